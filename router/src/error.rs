//! Errors rendered as OpenAI-style JSON bodies with a fitting HTTP status:
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI error `type`.
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `invalid_value`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, msg: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: msg.into(),
            param: None,
            code: None,
        }
    }

    pub fn bad_request(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", msg)
    }

    /// A 400 about one request field.
    pub fn invalid(param: &str, code: &'static str, msg: impl Into<String>) -> Self {
        Self::bad_request(msg).param(param).code(code)
    }

    pub fn not_found(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", msg)
    }

    pub fn unavailable(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", msg)
    }

    pub fn timeout(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", msg)
    }

    pub fn with_status(status: StatusCode, msg: impl Into<String>) -> Self {
        Self::new(status, "invalid_request_error", msg)
    }

    pub fn param(mut self, p: impl Into<String>) -> Self {
        self.param = Some(p.into());
        self
    }

    pub fn code(mut self, c: &'static str) -> Self {
        self.code = Some(c);
        self
    }

    /// A worker's gRPC status, classified: THE mapping from gRPC codes to HTTP. Only the
    /// client's own mistakes are 4xx; a worker's bug (INTERNAL) is a 500, never a 400.
    pub fn from_status(s: &tonic::Status, worker: &str) -> Self {
        use tonic::Code;
        let (status, kind) = match s.code() {
            Code::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
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
        Self::new(status, kind, format!("{worker}: {}", s.message()))
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn worker_statuses_map_to_http_by_class() {
        let cases = [
            (Code::InvalidArgument, 400, "invalid_request_error"),
            (Code::OutOfRange, 400, "invalid_request_error"),
            (Code::ResourceExhausted, 503, "overloaded"),
            (Code::Unavailable, 503, "service_unavailable"),
            (Code::DeadlineExceeded, 504, "timeout"),
            (Code::FailedPrecondition, 502, "worker_mismatch"),
            (Code::DataLoss, 502, "data_loss"),
            (Code::Internal, 500, "server_error"),
            (Code::Unknown, 502, "worker_error"),
        ];
        for (code, http, kind) in cases {
            let e = ApiError::from_status(&tonic::Status::new(code, "why"), "decode worker d:1");
            assert_eq!((e.status.as_u16(), e.kind), (http, kind), "{code:?}");
            assert_eq!(e.message, "decode worker d:1: why");
        }
    }
}
