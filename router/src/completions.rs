//! `POST /v1/completions`, `GET /v1/models`, `GET /health`, `GET /config`.

use crate::detok::Detok;
use crate::error::ApiError;
use crate::generation::{self, Job, Next, Started};
use crate::AppState;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use pdserve_proto::pb;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;

/// A prompt: text, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Batch(Vec<serde_json::Value>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// OpenAI's default is 1.0; 0 is greedy.
    #[serde(default = "one")]
    pub temperature: f32,
    #[serde(default = "one")]
    pub top_p: f32,
    /// Extension: 0 disables.
    #[serde(default)]
    pub top_k: u32,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    /// Extension: do not stop at the model's end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub stop: Option<serde_json::Value>,
}

fn default_max_tokens() -> u32 {
    16
}

fn one() -> f32 {
    1.0
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128)
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()))
}

fn job(state: &AppState, req: &CompletionRequest, request_id: String) -> Result<Job, ApiError> {
    if let Some(m) = &req.model {
        if *m != state.settings.model_name {
            return Err(ApiError::not_found(format!(
                "model `{m}` is not served here; this router serves `{}`",
                state.settings.model_name
            )));
        }
    }
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only n = 1 is supported"));
    }
    if req.stop.as_ref().is_some_and(|s| !s.is_null()) {
        return Err(ApiError::bad_request(
            "`stop` sequences are not supported yet; use max_tokens or the model's end token",
        ));
    }
    if req.max_tokens == 0 {
        return Err(ApiError::bad_request("max_tokens must be at least 1"));
    }
    let prompt = match &req.prompt {
        Prompt::Tokens(t) => t.clone(),
        Prompt::Text(s) => match &state.tokenizer {
            Some(tok) => tok
                .encode(s)
                .map_err(|e| ApiError::bad_request(e.to_string()))?,
            None => {
                return Err(ApiError::bad_request(
                    "this model has no tokenizer: send the prompt as token ids",
                ))
            }
        },
        Prompt::Batch(b) => {
            return Err(ApiError::bad_request(format!(
                "one prompt per request (a string or an array of token ids), got an array of {} prompts",
                b.len()
            )))
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    Ok(Job {
        request_id,
        prompt,
        sampling: pb::SamplingParams {
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            seed: req.seed.unwrap_or(0),
        },
        max_new_tokens: req.max_tokens,
        stop_tokens: if req.ignore_eos {
            Vec::new()
        } else {
            state.settings.eos_token_ids.clone()
        },
    })
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Json<CompletionRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return ApiError::bad_request(e.body_text()).into_response(),
    };
    let rid = request_id(&headers);
    let job = match job(&state, &req, rid.clone()) {
        Ok(j) => j,
        Err(e) => return e.into_response(),
    };
    let started = match generation::start(state.clone(), &job).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(request_id = %rid, error = %e.message, "request failed before its first token");
            return e.into_response();
        }
    };
    let prompt_tokens = job.prompt.len();
    if req.stream {
        stream_response(state, started, rid, prompt_tokens).into_response()
    } else {
        full_response(state, started, rid, prompt_tokens).await
    }
}

fn choice(text: String, ids: Vec<u32>, finish: Option<&str>) -> serde_json::Value {
    json!({ "index": 0, "text": text, "token_ids": ids, "logprobs": null, "finish_reason": finish })
}

fn usage(prompt: usize, completion: usize) -> serde_json::Value {
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}

