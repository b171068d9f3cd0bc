//! cuBLASLt's FP8 GEMM with DeepSeek's scales (`pdserve gpu-check --only stored`): for
//! each scaling the library takes, the product of random e4m3 operands with random
//! power-of-two scales in their natural grids (one per 1 x 128 activation block, one per
//! 128 x 128 weight block) against the host's f32 product of the dequantized operands.
//! A scale laid out in the wrong order scales the wrong block: errors of order one. The
//! library's refusals are printed, not counted.

use crate::check::{rel_err, CheckRow};
use pdserve_engine::checkpoint::dequant::e4m3_to_f32;
use pdserve_kernels::blas_fp8::{Fp8Operands, Fp8Scaling, SCALE_BLOCK};
use pdserve_kernels::CudaBackend;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The output is rounded to bf16 (relative 2^-9 per element); the rest is fp32
/// summation order.
const FP8_GEMM_TOL: f64 = 1e-2;

/// `(n, m, k)`: rows of x, rows of w, the shared dimension. The second has a k not a
/// multiple of 512 (5 blocks: the 128 x 128 scales' padding to 4) and partial weight
/// row blocks.
const DIMS: [(usize, usize, usize); 2] = [(256, 384, 1024), (128, 320, 640)];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// e4m3 bytes with the exponent's top bit clear (|v| < 2, never NaN).
    fn e4m3(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| (self.next() as u8) & 0xBF).collect()
    }

    /// Powers of two from 2^-4 to 2^4, as DeepSeek's ue8m0 scales are.
    fn pow2(&mut self, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| 2f32.powi((self.next() % 9) as i32 - 4))
            .collect()
    }
}

/// Row `r` of an operand of `k` columns, dequantized with its natural scale grid.
fn dequant_row(q: &[u8], scales: &[f32], (r, k): (usize, usize), group_rows: usize) -> Vec<f32> {
    let kb = k.div_ceil(SCALE_BLOCK);
    (0..k)
        .map(|c| e4m3_to_f32(q[r * k + c]) * scales[(r / group_rows) * kb + c / SCALE_BLOCK])
        .collect()
}

fn one(
    gpu: &CudaBackend,
    dims: (usize, usize, usize),
    scaling: Fp8Scaling,
    seed: u64,
) -> AnyResult<Option<CheckRow>> {
    let (n, m, k) = dims;
    let kb = k.div_ceil(SCALE_BLOCK);
    let mut rng = Rng(seed);
    let (x, w) = (rng.e4m3(n * k), rng.e4m3(m * k));
    let (mut xs, mut ws) = (rng.pow2(n * kb), rng.pow2(m.div_ceil(SCALE_BLOCK) * kb));
    if scaling == Fp8Scaling::Tensor {
        // One scale per tensor: every block the same.
        let (a, b) = (xs[0], ws[0]);
        xs.fill(a);
        ws.fill(b);
    }
    let ops = Fp8Operands {
        x: (&x, &xs),
        w: (&w, &ws),
    };
    let got = match gpu.fp8_gemm_on_host(dims, scaling, &ops)? {
        Ok(v) => v,
        Err(why) => {
            println!("fp8 GEMM {scaling:?} {n}x{m}x{k}: refused by cuBLASLt ({why})");
            return Ok(None);
        }
    };
    let wd: Vec<Vec<f32>> = (0..m)
        .map(|r| dequant_row(&w, &ws, (r, k), SCALE_BLOCK))
        .collect();
    let mut worst = (0f64, 0usize);
    for r in 0..n {
        let xr = dequant_row(&x, &xs, (r, k), 1);
        let want: Vec<f32> = wd
            .iter()
            .map(|wr| xr.iter().zip(wr).map(|(a, b)| a * b).sum())
            .collect();
        let err = rel_err(&got[r * m..(r + 1) * m], &want);
        if err > worst.0 || err.is_nan() {
            worst = (err, r);
        }
    }
    Ok(Some(CheckRow {
        name: format!("fp8 GEMM {scaling:?} {n}x{m}x{k} vs host"),
        rows: n,
        max_rel_err: worst.0,
        worst_row: worst.1,
        greedy_same: n,
        near_ties: 0,
        pass: worst.0 < FP8_GEMM_TOL,
        gate: true,
    }))
}

/// One row per scaling the library takes and shape of [`DIMS`].
pub fn check_fp8_gemm(gpu: &CudaBackend) -> AnyResult<Vec<CheckRow>> {
    let mut rows = Vec::new();
    for (i, &dims) in DIMS.iter().enumerate() {
        for (j, scaling) in Fp8Scaling::PREFERENCE.into_iter().enumerate() {
            rows.extend(one(gpu, dims, scaling, 0x5EED_0000 + (i * 8 + j) as u64)?);
        }
    }
    Ok(rows)
}
