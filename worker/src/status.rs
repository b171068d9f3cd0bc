//! The `Worker` service every prefill and decode server exposes: info and health.

use crate::lifecycle::{Lifecycle, Phase};
use pdserve_proto::cluster::{self, ClusterToken};
use pdserve_proto::pb;
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
    /// Loading, ready or draining, and the requests in flight.
    pub life: Arc<Lifecycle>,
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
    /// Count one finished KV transfer (here and in the process's metrics).
    pub fn add_transfer(&self, bytes: u64, took: std::time::Duration) {
        crate::metrics::transfer(bytes, took);
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
            draining: self.life.phase() == Phase::Draining,
        }
    }
}

/// The `Worker` service, with the cluster token (if any) to answer identity challenges.
pub struct WorkerService(pub Arc<WorkerStatus>, pub Option<ClusterToken>);

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    /// Open to any caller; a caller's challenge is answered with the token's proof.
    async fn info(
        &self,
        req: tonic::Request<pb::Empty>,
    ) -> Result<tonic::Response<pb::WorkerInfo>, tonic::Status> {
        let challenge = req
            .metadata()
            .get(cluster::CHALLENGE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let mut resp = tonic::Response::new(self.0.info());
        if let (Some(t), Some(c)) = (&self.1, challenge) {
            if let Ok(v) = t.prove(&c).parse() {
                resp.metadata_mut().insert(cluster::PROOF, v);
            }
        }
        Ok(resp)
    }

    async fn health(
        &self,
        _req: tonic::Request<pb::Empty>,
    ) -> Result<tonic::Response<pb::HealthResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::HealthResponse { ok: true }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn info_reports_the_live_counters() {
        let status = WorkerStatus {
            role: "prefill".into(),
            model: "m".into(),
            ..Default::default()
        };
        let l = &status.load;
        l.running.store(1, Ordering::Relaxed);
        l.waiting.store(3, Ordering::Relaxed);
        l.prefix_hit_host_tokens.store(256, Ordering::Relaxed);
        l.add_transfer(4096, std::time::Duration::from_millis(250));
        l.add_transfer(1024, std::time::Duration::from_millis(250));
        let i = status.info();
        assert_eq!((i.role.as_str(), i.model.as_str()), ("prefill", "m"));
        assert_eq!(
            (i.running, i.waiting, i.prefix_hit_host_tokens),
            (1, 3, 256)
        );
        assert_eq!((i.transfers, i.transfer_bytes), (2, 5120));
        assert_eq!(i.transfer_seconds, 0.5);
        assert!(!i.draining);
        status.life.start_drain();
        assert!(status.info().draining);
    }
}
