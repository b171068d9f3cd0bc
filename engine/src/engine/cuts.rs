//! The state at cuts inside one forward: the prefix cache snapshots the state slot at
//! every page boundary of a prompt. Ending a forward at each one (a forward of 256 tokens)
//! cost an 8K prompt 32 forwards (0.31 s against 0.068 s on the H200); instead one forward
//! runs the whole chunk and the ring writers also write, for each cut, a state slot of its
//! own as if the forward had ended there ([`crate::backend::BatchPlan::cuts`]).

use super::{Engine, EngineError, ForwardItem};
use crate::backend::{Backend, BatchPlan, HostTensor};
#[cfg(doc)]
use crate::kv::KvLayout;
use crate::kv::StateSlot;

/// A cut of a forward's single item: its position and the scratch slot its state goes to.
#[derive(Debug, Clone, Copy)]
pub(super) struct CutSlot {
    pub pos: usize,
    pub state: StateSlot,
}

/// The cuts' plan ([`BatchPlan::cuts`]): the forward's rows, one sequence per cut, the
/// item's sequence up to the cut writing the cut's slot.
pub(super) fn cut_plan(
    plan: &BatchPlan,
    cuts: &[CutSlot],
) -> Result<Option<Box<BatchPlan>>, EngineError> {
    if cuts.is_empty() {
        return Ok(None);
    }
    let [seq] = plan.seqs.as_slice() else {
        return Err(EngineError::Internal(format!(
            "cuts in a forward of {} sequences",
            plan.seqs.len()
        )));
    };
    let seqs = cuts
        .iter()
        .map(|c| {
            if c.pos <= seq.start || c.pos >= seq.start + seq.len {
                return Err(EngineError::Internal(format!(
                    "cut at {} outside the forward's positions {}..{}",
                    c.pos,
                    seq.start,
                    seq.start + seq.len
                )));
            }
            let mut s = seq.clone();
            s.len = c.pos - seq.start;
            s.state = c.state;
            Ok(s)
        })
        .collect::<Result<Vec<_>, EngineError>>()?;
    Ok(Some(Box::new(BatchPlan {
        seqs,
        tokens: plan.tokens.clone(),
        positions: plan.positions.clone(),
        row_seq: plan.row_seq.clone(),
        cuts: None,
    })))
}

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
        let (start, span) = (item.seq.kv.len, self.cut_span());
        if let Some(&c) = cuts.iter().find(|&&c| c < start + span) {
            return Err(EngineError::Internal(format!(
                "cut at {c} is closer than the rings' {span} rows to the forward's start {start}"
            )));
        }
        let mut slots = Vec::with_capacity(cuts.len());
        let mut result = Ok(());
        for &pos in cuts {
            match self.device.allocator.alloc_state() {
                Ok(state) => {
                    self.audit.forget_state(state);
                    slots.push(CutSlot { pos, state });
                }
                Err(e) => {
                    result = Err(e.into());
                    break;
                }
            }
        }
        let out = result.and_then(|()| {
            let mut items = [item];
            let mut out = self.forward_planned(&mut items, &slots)?;
            let logits = out
                .pop()
                .ok_or_else(|| EngineError::Internal("a forward returned no item".into()))??;
            let t0 = std::time::Instant::now();
            let ids: Vec<StateSlot> = slots.iter().map(|c| c.state).collect();
            let states = self.device.read_live_states(&self.backend, &ids)?;
            tracing::debug!(
                cuts = slots.len(),
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "cut states read back"
            );
            Ok((logits.logits, states))
        });
        for c in &slots {
            self.device.allocator.release_state(c.state)?;
            self.audit.forget_state(c.state);
        }
        out
    }
}
