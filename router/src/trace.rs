//! Per-request context: the request id (`x-request-id` accepted from the client or
//! generated) on a tracing span around the whole request, echoed in the response header
//! and passed to the workers in gRPC metadata; and the request counter by status.

use crate::metrics;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

pub const HEADER: &str = "x-request-id";

/// The request's id, for handlers (`Extension<RequestId>`).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// The client's id when usable (1..=128 visible ASCII characters), else a new one.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()))
}

const ENDPOINTS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

pub async fn request_context(mut req: Request, next: Next) -> Response {
    let rid = request_id(req.headers());
    let path = req.uri().path().to_string();
    let span = tracing::info_span!("request", request_id = %rid, path = %path);
    req.extensions_mut().insert(RequestId(rid.clone()));
    let mut resp = next.run(req).instrument(span).await;
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert(HEADER, v);
    }
    if let Some(e) = ENDPOINTS.iter().find(|e| **e == path) {
        metrics::request(e, resp.status().as_u16());
    }
    resp
}
