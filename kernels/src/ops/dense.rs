//! Dense ops: embedding, row gathers, GEMMs (cuBLAS, or the batch-invariant kernel under
//! `--deterministic`), RMS norm and rope.

use crate::buf::{f32_buf, out_ptr, shape_err, storage};
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::launch::{dev_err, grid_1d, BLOCK};
use crate::ops::rope_tables::rope_tables;
use crate::ops::tensors::{bf16_of, new_f32, param_f32};
use crate::ops::{moe_mma, stored};
use crate::tensor::{Buf, GpuTensor};
use pdserve_engine::backend::{shapes, BResult};
use pdserve_engine::rope::Rope;

pub(crate) fn embed(
    g: &Gpu,
    table: &GpuTensor,
    tokens: &[u32],
    copies: usize,
) -> BResult<GpuTensor> {
    shapes::check_embed(table.rows, tokens)?;
    let h = table.cols;
    let toks = g.upload(tokens)?;
    let out = new_f32(g, tokens.len(), copies * h)?;
    let (elem, tp) = storage(table, "embed")?;
    g.launch(
        (tokens.len() as u32, 1, 1),
        0,
        &kernels::Embed {
            variant: elem,
            table: DevPtr(tp),
            tokens: DevPtr::of(&toks),
            out: out_ptr(&out)?,
            h: h as i32,
            copies: copies as i32,
        },
    )?;
    Ok(out)
}

pub(crate) fn gather_rows(g: &Gpu, t: &GpuTensor, rows: &[usize]) -> BResult<GpuTensor> {
    if let Some(&r) = rows.iter().find(|&&r| r >= t.rows) {
        return Err(shape_err("gather_rows", format!("row {r} of {}", t.rows)));
    }
    let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
    let idx = g.upload(&idx)?;
    let out = new_f32(g, rows.len(), t.cols)?;
    g.launch(
        (rows.len() as u32, 1, 1),
        0,
        &kernels::GatherRows {
            x: DevPtr::of(f32_buf(t, "gather_rows")?),
            idx: DevPtr::of(&idx),
            out: out_ptr(&out)?,
            cols: t.cols as i32,
        },
    )?;
    Ok(out)
}

/// `x @ w^T`.
pub(crate) fn matmul(g: &Gpu, x: &GpuTensor, w: &GpuTensor) -> BResult<GpuTensor> {
    shapes::check_matmul((x.rows, x.cols), (w.rows, w.cols))?;
    matmul_into(g, x, w, 1)
}

/// `x @ w^T` per group of `groups` row blocks of `w` (the grouped output projection).
pub(crate) fn grouped_matmul(
    g: &Gpu,
    x: &GpuTensor,
    w: &GpuTensor,
    groups: usize,
) -> BResult<GpuTensor> {
    shapes::check_grouped_matmul((x.rows, x.cols), (w.rows, w.cols), groups)?;
    matmul_into(g, x, w, groups)
}

/// `rms_norm(x) @ w^T` (unweighted, over whole rows) as `(x @ w^T) * rinv` per row: the
/// GEMM reads the raw rows instead of a normalised copy written for it.
pub(crate) fn rms_norm_matmul(
    g: &Gpu,
    x: &GpuTensor,
    w: &GpuTensor,
    eps: f32,
) -> BResult<GpuTensor> {
    shapes::check_matmul((x.rows, x.cols), (w.rows, w.cols))?;
    let rinv = g.uninit::<f32>(x.rows)?;
    g.launch(
        (x.rows as u32, 1, 1),
        0,
        &kernels::RowInvRms {
            x: DevPtr::of(f32_buf(x, "rms_norm_matmul")?),
            rinv: DevPtr::of(&rinv),
            cols: x.cols as i32,
            eps,
        },
    )?;
    let y = matmul_into(g, x, w, 1)?;
    g.launch(
        grid_1d(y.len()),
        0,
        &kernels::ScaleRows {
            y: out_ptr(&y)?,
            s: DevPtr::of(&rinv),
            rows: y.rows as i32,
            cols: y.cols as i32,
        },
    )?;
    Ok(y)
}

/// [`matmul_into`] by the batch-invariant kernel (`--deterministic`): fp32 activations,
/// one warp per output column.
fn matmul_rows(
    g: &Gpu,
    (xs, ldx): (&DevMem<f32>, usize),
    w: &GpuTensor,
    out: GpuTensor,
    din: usize,
    dout: usize,
) -> BResult<GpuTensor> {
    let Buf::F32(o) = &out.buf else {
        return Err(dev_err("output buffer"));
    };
    let (m, n) = (out.rows, out.cols);
    let to_i =
        |v: usize| i32::try_from(v).map_err(|_| dev_err(format!("matmul dim {v} too large")));
    let (elem, wp) = storage(w, "matmul")?;
    let wp = DevPtr(wp);
    let warps = (BLOCK / 32) as usize;
    let grid = (n.div_ceil(warps) as u32, m.div_ceil(MM_TILE) as u32, 1);
    g.launch(
        grid,
        0,
        &kernels::MatmulRows {
            variant: elem,
            x: DevPtr::of(xs),
            w: wp,
            y: DevPtr::of(o),
            m: to_i(m)?,
            n: to_i(n)?,
            k: to_i(din)?,
            ldx: to_i(ldx)?,
            dout: to_i(dout)?,
        },
    )?;
    Ok(out)
}

