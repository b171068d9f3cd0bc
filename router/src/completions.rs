//! `POST /v1/completions`, `POST /v1/chat/completions` (streamed as SSE or not),
//! `GET /v1/models`, `GET /health`, `GET /config`, `GET /metrics`.

use crate::driver::{Driver, Step};
use crate::error::ApiError;
use crate::extract::{typed, ApiJson};
use crate::params::{self, ChatOnly, Common, CompletionOnly, Plan};
use crate::reply::{Call, ReplyParser};
use crate::trace::RequestId;
use crate::{chat, generation, AppState};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::StreamExt;
use pdserve_proto::pb::ScoredToken;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

/// Which API shape a response takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Completion,
    Chat,
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn prepare_completion(state: &AppState, body: &Value, rid: String) -> Result<Plan, ApiError> {
    params::refuse_unknown_fields(body, false)?;
    let c: Common = typed(body)?;
    params::check_model(state, &c.model)?;
    let only: CompletionOnly = typed(body)?;
    params::refuse_unsupported_completion(&only)?;
    let prompt = params::completion_prompt(state, &only.prompt)?;
    let max = c.max_tokens.map(|m| (m, "max_tokens"));
    let top = params::top_logprobs(&c, false)?;
    let echo = match only.echo {
        Some(true) if top.is_some() => {
            return Err(ApiError::invalid(
                "echo",
                "unsupported_parameter",
                "`echo` with `logprobs` would need the prompt's log-probabilities, which the workers do not compute",
            ))
        }
        Some(true) => Some(match &only.prompt {
            Value::String(s) => s.clone(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                a[0].as_str().unwrap_or_default().to_string()
            }
            _ => state
                .tokenizer
                .as_ref()
                .and_then(|t| t.decode(&prompt).ok())
                .unwrap_or_default(),
        }),
        _ => None,
    };
    let mut plan = params::plan(state, &c, prompt, max, Some(16), "prompt", rid)?;
    plan.job.top_logprobs = top;
    plan.echo = echo;
    Ok(plan)
}

fn prepare_chat(state: &AppState, body: &Value, rid: String) -> Result<Plan, ApiError> {
    params::refuse_unknown_fields(body, true)?;
    let c: Common = typed(body)?;
    params::check_model(state, &c.model)?;
    let only: ChatOnly = typed(body)?;
    if only.parallel_tool_calls == Some(false) {
        return Err(ApiError::invalid(
            "parallel_tool_calls",
            "unsupported_parameter",
            "`parallel_tool_calls: false` is not supported: every call the model writes is returned",
        ));
    }
    let top = params::top_logprobs(&c, true)?;
    let rendered = chat_prompt(state, body)?;
    let prompt = params::completion_prompt(state, &Value::String(rendered.text.clone()))
        .map_err(|e| e.param("messages"))?;
    let max = match (only.max_completion_tokens, c.max_tokens) {
        (Some(m), _) => Some((m, "max_completion_tokens")),
        (None, Some(m)) => Some((m, "max_tokens")),
        (None, None) => None,
    };
    let mut plan = params::plan(state, &c, prompt, max, None, "messages", rid)?;
    plan.job.top_logprobs = top;
    plan.reply = Some(crate::reply::Format {
        thinking: rendered.thinking,
        parse_tools: rendered.parse_tools,
        forced: rendered.forced,
    });
    Ok(plan)
}

/// The rendered prompt of a chat request (or a `/tokenize` body with `messages`).
pub(crate) fn chat_prompt(state: &AppState, body: &Value) -> Result<chat::Rendered, ApiError> {
    let Some(renderer) = state.settings.chat_renderer.as_deref() else {
        return Err(ApiError::invalid(
            "messages",
            "chat_template_missing",
            "this model has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json, no encoding/encoding_dsv4.py): start the router with --chat-template FILE or --chat-template deepseek-v4, or use /v1/completions",
        ));
    };
    chat::ChatInput::from_body(body, &state.settings.chat_template_kwargs)?.render(renderer)
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    ApiJson(body): ApiJson<Value>,
) -> Response {
    let t0 = Instant::now();
    match prepare_completion(&state, &body, rid.0.clone()) {
        Ok(plan) => run(state, plan, Api::Completion, rid.0, t0).await,
        Err(e) => refused(e),
    }
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    ApiJson(body): ApiJson<Value>,
) -> Response {
    let t0 = Instant::now();
    match prepare_chat(&state, &body, rid.0.clone()) {
        Ok(plan) => run(state, plan, Api::Chat, rid.0, t0).await,
        Err(e) => refused(e),
    }
}

