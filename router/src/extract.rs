//! `ApiJson<T>`: a JSON body extractor whose every rejection is an OpenAI-shaped error
//! (axum's own `Json` answers in plain text): wrong content type (415), body over the
//! limit (413), invalid UTF-8, malformed JSON, wrong types and missing fields (400, with
//! `param` naming the field).

use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use serde::de::DeserializeOwned;

/// A request body that is a JSON object; `typed` reads fields out of it.
pub struct ApiJson<T>(pub T);

fn json_content_type(req: &Request) -> bool {
    let Some(ct) = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = ct
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// Parse `bytes` as a JSON object, classifying every failure.
pub fn parse_object(bytes: &[u8]) -> Result<serde_json::Value, ApiError> {
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(ApiError::bad_request(format!(
            "the request body is not valid UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
        .code("invalid_utf8"));
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(
            ApiError::bad_request("the request body is empty; send a JSON object")
                .code("invalid_json"),
        );
    }
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(format!("malformed JSON body: {e}")).code("invalid_json")
    })?;
    if !v.is_object() {
        return Err(
            ApiError::bad_request("the request body must be a JSON object").code("invalid_type"),
        );
    }
    Ok(v)
}

/// Read the fields of `T` out of a parsed body; a wrong type or a missing field names it.
pub fn typed<T: DeserializeOwned>(v: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(classify)
}

/// Parse `bytes` as a `T` (a JSON object).
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    typed(&parse_object(bytes)?)
}

fn classify(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    use serde_json::error::Category;
    let path = e.path().to_string();
    let inner = e.into_inner();
    match inner.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            ApiError::bad_request(format!("malformed JSON body: {inner}")).code("invalid_json")
        }
        Category::Data => {
            let msg = inner.to_string();
            // serde reports a missing field at the parent's path, naming it in backticks.
            if let Some(field) = msg
                .strip_prefix("missing field `")
                .and_then(|r| r.split('`').next())
            {
                let param = if path == "." {
                    field.to_string()
                } else {
                    format!("{path}.{field}")
                };
                return ApiError::invalid(
                    &param,
                    "missing_required_parameter",
                    format!("missing required parameter `{param}`"),
                );
            }
            let msg = msg
                .split(" at line ")
                .next()
                .unwrap_or_default()
                .to_string();
            if path == "." {
                ApiError::bad_request(format!("the request body must be a JSON object: {msg}"))
                    .code("invalid_type")
            } else {
                ApiError::invalid(&path, "invalid_type", format!("`{path}`: {msg}"))
            }
        }
    }
}

/// Whether reading the body failed on the server's body deadline ([`crate::http`]).
fn body_timed_out(e: &axum::extract::rejection::BytesRejection) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

impl<S: Send + Sync> FromRequest<S> for ApiJson<serde_json::Value> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !json_content_type(&req) {
            return Err(ApiError::with_status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "expected `Content-Type: application/json`",
            )
            .code("unsupported_media_type"));
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::with_status(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "the request body is larger than this router accepts (setting max_body_bytes)",
                )
                .code("request_too_large")
            } else if body_timed_out(&e) {
                ApiError::with_status(
                    StatusCode::REQUEST_TIMEOUT,
                    "the request body stalled: no byte arrived within the router's body timeout (setting body_timeout_s)",
                )
                .code("request_timeout")
            } else {
                ApiError::bad_request(format!("reading the request body: {}", e.body_text()))
                    .code("invalid_body")
            }
        })?;
        parse_object(&bytes).map(ApiJson)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct R {
        #[allow(dead_code)]
        prompt: String,
        #[allow(dead_code)]
        max_tokens: Option<i64>,
    }

    #[test]
    fn every_failure_is_classified_with_its_param() {
        let e = parse::<R>(b"{\"prompt\": ").unwrap_err();
        assert_eq!((e.code, e.param), (Some("invalid_json"), None));
        let e = parse::<R>(b"{\"max_tokens\": 3}").unwrap_err();
        assert_eq!(e.code, Some("missing_required_parameter"));
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = parse::<R>(b"{\"prompt\": \"x\", \"max_tokens\": \"many\"}").unwrap_err();
        assert_eq!(e.code, Some("invalid_type"));
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = parse::<R>(b"{\"prompt\": \"\xff\"}").unwrap_err();
        assert_eq!(e.code, Some("invalid_utf8"));
        let e = parse::<R>(b"[1, 2]").unwrap_err();
        assert_eq!((e.code, e.param), (Some("invalid_type"), None));
        let e = parse::<R>(b"{\"prompt\": \"x\"} trailing").unwrap_err();
        assert_eq!(e.code, Some("invalid_json"));
        assert!(parse::<R>(b"{\"prompt\": \"x\"}\n").is_ok());
    }
}
