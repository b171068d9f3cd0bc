//! Sink attention over the sliding window plus compressed entries (tensor cores,
//! `ops/attention_mma.rs`; the split-key kernel, `ops/attention_split.rs`; or the reference
//! one of `cu/attention.cu`), and window stores. A prefill's fp8 keys are converted to
//! bf16 once for the tensor-core kernels (`ops/attention_dequant.rs`).

use crate::buf::{f32_buf, out_ptr, shape_err};
use crate::device::{AttentionKernel, Gpu, ATTENTION_SHARED};
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::kv_store::{kv_dt_code, DevPlan, GpuKv};
use crate::launch::BLOCK;
use crate::ops::attention_dequant;
use crate::ops::attention_mma::{self, MmaPlan};
use crate::ops::attention_split::{self, AttentionArgs, SplitPlan};
use crate::ops::dense::{rms_norm, rope};
use crate::ops::indexer::GpuSelection;
use crate::ops::kv_reach::{check_visible_reach, entry_bucket, layer_of};
use crate::ops::rope_tables::rope_tables;
use crate::ops::tensors::{new_f32, param_f32};
use crate::tensor::{Buf, GpuTensor};
use pdserve_engine::backend::{BResult, BatchPlan, CompressedKeys, HeadRope};
use pdserve_engine::kv::KvLayout;

/// Channels per lane the reference attention kernel holds (`ATT_MAXQ` in attention.cu).
const ATT_MAXQ: usize = 16;
/// Heads per reference attention block (`ATT_G` in attention.cu).
const ATT_G: usize = 4;

#[allow(clippy::too_many_arguments)]
pub fn attention(
    g: &Gpu,
    kv: &GpuKv,
    layout: &KvLayout,
    layer: usize,
    q: &GpuTensor,
    kv_new: &GpuTensor,
    sinks: &GpuTensor,
    n_heads: usize,
    compressed: CompressedKeys<'_, GpuSelection>,
    head_rope: HeadRope<'_>,
    plan: &BatchPlan,
) -> BResult<GpuTensor> {
    let l = layer_of(layout, layer)?;
    let hd = layout.head_dim;
    let window = layout.sliding_window;
    let rows = plan.rows();
    if q.cols != n_heads * hd
        || kv_new.cols != hd
        || sinks.len() != n_heads
        || q.rows != rows
        || kv_new.rows != rows
    {
        return Err(shape_err(
            "attention",
            format!("q cols {}, kv cols {}", q.cols, kv_new.cols),
        ));
    }
    let max_pos_nv = entry_bucket(
        plan.positions
            .iter()
            .map(|&p| (p + 1) / l.rate.max(1))
            .max()
            .unwrap_or(0),
    );
    let (mode, sel_ptr, topk, max_comp) = match &compressed {
        CompressedKeys::None => (0, DevPtr::NULL, 0, 0),
        CompressedKeys::AllVisible => (1, DevPtr::NULL, 0, max_pos_nv),
        CompressedKeys::Selected(s) => {
            if s.rows != rows {
                return Err(shape_err(
                    "attention",
                    format!("{} selection rows for {rows}", s.rows),
                ));
            }
            (2, DevPtr::of(&s.sel), s.topk, s.topk.min(max_pos_nv))
        }
    };
    if mode != 0 {
        if l.rate == 0 {
            return Err(shape_err(
                "attention",
                format!("layer {layer} has no compressed entries"),
            ));
        }
        check_visible_reach(layout, l.rate, plan)?;
    }
    let max_keys = window + max_comp;
    let dt = kv_dt_code(layout)?;
    let split = SplitPlan::choose(rows, n_heads, hd, max_keys, g.sms, g.deterministic).ok_or_else(
        || {
            shape_err(
                "attention",
                format!(
                    "head_dim {hd} is not a multiple of 32 up to {}",
                    32 * ATT_MAXQ
                ),
            )
        },
    )?;
    let dp = DevPlan::upload(g, kv, plan)?;
    let sinks = param_f32(g, sinks)?;
    let kv_new = f32_buf(kv_new, "attention")?;
    let mut args = AttentionArgs {
        pages: DevPtr::of(&kv.pages),
        states: DevPtr::of(&kv.states),
        page_bytes: kv.page_bytes as i64,
        state_bytes: kv.state_bytes as i64,
        seq: DevPtr::of(&dp.seq),
        pt: DevPtr::of(&dp.pt),
        row_seq: DevPtr::of(&dp.row_seq),
        positions: DevPtr::of(&dp.positions),
        // Set below: the normed and roped queries (fp32, or bf16 for the direct launch).
        q: DevPtr::NULL,
        kv_new: DevPtr::of(kv_new),
        new_stored: None,
        entry_bytes: layout.kv_row_bytes(),
        scale_bytes: layout.fp8_kv_format().map_or(0, |f| f.scale_bytes()),
        sinks: DevPtr::of(&sinks),
        sel: sel_ptr,
        topk: topk as i32,
        // Set below, once the kernel is chosen (the rotated bf16 output takes none).
        out: DevPtr::NULL,
        rows,
        n_heads,
        hd,
        window: window as i32,
        win_off: l.window_state_offset as i64,
        rate: l.rate.max(1) as i32,
        mode,
        comp_off: l.comp_page_offset as i64,
        comp_epp: l.comp_entries_per_page.max(1) as i32,
        page_tokens: layout.page_tokens as i32,
        dt,
        scale: (hd as f32).powf(-0.5),
        rd: layout.rope_dim as i32,
        win_scale_off: l.window_scale_offset as i64,
        comp_scale_off: l.comp_scale_offset as i64,
    };
    let cols = n_heads * hd;
    if let Some(kernel) = attention_mma::choose_kernel(g, &args) {
        let mma = MmaPlan::choose(kernel, rows, n_heads, max_keys, g.sms, g.deterministic);
        let converted = attention_dequant::convert_if_reused(g, &args, plan, max_keys)?;
        let mut args = converted.as_ref().map_or(args, |c| c.args);
        if mma.direct && !g.fp32_reference && g.attention_bf16_io {
            return attention_bf16_io(g, &args, mma, q, head_rope, layout, plan);
        }
        let q = fp32_queries(g, q, hd, head_rope, plan)?;
        args.q = DevPtr::of(f32_buf(&q, "attention")?);
        let mut out = new_f32(g, rows, cols)?;
        args.out = out_ptr(&out)?;
        attention_mma::launch(g, &args, mma, None)?;
        rope(g, &mut out, hd, head_rope.rope, &plan.positions, true)?;
        return Ok(out);
    }
    let q = fp32_queries(g, q, hd, head_rope, plan)?;
    args.q = DevPtr::of(f32_buf(&q, "attention")?);
    let mut out = new_f32(g, rows, cols)?;
    args.out = out_ptr(&out)?;
    if g.attention_kernel == AttentionKernel::Reference {
        launch_reference(g, &args, max_keys)?;
    } else {
        attention_split::launch(g, &args, split)?;
    }
    rope(g, &mut out, hd, head_rope.rope, &plan.positions, true)?;
    Ok(out)
}