fn refused(e: ApiError) -> Response {
    tracing::info!(status = e.status.as_u16(), param = ?e.param, error = %e.message, "request refused");
    e.into_response()
}

/// The fixed fields of every response object and chunk.
#[derive(Clone)]
struct Shape {
    api: Api,
    id: String,
    created: u64,
    model: String,
    /// Log-probabilities were asked for (else `"logprobs": null`).
    logprobs: bool,
    /// Completions with `echo`: the prompt text every choice starts with.
    echo: Option<String>,
    tokenizer: Option<Arc<pdserve_tokenizer::Tokenizer>>,
}

impl Shape {
    /// The `logprobs` of a choice or chunk covering `scored`; `offset`: completions'
    /// running text offset.
    fn logprobs(&self, scored: &[ScoredToken], offset: &mut usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let tok = self.tokenizer.as_deref();
        match self.api {
            Api::Completion => crate::logprobs::completion(tok, scored, offset),
            Api::Chat => crate::logprobs::chat(tok, scored),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Completion, _) => "text_completion",
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

async fn run(state: Arc<AppState>, plan: Plan, api: Api, rid: String, t0: Instant) -> Response {
    let jobs: Vec<generation::Job> = (0..plan.n).map(|i| plan.job.choice(i)).collect();
    let starts =
        futures::future::join_all(jobs.iter().map(|j| generation::start(state.clone(), j))).await;
    let mut drivers = Vec::with_capacity(starts.len());
    for s in starts {
        match s {
            Ok(s) => drivers.push(Driver::new(
                s,
                state.tokenizer.clone(),
                plan.stops.clone(),
                plan.job.prompt.len(),
                t0,
            )),
            Err(e) => {
                tracing::warn!(status = e.status.as_u16(), error = %e.message, "request failed before its first token");
                return e.into_response();
            }
        }
    }
    let shape = Shape {
        api,
        id: match api {
            Api::Completion => format!("cmpl-{rid}"),
            Api::Chat => format!("chatcmpl-{rid}"),
        },
        created: now(),
        model: state.settings.model_name.clone(),
        logprobs: plan.job.top_logprobs.is_some(),
        tokenizer: state.tokenizer.clone(),
        echo: plan.echo.clone(),
    };
    if plan.stream {
        stream(drivers, shape, plan.include_usage, plan.reply.as_ref()).into_response()
    } else {
        whole(drivers, shape, plan.reply.as_ref()).await
    }
}

/// `finish_reason`: `tool_calls` when the reply ended by itself after calling tools.
fn finish_reason(finish: String, parser: Option<&ReplyParser>) -> String {
    match parser {
        Some(p) if p.calls > 0 && finish == "stop" => "tool_calls".into(),
        _ => finish,
    }
}

/// OpenAI `tool_calls` entries (`index` added for stream deltas).
fn tool_calls(shape: &Shape, first: usize, calls: &[Call], indexed: bool) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "id": format!("call_{}_{}", shape.id, first + i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if indexed {
                v["index"] = json!(first + i);
            }
            v
        })
        .collect()
}

