//! Starting and stopping a worker: the side port and metrics recorder before the model
//! loads, then its role's gRPC service next to the `Worker` service and the standard
//! `grpc.health.v1` service; on shutdown, the graceful drain.

use crate::lifecycle::Lifecycle;
use crate::{Load, WorkerService, WorkerStatus};
use pdserve_proto::cluster::ClusterToken;
use pdserve_proto::pb;
use pdserve_proto::tls::ClusterTls;
use std::sync::Arc;
use std::time::Duration;
use tonic_health::ServingStatus;

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

/// The sockets a worker serves on, bound by the caller (which prints their addresses).
#[derive(Debug)]
pub struct Ports {
    /// The role's gRPC service, `Worker` and `grpc.health.v1`.
    pub grpc: tokio::net::TcpListener,
    /// The HTTP side port (`/metrics`, `/live`, `/ready`); none: not served.
    pub metrics: Option<tokio::net::TcpListener>,
}

/// After the drain deadline, how long the aborted requests get to send their error and
/// the gRPC server to close its connections.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// What a worker has before its engine loads: its live counters, its phase, and the side
/// port already answering (`/live` 200, `/ready` 503 until [`serve_grpc`] starts).
pub struct Startup {
    pub load: Arc<Load>,
    pub life: Arc<Lifecycle>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Startup {
    /// Install the metrics recorder (labels `model_name`, `role`) and serve the side port
    /// when one is given. Call before spawning the engine thread.
    pub fn begin(model_name: &str, role: &str, metrics: Option<tokio::net::TcpListener>) -> Self {
        if let Err(e) = crate::metrics::install(model_name, role) {
            tracing::warn!(error = e, "worker metrics are unavailable");
        }
        let load = Arc::new(Load::default());
        let life = Arc::new(Lifecycle::default());
        let mut tasks = vec![tokio::spawn(crate::metrics::upkeep(Duration::from_secs(5)))];
        if let Some(l) = metrics {
            tasks.push(tokio::spawn(crate::http::serve(
                l,
                load.clone(),
                life.clone(),
            )));
        }
        Startup { load, life, tasks }
    }
}

impl Drop for Startup {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
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

/// Mark the worker ready and serve `role` (the role's own gRPC service), the `Worker`
/// service reporting `status` and `grpc.health.v1` on `listener`. When `shutdown`
/// resolves, drain: report not ready (health `NOT_SERVING`, `/ready` 503, `Worker.Info`
/// `draining`), refuse new requests (the services check [`Lifecycle::enter`]), wait up to
/// `drain_timeout` for those in flight, then abort the rest (they fail with UNAVAILABLE)
/// and stop. HTTP/2 keepalives of 1 s (2 s timeout) let both ends notice a dead peer.
///
/// A connection carries at most [`MAX_STREAMS_PER_CONNECTION`] concurrent calls (the router
/// multiplexes all its requests to a worker over one connection, so this bounds one peer,
/// not the cluster), and a message of any service is bounded by its server's decoding
/// limit. `token` answers identity challenges on `Worker.Info`; the role's own service
/// checks it on every call (see [`pdserve_proto::cluster`]), wrapped by the role. With
/// `tls`, every connection must complete a mutual TLS handshake first (a client
/// certificate under the cluster CA; see [`pdserve_proto::tls`]).
pub async fn serve_grpc(
    role: tonic::service::Routes,
    status: Arc<WorkerStatus>,
    token: Option<ClusterToken>,
    tls: Option<&ClusterTls>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
    drain_timeout: Duration,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let life = status.life.clone();
    let routes = role
        .add_service(pb::worker_server::WorkerServer::new(WorkerService(
            status, token,
        )))
        .add_service(health_service);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = tls {
        builder = builder.tls_config(t.server())?;
    }
    let server = builder
        .http2_keepalive_interval(Some(Duration::from_secs(1)))
        .http2_keepalive_timeout(Some(Duration::from_secs(2)))
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .add_routes(routes)
        .serve_with_incoming_shutdown(
            no_delay(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            async {
                let _ = stopped.await;
            },
        );
    tokio::pin!(server);
    life.set_ready();
    health.set_service_status("", ServingStatus::Serving).await;
    tokio::select! {
        r = &mut server => return Ok(r?),
        _ = shutdown => {}
    }
    life.start_drain();
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    let drain = drain(&life, drain_timeout);
    tokio::select! {
        r = &mut server => return Ok(r?),
        _ = drain => {}
    }
    let _ = stop.send(());
    match tokio::time::timeout(CLOSE_GRACE, server).await {
        Ok(r) => r?,
        Err(_) => tracing::warn!("connections still open {CLOSE_GRACE:?} after the drain; exiting"),
    }
    Ok(())
}

/// Accepted connections with Nagle's algorithm off (tonic's `tcp_nodelay` default does
/// not reach connections served from an incoming stream). With it on, a small write (a
/// prefill's header, its last chunk, a token) waits for the peer's ACK of the previous
/// one, which Linux delays by up to 40 ms: measured as ~38 ms of "KV transfer" in every
/// time to first token of a tiny model's cluster.
pub fn no_delay(
    incoming: tokio_stream::wrappers::TcpListenerStream,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    incoming.map(|conn| {
        let conn = conn?;
        // A connection that refuses the option is still served, only slower.
        if let Err(e) = conn.set_nodelay(true) {
            tracing::warn!(error = %e, "TCP_NODELAY not set on an accepted connection");
        }
        Ok(conn)
    })
}

/// Wait for the requests in flight; past `timeout`, fail them and wait [`CLOSE_GRACE`]
/// more for their error to go out.
async fn drain(life: &Lifecycle, timeout: Duration) {
    tracing::info!(
        in_flight = life.inflight(),
        timeout_s = timeout.as_secs_f64(),
        "draining"
    );
    if life.wait_idle(timeout).await {
        tracing::info!("drained: every request finished");
        return;
    }
    tracing::warn!(
        in_flight = life.inflight(),
        "drain timeout passed; failing the requests still in flight"
    );
    life.abort();
    if !life.wait_idle(CLOSE_GRACE).await {
        tracing::warn!(
            in_flight = life.inflight(),
            "requests still in flight after the abort"
        );
    }
}
