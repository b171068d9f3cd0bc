//! cuBLASLt's FP8 GEMM with DeepSeek's scales (`pdserve gpu-check --only stored`): for
//! each scaling the library takes, the product of random e4m3 operands with random
//! power-of-two scales in their natural grids (one per 1 x 128 activation block, one per
//! 128 x 128 weight block) against the host's f32 product of the dequantized operands.
//! A scale laid out in the wrong order scales the wrong block: errors of order one. The
//! library's refusals are printed, not counted. Then DeepSeek's act_quant on the device
//! against the CPU's (bitwise: codes and scales) and the FP8 linear built from both
//! (act_quant, the stored FP8 weight, the block-scaled GEMM) against the CPU's product of
//! the quantized activations and the dequantized weight.

use crate::check::{rel_err, CheckRow};
use pdserve_engine::backend::counter_rng::WeightInit;
use pdserve_engine::backend::{TensorOps, WeightUse};
use pdserve_engine::checkpoint::dequant::e4m3_to_f32;
use pdserve_engine::checkpoint::WeightFormat;
use pdserve_engine::numerics::{act_quant, quantize_e4m3_block, ACT_BLOCK};
use pdserve_kernels::blas_fp8::{Fp8Scaling, SCALE_BLOCK};
use pdserve_kernels::fp8_host::Fp8Operands;
use pdserve_kernels::CudaBackend;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The output is rounded to bf16 (relative 2^-9 per element); the rest is fp32
/// summation order.
const FP8_GEMM_TOL: f64 = 1e-2;

/// `(n, m, k)`: rows of x, rows of w, the shared dimension. The second has a k not a
/// multiple of 512 (5 blocks: the 128 x 128 scales' padding to 4) and partial weight
/// row blocks.
const DIMS: [(usize, usize, usize); 2] = [(256, 384, 1024), (128, 320, 640)];

pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
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
    let name = format!("fp8 GEMM {scaling:?} {n}x{m}x{k} vs host");
    Ok(Some(product_row(
        name,
        &got,
        n,
        |r| dequant_row(&x, &xs, (r, k), 1),
        &wd,
    )))
}

/// The row of `got` (`n x w_rows.len()`) against the host's f32 products of each
/// activation row (`x_row(r)`) with each weight row.
fn product_row(
    name: String,
    got: &[f32],
    n: usize,
    x_row: impl Fn(usize) -> Vec<f32>,
    w_rows: &[Vec<f32>],
) -> CheckRow {
    let m = w_rows.len();
    let mut worst = (0f64, 0usize);
    for r in 0..n {
        let xr = x_row(r);
        let want: Vec<f32> = w_rows
            .iter()
            .map(|wr| xr.iter().zip(wr).map(|(a, b)| a * b).sum())
            .collect();
        let err = rel_err(&got[r * m..(r + 1) * m], &want);
        if err > worst.0 || err.is_nan() {
            worst = (err, r);
        }
    }
    CheckRow {
        name,
        rows: n,
        max_rel_err: worst.0,
        worst_row: worst.1,
        greedy_same: n,
        near_ties: 0,
        pass: worst.0 < FP8_GEMM_TOL,
        gate: true,
    }
}

/// Activations with every kind of block: normal values, a zero block, values past 448
/// (scales above 1), tiny ones (scales far below), a partial last block (`cols` = 1000).
pub(crate) fn activations(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            let u = (rng.next() >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0;
            match (r % 4, c / ACT_BLOCK) {
                (1, 2) => 0.0,
                (2, _) => u * 3000.0,
                (3, _) => u * 1e-6,
                _ => u * 3.0,
            }
        })
        .collect()
}

/// Every e4m3 rounding boundary as act_quant input: each finite magnitude, the midpoint
/// between it and the next and that midpoint's two f32 neighbours, both signs, in 128-value
/// rows whose first value 300 makes the scale 1; then the same rows times 2^k (k from -12
/// to 12, the scale 2^k). `(values, rows)`: rows of [`ACT_BLOCK`] values.
fn e4m3_boundaries() -> (Vec<f32>, usize) {
    let mags: Vec<f32> = (0..0x7fu8).map(e4m3_to_f32).collect();
    let mut base = Vec::new();
    for w in mags.windows(2) {
        let mid = (w[0] + w[1]) / 2.0;
        let (down, up) = (
            f32::from_bits(mid.to_bits() - 1),
            f32::from_bits(mid.to_bits() + 1),
        );
        for v in [w[0], down, mid, up] {
            base.extend([v, -v]);
        }
    }
    base.extend([448.0, -448.0]);
    let per_row = ACT_BLOCK - 1;
    let rows = base.len().div_ceil(per_row);
    let mut x = Vec::new();
    for k in -12..=12 {
        let f = 2f32.powi(k);
        for r in 0..rows {
            x.push(300.0 * f);
            let chunk = &base[r * per_row..((r + 1) * per_row).min(base.len())];
            x.extend(chunk.iter().map(|v| v * f));
            x.resize(x.len() + per_row - chunk.len(), 0.0);
        }
    }
    let n = x.len() / ACT_BLOCK;
    (x, n)
}