/// Every choice, then one response with all of them (`usage` counts the prompt once).
async fn whole(
    drivers: Vec<Driver>,
    shape: Shape,
    reply: Option<&crate::reply::Format>,
) -> Response {
    let prompt_tokens = drivers.first().map_or(0, |d| d.prompt_tokens);
    let results = futures::future::join_all(
        drivers
            .into_iter()
            .enumerate()
            .map(|(i, d)| choice(d, &shape, reply.map(ReplyParser::new), i)),
    )
    .await;
    let mut choices = Vec::with_capacity(results.len());
    let mut completion_tokens = 0;
    for r in results {
        match r {
            Ok((c, n)) => {
                choices.push(c);
                completion_tokens += n;
            }
            Err(e) => {
                tracing::warn!(error = %e.message, "request failed mid-generation");
                return e.into_response();
            }
        }
    }
    let mut body = shape.envelope(false, Value::Array(choices));
    body["usage"] = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    Json(body).into_response()
}

/// One whole choice and its completion token count.
async fn choice(
    mut d: Driver,
    shape: &Shape,
    mut parser: Option<ReplyParser>,
    index: usize,
) -> Result<(Value, usize), ApiError> {
    let mut text = String::new();
    let mut ids = Vec::new();
    let mut scored = Vec::new();
    let finish = loop {
        match d.next().await {
            Ok(Some(Step::Delta {
                text: t,
                ids: i,
                logprobs,
            })) => {
                text.push_str(&t);
                ids.extend(i);
                scored.extend(logprobs);
            }
            Ok(Some(Step::Done {
                text: t,
                ids: i,
                logprobs,
                finish,
            })) => {
                text.push_str(&t);
                ids.extend(i);
                scored.extend(logprobs);
                break finish;
            }
            Ok(None) => break d.finish.clone().unwrap_or_else(|| "length".into()),
            Err(e) => return Err(e),
        }
    };
    let logprobs = shape.logprobs(&scored, &mut 0);
    let choice = match (shape.api, parser.as_mut()) {
        (Api::Chat, Some(p)) => {
            let mut r = p.push(&text);
            let tail = p.finish();
            r.reasoning.push_str(&tail.reasoning);
            r.content.push_str(&tail.content);
            let mut message = json!({
                "role": "assistant",
                "content": if r.content.is_empty() && !r.calls.is_empty() { Value::Null } else { json!(r.content) },
                "reasoning_content": if r.reasoning.is_empty() { Value::Null } else { json!(r.reasoning) },
            });
            if !r.calls.is_empty() {
                message["tool_calls"] = json!(tool_calls(shape, 0, &r.calls, false));
            }
            json!({
                "index": index, "message": message, "token_ids": ids, "logprobs": logprobs,
                "finish_reason": finish_reason(finish, Some(p)),
            })
        }
        (Api::Chat, None) => json!({
            "index": index,
            "message": { "role": "assistant", "content": text },
            "token_ids": ids, "logprobs": logprobs, "finish_reason": finish,
        }),
        (Api::Completion, _) => json!({
            "index": index, "text": format!("{}{text}", shape.echo.as_deref().unwrap_or_default()), "token_ids": ids, "logprobs": logprobs, "finish_reason": finish,
        }),
    };
    Ok((choice, d.completion_tokens))
}

/// Token counts of a stream's choices, for its usage chunk.
#[derive(Default)]
struct Totals {
    prompt: AtomicUsize,
    completion: AtomicUsize,
    /// A choice ended with an error event: the stream ends there (no `[DONE]`).
    failed: AtomicBool,
}

struct StreamState {
    driver: Driver,
    shape: Shape,
    index: usize,
    totals: Arc<Totals>,
    include_usage: bool,
    /// The chat role chunk went out.
    role_sent: bool,
    /// Chat: the reply's reader; tool calls streamed so far are `parser.calls`.
    parser: Option<ReplyParser>,
    /// Token ids and log-probabilities not yet sent (their text is held back); they go
    /// out on the next chunk.
    pending_ids: Vec<u32>,
    pending_logprobs: Vec<ScoredToken>,
    /// Completions: text offset of the next token (logprobs' `text_offset`).
    offset: usize,
    over: bool,
    span: tracing::Span,
}

