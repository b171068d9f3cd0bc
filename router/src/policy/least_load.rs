//! Least load: the candidate with the fewest requests queued or running (the worker's
//! last report or this router's own in-flight count, whichever is larger), then the
//! smallest fraction of its KV pool in use; ties go round robin.

use super::{RouteRequest, RoutingPolicy};
use crate::workers::Worker;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug, Default)]
pub struct LeastLoad {
    next: AtomicUsize,
}

/// Lower is less loaded: (queue, permille of pages in use).
pub fn load_key(w: &Worker) -> (u32, u32) {
    (w.queue(), (w.pages_used_fraction() * 1000.0).round() as u32)
}

impl RoutingPolicy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn pick(&self, _req: &RouteRequest<'_>, candidates: &[Arc<Worker>]) -> Option<Arc<Worker>> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| &candidates[(start + k) % n])
            .min_by_key(|w| load_key(w))
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::policy::test_support::worker;

    #[tokio::test]
    async fn picks_the_shortest_queue_then_the_freest_pool() {
        let p = LeastLoad::default();
        let r = RouteRequest { prompt: &[1] };
        let ws = [
            worker("busy:1", 2, 3, 90),
            worker("idle-full:1", 0, 0, 10),
            worker("idle-free:1", 0, 0, 80),
        ];
        for _ in 0..5 {
            assert_eq!(p.pick(&r, &ws).unwrap().addr, "idle-free:1");
        }
        // The router's own in-flight requests count before the next report.
        let _g: Vec<_> = (0..6).map(|_| ws[2].start_request()).collect();
        assert_eq!(p.pick(&r, &ws).unwrap().addr, "idle-full:1");
        drop(_g);
        assert_eq!(p.pick(&r, &ws).unwrap().addr, "idle-free:1");
    }

    #[tokio::test]
    async fn equal_loads_alternate() {
        let p = LeastLoad::default();
        let r = RouteRequest { prompt: &[1] };
        let ws = [worker("a:1", 1, 0, 50), worker("b:1", 1, 0, 50)];
        let a = (0..10)
            .filter(|_| p.pick(&r, &ws).unwrap().addr == "a:1")
            .count();
        assert_eq!(a, 5);
    }
}
