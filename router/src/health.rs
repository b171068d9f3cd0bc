//! The health loop: every interval, ask each worker for `Worker.Info` (with a deadline),
//! feed the answer to its circuit breaker (a draining worker goes out of rotation), keep
//! its load, and record the router's view of each worker as gauges (labels `worker`,
//! `role`) in the global `metrics` recorder: the load it routes by and the circuit state
//! (label `state`). The workers' cumulative figures (transfers, prefix hits) are their own
//! counters, on their own `/metrics`.

use crate::workers::{fetch_info, Worker, Workers};
use pdserve_proto::pb;
use std::sync::Arc;
use std::time::Duration;

/// Check every worker once; each check has a deadline of `deadline`.
pub async fn check_all(workers: &Workers, deadline: Duration) {
    let checks = workers.all().into_iter().map(|w| async move {
        match fetch_info(&w, deadline).await {
            Ok(info) if info.draining => {
                record(&w, &info);
                w.set_info(info);
                w.fail_hard("draining: finishing its requests, taking no new ones");
            }
            Ok(info) => {
                record(&w, &info);
                w.health_ok(info);
            }
            Err(why) => w.fail_hard(&format!("health check: {why}")),
        }
        w.record_circuit();
    });
    futures::future::join_all(checks).await;
}

/// Deadline of one health poll: a worker that does not answer `Info` this fast (stopped,
/// hung, partitioned) leaves rotation.
pub const POLL_DEADLINE: Duration = Duration::from_millis(500);

/// Check every worker's health, forever, a round starting every `interval` (a slow round
/// does not push the next one back by its own length): a worker that stops answering is
/// out of rotation within `interval` + [`POLL_DEADLINE`], 1 s at the default interval.
pub async fn health_loop(workers: Arc<Workers>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        check_all(&workers, POLL_DEADLINE).await;
    }
}

