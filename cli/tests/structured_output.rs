//! Structured output and the decode server's logits processing against real workers on
//! the embedded model: replies that follow a regex, a choice list and a JSON schema
//! (parsed and validated), tool calls forced by a grammar coming back as `tool_calls`,
//! and `logit_bias`, `min_tokens` and `repetition_penalty` changing what is sampled.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{json, Value};
use support::api::*;
use support::*;

/// The schema the JSON replies must follow (bounded, so a random model finishes it).
fn schema() -> Value {
    json!({"type": "object",
           "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                          "color": {"enum": ["red", "blue"]},
                          "ok": {"type": "boolean"}},
           "required": ["n", "color", "ok"], "additionalProperties": false})
}

/// `text` parses and validates against [`schema`].
fn check_schema(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{v}");
    assert!(v["n"].as_u64().is_some_and(|n| n <= 99), "{v}");
    assert!(
        ["red", "blue"].contains(&v["color"].as_str().unwrap()),
        "{v}"
    );
    assert!(v["ok"].is_boolean(), "{v}");
}

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}])
}

fn check_call(call: &Value) {
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather", "{call}");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(
        ["Paris", "Rome"].contains(&args["city"].as_str().unwrap()),
        "{args}"
    );
    assert!(
        args["days"].as_u64().is_some_and(|d| (1..=7).contains(&d)),
        "{args}"
    );
}

