//! Worker management endpoints:
//! - `GET /workers`: every worker with role, circuit state, last error and reported load;
//! - `POST /workers` with `{"address": "host:port", "role": "prefill"|"decode"}`: add a
//!   worker (201); it must answer `Worker.Info`, have that role and the same model and
//!   KV layout as the current workers (409 naming the differing field otherwise);
//! - `DELETE /workers/{address}`: take a worker out of the set (requests already on it
//!   finish there; new ones go elsewhere).

use crate::error::ApiError;
use crate::workers::{AddError, Role, Worker};
use crate::AppState;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddWorker {
    pub address: String,
    pub role: Role,
}

/// One worker as `GET /workers` shows it.
pub fn describe(w: &Worker) -> serde_json::Value {
    let info = w.info();
    let load = info.as_ref().map(|i| {
        json!({
            "running": i.running,
            "waiting": i.waiting,
            "free_pages": i.free_pages,
            "total_pages": i.total_pages,
            "cached_pages": i.cached_pages,
            "host_used_pages": i.host_used_pages,
            "host_total_pages": i.host_total_pages,
            "prefix_hit_device_tokens": i.prefix_hit_device_tokens,
            "prefix_hit_host_tokens": i.prefix_hit_host_tokens,
            "prefix_miss_tokens": i.prefix_miss_tokens,
            "transfers": i.transfers,
            "transfer_bytes": i.transfer_bytes,
            "transfer_seconds": i.transfer_seconds,
        })
    });
    json!({
        "address": w.addr,
        "role": w.role,
        "circuit": w.circuit(),
        "healthy": w.is_healthy(),
        "last_error": w.last_error(),
        "inflight": w.inflight(),
        "model": info.as_ref().map(|i| i.model.clone()),
        "layout_fingerprint": info.as_ref().and_then(|i| i.layout.as_ref()).map(|l| l.fingerprint.clone()),
        "load": load,
    })
}

pub async fn list(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let all: Vec<_> = state.workers.all().iter().map(|w| describe(w)).collect();
    Json(json!({
        "prefill_policy": state.prefill_policy.name(),
        "decode_policy": state.decode_policy.name(),
        "workers": all,
    }))
}

fn add_error(e: AddError) -> ApiError {
    let msg = e.to_string();
    let (status, kind) = match e {
        AddError::Address(_) | AddError::WrongRole { .. } => {
            (StatusCode::BAD_REQUEST, "invalid_request_error")
        }
        AddError::Duplicate(_) => (StatusCode::CONFLICT, "conflict"),
        AddError::Identity { .. } => (StatusCode::FORBIDDEN, "worker_unauthenticated"),
        AddError::Mismatch { .. } => (StatusCode::CONFLICT, "worker_mismatch"),
        AddError::Unreachable { .. } => (StatusCode::BAD_GATEWAY, "worker_unreachable"),
    };
    ApiError {
        status,
        kind,
        message: msg,
        param: None,
        code: Some(kind),
    }
}

pub async fn add(
    State(state): State<Arc<AppState>>,
    body: Result<Json<AddWorker>, JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => {
            return ApiError::bad_request(format!(
                "POST /workers expects {{\"address\": \"host:port\", \"role\": \"prefill\"|\"decode\"}}: {}",
                e.body_text()
            ))
            .into_response()
        }
    };
    match state.workers.add(&req.address, req.role).await {
        Ok(w) => (StatusCode::CREATED, Json(describe(&w))).into_response(),
        Err(e) => {
            tracing::warn!(address = %req.address, error = %e, "worker not added");
            add_error(e).into_response()
        }
    }
}

pub async fn remove(State(state): State<Arc<AppState>>, Path(address): Path<String>) -> Response {
    match state.workers.remove(&address) {
        Some(w) => {
            state.prefill_policy.forget(&address);
            state.decode_policy.forget(&address);
            Json(describe(&w)).into_response()
        }
        None => ApiError::not_found(format!("no worker {address}")).into_response(),
    }
}