fn record(w: &Worker, i: &pb::WorkerInfo) {
    let (addr, role) = (w.addr.clone(), w.role.name());
    let g = |name: &'static str, v: f64| {
        metrics::gauge!(name, "worker" => addr.clone(), "role" => role).set(v);
    };
    g("pdserve_worker_running", f64::from(i.running));
    g("pdserve_worker_queued", f64::from(i.waiting));
    g(
        "pdserve_worker_kv_pages_used",
        i.total_pages.saturating_sub(i.free_pages) as f64,
    );
    g("pdserve_worker_kv_pages_capacity", i.total_pages as f64);
    g("pdserve_worker_kv_pages_cached", i.cached_pages as f64);
    g("pdserve_worker_host_pages_used", i.host_used_pages as f64);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::circuit::Circuit;
    use crate::workers::Role;

    struct FixedInfo(pb::WorkerInfo);

    #[tonic::async_trait]
    impl pb::worker_server::Worker for FixedInfo {
        async fn info(
            &self,
            _req: tonic::Request<pb::Empty>,
        ) -> Result<tonic::Response<pb::WorkerInfo>, tonic::Status> {
            Ok(tonic::Response::new(self.0.clone()))
        }

        async fn health(
            &self,
            _req: tonic::Request<pb::Empty>,
        ) -> Result<tonic::Response<pb::HealthResponse>, tonic::Status> {
            Ok(tonic::Response::new(pb::HealthResponse { ok: true }))
        }
    }

    #[tokio::test]
    async fn polls_record_load_gauges_and_close_the_circuit() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::set_global_recorder(recorder).unwrap();
        // A real gRPC Worker service reporting fixed figures (the router depends on the
        // wire contract only, not on the servers' runtime).
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let info = pb::WorkerInfo {
            role: "prefill".into(),
            model: "m".into(),
            running: 1,
            waiting: 3,
            total_pages: 100,
            free_pages: 60,
            prefix_hit_device_tokens: 512,
            prefix_hit_host_tokens: 256,
            transfers: 1,
            transfer_bytes: 4096,
            transfer_seconds: 0.25,
            ..Default::default()
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(pb::worker_server::WorkerServer::new(FixedInfo(info)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let ws = Workers::new(
            std::slice::from_ref(&addr),
            &[],
            Duration::from_secs(1),
            None,
        )
        .unwrap();
        check_all(&ws, Duration::from_secs(2)).await;
        let w = ws.find(&addr).unwrap();
        assert_eq!(w.circuit(), Circuit::Closed, "{}", w.last_error());
        assert_eq!(w.queue(), 4);
        assert!((w.pages_used_fraction() - 0.4).abs() < 1e-9);
        type Labels = Vec<(String, String)>;
        let got: Vec<(String, Labels, f64)> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(k, _, _, v)| {
                let key = k.key();
                let labels: Labels = key
                    .labels()
                    .map(|l| (l.key().to_string(), l.value().to_string()))
                    .collect();
                match v {
                    DebugValue::Gauge(g) => Some((key.name().to_string(), labels, g.into_inner())),
                    _ => None,
                }
            })
            .filter(|(_, labels, _)| labels.contains(&("worker".to_string(), addr.clone())))
            .collect();
        let gauge = |name: &str, label: Option<(&str, &str)>| {
            got.iter()
                .find(|(n, labels, _)| {
                    n == name
                        && labels.contains(&("role".to_string(), "prefill".to_string()))
                        && label
                            .is_none_or(|(k, v)| labels.contains(&(k.to_string(), v.to_string())))
                })
                .map(|g| g.2)
                .unwrap_or_else(|| panic!("no gauge {name} {label:?} in {got:?}"))
        };
        assert_eq!(gauge("pdserve_worker_running", None), 1.0);
        assert_eq!(gauge("pdserve_worker_queued", None), 3.0);
        assert_eq!(gauge("pdserve_worker_kv_pages_used", None), 40.0);
        assert_eq!(gauge("pdserve_worker_kv_pages_capacity", None), 100.0);
        let state = |s| gauge("pdserve_worker_circuit_state", Some(("state", s)));
        assert_eq!(state("closed"), 1.0);
        assert_eq!(
            (state("open"), state("half_open"), state("unknown")),
            (0.0, 0.0, 0.0)
        );
        // Cumulative figures are the worker's own counters, not re-exported as gauges.
        assert!(
            !got.iter()
                .any(|(n, ..)| n.contains("transfer") || n.contains("prefix")),
            "{got:?}"
        );
    }

    #[tokio::test]
    async fn a_draining_worker_leaves_rotation_at_the_next_poll() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let info = pb::WorkerInfo {
            role: "decode".into(),
            draining: true,
            ..Default::default()
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(pb::worker_server::WorkerServer::new(FixedInfo(info)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let ws = Workers::new(
            &[],
            std::slice::from_ref(&addr),
            Duration::from_secs(1),
            None,
        )
        .unwrap();
        check_all(&ws, Duration::from_secs(2)).await;
        let w = ws.find(&addr).unwrap();
        assert_eq!(w.circuit(), Circuit::Open);
        assert!(w.last_error().contains("draining"), "{}", w.last_error());
        // It answers, but stays out while it drains.
        check_all(&ws, Duration::from_secs(2)).await;
        assert!(!w.is_healthy());
    }

    #[tokio::test]
    async fn a_worker_that_never_answers_is_opened_within_the_deadline() {
        // Accepts TCP connections (the kernel's backlog) but never speaks HTTP/2.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap().to_string();
        let ws = Workers::new(
            std::slice::from_ref(&addr),
            &[],
            Duration::from_secs(1),
            None,
        )
        .unwrap();
        assert_eq!(ws.prefill()[0].circuit(), Circuit::Unknown);
        let t0 = std::time::Instant::now();
        check_all(&ws, Duration::from_millis(300)).await;
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        let w = ws.find(&addr).unwrap();
        assert_eq!((w.role, w.circuit()), (Role::Prefill, Circuit::Open));
        assert!(
            w.last_error().contains("no answer within"),
            "{}",
            w.last_error()
        );
        assert!(!w.is_healthy());
        drop(silent);
    }
}
