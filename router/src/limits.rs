//! Load limits that keep one client (or a burst) from starving the rest:
//! - [`ConcurrencyLimit`]: at most `--max-concurrent-requests` completions in flight
//!   (the slot is held until the response body, a stream included, is dropped); past it a
//!   429 with `Retry-After`, at once, instead of queueing without bound;
//! - [`Tokenizers`]: prompt preparation (JSON fields, chat template, tokenization) runs on
//!   blocking threads, at most one per core at a time, so the async threads that answer
//!   health polls and stream tokens never wait behind a 2 MB prompt;
//! - [`prompt_bytes_limit`]: a text prompt longer than the context could hold even at the
//!   vocabulary's longest token is refused before it is tokenized.

use crate::error::ApiError;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Seconds a refused client is told to wait.
const RETRY_AFTER_S: u32 = 1;

pub struct ConcurrencyLimit {
    slots: Arc<Semaphore>,
    max: usize,
}

impl ConcurrencyLimit {
    pub fn new(max: usize) -> Self {
        ConcurrencyLimit {
            slots: Arc::new(Semaphore::new(max)),
            max,
        }
    }
}

/// Middleware on the completion endpoints.
pub async fn limit_concurrency(
    State(limit): State<Arc<ConcurrencyLimit>>,
    req: Request,
    next: Next,
) -> Response {
    let Ok(permit) = limit.slots.clone().try_acquire_owned() else {
        tracing::warn!(
            max = limit.max,
            "request refused: too many concurrent requests"
        );
        let mut resp = ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "requests",
            message: format!(
                "this router serves at most {} requests at once (--max-concurrent-requests); retry after {RETRY_AFTER_S} s",
                limit.max
            ),
            param: None,
            code: Some("rate_limit_exceeded"),
        }
        .into_response();
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        return resp;
    };
    // The slot is released when the body (a whole SSE stream) is done or dropped.
    next.run(req).await.map(|inner| {
        Body::new(Held {
            inner,
            _permit: permit,
        })
    })
}

/// A response body holding a request slot until it is dropped; frames, size hint and
/// end of stream pass through unchanged (so `Content-Length` is kept).
struct Held {
    inner: Body,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl http_body::Body for Held {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The blocking-thread pool for prompt preparation, bounded by a semaphore.
pub struct Tokenizers {
    slots: Arc<Semaphore>,
    /// Longest wait for a slot (then 503).
    wait: Duration,
}

impl Tokenizers {
    pub fn new(concurrency: usize, wait: Duration) -> Self {
        Tokenizers {
            slots: Arc::new(Semaphore::new(concurrency.max(1))),
            wait,
        }
    }

    /// One slot per CPU core (the work is CPU-bound).
    pub fn per_core(wait: Duration) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new(cores, wait)
    }

    /// Run `f` on a blocking thread once a slot is free.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = tokio::time::timeout(self.wait, self.slots.clone().acquire_owned())
            .await
            .map_err(|_| {
                ApiError::unavailable(format!(
                    "the router's tokenizers were busy for {:?}; retry",
                    self.wait
                ))
            })?
            .map_err(|_| ApiError::unavailable("the router is shutting down"))?;
        tokio::task::spawn_blocking(move || {
            let _held = permit;
            f()
        })
        .await
        .map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: format!("preparing the prompt failed: {e}"),
            param: None,
            code: None,
        })?
    }
}

/// The longest text prompt (in bytes) that could still fit `context` tokens when every
/// token is the vocabulary's longest (`max_token_bytes`), with a factor of 2 for
/// normalizers that shrink text before it is split.
pub fn prompt_bytes_limit(context: usize, max_token_bytes: usize) -> usize {
    context.saturating_mul(max_token_bytes).saturating_mul(2)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn tokenizer_slots_bound_concurrency_and_waits_have_a_deadline() {
        let t = Arc::new(Tokenizers::new(1, Duration::from_millis(50)));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let busy = tokio::spawn({
            let t = t.clone();
            async move {
                t.run(move || {
                    let _ = rx.recv();
                    Ok(1)
                })
                .await
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let e = t.run(|| Ok(2)).await.unwrap_err();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        tx.send(()).unwrap();
        assert_eq!(busy.await.unwrap().unwrap(), 1);
        assert_eq!(t.run(|| Ok(3)).await.unwrap(), 3);
    }

    #[test]
    fn prompt_limit_scales_with_context_and_longest_token() {
        assert_eq!(prompt_bytes_limit(4096, 16), 131072);
        assert_eq!(prompt_bytes_limit(usize::MAX, 16), usize::MAX);
    }
}
