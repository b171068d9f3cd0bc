//! The pick recorder: the discrete decisions of a forward pass (each top-k layer's routed
//! experts, each CSA layer's indexer selection), row by row. Rounding noise moves logits a
//! little; a pick that flips (an expert or a compressed entry swapped for a near-tied one)
//! moves them a lot, and everything after it. With both backends recording the same
//! tokens, a row whose logits jump away from the reference can be traced to the pick that
//! flipped and the reference's margin there (`pdserve gpu-check --only picks`).
//!
//! Recording is off unless a caller installs a log ([`crate::Engine::record_picks`]); the
//! engine then runs every forward unpadded and outside captured decode steps, because a
//! backend reads its picks back to the host as it makes them.

use std::sync::{Mutex, PoisonError};

/// Which decision a [`Picks`] records, in the order a layer makes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PickKind {
    /// The compressed entries the lightning indexer kept for a CSA layer.
    Index,
    /// The routed experts of a top-k MoE layer (hash layers cannot flip: not recorded).
    Route,
}

impl std::fmt::Display for PickKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PickKind::Route => "route",
            PickKind::Index => "index",
        })
    }
}

/// One row's pick.
#[derive(Debug, Clone, PartialEq)]
pub struct RowPicks {
    /// The chosen ids (expert or compressed-entry index), ascending.
    pub ids: Vec<u32>,
    /// The selection score of every candidate, indexed by id, when the backend has them on
    /// the host (the CPU backend records them; the CUDA backend records only `ids`). `None`
    /// also where every candidate was chosen (nothing could flip).
    pub scores: Option<Vec<f32>>,
}

impl RowPicks {
    pub fn new(mut ids: Vec<u32>, scores: Option<Vec<f32>>) -> Self {
        ids.sort_unstable();
        RowPicks { ids, scores }
    }

    /// Whether `other` chose a different set.
    pub fn differs(&self, other: &RowPicks) -> bool {
        self.ids != other.ids
    }

    /// How near the flip from `self` (the reference, with scores) to `other` was, in the
    /// reference's own scores: the lowest score among the ids only `self` chose minus the
    /// highest among the ids only `other` chose. Small and positive for a near tie that
    /// rounding tipped over. `None` when the sets are equal or `self` has no scores.
    pub fn flip_margin(&self, other: &RowPicks) -> Option<f32> {
        let scores = self.scores.as_ref()?;
        let score = |id: &u32| {
            scores
                .get(*id as usize)
                .copied()
                .unwrap_or(f32::NEG_INFINITY)
        };
        let only_self = self
            .ids
            .iter()
            .filter(|i| !other.ids.contains(i))
            .map(score);
        let only_other = other
            .ids
            .iter()
            .filter(|i| !self.ids.contains(i))
            .map(score);
        let lowest_kept = only_self.fold(f32::INFINITY, f32::min);
        let highest_taken = only_other.fold(f32::NEG_INFINITY, f32::max);
        (lowest_kept.is_finite() || highest_taken.is_finite())
            .then_some(lowest_kept - highest_taken)
    }

    /// The reference's own margin at its decision boundary: its lowest chosen score minus
    /// the highest score it left out (`None` without scores or with nothing left out).
    pub fn boundary_margin(&self) -> Option<f32> {
        let scores = self.scores.as_ref()?;
        let (mut kept, mut left) = (f32::INFINITY, f32::NEG_INFINITY);
        for (id, &s) in scores.iter().enumerate() {
            if self.ids.binary_search(&(id as u32)).is_ok() {
                kept = kept.min(s);
            } else {
                left = left.max(s);
            }
        }
        left.is_finite().then_some(kept - left)
    }
}

/// One decision of one forward, for every row of its batch plan in row order.
#[derive(Debug, Clone, PartialEq)]
pub struct Picks {
    pub layer: usize,
    pub kind: PickKind,
    pub rows: Vec<RowPicks>,
}

/// Where a backend appends its picks, in the order the forward makes them.
#[derive(Debug, Default)]
pub struct PickLog {
    events: Mutex<Vec<Picks>>,
}

impl PickLog {
    pub fn push(&self, picks: Picks) {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(picks);
    }

    /// Everything recorded since the last take.
    pub fn take(&self) -> Vec<Picks> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// What a backend's MoE needs to record its routing.
#[derive(Clone, Copy)]
pub struct RouteRecord<'a> {
    pub log: &'a PickLog,
    pub layer: usize,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn reference() -> RowPicks {
        // Scores of ids 0..5; the reference kept 1 and 3.
        RowPicks::new(vec![3, 1], Some(vec![0.1, 0.9, 0.2, 0.5, 0.48]))
    }

    #[test]
    fn ids_are_kept_ascending_and_equal_sets_do_not_differ() {
        let r = reference();
        assert_eq!(r.ids, vec![1, 3]);
        let same = RowPicks::new(vec![1, 3], None);
        assert!(!r.differs(&same));
        assert_eq!(r.flip_margin(&same), None);
    }

    #[test]
    fn the_flip_margin_is_the_reference_gap_between_the_swapped_ids() {
        let r = reference();
        // The other run took 4 (0.48) instead of 3 (0.5): a near tie.
        let near = RowPicks::new(vec![1, 4], None);
        assert!(r.differs(&near));
        assert!((r.flip_margin(&near).unwrap() - 0.02).abs() < 1e-6);
        // Taking 0 (0.1) instead of 1 (0.9) is far from a tie.
        let far = RowPicks::new(vec![0, 3], None);
        assert!((r.flip_margin(&far).unwrap() - 0.8).abs() < 1e-6);
        // Without the reference's scores there is no margin to report.
        assert_eq!(near.flip_margin(&r), None);
    }

    #[test]
    fn the_boundary_margin_is_lowest_kept_minus_highest_left_out() {
        assert!((reference().boundary_margin().unwrap() - 0.02).abs() < 1e-6);
        let all = RowPicks::new(vec![0, 1], Some(vec![0.3, 0.2]));
        assert_eq!(all.boundary_margin(), None);
    }

    #[test]
    fn the_log_hands_back_events_in_order_once() {
        let log = PickLog::default();
        for layer in [2, 3] {
            log.push(Picks {
                layer,
                kind: PickKind::Route,
                rows: vec![reference()],
            });
        }
        let got = log.take();
        assert_eq!(got.iter().map(|p| p.layer).collect::<Vec<_>>(), vec![2, 3]);
        assert!(log.take().is_empty());
    }
}
