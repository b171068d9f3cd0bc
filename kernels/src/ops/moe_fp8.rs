//! Routed experts of a prefill under `--numerics deepseek` on cuBLASLt's block-scaled FP8
//! GEMM, the way DeepSeek's reference runs FP8/FP4 experts: picks sorted by expert on the
//! host (as [`crate::ops::moe_gemm`]), each pick's input row quantized per 1 x 128 into its
//! expert's run of GEMM rows (padded to the GEMM's row tile, each run with its own VEC128
//! scales), one FP8 GEMM per used expert and projection, and between them one kernel for
//! SwiGLU of the gate/up rows, the routing weight and w2's act_quant. The GEMMs write
//! fp32 where the library takes it (bf16 otherwise, widened after w2). FP8 experts
//! are read as stored (e4m3 bytes, 128 x 128 block scales); FP4 experts are expanded to
//! e4m3 one expert at a time, exactly (the reference expands them to FP8 inside its GEMM).
//! No bf16 copy of any expert is made.
//!
//! The GEMMs' descriptors are kept per power-of-two row bucket ([`GemmCache::for_rows`]),
//! each run at its expert's exact row count, so a forward plans a few shapes, not one per
//! expert.

use crate::blas_fp8::{Fp8Out, Fp8Scaling, OperandScales, SCALE_BLOCK};
use crate::buf::f32_buf;
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr, Elem};
use crate::lanes::Lane;
use crate::launch::{dev_err, grid_1d};
use crate::ops::fp8_linear::{act_quant, weight_scales, GemmCache, ROW_TILE};
use crate::ops::moe_gemm::{sort_picks, SortedRows};
use crate::ops::numerics::RoutedQuant;
use crate::ops::stored::to_i32;
use crate::ops::tensors::bf16_to_f32;
use crate::tensor::{GpuTensor, StoredBuf};
use pdserve_engine::backend::{BResult, MoeParams};
use pdserve_engine::checkpoint::WeightFormat;
use std::sync::Mutex;

/// Whether the routed experts of this MoE run here: FP8 activations asked for (`quant`),
/// outside decode steps and the fp32 reference / batch-invariant modes, both projections
/// stored FP8 (each expert on whole 128-row scale blocks) or FP4, inputs in whole
/// 128-blocks.
pub(crate) fn takes(g: &Gpu, p: &MoeParams<'_, GpuTensor>, quant: bool) -> bool {
    quant
        && !g.in_step()
        && !g.fp32_reference
        && !g.deterministic
        && ExpertWeights::takes(p.gate_up, 2 * p.intermediate)
        && ExpertWeights::takes(p.down, p.gate_up.cols)
}

/// Each used expert's run of GEMM rows: `(expert, first sorted pick, picks, first GEMM
/// row, GEMM rows)`, the GEMM rows padded to [`ROW_TILE`].
struct Runs {
    runs: Vec<(usize, usize, usize, usize, usize)>,
    rows: usize,
}

impl Runs {
    fn new(spans: &[(usize, usize)]) -> Self {
        let mut runs = Vec::new();
        let mut rows = 0;
        for (ex, &(first, count)) in spans.iter().enumerate() {
            if count == 0 {
                continue;
            }
            let padded = count.next_multiple_of(ROW_TILE);
            runs.push((ex, first, count, rows, padded));
            rows += padded;
        }
        Runs { runs, rows }
    }

    /// Four ints per sorted pick for the kernels that fill the runs
    /// (`k_gather_quantized_picks`, `k_moe_swiglu_quant_e4m3`):
    /// the pick, its GEMM row, its first scale and the scales' stride (its run's rows), for
    /// operands of `kb` 128-blocks a row; and each pick's GEMM row (the combine's `pos`).
    fn map(&self, order: &[i32], kb: usize) -> BResult<(Vec<i32>, Vec<i32>)> {
        let mut map = vec![0i32; 4 * order.len()];
        let mut pos = vec![0i32; order.len()];
        for &(_, first, count, row0, padded) in &self.runs {
            for i in 0..count {
                let (j, row) = (first + i, row0 + i);
                let pick = order[j];
                let at = &mut map[4 * j..4 * j + 4];
                at[0] = pick;
                at[1] = to_i32(row, "GEMM row")?;
                at[2] = to_i32(row0 * kb + i, "scale index")?;
                at[3] = to_i32(padded, "run rows")?;
                pos[pick as usize] = at[1];
            }
        }
        Ok((map, pos))
    }
}

