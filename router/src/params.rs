//! Request bodies of `/v1/completions` and `/v1/chat/completions` and their validation
//! into a [`Plan`]: the worker job plus what the router itself does (stop strings, SSE
//! options). Every refusal names the field (`param`) and says what is accepted.

use crate::error::ApiError;
use crate::generation::{Job, Processing};
use crate::AppState;
use pdserve_proto::pb;
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;

/// At most this many choices per request (`n`).
pub const MAX_N: i64 = 16;

/// At most this many stop strings per request.
pub const MAX_STOPS: usize = 16;

/// Fields both endpoints share.
#[derive(Debug, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extension: keep the k most likely tokens; 0 or -1 disables.
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    /// Extension: token ids that end generation (like the model's end token).
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Extension: do not stop at the model's end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// Extension (vLLM/SGLang): keep tokens at least `min_p` times as likely as the best.
    pub min_p: Option<f64>,
    pub logit_bias: Option<Value>,
    /// Extension (vLLM): the stop tokens cannot end the reply before this many tokens.
    pub min_tokens: Option<i64>,
    /// Extension (vLLM/HF): > 1 discourages every token of the prompt and the reply.
    pub repetition_penalty: Option<f64>,
    /// Extension (vLLM): `{json | regex | choice | grammar | json_object}`.
    pub structured_outputs: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields only `/v1/completions` has.
#[derive(Debug, Deserialize)]
pub struct CompletionOnly {
    pub prompt: Value,
    pub echo: Option<bool>,
    pub suffix: Option<Value>,
    pub best_of: Option<i64>,
    /// A chat-only field, refused here rather than ignored.
    pub tools: Option<Value>,
    pub response_format: Option<Value>,
}

/// Fields only `/v1/chat/completions` has (the rendering fields are read by
/// [`crate::chat::ChatInput::from_body`]).
#[derive(Debug, Deserialize)]
pub struct ChatOnly {
    pub max_completion_tokens: Option<i64>,
    pub parallel_tool_calls: Option<bool>,
}

/// Request fields both endpoints read.
const COMMON_FIELDS: [&str; 22] = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "logit_bias",
    "min_tokens",
    "repetition_penalty",
    "structured_outputs",
    // Accepted and ignored (an end-user id for abuse tracking; nothing here uses it).
    "user",
];

/// Fields only `/v1/completions` reads.
const COMPLETION_FIELDS: [&str; 5] = ["prompt", "echo", "suffix", "best_of", "response_format"];

/// Fields only `/v1/chat/completions` reads.
const CHAT_FIELDS: [&str; 9] = [
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
    "reasoning_effort",
    "add_generation_prompt",
];

/// Refuse every field this endpoint does not read (nothing is silently ignored except
/// [`IGNORED_FIELDS`]).
pub fn refuse_unknown_fields(body: &Value, chat: bool) -> Result<(), ApiError> {
    let only: &[&str] = if chat {
        &CHAT_FIELDS
    } else {
        &COMPLETION_FIELDS
    };
    let Some(o) = body.as_object() else {
        return Ok(());
    };
    match o
        .keys()
        .find(|k| !COMMON_FIELDS.contains(&k.as_str()) && !only.contains(&k.as_str()))
    {
        Some(k) => Err(unsupported(
            k,
            "this endpoint does not know the field (see the README's API section for every accepted one)",
        )),
        None => Ok(()),
    }
}

/// A validated request.
#[derive(Debug)]
pub struct Plan {
    pub job: Job,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices to generate (`n`); each is its own generation sharing the prompt.
    pub n: usize,
    /// Completions with `echo`: the prompt text each choice's text starts with.
    pub echo: Option<String>,
    /// Chat: how the reply is read (reasoning, tool calls).
    pub reply: Option<crate::reply::Format>,
}

fn unsupported(param: &str, what: &str) -> ApiError {
    ApiError::invalid(
        param,
        "unsupported_parameter",
        format!("`{param}` is not supported by this server: {what}"),
    )
}

