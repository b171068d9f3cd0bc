//! The lightning indexer op: scores of every visible compressed entry, then each row's
//! top-k (`cu/indexer.cu`).

use crate::buf::{f32_buf, shape_err};
use crate::device::{Gpu, MMA_SHARED};
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::kv_store::{dt_code, DevPlan, GpuKv};
use crate::launch::BLOCK;
use crate::ops::kv_reach::{check_visible_reach, entry_bucket, layer_of};
use crate::ops::tensors::to_bf16;
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
    let scoring = Scoring {
        kv,
        layout,
        l,
        dp: &dp,
        q,
        weights,
        n_heads,
        max_nv,
    };
    if by_gemm(g, plan) {
        scoring.by_gemm(g, plan, &scores)?;
    } else {
        scoring.by_kernel(g, rows, &scores)?;
    }
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

/// Heads (`IXM_H`), entries per block (`IXM_E`) and most channels (`IXM_MAXD`) of
/// `k_index_scores_mma`.
const MMA_HEADS: usize = 64;
const MMA_ENTRIES: usize = 128;
const MMA_MAX_DIM: usize = 256;
/// bf16 entries (`EntryDtype` code).
const DT_BF16: i32 = 1;

/// Whether `k_index_scores_mma` takes the layer: bf16 entries, at most 64 heads, a head
/// dim that is a multiple of 16 up to 256, 16-byte aligned entry rows.
fn mma_takes(dt: i32, n_heads: usize, ihd: usize, page_bytes: usize, entry_off: usize) -> bool {
    dt == DT_BF16
        && n_heads <= MMA_HEADS
        && ihd.is_multiple_of(16)
        && ihd <= MMA_MAX_DIM
        && page_bytes.is_multiple_of(16)
        && entry_off.is_multiple_of(16)
        && mma_shared_bytes(ihd) <= MMA_SHARED
}

/// Its dynamic shared memory: queries and entries as padded bf16 rows.
fn mma_shared_bytes(ihd: usize) -> usize {
    (MMA_HEADS + MMA_ENTRIES) * (ihd + 8) * 2
}

/// A sequence's rows from which the scores go through the GEMM path.
const GEMM_ROWS: usize = 64;

/// Floats of one chunk's per-head dot products (256 MiB).
const GEMM_CHUNK_FLOATS: usize = 64 << 20;

/// The GEMM path for prefill-sized forwards (some sequence has [`GEMM_ROWS`] rows or more),
/// outside decode steps and `--deterministic` (where cuBLAS's shape-dependent order would
/// make scores depend on how a prompt was chunked).
fn by_gemm(g: &Gpu, plan: &BatchPlan) -> bool {
    !g.deterministic && !g.in_step() && plan.seqs.iter().any(|s| s.len >= GEMM_ROWS)
}

/// What both ways of scoring one layer's rows read.
struct Scoring<'a> {
    kv: &'a GpuKv,
    layout: &'a KvLayout,
    l: &'a pdserve_engine::kv::LayerKvLayout,
    dp: &'a DevPlan,
    q: &'a GpuTensor,
    weights: &'a GpuTensor,
    n_heads: usize,
    max_nv: usize,
}

