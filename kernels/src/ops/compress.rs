//! The compressor op: ring update and, at each rate boundary, one pooled, normed, roped
//! entry stored in the sequence's pages (`cu/compress.cu`).

use crate::buf::{f32_buf, shape_err};
use crate::device::Gpu;
use crate::kernels::{self, DevPtr};
use crate::kv_store::{check_entry_page, dt_code, kv_dt_code, DevPlan, GpuKv};
use crate::ops::kv_reach::layer_of;
use crate::ops::numerics::rotation_scale_bits;
use crate::ops::rope_tables::rope_tables;
use crate::ops::tensors::param_f32;
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{shapes, BResult, BatchPlan, CompressorParams, CompressorPart};
use pdserve_engine::config::LayerKind;
use pdserve_engine::kv::KvLayout;
use pdserve_engine::numerics::Numerics;

/// Largest dynamic shared memory a kernel asks for without opting in.
const SHARED_LIMIT: usize = 48 * 1024;

#[allow(clippy::too_many_arguments)]
pub fn compress(
    g: &Gpu,
    kv: &mut GpuKv,
    layout: &KvLayout,
    layer: usize,
    proj_kv: &GpuTensor,
    proj_gate: &GpuTensor,
    p: &CompressorParams<'_, GpuTensor>,
    plan: &BatchPlan,
) -> BResult<()> {
    let l = layer_of(layout, layer)?;
    let (ring_off, slots, width) = p.part.ring(l);
    let overlap = l.kind == LayerKind::Csa;
    let dim = if overlap { width / 2 } else { width };
    let rate = l.rate;
    // deepseek numerics rotate and FP4-quantize the indexer's keys before they are stored.
    let rot_scale_bits = match (layout.numerics, p.part) {
        (Numerics::Deepseek, CompressorPart::Index) => rotation_scale_bits(dim, "compress")?,
        _ => 0,
    };
    // Dynamic shared memory: the pooled entry, then the rotation's doubles.
    let shared = if rot_scale_bits != 0 {
        dim.next_multiple_of(2) * 4 + dim * 8
    } else {
        dim * 4
    };
    let (entry_off, scale_off, epp, dt, want_dim) = match p.part {
        CompressorPart::Main => (
            l.comp_page_offset,
            l.comp_scale_offset,
            l.comp_entries_per_page,
            kv_dt_code(layout)?,
            layout.head_dim,
        ),
        CompressorPart::Index => (
            l.index_page_offset,
            l.index_scale_offset,
            l.index_entries_per_page,
            dt_code(layout.index_k_dtype)?,
            layout.index_head_dim,
        ),
    };
    // fp8 compressed-KV entries keep the trailing rope channels in bf16: the compressor's
    // rope must cover exactly those.
    if p.part == CompressorPart::Main
        && layout.fp8_kv_format().is_some()
        && p.rope.dim() != layout.rope_dim
    {
        return Err(shape_err(
            "compress",
            format!(
                "rope of {} channels for fp8 entries of {} rope channels",
                p.rope.dim(),
                layout.rope_dim
            ),
        ));
    }
    if rate == 0
        || proj_kv.cols != width
        || proj_gate.cols != width
        || proj_kv.rows != plan.rows()
        || proj_gate.rows != plan.rows()
        || p.position_bias.len() != rate * width
        || p.norm_weight.len() != dim
        || dim != want_dim
        || p.rope.dim() > dim
        || shared > SHARED_LIMIT
    {
        return Err(shape_err(
            "compress",
            format!(
                "layer {layer}: rows of {} / {} for width {width}, rate {rate}",
                proj_kv.cols, proj_gate.cols
            ),
        ));
    }
    for s in &plan.seqs {
        let (first, last) = (s.start / rate, (s.start + s.len) / rate);
        if last > first {
            check_entry_page(layout, rate, s.pages.len(), last - 1)?;
        }
    }
    let dp = DevPlan::upload(g, kv, plan)?;
    let window_positions: Vec<usize> = plan
        .positions
        .iter()
        .map(|&pos| {
            if (pos + 1).is_multiple_of(rate) {
                ((pos + 1) / rate - 1) * rate
            } else {
                0
            }
        })
        .collect();
    let table = rope_tables(g, p.rope, &window_positions)?;
    let bias = param_f32(g, p.position_bias)?;
    let norm = param_f32(g, p.norm_weight)?;
    // Outside decode steps (prefill), one block per window this forward closes, then the
    // ring; in a step, one block per sequence walking its rows (a grid the batch alone
    // fixes, as captured graphs need). The same arithmetic per window either way.
    let windows = !g.in_step();
    let grid = if windows {
        let most = plan
            .seqs
            .iter()
            .map(|s| ((s.start + s.len) / rate).saturating_sub((s.start + rate) / rate - 1))
            .max()
            .unwrap_or(0);
        (plan.seqs.len() as u32, most as u32, 1)
    } else {
        (plan.seqs.len() as u32, 1, 1)
    };
    let (pkv, pgate) = (
        DevPtr::of(f32_buf(proj_kv, "compress")?),
        DevPtr::of(f32_buf(proj_gate, "compress")?),
    );
    let args = kernels::Compress {
        pages: DevPtr::of(&kv.pages),
        states: DevPtr::of(&kv.states),
        page_bytes: kv.page_bytes as i64,
        state_bytes: kv.state_bytes as i64,
        seq: DevPtr::of(&dp.seq),
        pt: DevPtr::of(&dp.pt),
        proj_kv: pkv,
        proj_gate: pgate,
        bias: DevPtr::of(&bias),
        norm_w: DevPtr::of(&norm),
        cs: DevPtr::of(&table.cs),
        sn: DevPtr::of(&table.sn),
        width: width as i32,
        rate: rate as i32,
        slots: slots as i32,
        overlap: overlap as i32,
        ring_off: ring_off as i64,
        entry_off: entry_off as i64,
        scale_off: scale_off as i64,
        entries_per_page: epp as i32,
        page_tokens: layout.page_tokens as i32,
        dt,
        rd: p.rope.dim() as i32,
        eps: p.eps,
        by_window: windows as i32,
        rot_scale_bits,
    };
    if grid.1 > 0 {
        g.launch(grid, shared as u32, &args)?;
    }
    if !windows {
        return Ok(());
    }
    launch_ring(g, kv, plan, &dp, (pkv, pgate), (ring_off, slots, width))
}

