//! `--kv-audit`: an observer of each step that checksums every page and state slot
//! before it and checks after it that only the pages covering each sequence's new
//! positions (and its own state slot) changed. What it finds corrupt stays marked, so the
//! other owners of that state fail when they next run.

use super::{DevicePool, PageId, SeqKv, StateSlot};
use crate::backend::{BResult, BackendError, BatchPlan, KvStorage};
use std::collections::BTreeSet;

/// Pages and state slots of a step's own sequences found corrupt.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("pages {pages:?} and state slots {states:?} changed outside a step's expected writes")]
    Corrupt {
        pages: Vec<PageId>,
        states: Vec<StateSlot>,
    },
}

/// The audit's hooks around a step and what it has found corrupt so far.
#[derive(Debug, Default)]
pub struct StepAudit {
    enabled: bool,
    /// Pages/slots found corrupt; sequences holding them fail until they are freed.
    poisoned_pages: BTreeSet<PageId>,
    poisoned_states: BTreeSet<StateSlot>,
    /// Test hook: a page to overwrite with garbage after the next step.
    scribble: Option<PageId>,
}

impl StepAudit {
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether the audit marked `page` corrupt.
    pub fn is_poisoned(&self, page: PageId) -> bool {
        self.poisoned_pages.contains(&page)
    }

    /// `page` was freed (its contents no longer matter).
    pub fn forget_page(&mut self, page: PageId) {
        self.poisoned_pages.remove(&page);
    }

    /// `slot` was freed or handed out fresh.
    pub fn forget_state(&mut self, slot: StateSlot) {
        self.poisoned_states.remove(&slot);
    }

    /// After the next step, overwrite `page` with garbage, as a kernel writing out of
    /// bounds would (the audit tests).
    pub fn scribble_after_next_step(&mut self, page: PageId) {
        self.scribble = Some(page);
    }

    /// Refuse a step over sequences that hold state found corrupt earlier.
    pub fn check_held<'a>(&self, seqs: impl Iterator<Item = &'a SeqKv>) -> Result<(), AuditError> {
        if self.poisoned_pages.is_empty() && self.poisoned_states.is_empty() {
            return Ok(());
        }
        let mut pages = Vec::new();
        let mut states = Vec::new();
        for kv in seqs {
            pages.extend(kv.pages.iter().filter(|p| self.poisoned_pages.contains(p)));
            if self.poisoned_states.contains(&kv.state) {
                states.push(kv.state);
            }
        }
        if pages.is_empty() && states.is_empty() {
            return Ok(());
        }
        Err(AuditError::Corrupt { pages, states })
    }

    /// Before a step: the pool's checksums when the audit is on.
    pub fn before_step<B: KvStorage>(
        &self,
        backend: &B,
        pool: &DevicePool<B>,
    ) -> BResult<Option<PoolChecksums>> {
        match self.enabled {
            true => Ok(Some(PoolChecksums::take(backend, pool)?)),
            false => Ok(None),
        }
    }

    /// After the step of `plan`: compare the pool against `before`. Fails only if one of
    /// the step's own sequences holds corrupted state; other owners fail when they next
    /// run ([`StepAudit::check_held`]), so only affected requests end.
    pub fn after_step<B: KvStorage>(
        &mut self,
        backend: &B,
        pool: &mut DevicePool<B>,
        before: Option<PoolChecksums>,
        plan: &BatchPlan,
    ) -> Result<(), AuditError> {
        if let Some(page) = self.scribble.take() {
            let garbage = vec![0xA5u8; pool.layout().page_bytes];
            pool.write_page(backend, page, &garbage)?;
        }
        let Some(before) = before else {
            return Ok(());
        };
        let after = PoolChecksums::take(backend, pool)?;
        let expected = expected_writes(plan, pool.layout().page_tokens);
        let bad = compare(&before, &after, &expected);
        if bad.is_empty() {
            return Ok(());
        }
        tracing::error!(
            pages = ?bad.pages,
            states = ?bad.states,
            expected_pages = ?expected.0,
            "KV audit: unexpected writes in this step"
        );
        super::metrics::audit_violations(bad.count());
        let alloc = pool.allocator();
        self.poisoned_pages
            .extend(bad.pages.iter().copied().filter(|&p| alloc.refcount(p) > 0));
        self.poisoned_states.extend(bad.states.iter().copied());
        let pages: Vec<PageId> = plan
            .seqs
            .iter()
            .flat_map(|s| s.pages.iter().copied())
            .filter(|p| bad.pages.contains(p))
            .collect();
        let states: Vec<StateSlot> = plan
            .seqs
            .iter()
            .map(|s| s.state)
            .filter(|s| bad.states.contains(s))
            .collect();
        if pages.is_empty() && states.is_empty() {
            return Ok(());
        }
        Err(AuditError::Corrupt { pages, states })
    }
}

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
    pub fn take<B: KvStorage>(backend: &B, pool: &DevicePool<B>) -> BResult<Self> {
        let pp = pool.allocator();
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
