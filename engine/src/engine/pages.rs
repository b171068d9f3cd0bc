//! The page interface the engine lends to the prefix cache: page references, fresh
//! pages, copies to and from a host pool, and sequences started from a cached prefix.
//! The cache reaches the device pool only through these methods.

use super::{Engine, EngineError, Sequence};
use crate::backend::Backend;
use crate::kv::{HostPool, PageId};

impl<B: Backend> Engine<B> {
    /// Drop one reference on each page; a page whose last reference goes is free again
    /// (and no longer counted as corrupt).
    pub(crate) fn release_pages(&mut self, pages: &[PageId]) -> Result<(), EngineError> {
        self.device.allocator.release_pages(pages)?;
        for p in pages {
            if self.device.allocator.refcount(*p) == 0 {
                self.audit.forget_page(*p);
            }
        }
        self.device.publish_metrics();
        Ok(())
    }

    /// Whether the audit marked `page` corrupt.
    pub fn is_poisoned(&self, page: PageId) -> bool {
        self.audit.is_poisoned(page)
    }

    /// A new sequence that shares `pages` and starts from `state` (a state slot's bytes)
    /// at position `len`. It takes over one reference the caller holds on each page; on
    /// error those references stay with the caller.
    pub(crate) fn sequence_from_prefix(
        &mut self,
        pages: &[PageId],
        state: &[u8],
        len: usize,
    ) -> Result<Sequence, EngineError> {
        if pages.len() != self.layout().pages_for(len) {
            return Err(EngineError::Internal(format!(
                "prefix of {len} positions given {} pages",
                pages.len()
            )));
        }
        let mut seq = self.new_sequence()?;
        if let Err(e) = self.device.write_state(&self.backend, seq.kv.state, state) {
            self.release(seq)?;
            return Err(e.into());
        }
        seq.kv.pages = pages.to_vec();
        seq.kv.len = len;
        Ok(seq)
    }

    /// References held on `page` (0: free).
    pub(crate) fn page_refcount(&self, page: PageId) -> u32 {
        self.device.allocator.refcount(page)
    }

    /// Device pages free now.
    pub(crate) fn free_page_count(&self) -> usize {
        self.device.allocator.free_page_count()
    }

    /// `n` fresh pages, one reference each owned by the caller; all or nothing.
    pub(crate) fn alloc_pages(&mut self, n: usize) -> Result<Vec<PageId>, EngineError> {
        let pages = self.device.allocator.alloc_pages(n)?;
        self.device.publish_metrics();
        Ok(pages)
    }

    /// Add one reference to each of `pages` (already allocated).
    pub(crate) fn retain_pages(&mut self, pages: &[PageId]) -> Result<(), EngineError> {
        Ok(self.device.allocator.retain_pages(pages)?)
    }

    /// The live ranges of `seq`'s state slot ([`crate::kv::KvLayout::state_ranges_live_at_cut`],
    /// one after another), as [`Engine::forward_with_cuts`] returns a cut's.
    pub(crate) fn sequence_live_state(&self, seq: &Sequence) -> Result<Vec<u8>, EngineError> {
        let mut v = self
            .device
            .read_live_states(&self.backend, &[seq.kv.state])?;
        v.pop()
            .ok_or_else(|| EngineError::Internal("no live state read back".into()))
    }

    /// Copy device page `page` into `host`'s page `host_page`.
    pub(crate) fn backup_page(
        &self,
        host: &mut HostPool,
        page: PageId,
        host_page: PageId,
    ) -> Result<(), EngineError> {
        Ok(host.backup(&self.backend, &self.device, page, host_page)?)
    }

    /// Copy `host`'s page `host_page` into device page `page`.
    pub(crate) fn restore_page(
        &mut self,
        host: &HostPool,
        host_page: PageId,
        page: PageId,
    ) -> Result<(), EngineError> {
        Ok(host.load(&self.backend, &mut self.device, host_page, page)?)
    }
}
