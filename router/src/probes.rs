//! Probes for orchestrators: `GET /live` answers 200 whenever the process serves HTTP,
//! whatever its workers do (a liveness probe must not restart a healthy router during a
//! worker outage), and `GET /ready` answers 200 only when a request could be routed now
//! (a prefill and a decode worker in rotation), 503 otherwise. `GET /health` keeps its
//! older meaning (per-worker detail; 503 when no pair is healthy) for existing clients.

use crate::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;

pub async fn live() -> Json<serde_json::Value> {
    Json(json!({ "status": "live" }))
}

pub async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let count = |ws: Vec<Arc<crate::Worker>>| ws.iter().filter(|w| w.is_healthy()).count();
    let (prefill, decode) = (
        count(state.workers.prefill()),
        count(state.workers.decode()),
    );
    let ready = prefill > 0 && decode > 0;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "prefill_in_rotation": prefill,
        "decode_in_rotation": decode,
    });
    (code, Json(body)).into_response()
}
