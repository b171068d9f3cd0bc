//! The prefill server: runs prompts on its engine (one dedicated thread) and streams each
//! prompt's KV pages, state and last logits to the decode server that asked, after
//! checking that the decode server's KV layout equals its own.

// The engine's own error type passes through unboxed, as the engine returns it.
#![allow(clippy::result_large_err)]

mod engine_thread;
mod service;

use pdserve_engine::backend::Backend;
use pdserve_engine::{Engine, EngineError};
use pdserve_proto::cluster::{ClusterToken, RequireToken};
use pdserve_proto::pb;
use pdserve_worker::{Startup, WorkerStatus};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tonic::service::interceptor::InterceptedService;

#[derive(Debug, Clone)]
pub struct PrefillSettings {
    /// Name the model is served under.
    pub model_name: String,
    /// Prefill chunk size in tokens (0: whole prompt in one forward).
    pub chunked_prefill_size: usize,
    /// Pages of the host (hierarchical cache) pool behind the prefix cache; 0: no host
    /// tier (evicted prefixes are dropped).
    pub host_pages: usize,
    /// Largest page chunk on the wire.
    pub transfer_chunk_bytes: usize,
    /// Deadline for one prefill, queueing included.
    pub request_timeout: Duration,
    /// Deadline for loading the model.
    pub load_timeout: Duration,
    /// On shutdown, how long requests in flight may take to finish before they fail.
    pub drain_timeout: Duration,
    /// Effective configuration, reported by the info RPC.
    pub config: Vec<pb::ConfigEntry>,
    /// Required on every `Prefill` call when set.
    pub cluster_token: Option<ClusterToken>,
    /// Mutual TLS on the gRPC port (a client certificate under the CA required).
    pub tls: Option<pdserve_proto::tls::ClusterTls>,
}

pub use pdserve_worker::{Ports, ServeError};

/// Load the engine with `make_engine` on its own thread, then serve on `ports` until
/// `shutdown` resolves and the requests in flight are drained.
pub async fn serve<B, F>(
    settings: PrefillSettings,
    make_engine: F,
    ports: Ports,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError>
where
    B: Backend + 'static,
    F: FnOnce() -> Result<Engine<B>, EngineError> + Send + 'static,
{
    let startup = Startup::begin(&settings.model_name, "prefill", ports.metrics);
    let load = startup.load.clone();
    let (jobs, ready) = engine_thread::spawn(
        make_engine,
        settings.chunked_prefill_size,
        settings.host_pages,
        load.clone(),
    )?;
    let ready = pdserve_worker::engine_ready(ready, settings.load_timeout).await?;
    load.total_pages
        .store(ready.total_pages as u64, Ordering::Relaxed);
    let status = Arc::new(WorkerStatus {
        role: "prefill".into(),
        model: settings.model_name.clone(),
        config: settings.config.clone(),
        layout: pdserve_kv_transfer::layout_info(&ready.layout),
        load,
        life: startup.life.clone(),
    });
    let svc = service::PrefillService {
        jobs,
        layout: Arc::new(ready.layout),
        settings: settings.clone(),
        status: status.clone(),
    };
    tracing::info!(addr = ?ports.grpc.local_addr().ok(), layout = %status.layout.fingerprint, "prefill server ready");
    let token = settings.cluster_token.clone();
    let role = tonic::service::Routes::new(InterceptedService::new(
        pb::prefill_server::PrefillServer::new(svc)
            .max_encoding_message_size(usize::MAX)
            .max_decoding_message_size(64 << 20),
        RequireToken(token.clone()),
    ));
    let drain_timeout = settings.drain_timeout;
    pdserve_worker::serve_grpc(
        role,
        status,
        token,
        settings.tls.as_ref(),
        ports.grpc,
        shutdown,
        drain_timeout,
    )
    .await
}
