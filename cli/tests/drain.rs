//! Graceful drain: SIGTERM makes a decode server refuse new requests (the router sends
//! them elsewhere at once) while the ones in flight finish, then exit 0; past
//! `--drain-timeout-s` the rest fail cleanly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::mpsc;
use std::time::{Duration, Instant};
use support::prom::Scrape;
use support::*;

fn sigterm(pid: u32) {
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

fn wait_exit(p: &mut Proc, secs: u64) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(st) = p.child.try_wait().unwrap() {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "still running {secs} s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn admitted(side: &str) -> f64 {
    let (st, body) = http(side, "GET", "/metrics", None, Duration::from_secs(5));
    assert_eq!(st, 200);
    Scrape::parse(&body)
        .value("pdserve_request_queue_time_seconds_count", &[])
        .unwrap()
}

/// Start a stream in a thread; it reports its first event, then its token count and
/// finish reason (or the error event) at the end.
fn start_stream(
    router: &str,
    body: serde_json::Value,
    started: mpsc::Sender<()>,
) -> std::thread::JoinHandle<Result<(usize, String), String>> {
    let router = router.to_string();
    std::thread::spawn(move || {
        let (st, mut sse) = stream(&router, &body, Duration::from_secs(60));
        assert_eq!(st, 200);
        let (ev, data) = sse.next().unwrap();
        assert_eq!(ev, "message", "{data}");
        let v: serde_json::Value = serde_json::from_str(&data).unwrap();
        let first = v["choices"][0]["token_ids"].as_array().unwrap().len();
        started.send(()).unwrap();
        sse.collect()
            .map(|(ids, finish)| (first + ids.len(), finish))
    })
}

#[test]
fn sigterm_on_a_decode_server_finishes_its_streams_takes_no_new_ones_and_exits_0() {
    let (_p, pa) = role("prefill", &[]);
    let (mut a, aa, am) = worker_with_metrics("decode", &["--drain-timeout-s", "120"]);
    let (_b, ba) = role("decode", &[]);
    let (_r, ra) = role("router", &["--prefill", &pa, "--decode", &aa]);
    wait_healthy(&ra, 60);
    const STREAMS: usize = 10;
    const TOKENS: usize = 400;
    let (tx, rx) = mpsc::channel();
    let streams: Vec<_> = (0..STREAMS)
        .map(|i| {
            let body = serde_json::json!({
                "prompt": prompt(i as u64, 20), "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": true, "stream": true
            });
            start_stream(&ra, body, tx.clone())
        })
        .collect();
    for _ in 0..STREAMS {
        rx.recv_timeout(Duration::from_secs(60)).unwrap();
    }
    let t0 = Instant::now();
    assert_eq!(admitted(&am), STREAMS as f64);
    let body = serde_json::json!({ "address": ba, "role": "decode" });
    assert_eq!(
        http(
            &ra,
            "POST",
            "/workers",
            Some(&body),
            Duration::from_secs(10)
        )
        .0,
        201
    );
    sigterm(a.pid());
    wait_status(&am, "/ready", 503, 2);
    // New requests go to the other decode server, none to the draining one.
    for i in 0..3 {
        let (ids, _) = complete(&ra, &greedy(&prompt(100 + i, 10), 4)).unwrap();
        assert_eq!(ids.len(), 4);
    }
    assert_eq!(
        admitted(&am),
        STREAMS as f64,
        "a new request reached the draining server"
    );
    let running = streams.iter().filter(|s| !s.is_finished()).count();
    assert_eq!(
        running, STREAMS,
        "the streams must still run while the checks above happen"
    );
    eprintln!("checks done {:?} after SIGTERM", t0.elapsed());
    for s in streams {
        let (n, finish) = s
            .join()
            .unwrap()
            .expect("a stream in flight failed during the drain");
        assert_eq!((n, finish.as_str()), (TOKENS, "length"));
    }
    eprintln!("streams done {:?} after SIGTERM", t0.elapsed());
    let st = wait_exit(&mut a, 60);
    assert_eq!(st.code(), Some(0), "{st:?}");
}

#[test]
fn past_the_drain_timeout_requests_in_flight_fail_cleanly_and_the_server_exits_0() {
    let (_p, pa) = role("prefill", &[]);
    let (mut d, da, _) = worker_with_metrics("decode", &["--drain-timeout-s", "0.5"]);
    let (_r, ra) = role("router", &["--prefill", &pa, "--decode", &da]);
    wait_healthy(&ra, 60);
    let (tx, rx) = mpsc::channel();
    let body = serde_json::json!({
        "prompt": prompt(1, 20), "max_tokens": 4000, "temperature": 0, "ignore_eos": true, "stream": true
    });
    let s = start_stream(&ra, body, tx);
    rx.recv_timeout(Duration::from_secs(60)).unwrap();
    let t0 = Instant::now();
    sigterm(d.pid());
    let err = s
        .join()
        .unwrap()
        .expect_err("a 4000-token stream cannot finish in 0.5 s");
    assert!(err.contains("shutting down"), "{err}");
    let st = wait_exit(&mut d, 10);
    assert_eq!(st.code(), Some(0), "{st:?}");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
}