impl StreamState {
    /// A chunk's choice fields that carry the pending ids and log-probabilities.
    fn take_pending(&mut self) -> (Vec<u32>, Value) {
        let ids = std::mem::take(&mut self.pending_ids);
        let lp = std::mem::take(&mut self.pending_logprobs);
        let mut offset = self.offset;
        let logprobs = self.shape.logprobs(&lp, &mut offset);
        self.offset = offset;
        (ids, logprobs)
    }

    /// The chat chunks of `text` read through the reply parser (reasoning, content and
    /// tool-call deltas), the pending ids on the first.
    fn chat_chunks(&mut self, text: &str, last: bool) -> Vec<Event> {
        let Some(p) = self.parser.as_mut() else {
            return self.chunk(text, None).into_iter().collect();
        };
        let mut d = p.push(text);
        if last {
            let tail = p.finish();
            d.reasoning.push_str(&tail.reasoning);
            d.content.push_str(&tail.content);
        }
        let first_call = p.calls - d.calls.len();
        let mut deltas = Vec::new();
        if !d.reasoning.is_empty() {
            deltas.push(json!({ "reasoning_content": d.reasoning }));
        }
        if !d.content.is_empty() {
            deltas.push(json!({ "content": d.content }));
        }
        if !d.calls.is_empty() {
            deltas
                .push(json!({ "tool_calls": tool_calls(&self.shape, first_call, &d.calls, true) }));
        }
        deltas
            .into_iter()
            .map(|delta| {
                let (ids, logprobs) = self.take_pending();
                let choice = json!({
                    "index": self.index, "delta": delta, "token_ids": ids,
                    "logprobs": logprobs, "finish_reason": null,
                });
                self.event(choice)
            })
            .collect()
    }

    fn event(&self, choice: Value) -> Event {
        let mut c = self.shape.envelope(true, json!([choice]));
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        Event::default().data(c.to_string())
    }

    fn chunk(&mut self, text: &str, finish: Option<&str>) -> Option<Event> {
        if self.shape.api == Api::Chat && text.is_empty() && finish.is_none() {
            return None;
        }
        let (ids, logprobs) = self.take_pending();
        let choice = match self.shape.api {
            Api::Completion => json!({
                "index": self.index, "text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish,
            }),
            Api::Chat => {
                let delta = if text.is_empty() {
                    json!({})
                } else {
                    json!({ "content": text })
                };
                json!({
                    "index": self.index, "delta": delta, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish,
                })
            }
        };
        Some(self.event(choice))
    }

    fn role_chunk(&self) -> Event {
        self.event(json!({
            "index": self.index, "delta": { "role": "assistant", "content": "" },
            "logprobs": null, "finish_reason": null,
        }))
    }

    /// The events of the next step.
    async fn step(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        if let Some(echo) = self.shape.echo.take() {
            out.extend(self.chunk(&echo, None));
        }
        if self.shape.api == Api::Chat && !self.role_sent {
            self.role_sent = true;
            out.push(self.role_chunk());
        }
        match self.driver.next().await {
            Ok(Some(Step::Delta {
                text,
                ids,
                logprobs,
            })) => {
                self.pending_ids.extend(ids);
                self.pending_logprobs.extend(logprobs);
                if self.shape.api == Api::Chat {
                    out.extend(self.chat_chunks(&text, false));
                } else {
                    out.extend(self.chunk(&text, None));
                }
            }
            Ok(Some(Step::Done {
                text,
                ids,
                logprobs,
                finish,
            })) => {
                self.pending_ids.extend(ids);
                self.pending_logprobs.extend(logprobs);
                if self.shape.api == Api::Chat {
                    out.extend(self.chat_chunks(&text, true));
                    let finish = finish_reason(finish, self.parser.as_ref());
                    out.extend(self.chunk("", Some(&finish)));
                } else {
                    out.extend(self.chunk(&text, Some(&finish)));
                }
                self.totals
                    .prompt
                    .store(self.driver.prompt_tokens, Ordering::Relaxed);
                self.totals
                    .completion
                    .fetch_add(self.driver.completion_tokens, Ordering::Relaxed);
                self.over = true;
            }
            Ok(None) => self.over = true,
            Err(e) => {
                tracing::warn!(error = %e.message, "stream failed mid-generation");
                crate::metrics::stream_error();
                if !self.totals.failed.swap(true, Ordering::Relaxed) {
                    out.push(Event::default().event("error").data(e.body().to_string()));
                }
                self.over = true;
            }
        }
        out
    }
}

