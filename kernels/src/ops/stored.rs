//! Weights kept in DeepSeek's stored formats (`cu/quant.cu`): upload as stored, synthetic
//! ones quantized on the device, the fused small-batch GEMM, and the exact bf16 copy of a
//! weight (or of one expert's rows) that the tensor-core GEMMs of larger batches read.
//! The stored bytes are the only copy the device keeps; a bf16 copy lives for one GEMM.

use crate::buf::shape_err;
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::launch::{dev_err, grid_1d, BLOCK};
use crate::ops::random::random_tensor;
use crate::tensor::{Buf, GpuTensor, StoredBuf};
use cudarc::driver::CudaStream;
use pdserve_engine::backend::{BResult, WeightInit};
use pdserve_engine::checkpoint::{StoredWeight, WeightFormat};

/// Batches up to this many rows ran the fused kernel (each weight byte read once per 8
/// rows, no bf16 copy) until the tensor-core kernel took them (`moe_mma::dense_weight`);
/// `DenseKernel::Fused` still sends them here for A/B runs, as does `--deterministic`
/// (fp32 activations) at every batch. Past it, at 64 rows, the fused kernel's CUDA-core
/// work (8 row tiles, each decoding the weights again) cost more than a bf16 copy.
pub(crate) const FUSED_MAX_ROWS: usize = 16;
/// Rows per block row of `k_matmul_q` (`QMM_TILE` in cu/quant.cu).
const QMM_TILE: usize = 8;

pub(crate) fn to_i32(v: usize, what: &str) -> BResult<i32> {
    i32::try_from(v).map_err(|_| dev_err(format!("{what} {v} too large for the kernels")))
}

/// `w` on the device as stored.
pub(crate) fn upload(g: &Gpu, w: StoredWeight) -> BResult<GpuTensor> {
    w.check()
        .map_err(|detail| shape_err("upload_stored", detail))?;
    Ok(GpuTensor::new(
        w.rows,
        w.cols,
        Buf::Stored(StoredBuf {
            format: w.format,
            group_rows: w.group_rows,
            q: g.upload(&w.data)?,
            s: g.upload(&w.scale)?,
        }),
    ))
}

/// A synthetic `rows x cols` weight: the fp32 values of `init` keyed by `seed` (as
/// [`random_tensor`] draws them), quantized on the device to `format`.
pub(crate) fn random(
    g: &Gpu,
    (rows, cols): (usize, usize),
    format: WeightFormat,
    group_rows: usize,
    init: WeightInit,
    seed: u64,
) -> BResult<GpuTensor> {
    if !StoredWeight::shape_fits(format, rows, cols, group_rows) {
        return Err(shape_err(
            "random_stored",
            format!("{rows}x{cols} {format:?} weight in groups of {group_rows} rows"),
        ));
    }
    let values = random_tensor(g, rows, cols, false, init, seed)?;
    let Buf::F32(x) = &values.buf else {
        return Err(dev_err("random fp32 values"));
    };
    let (sr, sc) = StoredWeight::scale_grid(format, group_rows, cols);
    let groups = rows / group_rows;
    let q = g.zeros_owned::<u8>(rows * StoredWeight::row_bytes(format, cols))?;
    let s = g.zeros_owned::<u8>(groups * sr * sc)?;
    let (r, c) = (to_i32(rows, "rows")?, to_i32(cols, "cols")?);
    if format == WeightFormat::Fp8Block {
        g.launch(
            ((groups * sr) as u32, sc as u32, 1),
            0,
            &kernels::QuantizeFp8 {
                x: DevPtr::of(x),
                q: DevPtr::of(&q),
                s: DevPtr::of(&s),
                rows: r,
                cols: c,
                group_rows: to_i32(group_rows, "group rows")?,
            },
        )?;
    } else {
        g.launch(
            grid_1d(rows * sc),
            0,
            &kernels::QuantizeFp4 {
                x: DevPtr::of(x),
                q: DevPtr::of(&q),
                s: DevPtr::of(&s),
                rows: r,
                cols: c,
            },
        )?;
    }
    let buf = Buf::Stored(StoredBuf {
        format,
        group_rows,
        q,
        s,
    });
    Ok(GpuTensor::new(rows, cols, buf))
}

/// Rows `row0..row0 + rows` of stored weight `w` (`cols` columns; `row0` at a scale-grid
/// start) as exact bf16 values, into `out` (at least `rows * cols` values).
pub(crate) fn dequant_into(
    g: &Gpu,
    on: Option<&CudaStream>,
    w: &StoredBuf,
    (row0, rows, cols): (usize, usize, usize),
    out: &DevMem<u16>,
) -> BResult<()> {
    let (q, s) = w
        .rows_from(row0, cols)
        .ok_or_else(|| dev_err(format!("row {row0} is not at a scale grid of the weight")))?;
    if out.len() < rows * cols {
        return Err(dev_err("dequantization buffer too small"));
    }
    // One thread per 16 values (an FP8 group; FP4's 32 take half of them).
    let grid = grid_1d(rows * cols / 16);
    let kernel = kernels::DequantBf16 {
        q: DevPtr(q),
        s: DevPtr(s),
        fmt: w.fmt(),
        group_rows: to_i32(w.group_rows, "group rows")?,
        out: DevPtr::of(out),
        rows: to_i32(rows, "rows")?,
        cols: to_i32(cols, "cols")?,
    };
    g.launch_on(on, grid, 0, &kernel)
}

/// The whole of stored weight `t` as exact bf16 values.
pub(crate) fn dequant(g: &Gpu, t: &GpuTensor, w: &StoredBuf) -> BResult<DevMem<u16>> {
    let out = g.uninit::<u16>(t.len())?;
    dequant_into(g, None, w, (0, t.rows, t.cols), &out)?;
    Ok(out)
}

/// Activations of the fused kernel: fp32, or rounded to bf16 once (as the bf16 GEMMs
/// round them).
pub(crate) enum Activations<'a> {
    F32(&'a DevMem<f32>),
    Bf16(&'a DevMem<u16>),
}

/// `y = x @ w^T` per group of `dout` output columns (`x`'s `ldx`-strided rows, `din`
/// columns per group) by the fused kernel.
pub(crate) fn matmul_fused(
    g: &Gpu,
    (x, ldx, m): (Activations<'_>, usize, usize),
    (w, n): (&StoredBuf, usize),
    y: &DevMem<f32>,
    (din, dout): (usize, usize),
) -> BResult<()> {
    let warps = (BLOCK / 32) as usize;
    let (xf, xb) = match x {
        Activations::F32(x) => (DevPtr::of(x), DevPtr::NULL),
        Activations::Bf16(x) => (DevPtr::NULL, DevPtr::of(x)),
    };
    g.launch(
        (n.div_ceil(warps) as u32, m.div_ceil(QMM_TILE) as u32, 1),
        0,
        &kernels::MatmulQ {
            x: xf,
            xb,
            q: DevPtr::of(&w.q),
            s: DevPtr::of(&w.s),
            fmt: w.fmt(),
            group_rows: to_i32(w.group_rows, "group rows")?,
            y: DevPtr::of(y),
            m: to_i32(m, "rows")?,
            n: to_i32(n, "columns")?,
            k: to_i32(din, "inputs")?,
            ldx: to_i32(ldx, "row stride")?,
            dout: to_i32(dout, "group outputs")?,
        },
    )
}
