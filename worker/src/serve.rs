//! Starting a worker: wait for its engine thread to load the model, then serve its role's
//! gRPC service next to the `Worker` service until shutdown.

use crate::{WorkerService, WorkerStatus};
use pdserve_proto::cluster::ClusterToken;
use pdserve_proto::pb;
use std::sync::Arc;
use std::time::Duration;

/// Concurrent gRPC calls one connection may hold open on a worker: well above a decode
/// server's batch and a prefill server's queue, far below what would exhaust memory.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;

/// Why a prefill or decode server could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("loading the model: {0}")]
    Load(Box<dyn std::error::Error + Send + Sync>),
    #[error("the engine thread stopped while loading the model")]
    EngineGone,
    #[error("loading the model took longer than {0:?}")]
    LoadTimeout(std::time::Duration),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("starting the engine thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// Wait (at most `timeout`) for a server's engine thread to report the model loaded.
pub async fn engine_ready<R, E>(
    ready: tokio::sync::oneshot::Receiver<Result<R, E>>,
    timeout: std::time::Duration,
) -> Result<R, ServeError>
where
    E: std::error::Error + Send + Sync + 'static,
{
    tokio::time::timeout(timeout, ready)
        .await
        .map_err(|_| ServeError::LoadTimeout(timeout))?
        .map_err(|_| ServeError::EngineGone)?
        .map_err(|e| ServeError::Load(Box::new(e)))
}

/// Serve `role` (the role's own gRPC service) and the `Worker` service reporting `status`
/// on `listener` until `shutdown` resolves. HTTP/2 keepalives of 1 s (2 s timeout) let
/// both ends notice a dead peer mid-stream. A connection carries at most
/// [`MAX_STREAMS_PER_CONNECTION`] concurrent calls (the router multiplexes all its requests
/// to a worker over one connection, so this bounds one peer, not the cluster), and a
/// message of any service is bounded by its server's decoding limit.
///
/// `token` answers identity challenges on `Worker.Info`; the role's own service checks
/// it on every call (see [`pdserve_proto::cluster`]), wrapped by the role.
pub async fn serve_grpc(
    role: tonic::service::Routes,
    status: Arc<WorkerStatus>,
    token: Option<ClusterToken>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let routes = role.add_service(pb::worker_server::WorkerServer::new(WorkerService(
        status, token,
    )));
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(1)))
        .http2_keepalive_timeout(Some(Duration::from_secs(2)))
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .add_routes(routes)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await?;
    Ok(())
}
