//! DeepSeek's FP8 linear on tensor cores, as its reference inference runs an FP8 weight:
//! the activations quantized per 1 x 128 (`act_quant`: `k_act_quant_e4m3`), the weight's
//! e4m3 bytes and 128 x 128 block scales as stored, and cuBLASLt's block-scaled FP8 GEMM
//! ([`crate::blas_fp8`]) summing the per-block products with both scales in fp32. Under
//! `--numerics deepseek` a prefill-sized batch's FP8 linears run here
//! ([`pdserve_engine::backend::TensorOps::quantized_matmul`]); the GEMMs' descriptors are
//! kept per shape ([`GemmCache`]) and each weight's scales in cuBLASLt's layout with the
//! weight, so a forward neither plans nor synchronises per linear.

use crate::blas_fp8::{Fp8Gemm, Fp8Out, Fp8Scaling, OperandScales, SCALE_BLOCK, WORKSPACE};
use crate::buf::{f32_buf, out_ptr};
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::lanes::Lane;
use crate::launch::{dev_err, grid_1d};
use crate::ops::stored::to_i32;
use crate::ops::tensors::{bf16_to_f32, new_f32};
use crate::tensor::{Buf, GpuTensor, StoredBuf};
use pdserve_engine::backend::BResult;
use pdserve_engine::checkpoint::dequant::e8m0_to_f32;
use pdserve_engine::checkpoint::{StoredWeight, WeightFormat};
use std::collections::HashMap;
use std::sync::Arc;

/// The scalings a linear may run with: DeepSeek's block scales, or both operands per
/// 1 x 128 where the library takes only that; never one scale per tensor (which these
/// operands do not have).
const SCALINGS: [Fp8Scaling; 2] = [Fp8Scaling::Blocks, Fp8Scaling::RowBlocks];

/// Rows from which a linear runs on the FP8 GEMM: below, the stored-weight kernels that
/// stream the weight once for all rows (decode batches) are the faster path.
pub(crate) const MIN_ROWS: usize = 128;

/// Shapes whose GEMM descriptors are kept (a prefill uses one row count for its ~8
/// linear shapes); past it the cache starts over.
const MAX_SHAPES: usize = 64;

/// The rows' padding: cuBLASLt's FP8 GEMM takes rows in multiples of 16.
pub(crate) const ROW_TILE: usize = 16;

/// A kept GEMM's key: `(rows, outputs, inputs)`, the first scaling and output type asked.
type GemmKey = ((usize, usize, usize), Fp8Scaling, Fp8Out);

/// FP8 GEMM descriptors by `(rows, outputs, inputs)`, sharing one workspace (they run one
/// after another on the device's stream).
#[derive(Default)]
pub(crate) struct GemmCache {
    workspace: Option<Arc<DevMem<u8>>>,
    gemms: HashMap<GemmKey, Fp8Gemm>,
    /// Expert GEMMs run so far ([`crate::ops::moe_fp8`]): what shows a check that the
    /// path ran.
    pub(crate) expert_runs: u64,
}

// SAFETY: the cuBLASLt handles and descriptors inside are only used with the backend's
// mutex over this cache held, so calls on them are serialised; they are valid on any
// thread of the process.
#[allow(unsafe_code)]
unsafe impl Send for GemmCache {}

impl std::fmt::Debug for GemmCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GemmCache({} shapes)", self.gemms.len())
    }
}

impl GemmCache {
    fn gemm(&mut self, g: &Gpu, dims: (usize, usize, usize)) -> BResult<&Fp8Gemm> {
        self.gemm_of(g, dims, &SCALINGS, &Fp8Out::UNROUNDED_FIRST)
    }

    /// The GEMM of `dims` with the first of `scalings` and `outs` the library takes (kept
    /// by the shape and the first scaling and output type asked for).
    fn gemm_of(
        &mut self,
        g: &Gpu,
        dims: (usize, usize, usize),
        scalings: &[Fp8Scaling],
        outs: &[Fp8Out],
    ) -> BResult<&Fp8Gemm> {
        let (Some(&first), Some(&out)) = (scalings.first(), outs.first()) else {
            return Err(dev_err(
                "an FP8 GEMM asked for with no scaling or output type",
            ));
        };
        let key = (dims, first, out);
        if !self.gemms.contains_key(&key) {
            if self.gemms.len() >= MAX_SHAPES {
                // Work already queued may still use the descriptors about to go.
                g.synchronize()?;
                self.gemms.clear();
            }
            let ws = match &self.workspace {
                Some(ws) => Arc::clone(ws),
                None => Arc::clone(
                    self.workspace
                        .insert(Arc::new(g.zeros_owned::<u8>(WORKSPACE)?)),
                ),
            };
            let gemm = Fp8Gemm::first_of_in(dims, scalings, outs, &ws)?;
            self.gemms.insert(key, gemm);
        }
        self.gemms
            .get(&key)
            .ok_or_else(|| dev_err("an FP8 GEMM shape missing from its cache"))
    }

