//! The lightning indexer op: scores of every visible compressed entry, then each row's
//! top-k (`cu/indexer.cu`).

use crate::buf::{f32_buf, shape_err};
use crate::device::{Gpu, IndexerBlocking, MMA_SHARED};
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::kv_store::{dt_code, DevPlan, GpuKv, DT_BF16};
use crate::launch::BLOCK;
use crate::ops::kv_reach::{check_visible_reach, entry_bucket, layer_of};
use crate::ops::numerics;
use crate::ops::tensors::to_bf16;
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{BResult, BatchPlan};
use pdserve_engine::config::LayerKind;
use pdserve_engine::kv::{KvLayout, LayerKvLayout};
use pdserve_engine::numerics::Numerics;

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
    // deepseek numerics score rotated, FP4-quantized queries against the keys the
    // compressor stored the same way.
    let rotated;
    let q = if layout.numerics == Numerics::Deepseek {
        rotated = numerics::rotate_fp4(g, q, ihd)?;
        &rotated
    } else {
        q
    };
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
    let dt = dt_code(layout.index_k_dtype)?;
    let scoring = Scoring {
        kv,
        layout,
        l,
        dt,
        dp: &dp,
        q,
        weights,
        n_heads,
        max_nv,
    };
    let mma = !g.fp32_reference && mma_takes(dt, n_heads, ihd, kv, layout, l);
    if (!mma || g.indexer_gemm) && by_gemm(g, plan) {
        scoring.by_gemm(g, plan, &scores)?;
    } else {
        scoring.by_kernel(g, plan, mma, &scores)?;
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

/// Whether `k_index_scores_mma` takes the layer: bf16 entries, at most 64 heads, a head
/// dim that is a power of two from 16 to 256 (its copies split each entry into ihd / 8
/// columns across the block), 16-byte aligned entry rows, a page holding
/// `entries_per_page` whole entries (the kernel steps through entries page by page).
fn mma_takes(
    dt: i32,
    n_heads: usize,
    ihd: usize,
    kv: &GpuKv,
    layout: &KvLayout,
    l: &LayerKvLayout,
) -> bool {
    dt == DT_BF16
        && n_heads <= MMA_HEADS
        && ihd.is_power_of_two()
        && (16..=MMA_MAX_DIM).contains(&ihd)
        && kv.page_bytes.is_multiple_of(16)
        && l.index_page_offset.is_multiple_of(16)
        && l.index_entries_per_page * l.rate == layout.page_tokens
        && mma_shared_bytes(ihd) <= MMA_SHARED
}

/// Its dynamic shared memory: two rows' queries and two stages of entries as padded bf16
/// rows, then the two rows' head weights in f32.
fn mma_shared_bytes(ihd: usize) -> usize {
    (2 * MMA_HEADS + 2 * MMA_ENTRIES) * (ihd + 8) * 2 + 2 * MMA_HEADS * 4
}

/// Blocks of the tensor-core scores' grid from which a block takes more than one tile of
/// [`MMA_ENTRIES`] (its queries loaded once for all), and the most tiles it takes.
const MMA_TILE_BLOCKS: usize = 8192;
const MMA_MAX_TILES: usize = 8;

/// The blocking for `rows` plan rows of `seqs` sequences over `max_nv` entries: rows in
/// pairs when some sequence has several (a prefill), one per block otherwise (a decode
/// step's rows are all of different sequences); one tile per block (a block per row and
/// tile, as a decode step needs to fill the device) until the grid would exceed
/// [`MMA_TILE_BLOCKS`] blocks, then up to [`MMA_MAX_TILES`], so a prefill's grid stays
/// many waves deep while each block loads its queries once.
fn mma_blocking(rows: usize, seqs: usize, max_nv: usize) -> IndexerBlocking {
    let per_block = if rows > seqs { 2 } else { 1 };
    let blocks = rows.div_ceil(per_block) * max_nv.div_ceil(MMA_ENTRIES);
    IndexerBlocking {
        rows: per_block,
        tiles: (blocks / MMA_TILE_BLOCKS).clamp(1, MMA_MAX_TILES),
    }
}

/// A sequence's rows from which the scores go through the GEMM path.
const GEMM_ROWS: usize = 64;

/// Floats of one chunk's per-head dot products (256 MiB).
const GEMM_CHUNK_FLOATS: usize = 64 << 20;

/// The GEMM path for prefill-sized forwards (some sequence has [`GEMM_ROWS`] rows or more)
/// that the tensor-core kernel does not take (the fp32 reference mode, fp32 or fp8 index-K),
/// outside decode steps and `--deterministic` (where cuBLAS's shape-dependent order would
/// make scores depend on how a prompt was chunked).
fn by_gemm(g: &Gpu, plan: &BatchPlan) -> bool {
    !g.deterministic && !g.in_step() && plan.seqs.iter().any(|s| s.len >= GEMM_ROWS)
}

/// What both ways of scoring one layer's rows read.
struct Scoring<'a> {
    kv: &'a GpuKv,
    layout: &'a KvLayout,
    l: &'a LayerKvLayout,
    /// The index-K entries' dtype code (`dt` in common.cuh).
    dt: i32,
    dp: &'a DevPlan,
    q: &'a GpuTensor,
    weights: &'a GpuTensor,
    n_heads: usize,
    max_nv: usize,
}

