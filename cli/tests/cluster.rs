//! End to end through `pdserve up` (router, prefill and decode as separate processes):
//! outputs are token-identical to single-process generation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pdserve_engine::sampling::SamplingParams;
use std::time::Duration;
use support::*;

/// Prompt lengths around the embedded model's windows: HCA rate 32, sliding window 64,
/// page 256 (so the last one spans two pages).
const LENGTHS: [usize; 5] = [5, 33, 40, 70, 300];

#[test]
fn greedy_through_the_cluster_equals_single_process() {
    let up = Up::start(&["--device", "cpu"]);
    for name in ["prefill[0]", "decode[0]"] {
        assert!(
            up.startup
                .iter()
                .any(|l| l.contains(&format!(" {name} pid ")) && l.ends_with(" (cpu)")),
            "{name} placed on the cpu: {:?}",
            up.startup
        );
    }
    let mut e = engine();
    for (i, &n) in LENGTHS.iter().enumerate() {
        let p = prompt(i as u64, n);
        let want = reference(&mut e, &p, 12, SamplingParams::default());
        let (got, finish) = complete(&up.addr, &greedy(&p, 12)).unwrap();
        assert_eq!(got, want, "prompt of {n} tokens (non-streaming)");
        assert_eq!(finish, "length");
        let (st, sse) = stream(
            &up.addr,
            &serde_json::json!({
                "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stream": true
            }),
            Duration::from_secs(60),
        );
        assert_eq!(st, 200);
        let (got, finish) = sse.collect().unwrap();
        assert_eq!(got, want, "prompt of {n} tokens (streaming)");
        assert_eq!(finish, "length");
    }
    // Seeded sampling continues the same random stream across the prefill/decode split.
    let p = prompt(99, 50);
    let s = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: 7,
        ..SamplingParams::default()
    };
    let want = reference(&mut e, &p, 16, s);
    let (got, _) = complete(&up.addr, &serde_json::json!({
        "prompt": p, "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7, "ignore_eos": true
    }))
    .unwrap();
    assert_eq!(got, want, "seeded sampling");
    // Penalties and min_p: the same sampler on both sides of the split (the decode server
    // re-samples the prefill's first token, so both count it).
    let s = SamplingParams {
        temperature: 0.8,
        seed: 11,
        min_p: 0.1,
        presence_penalty: 0.5,
        frequency_penalty: 1.5,
        ..SamplingParams::default()
    };
    let want = reference(&mut e, &p, 16, s);
    let plain = reference(
        &mut e,
        &p,
        16,
        SamplingParams {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            min_p: 0.0,
            ..s
        },
    );
    assert_ne!(want, plain, "the penalties change this generation");
    let (got, _) = complete(
        &up.addr,
        &serde_json::json!({
            "prompt": p, "max_tokens": 16, "temperature": 0.8, "seed": 11, "min_p": 0.1,
            "presence_penalty": 0.5, "frequency_penalty": 1.5, "ignore_eos": true
        }),
    )
    .unwrap();
    assert_eq!(got, want, "penalties and min_p");
}

#[test]
fn text_prompt_matches_the_generate_command() {
    let up = Up::start(&[]);
    let out = bin()
        .args([
            "generate",
            "--prompt",
            "Hello pdserve cluster",
            "--max-new-tokens",
            "10",
            "--ignore-eos",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (st, body) = support::http(
        &up.addr,
        "POST",
        "/v1/completions",
        Some(&serde_json::json!({
            "model": "pdserve-embedded", "prompt": "Hello pdserve cluster", "max_tokens": 10, "temperature": 0, "ignore_eos": true
        })),
        Duration::from_secs(60),
    );
    assert_eq!(st, 200, "{body}");
    let r: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(r["choices"][0]["token_ids"], v["tokens"]);
    assert_eq!(r["choices"][0]["text"], v["text"]);
    assert_eq!(r["usage"]["completion_tokens"], 10);
    let (st, body) = support::http(&up.addr, "GET", "/v1/models", None, Duration::from_secs(5));
    assert_eq!(st, 200);
    assert!(body.contains("pdserve-embedded"), "{body}");
    let (st, body) = support::http(
        &up.addr,
        "POST",
        "/v1/completions",
        Some(&serde_json::json!({
            "model": "other", "prompt": "x"
        })),
        Duration::from_secs(5),
    );
    assert_eq!(st, 404, "{body}");
}

/// 64 conversations at once, 3 turns each; each next prompt extends the conversation.
#[test]
fn concurrent_conversations_match_single_process() {
    const CONVS: usize = 64;
    const TURNS: usize = 3;
    const NEW: usize = 6;
    let up = Up::start(&[]);
    let addr = up.addr.clone();
    let handles: Vec<_> = (0..CONVS)
        .map(|c| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut convo = prompt(1000 + c as u64, 4 + c % 29);
                let mut turns = Vec::new();
                for t in 0..TURNS {
                    let body = greedy(&convo, NEW);
                    let out = if (c + t) % 2 == 0 {
                        complete(&addr, &body)
                            .map(|x| x.0)
                            .map_err(|e| format!("{e:?}"))
                    } else {
                        let mut b = body.clone();
                        b["stream"] = true.into();
                        let (st, sse) = stream(&addr, &b, Duration::from_secs(120));
                        assert_eq!(st, 200);
                        sse.collect().map(|x| x.0)
                    };
                    let out = out.unwrap_or_else(|e| panic!("conversation {c} turn {t}: {e}"));
                    turns.push((convo.clone(), out.clone()));
                    convo.extend(&out);
                    convo.extend(prompt(c as u64 * 10 + t as u64, 3 + t));
                }
                turns
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut e = engine();
    let mut mismatches = 0;
    let mut total = 0;
    for (c, turns) in results.iter().enumerate() {
        for (t, (p, got)) in turns.iter().enumerate() {
            total += 1;
            let want = reference(&mut e, p, NEW, SamplingParams::default());
            if *got != want {
                mismatches += 1;
                eprintln!("conversation {c} turn {t}: got {got:?}, want {want:?}");
            }
        }
    }
    eprintln!("concurrent conversations: {total} completions, {mismatches} mismatches");
    assert_eq!(total, CONVS * TURNS);
    assert_eq!(mismatches, 0);
}

/// A device this machine cannot have is refused before any server starts, naming the flag.
#[test]
fn up_refuses_a_device_that_is_not_there() {
    let out = bin()
        .args(["up", "--port", "0", "--decode-device", "cuda:64"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--decode-device cuda:64: ") && err.contains("CUDA device(s) found"),
        "{err}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains(" pid "),
        "no server was started"
    );
}