/// The query heads normed and roped in fp32 (the kernels that read fp32 queries).
fn fp32_queries(
    g: &Gpu,
    q: &GpuTensor,
    hd: usize,
    head_rope: HeadRope<'_>,
    plan: &BatchPlan,
) -> BResult<GpuTensor> {
    let mut q = rms_norm(g, q, None, hd, head_rope.q_norm_eps)?;
    rope(g, &mut q, hd, head_rope.rope, &plan.positions, false)?;
    Ok(q)
}

/// The direct tensor-core launch in bf16 on both sides: the query heads normed, roped and
/// rounded by one kernel (the bits the attention kernel's own rounding of the fp32 queries
/// gave; 1 GB fewer fp32 writes and reads per layer at 8K), and the output, which the
/// o-projection rounds to bf16 anyway, rotated back and rounded in the epilogue (no fp32
/// output, rope pass or rounding pass).
#[allow(clippy::too_many_arguments)]
fn attention_bf16_io(
    g: &Gpu,
    args: &AttentionArgs,
    mma: MmaPlan,
    q: &GpuTensor,
    head_rope: HeadRope<'_>,
    layout: &KvLayout,
    plan: &BatchPlan,
) -> BResult<GpuTensor> {
    let (rows, hd, rd) = (args.rows, args.hd, layout.rope_dim);
    if head_rope.rope.dim() != rd || !hd.is_multiple_of(2) || rd > hd {
        return Err(shape_err(
            "attention",
            format!(
                "rope of {} channels for a layout of {rd} in heads of {hd}",
                head_rope.rope.dim()
            ),
        ));
    }
    let table = rope_tables(g, head_rope.rope, &plan.positions)?;
    let heads = rows * args.n_heads;
    let qb = g.uninit::<u16>(heads * hd)?;
    let warps = (BLOCK / 32) as usize;
    g.launch(
        (heads.div_ceil(warps) as u32, 1, 1),
        0,
        &kernels::QueryHeadsBf16 {
            x: DevPtr::of(f32_buf(q, "attention")?),
            cs: DevPtr::of(&table.cs),
            sn: DevPtr::of(&table.sn),
            out: DevPtr::of(&qb),
            head_dim: hd as i32,
            groups: heads as i32,
            heads_per_row: args.n_heads as i32,
            rd: rd as i32,
            eps: head_rope.q_norm_eps,
        },
    )?;
    let out = g.uninit::<u16>(heads * hd)?;
    let io = attention_mma::Bf16Io {
        table: &table,
        q: &qb,
        out: &out,
    };
    attention_mma::launch(g, args, mma, Some(io))?;
    Ok(GpuTensor::new(rows, args.n_heads * hd, Buf::Bf16(out)))
}

