//! Failures end requests fast and clearly: dead decode mid-stream, dead prefill,
//! mismatched KV layouts between prefill and decode.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};
use support::*;

#[test]
fn killing_decode_mid_stream_ends_the_stream_with_an_error() {
    let up = Up::start(&[]);
    let body = serde_json::json!({
        "prompt": prompt(5, 20), "max_tokens": 3000, "temperature": 0, "ignore_eos": true, "stream": true
    });
    let (st, mut sse) = stream(&up.addr, &body, Duration::from_secs(10));
    assert_eq!(st, 200);
    for _ in 0..3 {
        let (ev, _) = sse.next().unwrap();
        assert_eq!(ev, "message");
    }
    kill9(up.pid_of("decode[0]"));
    let t0 = Instant::now();
    let mut saw_error = None;
    while let Some((ev, data)) = sse.next() {
        if ev == "error" {
            saw_error = Some(data);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "still streaming 5 s after the kill"
        );
    }
    let err = saw_error.expect("the stream ended without an error event");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "error after {:?}",
        t0.elapsed()
    );
    assert!(err.contains("decode worker"), "{err}");
    // `up` notices the dead child and stops everything with a failure status.
    let mut up = up;
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = up.proc.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "pdserve up still running"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
}

#[test]
fn killing_prefill_reroutes_then_fails_fast() {
    let (p1, a1) = role("prefill", &[]);
    let (p2, a2) = role("prefill", &[]);
    let (_d, ad) = role("decode", &[]);
    let (_r, ar) = role(
        "router",
        &["--prefill", &format!("{a1},{a2}"), "--decode", &ad],
    );
    wait_healthy(&ar, 60);
    let p = prompt(3, 30);
    let (want, _) = complete(&ar, &greedy(&p, 5)).unwrap();
    kill9(p1.pid());
    for _ in 0..4 {
        let t0 = Instant::now();
        let (got, _) = complete(&ar, &greedy(&p, 5)).expect("a second prefill server is up");
        assert_eq!(got, want);
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
    kill9(p2.pid());
    for _ in 0..2 {
        let t0 = Instant::now();
        let (st, body) = complete(&ar, &greedy(&p, 5)).unwrap_err();
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t0.elapsed()
        );
        assert_eq!(st, 503, "{body}");
        assert!(body.contains("prefill"), "{body}");
    }
    drop((p1, p2));
}

#[test]
fn mismatched_index_k_dtype_fails_the_first_request_naming_it() {
    let up = Up::start(&[
        "--prefill-args",
        "--index-k-dtype bf16",
        "--decode-args",
        "--index-k-dtype f32",
    ]);
    let t0 = Instant::now();
    let (st, body) = complete(&up.addr, &greedy(&prompt(1, 10), 4)).unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(st, 502, "{body}");
    assert!(body.contains("index_k_dtype"), "{body}");
    let (st, sse) = stream(
        &up.addr,
        &serde_json::json!({"prompt": [5, 6, 7], "max_tokens": 2, "stream": true}),
        Duration::from_secs(5),
    );
    assert_eq!(st, 502);
    drop(sse);
}

fn decode_info(rt: &tokio::runtime::Runtime, addr: &str) -> pdserve_proto::pb::WorkerInfo {
    rt.block_on(async {
        let mut c =
            pdserve_proto::pb::worker_client::WorkerClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
        c.info(pdserve_proto::pb::Empty {})
            .await
            .unwrap()
            .into_inner()
    })
}

#[test]
fn client_disconnect_cancels_and_frees_pages() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_p, ap) = role("prefill", &[]);
    let (_d, ad) = role("decode", &["--kv-pages", "64"]);
    let (_r, ar) = role("router", &["--prefill", &ap, "--decode", &ad]);
    wait_healthy(&ar, 60);
    let idle = decode_info(&rt, &ad);
    assert_eq!(idle.role, "decode");
    assert_eq!(idle.total_pages, 64);
    assert!(idle
        .config
        .iter()
        .any(|e| e.key == "kv_pages" && e.value == "64" && e.source == "flag --kv-pages"));
    let body = serde_json::json!({
        "prompt": prompt(8, 20), "max_tokens": 3000, "temperature": 0, "ignore_eos": true, "stream": true
    });
    let (st, mut sse) = stream(&ar, &body, Duration::from_secs(10));
    assert_eq!(st, 200);
    for _ in 0..3 {
        sse.next().unwrap();
    }
    let busy = decode_info(&rt, &ad);
    assert_eq!(busy.running, 1);
    assert!(busy.free_pages < 64, "{busy:?}");
    drop(sse);
    let t0 = Instant::now();
    loop {
        let i = decode_info(&rt, &ad);
        if i.running == 0 && i.free_pages == 64 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "pages not freed: {i:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
