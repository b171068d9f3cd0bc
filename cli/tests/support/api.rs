//! Helpers of the API tests: a prefill/decode/router cluster whose processes' logs are
//! collected, JSON and SSE requests, the embedded tokenizer, Prometheus text lookups.

use super::*;
use pdserve_tokenizer::Tokenizer;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

pub const T: Duration = Duration::from_secs(60);
pub const JSON: (&str, &str) = ("Content-Type", "application/json");
/// The routers here are started with these limits.
pub const MAX_BODY: usize = 65536;
pub const MAX_MODEL_LEN: usize = 512;

pub type Log = Arc<Mutex<Vec<String>>>;

/// `pdserve <role>` at log level info with its stderr collected (and echoed).
pub fn start_logged(role: &str, args: &[&str]) -> (Proc, String, Log) {
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

pub struct Cluster {
    pub procs: Vec<Proc>,
    pub addr: String,
    pub logs: [Log; 3],
}

/// Prefill, decode and router processes; the router with small body and context limits.
pub fn cluster() -> Cluster {
    cluster_with(&[])
}

pub fn cluster_with(router_args: &[&str]) -> Cluster {
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
        procs: vec![r, d, p],
        addr,
        logs: [rlog, dlog, plog],
    }
}

pub fn post(
    addr: &str,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, String, Value) {
    let mut h = vec![JSON];
    h.extend_from_slice(headers);
    let (st, head, b) = raw(addr, "POST", path, &h, body.to_string().as_bytes(), T);
    let v = serde_json::from_str(&b).unwrap_or_else(|e| panic!("{e}: {b}"));
    (st, head, v)
}

/// A streamed request: every `data:` JSON up to `[DONE]` (which must come).
pub fn sse(addr: &str, path: &str, body: &Value) -> Vec<Value> {
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

pub fn tokenizer() -> Tokenizer {
    std::env::set_var(
        "PDSERVE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("pdserve-cache"),
    );
    let dir = pdserve_engine::embedded::model_dir().unwrap();
    Tokenizer::from_model_dir(&dir).unwrap().unwrap()
}

/// The value of the first sample of `name` whose labels contain all of `labels`.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.split([' ', '{']).next() == Some(name) && labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next())
        .map(|v| v.parse().unwrap())
        .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"))
}