/// One projection of every expert (`per` rows each) as the FP8 GEMM's weight operand.
/// FP8: the stored e4m3 codes and, kept with the weight, its 128 x 128 block scales in
/// cuBLASLt's BLK128 layout (`[row block][pad4(k blocks)]`), so expert `ex`'s codes and
/// scales are slices. FP4: each expert expanded to e4m3 with one scale per 1 x 128 row
/// block (`k_fp4_to_e4m3`) just before its GEMM, into a buffer reused by the GEMMs of
/// one stream (one per lane, see [`run_experts`]).
struct ExpertWeights<'a> {
    stored: &'a StoredBuf,
    fp8_scales: Option<&'a DevMem<f32>>,
    fp4_scratch: Vec<(DevMem<u8>, DevMem<f32>)>,
    per: usize,
    cols: usize,
}

impl<'a> ExpertWeights<'a> {
    fn takes(w: &GpuTensor, per: usize) -> bool {
        let format_ok = match w.stored() {
            Some(sw) if sw.format == WeightFormat::Fp8Block => {
                sw.group_rows.is_multiple_of(SCALE_BLOCK) && per.is_multiple_of(SCALE_BLOCK)
            }
            Some(sw) => sw.format == WeightFormat::Fp4Packed && per.is_multiple_of(ROW_TILE),
            None => false,
        };
        format_ok && per > 0 && w.rows.is_multiple_of(per) && w.cols.is_multiple_of(SCALE_BLOCK)
    }

    /// FP4: one expansion buffer per stream that may run this projection's GEMMs at once
    /// ([`Gpu::expert_lanes`]).
    fn new(g: &Gpu, w: &'a GpuTensor, per: usize) -> BResult<Self> {
        let Some(stored) = w.stored() else {
            return Err(dev_err("FP8/FP4 experts kept as stored expected"));
        };
        let (mut fp8_scales, mut fp4_scratch) = (None, Vec::new());
        if stored.format == WeightFormat::Fp8Block {
            let layout = OperandScales::Blk128;
            fp8_scales = Some(match w.fp8_scales() {
                Some((l, s)) if *l == layout => s,
                Some((l, _)) => {
                    return Err(dev_err(format!(
                        "expert weight scales kept as {l:?}; the expert GEMMs take {layout:?}"
                    )))
                }
                None => {
                    &w.keep_fp8_scales(layout, weight_scales(g, stored, (w.rows, w.cols), layout)?)
                        .1
                }
            });
        } else {
            let kb = w.cols / SCALE_BLOCK;
            for _ in 0..g.expert_lanes.max(1) {
                fp4_scratch.push((g.uninit::<u8>(per * w.cols)?, g.uninit::<f32>(per * kb)?));
            }
        }
        Ok(ExpertWeights {
            stored,
            fp8_scales,
            fp4_scratch,
            per,
            cols: w.cols,
        })
    }

    /// The scaling its GEMMs run with.
    fn scaling(&self) -> Fp8Scaling {
        match self.fp8_scales {
            Some(_) => Fp8Scaling::Blocks,
            None => Fp8Scaling::RowBlocks,
        }
    }

    /// Device addresses of expert `ex`'s e4m3 codes and scales, as its GEMM on `lane`
    /// (`slot` of [`run_experts`]' lanes; `None`: the device's stream) reads them. An FP4
    /// expert is expanded on that stream into its slot's buffer, which the stream's
    /// previous GEMM has read by then.
    fn expert(
        &self,
        g: &Gpu,
        (lane, slot): (Option<&Lane>, usize),
        ex: usize,
    ) -> BResult<(u64, u64)> {
        let (per, cols) = (self.per, self.cols);
        if let Some(scales) = self.fp8_scales {
            let kb4 = cols.div_ceil(SCALE_BLOCK).next_multiple_of(4);
            let scale0 = ex * (per / SCALE_BLOCK) * kb4;
            return Ok((
                self.stored.q.ptr() + (ex * per * cols) as u64,
                scales.ptr() + (scale0 * 4) as u64,
            ));
        }
        let Some((q8, s8)) = self.fp4_scratch.get(slot) else {
            return Err(dev_err(format!(
                "FP4 experts without an expansion buffer for stream {slot}"
            )));
        };
        let grid = grid_1d(per * (cols / SCALE_BLOCK) * 32);
        let expand = kernels::Fp4ToE4m3 {
            q4: DevPtr(self.stored.q.ptr() + (ex * per * cols / 2) as u64),
            s4: DevPtr(self.stored.s.ptr() + (ex * per * (cols / 32)) as u64),
            q8: DevPtr::of(q8),
            s8: DevPtr::of(s8),
            rows: to_i32(per, "expert rows")?,
            cols: to_i32(cols, "expert inputs")?,
        };
        g.launch_on(lane.map(|l| &*l.stream), grid, 0, &expand)?;
        Ok((q8.ptr(), s8.ptr()))
    }
}

