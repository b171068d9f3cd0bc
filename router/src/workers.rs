//! The worker set: one lazily connected gRPC channel per worker and a health flag kept
//! fresh by a background loop (and cleared at once when a request finds a worker down).

use crate::ServeError;
use pdserve_proto::pb;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

#[derive(Debug)]
pub struct Worker {
    pub addr: String,
    pub role: Role,
    pub channel: Channel,
    healthy: AtomicBool,
}

impl Worker {
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Record a health observation; logs transitions.
    pub fn set_healthy(&self, ok: bool, why: &str) {
        let was = self.healthy.swap(ok, Ordering::Relaxed);
        if was != ok {
            if ok {
                tracing::info!(addr = %self.addr, role = ?self.role, "worker is up");
            } else {
                tracing::warn!(addr = %self.addr, role = ?self.role, reason = why, "worker is down");
            }
        }
    }
}

#[derive(Debug)]
pub struct Workers {
    pub prefill: Vec<Arc<Worker>>,
    pub decode: Vec<Arc<Worker>>,
}

fn worker(addr: &str, role: Role, connect_timeout: Duration) -> Result<Arc<Worker>, ServeError> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| ServeError::Address {
            addr: addr.to_string(),
            reason: e.to_string(),
        })?
        .connect_timeout(connect_timeout)
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true)
        .connect_lazy();
    Ok(Arc::new(Worker {
        addr: addr.to_string(),
        role,
        channel,
        healthy: AtomicBool::new(false),
    }))
}

impl Workers {
    pub fn new(
        prefill: &[String],
        decode: &[String],
        connect_timeout: Duration,
    ) -> Result<Self, ServeError> {
        Ok(Workers {
            prefill: prefill
                .iter()
                .map(|a| worker(a, Role::Prefill, connect_timeout))
                .collect::<Result<_, _>>()?,
            decode: decode
                .iter()
                .map(|a| worker(a, Role::Decode, connect_timeout))
                .collect::<Result<_, _>>()?,
        })
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<Worker>> {
        self.prefill.iter().chain(&self.decode)
    }

    /// Check every worker's health, each with a deadline of one interval, forever.
    pub async fn health_loop(self: Arc<Self>, interval: Duration) {
        loop {
            let checks = self.all().map(|w| {
                let w = w.clone();
                async move {
                    let mut c = pb::worker_client::WorkerClient::new(w.channel.clone());
                    let r = tokio::time::timeout(
                        interval.max(Duration::from_millis(500)),
                        c.health(pb::Empty {}),
                    )
                    .await;
                    match r {
                        Ok(Ok(h)) if h.get_ref().ok => w.set_healthy(true, ""),
                        Ok(Ok(_)) => w.set_healthy(false, "health check says not ok"),
                        Ok(Err(s)) => w.set_healthy(false, s.message()),
                        Err(_) => w.set_healthy(false, "health check timed out"),
                    }
                }
            });
            futures::future::join_all(checks).await;
            tokio::time::sleep(interval).await;
        }
    }
}