/// `k_compress_ring`: each sequence's last rows of `proj` into its ring.
fn launch_ring(
    g: &Gpu,
    kv: &GpuKv,
    plan: &BatchPlan,
    dp: &DevPlan,
    (proj_kv, proj_gate): (DevPtr, DevPtr),
    (ring_off, slots, width): (usize, usize, usize),
) -> BResult<()> {
    g.launch(
        (plan.seqs.len() as u32, 1, 1),
        0,
        &kernels::CompressRing {
            states: DevPtr::of(&kv.states),
            state_bytes: kv.state_bytes as i64,
            seq: DevPtr::of(&dp.seq),
            proj_kv,
            proj_gate,
            width: width as i32,
            slots: slots as i32,
            ring_off: ring_off as i64,
        },
    )
}

/// [`pdserve_engine::backend::TensorOps::compress_ring`]: `k_compress_ring` alone (each
/// sequence's last rows into its ring; the state at a cut inside a longer forward).
#[allow(clippy::too_many_arguments)]
pub fn compress_ring(
    g: &Gpu,
    kv: &mut GpuKv,
    layout: &KvLayout,
    layer: usize,
    part: CompressorPart,
    proj_kv: &GpuTensor,
    proj_gate: &GpuTensor,
    plan: &BatchPlan,
) -> BResult<()> {
    let l = layer_of(layout, layer)?;
    let (ring_off, slots, width) = part.ring(l);
    shapes::check_compress_ring(
        layer,
        (width, slots),
        (proj_kv.rows, proj_kv.cols),
        (proj_gate.rows, proj_gate.cols),
        plan.rows(),
    )?;
    let dp = DevPlan::upload(g, kv, plan)?;
    let proj = (
        DevPtr::of(f32_buf(proj_kv, "compress_ring")?),
        DevPtr::of(f32_buf(proj_gate, "compress_ring")?),
    );
    launch_ring(g, kv, plan, &dp, proj, (ring_off, slots, width))
}
