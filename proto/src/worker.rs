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
