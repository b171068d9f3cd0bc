//! The decode server: admits a request only when its pages fit (backpressure), pulls the
//! prompt's KV from a prefill server, imports it into its own pool and runs every admitted
//! request in one continuously batched decode loop on a dedicated engine thread.

mod admission;
mod batch;
mod events;
mod logits;
mod service;
mod step_gaps;

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
pub struct DecodeSettings {
    /// Name the model is served under.
    pub model_name: String,
    /// Most requests in the running batch.
    pub max_batch: usize,
    /// Deadline for a request waiting for pages and a batch slot.
    pub admit_timeout: Duration,
    /// Deadline for the prefill server to finish a prompt (queueing and compute, up to
    /// the transfer's header).
    pub transfer_timeout: Duration,
    /// Deadline for each next message of a transfer (heartbeats while the prefill
    /// computes, then the KV): a silent peer frees the request's slot and pages this soon.
    pub transfer_progress_timeout: Duration,
    /// Deadline for connecting to a prefill server.
    pub connect_timeout: Duration,
    /// Deadline for loading the model.
    pub load_timeout: Duration,
    /// On shutdown, how long requests in flight may take to finish before they fail.
    pub drain_timeout: Duration,
    /// Effective configuration, reported by the info RPC.
    pub config: Vec<pb::ConfigEntry>,
    /// Test-only KV scribble (`--debug-kv-scribble`).
    pub debug_kv_scribble: Option<DebugScribble>,
    /// Required on every `Generate` call when set, with the router's grant for its
    /// prefill address, and sent on every pull.
    pub cluster_token: Option<ClusterToken>,
    /// Compiles requests' structured-output grammars; None when the model folder has no
    /// tokenizer.json (such requests are refused).
    pub grammar: Option<Arc<pdserve_grammar::GrammarEnv>>,
    /// Mutual TLS on the gRPC port and on every pull (see [`pdserve_proto::tls`]).
    pub tls: Option<pdserve_proto::tls::ClusterTls>,
}

pub use batch::{DebugScribble, ScribbleKind};

pub use pdserve_worker::{Ports, ServeError};

/// Load the engine with `make_engine` on its own thread, then serve on `ports` until
/// `shutdown` resolves and the requests in flight are drained.
pub async fn serve<B, F>(
    settings: DecodeSettings,
    make_engine: F,
    ports: Ports,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), ServeError>
where
    B: Backend + 'static,
    F: FnOnce() -> Result<Engine<B>, EngineError> + Send + 'static,
{
    let startup = Startup::begin(&settings.model_name, "decode", ports.metrics);
    let load = startup.load.clone();
    let (admits, ready) = batch::spawn(
        make_engine,
        load.clone(),
        startup.life.clone(),
        settings.debug_kv_scribble,
    )?;
    let ready = pdserve_worker::engine_ready(ready, settings.load_timeout).await?;
    load.total_pages
        .store(ready.total_pages as u64, Ordering::Relaxed);
    load.free_pages
        .store(ready.total_pages as u64, Ordering::Relaxed);
    let status = Arc::new(WorkerStatus {
        role: "decode".into(),
        model: settings.model_name.clone(),
        config: settings.config.clone(),
        layout: pdserve_kv_transfer::layout_info(&ready.layout),
        load,
        life: startup.life.clone(),
    });
    let admission = admission::Admission::new(
        ready.total_pages,
        settings.max_batch.min(ready.total_states),
    );
    let svc = service::DecodeService {
        admits,
        layout: Arc::new(ready.layout),
        max_positions: ready.max_positions,
        vocab_size: ready.vocab_size,
        admission: Arc::new(admission),
        settings: settings.clone(),
        status: status.clone(),
    };
    tracing::info!(addr = ?ports.grpc.local_addr().ok(), layout = %status.layout.fingerprint, max_batch = settings.max_batch, "decode server ready");
    let token = settings.cluster_token.clone();
    let role = tonic::service::Routes::new(InterceptedService::new(
        pb::decode_server::DecodeServer::new(svc),
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
