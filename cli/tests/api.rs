//! The router's OpenAI API against real prefill/decode workers: stop strings and stop
//! token ids, chat completions (default and model templates), usage, `/metrics` and
//! request ids in every process's logs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{json, Value};
use std::time::Duration;
use support::api::*;
use support::*;

#[test]
fn stops_chat_usage_metrics_and_request_ids() {
    let c = cluster();
    let tok = tokenizer();
    let addr = c.addr.as_str();
    let (mut prompt_sum, mut completion_sum, mut ok_requests) = (0u64, 0u64, 0u64);
    let mut count = |v: &Value| {
        prompt_sum += v["prompt_tokens"].as_u64().unwrap();
        completion_sum += v["completion_tokens"].as_u64().unwrap();
    };

    // A greedy base generation from token ids.
    let p = prompt(5, 20);
    let greedy = |extra: Value| {
        let mut b = json!({"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let (st, _, base) = post(addr, "/v1/completions", &greedy(json!({})), &[]);
    assert_eq!(st, 200, "{base}");
    ok_requests += 1;
    count(&base["usage"]);
    let ids: Vec<u32> = serde_json::from_value(base["choices"][0]["token_ids"].clone()).unwrap();
    let text = base["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(ids.len(), 24);
    assert_eq!(text, tok.decode(&ids).unwrap());
    assert_eq!(
        base["usage"],
        json!({"prompt_tokens": 20, "completion_tokens": 24, "total_tokens": 44})
    );
    assert_eq!(base["choices"][0]["finish_reason"], "length");

    // A stop string straddling a token boundary in the middle of the text.
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let stop = (6..ids.len() - 4)
        .find_map(|k| {
            let b = tok.decode(&ids[..k]).unwrap();
            if b.ends_with('\u{FFFD}') || !text.starts_with(&b) {
                return None;
            }
            let ci = chars.iter().position(|(i, _)| *i == b.len())?;
            (ci >= 2 && ci + 2 <= chars.len()).then(|| {
                chars[ci - 2..ci + 2]
                    .iter()
                    .map(|c| c.1)
                    .collect::<String>()
            })
        })
        .expect("a token boundary to put a stop string across");
    let want = &text[..text.find(&stop).unwrap()];
    // Tokens generated until the text first contains the stop string.
    let need = (1..=ids.len())
        .find(|&j| tok.decode(&ids[..j]).unwrap().contains(&stop))
        .unwrap();
    assert!(need < ids.len(), "the stop string must cut the text");
    let (st, _, v) = post(
        addr,
        "/v1/completions",
        &greedy(json!({"stop": [stop, "zzzzqq"]})),
        &[],
    );
    assert_eq!(st, 200, "{v}");
    ok_requests += 1;
    count(&v["usage"]);
    assert_eq!(v["choices"][0]["text"], want, "stop {stop:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], need);
    // Streamed: the same text, and no chunk ever carried any of the stop string.
    let chunks = sse(
        addr,
        "/v1/completions",
        &greedy(json!({"stop": stop, "stream": true, "stream_options": {"include_usage": true}})),
    );
    ok_requests += 1;
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, want);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], need);
    count(&last["usage"]);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "stop"
    );

    // Stop token ids (extension): generation ends before the first such token.
    // The first id (after the third) that did not occur before it.
    let f = (3..ids.len())
        .find(|&j| !ids[..j].contains(&ids[j]))
        .unwrap();
    let t = ids[f];
    let (st, _, v) = post(
        addr,
        "/v1/completions",
        &greedy(json!({"stop_token_ids": [t]})),
        &[],
    );
    assert_eq!(st, 200, "{v}");
    ok_requests += 1;
    count(&v["usage"]);
    assert_eq!(v["choices"][0]["token_ids"], json!(ids[..f]));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], f);

    // Chat: the default template; streamed equals not streamed; usage on the last chunk.
    let chat = json!({
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a parser"}],
        "max_completion_tokens": 10, "temperature": 0, "ignore_eos": true,
    });
    let rendered = "system: Be brief.\nuser: Write a parser\nassistant:";
    let (st, _, v) = post(addr, "/v1/chat/completions", &chat, &[]);
    assert_eq!(st, 200, "{v}");
    ok_requests += 1;
    count(&v["usage"]);
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let content = msg["content"].as_str().unwrap();
    let n_prompt = tok.encode(rendered).unwrap().len();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": n_prompt, "completion_tokens": 10, "total_tokens": n_prompt + 10})
    );
    let (_, _, same) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": rendered, "max_tokens": 10, "temperature": 0, "ignore_eos": true}),
        &[],
    );
    ok_requests += 1;
    count(&same["usage"]);
    assert_eq!(same["choices"][0]["text"], content);
    let mut s = chat.clone();
    s["stream"] = true.into();
    s["stream_options"] = json!({"include_usage": true});
    let chunks = sse(addr, "/v1/chat/completions", &s);
    ok_requests += 1;
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));
    assert_eq!(chunks.last().unwrap()["usage"], v["usage"]);
    count(&v["usage"]);

    // Request ids: echoed, generated when absent, and on the logs of all three processes.
    let rid = "rid-api-test-4f2a";
    let (st, head, v) = post(
        addr,
        "/v1/completions",
        &greedy(json!({"max_tokens": 2})),
        &[("X-Request-Id", rid)],
    );
    assert_eq!(st, 200, "{v}");
    ok_requests += 1;
    count(&v["usage"]);
    assert!(head.contains(&format!("x-request-id: {rid}")), "{head}");
    let (_, head, _) = post(addr, "/v1/completions", &json!({"prompt": ""}), &[]);
    assert!(
        head.lines()
            .any(|l| l.starts_with("x-request-id: ") && l.len() == "x-request-id: ".len() + 16),
        "{head}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for (name, log) in ["router", "decode", "prefill"].iter().zip(&c.logs) {
        loop {
            if log.lock().unwrap().iter().any(|l| l.contains(rid)) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}'s log has no line with {rid}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let router_lines = c.logs[0].lock().unwrap().clone();
    assert!(
        router_lines
            .iter()
            .any(|l| l.contains(rid) && l.contains("completed")),
        "the router's completion line lacks the request id"
    );

    // Model listing and retrieval.
    let (st, _, b) = raw(addr, "GET", "/v1/models", &[], b"", T);
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["data"][0]["id"], "pdserve-embedded");
    assert_eq!(v["data"][0]["max_model_len"], MAX_MODEL_LEN);
    let (st, _, b) = raw(addr, "GET", "/v1/models/pdserve-embedded", &[], b"", T);
    assert_eq!(st, 200, "{b}");
    let (st, _, b) = raw(addr, "GET", "/v1/models/gpt-17", &[], b"", T);
    assert_eq!(st, 404);
    assert!(b.contains("model_not_found"), "{b}");

    // Metrics: exact token totals and request counts of this router process.
    let (st, head, m) = raw(addr, "GET", "/metrics", &[], b"", T);
    assert_eq!(st, 200);
    assert!(head.contains("text/plain"), "{head}");
    let ok_completions = metric(
        &m,
        "pdserve_router_requests_total",
        &["endpoint=\"/v1/completions\"", "status=\"200\""],
    );
    let ok_chat = metric(
        &m,
        "pdserve_router_requests_total",
        &["endpoint=\"/v1/chat/completions\"", "status=\"200\""],
    );
    assert_eq!(ok_completions + ok_chat, ok_requests as f64);
    assert_eq!(ok_chat, 2.0);
    assert_eq!(
        metric(&m, "pdserve_router_requests_total", &["status=\"400\""]),
        1.0
    );
    assert_eq!(
        metric(&m, "pdserve_router_prompt_tokens_total", &[]),
        prompt_sum as f64
    );
    assert_eq!(
        metric(&m, "pdserve_router_completion_tokens_total", &[]),
        completion_sum as f64
    );
    assert_eq!(
        metric(&m, "pdserve_router_e2e_latency_seconds_count", &[]),
        ok_requests as f64
    );
    assert_eq!(
        metric(&m, "pdserve_router_time_to_first_token_seconds_count", &[]),
        ok_requests as f64
    );
    assert!(metric(&m, "pdserve_router_inter_token_latency_seconds_count", &[]) > 0.0);
    assert!(
        metric(
            &m,
            "pdserve_router_time_to_first_token_seconds_bucket",
            &["le=\"+Inf\""]
        ) > 0.0
    );
    assert_eq!(metric(&m, "pdserve_router_running_requests", &[]), 0.0);
    eprintln!(
        "router metrics: ttft sum {} s over {ok_requests} requests, e2e sum {} s",
        metric(&m, "pdserve_router_time_to_first_token_seconds_sum", &[]),
        metric(&m, "pdserve_router_e2e_latency_seconds_sum", &[]),
    );
}

