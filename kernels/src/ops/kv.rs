//! Paged-KV ops of [`CudaBackend`]: compressor, lightning indexer, sink attention and
//! window stores. Host code validates shapes and page reach, then launches one kernel.

use crate::buf::{f32_buf, out_ptr, shape_err};
use crate::device::Gpu;
use crate::device::ATTENTION_SHARED;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::kv_store::GpuKv;
use crate::kv_store::{check_entry_page, dt_code, DevPlan};
use crate::launch::BLOCK;
use crate::ops::dense::rope_tables;
use crate::ops::tensors::{new_f32, param_f32};
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{
    BResult, BackendError, BatchPlan, CompressedKeys, CompressorParams, CompressorPart,
};
use pdserve_engine::config::LayerKind;
use pdserve_engine::kv::{KvLayout, LayerKvLayout};

/// Indexer picks: `[rows, topk]` entry ids, ascending, `-1` padded.
#[derive(Debug)]
pub struct GpuSelection {
    pub(crate) sel: DevMem<i32>,
    pub rows: usize,
    pub topk: usize,
}

/// Largest dynamic shared memory a kernel asks for without opting in.
const SHARED_LIMIT: usize = 48 * 1024;
const WARPS: usize = BLOCK as usize / 32;
/// Channels per lane the attention kernel holds (`ATT_MAXQ` in attention.cu).
const ATT_MAXQ: usize = 16;
/// Heads per attention block (`ATT_G` in attention.cu).
const ATT_G: usize = 4;

/// Compressed entries a launch is sized for: the batch's most, rounded up to a power of
/// two (the kernels bound every row by its own count), so that decode steps of a bucket
/// launch identically while contexts grow and replay one captured graph.
fn entry_bucket(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        n.next_power_of_two().max(32)
    }
}

/// Error unless every compressed entry a sequence of `plan` can see lies in its pages.
fn check_visible_reach(layout: &KvLayout, rate: usize, plan: &BatchPlan) -> BResult<()> {
    for s in &plan.seqs {
        let nv = (s.start + s.len) / rate;
        if nv > 0 {
            check_entry_page(layout, rate, s.pages.len(), nv - 1)?;
        }
    }
    Ok(())
}

fn layer_of(layout: &KvLayout, layer: usize) -> BResult<&LayerKvLayout> {
    layout
        .layers
        .get(layer)
        .ok_or_else(|| BackendError::Kv(format!("layer {layer} not in layout")))
}

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
    let (ring_off, slots, width) = match p.part {
        CompressorPart::Main => (l.comp_state_offset, l.comp_ring_slots, l.comp_width),
        CompressorPart::Index => (l.index_state_offset, l.index_ring_slots, l.index_width),
    };
    let overlap = l.kind == LayerKind::Csa;
    let dim = if overlap { width / 2 } else { width };
    let rate = l.rate;
    let (entry_off, epp, dt, want_dim) = match p.part {
        CompressorPart::Main => (
            l.comp_page_offset,
            l.comp_entries_per_page,
            layout.kv_dtype,
            layout.head_dim,
        ),
        CompressorPart::Index => (
            l.index_page_offset,
            l.index_entries_per_page,
            layout.index_k_dtype,
            layout.index_head_dim,
        ),
    };
    if rate == 0
        || proj_kv.cols != width
        || proj_gate.cols != width
        || proj_kv.rows != plan.rows()
        || proj_gate.rows != plan.rows()
        || p.position_bias.len() != rate * width
        || p.norm_weight.len() != dim
        || dim != want_dim
        || p.rope.dim() > dim
        || dim * 4 > SHARED_LIMIT
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
    let (cs, sn) = rope_tables(
        g,
        p.rope,
        plan.positions.iter().map(|&pos| {
            if (pos + 1).is_multiple_of(rate) {
                ((pos + 1) / rate - 1) * rate
            } else {
                0
            }
        }),
    )?;
    let bias = param_f32(g, p.position_bias)?;
    let norm = param_f32(g, p.norm_weight)?;
    g.launch(
        (plan.seqs.len() as u32, 1, 1),
        (dim * 4) as u32,
        &kernels::Compress {
            pages: DevPtr::of(&kv.pages),
            states: DevPtr::of(&kv.states),
            page_bytes: kv.page_bytes as i64,
            state_bytes: kv.state_bytes as i64,
            seq: DevPtr::of(&dp.seq),
            pt: DevPtr::of(&dp.pt),
            proj_kv: DevPtr::of(f32_buf(proj_kv, "compress")?),
            proj_gate: DevPtr::of(f32_buf(proj_gate, "compress")?),
            bias: DevPtr::of(&bias),
            norm_w: DevPtr::of(&norm),
            cs: DevPtr::of(&cs),
            sn: DevPtr::of(&sn),
            width: width as i32,
            rate: rate as i32,
            slots: slots as i32,
            overlap: overlap as i32,
            ring_off: ring_off as i64,
            entry_off: entry_off as i64,
            entries_per_page: epp as i32,
            page_tokens: layout.page_tokens as i32,
            dt: dt_code(dt)?,
            rd: p.rope.dim() as i32,
            eps: p.eps,
        },
    )
}

