//! The FP8 GEMM, DeepSeek's act_quant and the indexer's rotation on host data, for
//! `gpu-check` (which uses only this crate's public API): the operands go up, the results
//! come back.

use crate::blas_fp8::{natural_from_vec128, Fp8Gemm, Fp8Scaling, SCALE_BLOCK};
use crate::buf::f32_buf;
use crate::kernels::{self, DevPtr};
use crate::launch::dev_err;
use crate::ops::{fp8_linear, numerics};
use crate::tensor::{Buf, GpuTensor};
use pdserve_engine::backend::BResult;

/// An FP8 GEMM's operands on the host: e4m3 bytes row-major with `k` contiguous, and their
/// scales in the natural grid of [`OperandScales::lay_out`].
pub struct Fp8Operands<'a> {
    /// `[n x k]` activations, one scale per 1 x 128 block (`[n][ceil(k/128)]`).
    pub x: (&'a [u8], &'a [f32]),
    /// `[m x k]` weights, one scale per 128 x 128 block (`[ceil(m/128)][ceil(k/128)]`).
    pub w: (&'a [u8], &'a [f32]),
}

impl crate::backend::CudaBackend {
    /// `x @ w^T` (`[n x m]`, row-major, from bf16) by the cuBLASLt FP8 GEMM with
    /// `scaling`, on host data: `Ok(Err(why))` where the library refuses the scaling.
    pub fn fp8_gemm_on_host(
        &self,
        dims: (usize, usize, usize),
        scaling: Fp8Scaling,
        ops: &Fp8Operands<'_>,
    ) -> BResult<Result<Vec<f32>, String>> {
        let (n, m, k) = dims;
        if ops.x.0.len() != n * k || ops.w.0.len() != m * k {
            return Err(dev_err("FP8 GEMM operands do not match the dims"));
        }
        let gemm = match Fp8Gemm::with(&self.gpu, dims, scaling) {
            Ok(g) => g,
            Err(e) => return Ok(Err(e.to_string())),
        };
        let bad = |e: String| dev_err(format!("FP8 GEMM scales: {e}"));
        let xs = scaling
            .activation_scales()
            .lay_out(ops.x.1, (n, k), 1)
            .map_err(bad)?;
        let ws = scaling
            .weight_scales()
            .lay_out(ops.w.1, (m, k), SCALE_BLOCK)
            .map_err(bad)?;
        let g = &self.gpu;
        let (x, w) = (g.upload(ops.x.0)?, g.upload(ops.w.0)?);
        let (xs, ws) = (g.upload(&xs)?, g.upload(&ws)?);
        let out = g.zeros_owned::<u16>(n * m)?;
        gemm.run(g, x.ptr(), xs.ptr(), w.ptr(), ws.ptr(), out.ptr())?;
        let raw = g.download(&out, n * m)?;
        let v = |i: usize| half::bf16::from_bits(raw[i]).to_f32();
        Ok(Ok(match scaling.activations_first() {
            false => (0..n * m).map(v).collect(),
            // out^T: element (row r of x, row c of w) at c * n + r.
            true => (0..n * m).map(|i| v((i % m) * n + i / m)).collect(),
        }))
    }

    /// DeepSeek's act_quant of `rows x cols` fp32 values on the device: the e4m3 codes
    /// (row-major) and the scales in their natural grid, `[rows][ceil(cols / 128)]`.
    pub fn act_quant_on_host(
        &self,
        x: &[f32],
        (rows, cols): (usize, usize),
    ) -> BResult<(Vec<u8>, Vec<f32>)> {
        if x.len() != rows * cols {
            return Err(dev_err("act_quant input does not match its dims"));
        }
        let g = &self.gpu;
        let xd = g.upload(x)?;
        let act = fp8_linear::act_quant(g, &xd, (rows, cols, cols), rows)?;
        let kb = cols.div_ceil(SCALE_BLOCK);
        let q = g.download(&act.q, rows * cols)?;
        let by_block = g.download(&act.s, rows * kb)?;
        Ok((q, natural_from_vec128(&by_block, rows, kb)))
    }

    /// `act_quant(x) @ w^T` by the device's FP8 linear (`n x k` host activations, an FP8
    /// weight of `m x k` on the device): `n x m`, row-major.
    pub fn fp8_linear_on_host(
        &self,
        x: &[f32],
        (n, k): (usize, usize),
        w: &GpuTensor,
    ) -> BResult<Vec<f32>> {
        let Buf::Stored(_) = &w.buf else {
            return Err(dev_err("the FP8 linear takes a weight kept as stored"));
        };
        if x.len() != n * k || w.cols != k {
            return Err(dev_err("FP8 linear operands do not match the dims"));
        }
        let g = &self.gpu;
        let xd = GpuTensor::new(n, k, Buf::F32(g.upload(x)?));
        let mut cache = fp8_linear::GemmCache::default();
        let y = fp8_linear::linear(g, &mut cache, &xd, w)?;
        // (The download waits for the GEMM, before `cache` drops its descriptors.)
        g.download(f32_buf(&y, "fp8 linear")?, n * w.rows)
    }

    /// deepseek numerics' rotation of the indexer's queries on the device: each
    /// `head_dim`-wide head of the `rows x cols` values Hadamard-rotated and FP4-quantized.
    pub fn rotate_fp4_on_host(
        &self,
        x: &[f32],
        (rows, cols): (usize, usize),
        head_dim: usize,
    ) -> BResult<Vec<f32>> {
        if x.len() != rows * cols {
            return Err(dev_err("rotation input does not match its dims"));
        }
        let g = &self.gpu;
        let xd = GpuTensor::new(rows, cols, Buf::F32(g.upload(x)?));
        let y = numerics::rotate_fp4(g, &xd, head_dim)?;
        g.download(f32_buf(&y, "rotate_fp4")?, rows * cols)
    }

    /// The device's e4m3 conversions (in hardware from sm_89) against their integer forms
    /// over every f32 bit pattern (`k_e4m3_selfcheck`): the failing patterns' count and
    /// the smallest of them.
    pub fn e4m3_conversion_mismatches(&self) -> BResult<(u64, Option<u32>)> {
        let g = &self.gpu;
        let bad = g.upload(&[0u64, u64::MAX])?;
        // A thread per 2^14 patterns.
        g.launch(
            (1024, 1, 1),
            0,
            &kernels::E4m3SelfCheck {
                bad: DevPtr::of(&bad),
            },
        )?;
        let out = g.download(&bad, 2)?;
        Ok((out[0], u32::try_from(out[1]).ok()))
    }
}
