//! Every malformed request to the router's OpenAI API gets the right status and an
//! OpenAI-shaped error naming the field (`type`, `param`, `code`), against real workers,
//! and the router keeps serving afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{json, Value};
use support::api::*;
use support::*;

/// One row of the bad-request table.
struct Bad {
    what: &'static str,
    path: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
    status: u16,
    param: Option<&'static str>,
    code: &'static str,
}

fn bad(what: &'static str, body: Value, param: Option<&'static str>, code: &'static str) -> Bad {
    Bad {
        what,
        path: "/v1/completions",
        content_type: "application/json",
        body: body.to_string().into_bytes(),
        status: 400,
        param,
        code,
    }
}

fn bad_chat(
    what: &'static str,
    body: Value,
    param: Option<&'static str>,
    code: &'static str,
) -> Bad {
    Bad {
        path: "/v1/chat/completions",
        ..bad(what, body, param, code)
    }
}

fn table() -> Vec<Bad> {
    let user = json!([{"role": "user", "content": "hi"}]);
    let long: Vec<u32> = prompt(1, MAX_MODEL_LEN + 1);
    let near: Vec<u32> = prompt(2, MAX_MODEL_LEN - 10);
    vec![
        Bad {
            body: b"{\"prompt\": \"x\", ".to_vec(),
            ..bad("malformed JSON", json!({}), None, "invalid_json")
        },
        Bad {
            body: Vec::new(),
            ..bad("empty body", json!({}), None, "invalid_json")
        },
        bad("array body", json!([1, 2]), None, "invalid_type"),
        bad(
            "max_tokens a string",
            json!({"prompt": "x", "max_tokens": "ten"}),
            Some("max_tokens"),
            "invalid_type",
        ),
        bad(
            "temperature a string",
            json!({"prompt": "x", "temperature": "hot"}),
            Some("temperature"),
            "invalid_type",
        ),
        bad(
            "stream not a bool",
            json!({"prompt": "x", "stream": "yes"}),
            Some("stream"),
            "invalid_type",
        ),
        bad(
            "prompt an object",
            json!({"prompt": {"text": "x"}}),
            Some("prompt"),
            "invalid_type",
        ),
        bad(
            "stop a number",
            json!({"prompt": "x", "stop": 5}),
            Some("stop"),
            "invalid_type",
        ),
        bad(
            "missing prompt",
            json!({"max_tokens": 3}),
            Some("prompt"),
            "missing_required_parameter",
        ),
        bad_chat(
            "missing messages",
            json!({"max_tokens": 3}),
            Some("messages"),
            "missing_required_parameter",
        ),
        bad_chat(
            "message without role",
            json!({"messages": [{"content": "x"}]}),
            Some("messages[0].role"),
            "missing_required_parameter",
        ),
        bad_chat(
            "unknown role",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            Some("messages[0].role"),
            "invalid_value",
        ),
        bad_chat(
            "no messages",
            json!({"messages": []}),
            Some("messages"),
            "invalid_value",
        ),
        bad(
            "empty prompt",
            json!({"prompt": ""}),
            Some("prompt"),
            "invalid_value",
        ),
        bad(
            "empty token prompt",
            json!({"prompt": []}),
            Some("prompt"),
            "invalid_value",
        ),
        bad(
            "token id outside the vocabulary",
            json!({"prompt": [5, 100000]}),
            Some("prompt"),
            "invalid_value",
        ),
        bad(
            "a batch of prompts",
            json!({"prompt": ["a", "b"]}),
            Some("prompt"),
            "invalid_value",
        ),
        bad(
            "negative max_tokens",
            json!({"prompt": "x", "max_tokens": -5}),
            Some("max_tokens"),
            "invalid_value",
        ),
        bad(
            "zero max_tokens",
            json!({"prompt": "x", "max_tokens": 0}),
            Some("max_tokens"),
            "invalid_value",
        ),
        bad(
            "huge max_tokens",
            json!({"prompt": "x", "max_tokens": 1_000_000_000_000i64}),
            Some("max_tokens"),
            "invalid_value",
        ),
        bad_chat(
            "negative max_completion_tokens",
            json!({"messages": user, "max_completion_tokens": -1}),
            Some("max_completion_tokens"),
            "invalid_value",
        ),
        bad(
            "temperature above 2",
            json!({"prompt": "x", "temperature": 2.5}),
            Some("temperature"),
            "invalid_value",
        ),
        bad(
            "negative temperature",
            json!({"prompt": "x", "temperature": -0.1}),
            Some("temperature"),
            "invalid_value",
        ),
        bad(
            "top_p zero",
            json!({"prompt": "x", "top_p": 0}),
            Some("top_p"),
            "invalid_value",
        ),
        bad(
            "top_p above 1",
            json!({"prompt": "x", "top_p": 1.5}),
            Some("top_p"),
            "invalid_value",
        ),
        bad(
            "n = 0",
            json!({"prompt": "x", "n": 0}),
            Some("n"),
            "invalid_value",
        ),
        bad_chat(
            "chat n = 17",
            json!({"messages": user, "n": 17}),
            Some("n"),
            "invalid_value",
        ),
        bad(
            "logprobs over 20",
            json!({"prompt": "x", "logprobs": 21}),
            Some("logprobs"),
            "invalid_value",
        ),
        bad(
            "top_logprobs on completions",
            json!({"prompt": "x", "top_logprobs": 2}),
            Some("top_logprobs"),
            "unsupported_parameter",
        ),
        bad_chat(
            "chat logprobs not a boolean",
            json!({"messages": user, "logprobs": 3}),
            Some("logprobs"),
            "invalid_type",
        ),
        bad_chat(
            "top_logprobs without logprobs",
            json!({"messages": user, "top_logprobs": 2}),
            Some("top_logprobs"),
            "invalid_value",
        ),
        bad_chat(
            "top_logprobs over 20",
            json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
            Some("top_logprobs"),
            "invalid_value",
        ),
        bad(
            "echo with logprobs",
            json!({"prompt": "x", "echo": true, "logprobs": 1}),
            Some("echo"),
            "unsupported_parameter",
        ),
        bad(
            "presence_penalty above 2",
            json!({"prompt": "x", "presence_penalty": 2.5}),
            Some("presence_penalty"),
            "invalid_value",
        ),
        bad_chat(
            "frequency_penalty below -2",
            json!({"messages": user, "frequency_penalty": -3}),
            Some("frequency_penalty"),
            "invalid_value",
        ),
        bad(
            "min_p above 1",
            json!({"prompt": "x", "min_p": 1.5}),
            Some("min_p"),
            "invalid_value",
        ),
        bad(
            "min_tokens negative",
            json!({"prompt": "x", "min_tokens": -1}),
            Some("min_tokens"),
            "invalid_value",
        ),
        bad(
            "min_tokens over max_tokens",
            json!({"prompt": "x", "max_tokens": 4, "min_tokens": 5}),
            Some("min_tokens"),
            "invalid_value",
        ),
        bad(
            "min_tokens a string",
            json!({"prompt": "x", "min_tokens": "2"}),
            Some("min_tokens"),
            "invalid_type",
        ),
        bad_chat(
            "repetition_penalty zero",
            json!({"messages": user, "repetition_penalty": 0}),
            Some("repetition_penalty"),
            "invalid_value",
        ),
        bad(
            "repetition_penalty negative",
            json!({"prompt": "x", "repetition_penalty": -1.5}),
            Some("repetition_penalty"),
            "invalid_value",
        ),
        bad(
            "logit_bias above 100",
            json!({"prompt": "x", "logit_bias": {"5": 101}}),
            Some("logit_bias"),
            "invalid_value",
        ),
        bad_chat(
            "logit_bias below -100",
            json!({"messages": user, "logit_bias": {"5": -100.5}}),
            Some("logit_bias"),
            "invalid_value",
        ),
        bad(
            "logit_bias key not a token id",
            json!({"prompt": "x", "logit_bias": {"hello": 1}}),
            Some("logit_bias"),
            "invalid_value",
        ),
        bad(
            "logit_bias token outside the vocabulary",
            json!({"prompt": "x", "logit_bias": {"512": 1}}),
            Some("logit_bias"),
            "invalid_value",
        ),
        bad(
            "logit_bias a list",
            json!({"prompt": "x", "logit_bias": [1]}),
            Some("logit_bias"),
            "invalid_type",
        ),
        bad(
            "logit_bias value a string",
            json!({"prompt": "x", "logit_bias": {"5": "up"}}),
            Some("logit_bias"),
            "invalid_value",
        ),
        bad(
            "json_schema that does not compile",
            json!({"prompt": "x", "response_format": {"type": "json_schema",
                   "json_schema": {"name": "t", "schema": {"type": "nonsense"}}}}),
            Some("response_format.json_schema.schema"),
            "invalid_value",
        ),
        bad_chat(
            "json_schema without a schema",
            json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "t"}}}),
            Some("response_format.json_schema.schema"),
            "missing_required_parameter",
        ),
        bad_chat(
            "json_schema strict not a boolean",
            json!({"messages": user, "response_format": {"type": "json_schema",
                   "json_schema": {"name": "t", "strict": "yes", "schema": {"type": "object"}}}}),
            Some("response_format.json_schema.strict"),
            "invalid_type",
        ),
        bad(
            "regex that does not compile",
            json!({"prompt": "x", "structured_outputs": {"regex": "(a"}}),
            Some("structured_outputs.regex"),
            "invalid_value",
        ),
        bad_chat(
            "grammar that does not compile",
            json!({"messages": user, "structured_outputs": {"grammar": "start: missing_rule"}}),
            Some("structured_outputs.grammar"),
            "invalid_value",
        ),
        bad(
            "two structured_outputs kinds",
            json!({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}),
            Some("structured_outputs"),
            "invalid_value",
        ),
        bad(
            "unknown structured_outputs kind",
            json!({"prompt": "x", "structured_outputs": {"structural_tag": "a"}}),
            Some("structured_outputs.structural_tag"),
            "unsupported_parameter",
        ),
        bad(
            "empty structured_outputs choice",
            json!({"prompt": "x", "structured_outputs": {"choice": []}}),
            Some("structured_outputs.choice"),
            "invalid_type",
        ),
        bad(
            "structured_outputs not an object",
            json!({"prompt": "x", "structured_outputs": "json"}),
            Some("structured_outputs"),
            "invalid_type",
        ),
        bad(
            "response_format and structured_outputs together",
            json!({"prompt": "x", "response_format": {"type": "json_object"},
                   "structured_outputs": {"regex": "a"}}),
            Some("structured_outputs.regex"),
            "invalid_value",
        ),
        bad_chat(
            "forced tool call and response_format together",
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": "required", "response_format": {"type": "json_object"}}),
            Some("response_format"),
            "invalid_value",
        ),
        bad(
            "unknown response_format type on completions",
            json!({"prompt": "x", "response_format": {"type": "xml"}}),
            Some("response_format.type"),
            "invalid_value",
        ),
        bad(
            "chat-only field on completions",
            json!({"prompt": "x", "tools": []}),
            Some("tools"),
            "unsupported_parameter",
        ),
        bad_chat(
            "unknown message field",
            json!({"messages": [{"role": "user", "content": "x", "audio": {}}]}),
            Some("messages[0].audio"),
            "unsupported_parameter",
        ),
        bad_chat(
            "tool of another type",
            json!({"messages": user, "tools": [{"type": "retrieval"}]}),
            Some("tools[0].type"),
            "invalid_value",
        ),
        bad_chat(
            "tool without a name",
            json!({"messages": user, "tools": [{"type": "function", "function": {}}]}),
            Some("tools[0].function.name"),
            "missing_required_parameter",
        ),
        bad_chat(
            "unknown tool_choice",
            json!({"messages": user, "tool_choice": "sometimes"}),
            Some("tool_choice"),
            "invalid_value",
        ),
        bad_chat(
            "tool_choice required without tools",
            json!({"messages": user, "tool_choice": "required"}),
            Some("tool_choice"),
            "invalid_value",
        ),
        bad_chat(
            "tool_choice naming a missing tool",
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            Some("tool_choice"),
            "invalid_value",
        ),
        bad_chat(
            "parallel_tool_calls false",
            json!({"messages": user, "parallel_tool_calls": false}),
            Some("parallel_tool_calls"),
            "unsupported_parameter",
        ),
        bad_chat(
            "unknown reasoning_effort",
            json!({"messages": user, "reasoning_effort": "extreme"}),
            Some("reasoning_effort"),
            "invalid_value",
        ),
        bad_chat(
            "chat_template_kwargs not an object",
            json!({"messages": user, "chat_template_kwargs": [1]}),
            Some("chat_template_kwargs"),
            "invalid_type",
        ),
        bad_chat(
            "thinking not a boolean",
            json!({"messages": user, "chat_template_kwargs": {"thinking": "yes"}}),
            Some("chat_template_kwargs.thinking"),
            "invalid_type",
        ),
        bad_chat(
            "unknown response_format type",
            json!({"messages": user, "response_format": {"type": "xml"}}),
            Some("response_format.type"),
            "invalid_value",
        ),
        bad_chat(
            "tool call with a non-string id",
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
            Some("messages[0].tool_calls[0].id"),
            "invalid_type",
        ),
        bad(
            "empty stop string",
            json!({"prompt": "x", "stop": ["a", ""]}),
            Some("stop"),
            "invalid_value",
        ),
        bad(
            "stop token outside the vocabulary",
            json!({"prompt": "x", "stop_token_ids": [9999]}),
            Some("stop_token_ids"),
            "invalid_value",
        ),
        bad(
            "prompt longer than the context",
            json!({"prompt": long, "max_tokens": 1}),
            Some("prompt"),
            "context_length_exceeded",
        ),
        bad(
            "prompt + max_tokens over the context",
            json!({"prompt": near, "max_tokens": 20}),
            Some("prompt"),
            "context_length_exceeded",
        ),
        Bad {
            status: 404,
            ..bad(
                "unknown model",
                json!({"model": "gpt-17", "prompt": "x"}),
                Some("model"),
                "model_not_found",
            )
        },
        Bad {
            status: 404,
            ..bad_chat(
                "unknown chat model",
                json!({"model": "gpt-17", "messages": user}),
                Some("model"),
                "model_not_found",
            )
        },
        Bad {
            status: 413,
            body: format!("{{\"prompt\": \"{}\"}}", "a".repeat(3 * MAX_BODY)).into_bytes(),
            ..bad("oversized body", json!({}), None, "request_too_large")
        },
        Bad {
            body: b"{\"prompt\": \"caf\xe9 \xff\"}".to_vec(),
            ..bad("invalid UTF-8", json!({}), None, "invalid_utf8")
        },
        Bad {
            status: 415,
            content_type: "text/plain",
            ..bad(
                "wrong content type",
                json!({"prompt": "x"}),
                None,
                "unsupported_media_type",
            )
        },
        Bad {
            status: 404,
            path: "/v1/no-such-endpoint",
            ..bad("unknown path", json!({"prompt": "x"}), None, "unknown_url")
        },
    ]
}

