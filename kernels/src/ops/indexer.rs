//! The lightning indexer op: scores of every visible compressed entry, then each row's
//! top-k (`cu/indexer.cu`).

use crate::buf::{f32_buf, shape_err};
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::kv_store::{dt_code, DevPlan, GpuKv};
use crate::launch::BLOCK;
use crate::ops::kv_reach::{check_visible_reach, entry_bucket, layer_of};
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{BResult, BatchPlan};
use pdserve_engine::config::LayerKind;
use pdserve_engine::kv::KvLayout;

/// Indexer picks: `[rows, topk]` entry ids, ascending, `-1` padded.
#[derive(Debug)]
pub struct GpuSelection {
    pub(crate) sel: DevMem<i32>,
    pub rows: usize,
    pub topk: usize,
}

const WARPS: usize = BLOCK as usize / 32;

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
            scale_off: l.index_scale_offset as i64,
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
