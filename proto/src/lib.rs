//! The wire contract between the router, the prefill and the decode servers: gRPC
//! messages and services (generated from `proto/pdserve.proto` by protox +
//! tonic-prost-build) and the metadata keys they carry. The runtime that serves them is
//! `pdserve-worker`.

#[allow(clippy::all, clippy::unwrap_used, clippy::expect_used)]
pub mod pb {
    tonic::include_proto!("pdserve.v1");
}

/// The most alternatives a request may ask log-probabilities for (`top_logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// gRPC metadata key carrying a request's id across processes.
pub const REQUEST_ID: &str = "x-request-id";

/// Metadata key a decode server sets (value `prefill`) on a status its prefill server caused.
pub const FAILED_WORKER: &str = "x-pdserve-failed";

/// The request id from incoming metadata, or "-" when absent.
pub fn request_id<T>(req: &tonic::Request<T>) -> String {
    req.metadata()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string()
}

/// Attach a request id to an outgoing request (ids that are not valid metadata are dropped).
pub fn with_request_id<T>(msg: T, id: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Ok(v) = id.parse() {
        req.metadata_mut().insert(REQUEST_ID, v);
    }
    req
}

pub mod cluster;
pub mod tls;
