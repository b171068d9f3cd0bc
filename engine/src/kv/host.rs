//! The host pool behind a device pool: plain host memory holding backed-up pages. Sized
//! from the same [`KvLayout`] as the device pool; every copy checks that both pools
//! share that layout and refuses (naming the differing field) otherwise.

use super::{metrics, DevicePool, KvAllocator, KvLayout, LayoutError, PageId};
use crate::backend::{BackendError, KvStorage};

#[derive(Debug, thiserror::Error)]
pub enum HostPoolError {
    #[error("host and device KV pools disagree: {0}")]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("host page {0} is not allocated")]
    NotAllocated(PageId),
    #[error("host page {page} got {got} bytes, layout pages hold {want}")]
    Size {
        page: PageId,
        got: usize,
        want: usize,
    },
}

pub struct HostPool {
    layout: KvLayout,
    fingerprint: String,
    allocator: KvAllocator,
    data: Vec<u8>,
}

impl HostPool {
    pub fn new(layout: &KvLayout, pages: usize) -> Self {
        let pool = HostPool {
            layout: layout.clone(),
            fingerprint: layout.fingerprint(),
            allocator: KvAllocator::new(pages, 0),
            data: vec![0; pages * layout.page_bytes],
        };
        pool.publish_metrics();
        pool
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn total_pages(&self) -> usize {
        self.allocator.total_pages()
    }

    pub fn used_pages(&self) -> usize {
        self.allocator.total_pages() - self.allocator.free_page_count()
    }

    pub fn alloc(&mut self) -> Option<PageId> {
        let p = self.allocator.alloc_pages(1).ok()?.pop();
        self.publish_metrics();
        p
    }

    pub fn free(&mut self, page: PageId) -> Result<(), HostPoolError> {
        self.allocator
            .release_pages(&[page])
            .map_err(|_| HostPoolError::NotAllocated(page))?;
        self.publish_metrics();
        Ok(())
    }

    fn range(&self, page: PageId) -> Result<std::ops::Range<usize>, HostPoolError> {
        if self.allocator.refcount(page) == 0 {
            return Err(HostPoolError::NotAllocated(page));
        }
        let pb = self.layout.page_bytes;
        Ok(page as usize * pb..(page as usize + 1) * pb)
    }

    pub fn read(&self, page: PageId) -> Result<&[u8], HostPoolError> {
        let r = self.range(page)?;
        Ok(&self.data[r])
    }

    pub fn write(&mut self, page: PageId, bytes: &[u8]) -> Result<(), HostPoolError> {
        let r = self.range(page)?;
        if bytes.len() != r.len() {
            return Err(HostPoolError::Size {
                page,
                got: bytes.len(),
                want: r.len(),
            });
        }
        self.data[r].copy_from_slice(bytes);
        Ok(())
    }

    fn check_peer<B: KvStorage>(&self, dev: &DevicePool<B>) -> Result<(), HostPoolError> {
        if dev.fingerprint() != self.fingerprint {
            self.layout.check_compatible(dev.layout())?;
            // Same fields, different fingerprint cannot happen; refuse anyway.
            return Err(LayoutError::Mismatch {
                field: "fingerprint".into(),
                ours: self.fingerprint.clone(),
                theirs: dev.fingerprint().to_string(),
            }
            .into());
        }
        Ok(())
    }

    /// Copy device page `dev_page` into host page `host_page`.
    pub fn backup<B: KvStorage>(
        &mut self,
        backend: &B,
        dev: &DevicePool<B>,
        dev_page: PageId,
        host_page: PageId,
    ) -> Result<(), HostPoolError> {
        self.check_peer(dev)?;
        let bytes = dev.read_page(backend, dev_page)?;
        self.write(host_page, &bytes)
    }

    /// Copy host page `host_page` into device page `dev_page`.
    pub fn load<B: KvStorage>(
        &self,
        backend: &B,
        dev: &mut DevicePool<B>,
        host_page: PageId,
        dev_page: PageId,
    ) -> Result<(), HostPoolError> {
        self.check_peer(dev)?;
        let bytes = self.read(host_page)?;
        dev.write_page(backend, dev_page, bytes)?;
        Ok(())
    }

    pub fn publish_metrics(&self) {
        metrics::pages("host", self.used_pages(), self.total_pages());
    }
}