/// `k_attention`: one block per row and group of heads, every score of the row in shared
/// memory (the kernel the split one replaced, kept as gpu-check's A/B reference).
fn launch_reference(g: &Gpu, a: &AttentionArgs, max_keys: usize) -> BResult<()> {
    let (hd, n_heads) = (a.hd, a.n_heads);
    let group = if n_heads.is_multiple_of(ATT_G) {
        ATT_G
    } else {
        1
    };
    // Queries and scores (fp32) plus one 8-byte key address per key, 8-byte aligned, and
    // for fp8 entries one 8-byte scale address per key.
    let floats = group * (hd + max_keys);
    let shared = (floats + floats % 2) * 4 + max_keys * if a.dt == 3 { 16 } else { 8 };
    if shared > ATTENTION_SHARED || hd > 32 * ATT_MAXQ {
        return Err(shape_err(
            "attention",
            format!(
                "{max_keys} keys per row and head_dim {hd} exceed the reference kernel \
                 (shared memory {shared} of {ATTENTION_SHARED} bytes)"
            ),
        ));
    }
    // fp8: this forward's keys as their stored entries will read back.
    let rounded = (a.dt == 3)
        .then(|| -> BResult<DevMem<f32>> {
            let r = g.uninit::<f32>(a.rows * hd)?;
            g.launch(
                (a.rows as u32, 1, 1),
                0,
                &kernels::KvRoundTrip {
                    x: a.kv_new,
                    out: DevPtr::of(&r),
                    hd: hd as i32,
                    rd: a.rd,
                },
            )?;
            Ok(r)
        })
        .transpose()?;
    g.launch(
        (a.rows as u32, (n_heads / group) as u32, 1),
        shared as u32,
        &kernels::Attention {
            pages: a.pages,
            states: a.states,
            page_bytes: a.page_bytes,
            state_bytes: a.state_bytes,
            seq: a.seq,
            pt: a.pt,
            row_seq: a.row_seq,
            positions: a.positions,
            q: a.q,
            kv_new: rounded.as_ref().map_or(a.kv_new, DevPtr::of),
            sinks: a.sinks,
            sel: a.sel,
            topk: a.topk,
            out: a.out,
            n_heads: n_heads as i32,
            hd: hd as i32,
            window: a.window,
            win_off: a.win_off,
            rate: a.rate,
            mode: a.mode,
            comp_off: a.comp_off,
            comp_epp: a.comp_epp,
            page_tokens: a.page_tokens,
            dt: a.dt,
            scale: a.scale,
            max_keys: max_keys as i32,
            g: group as i32,
            rd: a.rd,
            win_scale_off: a.win_scale_off,
            comp_scale_off: a.comp_scale_off,
        },
    )
}

pub fn window_store(
    g: &Gpu,
    kv: &mut GpuKv,
    layout: &KvLayout,
    layer: usize,
    kv_new: &GpuTensor,
    plan: &BatchPlan,
) -> BResult<()> {
    let l = layer_of(layout, layer)?;
    let hd = layout.head_dim;
    if kv_new.cols != hd || kv_new.rows != plan.rows() {
        return Err(shape_err(
            "window_store",
            format!("kv cols {}", kv_new.cols),
        ));
    }
    let dp = DevPlan::upload(g, kv, plan)?;
    let rows = plan.seqs.iter().map(|s| s.len).max().unwrap_or(0);
    let grid = (
        plan.seqs.len() as u32,
        rows.min(layout.sliding_window) as u32,
        1,
    );
    if grid.0 == 0 || grid.1 == 0 {
        return Ok(());
    }
    g.launch(
        grid,
        0,
        &kernels::WindowStore {
            states: DevPtr::of(&kv.states),
            state_bytes: kv.state_bytes as i64,
            seq: DevPtr::of(&dp.seq),
            kv_new: DevPtr::of(f32_buf(kv_new, "window_store")?),
            hd: hd as i32,
            window: layout.sliding_window as i32,
            win_off: l.window_state_offset as i64,
            dt: kv_dt_code(layout)?,
            rd: layout.rope_dim as i32,
            win_scale_off: l.window_scale_offset as i64,
        },
    )
}
