//! What a paged-KV op may reach: a layer's layout, the compressed entries each sequence
//! sees (every one inside its pages), and the entry count a launch is sized for.

use crate::kv_store::check_entry_page;
use pdserve_engine::backend::{BResult, BackendError, BatchPlan};
use pdserve_engine::kv::{KvLayout, LayerKvLayout};

/// Compressed entries a launch is sized for: the batch's most, rounded up to a power of
/// two (the kernels bound every row by its own count), so that decode steps of a bucket
/// launch identically while contexts grow and replay one captured graph.
pub(crate) fn entry_bucket(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        n.next_power_of_two().max(32)
    }
}

/// Error unless every compressed entry a sequence of `plan` can see lies in its pages.
pub(crate) fn check_visible_reach(layout: &KvLayout, rate: usize, plan: &BatchPlan) -> BResult<()> {
    for s in &plan.seqs {
        let nv = (s.start + s.len) / rate;
        if nv > 0 {
            check_entry_page(layout, rate, s.pages.len(), nv - 1)?;
        }
    }
    Ok(())
}

pub(crate) fn layer_of(layout: &KvLayout, layer: usize) -> BResult<&LayerKvLayout> {
    layout
        .layers
        .get(layer)
        .ok_or_else(|| BackendError::Kv(format!("layer {layer} not in layout")))
}
