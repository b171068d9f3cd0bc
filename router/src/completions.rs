//! `POST /v1/completions`, `POST /v1/chat/completions` (whole here, streamed in sse.rs),
//! `GET /v1/models`, `GET /health`, `GET /config`, `GET /metrics`.

use crate::driver::{Driver, Step};
use crate::error::ApiError;
use crate::extract::{typed, ApiJson};
use crate::params::{self, ChatOnly, Common, CompletionOnly, Plan};
use crate::reply::ReplyParser;
use crate::shape::{finish_reason, tool_calls, Api, Shape};
use crate::trace::RequestId;
use crate::{chat, generation, structured, AppState};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

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
    let prompt = params::completion_prompt(state, &only.prompt, true)?;
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
    let grammar = structured::one_of(vec![
        structured::from_response_format(only.response_format.as_ref())?,
        structured::from_structured_outputs(c.structured_outputs.as_ref())?,
    ])?;
    plan.job.processing.grammar = grammar
        .map(|g| structured::checked(state, &g))
        .transpose()?;
    Ok(plan)
}

fn prepare_chat(state: &AppState, body: &Value, rid: String) -> Result<Plan, ApiError> {
    params::refuse_unknown_fields(body, true)?;
    let c: Common = typed(body)?;
    params::check_model(state, &c.model)?;
    let only: ChatOnly = typed(body)?;
    let top = params::top_logprobs(&c, true)?;
    let renderer = renderer(state)?;
    let input = chat::ChatInput::from_body(body, &state.settings.chat_template_kwargs)?;
    let rendered = input.render(renderer)?;
    let prompt = params::completion_prompt(state, &Value::String(rendered.text.clone()), false)
        .map_err(|e| e.param("messages"))?;
    let max = match (only.max_completion_tokens, c.max_tokens) {
        (Some(m), _) => Some((m, "max_completion_tokens")),
        (None, Some(m)) => Some((m, "max_tokens")),
        (None, None) => None,
    };
    let mut plan = params::plan(state, &c, prompt, max, None, "messages", rid)?;
    plan.job.top_logprobs = top;
    let single = only.parallel_tool_calls == Some(false);
    if single
        && matches!(
            input.tool_choice,
            chat::ToolChoice::Auto | chat::ToolChoice::None
        )
    {
        return Err(ApiError::invalid(
            "parallel_tool_calls",
            "unsupported_parameter",
            "`parallel_tool_calls: false` needs `tool_choice` required or a named function (a grammar then allows one call); with auto every call the model writes is returned",
        ));
    }
    let tool_call = chat::tool_grammar::tool_call_grammar(&input.tools, &input.tool_choice, single)
        .map(|grammar| structured::Requested {
            grammar,
            param: "tool_choice".into(),
        });
    let grammar = structured::one_of(vec![
        tool_call,
        structured::from_response_format(body.get("response_format"))?,
        structured::from_structured_outputs(c.structured_outputs.as_ref())?,
    ])?;
    plan.job.processing.grammar = grammar
        .map(|g| structured::checked(state, &g))
        .transpose()?;
    plan.reply = Some(crate::reply::Format {
        thinking: rendered.thinking,
        parse_tools: rendered.parse_tools,
        forced: rendered.forced,
    });
    Ok(plan)
}

/// The rendered prompt of a chat request (or a `/tokenize` body with `messages`).
pub(crate) fn chat_prompt(state: &AppState, body: &Value) -> Result<chat::Rendered, ApiError> {
    let renderer = renderer(state)?;
    chat::ChatInput::from_body(body, &state.settings.chat_template_kwargs)?.render(renderer)
}

/// The model's chat renderer, or the 400 of a model without one.
fn renderer(state: &AppState) -> Result<&chat::Renderer, ApiError> {
    state.settings.chat_renderer.as_deref().ok_or_else(|| {
        ApiError::invalid(
            "messages",
            "chat_template_missing",
            "this model has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json, no encoding/encoding_dsv4.py): start the router with --chat-template FILE or --chat-template deepseek-v4, or use /v1/completions",
        )
    })
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    ApiJson(body): ApiJson<Value>,
) -> Response {
    let t0 = Instant::now();
    let (st, r) = (state.clone(), rid.0.clone());
    match state
        .tokenizers
        .run(move || prepare_completion(&st, &body, r))
        .await
    {
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
    let (st, r) = (state.clone(), rid.0.clone());
    match state
        .tokenizers
        .run(move || prepare_chat(&st, &body, r))
        .await
    {
        Ok(plan) => run(state, plan, Api::Chat, rid.0, t0).await,
        Err(e) => refused(e),
    }
}

fn refused(e: ApiError) -> Response {
    tracing::info!(status = e.status.as_u16(), param = ?e.param, error = %e.message, "request refused");
    e.into_response()
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
                plan.job.processing.min_tokens as usize,
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
        model: state.settings.model.primary().to_string(),
        logprobs: plan.job.top_logprobs.is_some(),
        tokenizer: state.tokenizer.clone(),
        echo: plan.echo.clone(),
    };
    if plan.stream {
        crate::sse::stream(drivers, shape, plan.include_usage, plan.reply.as_ref()).into_response()
    } else {
        whole(drivers, shape, plan.reply.as_ref()).await
    }
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

fn model_card(state: &AppState, id: &str) -> Value {
    json!({
        "id": id, "object": "model", "created": 0, "owned_by": "pdserve",
        "max_model_len": state.settings.context_length,
    })
}

/// `GET /v1/models`: one card per served name.
pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let data: Vec<Value> = state
        .settings
        .model
        .listed()
        .into_iter()
        .map(|id| model_card(&state, id))
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

/// `GET /v1/models/{model}`: the card under the name asked for (any served name or the
/// folder's), or 404 `model_not_found`.
pub async fn model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    match params::check_model(&state, &Some(name.clone())) {
        Ok(()) => Json(model_card(&state, &name)).into_response(),
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