async fn full_response(
    state: Arc<AppState>,
    mut s: Started,
    rid: String,
    prompt_tokens: usize,
) -> Response {
    let mut detok = Detok::new(state.tokenizer.as_deref());
    let mut text = String::new();
    let mut next = Some(std::mem::replace(&mut s.first, Next::Token(0)));
    let finish = loop {
        let ev = match next.take() {
            Some(e) => e,
            None => match s.next().await {
                Ok(Some(e)) => e,
                Ok(None) => break "length".to_string(),
                Err(e) => {
                    tracing::warn!(request_id = %rid, error = %e.message, "request failed mid-generation");
                    return e.into_response();
                }
            },
        };
        match ev {
            Next::Token(t) => text.push_str(&detok.push(t)),
            Next::Finished(f) => break f.reason,
        }
    };
    text.push_str(&detok.finish());
    let n = detok.ids().len();
    tracing::info!(request_id = %rid, completion_tokens = n, finish = %finish, "completed");
    Json(json!({
        "id": format!("cmpl-{rid}"),
        "object": "text_completion",
        "created": now(),
        "model": state.settings.model_name,
        "choices": [choice(text, detok.ids().to_vec(), Some(&finish))],
        "usage": usage(prompt_tokens, n),
    }))
    .into_response()
}

struct StreamState {
    state: Arc<AppState>,
    started: Started,
    rid: String,
    prompt_tokens: usize,
    ids: Vec<u32>,
    pending: Option<Next>,
    done: bool,
    created: u64,
}

fn stream_response(
    state: Arc<AppState>,
    mut started: Started,
    rid: String,
    prompt_tokens: usize,
) -> impl IntoResponse {
    let first = std::mem::replace(&mut started.first, Next::Token(0));
    let st = StreamState {
        state,
        started,
        rid,
        prompt_tokens,
        ids: Vec::new(),
        pending: Some(first),
        done: false,
        created: now(),
    };
    let events = futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let ev = match st.pending.take() {
            Some(e) => Ok(e),
            None => st.started.next().await.and_then(|e| {
                e.ok_or_else(|| ApiError::unavailable("decode stream ended without finishing"))
            }),
        };
        let out = match ev {
            Err(e) => {
                tracing::warn!(request_id = %st.rid, error = %e.message, "stream failed mid-generation");
                st.done = true;
                vec![Event::default().event("error").data(e.body().to_string())]
            }
            Ok(Next::Token(t)) => {
                st.ids.push(t);
                let text = incremental_text(&st.state, &st.ids);
                vec![chunk(&st, text, vec![t], None)]
            }
            Ok(Next::Finished(f)) => {
                st.done = true;
                tracing::info!(request_id = %st.rid, completion_tokens = st.ids.len(), finish = %f.reason, "completed");
                let mut c = chunk_json(&st, String::new(), Vec::new(), Some(&f.reason));
                c["usage"] = usage(st.prompt_tokens, st.ids.len());
                vec![
                    Event::default().data(c.to_string()),
                    Event::default().data("[DONE]"),
                ]
            }
        };
        Some((out, st))
    })
    .flat_map(|v| futures::stream::iter(v.into_iter().map(Ok::<_, std::convert::Infallible>)));
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// Text added by the last id of `ids` (whole-sequence decode, incomplete characters held).
fn incremental_text(state: &AppState, ids: &[u32]) -> String {
    let Some(tok) = state.tokenizer.as_deref() else {
        return String::new();
    };
    let prev = tok.decode(&ids[..ids.len() - 1]).unwrap_or_default();
    let now = tok.decode(ids).unwrap_or_default();
    if now.ends_with('\u{FFFD}') || !now.starts_with(prev.trim_end_matches('\u{FFFD}')) {
        return String::new();
    }
    let base = prev.trim_end_matches('\u{FFFD}').len();
    now.get(base..).unwrap_or_default().to_string()
}

fn chunk_json(
    st: &StreamState,
    text: String,
    ids: Vec<u32>,
    finish: Option<&str>,
) -> serde_json::Value {
    json!({
        "id": format!("cmpl-{}", st.rid),
        "object": "text_completion",
        "created": st.created,
        "model": st.state.settings.model_name,
        "choices": [choice(text, ids, finish)],
    })
}

fn chunk(st: &StreamState, text: String, ids: Vec<u32>, finish: Option<&str>) -> Event {
    Event::default().data(chunk_json(st, text, ids, finish).to_string())
}

pub async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": state.settings.model_name, "object": "model", "created": 0, "owned_by": "pdserve" }],
    }))
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

pub async fn config(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(state.settings.config.clone())
}
