//! The KV canary in the servers: with `--kv-audit` (and `--deterministic`) on every
//! prefill and decode server,
//! concurrent multi-turn sessions through the router see no violation and outputs equal
//! single-process generation; a test-only scribble into one running request's page,
//! index-K entry or state slot fails exactly that request, within one audited step.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pdserve_engine::sampling::SamplingParams;
use std::time::Duration;
use support::api::{start_logged, Log};
use support::*;

struct Canaried {
    _procs: Vec<Proc>,
    addr: String,
    prefill_log: Log,
    decode_log: Log,
}

fn cluster(prefill: &[&str], decode: &[&str]) -> Canaried {
    let (p, paddr, prefill_log) = start_logged("prefill", prefill);
    let (d, daddr, decode_log) = start_logged("decode", decode);
    let (r, addr, _) = start_logged("router", &["--prefill", &paddr, "--decode", &daddr]);
    wait_healthy(&addr, 60);
    Canaried {
        _procs: vec![r, d, p],
        addr,
        prefill_log,
        decode_log,
    }
}

fn violations(log: &Log) -> Vec<String> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("KV canary"))
        .cloned()
        .collect()
}

#[test]
fn canary_on_every_server_under_concurrent_multi_turn_sessions() {
    let c = cluster(
        &[
            "--kv-audit",
            "--deterministic",
            "--kv-pages",
            "256",
            "--hicache-ratio",
            "2",
        ],
        &["--kv-audit", "--deterministic", "--kv-pages", "256"],
    );
    const SESSIONS: u64 = 64;
    const TURNS: usize = 3;
    const NEW: usize = 6;
    // Every session shares a system prefix (prefix-cache hits) and grows by its answer
    // plus a new user turn.
    let system = prompt(1000, 40);
    let transcripts: Vec<Vec<Vec<u32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..SESSIONS)
            .map(|i| {
                let (addr, system) = (c.addr.clone(), system.clone());
                s.spawn(move || {
                    let mut history = system;
                    let mut turns = Vec::new();
                    for t in 0..TURNS {
                        history.extend(prompt(i * 10 + t as u64, 5 + (i as usize % 7)));
                        let (got, _) = complete(&addr, &greedy(&history, NEW))
                            .unwrap_or_else(|e| panic!("session {i} turn {t}: {e:?}"));
                        turns.push(history.clone());
                        history.extend(&got);
                        turns.push(got);
                    }
                    turns
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut e = engine();
    for (i, turns) in transcripts.iter().enumerate() {
        for (t, pair) in turns.chunks(2).enumerate() {
            let want = reference(&mut e, &pair[0], NEW, SamplingParams::default());
            assert_eq!(pair[1], want, "session {i} turn {t}");
        }
    }
    assert_eq!(violations(&c.prefill_log), Vec::<String>::new());
    assert_eq!(violations(&c.decode_log), Vec::<String>::new());
}

/// 6 concurrent streams; after decode step 4 garbage lands in the oldest one's `kind`.
/// `kind`: the scribble; `region`: what the violation log must name as the changed bytes.
fn one_scribble(kind: &str, region: &str) {
    let scribble = format!("{kind}@4");
    let c = cluster(&[], &["--kv-audit", "--debug-kv-scribble", &scribble]);
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| prompt(50 + i, 20 + 3 * i as usize))
        .collect();
    let results: Vec<Result<(Vec<u32>, String), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let addr = c.addr.clone();
                s.spawn(move || {
                    let body = serde_json::json!({
                        "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": true, "stream": true
                    });
                    let (st, sse) = stream(&addr, &body, Duration::from_secs(60));
                    assert_eq!(st, 200);
                    sse.collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(
        failed.len(),
        1,
        "{kind}: exactly the scribbled request fails: {results:?}"
    );
    assert!(failed[0].contains("KV"), "{kind}: {}", failed[0]);
    let mut e = engine();
    for (p, r) in prompts.iter().zip(&results) {
        if let Ok((got, _)) = r {
            assert_eq!(
                got,
                &reference(&mut e, p, 40, SamplingParams::default()),
                "{kind}"
            );
        }
    }
    let v = violations(&c.decode_log);
    assert!(
        !v.is_empty(),
        "{kind}: the decode server logged the violation"
    );
    assert!(
        v.iter()
            .any(|l| l.contains(" bytes ") && l.contains(region)),
        "{kind}: the violation names the changed bytes and their region ({region}): {v:?}"
    );
}

#[test]
fn a_scribbled_page_fails_only_its_request() {
    one_scribble("page", "compressed KV");
}

#[test]
fn a_scribbled_index_k_entry_fails_only_its_request() {
    one_scribble("index-k", "index-K");
}

#[test]
fn a_scribbled_state_slot_fails_only_its_request() {
    one_scribble("state", "window ring");
}
