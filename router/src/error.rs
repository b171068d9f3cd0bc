//! Errors rendered as OpenAI-style JSON bodies with a fitting HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI error `type`.
    pub kind: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(msg: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: msg.into(),
        }
    }

    pub fn not_found(msg: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "not_found_error",
            message: msg.into(),
        }
    }

    pub fn unavailable(msg: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable",
            message: msg.into(),
        }
    }

    pub fn timeout(msg: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "timeout",
            message: msg.into(),
        }
    }

    /// A worker's gRPC status, classified.
    pub fn from_status(s: &tonic::Status, worker: &str) -> Self {
        use tonic::Code;
        let (status, kind) = match s.code() {
            Code::InvalidArgument | Code::OutOfRange => {
                (StatusCode::BAD_REQUEST, "invalid_request_error")
            }
            Code::ResourceExhausted => (StatusCode::SERVICE_UNAVAILABLE, "overloaded"),
            Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"),
            Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
            Code::FailedPrecondition => (StatusCode::BAD_GATEWAY, "worker_mismatch"),
            Code::DataLoss => (StatusCode::BAD_GATEWAY, "data_loss"),
            _ => (StatusCode::BAD_GATEWAY, "worker_error"),
        };
        ApiError {
            status,
            kind,
            message: format!("{worker}: {}", s.message()),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