    /// The GEMM planned for `rows`' power-of-two bucket (at least [`ROW_TILE`]) with the
    /// first of `outs` the library takes, to run at `rows` through [`Fp8Gemm::run_rows`]:
    /// runs of many row counts (each expert's picks) share a few descriptor sets.
    pub(crate) fn for_rows(
        &mut self,
        g: &Gpu,
        (rows, m, k): (usize, usize, usize),
        scaling: Fp8Scaling,
        outs: &[Fp8Out],
    ) -> BResult<&Fp8Gemm> {
        let bucket = rows.next_power_of_two().max(ROW_TILE);
        self.gemm_of(g, (bucket, m, k), &[scaling], outs)
    }

    /// `out = x @ w^T` (values of type `out_type`) over `rows` rows with the bucket's GEMM
    /// ([`GemmCache::for_rows`]); where the library refuses that algorithm at this row
    /// count, with one planned for it. `x` and `w` are (codes, scales) device addresses.
    /// On `lane`'s stream and workspace, else on the device's stream.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_rows(
        &mut self,
        g: &Gpu,
        lane: Option<&Lane>,
        (rows, m, k): (usize, usize, usize),
        (scaling, out_type): (Fp8Scaling, Fp8Out),
        x: (u64, u64),
        w: (u64, u64),
        out: u64,
    ) -> BResult<()> {
        let run = |gemm: &Fp8Gemm| match lane {
            Some(lane) => gemm.run_rows_on(lane, rows, x, w, out),
            None => gemm.run_rows(g, rows, x, w, out),
        };
        if run(self.for_rows(g, (rows, m, k), scaling, &[out_type])?).is_ok() {
            return Ok(());
        }
        run(self.gemm_of(g, (rows, m, k), &[scaling], &[out_type])?)
    }
}

/// Whether `x @ w^T` of `x`'s rows takes the FP8 GEMM: an fp32 activation of at least
/// [`MIN_ROWS`] rows, an FP8 weight with one scale grid over all its rows, outputs a
/// multiple of 16 and inputs of 128, outside decode steps, and not in a mode that keeps
/// fp32 products or batch-invariant sums (the reference and `--deterministic`).
pub(crate) fn takes(g: &Gpu, x: &GpuTensor, w: &GpuTensor) -> bool {
    let fp8 = matches!(w.stored(), Some(sw) if sw.format == WeightFormat::Fp8Block && sw.group_rows == w.rows);
    fp8 && matches!(x.buf, Buf::F32(_))
        && x.rows >= MIN_ROWS
        && x.cols == w.cols
        && w.rows.is_multiple_of(16)
        && w.cols.is_multiple_of(SCALE_BLOCK)
        && !g.in_step()
        && !g.fp32_reference
        && !g.deterministic
}

/// FP8 activations: `rows x cols` e4m3 codes (row-major) and one f32 scale per 1 x 128
/// block in cuBLASLt's VEC128 layout (`[block][row]`).
pub(crate) struct Fp8Activations {
    pub q: DevMem<u8>,
    pub s: DevMem<f32>,
}

/// `act_quant` of `rows` fp32 rows of `cols` values (`ldx` apart), for a GEMM over
/// `padded` rows (>= rows): the codes of the rows past `rows` and their scales are 0.
pub(crate) fn act_quant(
    g: &Gpu,
    x: &DevMem<f32>,
    (rows, cols, ldx): (usize, usize, usize),
    padded: usize,
) -> BResult<Fp8Activations> {
    if ldx < cols || padded < rows || x.len() < rows.saturating_sub(1) * ldx + cols {
        return Err(dev_err(format!(
            "act_quant of {rows} x {cols} (row stride {ldx}, padded to {padded}) over {} values",
            x.len()
        )));
    }
    let kb = cols.div_ceil(SCALE_BLOCK);
    let (q, s) = if padded > rows {
        (g.zeros::<u8>(padded * cols)?, g.zeros::<f32>(padded * kb)?)
    } else {
        (g.uninit::<u8>(rows * cols)?, g.uninit::<f32>(rows * kb)?)
    };
    // A warp per 128-value block (the kernel strides when the grid is capped).
    g.launch(
        grid_1d(rows * kb * 32),
        0,
        &kernels::ActQuantE4m3 {
            x: DevPtr::of(x),
            ldx: to_i32(ldx, "row stride")?,
            q: DevPtr::of(&q),
            s: DevPtr::of(&s),
            rows: to_i32(rows, "rows")?,
            cols: to_i32(cols, "columns")?,
            srows: to_i32(padded, "padded rows")?,
        },
    )?;
    Ok(Fp8Activations { q, s })
}

