//! Every process's own `/metrics` (series names and Prometheus types), the probes
//! (`/live`, `/ready`, `grpc.health.v1`) and what the router does with them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;
use support::prom::Scrape;
use support::*;

fn scrape(addr: &str) -> Scrape {
    let (st, body) = http(addr, "GET", "/metrics", None, Duration::from_secs(10));
    assert_eq!(st, 200, "{body}");
    Scrape::parse(&body)
}

/// (name, type) every worker of `role` exports after serving one request.
fn expected(role: &str) -> Vec<(&'static str, &'static str)> {
    let mut v = vec![
        ("pdserve_num_requests_running", "gauge"),
        ("pdserve_num_requests_waiting", "gauge"),
        ("pdserve_kv_cache_usage_perc", "gauge"),
        ("pdserve_kv_pages_free", "gauge"),
        ("pdserve_kv_pages_cached", "gauge"),
        ("pdserve_kv_pages_used", "gauge"),
        ("pdserve_kv_pages_capacity", "gauge"),
        ("pdserve_worker_phase", "gauge"),
        ("pdserve_kv_transfers_total", "counter"),
        ("pdserve_kv_transfer_bytes_total", "counter"),
        ("pdserve_kv_transfer_seconds", "histogram"),
        ("pdserve_request_queue_time_seconds", "histogram"),
        ("pdserve_prefix_cache_hit_tokens_total", "counter"),
        ("pdserve_prefix_cache_miss_tokens_total", "counter"),
        ("pdserve_prefix_cache_queries_total", "counter"),
        ("pdserve_prefix_cache_hits_total", "counter"),
        ("pdserve_kv_audit_violations_total", "counter"),
    ];
    if role == "prefill" {
        v.push(("pdserve_request_prefill_time_seconds", "histogram"));
    } else {
        v.extend([
            ("pdserve_decode_step_seconds", "histogram"),
            ("pdserve_decode_batch_size", "histogram"),
            ("pdserve_decode_step_gap_seconds", "histogram"),
            ("pdserve_decode_step_gap_part_seconds", "histogram"),
            ("pdserve_cuda_graph_captures_total", "counter"),
            ("pdserve_cuda_graph_replays_total", "counter"),
            ("pdserve_graph_verify_mismatches_total", "counter"),
        ]);
    }
    v
}

const ROUTER_SERIES: &[(&str, &str)] = &[
    ("pdserve_router_requests_total", "counter"),
    ("pdserve_router_running_requests", "gauge"),
    ("pdserve_router_time_to_first_token_seconds", "histogram"),
    ("pdserve_router_inter_token_latency_seconds", "histogram"),
    ("pdserve_router_e2e_latency_seconds", "histogram"),
    ("pdserve_router_prompt_tokens_total", "counter"),
    ("pdserve_router_completion_tokens_total", "counter"),
    ("pdserve_worker_running", "gauge"),
    ("pdserve_worker_queued", "gauge"),
    ("pdserve_worker_kv_pages_used", "gauge"),
    ("pdserve_worker_kv_pages_capacity", "gauge"),
    ("pdserve_worker_circuit_state", "gauge"),
];

#[test]
fn every_process_exports_its_own_series_with_their_prometheus_types() {
    let (_p, pa, pm) = worker_with_metrics("prefill", &[]);
    let (_d, da, dm) = worker_with_metrics("decode", &[]);
    let (_r, ra) = role("router", &["--prefill", &pa, "--decode", &da]);
    wait_healthy(&ra, 60);
    let p = prompt(7, 300);
    complete(&ra, &greedy(&p, 6)).unwrap();
    complete(&ra, &greedy(&p, 6)).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for (role, side) in [("prefill", &pm), ("decode", &dm)] {
        let s = scrape(side);
        for (name, kind) in expected(role) {
            assert_eq!(
                s.types.get(name).map(String::as_str),
                Some(kind),
                "{role}: {name}"
            );
        }
        assert_eq!(s.convention_errors(), Vec::<String>::new(), "{role}");
        for (n, labels, _) in &s.samples {
            assert!(
                labels.contains("model_name=\"pdserve-embedded\"")
                    && labels.contains(&format!("role=\"{role}\"")),
                "{role}: {n}{{{labels}}} lacks model_name/role"
            );
        }
        assert_eq!(
            s.value("pdserve_worker_phase", &["phase=\"ready\""]),
            Some(1.0)
        );
        assert_eq!(
            s.value("pdserve_worker_phase", &["phase=\"draining\""]),
            Some(0.0)
        );
        assert_eq!(
            s.value("pdserve_kv_transfers_total", &[]),
            Some(2.0),
            "{role}"
        );
        assert_eq!(
            s.value("pdserve_request_queue_time_seconds_count", &[]),
            Some(2.0),
            "{role}"
        );
        assert_eq!(
            s.value("pdserve_num_requests_running", &[]),
            Some(0.0),
            "{role}"
        );
        seen.extend(s.types.keys().cloned());
        assert_eq!(
            http(side, "GET", "/live", None, Duration::from_secs(5)).0,
            200
        );
        assert_eq!(
            http(side, "GET", "/ready", None, Duration::from_secs(5)).0,
            200
        );
    }
    // The prefill server ran the prompt twice: the second time its 256-token page hit.
    let s = scrape(&pm);
    assert_eq!(
        s.value("pdserve_prefix_cache_queries_total", &[]),
        Some(600.0)
    );
    assert_eq!(s.value("pdserve_prefix_cache_hits_total", &[]), Some(256.0));
    assert_eq!(
        s.value(
            "pdserve_prefix_cache_hit_tokens_total",
            &["tier=\"device\""]
        ),
        Some(256.0)
    );
    assert_eq!(
        s.value("pdserve_request_prefill_time_seconds_count", &[]),
        Some(2.0)
    );
    let s = scrape(&dm);
    assert_eq!(
        s.value("pdserve_decode_batch_size_count", &[]),
        s.value("pdserve_decode_step_seconds_count", &[])
    );
    let steps = s.value("pdserve_decode_step_seconds_count", &[]).unwrap();
    assert!(steps >= 10.0);
    // Every step but the first of each busy stretch (two requests: one or two stretches)
    // has a gap before it, in microsecond-scale buckets.
    let gaps = s
        .value("pdserve_decode_step_gap_seconds_count", &[])
        .unwrap();
    assert!(
        (steps - 2.0..=steps - 1.0).contains(&gaps),
        "{gaps} gaps, {steps} steps"
    );
    assert!(s
        .value("pdserve_decode_step_gap_seconds_bucket", &["le=\"0.0001\""])
        .is_some());
    // Each gap is split into its parts, which add up to it.
    let mut parts_sum = 0.0;
    for part in ["sample", "admit", "other"] {
        let label = format!("part=\"{part}\"");
        assert_eq!(
            s.value("pdserve_decode_step_gap_part_seconds_count", &[&label]),
            Some(gaps),
            "{part}"
        );
        parts_sum += s
            .value("pdserve_decode_step_gap_part_seconds_sum", &[&label])
            .unwrap();
    }
    let total = s.value("pdserve_decode_step_gap_seconds_sum", &[]).unwrap();
    assert!(
        (parts_sum - total).abs() <= 1e-9 + 1e-6 * total,
        "parts {parts_sum} vs gaps {total}"
    );
    let r = scrape(&ra);
    for (name, kind) in ROUTER_SERIES {
        assert_eq!(
            r.types.get(*name).map(String::as_str),
            Some(*kind),
            "router: {name}"
        );
    }
    assert_eq!(r.convention_errors(), Vec::<String>::new(), "router");
    assert_eq!(
        r.value(
            "pdserve_worker_circuit_state",
            &[&format!("worker=\"{da}\""), "state=\"closed\""]
        ),
        Some(1.0)
    );
    assert_eq!(
        r.value(
            "pdserve_worker_circuit_state",
            &[&format!("worker=\"{da}\""), "state=\"open\""]
        ),
        Some(0.0)
    );
    seen.extend(r.types.keys().cloned());
    dashboard_uses_only(&seen);
}

