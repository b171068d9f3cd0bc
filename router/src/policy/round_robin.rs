//! Round robin: each candidate in turn.

use super::{RouteRequest, RoutingPolicy};
use crate::workers::Worker;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(&self, _req: &RouteRequest<'_>, candidates: &[Arc<Worker>]) -> Option<Arc<Worker>> {
        if candidates.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        Some(candidates[i % candidates.len()].clone())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::policy::test_support::worker;

    #[tokio::test]
    async fn takes_turns() {
        let ws = [worker("a:1", 0, 0, 10), worker("b:1", 9, 9, 0)];
        let p = RoundRobin::default();
        let r = RouteRequest { prompt: &[1, 2] };
        let got: Vec<String> = (0..4)
            .map(|_| p.pick(&r, &ws).unwrap().addr.clone())
            .collect();
        assert_eq!(got, ["a:1", "b:1", "a:1", "b:1"]);
        assert!(p.pick(&r, &[]).is_none());
    }
}
