//! Routing policies: which prefill and decode worker serve a request.

use crate::workers::{Role, Worker};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Picks one worker of a role among candidates (healthy, not yet tried for this request).
pub trait RoutingPolicy: Send + Sync {
    fn pick(&self, role: Role, candidates: &[Arc<Worker>]) -> Option<Arc<Worker>>;
}

/// Round robin per role.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: [AtomicUsize; 2],
}

impl RoutingPolicy for RoundRobin {
    fn pick(&self, role: Role, candidates: &[Arc<Worker>]) -> Option<Arc<Worker>> {
        if candidates.is_empty() {
            return None;
        }
        let i = self.next[role as usize].fetch_add(1, Ordering::Relaxed);
        Some(candidates[i % candidates.len()].clone())
    }
}