/// The device's act_quant against the CPU's, code for code and scale for scale, on
/// random rows and on every e4m3 rounding boundary.
fn act_quant_rows(gpu: &CudaBackend) -> AnyResult<Vec<CheckRow>> {
    let (bx, brows) = e4m3_boundaries();
    Ok(vec![
        act_quant_row(gpu, "", &activations(64, 1000, 0xAC7), (64, 1000))?,
        act_quant_row(gpu, ", every rounding boundary", &bx, (brows, ACT_BLOCK))?,
    ])
}

/// The device's e4m3 conversions (in hardware from sm_89) against their integer forms on
/// the device, over every f32 bit pattern.
fn e4m3_selfcheck_row(gpu: &CudaBackend) -> AnyResult<CheckRow> {
    let (bad, first) = gpu.e4m3_conversion_mismatches()?;
    if let Some(f) = first {
        println!("e4m3 conversions: {bad} f32 patterns differ, the first {f:#010x}");
    }
    Ok(CheckRow {
        name: "e4m3 conversions == integer forms, every f32 pattern".into(),
        rows: 1,
        max_rel_err: bad as f64,
        worst_row: 0,
        greedy_same: usize::from(bad == 0),
        near_ties: 0,
        pass: bad == 0,
        gate: true,
    })
}

/// The device's act_quant of `x` (`rows x cols`) against the CPU's, code for code and
/// scale for scale.
fn act_quant_row(
    gpu: &CudaBackend,
    what: &str,
    x: &[f32],
    (rows, cols): (usize, usize),
) -> AnyResult<CheckRow> {
    let (codes, scales) = gpu.act_quant_on_host(x, (rows, cols))?;
    let kb = cols.div_ceil(ACT_BLOCK);
    let (mut bad, mut first_bad) = (0usize, None);
    let mut want = vec![0u8; ACT_BLOCK];
    for r in 0..rows {
        for b in 0..kb {
            let (c0, c1) = (b * ACT_BLOCK, ((b + 1) * ACT_BLOCK).min(cols));
            let scale = quantize_e4m3_block(&x[r * cols + c0..r * cols + c1], &mut want);
            let same = scale.to_bits() == scales[r * kb + b].to_bits()
                && want[..c1 - c0] == codes[r * cols + c0..r * cols + c1];
            if !same {
                bad += 1;
                first_bad.get_or_insert(r);
            }
        }
    }
    Ok(CheckRow {
        name: format!("act_quant e4m3 {rows}x{cols}{what} == CPU bitwise"),
        rows,
        max_rel_err: bad as f64 / (rows * kb) as f64,
        worst_row: first_bad.unwrap_or(0),
        greedy_same: rows,
        near_ties: 0,
        pass: bad == 0,
        gate: true,
    })
}

/// The FP8 linear (act_quant + the block-scaled GEMM on the stored weight) against the
/// CPU: act_quant, then the f32 product with the exactly dequantized weight. 256 rows,
/// then 200 (padded to the GEMM's 16-row tile), the second reusing the weight's kept
/// scales.
fn fp8_linear_rows(gpu: &CudaBackend) -> AnyResult<Vec<CheckRow>> {
    let (k, m) = (1024, 384);
    let init = WeightInit::Normal {
        mean: 0.0,
        std: 1.0 / (k as f32).sqrt(),
    };
    let w = gpu.random_stored(
        (m, k),
        WeightFormat::Fp8Block,
        m,
        init,
        23,
        WeightUse::Matrix,
    )?;
    let wd = gpu.to_host(&w)?;
    let w_rows: Vec<Vec<f32>> = (0..m).map(|j| wd.row(j).to_vec()).collect();
    let mut out = Vec::new();
    for n in [256, 200] {
        let x = activations(n, k, 0xF8 + n as u64);
        let got = gpu.fp8_linear_on_host(&x, (n, k), &w)?;
        let mut xq = x.clone();
        for row in xq.chunks_mut(k) {
            act_quant(row, ACT_BLOCK);
        }
        let name = format!("fp8 linear act_quant + block GEMM {n}x{k}->{m} vs CPU");
        let x_row = |r: usize| xq[r * k..(r + 1) * k].to_vec();
        out.push(product_row(name, &got, n, x_row, &w_rows));
    }
    Ok(out)
}

/// One row per scaling the library takes and shape of [`DIMS`], then act_quant and the
/// FP8 linear.
pub fn check_fp8_gemm(gpu: &CudaBackend) -> AnyResult<Vec<CheckRow>> {
    let mut rows = Vec::new();
    for (i, &dims) in DIMS.iter().enumerate() {
        for (j, scaling) in Fp8Scaling::PREFERENCE.into_iter().enumerate() {
            rows.extend(one(gpu, dims, scaling, 0x5EED_0000 + (i * 8 + j) as u64)?);
        }
    }
    // An error in one of these is its rows' failure, printed, not the whole group's.
    for (name, got) in [
        (
            "e4m3 conversions == integer forms",
            e4m3_selfcheck_row(gpu).map(|r| vec![r]),
        ),
        ("act_quant e4m3 == CPU bitwise", act_quant_rows(gpu)),
        (
            "fp8 linear act_quant + block GEMM vs CPU",
            fp8_linear_rows(gpu),
        ),
    ] {
        rows.extend(got.unwrap_or_else(|e| {
            println!("{name}: {e}");
            vec![CheckRow {
                name: format!("{name}: error"),
                rows: 0,
                max_rel_err: f64::NAN,
                worst_row: 0,
                greedy_same: 0,
                near_ties: 0,
                pass: false,
                gate: true,
            }]
        }));
    }
    Ok(rows)
}