#[test]
fn replies_follow_regexes_choices_schemas_and_forced_tool_calls() {
    let c = cluster();
    let addr = c.addr.as_str();
    let user = json!([{"role": "user", "content": "Give me a record"}]);

    // A regex on a completion, greedy and sampled: the text matches; the reply ends when
    // the regex is complete.
    for extra in [
        json!({"temperature": 0}),
        json!({"temperature": 1, "seed": 3, "n": 3}),
    ] {
        let mut body = json!({"prompt": "Answer:", "max_tokens": 40,
                              "structured_outputs": {"regex": "(yes|no), [0-9]{2}"}});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, _, v) = post(addr, "/v1/completions", &body, &[]);
        assert_eq!(st, 200, "{v}");
        for ch in v["choices"].as_array().unwrap() {
            let text = ch["text"].as_str().unwrap();
            let (word, num) = text.split_once(", ").unwrap_or_else(|| panic!("{text:?}"));
            assert!(["yes", "no"].contains(&word), "{text:?}");
            assert!(
                num.len() == 2 && num.bytes().all(|b| b.is_ascii_digit()),
                "{text:?}"
            );
            assert_eq!(ch["finish_reason"], "stop", "{v}");
        }
    }

    // A choice list.
    let (st, _, v) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Color:", "max_tokens": 10, "temperature": 1, "seed": 9, "n": 4,
                "structured_outputs": {"choice": ["red", "green", "light blue"]}}),
        &[],
    );
    assert_eq!(st, 200, "{v}");
    for ch in v["choices"].as_array().unwrap() {
        assert!(
            ["red", "green", "light blue"].contains(&ch["text"].as_str().unwrap()),
            "{v}"
        );
    }

    // response_format json_schema on chat (whole and streamed) and on completions.
    let rf = json!({"type": "json_schema", "json_schema": {"name": "record", "strict": true, "schema": schema()}});
    let (st, _, v) = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user, "response_format": rf, "max_tokens": 80, "temperature": 0.8, "seed": 1, "n": 3}),
        &[],
    );
    assert_eq!(st, 200, "{v}");
    for ch in v["choices"].as_array().unwrap() {
        check_schema(ch["message"]["content"].as_str().unwrap());
        assert_eq!(ch["finish_reason"], "stop", "{v}");
    }
    let chunks = sse(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user, "response_format": rf, "max_tokens": 80, "temperature": 0, "stream": true}),
    );
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    check_schema(&streamed);
    let (st, _, v) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "JSON:", "response_format": rf, "max_tokens": 80, "temperature": 0}),
        &[],
    );
    assert_eq!(st, 200, "{v}");
    check_schema(v["choices"][0]["text"].as_str().unwrap());

    // A forced tool call: `required` (one call: `parallel_tool_calls: false`; a random
    // model would go on calling) and a named function come back as tool_calls whose
    // arguments follow the function's schema.
    let weather = json!([{"role": "user", "content": "Weather in Paris?"}]);
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let (st, _, v) = post(
            addr,
            "/v1/chat/completions",
            &json!({"messages": weather, "tools": weather_tool(), "tool_choice": choice,
                    "parallel_tool_calls": false, "max_tokens": 200, "temperature": 0}),
            &[],
        );
        assert_eq!(st, 200, "{v}");
        let ch = &v["choices"][0];
        assert_eq!(ch["finish_reason"], "tool_calls", "{v}");
        let calls = ch["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        assert!(ch["message"]["content"].is_null(), "{v}");
        calls.iter().for_each(check_call);
        // The call answered with a tool message renders in the next turn.
        let next = json!([
            weather[0],
            {"role": "assistant", "content": null, "tool_calls": [calls[0]]},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18C, sunny"}]);
        let (st, _, t) = post(
            addr,
            "/tokenize",
            &json!({"messages": next, "tools": weather_tool()}),
            &[],
        );
        assert_eq!(st, 200, "{t}");
        let (_, _, d) = post(addr, "/detokenize", &json!({"tokens": t["tokens"]}), &[]);
        assert!(
            d["prompt"].as_str().unwrap().contains("tool: 18C, sunny"),
            "{d}"
        );
    }
    // Streamed, the call comes as a tool_calls delta.
    let chunks = sse(
        addr,
        "/v1/chat/completions",
        &json!({"messages": weather, "tools": weather_tool(), "tool_choice": "required",
                "parallel_tool_calls": false, "max_tokens": 200, "temperature": 0, "stream": true}),
    );
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    calls.iter().for_each(|c| check_call(c));
}

#[test]
fn logit_bias_min_tokens_and_repetition_penalty_change_what_is_sampled() {
    let c = cluster();
    let tok = tokenizer();
    let addr = c.addr.as_str();
    let p = prompt(7, 12);
    let greedy = |extra: Value| {
        let mut b = json!({"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (st, _, v) = post(addr, "/v1/completions", &b, &[]);
        assert_eq!(st, 200, "{v}");
        v["choices"][0].clone()
    };
    let ids = |ch: &Value| -> Vec<u32> { serde_json::from_value(ch["token_ids"].clone()).unwrap() };
    let base = ids(&greedy(json!({})));
    assert_eq!(base.len(), 8);

    // logit_bias -100 on the greedy token: another token comes first.
    let first = base[0].to_string();
    let banned = ids(&greedy(json!({"logit_bias": {(first): -100}})));
    assert_ne!(banned[0], base[0]);
    assert!(!banned.contains(&base[0]), "{banned:?}");
    // +100 forces a token at every step; its log-probability (of the biased logits) is ~0.
    let forced = (3..512u32).find(|t| !base.contains(t)).unwrap();
    let ch = greedy(json!({"logit_bias": {(forced.to_string()): 100}, "logprobs": 0}));
    assert_eq!(ids(&ch), vec![forced; 8]);
    let lp = ch["logprobs"]["token_logprobs"][0].as_f64().unwrap();
    assert!(lp > -1e-3, "{lp}");

    // A stop token that comes first ends the reply at once; with min_tokens 3 it cannot
    // be sampled before 3 tokens came out.
    let stop = json!({"stop_token_ids": [base[0]]});
    let at_once = greedy(stop.clone());
    assert_eq!(ids(&at_once), Vec::<u32>::new());
    assert_eq!(at_once["finish_reason"], "stop");
    let mut with_min = stop.clone();
    with_min["min_tokens"] = json!(3);
    let held = ids(&greedy(with_min));
    assert!(held.len() >= 3, "{held:?}");
    assert!(!held[..3].contains(&base[0]), "{held:?}");
    // Stop strings are not looked for before min_tokens either.
    let s = tok.decode(&base[..1]).unwrap();
    let cut = greedy(json!({"stop": [s.clone()]}));
    assert_eq!(cut["text"], "");
    let kept = greedy(json!({"stop": [s], "min_tokens": 3}));
    let head = tok.decode(&base[..3]).unwrap();
    assert!(kept["text"].as_str().unwrap().starts_with(&head), "{kept}");

    // A huge repetition penalty: no token of the prompt or of the reply comes again.
    let fresh = ids(&greedy(
        json!({"repetition_penalty": 1e6, "max_tokens": 16}),
    ));
    for (i, t) in fresh.iter().enumerate() {
        assert!(
            !p.contains(t) && !fresh[..i].contains(t),
            "{fresh:?} (prompt {p:?})"
        );
    }
}
