//! Rope cos/sin tables on the device, computed on the host exactly like the CPU backend.
//!
//! Outside decode steps the last few tables are kept and reused: every layer of a forward
//! rotates its queries, keys and outputs at the same positions, and each table of an 8K
//! prefill is 262K cos/sin pairs of host work (~3.6 ms), during which the device ran dry.
//! Inside a decode step each call uploads its own table into the step's arena.

use crate::device::Gpu;
use crate::devmem::DevMem;
use pdserve_engine::backend::BResult;
use pdserve_engine::rope::Rope;
use std::collections::VecDeque;
use std::sync::Arc;

/// cos and sin `[rows, rope.dim() / 2]`, one row per position.
pub(crate) struct RopeTable {
    pub cs: DevMem<f32>,
    pub sn: DevMem<f32>,
}

/// Tables kept at most: a forward uses one per rope and position set (queries and keys at
/// the rows' positions, each compressor rate at its windows' positions).
const KEPT: usize = 8;

/// The tables kept outside decode steps, most recent last.
#[derive(Default)]
pub(crate) struct RopeTableCache {
    entries: VecDeque<(Rope, Vec<usize>, Arc<RopeTable>)>,
}

/// The table of `rope` at `positions`.
pub(crate) fn rope_tables(g: &Gpu, rope: &Rope, positions: &[usize]) -> BResult<Arc<RopeTable>> {
    if g.in_step() {
        return Ok(Arc::new(compute(g, rope, positions)?));
    }
    let mut cache = g.rope_tables()?;
    if let Some((_, _, t)) = cache
        .entries
        .iter()
        .find(|(r, p, _)| r == rope && p.as_slice() == positions)
    {
        return Ok(t.clone());
    }
    let t = Arc::new(compute(g, rope, positions)?);
    if cache.entries.len() == KEPT {
        cache.entries.pop_front();
    }
    cache
        .entries
        .push_back((rope.clone(), positions.to_vec(), t.clone()));
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