/// Rows per block of `k_matmul_rows` (`MM_TILE` in cu/elementwise.cu).
const MM_TILE: usize = 8;

/// `x @ w^T` of each group: bf16 and stored weights take a bf16 copy of an fp32 `x` (or a
/// bf16 `x` itself: the attention's output), fp32 weights and `--deterministic` an fp32 `x`.
fn matmul_into(g: &Gpu, x: &GpuTensor, w: &GpuTensor, groups: usize) -> BResult<GpuTensor> {
    let out = new_f32(g, x.rows, w.rows)?;
    let Buf::F32(o) = &out.buf else {
        return Err(dev_err("output buffer"));
    };
    let (din, dout) = (w.cols, w.rows / groups);
    if g.deterministic {
        // Batch invariance: fp32 activations and one fixed order per output.
        if let Buf::Stored(sw) = &w.buf {
            let xa = stored::Activations::F32(f32_buf(x, "matmul")?);
            stored::matmul_fused(g, (xa, x.cols, x.rows), (sw, w.rows), o, (din, dout))?;
            return Ok(out);
        }
        return matmul_rows(g, (f32_buf(x, "matmul")?, x.cols), w, out, din, dout);
    }
    // Decode-sized batches: tensor cores streaming the weights in their own format.
    if let Some(dw) = moe_mma::dense_weight(g, w, x.rows, (din, dout, groups)) {
        let xb = bf16_of(g, x, "matmul")?;
        moe_mma::matmul_dense(g, xb, &dw, o, (x.rows, din, dout, groups))?;
        return Ok(out);
    }
    if let Buf::Stored(sw) = &w.buf {
        // Small batches where a benchmark asks for the CUDA-core kernel read the stored
        // bytes directly; larger ones pay one exact bf16 copy for cuBLAS.
        if x.rows <= stored::FUSED_MAX_ROWS {
            let xa = stored::Activations::Bf16(bf16_of(g, x, "matmul")?);
            stored::matmul_fused(g, (xa, x.cols, x.rows), (sw, w.rows), o, (din, dout))?;
            return Ok(out);
        }
    }
    let dims = (x.rows, dout, din);
    let lds = (x.cols, din, w.rows);
    let strides = (din as i64, (dout * din) as i64, dout as i64);
    match &w.buf {
        Buf::Stored(sw) => {
            let wb = stored::dequant(g, w, sw)?;
            let xb = bf16_of(g, x, "matmul")?;
            let (xp, wp, op) = (xb.ptr(), wb.ptr(), o.ptr());
            g.gemm_nt(xp, wp, op, dims, lds, strides, groups, true)?;
        }
        Buf::Bf16(wb) => {
            let xb = bf16_of(g, x, "matmul")?;
            let (xp, wp, op) = (xb.ptr(), wb.ptr(), o.ptr());
            g.gemm_nt(xp, wp, op, dims, lds, strides, groups, true)?;
        }
        Buf::F32(wf) => {
            let xs = f32_buf(x, "matmul")?;
            let (xp, wp, op) = (xs.ptr(), wf.ptr(), o.ptr());
            g.gemm_nt(xp, wp, op, dims, lds, strides, groups, false)?;
        }
    }
    Ok(out)
}

/// Largest group the one-warp-per-group norm takes (16 values per lane).
const WARP_NORM_MAX_GROUP: usize = 512;

pub(crate) fn rms_norm(
    g: &Gpu,
    x: &GpuTensor,
    weight: Option<&GpuTensor>,
    group: usize,
    eps: f32,
) -> BResult<GpuTensor> {
    shapes::check_rms_norm(x.cols, weight.map(|w| w.len()), group)?;
    let w = weight.map(|w| param_f32(g, w)).transpose()?;
    let out = new_f32(g, x.rows, x.cols)?;
    let (xp, wp, op) = (
        DevPtr::of(f32_buf(x, "rms_norm")?),
        w.as_ref().map_or(DevPtr::NULL, DevPtr::of),
        out_ptr(&out)?,
    );
    let groups = x.len() / group;
    if group <= WARP_NORM_MAX_GROUP {
        // A block per group of 512 (a per-head norm) left most of its threads idle.
        let warps = (BLOCK / 32) as usize;
        g.launch(
            (groups.div_ceil(warps) as u32, 1, 1),
            0,
            &kernels::RmsNormWarp {
                x: xp,
                w: wp,
                out: op,
                group: group as i32,
                groups: groups as i32,
                eps,
            },
        )?;
    } else {
        g.launch(
            (groups as u32, 1, 1),
            0,
            &kernels::RmsNorm {
                x: xp,
                w: wp,
                out: op,
                group: group as i32,
                eps,
            },
        )?;
    }
    Ok(out)
}

pub(crate) fn rope(
    g: &Gpu,
    x: &mut GpuTensor,
    head_dim: usize,
    rope: &Rope,
    positions: &[usize],
    inverse: bool,
) -> BResult<()> {
    shapes::check_rope((x.rows, x.cols), head_dim, positions.len(), rope.dim())?;
    x.written_in_place();
    let table = rope_tables(g, rope, positions)?;
    g.launch(
        (x.rows as u32, 1, 1),
        0,
        &kernels::Rope {
            x: out_ptr(x)?,
            cs: DevPtr::of(&table.cs),
            sn: DevPtr::of(&table.sn),
            cols: x.cols as i32,
            head_dim: head_dim as i32,
            rd: rope.dim() as i32,
            inverse: inverse as i32,
        },
    )
}