impl Scoring<'_> {
    /// One warp per (row, entry), every head's dot product in turn (`k_index_scores`); or,
    /// under bf16 weights with bf16 entries, the same scores on tensor cores
    /// (`k_index_scores_mma`: a block per row and 128 entries, every head at once).
    fn by_kernel(&self, g: &Gpu, rows: usize, scores: &DevMem<f32>) -> BResult<()> {
        let (kv, layout, l, dp) = (self.kv, self.layout, self.l, self.dp);
        let ihd = layout.index_head_dim;
        let n_heads = self.n_heads;
        let dt = dt_code(layout.index_k_dtype)?;
        let (q, wts) = (
            DevPtr::of(f32_buf(self.q, "index_select")?),
            DevPtr::of(f32_buf(self.weights, "index_select")?),
        );
        let (softmax_scale, weight_scale) = ((ihd as f32).powf(-0.5), (n_heads as f32).powf(-0.5));
        if !g.fp32_reference && mma_takes(dt, n_heads, ihd, kv.page_bytes, l.index_page_offset) {
            return g.launch(
                (rows as u32, self.max_nv.div_ceil(MMA_ENTRIES) as u32, 1),
                mma_shared_bytes(ihd) as u32,
                &kernels::IndexScoresMma {
                    pages: DevPtr::of(&kv.pages),
                    page_bytes: kv.page_bytes as i64,
                    seq: DevPtr::of(&dp.seq),
                    pt: DevPtr::of(&dp.pt),
                    row_seq: DevPtr::of(&dp.row_seq),
                    positions: DevPtr::of(&dp.positions),
                    q,
                    wts,
                    scores: DevPtr::of(scores),
                    max_nv: self.max_nv as i32,
                    n_heads: n_heads as i32,
                    ihd: ihd as i32,
                    rate: l.rate as i32,
                    entry_off: l.index_page_offset as i64,
                    entries_per_page: l.index_entries_per_page as i32,
                    page_tokens: layout.page_tokens as i32,
                    softmax_scale,
                    weight_scale,
                },
            );
        }
        g.launch(
            (rows as u32, self.max_nv.div_ceil(WARPS) as u32, 1),
            0,
            &kernels::IndexScores {
                pages: DevPtr::of(&kv.pages),
                page_bytes: kv.page_bytes as i64,
                seq: DevPtr::of(&dp.seq),
                pt: DevPtr::of(&dp.pt),
                row_seq: DevPtr::of(&dp.row_seq),
                positions: DevPtr::of(&dp.positions),
                q,
                wts,
                scores: DevPtr::of(scores),
                max_nv: self.max_nv as i32,
                n_heads: n_heads as i32,
                ihd: ihd as i32,
                rate: l.rate as i32,
                entry_off: l.index_page_offset as i64,
                scale_off: l.index_scale_offset as i64,
                entries_per_page: l.index_entries_per_page as i32,
                page_tokens: layout.page_tokens as i32,
                dt,
                softmax_scale,
                weight_scale,
            },
        )
    }

    /// Per sequence: its visible entries gathered into a dense matrix, then per chunk of
    /// rows every head's dot products as one cuBLAS GEMM (`[rows * heads, ihd] x [nv,
    /// ihd]^T`, fp32 out) and `k_index_reduce`. In the fp32 reference mode the operands are
    /// fp32 (tensor-free: the same values as [`Scoring::by_kernel`] up to the dot products'
    /// summation order); under bf16 weights the queries and entries are rounded to bf16 for
    /// tensor cores (bf16 index-K entries are exact; DeepSeek's reference scores in fp8).
    fn by_gemm(&self, g: &Gpu, plan: &BatchPlan, scores: &DevMem<f32>) -> BResult<()> {
        let (kv, layout, l, dp) = (self.kv, self.layout, self.l, self.dp);
        let (ihd, n_heads) = (layout.index_head_dim, self.n_heads);
        let q = f32_buf(self.q, "index_select")?;
        let wts = f32_buf(self.weights, "index_select")?;
        let dt = dt_code(layout.index_k_dtype)?;
        let bf16 = !g.fp32_reference;
        let q_bf16 = bf16.then(|| to_bf16(g, q)).transpose()?;
        let (q_ptr, esz) = q_bf16.as_ref().map_or((q.ptr(), 4), |b| (b.ptr(), 2));
        for (si, s) in plan.seqs.iter().enumerate() {
            let nvs = (s.start + s.len) / l.rate;
            // Every entry is written by the gather, as bf16 or fp32 values.
            let keys = g.uninit::<u8>(nvs * ihd * esz)?;
            if nvs > 0 {
                g.launch(
                    (nvs.div_ceil(WARPS) as u32, 1, 1),
                    0,
                    &kernels::GatherIndexK {
                        pages: DevPtr::of(&kv.pages),
                        page_bytes: kv.page_bytes as i64,
                        seq: DevPtr::of(&dp.seq),
                        pt: DevPtr::of(&dp.pt),
                        si: si as i32,
                        nv: nvs as i32,
                        ihd: ihd as i32,
                        rate: l.rate as i32,
                        entry_off: l.index_page_offset as i64,
                        scale_off: l.index_scale_offset as i64,
                        entries_per_page: l.index_entries_per_page as i32,
                        page_tokens: layout.page_tokens as i32,
                        dt,
                        out: DevPtr::of(&keys),
                        out_bf16: i32::from(bf16),
                    },
                )?;
            }
            let chunk = (GEMM_CHUNK_FLOATS / (n_heads * nvs.max(1))).clamp(1, s.len.max(1));
            // Every dot product is written by the GEMM (beta 0) before the reduce reads it.
            let dots = g.uninit::<f32>(chunk * n_heads * nvs.max(1))?;
            for c0 in (0..s.len).step_by(chunk) {
                let n = chunk.min(s.len - c0);
                let row0 = s.row0 + c0;
                if nvs > 0 {
                    g.gemm_nt(
                        q_ptr + (row0 * n_heads * ihd * esz) as u64,
                        keys.ptr(),
                        dots.ptr(),
                        (n * n_heads, nvs, ihd),
                        (ihd, ihd, nvs),
                        (0, 0, 0),
                        1,
                        bf16,
                    )?;
                }
                g.launch(
                    (n as u32, self.max_nv.div_ceil(BLOCK as usize) as u32, 1),
                    0,
                    &kernels::IndexReduce {
                        d: DevPtr::of(&dots),
                        nvs: nvs as i32,
                        positions: DevPtr::of(&dp.positions),
                        wts: DevPtr::of(wts),
                        scores: DevPtr::of(scores),
                        row0: row0 as i32,
                        max_nv: self.max_nv as i32,
                        n_heads: n_heads as i32,
                        rate: l.rate as i32,
                        softmax_scale: (ihd as f32).powf(-0.5),
                        weight_scale: (n_heads as f32).powf(-0.5),
                    },
                )?;
            }
        }
        Ok(())
    }
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