/// The routed experts' outputs, sorted by expert as [`crate::ops::moe_gemm::routed`]'s
/// (`pos` maps each pick to its row); `None` where the library has no block-scaled GEMM
/// for these shapes (the caller takes the bf16 path), decided before anything runs.
pub(crate) fn routed(
    g: &Gpu,
    gemms: &Mutex<GemmCache>,
    x: &GpuTensor,
    p: &MoeParams<'_, GpuTensor>,
    host_ids: &[i32],
    quant: &RoutedQuant<'_>,
) -> BResult<Option<SortedRows>> {
    let (n, h) = (x.rows, x.cols);
    let (e, k, inter) = (p.n_experts, p.top_k, p.intermediate);
    let mut cache = gemms
        .lock()
        .map_err(|_| dev_err("FP8 GEMM cache lock poisoned"))?;
    let (order, spans) = sort_picks(host_ids, (n, k), e)?;
    let runs = Runs::new(&spans);
    let gu_w = ExpertWeights::new(g, p.gate_up, 2 * inter)?;
    let down_w = ExpertWeights::new(g, p.down, h)?;
    // Whether the library takes these scalings (and which output type), asked at the
    // largest run's bucket.
    let most = runs.runs.iter().map(|r| r.4).max().unwrap_or(ROW_TILE);
    let Some(gu_out) = expert_out(g, &mut cache, (most, 2 * inter, h), gu_w.scaling()) else {
        return Ok(None);
    };
    let Some(down_out) = expert_out(g, &mut cache, (most, h, inter), down_w.scaling()) else {
        return Ok(None);
    };
    let picks = to_i32(n * k, "picks")?;
    let (kb_h, kb_i) = (h / SCALE_BLOCK, inter / SCALE_BLOCK);
    // The gate/up GEMMs' input: every token quantized once, each pick's row of it copied
    // into its expert's run.
    let (map_h, pos) = runs.map(&order, kb_h)?;
    let map_h = g.upload(&map_h)?;
    let tokens = act_quant(g, f32_buf(x, "moe")?, (n, h, h), n)?;
    let (xq, xs) = (
        g.zeros::<u8>(runs.rows * h)?,
        g.zeros::<f32>(runs.rows * kb_h)?,
    );
    g.launch(
        (picks.unsigned_abs(), 1, 1),
        0,
        &kernels::GatherQuantizedPicks {
            xq: DevPtr::of(&tokens.q),
            xs: DevPtr::of(&tokens.s),
            n: to_i32(n, "tokens")?,
            map: DevPtr::of(&map_h),
            q: DevPtr::of(&xq),
            s: DevPtr::of(&xs),
            picks,
            cols: to_i32(h, "hidden")?,
            k: to_i32(k, "top k")?,
        },
    )?;
    drop(tokens);
    let gu = g.uninit::<u8>(runs.rows * 2 * inter * gu_out.bytes())?;
    run_experts(g, &mut cache, &runs, &gu_w, (&xq, &xs), (gu.ptr(), gu_out))?;
    drop((xq, xs, map_h));
    // w2's input: SwiGLU, the routing weight, act_quant.
    let (map_i, _) = runs.map(&order, kb_i)?;
    let map_i = g.upload(&map_i)?;
    let (aq, asc) = (
        g.zeros::<u8>(runs.rows * inter)?,
        g.zeros::<f32>(runs.rows * kb_i)?,
    );
    g.launch(
        grid_1d(n * k * kb_i * 32),
        0,
        &kernels::MoeSwigluQuantE4m3 {
            variant: match gu_out {
                Fp8Out::Bf16 => Elem::Bf16,
                Fp8Out::F32 => Elem::F32,
            },
            gu: DevPtr::of(&gu),
            map: DevPtr::of(&map_i),
            wts: DevPtr::of(quant.wts),
            unit: DevPtr::of(quant.unit),
            q: DevPtr::of(&aq),
            s: DevPtr::of(&asc),
            picks,
            inter: to_i32(inter, "intermediate")?,
            limit: p.swiglu_limit,
        },
    )?;
    drop(gu);
    // The down GEMMs write y itself, or bf16 rows widened into it.
    let y = g.uninit::<f32>(runs.rows * h)?;
    let yb = match down_out {
        Fp8Out::F32 => None,
        Fp8Out::Bf16 => Some(g.uninit::<u16>(runs.rows * h)?),
    };
    let dst = yb.as_ref().map_or(y.ptr(), DevMem::ptr);
    run_experts(g, &mut cache, &runs, &down_w, (&aq, &asc), (dst, down_out))?;
    if let Some(yb) = &yb {
        bf16_to_f32(g, yb.ptr(), y.ptr(), runs.rows * h)?;
    }
    Ok(Some(SortedRows {
        y,
        pos: g.upload(&pos)?,
    }))
}