/// Every series the Grafana dashboard queries is one the processes export.
fn dashboard_uses_only(exported: &std::collections::BTreeSet<String>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/pdserve.json"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    collect_exprs(&dash, &mut exprs);
    assert!(
        exprs.len() >= 8,
        "the dashboard has {} queries",
        exprs.len()
    );
    let mut used = std::collections::BTreeSet::new();
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("pdserve_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            used.insert(name);
        }
    }
    assert!(!used.is_empty());
    for name in &used {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|b| exported.contains(*b)))
            .unwrap_or(name);
        assert!(
            exported.contains(family),
            "the dashboard queries {name}, which no process exports"
        );
    }
}

fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => collect_exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_exprs(x, out)),
        _ => {}
    }
}

#[test]
fn router_liveness_does_not_follow_its_workers_and_readiness_does() {
    let (_r, ra) = role("router", &[]);
    let (st, body) = http(&ra, "GET", "/live", None, Duration::from_secs(5));
    assert_eq!((st, body.as_str()), (200, "{\"status\":\"live\"}"));
    let (st, body) = http(&ra, "GET", "/ready", None, Duration::from_secs(5));
    assert_eq!(st, 503, "{body}");
    assert!(body.contains("\"decode_in_rotation\":0"), "{body}");
    // /health keeps its older meaning: 503 without a healthy pair.
    assert_eq!(
        http(&ra, "GET", "/health", None, Duration::from_secs(5)).0,
        503
    );
    let (_p, pa, _) = worker_with_metrics("prefill", &[]);
    let (_d, da, _) = worker_with_metrics("decode", &[]);
    for (address, role) in [(&pa, "prefill"), (&da, "decode")] {
        let body = serde_json::json!({ "address": address, "role": role });
        let (st, b) = http(
            &ra,
            "POST",
            "/workers",
            Some(&body),
            Duration::from_secs(10),
        );
        assert_eq!(st, 201, "{b}");
    }
    wait_status(&ra, "/ready", 200, 10);
}

#[test]
fn a_worker_is_live_while_loading_and_serves_grpc_health_once_ready() {
    let (d, da, dm) = worker_with_metrics("decode", &[]);
    // The side port answers before the model has loaded; readiness follows the engine.
    assert_eq!(
        http(&dm, "GET", "/live", None, Duration::from_secs(5)).0,
        200
    );
    wait_status(&dm, "/ready", 200, 60);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let status = rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{da}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = tonic_health::pb::health_client::HealthClient::new(ch);
        c.check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
    });
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    drop(d);
}

#[test]
fn a_router_takes_its_workers_from_the_discovery_names() {
    let (_p, pa, _) = worker_with_metrics("prefill", &[]);
    let (_d, da, _) = worker_with_metrics("decode", &[]);
    let (_r, ra) = role(
        "router",
        &[
            "--discover-prefill",
            &pa,
            "--discover-decode",
            &da,
            "--discover-interval-s",
            "0.2",
        ],
    );
    wait_status(&ra, "/ready", 200, 60);
    let (ids, _) = complete(&ra, &greedy(&prompt(3, 12), 3)).unwrap();
    assert_eq!(ids.len(), 3);
    let (_, body) = http(&ra, "GET", "/workers", None, Duration::from_secs(5));
    assert!(body.contains(&pa) && body.contains(&da), "{body}");
}