/// Refuse parameters this server cannot honour instead of silently ignoring them.
fn refuse_unsupported(c: &Common) -> Result<(), ApiError> {
    for (p, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if v.is_some_and(|x| !(-2.0..=2.0).contains(&x)) {
            return Err(ApiError::invalid(
                p,
                "invalid_value",
                format!("`{p}` must be in [-2, 2], got {}", v.unwrap_or_default()),
            ));
        }
    }
    if c.min_p.is_some_and(|x| !(0.0..=1.0).contains(&x)) {
        return Err(ApiError::invalid(
            "min_p",
            "invalid_value",
            format!(
                "`min_p` must be in [0, 1], got {}",
                c.min_p.unwrap_or_default()
            ),
        ));
    }
    if let Some(p) = c
        .repetition_penalty
        .filter(|&p| !(p.is_finite() && p > 0.0))
    {
        return Err(ApiError::invalid(
            "repetition_penalty",
            "invalid_value",
            format!("`repetition_penalty` must be > 0 (1 disables), got {p}"),
        ));
    }
    Ok(())
}

/// OpenAI's `logit_bias`: token ids (as strings) to biases in [-100, 100].
fn logit_bias(v: &Option<Value>, vocab: usize) -> Result<HashMap<u32, f32>, ApiError> {
    let o = match v {
        None | Some(Value::Null) => return Ok(HashMap::new()),
        Some(Value::Object(o)) => o,
        Some(x) => {
            return Err(ApiError::invalid(
                "logit_bias",
                "invalid_type",
                format!("`logit_bias` must be an object of token id to bias, got {x}"),
            ))
        }
    };
    o.iter()
        .map(|(k, b)| {
            let t = k
                .parse::<u32>()
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        "invalid_value",
                        format!("`logit_bias` keys are token ids in 0..{vocab}, got {k:?}"),
                    )
                })?;
            let b = b
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        "invalid_value",
                        format!("`logit_bias` values are numbers in [-100, 100], got {b} for {k}"),
                    )
                })?;
            Ok((t, b as f32))
        })
        .collect()
}

/// `logprobs` / `top_logprobs`: how many alternatives each token comes with, or None
/// when log-probabilities are not asked for. Completions: `logprobs` is that number;
/// chat: `logprobs: true` turns them on and `top_logprobs` is the number.
pub fn top_logprobs(c: &Common, chat: bool) -> Result<Option<u32>, ApiError> {
    let max = pdserve_proto::MAX_TOP_LOGPROBS;
    let count = |v: &Value, param: &str| -> Result<u32, ApiError> {
        v.as_u64()
            .filter(|&n| n <= u64::from(max))
            .map(|n| n as u32)
            .ok_or_else(|| {
                ApiError::invalid(
                    param,
                    "invalid_value",
                    format!("`{param}` must be an integer in 0..={max}, got {v}"),
                )
            })
    };
    let top = c.top_logprobs.as_ref().filter(|v| !v.is_null());
    if !chat {
        if top.is_some() {
            return Err(unsupported(
                "top_logprobs",
                "completions take the number of alternatives in `logprobs`",
            ));
        }
        return match c.logprobs.as_ref().filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => count(v, "logprobs").map(Some),
        };
    }
    let on = match c.logprobs.as_ref() {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => {
            return Err(ApiError::invalid(
                "logprobs",
                "invalid_type",
                format!("chat `logprobs` is a boolean, got {v}"),
            ))
        }
    };
    match (on, top) {
        (false, Some(_)) => Err(ApiError::invalid(
            "top_logprobs",
            "invalid_value",
            "`top_logprobs` needs `logprobs: true`",
        )),
        (false, None) => Ok(None),
        (true, None) => Ok(Some(0)),
        (true, Some(v)) => count(v, "top_logprobs").map(Some),
    }
}

/// Whether a request gave a field a value (null and false count as absent).
fn is_set(v: &Option<Value>) -> bool {
    !matches!(v, None | Some(Value::Null) | Some(Value::Bool(false)))
}

pub fn refuse_unsupported_completion(c: &CompletionOnly) -> Result<(), ApiError> {
    if c.suffix.as_ref().is_some_and(|s| !s.is_null() && s != "") {
        return Err(unsupported(
            "suffix",
            "insertion (suffix) is not implemented",
        ));
    }
    if c.best_of.is_some_and(|b| b != 1) {
        return Err(unsupported("best_of", "only best_of = 1"));
    }
    if is_set(&c.tools) {
        return Err(unsupported(
            "tools",
            "it belongs to /v1/chat/completions, not /v1/completions",
        ));
    }
    Ok(())
}

