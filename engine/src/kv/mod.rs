//! Paged KV state: the layout value and the page/state allocator.

pub mod layout;
pub mod peer;
pub mod pool;

pub use layout::{EntryDtype, KvLayout, KvLayoutSpec, LayerKvLayout, LayoutError};
pub use pool::{PageId, PagePool, PoolError, StateSlot};

/// One request's KV handle: its page table and its state slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqKv {
    pub pages: Vec<PageId>,
    pub state: StateSlot,
    /// Positions already written (the next token's position).
    pub len: usize,
}
