//! The prefix cache: a radix tree over token ids whose edges are one page of tokens.
//!
//! Cut points are the multiples of `page_tokens` (itself a multiple of every compress
//! rate), so a cached prefix is a chain of FULL pages, shared between sequences by
//! reference count (a page is never written again once a sequence has moved past it),
//! plus a snapshot of the state slot (compressor rings and sliding window) taken at the
//! cut and copied into the new sequence's own state slot. A hit skips the prefix's
//! forward entirely and is bit-identical to recomputing it.
//!
//! Eviction is LRU (ties: deepest first). An evicted device page is backed up to the
//! [`HostPool`]; a host-tier hit loads it back into a fresh device page before the
//! prefill continues. Pages held by a running sequence (reference count above the
//! cache's own one) are never evicted. State snapshots live in host memory with their
//! node (`layout.state_bytes` each).

mod evict;
mod pending;

use super::{metrics, HostPool, HostPoolError, PageId};
use crate::backend::Backend;
use crate::engine::{CutSlots, Engine, EngineError, Logits, Sequence};
use crate::generate::{prefill_chunks, ChunkHooks, Chunking};
use std::collections::HashMap;

type NodeId = usize;
const ROOT: NodeId = 0;

struct Node {
    parent: NodeId,
    depth: usize,
    key: Vec<u32>,
    children: HashMap<Vec<u32>, NodeId>,
    /// Device page; the cache holds one reference on it.
    device: Option<PageId>,
    /// Host copy (pages under a cut are immutable, so a copy stays valid).
    host: Option<PageId>,
    /// State slot bytes after this node's last token, only the ranges a continuation
    /// can read ([`KvLayout::state_ranges_live_at_cut`]).
    state: Vec<u8>,
    last_use: u64,
}

/// One forward's cut points to cache ([`pending`]): the cuts inside it (unread) and,
/// when the forward ends on a page boundary, the sequence's own state there.
struct Pending {
    cuts: CutSlots,
    /// The state at the forward's end (its position and live bytes), when on a page.
    end: Option<(usize, Vec<u8>)>,
    /// Position of the first token of `keys` and of the first page of `pages`.
    from: usize,
    /// The prompt's tokens `from .. ` the last cut point.
    keys: Vec<u32>,
    /// The pages ending at each cut point, `from ..`, one reference held by this.
    pages: Vec<PageId>,
    /// Node the first cut point hangs under.
    parent: NodeId,
}

/// Result of [`PrefixCache::prefill`].
#[derive(Debug)]
pub struct CachedPrefill {
    /// The sequence, `tokens.len()` positions long; release it with [`Engine::release`].
    pub seq: Sequence,
    /// Logits rows `want` asked for, for the positions computed in this call (with
    /// [`Logits::All`], the rows after the cached prefix).
    pub logits: Vec<Vec<f32>>,
    /// Prefix positions taken from the cache (device and host tiers together).
    pub hit_tokens: usize,
    /// Of those, positions loaded back from the host tier.
    pub host_hit_tokens: usize,
}

/// Counts for tests and `inspect`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub nodes: usize,
    pub device_pages: usize,
    pub host_pages: usize,
}

pub struct PrefixCache {
    host: HostPool,
    /// Live state ranges at a cut, from the layout.
    live: Vec<std::ops::Range<usize>>,
    state_bytes: usize,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<NodeId>,
    tick: u64,
    page_tokens: usize,
    totals: PrefixTotals,
    /// The last prefill's final cut points, not cached yet ([`PrefixCache::finish_pending`]).
    pending: Option<Pending>,
    /// Leave them pending when a prefill returns ([`PrefixCache::set_defer_final_cuts`]).
    defer_final_cuts: bool,
}

/// Prompt tokens by where their KV came from, since the cache was made: counted once, in
/// [`PrefixCache::prefill_cancellable`], which also feeds the `pdserve_prefix_cache_*`
/// counters; a server's load report reads these totals rather than counting again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixTotals {
    pub device_hit_tokens: u64,
    pub host_hit_tokens: u64,
    pub miss_tokens: u64,
}

fn internal(msg: String) -> EngineError {
    EngineError::Internal(format!("prefix cache: {msg}"))
}

