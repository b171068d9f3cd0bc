//! A pool's KV storage as a backend keeps it: allocation, reset, and pages and state
//! slots as bytes (audits, transfers, host backups, tests). Sizes come from the layout
//! the store was allocated with.

use super::BResult;
use crate::kv::{KvLayout, PageId, StateSlot};
use std::ops::Range;

pub trait KvStorage: Send + Sync {
    /// Storage of all pages and state slots of one pool.
    type KvStore: Send + Sync;

    fn alloc_kv(&self, layout: &KvLayout, pages: usize, states: usize) -> BResult<Self::KvStore>;
    /// Zero a state slot before a new sequence uses it.
    fn reset_state(&self, kv: &mut Self::KvStore, slot: StateSlot) -> BResult<()>;
    /// Raw bytes of a page / state slot.
    fn page_bytes(&self, kv: &Self::KvStore, page: PageId) -> BResult<Vec<u8>>;
    fn state_bytes(&self, kv: &Self::KvStore, slot: StateSlot) -> BResult<Vec<u8>>;
    /// The bytes `ranges` (of a state slot, ascending, inside it) of each of `slots`, one
    /// vector per slot with its ranges one after another: the prefix cache's snapshots of
    /// a prompt's cuts, in one wait for the device.
    fn state_ranges(
        &self,
        kv: &Self::KvStore,
        slots: &[StateSlot],
        ranges: &[Range<usize>],
    ) -> BResult<Vec<Vec<u8>>>;
    /// Overwrite a whole page / state slot (`layout.page_bytes` / `layout.state_bytes` bytes).
    fn write_page(&self, kv: &mut Self::KvStore, page: PageId, bytes: &[u8]) -> BResult<()>;
    fn write_state(&self, kv: &mut Self::KvStore, slot: StateSlot, bytes: &[u8]) -> BResult<()>;
    /// The canary's checksum ([`crate::kv::checksum`]) of every page / every state slot,
    /// computed where the storage lives (on the GPU: one kernel, no copy of the pool).
    fn page_checksums(&self, kv: &Self::KvStore) -> BResult<Vec<u64>>;
    fn state_checksums(&self, kv: &Self::KvStore) -> BResult<Vec<u64>>;
}

/// Error unless every range lies inside a state slot of `state_bytes` bytes; returns the
/// bytes per slot.
pub fn check_state_ranges(ranges: &[Range<usize>], state_bytes: usize) -> BResult<usize> {
    if let Some(r) = ranges
        .iter()
        .find(|r| r.start > r.end || r.end > state_bytes)
    {
        return Err(super::BackendError::Kv(format!(
            "state range {r:?} outside a slot of {state_bytes} bytes"
        )));
    }
    Ok(ranges.iter().map(Range::len).sum())
}
