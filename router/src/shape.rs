//! The shape of a response: which API it answers, the fields every object and chunk
//! carries, and the pieces whole and streamed responses share (finish reasons, tool-call
//! entries, log-probabilities).

use crate::reply::{Call, ReplyParser};
use pdserve_proto::pb::ScoredToken;
use serde_json::{json, Value};
use std::sync::Arc;

/// Which API shape a response takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    Completion,
    Chat,
}

/// The fixed fields of every response object and chunk.
#[derive(Clone)]
pub(crate) struct Shape {
    pub(crate) api: Api,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    /// Log-probabilities were asked for (else `"logprobs": null`).
    pub(crate) logprobs: bool,
    /// Completions with `echo`: the prompt text every choice starts with.
    pub(crate) echo: Option<String>,
    pub(crate) tokenizer: Option<Arc<pdserve_tokenizer::Tokenizer>>,
}

impl Shape {
    /// The `logprobs` of a choice or chunk covering `scored`; `offset`: completions'
    /// running text offset.
    pub(crate) fn logprobs(&self, scored: &[ScoredToken], offset: &mut usize) -> Value {
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

    pub(crate) fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

/// `finish_reason`: `tool_calls` when the reply ended by itself after calling tools.
pub(crate) fn finish_reason(finish: String, parser: Option<&ReplyParser>) -> String {
    match parser {
        Some(p) if p.calls > 0 && finish == "stop" => "tool_calls".into(),
        _ => finish,
    }
}

/// OpenAI `tool_calls` entries (`index` added for stream deltas).
pub(crate) fn tool_calls(shape: &Shape, first: usize, calls: &[Call], indexed: bool) -> Vec<Value> {
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
