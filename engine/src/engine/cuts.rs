//! The state at cuts inside one forward: the prefix cache snapshots the state slot at
//! every page boundary of a prompt. Ending a forward at each one (a forward of 256 tokens)
//! cost an 8K prompt 32 forwards (0.31 s against 0.068 s on the H200); instead one forward
//! runs the whole chunk and the ring writers also write, for each cut, a state slot of its
//! own as if the forward had ended there ([`crate::backend::BatchPlan::cuts`]).

use super::{Engine, EngineError, ForwardItem};
use crate::backend::{Backend, Cut, HostTensor};
#[cfg(doc)]
use crate::kv::KvLayout;
use crate::kv::StateSlot;

impl<B: Backend> Engine<B> {
    /// Rows a forward must run before a cut for the cut's rings to be whole (the longest
    /// ring of the layout: sliding window, compressor and indexer rings).
    pub fn cut_span(&self) -> usize {
        self.device.layout.longest_ring()
    }

    /// One forward of `item`, also returning the state slot's live bytes the sequence has
    /// at each of `cuts` (positions inside the forward, ascending, each at least
    /// [`Engine::cut_span`] rows past its start): what a forward ending there would leave
    /// in [`KvLayout::state_ranges_live_at_cut`], those ranges one after another.
    pub fn forward_with_cuts(
        &mut self,
        item: ForwardItem<'_>,
        cuts: &[usize],
    ) -> Result<(HostTensor, Vec<Vec<u8>>), EngineError> {
        let (logits, slots) = self.forward_keeping_cuts(item, cuts)?;
        Ok((logits, self.read_cut_states(slots)?))
    }

    /// [`Engine::forward_with_cuts`] without reading the cuts' states back: they stay in
    /// scratch state slots until [`Engine::read_cut_states`] (which frees them), so that
    /// a caller can answer first and read them after.
    pub fn forward_keeping_cuts(
        &mut self,
        item: ForwardItem<'_>,
        cuts: &[usize],
    ) -> Result<(HostTensor, CutSlots), EngineError> {
        let (start, span) = (item.seq.kv.len, self.cut_span());
        if let Some(&c) = cuts.iter().find(|&&c| c < start + span) {
            return Err(EngineError::Internal(format!(
                "cut at {c} is closer than the rings' {span} rows to the forward's start {start}"
            )));
        }
        let mut slots = CutSlots(Vec::with_capacity(cuts.len()));
        let mut result = Ok(());
        for &pos in cuts {
            match self.device.allocator.alloc_state() {
                Ok(state) => {
                    self.audit.forget_state(state);
                    slots.0.push(Cut { pos, state });
                }
                Err(e) => {
                    result = Err(e.into());
                    break;
                }
            }
        }
        let out = result.and_then(|()| {
            let mut items = [item];
            let mut out = self.forward_planned(&mut items, &slots.0)?;
            out.pop()
                .ok_or_else(|| EngineError::Internal("a forward returned no item".into()))?
        });
        match out {
            Ok(o) => Ok((o.logits, slots)),
            Err(e) => {
                self.release_cut_slots(slots)?;
                Err(e)
            }
        }
    }

    /// The live bytes of each cut [`Engine::forward_keeping_cuts`] kept, in its order, read
    /// back with one wait; the scratch slots are freed whether or not the read succeeds.
    /// No cuts: no read (nor a wait for the device).
    pub fn read_cut_states(&mut self, slots: CutSlots) -> Result<Vec<Vec<u8>>, EngineError> {
        if slots.is_empty() {
            return Ok(Vec::new());
        }
        let t0 = std::time::Instant::now();
        let ids: Vec<StateSlot> = slots.0.iter().map(|c| c.state).collect();
        let states = self.device.read_live_states(&self.backend, &ids);
        tracing::debug!(
            cuts = ids.len(),
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "cut states read back"
        );
        self.release_cut_slots(slots)?;
        Ok(states?)
    }

    /// Free kept cuts' scratch slots without reading them.
    pub fn release_cut_slots(&mut self, slots: CutSlots) -> Result<(), EngineError> {
        for c in &slots.0 {
            self.device.allocator.release_state(c.state)?;
            self.audit.forget_state(c.state);
        }
        Ok(())
    }
}

/// Cuts a forward wrote and nobody has read yet ([`Engine::forward_keeping_cuts`]): their
/// scratch state slots stay taken until [`Engine::read_cut_states`] or
/// [`Engine::release_cut_slots`] gets them.
#[must_use = "kept cuts hold state slots until read or released"]
#[derive(Debug, Default)]
pub struct CutSlots(Vec<Cut>);

impl CutSlots {
    /// The cuts' positions, ascending.
    pub fn positions(&self) -> Vec<usize> {
        self.0.iter().map(|c| c.pos).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
