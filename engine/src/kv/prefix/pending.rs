//! Cuts a forward wrote and the cache has not taken yet. Reading an 8K prompt's 31 cut
//! states back costs ~12 ms on the H200 host (most of it the host's first touch of their
//! new memory); after the prompt's last forward the prefill server answers first and
//! caches them after ([`PrefixCache::set_defer_final_cuts`]), so that this stays off the
//! time to first token. Meanwhile the cuts hold their scratch state slots and the pending
//! pages hold a reference of their own, so releasing the sequence loses nothing.

use super::{internal, NodeId, Pending, PrefixCache};
use crate::backend::Backend;
use crate::engine::{CutSlots, Engine, EngineError, Sequence};
use crate::generate::read_cuts;

impl Pending {
    /// The cut points of the forward that brought `seq` to `seq.len()` positions of
    /// `tokens` (the prompt), taking over `cuts` (released on error).
    pub(super) fn new<B: Backend>(
        engine: &mut Engine<B>,
        seq: &Sequence,
        tokens: &[u32],
        page_tokens: usize,
        cuts: CutSlots,
        parent: NodeId,
    ) -> Result<Self, EngineError> {
        let end = seq.len();
        let positions = cuts.positions();
        let checked = (|| {
            if let Some(c) = positions.iter().find(|c| !c.is_multiple_of(page_tokens)) {
                return Err(internal(format!("cut at {c} off the pages")));
            }
            let last = match end.is_multiple_of(page_tokens) {
                true => end,
                false => positions.last().copied().unwrap_or(0),
            };
            let from = positions
                .first()
                .copied()
                .unwrap_or(last)
                .saturating_sub(page_tokens);
            let (Some(keys), Some(pages)) = (
                tokens.get(from..last),
                seq.kv().pages.get(from / page_tokens..last / page_tokens),
            ) else {
                return Err(internal(format!(
                    "cut points up to {last} past a sequence of {end} positions"
                )));
            };
            let end_state = match end.is_multiple_of(page_tokens) {
                true => Some((end, engine.sequence_live_state(seq)?)),
                false => None,
            };
            Ok((end_state, from, keys.to_vec(), pages.to_vec()))
        })();
        let (end, from, keys, pages) = match checked {
            Ok(c) => c,
            Err(e) => {
                engine.release_cut_slots(cuts)?;
                return Err(e);
            }
        };
        if let Err(e) = engine.retain_pages(&pages) {
            engine.release_cut_slots(cuts)?;
            return Err(e);
        }
        Ok(Pending {
            cuts,
            end,
            from,
            keys,
            pages,
            parent,
        })
    }
}

impl PrefixCache {
    /// Cache the prompt's last forward's cut points only when
    /// [`PrefixCache::finish_pending`] is called (or the next prefill starts), not before
    /// [`PrefixCache::prefill`] returns: a server answers first, then calls it.
    pub fn set_defer_final_cuts(&mut self, on: bool) {
        self.defer_final_cuts = on;
    }

    /// Whether a prefill's last cut points wait for [`PrefixCache::finish_pending`].
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Cache the cut points the last prefill left pending (nothing when there are none).
    pub fn finish_pending<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
    ) -> Result<(), EngineError> {
        match self.pending.take() {
            Some(p) => self.finish_cuts(engine, p).map(|_| ()),
            None => Ok(()),
        }
    }

    /// Read `p`'s cuts back and cache each cut point in order; returns the last one's
    /// node. The cuts' slots and `p`'s page references are freed whatever happens.
    pub(super) fn finish_cuts<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        p: Pending,
    ) -> Result<NodeId, EngineError> {
        let (from, keys, pages) = (p.from, &p.keys, &p.pages);
        let pt = self.page_tokens;
        let cached = read_cuts(engine, p.cuts).and_then(|states| {
            let points = states.into_iter().map(|c| (c.pos, c.state)).chain(p.end);
            let mut node = p.parent;
            for (pos, state) in points {
                let (key, page) = match (
                    keys.get(pos - pt - from..pos - from),
                    pages.get((pos - from) / pt - 1),
                ) {
                    (Some(k), Some(&pg)) => (k, pg),
                    _ => return Err(internal(format!("cut point {pos} outside its forward"))),
                };
                node = self.insert(engine, node, page, key, state)?;
            }
            Ok(node)
        });
        engine.release_pages(pages)?;
        cached
    }
}