/// The model name a request asks for must be a served one or the folder's (404 otherwise).
pub fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    let served = &state.settings.model;
    match model {
        Some(m) if !served.accepts(m) => Err(ApiError::not_found(format!(
            "the model `{m}` does not exist; this router serves `{}`",
            served.listed().join("`, `")
        ))
        .param("model")
        .code("model_not_found")),
        _ => Ok(()),
    }
}

/// `stop`: null, a string, or a list of up to [`MAX_STOPS`] non-empty strings.
fn stops(v: &Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = |msg: String| ApiError::invalid("stop", "invalid_value", msg);
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(format!("`stop` entries must be strings, got {x}")))
            })
            .collect::<Result<_, _>>()?,
        Some(x) => {
            return Err(ApiError::invalid(
                "stop",
                "invalid_type",
                format!("`stop` must be a string or a list of strings, got {x}"),
            ))
        }
    };
    if list.len() > MAX_STOPS {
        return Err(bad(format!(
            "at most {MAX_STOPS} stop strings, got {}",
            list.len()
        )));
    }
    if list.iter().any(String::is_empty) {
        return Err(bad("stop strings must not be empty".into()));
    }
    Ok(list)
}

/// `text`'s ids; with `special`, begun as the tokenizer config says (a completion's
/// text prompt; a rendered chat template writes its own BOS).
fn tokenize(
    state: &AppState,
    text: &str,
    param: &str,
    special: bool,
) -> Result<Vec<u32>, ApiError> {
    if text.len() > state.prompt_bytes_limit {
        return Err(ApiError::invalid(
            param,
            "context_length_exceeded",
            format!(
                "the prompt has {} bytes; no tokenization of more than {} bytes fits the context of {} tokens",
                text.len(),
                state.prompt_bytes_limit,
                state.settings.context_length
            ),
        ));
    }
    match &state.tokenizer {
        Some(t) => if special {
            t.encode_prompt(text)
        } else {
            t.encode(text)
        }
        .map_err(|e| ApiError::invalid(param, "invalid_value", e.to_string())),
        None => Err(ApiError::invalid(
            param,
            "invalid_value",
            "this model has no tokenizer: send the prompt as token ids",
        )),
    }
}

pub fn token_ids(state: &AppState, a: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    let vocab = state.settings.vocab_size;
    a.iter()
        .map(|x| {
            x.as_u64()
                .filter(|&t| (t as usize) < vocab)
                .map(|t| t as u32)
                .ok_or_else(|| {
                    ApiError::invalid(
                        param,
                        "invalid_value",
                        format!("token ids must be integers in 0..{vocab}, got {x}"),
                    )
                })
        })
        .collect()
}

/// `prompt`: a string, token ids, or a list holding exactly one of those. A string gets
/// the tokenizer's special tokens (BOS) with `special`; token ids are taken as they are.
pub fn completion_prompt(state: &AppState, v: &Value, special: bool) -> Result<Vec<u32>, ApiError> {
    let ids = match v {
        Value::String(s) => tokenize(state, s, "prompt", special)?,
        Value::Array(a) if a.iter().all(Value::is_number) => token_ids(state, a, "prompt")?,
        Value::Array(a) if a.len() == 1 => return completion_prompt(state, &a[0], special),
        Value::Array(a) if a.iter().all(|x| x.is_string() || x.is_array()) => {
            return Err(ApiError::invalid(
                "prompt",
                "invalid_value",
                format!(
                    "one prompt per request (a string or an array of token ids), got a batch of {}",
                    a.len()
                ),
            ))
        }
        x => {
            return Err(ApiError::invalid(
                "prompt",
                "invalid_type",
                format!("`prompt` must be a string or an array of token ids, got {x}"),
            ))
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "invalid_value",
            "the prompt is empty",
        ));
    }
    Ok(ids)
}

