//! Slow and hostile HTTP clients against a real router: slow headers, idle keep-alives,
//! stalled bodies, more requests than `--max-concurrent-requests`, chat-only or
//! unimplemented fields, and prompts too large to tokenize, with the router's RSS bounded
//! and its workers kept in rotation.

use crate::support::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const LIMITS: &[&str] = &[
    "--header-timeout-s",
    "1",
    "--body-timeout-s",
    "1",
    "--max-concurrent-requests",
    "2",
];

/// Read until the server closes the connection (or 5 s pass); what it sent and when it
/// closed, counted from `t0`.
fn until_closed(s: &mut TcpStream, t0: Instant) -> (String, Duration) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), t0.elapsed())
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// A completion request whose head is sent but whose body never comes.
fn stalled_body(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"pro"
    )
    .unwrap();
    s
}

#[test]
fn slow_clients_are_cut_off_and_excess_requests_get_429() {
    let (router, addr) = role("router", LIMITS);
    let rss0 = rss_kib(router.pid());

    // Headers at a byte every 300 ms, and a connection that never sends anything: both
    // closed at the header deadline.
    let t0 = Instant::now();
    let mut slow = TcpStream::connect(&addr).unwrap();
    let mut idle = TcpStream::connect(&addr).unwrap();
    let mut crowd: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    for b in b"POST /v1/completions HTTP/1.1\r\n".iter().take(6) {
        if slow.write_all(&[*b]).is_err() {
            break;
        }
        for c in crowd.iter_mut() {
            let _ = c.write_all(&[*b]);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let (_, slow_closed) = until_closed(&mut slow, t0);
    let (_, idle_closed) = until_closed(&mut idle, t0);
    assert!(
        slow_closed < Duration::from_millis(3500),
        "slow headers kept open {slow_closed:?}"
    );
    assert!(
        idle_closed < Duration::from_millis(3500),
        "idle connection kept open {idle_closed:?}"
    );
    for c in crowd.iter_mut() {
        let (_, t) = until_closed(c, t0);
        assert!(
            t < Duration::from_secs(4),
            "a slowloris connection stayed {t:?}"
        );
    }
    let (st, _) = http(&addr, "GET", "/health", None, Duration::from_secs(5));
    assert_eq!(st, 503, "the router still answers (no workers: 503)");

    // Two stalled bodies hold both request slots: the third request is a 429 with
    // Retry-After, at once; the stalled ones end with 408 at the body deadline.
    let t1 = Instant::now();
    let mut a = stalled_body(&addr);
    let mut b = stalled_body(&addr);
    std::thread::sleep(Duration::from_millis(200));
    let (st, head, body) = raw(
        &addr,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        json!({"prompt": "x"}).to_string().as_bytes(),
        Duration::from_secs(5),
    );
    assert_eq!(st, 429, "{body}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    for s in [&mut a, &mut b] {
        let (resp, t) = until_closed(s, t1);
        assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
        assert!(resp.contains("request_timeout"), "{resp}");
        assert!(t < Duration::from_secs(3), "stalled body held {t:?}");
    }
    // Slots are free again.
    let (st, body) = http(
        &addr,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "x"})),
        Duration::from_secs(5),
    );
    assert_eq!(st, 503, "{body}");

    // A chunked body that announces a huge chunk and stalls: 408 at the body deadline.
    let t2 = Instant::now();
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFF\r\n{{\"prompt\""
    )
    .unwrap();
    let (resp, t) = until_closed(&mut s, t2);
    assert!(
        resp.starts_with("HTTP/1.1 408") || resp.starts_with("HTTP/1.1 413"),
        "{resp}"
    );
    assert!(t < Duration::from_secs(3), "{t:?}");

    let grown = rss_kib(router.pid()).saturating_sub(rss0) / 1024;
    assert!(grown < 32, "router RSS grew by {grown} MiB");
}

