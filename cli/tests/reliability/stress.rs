//! The stress case at CI scale: 32 concurrent multi-turn sessions (greedy and seeded,
//! streamed and whole) through two prefill and two decode servers; every completion
//! equals the single-process reference, and at the end every worker is idle with every
//! page back and the router runs nothing.

use super::pd::*;
use crate::support::*;
use pdserve_engine::sampling::SamplingParams;
use std::time::Duration;

const SESSIONS: usize = 32;
const TURNS: usize = 3;
const NEW: usize = 12;

/// Session `s`'s sampling: even sessions greedy, odd ones seeded.
fn sampling(s: usize) -> (SamplingParams, serde_json::Value) {
    if s.is_multiple_of(2) {
        return (SamplingParams::default(), serde_json::json!({}));
    }
    let seed = 100 + s as u64;
    (
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed,
            ..SamplingParams::default()
        },
        serde_json::json!({ "temperature": 0.8, "top_p": 0.9, "seed": seed }),
    )
}

#[test]
fn concurrent_multi_turn_sessions_are_exact_and_every_page_comes_back() {
    let pd = Pd::start(2, 2, &[]);
    let handles: Vec<_> = (0..SESSIONS)
        .map(|s| {
            let addr = pd.addr.clone();
            std::thread::spawn(move || {
                let (_, extra) = sampling(s);
                let mut convo = prompt(2000 + s as u64, 6 + s % 23);
                let mut turns = Vec::new();
                for t in 0..TURNS {
                    let mut body = greedy(&convo, NEW);
                    for (k, v) in extra.as_object().unwrap() {
                        body[k] = v.clone();
                    }
                    let out = if (s + t).is_multiple_of(2) {
                        complete(&addr, &body)
                            .map(|x| x.0)
                            .map_err(|e| format!("{e:?}"))
                    } else {
                        match stream_to_end(&addr, &body, &mut None) {
                            Outcome::Done(ids, _, usage) => {
                                assert_eq!(usage, ids.len() as u64);
                                Ok(ids)
                            }
                            Outcome::Failed(e) => Err(e),
                        }
                    };
                    let out = out.unwrap_or_else(|e| panic!("session {s} turn {t}: {e}"));
                    turns.push((convo.clone(), out.clone()));
                    convo.extend(&out);
                    convo.extend(prompt(s as u64 * 10 + t as u64, 3 + t));
                }
                turns
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    pd.wait_idle(10);
    let (st, m) = http(&pd.addr, "GET", "/metrics", None, Duration::from_secs(5));
    assert_eq!(st, 200);
    assert_eq!(api::metric(&m, "pdserve_router_running_requests", &[]), 0.0);

    let mut e = engine();
    let mut mismatches = 0;
    for (s, turns) in results.iter().enumerate() {
        let (params, _) = sampling(s);
        for (t, (p, got)) in turns.iter().enumerate() {
            let want = reference(&mut e, p, NEW, params);
            if *got != want {
                mismatches += 1;
                eprintln!("session {s} turn {t}: got {got:?}, want {want:?}");
            }
        }
    }
    assert_eq!(results.len() * TURNS, SESSIONS * TURNS);
    assert_eq!(mismatches, 0, "completions differing from the reference");
}