#[test]
fn bad_requests_get_openai_errors_and_the_router_keeps_serving() {
    let c = cluster();
    let mut failures = Vec::new();
    for b in table() {
        let (st, _, body) = raw(
            &c.addr,
            "POST",
            b.path,
            &[("Content-Type", b.content_type)],
            &b.body,
            T,
        );
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        let e = &v["error"];
        let ok = st == b.status
            && e["type"] == "invalid_request_error"
            && e["param"] == json!(b.param)
            && e["code"] == b.code
            && e["message"].as_str().is_some_and(|m| !m.is_empty());
        if !ok {
            failures.push(format!("{}: got {st} {body}", b.what));
        }
        if b.what == "prompt + max_tokens over the context" {
            let m = e["message"].as_str().unwrap_or_default();
            assert!(m.contains("512") && m.contains("20"), "{m}");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Wrong method on a known path.
    let (st, _, body) = raw(&c.addr, "GET", "/v1/completions", &[], b"", T);
    assert_eq!(st, 405, "{body}");
    assert!(body.contains("method_not_allowed"), "{body}");
    // Still serving.
    let (st, _, v) = post(
        &c.addr,
        "/v1/completions",
        &json!({"prompt": "def parse(", "max_tokens": 4, "temperature": 0, "ignore_eos": true}),
        &[],
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}