#[test]
fn fields_of_other_endpoints_and_function_calling_are_refused() {
    let (_r, addr) = role("router", &[]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "x", "tools": [{"type": "function"}]}),
            "tools",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}),
            "functions",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "function_call": "auto"}),
            "function_call",
        ),
        (
            "/v1/chat/completions",
            // Tool calls exist on chat now; only turning parallel calls off is refused.
            json!({"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": false}),
            "parallel_tool_calls",
        ),
    ];
    for (path, body, param) in cases {
        let (st, b) = http(&addr, "POST", path, Some(&body), Duration::from_secs(5));
        assert_eq!(st, 400, "{param}: {b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["error"]["param"], param, "{b}");
        assert_eq!(v["error"]["code"], "unsupported_parameter", "{b}");
    }
}

#[test]
fn huge_prompts_are_refused_before_tokenizing_and_starve_nobody() {
    let (_p, ap) = role("prefill", &[]);
    let (_d, ad) = role("decode", &[]);
    let (router, ar) = role("router", &["--prefill", &ap, "--decode", &ad]);
    wait_healthy(&ar, 60);
    let rss0 = rss_kib(router.pid());
    // Ten concurrent prompts of ~2 MB (just under the 2 MiB body limit) ...
    let big = "lorem ipsum ".repeat(170_000);
    let floods: Vec<_> = (0..10)
        .map(|_| {
            let (ar, big) = (ar.clone(), big.clone());
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let (st, b) = http(
                    &ar,
                    "POST",
                    "/v1/completions",
                    Some(&json!({"prompt": big, "max_tokens": 4})),
                    Duration::from_secs(30),
                );
                (st, b, t0.elapsed())
            })
        })
        .collect();
    // ... while normal traffic runs.
    for i in 0..4 {
        let (ids, _) = complete(&ar, &greedy(&prompt(300 + i, 16), 4)).unwrap();
        assert_eq!(ids.len(), 4);
    }
    for f in floods {
        let (st, b, took) = f.join().unwrap();
        assert_eq!(st, 400, "{b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{b}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("no tokenization of more than"),
            "refused before tokenizing: {msg}"
        );
        assert!(took < Duration::from_secs(10), "{took:?}");
    }
    // No worker left rotation; router memory stayed bounded.
    let (st, body) = http(&ar, "GET", "/workers", None, Duration::from_secs(5));
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    for w in v["workers"].as_array().unwrap() {
        assert_eq!(w["circuit"], "closed", "{w}");
    }
    let grown = rss_kib(router.pid()).saturating_sub(rss0) / 1024;
    assert!(grown < 200, "router RSS grew by {grown} MiB");
}

#[test]
fn a_stopped_worker_leaves_rotation_within_a_second() {
    let (_p, ap) = role("prefill", &[]);
    let (d, ad) = role("decode", &[]);
    let (_r, ar) = role("router", &["--prefill", &ap, "--decode", &ad]);
    wait_healthy(&ar, 60);
    let decode_healthy = || {
        let (_, body) = http(&ar, "GET", "/health", None, Duration::from_secs(5));
        let v: Value = serde_json::from_str(&body).unwrap();
        v["decode"][0]["healthy"].as_bool().unwrap()
    };
    let signal = |sig: &str| {
        assert!(std::process::Command::new("kill")
            .args([sig, &d.pid().to_string()])
            .status()
            .unwrap()
            .success());
    };
    signal("-STOP");
    let t0 = Instant::now();
    while decode_healthy() {
        assert!(t0.elapsed() < Duration::from_secs(5), "still in rotation");
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = t0.elapsed();
    signal("-CONT");
    // Design bound: health interval 0.5 s + poll deadline 0.5 s; slack for a loaded CI box.
    assert!(
        took < Duration::from_millis(1500),
        "out of rotation after {took:?}"
    );
    let t1 = Instant::now();
    while !decode_healthy() {
        assert!(
            t1.elapsed() < Duration::from_secs(5),
            "never back in rotation"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
