//! The router's HTTP/1.1 server, with the limits a slow or hostile client hits:
//! - a header deadline: a client that has not sent a whole request head within
//!   `header_timeout` (1 byte/s slowloris included) is disconnected, and the same
//!   deadline closes idle keep-alive connections (hyper's `header_read_timeout` runs
//!   while a connection waits for its next request);
//! - a body deadline: a body that goes `body_timeout` without a byte (a chunk announced,
//!   then silence) fails the request with 408;
//! - at most `max_connections` open connections; more wait in the kernel's accept queue;
//! - the body size itself is counted as it streams by the routes' `DefaultBodyLimit`.
//!
//! Framing errors (a bad Content-Length, a header without a colon, HTTP/9.9) are
//! answered by hyper with a bare 400 and no body before any route runs.

use hyper_util::rt::{TokioIo, TokioTimer};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            max_connections: 4096,
        }
    }
}

/// How long connections still open at shutdown may finish their requests.
const DRAIN: Duration = Duration::from_secs(5);

/// Serve `app` on `listener` with `limits` until `shutdown` resolves, then let open
/// connections finish (at most [`DRAIN`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let svc = tower_http::timeout::RequestBodyTimeout::new(app, limits.body_timeout);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Streamed tokens are small writes: with Nagle's algorithm on, each waits for the
        // client's (delayed, up to 40 ms) ACK of the one before.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!(error = %e, "TCP_NODELAY not set on a client connection");
        }
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(
                TokioIo::new(stream),
                hyper_util::service::TowerToHyperService::new(svc.clone()),
            );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _slot = permit;
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "client connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open {DRAIN:?} after shutdown; closing them");
    }
    Ok(())
}
