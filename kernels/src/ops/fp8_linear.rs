//! DeepSeek's FP8 linear on tensor cores, as its reference inference runs an FP8 weight:
//! the activations quantized per 1 x 128 (`act_quant`: `k_act_quant_e4m3`), the weight's
//! e4m3 bytes and 128 x 128 block scales as stored, and cuBLASLt's block-scaled FP8 GEMM
//! ([`crate::blas_fp8`]) summing the per-block products with both scales in fp32. The
//! building block of `--numerics deepseek` on the GPU; the forward does not call it yet
//! (`gpu-check --only stored` checks it against the CPU's act_quant and product).

use crate::blas_fp8::{Fp8Gemm, Fp8Scaling, OperandScales, SCALE_BLOCK};
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::launch::{dev_err, grid_1d};
use crate::ops::stored::to_i32;
use crate::tensor::StoredBuf;
use pdserve_engine::backend::BResult;
use pdserve_engine::checkpoint::dequant::e8m0_to_f32;
use pdserve_engine::checkpoint::{StoredWeight, WeightFormat};

/// FP8 activations: `rows x cols` e4m3 codes (row-major) and one f32 scale per 1 x 128
/// block in cuBLASLt's VEC128 layout (`[block][row]`).
pub(crate) struct Fp8Activations {
    pub q: DevMem<u8>,
    pub s: DevMem<f32>,
}

/// `act_quant` of `rows` fp32 rows of `cols` values (`ldx` apart).
pub(crate) fn act_quant(
    g: &Gpu,
    x: &DevMem<f32>,
    (rows, cols, ldx): (usize, usize, usize),
) -> BResult<Fp8Activations> {
    if ldx < cols || x.len() < rows.saturating_sub(1) * ldx + cols {
        return Err(dev_err(format!(
            "act_quant of {rows} x {cols} (row stride {ldx}) over {} values",
            x.len()
        )));
    }
    let kb = cols.div_ceil(SCALE_BLOCK);
    let q = g.uninit::<u8>(rows * cols)?;
    let s = g.uninit::<f32>(rows * kb)?;
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
        },
    )?;
    Ok(Fp8Activations { q, s })
}

/// The 128 x 128 block scales of an FP8 weight of `rows x cols` as f32, in `layout`
/// (from the stored ue8m0 bytes, one grid over all rows).
pub(crate) fn weight_scales(
    g: &Gpu,
    w: &StoredBuf,
    (rows, cols): (usize, usize),
    layout: OperandScales,
) -> BResult<DevMem<f32>> {
    if w.format != WeightFormat::Fp8Block || w.group_rows != rows {
        return Err(dev_err(format!(
            "an FP8 GEMM takes a {:?} weight in groups of {} rows: one FP8 grid over all {rows} rows expected",
            w.format, w.group_rows
        )));
    }
    let (sr, sc) = StoredWeight::scale_grid(w.format, rows, cols);
    let bytes = g.download(&w.s, sr * sc)?;
    let natural = bytes
        .iter()
        .map(|&b| e8m0_to_f32(b).ok_or_else(|| dev_err("a NaN weight scale byte")))
        .collect::<BResult<Vec<f32>>>()?;
    let laid = layout
        .lay_out(&natural, (rows, cols), SCALE_BLOCK)
        .map_err(|e| dev_err(format!("weight scales: {e}")))?;
    g.upload(&laid)
}

/// `y = act_quant(x) @ w^T` (`n x m`, fp32 out from the GEMM's bf16) for `n` rows of `k`
/// values (`ldx` apart) and an FP8 weight of `m x k`; `n` and `m` multiples of 16, `k` of
/// 128. Runs with DeepSeek's block scales, or with both operands scaled per 1 x 128 where
/// the library takes only that; never with one scale per tensor (which these operands do
/// not have).
pub(crate) fn matmul(
    g: &Gpu,
    (x, n, ldx): (&DevMem<f32>, usize, usize),
    (w, m): (&StoredBuf, usize),
    k: usize,
) -> BResult<DevMem<f32>> {
    if !n.is_multiple_of(16) || !m.is_multiple_of(16) || !k.is_multiple_of(SCALE_BLOCK) {
        return Err(dev_err(format!(
            "the FP8 GEMM takes rows and outputs in multiples of 16 and inputs in multiples of 128, not {n} x {m} x {k}"
        )));
    }
    // Never one scale per tensor: these operands do not have one.
    let gemm = Fp8Gemm::first_of(g, (n, m, k), &[Fp8Scaling::Blocks, Fp8Scaling::RowBlocks])?;
    let act = act_quant(g, x, (n, k, ldx))?;
    let ws = weight_scales(g, w, (m, k), gemm.scaling.weight_scales())?;
    let out = g.uninit::<u16>(n * m)?;
    gemm.run(g, act.q.ptr(), act.s.ptr(), w.q.ptr(), ws.ptr(), out.ptr())?;
    let y = g.uninit::<f32>(n * m)?;
    g.launch(
        grid_1d(n * m),
        0,
        &kernels::Bf16ToF32 {
            x: DevPtr::of(&out),
            y: DevPtr::of(&y),
            n: (n * m) as i64,
        },
    )?;
    // The GEMM's descriptors and workspace go with `gemm` at the end of this call: the
    // stream must be done with them first.
    g.synchronize()?;
    Ok(y)
}
