//! The device pool: page/state allocation ([`KvAllocator`]) plus the backend's storage of
//! every page and state slot ("device" memory is host memory on the CPU backend, GPU
//! memory on CUDA). Every size comes from its [`KvLayout`]; of the backend it needs only
//! the [`KvStorage`].

use super::{metrics, KvAllocator, KvLayout, PageId, StateSlot};
use crate::backend::{BResult, BackendError, KvStorage};
use std::collections::BTreeSet;

/// Pages and state slots written since the KV canary last checked the pool: every write
/// that goes through the pool (imports, host-tier loads, state resets) and the writes the
/// steps' plans announce. Whatever else changed was written by nobody.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Written {
    pub pages: BTreeSet<PageId>,
    pub states: BTreeSet<StateSlot>,
}

pub struct DevicePool<B: KvStorage> {
    pub(crate) layout: KvLayout,
    pub(crate) fingerprint: String,
    pub(crate) allocator: KvAllocator,
    pub(crate) store: B::KvStore,
    /// Kept only while the canary is on.
    pub(crate) written: Option<Written>,
}

impl<B: KvStorage> DevicePool<B> {
    pub fn new(backend: &B, layout: KvLayout, pages: usize, states: usize) -> BResult<Self> {
        let store = backend.alloc_kv(&layout, pages, states)?;
        let pool = DevicePool {
            fingerprint: layout.fingerprint(),
            layout,
            allocator: KvAllocator::new(pages, states),
            store,
            written: None,
        };
        pool.publish_metrics();
        Ok(pool)
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Who holds which pages and state slots of this pool.
    pub fn allocator(&self) -> &KvAllocator {
        &self.allocator
    }

    pub fn store(&self) -> &B::KvStore {
        &self.store
    }

    /// Bytes of a page (exactly `layout.page_bytes`).
    pub fn read_page(&self, backend: &B, page: PageId) -> BResult<Vec<u8>> {
        let b = backend.page_bytes(&self.store, page)?;
        self.check_len("page", b.len(), self.layout.page_bytes)?;
        Ok(b)
    }

    pub fn write_page(&mut self, backend: &B, page: PageId, bytes: &[u8]) -> BResult<()> {
        self.check_len("page", bytes.len(), self.layout.page_bytes)?;
        if let Some(w) = &mut self.written {
            w.pages.insert(page);
        }
        backend.write_page(&mut self.store, page, bytes)
    }

    pub fn read_state(&self, backend: &B, slot: StateSlot) -> BResult<Vec<u8>> {
        let b = backend.state_bytes(&self.store, slot)?;
        self.check_len("state slot", b.len(), self.layout.state_bytes)?;
        Ok(b)
    }

    /// The ranges live at a cut ([`KvLayout::state_ranges_live_at_cut`]) of each of
    /// `slots`, one `Vec` per slot, read from the device with one wait.
    pub fn read_live_states(&self, backend: &B, slots: &[StateSlot]) -> BResult<Vec<Vec<u8>>> {
        let live = self.layout.state_ranges_live_at_cut();
        let per: usize = live.iter().map(|r| r.len()).sum();
        let states = backend.state_ranges(&self.store, slots, &live)?;
        if states.len() != slots.len() {
            return Err(BackendError::Kv(format!(
                "{} live states read back for {} slots",
                states.len(),
                slots.len()
            )));
        }
        for s in &states {
            self.check_len("live state ranges", s.len(), per)?;
        }
        Ok(states)
    }

    pub fn write_state(&mut self, backend: &B, slot: StateSlot, bytes: &[u8]) -> BResult<()> {
        self.check_len("state slot", bytes.len(), self.layout.state_bytes)?;
        self.note_state(slot);
        backend.write_state(&mut self.store, slot, bytes)
    }

    /// Zero a state slot for a new sequence.
    pub fn reset_state(&mut self, backend: &B, slot: StateSlot) -> BResult<()> {
        self.note_state(slot);
        backend.reset_state(&mut self.store, slot)
    }

    fn note_state(&mut self, slot: StateSlot) {
        if let Some(w) = &mut self.written {
            w.states.insert(slot);
        }
    }

    /// Start (or stop) keeping the [`Written`] set.
    pub fn track_writes(&mut self, on: bool) {
        self.written = on.then(Written::default);
    }

    /// What was written since the last call (empty when not kept).
    pub fn take_written(&mut self) -> Written {
        self.written
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn check_len(&self, what: &str, got: usize, want: usize) -> BResult<()> {
        if got != want {
            return Err(BackendError::Kv(format!(
                "{what} of {got} bytes where layout {} has {want}",
                self.fingerprint
            )));
        }
        Ok(())
    }

    /// Set the `pool="device"` gauges.
    pub fn publish_metrics(&self) {
        metrics::pages(
            "device",
            self.allocator.total_pages() - self.allocator.free_page_count(),
            self.allocator.total_pages(),
        );
    }
}