/// The output type of the block-scaled GEMM the library has for an expert projection of
/// `dims` (rows, outputs, inputs), or `None` (logged) where it has none.
fn expert_out(
    g: &Gpu,
    cache: &mut GemmCache,
    dims: (usize, usize, usize),
    scaling: Fp8Scaling,
) -> Option<Fp8Out> {
    match cache.for_rows(g, dims, scaling, &Fp8Out::UNROUNDED_FIRST) {
        Ok(gemm) => Some(gemm.out),
        Err(e) => {
            tracing::warn!(error = %e, ?dims, ?scaling, "FP8 expert GEMM refused: the experts take bf16 GEMMs");
            None
        }
    }
}

/// One projection of every used expert: its run of `act`'s rows (e4m3 codes, VEC128
/// scales per run) times the expert's weight into the same rows of `out` (a device
/// address, values of `out_type`), spread over side streams ([`Gpu::spread`]): each GEMM
/// reads and writes only its own run's rows, so they may run at once. Every buffer they
/// touch was allocated on the device's stream before the fork.
fn run_experts(
    g: &Gpu,
    cache: &mut GemmCache,
    runs: &Runs,
    weights: &ExpertWeights<'_>,
    (codes, scales): (&DevMem<u8>, &DevMem<f32>),
    (out, out_type): (u64, Fp8Out),
) -> BResult<()> {
    let (m, k) = (weights.per, weights.cols);
    let kb = k / SCALE_BLOCK;
    g.spread(runs.runs.len(), |lane, slot, i| {
        let (ex, _, _, row0, rows) = runs.runs[i];
        let x = (
            codes.ptr() + (row0 * k) as u64,
            scales.ptr() + (row0 * kb * 4) as u64,
        );
        let y = out + (row0 * m * out_type.bytes()) as u64;
        let w = weights.expert(g, (lane, slot), ex)?;
        cache.run_rows(
            g,
            lane,
            (rows, m, k),
            (weights.scaling(), out_type),
            x,
            w,
            y,
        )?;
        cache.expert_runs += 1;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn runs_pad_each_expert_and_map_picks_to_their_rows_and_scales() {
        // 4 experts; sorted picks: expert 0 has 2, expert 1 none, expert 2 has 17, expert 3 has 1.
        let spans = [(0, 2), (2, 0), (2, 17), (19, 1)];
        let runs = Runs::new(&spans);
        assert_eq!(
            runs.runs,
            vec![(0, 0, 2, 0, 16), (2, 2, 17, 16, 32), (3, 19, 1, 48, 16)]
        );
        assert_eq!(runs.rows, 64);
        let order: Vec<i32> = (0..20).rev().collect();
        let (map, pos) = runs.map(&order, 3).unwrap();
        // Sorted pick 1 (pick 18): expert 0's second row, scales from 1, stride 16.
        assert_eq!(&map[4..8], &[18, 1, 1, 16]);
        // Sorted pick 4 (pick 15): expert 2's third row (GEMM row 18); its run's scales
        // start at 16 * 3.
        assert_eq!(&map[16..20], &[15, 18, 48 + 2, 32]);
        // Sorted pick 19 (pick 0): expert 3's only row.
        assert_eq!(&map[76..80], &[0, 48, 48 * 3, 16]);
        assert_eq!((pos[18], pos[15], pos[0]), (1, 18, 48));
    }
}
