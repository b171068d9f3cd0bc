//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes. `/tokenize` takes `prompt`
//! (with `add_special_tokens`, default true: the BOS a completion of that text gets, as
//! the tokenizer config says) or `messages` with every chat rendering field
//! (`tools`, `tool_choice`, `chat_template_kwargs`, `reasoning_effort`,
//! `add_generation_prompt`), and answers `{"tokens", "count", "max_model_len"}`; the ids
//! are exactly what a chat completion of the same body prefills (one code path renders
//! both). `/detokenize` takes `{"tokens": [...]}` and answers `{"prompt": text}`.

use crate::completions::chat_prompt;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::{params, AppState};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

const TOKENIZE_FIELDS: [&str; 9] = [
    "model",
    "prompt",
    "add_special_tokens",
    "messages",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "reasoning_effort",
    "add_generation_prompt",
];

fn refuse_unknown(body: &Value, known: &[&str]) -> Result<(), ApiError> {
    match body
        .as_object()
        .and_then(|o| o.keys().find(|k| !known.contains(&k.as_str())))
    {
        Some(k) => Err(ApiError::invalid(
            k,
            "unsupported_parameter",
            format!("`{k}` is not a field of this endpoint (accepted: {known:?})"),
        )),
        None => Ok(()),
    }
}

fn model(state: &AppState, body: &Value) -> Result<(), ApiError> {
    let m = body
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string);
    params::check_model(state, &m)
}

fn tokenize_ids(state: &AppState, body: &Value) -> Result<Vec<u32>, ApiError> {
    refuse_unknown(body, &TOKENIZE_FIELDS)?;
    model(state, body)?;
    match (body.get("prompt"), body.get("messages")) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "messages",
            "invalid_value",
            "send either `prompt` or `messages`, not both",
        )),
        (Some(p), None) => {
            let special = match body.get("add_special_tokens") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(x) => {
                    return Err(ApiError::invalid(
                        "add_special_tokens",
                        "invalid_type",
                        format!("`add_special_tokens` must be a boolean, got {x}"),
                    ))
                }
            };
            params::completion_prompt(state, p, special)
        }
        (None, Some(_)) => {
            let text = chat_prompt(state, body)?.text;
            params::completion_prompt(state, &Value::String(text), false)
                .map_err(|e| e.param("messages"))
        }
        (None, None) => Err(ApiError::invalid(
            "prompt",
            "missing_required_parameter",
            "send `prompt` or `messages`",
        )),
    }
}

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    ApiJson(body): ApiJson<Value>,
) -> Response {
    match tokenize_ids(&state, &body) {
        Ok(ids) => Json(json!({
            "tokens": ids, "count": ids.len(), "max_model_len": state.settings.context_length,
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

fn detokenize_text(state: &AppState, body: &Value) -> Result<String, ApiError> {
    refuse_unknown(body, &["model", "tokens"])?;
    model(state, body)?;
    let tokens = match body.get("tokens") {
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::invalid(
                "tokens",
                "invalid_type",
                "`tokens` must be a list of token ids",
            ))
        }
        None => {
            return Err(ApiError::invalid(
                "tokens",
                "missing_required_parameter",
                "missing required parameter `tokens`",
            ))
        }
    };
    let ids = params::token_ids(state, tokens, "tokens")?;
    let Some(tok) = &state.tokenizer else {
        return Err(ApiError::invalid(
            "tokens",
            "invalid_value",
            "this model has no tokenizer",
        ));
    };
    tok.decode(&ids)
        .map_err(|e| ApiError::invalid("tokens", "invalid_value", e.to_string()))
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    ApiJson(body): ApiJson<Value>,
) -> Response {
    match detokenize_text(&state, &body) {
        Ok(text) => Json(json!({ "prompt": text })).into_response(),
        Err(e) => e.into_response(),
    }
}