impl Scoring<'_> {
    /// One warp per (row, entry), every head's dot product in turn (`k_index_scores`); or,
    /// when `mma` (bf16 weights, bf16 entries, dims it takes), the same scores on tensor
    /// cores (`k_index_scores_mma`: a block per [`mma_blocking`] rows and tiles of 128
    /// entries, every head at once, the causally invisible tiles skipped).
    fn by_kernel(&self, g: &Gpu, plan: &BatchPlan, mma: bool, scores: &DevMem<f32>) -> BResult<()> {
        let (kv, layout, l, dp) = (self.kv, self.layout, self.l, self.dp);
        let rows = plan.rows();
        let ihd = layout.index_head_dim;
        let (n_heads, dt) = (self.n_heads, self.dt);
        let (q, wts) = (
            DevPtr::of(f32_buf(self.q, "index_select")?),
            DevPtr::of(f32_buf(self.weights, "index_select")?),
        );
        let (softmax_scale, weight_scale) = ((ihd as f32).powf(-0.5), (n_heads as f32).powf(-0.5));
        if mma {
            let b = g
                .indexer_blocking
                .unwrap_or_else(|| mma_blocking(rows, plan.seqs.len(), self.max_nv));
            let (per_block, tiles) = (b.rows.clamp(1, 2), b.tiles.max(1));
            return g.launch(
                (
                    rows.div_ceil(per_block) as u32,
                    self.max_nv.div_ceil(MMA_ENTRIES * tiles) as u32,
                    1,
                ),
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
                    rows: rows as i32,
                    rows_per_block: per_block as i32,
                    tiles: tiles as i32,
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
        let dt = self.dt;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn blocking(rows: usize, tiles: usize) -> IndexerBlocking {
        IndexerBlocking { rows, tiles }
    }

    #[test]
    fn decode_steps_keep_one_row_and_tile_and_prefills_pair_rows_over_many_tiles() {
        // Decode steps (one row per sequence): batch 1, 64 and 256 at 32K context (8192
        // entries, 64 tiles each).
        assert_eq!(mma_blocking(1, 1, 8192), blocking(1, 1));
        assert_eq!(mma_blocking(64, 64, 8192), blocking(1, 1));
        assert_eq!(mma_blocking(256, 256, 8192), blocking(1, 2));
        // Prefills: 8K rows over 2048 entries, 32K rows over 8192, a short one.
        assert_eq!(mma_blocking(8192, 1, 2048), blocking(2, 8));
        assert_eq!(mma_blocking(32768, 1, 8192), blocking(2, 8));
        assert_eq!(mma_blocking(200, 1, 50), blocking(2, 1));
        // No entries yet (a first chunk shorter than the rate): a valid grid.
        assert_eq!(mma_blocking(3, 1, 0), blocking(2, 1));
    }
}
