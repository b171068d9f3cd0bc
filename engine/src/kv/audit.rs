//! `--kv-audit`: checksum every page and state slot around a forward and check that only
//! the pages covering each sequence's new positions (and its own state slot) changed.

use super::{DevicePool, PageId, StateSlot};
use crate::backend::{BResult, Backend, BatchPlan};
use std::collections::BTreeSet;

/// 64-bit FNV-1a over 8-byte words (pages are multiples of 16 bytes).
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for c in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h ^= u64::from_le_bytes(w);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    h
}

/// Checksums of every page and state slot of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolChecksums {
    pub pages: Vec<u64>,
    pub states: Vec<u64>,
}

impl PoolChecksums {
    pub fn take<B: Backend>(backend: &B, pool: &DevicePool<B>) -> BResult<Self> {
        let pp = pool.bookkeeping();
        let pages = (0..pp.total_pages() as PageId)
            .map(|p| pool.read_page(backend, p).map(|b| checksum(&b)))
            .collect::<BResult<_>>()?;
        let states = (0..pp.total_states() as StateSlot)
            .map(|s| pool.read_state(backend, s).map(|b| checksum(&b)))
            .collect::<BResult<_>>()?;
        Ok(PoolChecksums { pages, states })
    }
}

/// Pages and state slots a forward of `plan` may write: for each sequence, the pages
/// covering positions `[start, start + len)` and its state slot.
pub fn expected_writes(
    plan: &BatchPlan,
    page_tokens: usize,
) -> (BTreeSet<PageId>, BTreeSet<StateSlot>) {
    let mut pages = BTreeSet::new();
    let mut states = BTreeSet::new();
    for s in &plan.seqs {
        states.insert(s.state);
        if s.len == 0 {
            continue;
        }
        let first = s.start / page_tokens;
        let last = (s.start + s.len - 1) / page_tokens;
        pages.extend(s.pages.iter().take(last + 1).skip(first).copied());
    }
    (pages, states)
}

/// What changed that should not have.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Violations {
    pub pages: Vec<PageId>,
    pub states: Vec<StateSlot>,
}

impl Violations {
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty() && self.states.is_empty()
    }

    pub fn count(&self) -> usize {
        self.pages.len() + self.states.len()
    }
}

pub fn compare(
    before: &PoolChecksums,
    after: &PoolChecksums,
    expected: &(BTreeSet<PageId>, BTreeSet<StateSlot>),
) -> Violations {
    let changed = |a: &[u64], b: &[u64]| -> Vec<u32> {
        a.iter()
            .zip(b)
            .enumerate()
            .filter(|(_, (x, y))| x != y)
            .map(|(i, _)| i as u32)
            .collect()
    };
    Violations {
        pages: changed(&before.pages, &after.pages)
            .into_iter()
            .filter(|p| !expected.0.contains(p))
            .collect(),
        states: changed(&before.states, &after.states)
            .into_iter()
            .filter(|s| !expected.1.contains(s))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqPlan;

    #[test]
    fn expected_set_covers_exactly_the_written_positions() {
        let plan = BatchPlan {
            seqs: vec![
                SeqPlan {
                    start: 14,
                    len: 3,
                    row0: 0,
                    pages: vec![7, 3, 9],
                    state: 2,
                },
                SeqPlan {
                    start: 8,
                    len: 8,
                    row0: 3,
                    pages: vec![1, 5],
                    state: 0,
                },
            ],
            ..Default::default()
        };
        let (pages, states) = expected_writes(&plan, 8);
        // 14..17 spans pages 1 and 2 of the first table; 8..16 only page 1 of the second.
        assert_eq!(pages.into_iter().collect::<Vec<_>>(), vec![3, 5, 9]);
        assert_eq!(states.into_iter().collect::<Vec<_>>(), vec![0, 2]);
    }

    #[test]
    fn checksum_sees_single_bit_flips() {
        let a = vec![0u8; 64];
        for i in 0..64 * 8 {
            let mut b = a.clone();
            b[i / 8] ^= 1 << (i % 8);
            assert_ne!(checksum(&a), checksum(&b), "bit {i}");
        }
    }
}