/// A model folder with a Jinja chat template: the router renders messages with it. Its
/// tokenizer config asks for BOS: completions of text get it, chat prompts (whose
/// template writes it) do not get a second one.
#[test]
fn chat_uses_the_models_template() {
    let tok = tokenizer();
    let src = pdserve_engine::embedded::model_dir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("templated");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), model.join(f)).unwrap();
    }
    let template = "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with a user or system message') }}{% endif %}{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'].strip() }}</{{ m['role'] }}>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
    std::fs::write(
        model.join("tokenizer_config.json"),
        json!({"chat_template": template, "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": true}).to_string(),
    )
    .unwrap();
    let c = cluster_with(&["--model", model.to_str().unwrap()]);
    let messages = json!([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Parse it"}]);
    let rendered =
        "<|begin_of_text|><system>Be brief.</system>\n<user>Parse it</user>\n<assistant>";
    let (st, _, chat) = post(
        &c.addr,
        "/v1/chat/completions",
        &json!({"model": "templated", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
        &[],
    );
    assert_eq!(st, 200, "{chat}");
    let want_ids = tok.encode(rendered).unwrap();
    assert_eq!(
        want_ids[0], 0,
        "the bos token is tokenized as the special token"
    );
    assert_eq!(chat["usage"]["prompt_tokens"], want_ids.len());
    let (st, _, same) = post(
        &c.addr,
        "/v1/completions",
        &json!({"prompt": want_ids, "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
        &[],
    );
    assert_eq!(st, 200, "{same}");
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        same["choices"][0]["text"]
    );
    assert_eq!(
        chat["choices"][0]["token_ids"],
        same["choices"][0]["token_ids"]
    );
    // A text completion starts with BOS (once, also when the text starts with it), as
    // does /tokenize of a prompt unless `add_special_tokens` is false.
    let text_ids = tok.encode("Parse it").unwrap();
    let with_bos: Vec<u32> = std::iter::once(0).chain(text_ids.iter().copied()).collect();
    for prompt in ["Parse it", "<|begin_of_text|>Parse it"] {
        let (st, _, v) = post(
            &c.addr,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": true}),
            &[],
        );
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], with_bos.len(), "{prompt}");
        let (_, _, by_ids) = post(
            &c.addr,
            "/v1/completions",
            &json!({"prompt": with_bos, "max_tokens": 3, "temperature": 0, "ignore_eos": true}),
            &[],
        );
        assert_eq!(
            v["choices"][0]["token_ids"],
            by_ids["choices"][0]["token_ids"]
        );
    }
    let (_, _, t) = post(&c.addr, "/tokenize", &json!({"prompt": "Parse it"}), &[]);
    assert_eq!(t["tokens"], json!(with_bos));
    let (_, _, t) = post(
        &c.addr,
        "/tokenize",
        &json!({"prompt": "Parse it", "add_special_tokens": false}),
        &[],
    );
    assert_eq!(t["tokens"], json!(text_ids));
    // A template error is the client's 400, not a crash.
    let (st, _, e) = post(
        &c.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2}),
        &[],
    );
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "messages");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("start with a user or system message"), "{msg}");
}