/// The SSE stream of every choice (interleaved as their tokens come), then the usage
/// chunk (when asked) and `[DONE]`; after an error event, nothing more.
fn stream(
    drivers: Vec<Driver>,
    shape: Shape,
    include_usage: bool,
    reply: Option<&crate::reply::Format>,
) -> impl IntoResponse {
    let totals = Arc::new(Totals::default());
    let envelope = shape.clone();
    let choices = drivers.into_iter().enumerate().map(|(index, driver)| {
        let st = StreamState {
            driver,
            shape: shape.clone(),
            index,
            totals: totals.clone(),
            include_usage,
            role_sent: false,
            parser: reply.map(ReplyParser::new),
            pending_ids: Vec::new(),
            pending_logprobs: Vec::new(),
            offset: 0,
            over: false,
            span: tracing::Span::current(),
        };
        Box::pin(futures::stream::unfold(st, |mut st| async move {
            if st.over || st.totals.failed.load(Ordering::Relaxed) {
                return None;
            }
            let span = st.span.clone();
            let out = st.step().instrument(span).await;
            Some((out, st))
        }))
    });
    let choices: Vec<_> = choices.collect();
    let tail = futures::stream::once(async move {
        if totals.failed.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let mut out = Vec::new();
        if include_usage {
            let (p, c) = (
                totals.prompt.load(Ordering::Relaxed),
                totals.completion.load(Ordering::Relaxed),
            );
            let mut u = envelope.envelope(true, json!([]));
            u["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
            out.push(Event::default().data(u.to_string()));
        }
        out.push(Event::default().data("[DONE]"));
        out
    });
    let events = futures::stream::select_all(choices)
        .chain(tail)
        .flat_map(|v| futures::stream::iter(v.into_iter().map(Ok::<_, std::convert::Infallible>)));
    Sse::new(events).keep_alive(KeepAlive::default())
}

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.settings.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
        "max_model_len": state.settings.context_length,
    })
}

pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "object": "list", "data": [model_card(&state)] }))
}

/// `GET /v1/models/{model}`: the served model, or 404 `model_not_found`.
pub async fn model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    match params::check_model(&state, &Some(name)) {
        Ok(()) => Json(model_card(&state)).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    let list = |ws: &[Arc<crate::Worker>]| {
        ws.iter()
            .map(|w| json!({ "addr": w.addr, "healthy": w.is_healthy() }))
            .collect::<Vec<_>>()
    };
    let (prefill, decode) = (state.workers.prefill(), state.workers.decode());
    let ok = prefill.iter().any(|x| x.is_healthy()) && decode.iter().any(|x| x.is_healthy());
    let all = prefill.iter().chain(&decode).all(|x| x.is_healthy());
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        code,
        Json(json!({
            "status": if all { "ok" } else if ok { "degraded" } else { "unavailable" },
            "prefill": list(&prefill),
            "decode": list(&decode),
        })),
    )
        .into_response()
}

pub async fn config(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(state.settings.config.clone())
}

/// Prometheus text format of every metric recorded in this process.
pub async fn metrics() -> Response {
    match crate::metrics::handle() {
        Ok(h) => {
            h.run_upkeep();
            (
                [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                h.render(),
            )
                .into_response()
        }
        Err(e) => ApiError::unavailable(e).into_response(),
    }
}

/// Unknown paths get an OpenAI-shaped 404.
pub async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::not_found(format!("no route for {}", uri.path()))
        .code("unknown_url")
        .into_response()
}

/// A known path with the wrong method gets an OpenAI-shaped 405.
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    ApiError::with_status(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
    .code("method_not_allowed")
    .into_response()
}
