//! The `Worker` service every prefill and decode server exposes: info and health.

use crate::pb;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// A worker's fixed description and live load counters.
#[derive(Debug, Default)]
pub struct WorkerStatus {
    pub role: String,
    pub model: String,
    /// Effective configuration with the source of each value.
    pub config: Vec<pb::ConfigEntry>,
    pub layout: pb::KvLayoutInfo,
    pub load: Arc<Load>,
}

/// Live counters, shared with the engine thread.
#[derive(Debug, Default)]
pub struct Load {
    pub running: AtomicU32,
    pub waiting: AtomicU32,
    pub free_pages: AtomicU64,
    pub total_pages: AtomicU64,
    pub cached_pages: AtomicU64,
    pub host_used_pages: AtomicU64,
    pub host_total_pages: AtomicU64,
    pub prefix_hit_device_tokens: AtomicU64,
    pub prefix_hit_host_tokens: AtomicU64,
    pub prefix_miss_tokens: AtomicU64,
    pub transfers: AtomicU64,
    pub transfer_bytes: AtomicU64,
    pub transfer_micros: AtomicU64,
}

impl Load {
    /// Count one finished KV transfer.
    pub fn add_transfer(&self, bytes: u64, took: std::time::Duration) {
        self.transfers.fetch_add(1, Ordering::Relaxed);
        self.transfer_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.transfer_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }
}

impl WorkerStatus {
    pub fn info(&self) -> pb::WorkerInfo {
        pb::WorkerInfo {
            role: self.role.clone(),
            model: self.model.clone(),
            config: self.config.clone(),
            layout: Some(self.layout.clone()),
            running: self.load.running.load(Ordering::Relaxed),
            waiting: self.load.waiting.load(Ordering::Relaxed),
            free_pages: self.load.free_pages.load(Ordering::Relaxed),
            total_pages: self.load.total_pages.load(Ordering::Relaxed),
            cached_pages: self.load.cached_pages.load(Ordering::Relaxed),
            host_used_pages: self.load.host_used_pages.load(Ordering::Relaxed),
            host_total_pages: self.load.host_total_pages.load(Ordering::Relaxed),
            prefix_hit_device_tokens: self.load.prefix_hit_device_tokens.load(Ordering::Relaxed),
            prefix_hit_host_tokens: self.load.prefix_hit_host_tokens.load(Ordering::Relaxed),
            prefix_miss_tokens: self.load.prefix_miss_tokens.load(Ordering::Relaxed),
            transfers: self.load.transfers.load(Ordering::Relaxed),
            transfer_bytes: self.load.transfer_bytes.load(Ordering::Relaxed),
            transfer_seconds: self.load.transfer_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

pub struct WorkerService(pub Arc<WorkerStatus>);

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn info(
        &self,
        _req: tonic::Request<pb::Empty>,
    ) -> Result<tonic::Response<pb::WorkerInfo>, tonic::Status> {
        Ok(tonic::Response::new(self.0.info()))
    }

    async fn health(
        &self,
        _req: tonic::Request<pb::Empty>,
    ) -> Result<tonic::Response<pb::HealthResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::HealthResponse { ok: true }))
    }
}

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
