//! `pdserve bench serve` against a real prefill/decode/router cluster on the embedded
//! model (CPU): every request completes, its figures are consistent, multi-turn prompts
//! grow by the answers, and every output equals the single-process reference.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::Value;
use std::process::Output;
use support::api::*;
use support::*;

fn bench_serve(addr: &str, args: &[&str]) -> (Output, Value) {
    let url = format!("http://{addr}");
    let out = bin()
        .args(["bench", "serve", "--url", &url, "--json"])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let v = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out, v)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn count(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn multi_turn_sessions_complete_and_match_the_reference() {
    let c = cluster();
    let (out, r) = bench_serve(
        &c.addr,
        &[
            "--sessions",
            "8",
            "--turns",
            "2",
            "--concurrency",
            "4",
            "--prompt-len",
            "12:40",
            "--output-len",
            "3:10",
            "--shared-prefix-len",
            "8",
            "--seed",
            "7",
        ],
    );
    assert!(out.status.success(), "{}\n{r:#}", stderr(&out));
    let req = &r["requests"];
    assert_eq!(
        [
            &req["planned"],
            &req["sent"],
            &req["completed"],
            &req["failed"],
            &req["skipped"]
        ]
        .map(count),
        [16, 16, 16, 0, 0],
        "{r:#}"
    );
    assert_eq!(r["errors"], Value::Array(vec![]));
    assert_eq!(count(&r["length_miscounts"]), 0);
    let check = &r["reference"];
    assert_eq!(
        [&check["checked"], &check["matched"], &check["mismatched"]].map(count),
        [16, 16, 0],
        "{check:#}"
    );

    let each = r["per_request"].as_array().unwrap();
    assert_eq!(each.len(), 16);
    let (mut outputs, mut prompts) = (0, 0);
    for (i, q) in each.iter().enumerate() {
        let (n, max) = (count(&q["output_tokens"]), count(&q["max_tokens"]));
        assert!((3..=10).contains(&max), "{q}");
        match q["finish"].as_str().unwrap() {
            "length" => assert_eq!(n, max, "{q}"),
            "stop" => assert!(n < max, "{q}"),
            f => panic!("finish {f}: {q}"),
        }
        let (ttft, e2e) = (num(&q["ttft_ms"]), num(&q["e2e_ms"]));
        assert!(ttft > 0.0 && ttft <= e2e, "{q}");
        let p = count(&q["prompt_tokens"]);
        match count(&q["turn"]) {
            // prefix + one user turn
            0 => assert!((8 + 12..=8 + 40).contains(&p), "{q}"),
            // turn 0's prompt + its answer + a new user turn
            1 => {
                let prev = &each[i - 1];
                assert_eq!(prev["session"], q["session"]);
                let grown = count(&prev["prompt_tokens"]) + count(&prev["output_tokens"]);
                assert!((grown + 12..=grown + 40).contains(&p), "{prev}\n{q}");
            }
            t => panic!("turn {t}"),
        }
        outputs += n;
        prompts += p;
    }
    assert_eq!(count(&r["output_tokens"]), outputs);
    assert_eq!(count(&r["prompt_tokens"]), prompts);
    // One inter-token gap per output token after each request's first.
    let requests_with_tokens = each
        .iter()
        .filter(|q| count(&q["output_tokens"]) > 0)
        .count() as u64;
    assert_eq!(count(&r["itl_ms"]["count"]), outputs - requests_with_tokens);
    for d in ["ttft_ms", "itl_ms", "e2e_ms"] {
        let x = &r[d];
        let (p50, p90, p99, max) = (
            num(&x["p50"]),
            num(&x["p90"]),
            num(&x["p99"]),
            num(&x["max"]),
        );
        assert!(
            0.0 <= p50 && p50 <= p90 && p90 <= p99 && p99 <= max,
            "{d}: {x}"
        );
    }
    assert!(num(&r["ttft_ms"]["p50"]) <= num(&r["e2e_ms"]["p50"]));
    let duration = num(&r["duration_s"]);
    assert!(duration > 0.0 && duration * 1e3 >= num(&r["e2e_ms"]["max"]));
    assert!((num(&r["output_throughput"]) - outputs as f64 / duration).abs() < 1e-6);
    assert!((num(&r["request_throughput"]) - 16.0 / duration).abs() < 1e-9);
    assert_eq!(r["config"]["mode"], "closed");
}

#[test]
fn open_loop_ignore_eos_returns_every_asked_token_and_failures_exit_1() {
    let c = cluster();
    let (out, r) = bench_serve(
        &c.addr,
        &[
            "--sessions",
            "6",
            "--request-rate",
            "40",
            "--prompt-len",
            "16",
            "--output-len",
            "2:6",
            "--ignore-eos",
            "--no-reference",
        ],
    );
    assert!(out.status.success(), "{}\n{r:#}", stderr(&out));
    assert_eq!(count(&r["requests"]["completed"]), 6, "{r:#}");
    assert_eq!(r["reference"], Value::Null);
    assert_eq!(r["config"]["mode"], "open");
    let each = r["per_request"].as_array().unwrap();
    for q in each {
        assert_eq!(q["finish"], "length", "{q}");
        assert_eq!(q["output_tokens"], q["max_tokens"], "{q}");
        assert_eq!(count(&q["prompt_tokens"]), 16);
    }
    let asked: u64 = each.iter().map(|q| count(&q["max_tokens"])).sum();
    assert_eq!(count(&r["output_tokens"]), asked);

    // Longer than the router's context (MAX_MODEL_LEN): refused before any request.
    let long = (MAX_MODEL_LEN + 1).to_string();
    let (out, _) = bench_serve(&c.addr, &["--prompt-len", &long, "--no-reference"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("max_model_len is {MAX_MODEL_LEN}")),
        "{}",
        stderr(&out)
    );
    let (out, _) = bench_serve(&c.addr, &["--temperature", "0.7"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--no-reference"), "{}", stderr(&out));

    // A reference that is not the served model (a randomised fixture of 97 tokens, so
    // its prompt ids are valid for the embedded model too): the outputs differ, each
    // difference is located and measured, and the run fails after printing the report.
    let other = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/mixed");
    let (out, r) = bench_serve(
        &c.addr,
        &[
            "--model",
            other,
            "--sessions",
            "4",
            "--prompt-len",
            "10",
            "--output-len",
            "6",
            "--ignore-eos",
        ],
    );
    assert!(!out.status.success(), "{r:#}");
    assert!(
        stderr(&out).contains("outputs differ from the reference"),
        "{}",
        stderr(&out)
    );
    let check = &r["reference"];
    assert_eq!(count(&check["checked"]), 4, "{r:#}");
    assert_eq!(count(&check["matched"]) + count(&check["mismatched"]), 4);
    let mismatches = check["mismatches"].as_array().unwrap();
    assert!(!mismatches.is_empty(), "{check:#}");
    assert_eq!(mismatches.len() as u64, count(&check["mismatched"]));
    for m in mismatches {
        let p = count(&m["position"]);
        assert!(p < 6, "{m}");
        assert_ne!(m["served_token"], m["reference_token"], "{m}");
        assert_eq!(count(&m["served_tokens"]), 6);
        assert!(num(&m["top2_margin"]) >= 0.0, "{m}");
    }
}

/// `--worker-metrics`: the mean TTFT broken down from the workers' own histograms. Every
/// part is measured over exactly the run's requests, none is negative (the decode's first
/// token comes after the prefill's queue and its compute up to the token, the client's
/// TTFT contains the decode's first token, the pull contains the whole prefill), the first
/// token's path adds up to the TTFT, and the ratio is the TTFT over the prefill compute.
#[test]
fn worker_metrics_break_down_the_time_to_first_token() {
    let (_p, pa, pm) = worker_with_metrics("prefill", &[]);
    let (_d, da, dm) = worker_with_metrics("decode", &[]);
    let (_r, ra) = role("router", &["--prefill", &pa, "--decode", &da]);
    wait_healthy(&ra, 60);
    let metrics = format!("{pm},http://{dm}/metrics");
    let (out, r) = bench_serve(
        &ra,
        &[
            "--sessions",
            "4",
            "--concurrency",
            "2",
            "--prompt-len",
            "20:60",
            "--output-len",
            "4",
            "--no-reference",
            "--worker-metrics",
            &metrics,
        ],
    );
    assert!(out.status.success(), "{}\n{r:#}", stderr(&out));
    let b = &r["ttft_breakdown"];
    assert_eq!([num(&b["prefills"]), num(&b["pulls"])], [4.0, 4.0], "{b:#}");
    let ttft = num(&b["ttft_mean_ms"]);
    assert!((ttft - num(&r["ttft_ms"]["mean"])).abs() < 1e-9, "{r:#}");
    let compute = num(&b["prefill_compute_ms"]);
    assert!(compute > 0.0, "{b:#}");
    for part in [
        "decode_admission_ms",
        "prefill_queue_ms",
        "prefill_to_first_token_ms",
        "first_token_to_decode_ms",
        "first_token_out_ms",
        "kv_transfer_ms",
        "kv_after_first_token_ms",
    ] {
        assert!(num(&b[part]) >= 0.0, "{part}: {b:#}");
    }
    assert!(num(&b["prefill_to_first_token_ms"]) <= compute, "{b:#}");
    // The first token's path adds up to the client's TTFT.
    let parts: f64 = [
        "decode_admission_ms",
        "prefill_queue_ms",
        "prefill_to_first_token_ms",
        "first_token_to_decode_ms",
        "first_token_out_ms",
    ]
    .iter()
    .map(|k| num(&b[*k]))
    .sum();
    assert!((parts - ttft).abs() < 1e-6 * ttft.max(1.0), "{b:#}");
    assert!((num(&b["ttft_over_prefill"]) - ttft / compute).abs() < 1e-9);
}
