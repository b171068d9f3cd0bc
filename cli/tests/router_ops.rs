//! Operating the cluster with real processes: the prefill prefix cache (device and host
//! tiers) through the router, prefix-affinity routing against round robin, and adding and
//! removing workers at run time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use pdserve_engine::sampling::SamplingParams;
use pdserve_proto::pb;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::*;

/// 64-token pages (a multiple of the embedded model's rates 4 and 32): prompts of a few
/// pages exercise the prefix cache quickly. Prefill and decode must agree on it.
const PAGE: &[&str] = &["--page-tokens", "64"];

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// `Worker.Info` of the server at `addr`, retried until it answers (model loading).
fn info(rt: &tokio::runtime::Runtime, addr: &str) -> pb::WorkerInfo {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = rt.block_on(async {
            let mut c = pb::worker_client::WorkerClient::connect(format!("http://{addr}")).await?;
            Ok::<_, Box<dyn std::error::Error>>(c.info(pb::Empty {}).await?.into_inner())
        });
        match r {
            Ok(i) => return i,
            Err(e) => assert!(Instant::now() < deadline, "{addr} never answered Info: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn with(mut a: Vec<String>, more: &[&str]) -> Vec<String> {
    a.extend(more.iter().map(|s| s.to_string()));
    a
}

fn start(role_name: &str, args: &[String]) -> (Proc, String) {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    role(role_name, &a)
}

fn get_workers(router: &str) -> Value {
    let (st, body) = http(router, "GET", "/workers", None, Duration::from_secs(5));
    assert_eq!(st, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn worker_entry(router: &str, addr: &str) -> Option<Value> {
    get_workers(router)["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["address"] == addr)
        .cloned()
}

/// Wait until `pred` holds for the router's view of `addr`.
fn wait_worker(router: &str, addr: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let w = worker_entry(router, addr).unwrap_or(Value::Null);
        if pred(&w) {
            return w;
        }
        assert!(Instant::now() < deadline, "{addr}: never {what}: {w}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn post_worker(router: &str, addr: &str, role: &str) -> (u16, String) {
    http(
        router,
        "POST",
        "/workers",
        Some(&json!({"address": addr, "role": role})),
        Duration::from_secs(10),
    )
}

/// `shared` tokens of prefix `k` followed by a tail unique to `tail`.
fn shared_prompt(k: u64, shared: usize, tail: u64) -> Vec<u32> {
    let mut p = prompt(7000 + k, shared);
    p.extend(prompt(90_000 + k * 100 + tail, 10));
    p
}

#[test]
fn prefix_cache_hits_both_tiers_with_outputs_identical_to_cold_runs() {
    let rt = rt();
    let pargs = with(
        PAGE.iter().map(|s| s.to_string()).collect(),
        &["--kv-pages", "8", "--hicache-ratio", "4"],
    );
    let (_p, ap) = start("prefill", &pargs);
    let (_d, ad) = role("decode", PAGE);
    let (_r, ar) = role("router", &["--prefill", &ap, "--decode", &ad]);
    wait_healthy(&ar, 60);
    let i0 = info(&rt, &ap);
    assert_eq!((i0.total_pages, i0.host_total_pages), (8, 32));
    let mut e = engine();
    let mut run = |p: &[u32]| {
        let want = reference(&mut e, p, 8, SamplingParams::default());
        let (got, _) = complete(&ar, &greedy(p, 8)).unwrap();
        assert_eq!(got, want, "prompt of {} tokens", p.len());
        info(&rt, &ap)
    };
    // A: 128 shared tokens (2 pages) + 10. First time: all computed, two cut points cached.
    let i = run(&shared_prompt(0, 128, 0));
    assert_eq!(
        (
            i.prefix_hit_device_tokens,
            i.prefix_hit_host_tokens,
            i.prefix_miss_tokens
        ),
        (0, 0, 138)
    );
    assert_eq!(i.cached_pages, 2);
    // Same prefix, other tail: both pages from the device tier.
    let i = run(&shared_prompt(0, 128, 1));
    assert_eq!(
        (
            i.prefix_hit_device_tokens,
            i.prefix_hit_host_tokens,
            i.prefix_miss_tokens
        ),
        (128, 0, 148)
    );
    // Three other prefixes fill the 8-page pool: the least recently used page of A goes
    // to the host tier.
    for k in 1..4 {
        run(&shared_prompt(k, 128, 0));
    }
    let i = info(&rt, &ap);
    assert!(i.host_used_pages >= 1, "{i:?}");
    // A again: its first page still on the device, its second loaded back from the host.
    let before = i;
    let i = run(&shared_prompt(0, 128, 2));
    let dev = i.prefix_hit_device_tokens - before.prefix_hit_device_tokens;
    let host = i.prefix_hit_host_tokens - before.prefix_hit_host_tokens;
    assert_eq!(dev + host, 128, "{i:?}");
    assert!(host >= 64, "no host-tier hit: {i:?}");
    assert_eq!(i.prefix_miss_tokens - before.prefix_miss_tokens, 10);
    // Transfers are counted on both sides.
    assert_eq!(i.transfers, 6);
    let di = info(&rt, &ad);
    assert_eq!(di.transfers, 6);
    assert!(di.transfer_bytes > 0 && di.transfer_bytes == i.transfer_bytes);
    // The router reports the same figures.
    let w = wait_worker(&ar, &ap, "reporting the host hits", |w| {
        w["load"]["prefix_hit_host_tokens"] == i.prefix_hit_host_tokens
    });
    assert_eq!(
        w["load"]["prefix_hit_device_tokens"],
        i.prefix_hit_device_tokens
    );
    assert_eq!(w["circuit"], "closed");
}

/// Device-tier hit tokens summed over both prefill workers after `order`, and the outputs.
fn hits_with_policy(policy: &str, order: &[(u64, u64)]) -> (u64, u64, Vec<Vec<u32>>) {
    let rt = rt();
    let (_p1, a1) = role("prefill", PAGE);
    let (_p2, a2) = role("prefill", PAGE);
    let (_d, ad) = role("decode", PAGE);
    let (_r, ar) = role(
        "router",
        &[
            "--prefill",
            &format!("{a1},{a2}"),
            "--decode",
            &ad,
            "--prefill-policy",
            policy,
        ],
    );
    wait_healthy(&ar, 60);
    assert_eq!(get_workers(&ar)["prefill_policy"], policy);
    let outs: Vec<Vec<u32>> = order
        .iter()
        .map(|&(k, t)| {
            complete(&ar, &greedy(&shared_prompt(k, 128, t), 4))
                .unwrap()
                .0
        })
        .collect();
    let (i1, i2) = (info(&rt, &a1), info(&rt, &a2));
    let hits = i1.prefix_hit_device_tokens + i2.prefix_hit_device_tokens;
    let miss = i1.prefix_miss_tokens + i2.prefix_miss_tokens;
    // The router's gauges/listing agree with the workers' own counters.
    for (a, i) in [(&a1, &i1), (&a2, &i2)] {
        wait_worker(&ar, a, "reporting its hits", |w| {
            w["load"]["prefix_hit_device_tokens"] == i.prefix_hit_device_tokens
        });
    }
    (hits, miss, outs)
}

#[test]
fn prefix_affinity_raises_device_hits_over_round_robin() {
    // 6 prefixes of 2 pages, 4 requests each, in a fixed shuffled order.
    let mut order: Vec<(u64, u64)> = (0..6).flat_map(|k| (0..4).map(move |t| (k, t))).collect();
    let mut x = 12345u64;
    for i in (1..order.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        order.swap(i, (x >> 33) as usize % (i + 1));
    }
    let (aff, aff_miss, aff_out) = hits_with_policy("prefix_affinity", &order);
    let (rr, rr_miss, rr_out) = hits_with_policy("round_robin", &order);
    let possible = 6 * 3 * 128;
    eprintln!(
        "device-tier prefix hits: prefix_affinity {aff} tokens ({:.0}% of {possible} reusable), round_robin {rr} ({:.0}%)",
        100.0 * aff as f64 / possible as f64,
        100.0 * rr as f64 / possible as f64
    );
    // Affinity: every repeat of a prefix lands where the prefix is cached.
    assert_eq!(aff, possible);
    assert!(rr < aff, "round robin {rr} >= affinity {aff}");
    assert_eq!(aff + aff_miss, rr + rr_miss);
    // Cache hits never change an output.
    assert_eq!(aff_out, rr_out);
    let mut e = engine();
    for (&(k, t), got) in order.iter().zip(&aff_out).take(6) {
        let want = reference(
            &mut e,
            &shared_prompt(k, 128, t),
            4,
            SamplingParams::default(),
        );
        assert_eq!(*got, want);
    }
}

#[test]
fn workers_join_leave_and_are_refused_at_run_time() {
    let rt = rt();
    let (_p1, a1) = role("prefill", &[]);
    let (p2, a2) = role("prefill", &[]);
    let (_d1, d1) = role("decode", &[]);
    let (_r, ar) = role(
        "router",
        &[
            "--prefill",
            &format!("{a1},{a2}"),
            "--decode",
            &d1,
            "--decode-policy",
            "round_robin",
        ],
    );
    wait_healthy(&ar, 60);

    // (c) A decode worker added at run time takes traffic.
    let (_d2, d2) = role("decode", &[]);
    info(&rt, &d2);
    let (st, body) = post_worker(&ar, &d2, "decode");
    assert_eq!(st, 201, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["circuit"].as_str(), v["role"].as_str()),
        (Some("closed"), Some("decode"))
    );
    for i in 0..4 {
        complete(&ar, &greedy(&prompt(i, 20), 3)).unwrap();
    }
    assert!(
        info(&rt, &d2).transfers >= 2,
        "the new decode worker got no traffic"
    );
    let (st, body) = post_worker(&ar, &d2, "decode");
    assert_eq!(st, 409, "{body}");

    // (d) Workers that cannot pair are refused, naming why.
    let (_d3, d3) = role("decode", &["--index-k-dtype", "bf16"]);
    info(&rt, &d3);
    let (st, body) = post_worker(&ar, &d3, "decode");
    assert_eq!(st, 409, "{body}");
    assert!(
        body.contains("index_k_dtype") && body.contains("bf16"),
        "{body}"
    );
    assert!(body.contains("worker_mismatch"), "{body}");
    let (st, body) = post_worker(&ar, &d3, "prefill");
    assert_eq!(st, 400, "{body}");
    assert!(body.contains("decode server, not prefill"), "{body}");
    let (st, body) = post_worker(&ar, "127.0.0.1:1", "prefill");
    assert_eq!(st, 502, "{body}");
    let (st, body) = http(
        &ar,
        "POST",
        "/workers",
        Some(&json!({"addr": d3})),
        Duration::from_secs(5),
    );
    assert_eq!(st, 400, "{body}");
    assert_eq!(get_workers(&ar)["workers"].as_array().unwrap().len(), 4);

    // (b) Under load, remove a decode worker (it finishes what it has) and remove then
    // kill a prefill worker (its prefills in flight fail over to the other one): no
    // request fails.
    let handles: Vec<_> = (0..24u64)
        .map(|c| {
            let ar = ar.clone();
            std::thread::spawn(move || {
                let mut fails = Vec::new();
                for t in 0..2 {
                    let p = prompt(500 + c * 3 + t, 30 + (c as usize % 40));
                    let mut b = greedy(&p, 24);
                    b["stream"] = true.into();
                    let (st, sse) = stream(&ar, &b, Duration::from_secs(120));
                    if st != 200 {
                        fails.push(format!("request {c}/{t}: status {st}"));
                        continue;
                    }
                    if let Err(e) = sse.collect() {
                        fails.push(format!("request {c}/{t}: {e}"));
                    }
                }
                fails
            })
        })
        .collect();
    // Remove d1 while it has requests in flight (the router's own count).
    wait_worker(&ar, &d1, "busy", |w| w["inflight"].as_u64() >= Some(2));
    let (st, body) = http(
        &ar,
        "DELETE",
        &format!("/workers/{d1}"),
        None,
        Duration::from_secs(5),
    );
    assert_eq!(st, 200, "{body}");
    let removed: Value = serde_json::from_str(&body).unwrap();
    assert!(removed["inflight"].as_u64() >= Some(1), "{removed}");
    eprintln!(
        "removed {d1} with {} requests in flight",
        removed["inflight"]
    );
    let (st, body) = http(
        &ar,
        "DELETE",
        &format!("/workers/{a2}"),
        None,
        Duration::from_secs(5),
    );
    assert_eq!(st, 200, "{body}");
    kill9(p2.pid());
    let fails: Vec<String> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    assert!(
        fails.is_empty(),
        "{} requests failed: {fails:?}",
        fails.len()
    );
    let (st, _) = http(
        &ar,
        "DELETE",
        &format!("/workers/{d1}"),
        None,
        Duration::from_secs(5),
    );
    assert_eq!(st, 404);
    // The removed decode worker gets nothing new.
    let before = info(&rt, &d1).transfers;
    for i in 0..4 {
        complete(&ar, &greedy(&prompt(900 + i, 12), 2)).unwrap();
    }
    assert_eq!(info(&rt, &d1).transfers, before);
    let left: Vec<String> = get_workers(&ar)["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["address"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(left, vec![a1.clone(), d2.clone()]);
}

#[test]
fn a_dead_worker_leaves_rotation_and_returns_when_healthy() {
    let (_p, ap) = role("prefill", &[]);
    let (d1, ad1) = role("decode", &[]);
    let (_d2, ad2) = role("decode", &[]);
    let (_r, ar) = role(
        "router",
        &["--prefill", &ap, "--decode", &format!("{ad1},{ad2}")],
    );
    wait_healthy(&ar, 60);
    kill9(d1.pid());
    drop(d1);
    let w = wait_worker(&ar, &ad1, "open", |w| w["circuit"] == "open");
    assert!(
        w["last_error"].as_str().unwrap().contains("health check"),
        "{w}"
    );
    // Every request goes to the live decode worker meanwhile.
    for i in 0..3 {
        complete(&ar, &greedy(&prompt(i, 10), 2)).unwrap();
    }
    // The same address comes back: half open, then closed.
    let mut c = bin();
    c.args(["decode", "--listen", &ad1]);
    let _back = Proc::start(c);
    wait_worker(&ar, &ad1, "closed again", |w| w["circuit"] == "closed");
    wait_healthy(&ar, 10);
}

#[test]
fn cache_and_policy_flags_are_checked_and_shown() {
    let run = |args: &[&str]| {
        let out = bin().args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = run(&["prefill", "--print-config", "--hicache-ratio", "2"]);
    assert!(ok, "{err}");
    let line = |out: &str, key: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{key} ")))
            .unwrap_or_else(|| panic!("no {key} in {out}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        line(&out, "hicache_ratio"),
        "hicache_ratio = 2.0 # flag --hicache-ratio"
    );
    for (args, want) in [
        (
            vec!["prefill", "--print-config", "--hicache-ratio", "0.5"],
            "--hicache-ratio 0.5 is below 1",
        ),
        (
            vec!["decode", "--print-config", "--hicache-ratio", "2"],
            "decode servers keep none",
        ),
        (
            vec![
                "prefill",
                "--print-config",
                "--hicache-size",
                "1",
                "--hicache-ratio",
                "2",
            ],
            "give one",
        ),
        (
            vec!["router", "--print-config", "--prefill-policy", "random"],
            "--prefill-policy: unknown routing policy `random`",
        ),
        (
            vec!["router", "--print-config", "--health-interval-s", "0"],
            "--health-interval-s must be a positive",
        ),
    ] {
        let (ok, _, err) = run(&args);
        assert!(!ok, "{args:?} accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let (ok, out, err) = run(&["router", "--print-config"]);
    assert!(ok, "{err}");
    assert_eq!(
        line(&out, "prefill_policy"),
        "prefill_policy = prefix_affinity # default"
    );
    assert_eq!(
        line(&out, "decode_policy"),
        "decode_policy = least_load # default"
    );
    let (ok, out, _) = run(&["router", "--print-config", "--decode-policy", "round_robin"]);
    assert!(ok);
    assert_eq!(
        line(&out, "decode_policy"),
        "decode_policy = round_robin # flag --decode-policy"
    );
    // The host pool is sized at startup: a size that cannot hold the device pool fails fast.
    let (ok, _, err) = run(&[
        "prefill",
        "--kv-pages",
        "100",
        "--hicache-size",
        "0.000001",
        "--listen",
        "127.0.0.1:0",
    ]);
    assert!(!ok);
    assert!(err.contains("fewer than the device pool's 100"), "{err}");
}