impl PrefixCache {
    /// A cache in front of `engine`'s device pool, backed by `host` (same layout, or an
    /// error naming the differing field).
    pub fn new<B: Backend>(engine: &Engine<B>, host: HostPool) -> Result<Self, EngineError> {
        host.layout()
            .check_compatible(engine.layout())
            .map_err(HostPoolError::from)?;
        let root = Node {
            parent: ROOT,
            depth: 0,
            key: Vec::new(),
            children: HashMap::new(),
            device: None,
            host: None,
            state: Vec::new(),
            last_use: 0,
        };
        Ok(PrefixCache {
            page_tokens: engine.layout().page_tokens,
            live: engine.layout().state_ranges_live_at_cut(),
            state_bytes: engine.layout().state_bytes,
            host,
            nodes: vec![Some(root)],
            free_ids: Vec::new(),
            tick: 0,
            totals: PrefixTotals::default(),
            pending: None,
            defer_final_cuts: false,
        })
    }

    pub fn host(&self) -> &HostPool {
        &self.host
    }

    /// Prompt tokens served from each tier and computed, since the cache was made.
    pub fn totals(&self) -> PrefixTotals {
        self.totals
    }

    fn count(&mut self, device_hit: usize, host_hit: usize, miss: usize) {
        let t = &mut self.totals;
        t.device_hit_tokens += device_hit as u64;
        t.host_hit_tokens += host_hit as u64;
        t.miss_tokens += miss as u64;
        metrics::lookup(device_hit, host_hit, miss);
    }

    pub fn stats(&self) -> CacheStats {
        let live = self.nodes.iter().skip(1).flatten();
        CacheStats {
            nodes: live.clone().count(),
            device_pages: live.clone().filter(|n| n.device.is_some()).count(),
            host_pages: live.filter(|n| n.host.is_some()).count(),
        }
    }

    fn node(&self, id: NodeId) -> Result<&Node, EngineError> {
        self.nodes
            .get(id)
            .and_then(Option::as_ref)
            .ok_or_else(|| internal(format!("node {id} missing")))
    }

    fn node_mut(&mut self, id: NodeId) -> Result<&mut Node, EngineError> {
        self.nodes
            .get_mut(id)
            .and_then(Option::as_mut)
            .ok_or_else(|| internal(format!("node {id} missing")))
    }

    /// Longest chain of cached pages matching `tokens`, ending at a cut `<= max_len`.
    fn lookup<B: Backend>(
        &self,
        engine: &Engine<B>,
        tokens: &[u32],
        max_len: usize,
    ) -> Vec<NodeId> {
        let p = self.page_tokens;
        let mut chain = Vec::new();
        let mut at = ROOT;
        while (chain.len() + 1) * p <= max_len {
            let key = &tokens[chain.len() * p..(chain.len() + 1) * p];
            let next = self.nodes[at]
                .as_ref()
                .and_then(|n| n.children.get(key).copied());
            let usable = next
                .and_then(|id| self.nodes[id].as_ref())
                .is_some_and(|n| {
                    !n.device.is_some_and(|pg| engine.is_poisoned(pg))
                        && (n.device.is_some() || n.host.is_some())
                });
            match next {
                Some(id) if usable => {
                    chain.push(id);
                    at = id;
                }
                _ => break,
            }
        }
        chain
    }

