//! Prefix affinity (for prefill workers): requests sharing a prompt prefix go to the
//! worker that computed it, so its prefix cache serves the shared pages.
//!
//! The router keeps an approximate map from page-aligned prompt prefixes (a hash of the
//! first k pages, k = 1, 2, ...) to the worker last sent that prefix. A request goes to the
//! candidate holding its longest cached prefix that leaves at least one token to compute
//! (the worker's cache hits stop there too). Without a match, or when that worker is
//! overloaded (its queue exceeds the least loaded candidate's by more than
//! `overload_slack`), the request goes to the least loaded candidate. The page size is
//! the one the workers report in their KV layout. The map holds at most `capacity`
//! prefixes; the least recently used half goes when it is full.

use super::least_load::LeastLoad;
use super::{RouteRequest, RoutingPolicy};
use crate::workers::Worker;
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};

/// Page size assumed until a worker reports its layout.
const DEFAULT_PAGE_TOKENS: usize = 256;

#[derive(Debug)]
struct Entry {
    worker: String,
    last_use: u64,
}

#[derive(Debug, Default)]
struct Map {
    entries: HashMap<u64, Entry>,
    tick: u64,
}

#[derive(Debug)]
pub struct PrefixAffinity {
    map: Mutex<Map>,
    fallback: LeastLoad,
    /// How many more queued requests than the least loaded candidate the affine worker
    /// may have before the request goes elsewhere.
    pub overload_slack: u32,
    pub capacity: usize,
}

impl Default for PrefixAffinity {
    fn default() -> Self {
        PrefixAffinity {
            map: Mutex::new(Map::default()),
            fallback: LeastLoad::default(),
            overload_slack: 4,
            capacity: 1 << 18,
        }
    }
}

/// Hashes of the prompt's first 1, 2, ... `pages` pages of `page` tokens.
fn prefix_hashes(prompt: &[u32], page: usize, pages: usize) -> Vec<u64> {
    let mut h = DefaultHasher::new();
    (0..pages)
        .map(|k| {
            prompt[k * page..(k + 1) * page].hash(&mut h);
            h.finish()
        })
        .collect()
}

fn page_tokens(candidates: &[Arc<Worker>]) -> usize {
    candidates
        .iter()
        .find_map(|w| w.page_tokens())
        .filter(|&p| p > 0)
        .unwrap_or(DEFAULT_PAGE_TOKENS)
}

impl PrefixAffinity {
    fn lock(&self) -> std::sync::MutexGuard<'_, Map> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Prefixes remembered (tests, inspection).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The candidate holding the longest usable prefix of `prompt`, and its length in pages.
    fn best(&self, prompt: &[u32], candidates: &[Arc<Worker>]) -> Option<(Arc<Worker>, usize)> {
        let page = page_tokens(candidates);
        let usable = prompt.len().saturating_sub(1) / page;
        let hashes = prefix_hashes(prompt, page, usable);
        let mut map = self.lock();
        map.tick += 1;
        let tick = map.tick;
        for (k, h) in hashes.iter().enumerate().rev() {
            if let Some(e) = map.entries.get_mut(h) {
                if let Some(w) = candidates.iter().find(|w| w.addr == e.worker) {
                    e.last_use = tick;
                    return Some((w.clone(), k + 1));
                }
            }
        }
        None
    }
}