#[allow(clippy::too_many_arguments)]
pub fn index_select(
    g: &Gpu,
    kv: &GpuKv,
    layout: &KvLayout,
    layer: usize,
    q: &GpuTensor,
    weights: &GpuTensor,
    n_heads: usize,
    topk: usize,
    plan: &BatchPlan,
) -> BResult<GpuSelection> {
    let l = layer_of(layout, layer)?;
    let ihd = layout.index_head_dim;
    let rows = plan.rows();
    if q.cols != n_heads * ihd
        || weights.cols != n_heads
        || l.kind != LayerKind::Csa
        || q.rows != rows
        || weights.rows != rows
        || topk == 0
    {
        return Err(shape_err(
            "index_select",
            format!("q cols {}, weights cols {}", q.cols, weights.cols),
        ));
    }
    check_visible_reach(layout, l.rate, plan)?;
    let max_nv = entry_bucket(
        plan.positions
            .iter()
            .map(|&p| (p + 1) / l.rate)
            .max()
            .unwrap_or(0),
    );
    let dp = DevPlan::upload(g, kv, plan)?;
    let scores = g.zeros::<f32>(rows * max_nv)?;
    let sel = g.zeros::<i32>(rows * topk)?;
    g.launch(
        (rows as u32, max_nv.div_ceil(WARPS) as u32, 1),
        0,
        &kernels::IndexScores {
            pages: DevPtr::of(&kv.pages),
            page_bytes: kv.page_bytes as i64,
            seq: DevPtr::of(&dp.seq),
            pt: DevPtr::of(&dp.pt),
            row_seq: DevPtr::of(&dp.row_seq),
            positions: DevPtr::of(&dp.positions),
            q: DevPtr::of(f32_buf(q, "index_select")?),
            wts: DevPtr::of(f32_buf(weights, "index_select")?),
            scores: DevPtr::of(&scores),
            max_nv: max_nv as i32,
            n_heads: n_heads as i32,
            ihd: ihd as i32,
            rate: l.rate as i32,
            entry_off: l.index_page_offset as i64,
            entries_per_page: l.index_entries_per_page as i32,
            page_tokens: layout.page_tokens as i32,
            dt: dt_code(layout.index_k_dtype)?,
            softmax_scale: (ihd as f32).powf(-0.5),
            weight_scale: (n_heads as f32).powf(-0.5),
        },
    )?;
    g.launch(
        (rows as u32, 1, 1),
        0,
        &kernels::Topk {
            scores: DevPtr::of(&scores),
            positions: DevPtr::of(&dp.positions),
            sel: DevPtr::of(&sel),
            max_nv: max_nv as i32,
            topk: topk as i32,
            rate: l.rate as i32,
        },
    )?;
    Ok(GpuSelection { sel, rows, topk })
}

impl GpuSelection {
    /// The picks of every row as the CPU backend returns them.
    pub fn to_host(&self, g: &Gpu) -> BResult<Vec<Vec<u32>>> {
        let v = g.download(&self.sel, self.rows * self.topk)?;
        Ok(v.chunks(self.topk.max(1))
            .take(self.rows)
            .map(|r| r.iter().filter(|&&e| e >= 0).map(|&e| e as u32).collect())
            .collect())
    }
}

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
    let group = if n_heads.is_multiple_of(ATT_G) {
        ATT_G
    } else {
        1
    };
    // Queries and scores (fp32) plus one 8-byte key address per key, 8-byte aligned.
    let floats = group * (hd + max_keys);
    let shared = (floats + floats % 2) * 4 + max_keys * 8;
    if shared > ATTENTION_SHARED || !hd.is_multiple_of(32) || hd > 32 * ATT_MAXQ {
        return Err(shape_err(
            "attention",
            format!(
                "{max_keys} keys per row and head_dim {hd} exceed the kernel (shared memory \
                 {shared} of {ATTENTION_SHARED} bytes; head_dim a multiple of 32 up to {})",
                32 * ATT_MAXQ
            ),
        ));
    }
    let dp = DevPlan::upload(g, kv, plan)?;
    let sinks = param_f32(g, sinks)?;
    let out = new_f32(g, rows, n_heads * hd)?;
    g.launch(
        (rows as u32, (n_heads / group) as u32, 1),
        shared as u32,
        &kernels::Attention {
            pages: DevPtr::of(&kv.pages),
            states: DevPtr::of(&kv.states),
            page_bytes: kv.page_bytes as i64,
            state_bytes: kv.state_bytes as i64,
            seq: DevPtr::of(&dp.seq),
            pt: DevPtr::of(&dp.pt),
            row_seq: DevPtr::of(&dp.row_seq),
            positions: DevPtr::of(&dp.positions),
            q: DevPtr::of(f32_buf(q, "attention")?),
            kv_new: DevPtr::of(f32_buf(kv_new, "attention")?),
            sinks: DevPtr::of(&sinks),
            sel: sel_ptr,
            topk: topk as i32,
            out: out_ptr(&out)?,
            n_heads: n_heads as i32,
            hd: hd as i32,
            window: window as i32,
            win_off: l.window_state_offset as i64,
            rate: l.rate.max(1) as i32,
            mode,
            comp_off: l.comp_page_offset as i64,
            comp_epp: l.comp_entries_per_page.max(1) as i32,
            page_tokens: layout.page_tokens as i32,
            dt: dt_code(layout.kv_dtype)?,
            scale: (hd as f32).powf(-0.5),
            max_keys: max_keys as i32,
            g: group as i32,
        },
    )?;
    Ok(out)
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
    g.launch(
        (plan.rows() as u32, 1, 1),
        0,
        &kernels::WindowStore {
            states: DevPtr::of(&kv.states),
            state_bytes: kv.state_bytes as i64,
            seq: DevPtr::of(&dp.seq),
            row_seq: DevPtr::of(&dp.row_seq),
            positions: DevPtr::of(&dp.positions),
            kv_new: DevPtr::of(f32_buf(kv_new, "window_store")?),
            hd: hd as i32,
            window: layout.sliding_window as i32,
            win_off: l.window_state_offset as i64,
            dt: dt_code(layout.kv_dtype)?,
        },
    )
}
