//! Paged KV state: the layout value, the page/state allocator, the device and host
//! pools, the prefix cache and the write audit.

pub mod allocator;
pub mod audit;
pub mod canary_regions;
pub mod checksum;
pub mod device;
pub mod fp8;
pub mod fp8_kv;
pub mod host;
pub mod layout;
pub mod layout_table;
pub mod metrics;
pub mod peer;
pub mod prefix;
pub mod sizing;

pub use allocator::{KvAllocator, PoolError, SeqKv};
pub use device::{DevicePool, Written};
pub use host::{HostPool, HostPoolError};
pub use layout::{
    EntryDtype, KvLayout, KvLayoutSpec, LayerKvLayout, LayoutError, PageId, StateSlot,
};
pub use prefix::{CachedPrefill, PrefixCache, PrefixTotals};