impl RoutingPolicy for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix_affinity"
    }

    fn pick(&self, req: &RouteRequest<'_>, candidates: &[Arc<Worker>]) -> Option<Arc<Worker>> {
        if let Some((w, _)) = self.best(req.prompt, candidates) {
            let least = candidates.iter().map(|c| c.queue()).min().unwrap_or(0);
            if w.queue() <= least + self.overload_slack {
                return Some(w);
            }
            tracing::debug!(worker = %w.addr, queue = w.queue(), least, "affine worker overloaded; balancing");
        }
        self.fallback.pick(req, candidates)
    }

    fn routed(&self, req: &RouteRequest<'_>, worker: &Worker) {
        let page = worker
            .page_tokens()
            .filter(|&p| p > 0)
            .unwrap_or(DEFAULT_PAGE_TOKENS);
        let hashes = prefix_hashes(req.prompt, page, req.prompt.len() / page);
        if hashes.is_empty() {
            return;
        }
        let mut map = self.lock();
        map.tick += 1;
        let tick = map.tick;
        for h in hashes {
            map.entries.insert(
                h,
                Entry {
                    worker: worker.addr.clone(),
                    last_use: tick,
                },
            );
        }
        if map.entries.len() > self.capacity {
            let mut ages: Vec<u64> = map.entries.values().map(|e| e.last_use).collect();
            let mid = ages.len() / 2;
            let (_, cut, _) = ages.select_nth_unstable(mid);
            let cut = *cut;
            map.entries.retain(|_, e| e.last_use > cut);
        }
    }

    fn forget(&self, addr: &str) {
        self.lock().entries.retain(|_, e| e.worker != addr);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::policy::test_support::worker;

    fn prompt(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 1000 + i).collect()
    }

    fn best(p: &PrefixAffinity, q: &[u32], ws: &[Arc<Worker>]) -> Option<(String, usize)> {
        p.best(q, ws).map(|(w, k)| (w.addr.clone(), k))
    }

    #[tokio::test]
    async fn shared_prefixes_follow_the_worker_that_holds_them() {
        let p = PrefixAffinity::default();
        let ws = [worker("a:1", 0, 0, 50), worker("b:1", 0, 0, 50)];
        // 64-token pages (from the reported layout): 150 tokens = 2 full pages.
        let first = prompt(1, 150);
        let r = RouteRequest { prompt: &first };
        let to = p.pick(&r, &ws).unwrap();
        p.routed(&r, &to);
        assert_eq!(p.len(), 2);
        for tail in 0..6u32 {
            let mut q = first[..130].to_vec();
            q.push(90_000 + tail);
            let r = RouteRequest { prompt: &q };
            assert_eq!(p.best(&q, &ws).unwrap().1, 2);
            let got = p.pick(&r, &ws).unwrap();
            assert_eq!(got.addr, to.addr, "request {tail}");
            p.routed(&r, &got);
        }
        // One shared page only still matches; nothing shared falls back to least load.
        let mut one = first[..64].to_vec();
        one.extend([7, 7, 7]);
        assert_eq!(best(&p, &one, &ws).unwrap(), (to.addr.clone(), 1));
        assert!(p.best(&prompt(2, 150), &ws).is_none());
        // A prompt of exactly one page has no usable cached prefix (one token must run).
        assert!(p.best(&first[..64], &ws).is_none());
    }

    #[tokio::test]
    async fn longest_match_wins() {
        let p = PrefixAffinity::default();
        let ws = [worker("a:1", 0, 0, 50), worker("b:1", 0, 0, 50)];
        let base = prompt(3, 200);
        p.routed(
            &RouteRequest {
                prompt: &base[..70],
            },
            &ws[0],
        );
        p.routed(&RouteRequest { prompt: &base }, &ws[1]);
        // b holds 3 pages, a only the first (b overwrote it too): b wins.
        assert_eq!(p.best(&base, &ws).unwrap().0.addr, "b:1");
        p.routed(
            &RouteRequest {
                prompt: &base[..70],
            },
            &ws[0],
        );
        let mut q = base[..140].to_vec();
        q.push(1);
        assert_eq!(best(&p, &q, &ws).unwrap(), ("b:1".into(), 2));
        let mut q = base[..66].to_vec();
        q.push(1);
        assert_eq!(best(&p, &q, &ws).unwrap(), ("a:1".into(), 1));
    }

    #[tokio::test]
    async fn overload_and_departed_workers_fall_back_to_least_load() {
        let p = PrefixAffinity::default();
        let ws = [worker("a:1", 6, 3, 50), worker("b:1", 0, 0, 50)];
        let q = prompt(4, 150);
        p.routed(&RouteRequest { prompt: &q }, &ws[0]);
        // a's queue (9) exceeds b's (0) by more than the slack of 4.
        assert_eq!(
            p.pick(&RouteRequest { prompt: &q }, &ws).unwrap().addr,
            "b:1"
        );
        let ws2 = [worker("a:1", 3, 1, 50), worker("b:1", 0, 0, 50)];
        assert_eq!(
            p.pick(&RouteRequest { prompt: &q }, &ws2).unwrap().addr,
            "a:1"
        );
        // Only candidates count (a not in rotation), and forgetting drops its prefixes.
        assert_eq!(
            p.pick(&RouteRequest { prompt: &q }, &ws2[1..])
                .unwrap()
                .addr,
            "b:1"
        );
        p.forget("a:1");
        assert!(p.is_empty());
    }

    #[tokio::test]
    async fn the_map_is_bounded() {
        let p = PrefixAffinity {
            capacity: 10,
            ..Default::default()
        };
        let w = worker("a:1", 0, 0, 50);
        for s in 0..20 {
            p.routed(
                &RouteRequest {
                    prompt: &prompt(s, 64),
                },
                &w,
            );
            assert!(p.len() <= 10);
        }
        // The most recent prefix survives the trimming.
        let mut q = prompt(19, 64);
        q.push(5);
        assert!(p.best(&q, &[w]).is_some());
    }
}
