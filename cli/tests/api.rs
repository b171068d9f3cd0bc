//! The router's OpenAI API against real prefill/decode workers: every malformed request
//! gets the right status and an OpenAI-shaped error (and the router keeps serving), stop
//! strings and stop token ids, chat completions, usage, `/metrics` and request ids in
//! every process's logs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pdserve_engine::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use support::*;

const T: Duration = Duration::from_secs(60);
const JSON: (&str, &str) = ("Content-Type", "application/json");
/// The routers here are started with these limits.
const MAX_BODY: usize = 65536;
const MAX_MODEL_LEN: usize = 512;

type Log = Arc<Mutex<Vec<String>>>;

/// `pdserve <role>` at log level info with its stderr collected (and echoed).
fn start_logged(role: &str, args: &[&str]) -> (Proc, String, Log) {
    let mut c = bin();
    c.env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .arg(role)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null());
    let mut child = c.spawn().unwrap();
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let log: Log = Arc::default();
    let sink = log.clone();
    let tag = role.to_string();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("[{tag}] {l}");
            sink.lock().unwrap().push(l);
        }
    });
    let p = Proc { child, lines: rx };
    let addr = p
        .wait_line("listening on", 60)
        .rsplit(' ')
        .next()
        .unwrap()
        .to_string();
    (p, addr, log)
}

struct Cluster {
    _procs: Vec<Proc>,
    addr: String,
    logs: [Log; 3],
}

/// Prefill, decode and router processes; the router with small body and context limits.
fn cluster() -> Cluster {
    cluster_with(&[])
}

fn cluster_with(router_args: &[&str]) -> Cluster {
    let (p, paddr, plog) = start_logged("prefill", &[]);
    let (d, daddr, dlog) = start_logged("decode", &[]);
    let (r, addr, rlog) = start_logged(
        "router",
        &[
            "--prefill",
            &paddr,
            "--decode",
            &daddr,
            "--max-body-bytes",
            &MAX_BODY.to_string(),
            "--max-model-len",
            &MAX_MODEL_LEN.to_string(),
        ]
        .into_iter()
        .chain(router_args.iter().copied())
        .collect::<Vec<_>>(),
    );
    wait_healthy(&addr, 60);
    Cluster {
        _procs: vec![r, d, p],
        addr,
        logs: [rlog, dlog, plog],
    }
}

fn post(addr: &str, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, String, Value) {
    let mut h = vec![JSON];
    h.extend_from_slice(headers);
    let (st, head, b) = raw(addr, "POST", path, &h, body.to_string().as_bytes(), T);
    let v = serde_json::from_str(&b).unwrap_or_else(|e| panic!("{e}: {b}"));
    (st, head, v)
}

/// A streamed request: every `data:` JSON up to `[DONE]` (which must come).
fn sse(addr: &str, path: &str, body: &Value) -> Vec<Value> {
    let (st, head, b) = raw(addr, "POST", path, &[JSON], body.to_string().as_bytes(), T);
    assert_eq!(st, 200, "{b}");
    assert!(head.contains("text/event-stream"), "{head}");
    assert!(!b.contains("event: error"), "{b}");
    let data: Vec<&str> = b.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{b}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn tokenizer() -> Tokenizer {
    std::env::set_var(
        "PDSERVE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("pdserve-cache"),
    );
    let dir = pdserve_engine::embedded::model_dir().unwrap();
    Tokenizer::from_model_dir(&dir).unwrap().unwrap()
}

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
            "n = 2",
            json!({"prompt": "x", "n": 2}),
            Some("n"),
            "unsupported_parameter",
        ),
        bad_chat(
            "chat n = 3",
            json!({"messages": user, "n": 3}),
            Some("n"),
            "unsupported_parameter",
        ),
        bad(
            "logprobs",
            json!({"prompt": "x", "logprobs": 2}),
            Some("logprobs"),
            "unsupported_parameter",
        ),
        bad_chat(
            "chat logprobs",
            json!({"messages": user, "logprobs": true}),
            Some("logprobs"),
            "unsupported_parameter",
        ),
        bad(
            "echo",
            json!({"prompt": "x", "echo": true}),
            Some("echo"),
            "unsupported_parameter",
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

fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.split([' ', '{']).next() == Some(name) && labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next())
        .map(|v| v.parse().unwrap())
        .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"))
}

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

/// A model folder with a Jinja chat template: the router renders messages with it.
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
        json!({"chat_template": template, "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}).to_string(),
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