    /// Prefill `tokens` into a new sequence, reusing the longest cached prefix (at least
    /// one token is always computed, for the logits) and caching every new cut point.
    pub fn prefill<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        tokens: &[u32],
        chunk: usize,
        want: Logits,
    ) -> Result<CachedPrefill, EngineError> {
        self.prefill_cancellable(engine, tokens, chunk, want, &|| false)?
            .ok_or_else(|| internal("cancelled without a cancel hook".into()))
    }

    /// [`PrefixCache::prefill`], asking `cancelled` before every forward chunk: `Ok(None)`
    /// when it said yes (the sequence is released; cut points already cached stay).
    pub fn prefill_cancellable<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        tokens: &[u32],
        chunk: usize,
        want: Logits,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Option<CachedPrefill>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidInput("empty prompt".into()));
        }
        // A deferred prefill's cut points go in before this prompt looks them up.
        self.finish_pending(engine)?;
        let (mut seq, last, host_hit) = self.begin(engine, tokens)?;
        let hit = seq.len();
        self.count(hit - host_hit, host_hit, tokens.len() - hit);
        match self.extend(engine, &mut seq, tokens, chunk, want, last, cancelled) {
            Ok(Some(logits)) => {
                if !self.defer_final_cuts {
                    if let Err(e) = self.finish_pending(engine) {
                        engine.release(seq)?;
                        return Err(e);
                    }
                }
                Ok(Some(CachedPrefill {
                    seq,
                    logits,
                    hit_tokens: hit,
                    host_hit_tokens: host_hit,
                }))
            }
            Ok(None) => {
                engine.release(seq)?;
                Ok(None)
            }
            Err(e) => {
                if let Err(r) = self.finish_pending(engine) {
                    tracing::error!(error = %r, "caching a failed prefill's cut points");
                }
                if let Err(r) = engine.release(seq) {
                    tracing::error!(error = %r, "releasing a failed prefill's sequence");
                }
                Err(e)
            }
        }
    }

    /// A sequence holding the cached prefix; returns it, its last node and host-hit tokens.
    fn begin<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        tokens: &[u32],
    ) -> Result<(Sequence, NodeId, usize), EngineError> {
        let mut chain = self.lookup(engine, tokens, tokens.len() - 1);
        self.tick += 1;
        for &id in &chain {
            self.node_mut(id)?.last_use = self.tick;
        }
        // Hold (for the new sequence) every device page of the chain first, so that making
        // room for host pages cannot evict them.
        let mut held: Vec<PageId> = Vec::new();
        for &id in &chain {
            if let Some(p) = self.node(id)?.device {
                engine.retain_pages(&[p])?;
                held.push(p);
            }
        }
        let loaded = self.load_chain(engine, &mut chain, &mut held);
        let built = loaded.and_then(|host_hit| {
            let Some(&last) = chain.last() else {
                return Ok((engine.new_sequence()?, ROOT, 0));
            };
            let pages = chain
                .iter()
                .map(|&id| {
                    self.node(id)?
                        .device
                        .ok_or_else(|| internal(format!("node {id} not on device")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let state = self.expand(&self.node(last)?.state)?;
            let seq =
                engine.sequence_from_prefix(&pages, &state, chain.len() * self.page_tokens)?;
            Ok((seq, last, host_hit))
        });
        if built.is_err() {
            engine.release_pages(&held)?;
        }
        built
    }

    /// Bring host-only nodes of `chain` back onto the device (holding each for the new
    /// sequence); the chain is cut where no device page can be had. Returns host-hit tokens.
    fn load_chain<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        chain: &mut Vec<NodeId>,
        held: &mut Vec<PageId>,
    ) -> Result<usize, EngineError> {
        let mut host_hit = 0;
        for i in 0..chain.len() {
            let id = chain[i];
            let node = self.node(id)?;
            if node.device.is_some() {
                continue;
            }
            let hp = node
                .host
                .ok_or_else(|| internal(format!("node {id} in neither tier")))?;
            let Some(p) = self.alloc_device_page(engine)? else {
                // No room: keep the prefix before this node; drop the holds after it.
                let rest: Vec<PageId> = chain[i..]
                    .iter()
                    .filter_map(|&c| self.nodes[c].as_ref().and_then(|n| n.device))
                    .collect();
                for p in rest {
                    if let Some(k) = held.iter().position(|&h| h == p) {
                        held.swap_remove(k);
                        engine.release_pages(&[p])?;
                    }
                }
                chain.truncate(i);
                break;
            };
            if let Err(e) = engine.restore_page(&self.host, hp, p) {
                engine.release_pages(&[p])?;
                return Err(e);
            }
            self.node_mut(id)?.device = Some(p);
            engine.retain_pages(&[p])?;
            held.push(p);
            host_hit += self.page_tokens;
        }
        Ok(host_hit)
    }

    /// One device page (reference owned by the caller), evicting if needed.
    fn alloc_device_page<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
    ) -> Result<Option<PageId>, EngineError> {
        loop {
            if let Ok(mut v) = engine.alloc_pages(1) {
                return Ok(v.pop());
            }
            if !self.evict_one_device(engine)? {
                return Ok(None);
            }
        }
    }

    /// A full state slot from a snapshot's live ranges (the rest zero: never read).
    fn expand(&self, snap: &[u8]) -> Result<Vec<u8>, EngineError> {
        let mut full = vec![0u8; self.state_bytes];
        let mut at = 0;
        for r in &self.live {
            let src = snap
                .get(at..at + r.len())
                .ok_or_else(|| internal("state snapshot shorter than its layout".into()))?;
            full[r.clone()].copy_from_slice(src);
            at += r.len();
        }
        Ok(full)
    }

    /// Run the rest of the prompt, stopping at every cut to cache it; `None` when
    /// `cancelled` said so before a chunk.
    #[allow(clippy::too_many_arguments)]
    fn extend<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        seq: &mut Sequence,
        tokens: &[u32],
        chunk: usize,
        want: Logits,
        node: NodeId,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<Vec<f32>>>, EngineError> {
        let chunking = Chunking {
            chunk,
            cut_every: Some(self.page_tokens),
        };
        let rest = &tokens[seq.len()..];
        let mut hooks = CutHooks {
            cache: self,
            tokens,
            node,
            cancelled,
        };
        prefill_chunks(engine, seq, rest, chunking, want, &mut hooks)
    }

    /// Evict until `need` device pages are free (or nothing more can go).
    pub fn make_room<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        need: usize,
    ) -> Result<(), EngineError> {
        while engine.free_page_count() < need {
            if !self.evict_one_device(engine)? {
                break;
            }
        }
        Ok(())
    }

    /// Cache the page `page` ending a cut (its tokens `key`; `live`: the state slot's
    /// live ranges there, one after another) under `parent`; returns the node for it.
    fn insert<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        parent: NodeId,
        page: PageId,
        key: &[u32],
        live: Vec<u8>,
    ) -> Result<NodeId, EngineError> {
        if let Some(&c) = self.node(parent)?.children.get(key) {
            self.node_mut(c)?.last_use = self.tick;
            return Ok(c);
        }
        let live_bytes: usize = self.live.iter().map(|r| r.len()).sum();
        if live.len() != live_bytes {
            return Err(internal(format!(
                "live state of {} bytes for live ranges of {live_bytes}",
                live.len()
            )));
        }
        engine.retain_pages(&[page])?;
        let node = Node {
            parent,
            depth: self.node(parent)?.depth + 1,
            key: key.to_vec(),
            children: HashMap::new(),
            device: Some(page),
            host: None,
            state: live,
            last_use: self.tick,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        self.node_mut(parent)?.children.insert(key.to_vec(), id);
        Ok(id)
    }
}

