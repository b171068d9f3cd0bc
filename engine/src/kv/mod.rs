//! Paged KV state: the layout value, the page/state allocator, the device and host
//! pools, the prefix cache and the write audit.

pub mod audit;
pub mod device;
pub mod fp8;
pub mod host;
pub mod layout;
pub mod layout_table;
pub mod metrics;
pub mod pool;
pub mod prefix;
pub mod sizing;

pub use device::DevicePool;
pub use host::{HostPool, HostPoolError};
pub use layout::{EntryDtype, KvLayout, KvLayoutSpec, LayerKvLayout, LayoutError};
pub use pool::{PageId, PagePool, PoolError, StateSlot};
pub use prefix::{CachedPrefill, PrefixCache};

/// One request's KV handle: its page table and its state slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqKv {
    pub pages: Vec<PageId>,
    pub state: StateSlot,
    /// Positions already written (the next token's position).
    pub len: usize,
}