/// The 128 x 128 block scales of an FP8 weight of `rows x cols` as f32, in `layout`
/// (from the stored ue8m0 bytes: one grid over all rows, or groups of whole 128-row
/// blocks, such as experts).
pub(crate) fn weight_scales(
    g: &Gpu,
    w: &StoredBuf,
    (rows, cols): (usize, usize),
    layout: OperandScales,
) -> BResult<DevMem<f32>> {
    // Groups of whole 128-row blocks make the same grid as one group of all the rows.
    let whole_blocks = w.group_rows == rows || w.group_rows.is_multiple_of(SCALE_BLOCK);
    if w.format != WeightFormat::Fp8Block || !whole_blocks || !rows.is_multiple_of(w.group_rows) {
        return Err(dev_err(format!(
            "an FP8 GEMM takes a {:?} weight in groups of {} rows: one FP8 grid over all {rows} rows expected",
            w.format, w.group_rows
        )));
    }
    let (sr, sc) = StoredWeight::scale_grid(w.format, w.group_rows, cols);
    let bytes = g.download(&w.s, rows / w.group_rows * sr * sc)?;
    let natural = bytes
        .iter()
        .map(|&b| e8m0_to_f32(b).ok_or_else(|| dev_err("a NaN weight scale byte")))
        .collect::<BResult<Vec<f32>>>()?;
    let laid = layout
        .lay_out(&natural, (rows, cols), SCALE_BLOCK)
        .map_err(|e| dev_err(format!("weight scales: {e}")))?;
    g.upload(&laid)
}

/// `y = act_quant(x) @ w^T` (`n x m`, fp32: the GEMM's own fp32 output where the library
/// takes it, else widened from its bf16) for `n` rows of an
/// FP8 weight `w` of `m x k` (see [`takes`] for what it needs); `n` is padded to the
/// GEMM's row tile.
pub(crate) fn linear(
    g: &Gpu,
    cache: &mut GemmCache,
    x: &GpuTensor,
    w: &GpuTensor,
) -> BResult<GpuTensor> {
    let mut ys = linears(g, cache, x, &[w])?;
    ys.pop()
        .ok_or_else(|| dev_err("the FP8 linear gave no output"))
}

/// [`linear`] of one input and several weights, the input quantized once.
pub(crate) fn linears(
    g: &Gpu,
    cache: &mut GemmCache,
    x: &GpuTensor,
    ws: &[&GpuTensor],
) -> BResult<Vec<GpuTensor>> {
    let (n, k) = (x.rows, x.cols);
    let padded = n.next_multiple_of(ROW_TILE);
    let mut act = None;
    let mut ys = Vec::with_capacity(ws.len());
    for w in ws {
        let act = match (&act, n) {
            (_, 0) => None,
            (Some(a), _) => Some(a),
            (None, _) => {
                Some(&*act.insert(act_quant(g, f32_buf(x, "fp8 linear")?, (n, k, k), padded)?))
            }
        };
        ys.push(linear_quantized(g, cache, act, (n, k), w)?);
    }
    Ok(ys)
}

/// The block-scaled GEMM of `n` rows of quantized activations `act` (`n x k`, padded to
/// the row tile; None where n is 0) and FP8 weight `w`.
fn linear_quantized(
    g: &Gpu,
    cache: &mut GemmCache,
    act: Option<&Fp8Activations>,
    (n, k): (usize, usize),
    w: &GpuTensor,
) -> BResult<GpuTensor> {
    let Some(sw) = w.stored() else {
        return Err(dev_err("the FP8 linear takes a weight kept as stored"));
    };
    let m = w.rows;
    if w.cols != k || !m.is_multiple_of(16) || !k.is_multiple_of(SCALE_BLOCK) {
        return Err(dev_err(format!(
            "the FP8 GEMM takes outputs in multiples of 16 and inputs in multiples of 128, not {n} x {m} x {} (x of {k} columns)",
            w.cols
        )));
    }
    let y = new_f32(g, n, m)?;
    let Some(act) = act.filter(|_| n > 0) else {
        return Ok(y);
    };
    let padded = n.next_multiple_of(ROW_TILE);
    let gemm = cache.gemm(g, (padded, m, k))?;
    let layout = gemm.scaling.weight_scales();
    let fresh;
    let ws = match w.fp8_scales() {
        Some((l, s)) if *l == layout => s,
        Some(_) => {
            fresh = weight_scales(g, sw, (m, k), layout)?;
            &fresh
        }
        None => {
            &w.keep_fp8_scales(layout, weight_scales(g, sw, (m, k), layout)?)
                .1
        }
    };
    // The GEMM writes y itself where it can (fp32 sums, no padded rows), else a scratch
    // of `padded` rows (row-major `[padded][m]`) whose first n rows go into y.
    let y_ptr = out_ptr(&y)?.0;
    let scratch = if gemm.out == Fp8Out::F32 && padded == n {
        None
    } else {
        Some(g.uninit::<u8>(padded * m * gemm.out.bytes())?)
    };
    let dst = scratch.as_ref().map_or(y_ptr, DevMem::ptr);
    gemm.run(g, act.q.ptr(), act.s.ptr(), sw.q.ptr(), ws.ptr(), dst)?;
    match (&scratch, gemm.out) {
        (None, _) => {}
        (Some(s), Fp8Out::F32) => g.copy_dtod(y_ptr, s.ptr(), n * m * 4)?,
        // (Activations-first scalings are not among SCALINGS.)
        (Some(s), Fp8Out::Bf16) => bf16_to_f32(g, s.ptr(), y_ptr, n * m)?,
    }
    Ok(y)
}