/// Validate the shared fields against a tokenized prompt and build the plan.
/// `max_tokens`: the request's (with its field name), or None for `default_max`
/// (None there: whatever context is left).
pub fn plan(
    state: &AppState,
    c: &Common,
    prompt: Vec<u32>,
    max_tokens: Option<(i64, &str)>,
    default_max: Option<u32>,
    prompt_param: &str,
    request_id: String,
) -> Result<Plan, ApiError> {
    refuse_unsupported(c)?;
    let n = match c.n.unwrap_or(1) {
        n @ 1..=MAX_N => n as usize,
        n => {
            return Err(ApiError::invalid(
                "n",
                "invalid_value",
                format!("n must be in 1..={MAX_N}, got {n}"),
            ))
        }
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            "invalid_value",
            format!("temperature must be in [0, 2], got {temperature}"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            "invalid_value",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match c.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        k => {
            return Err(ApiError::invalid(
                "top_k",
                "invalid_value",
                format!("top_k must be >= 1, or 0 / -1 to disable, got {k}"),
            ))
        }
    };
    let stops = stops(&c.stop)?;
    if !stops.is_empty() && state.tokenizer.is_none() {
        return Err(ApiError::invalid(
            "stop",
            "unsupported_parameter",
            "this model has no tokenizer, so stop strings cannot be matched; use stop_token_ids",
        ));
    }
    let vocab = state.settings.vocab_size;
    let mut stop_tokens = c.stop_token_ids.clone().unwrap_or_default();
    if let Some(t) = stop_tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            "stop_token_ids",
            "invalid_value",
            format!("token id {t} is outside the vocabulary (0..{vocab})"),
        ));
    }
    if !c.ignore_eos.unwrap_or(false) {
        stop_tokens.extend(&state.settings.eos_token_ids);
    }
    let ctx = state.settings.context_length;
    let max_new = match max_tokens {
        Some((m, param)) => {
            if m < 1 {
                return Err(ApiError::invalid(
                    param,
                    "invalid_value",
                    format!("`{param}` must be at least 1, got {m}"),
                ));
            }
            if m as u64 > ctx as u64 {
                return Err(ApiError::invalid(
                    param,
                    "invalid_value",
                    format!("`{param}` must be at most the model's context length {ctx}, got {m}"),
                ));
            }
            m as usize
        }
        None => match default_max {
            Some(d) => d as usize,
            None => ctx.saturating_sub(prompt.len()).max(1),
        },
    };
    if prompt.len() + max_new > ctx {
        return Err(ApiError::invalid(
            prompt_param,
            "context_length_exceeded",
            format!(
                "this model's maximum context length is {ctx} tokens, but {} were requested ({} in the prompt + {max_new} to generate); shorten the prompt or lower max_tokens",
                prompt.len() + max_new,
                prompt.len()
            ),
        ));
    }
    let min_tokens = match c.min_tokens.unwrap_or(0) {
        m if m >= 0 && m as u64 <= max_new as u64 => m as u32,
        m => {
            return Err(ApiError::invalid(
                "min_tokens",
                "invalid_value",
                format!("`min_tokens` must be in 0..=max_tokens ({max_new}), got {m}"),
            ))
        }
    };
    let processing = Processing {
        grammar: None,
        min_tokens,
        logit_bias: logit_bias(&c.logit_bias, vocab)?,
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0) as f32,
    };
    let include_usage = c
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    Ok(Plan {
        job: Job {
            request_id,
            prompt,
            sampling: pb::SamplingParams {
                temperature: temperature as f32,
                top_p: top_p as f32,
                top_k,
                seed: c.seed.map_or_else(rand::random::<u64>, |s| s as u64),
                min_p: c.min_p.unwrap_or(0.0) as f32,
                presence_penalty: c.presence_penalty.unwrap_or(0.0) as f32,
                frequency_penalty: c.frequency_penalty.unwrap_or(0.0) as f32,
                resumed_tokens: 0,
            },
            max_new_tokens: max_new as u32,
            stop_tokens,
            top_logprobs: None,
            processing,
        },
        stops,
        stream: c.stream.unwrap_or(false),
        include_usage,
        n,
        echo: None,
        reply: None,
    })
}