/// The cache's part in a chunked prefill: make room for each chunk's pages, and cache
/// every cut point the prefill reaches.
struct CutHooks<'a> {
    cache: &'a mut PrefixCache,
    /// The whole prompt.
    tokens: &'a [u32],
    /// Node of the last cut cached so far.
    node: NodeId,
    cancelled: &'a dyn Fn() -> bool,
}

impl<B: Backend> ChunkHooks<B> for CutHooks<'_> {
    fn before(
        &mut self,
        engine: &mut Engine<B>,
        seq: &Sequence,
        end: usize,
    ) -> Result<bool, EngineError> {
        if (self.cancelled)() {
            return Ok(false);
        }
        let need = engine
            .layout()
            .pages_for(end)
            .saturating_sub(seq.kv().pages.len());
        self.cache.make_room(engine, need)?;
        Ok(true)
    }

    fn after(
        &mut self,
        engine: &mut Engine<B>,
        seq: &Sequence,
        cuts: CutSlots,
    ) -> Result<(), EngineError> {
        if cuts.is_empty() && !seq.len().is_multiple_of(self.cache.page_tokens) {
            // No cut point in this forward.
            return engine.release_cut_slots(cuts);
        }
        let pending = Pending::new(
            engine,
            seq,
            self.tokens,
            self.cache.page_tokens,
            cuts,
            self.node,
        )?;
        if seq.len() < self.tokens.len() {
            self.node = self.cache.finish_cuts(engine, pending)?;
        } else {
            // The prompt's last forward: cached now, or after the caller has answered.
            self.cache.pending = Some(pending);
        }
        Ok(())
    }
}
