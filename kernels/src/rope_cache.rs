//! The rope tables a device keeps between calls outside decode steps (filled and read by
//! `ops::rope_tables`): every layer of a forward rotates at the same positions.

use crate::devmem::DevMem;
use pdserve_engine::rope::Rope;
use std::collections::VecDeque;
use std::sync::Arc;

/// cos and sin `[rows, rope.dim() / 2]`, one row per position.
pub(crate) struct RopeTable {
    pub cs: DevMem<f32>,
    pub sn: DevMem<f32>,
}

/// Tables kept at most: a forward uses one per rope and position set (queries and keys at
/// the rows' positions, each compressor rate at its windows' positions).
const KEPT: usize = 8;

/// The tables kept, most recent last.
#[derive(Default)]
pub(crate) struct RopeTableCache {
    entries: VecDeque<(Rope, Vec<usize>, Arc<RopeTable>)>,
}

impl RopeTableCache {
    /// The table of `rope` at `positions`, if kept.
    pub(crate) fn get(&self, rope: &Rope, positions: &[usize]) -> Option<Arc<RopeTable>> {
        self.entries
            .iter()
            .find(|(r, p, _)| r == rope && p.as_slice() == positions)
            .map(|(_, _, t)| t.clone())
    }

    /// Keep `table` for `rope` at `positions`, dropping the oldest past [`KEPT`] (its
    /// buffers are freed in stream order, after the launches that read them).
    pub(crate) fn put(&mut self, rope: &Rope, positions: &[usize], table: Arc<RopeTable>) {
        if self.entries.len() == KEPT {
            self.entries.pop_front();
        }
        self.entries
            .push_back((rope.clone(), positions.to_vec(), table));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use pdserve_engine::config::{RopeParams, RopeScaling};

    fn table(tag: u64) -> Arc<RopeTable> {
        // Views of made-up addresses: never read, and dropping a view frees nothing.
        Arc::new(RopeTable {
            cs: DevMem::view(tag, 1),
            sn: DevMem::view(tag, 1),
        })
    }

    #[test]
    fn tables_are_found_by_rope_and_positions_and_the_oldest_goes_first() {
        let params = RopeParams {
            theta: 10000.0,
            scaling: RopeScaling::Default,
        };
        let (a, b) = (Rope::new(&params, 16), Rope::new(&params, 32));
        let mut cache = RopeTableCache::default();
        cache.put(&a, &[0, 1, 2], table(1));
        assert_eq!(cache.get(&a, &[0, 1, 2]).unwrap().cs.ptr(), 1);
        assert!(cache.get(&a, &[0, 1]).is_none(), "other positions");
        assert!(cache.get(&b, &[0, 1, 2]).is_none(), "another rope");
        for i in 0..KEPT {
            cache.put(&b, &[i], table(10 + i as u64));
        }
        assert!(
            cache.get(&a, &[0, 1, 2]).is_none(),
            "the oldest was dropped"
        );
        assert_eq!(cache.get(&b, &[0]).unwrap().cs.ptr(), 10);
        assert_eq!(
            cache.get(&b, &[KEPT - 1]).unwrap().cs.ptr(),
            10 + KEPT as u64 - 1
        );
    }
}
