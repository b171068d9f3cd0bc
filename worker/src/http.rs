//! The worker's HTTP side port (`--metrics-listen`): `GET /metrics` (Prometheus text),
//! `GET /live` (the process answers: 200 from the moment it listens) and `GET /ready`
//! (200 once the engine is loaded and its pool allocated, 503 while loading or draining),
//! so Kubernetes and Prometheus reach every worker without speaking gRPC.

use crate::lifecycle::{Lifecycle, Phase};
use crate::metrics::{
    KV_CACHE_USAGE, KV_PAGES_CACHED, KV_PAGES_FREE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING,
    WORKER_PHASE,
};
use crate::status::Load;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::atomic::Ordering;
use std::sync::Arc;

#[derive(Clone)]
struct Side {
    load: Arc<Load>,
    life: Arc<Lifecycle>,
}

/// The side port's routes.
pub fn app(load: Arc<Load>, life: Arc<Lifecycle>) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/live", get(live))
        .route("/ready", get(ready))
        .with_state(Side { load, life })
}

/// Serve the side port until the task is dropped (it outlives the drain: probes and
/// scrapes keep answering until the process exits).
pub async fn serve(listener: tokio::net::TcpListener, load: Arc<Load>, life: Arc<Lifecycle>) {
    if let Err(e) = axum::serve(listener, app(load, life)).await {
        tracing::error!(error = %e, "metrics side port stopped");
    }
}

/// Set the gauges from the live counters and the phase (at scrape time: one reading of
/// the same atomics `Worker.Info` reports).
fn publish(load: &Load, life: &Lifecycle) {
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    metrics::gauge!(NUM_REQUESTS_RUNNING).set(f64::from(load.running.load(Ordering::Relaxed)));
    metrics::gauge!(NUM_REQUESTS_WAITING).set(f64::from(load.waiting.load(Ordering::Relaxed)));
    let (total, free, cached) = (
        get(&load.total_pages),
        get(&load.free_pages),
        get(&load.cached_pages),
    );
    metrics::gauge!(KV_PAGES_FREE).set(free);
    metrics::gauge!(KV_PAGES_CACHED).set(cached);
    let held = (total - free - cached).max(0.0);
    metrics::gauge!(KV_CACHE_USAGE).set(if total > 0.0 { held / total } else { 0.0 });
    let now = life.phase();
    for p in Phase::ALL {
        metrics::gauge!(WORKER_PHASE, "phase" => p.name()).set(if p == now { 1.0 } else { 0.0 });
    }
}

/// The Prometheus text of every series in the process, gauges refreshed first.
fn render(load: &Load, life: &Lifecycle) -> Result<String, &'static str> {
    let h = crate::metrics::handle()?;
    publish(load, life);
    h.run_upkeep();
    Ok(h.render())
}

async fn metrics(State(s): State<Side>) -> Response {
    match render(&s.load, &s.life) {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "error": e })),
        )
            .into_response(),
    }
}

async fn live() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "live" }))
}

async fn ready(State(s): State<Side>) -> Response {
    let phase = s.life.phase();
    let code = if phase == Phase::Ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({ "status": phase.name(), "in_flight": s.life.inflight() });
    (code, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        let status = raw.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, raw)
    }

    #[tokio::test]
    async fn ready_follows_the_phase_and_live_does_not() {
        let life = Arc::new(Lifecycle::default());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, Arc::new(Load::default()), life.clone()));
        let (st, body) = get(addr, "/ready").await;
        assert_eq!(st, 503);
        assert!(body.contains("\"status\":\"loading\""), "{body}");
        assert_eq!(get(addr, "/live").await.0, 200);
        life.set_ready();
        assert_eq!(get(addr, "/ready").await.0, 200);
        life.start_drain();
        let (st, body) = get(addr, "/ready").await;
        assert_eq!(st, 503);
        assert!(body.contains("\"status\":\"draining\""), "{body}");
        assert_eq!(get(addr, "/live").await.0, 200);
    }
}
