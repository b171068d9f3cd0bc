//! Rope cos/sin tables on the device, computed on the host exactly like the CPU backend.
//!
//! Outside decode steps the last few tables are kept and reused: every layer of a forward
//! rotates its queries, keys and outputs at the same positions, and each table of an 8K
//! prefill is 262K cos/sin pairs of host work (~3.6 ms), during which the device ran dry.
//! Inside a decode step each call uploads its own table into the step's arena.

use crate::device::Gpu;
use crate::rope_cache::RopeTable;
use pdserve_engine::backend::BResult;
use pdserve_engine::rope::Rope;
use std::sync::Arc;

/// The table of `rope` at `positions`.
pub(crate) fn rope_tables(g: &Gpu, rope: &Rope, positions: &[usize]) -> BResult<Arc<RopeTable>> {
    if g.in_step() {
        return Ok(Arc::new(compute(g, rope, positions)?));
    }
    let mut cache = g.rope_tables()?;
    if let Some(t) = cache.get(rope, positions) {
        return Ok(t);
    }
    let t = Arc::new(compute(g, rope, positions)?);
    cache.put(rope, positions, t.clone());
    Ok(t)
}

fn compute(g: &Gpu, rope: &Rope, positions: &[usize]) -> BResult<RopeTable> {
    let half = rope.dim() / 2;
    let (mut cs, mut sn) = (
        Vec::with_capacity(positions.len() * half),
        Vec::with_capacity(positions.len() * half),
    );
    let (mut c, mut s) = (vec![0f32; half], vec![0f32; half]);
    let mut last = None;
    for &p in positions {
        // Runs of one position (a compressor's rows between window ends) reuse the row.
        if last != Some(p) {
            rope.cos_sin(p, &mut c, &mut s);
            last = Some(p);
        }
        cs.extend_from_slice(&c);
        sn.extend_from_slice(&s);
    }
    Ok(RopeTable {
        cs: g.upload(&cs)?,
        sn: g.upload(&sn)?,
    })
}
