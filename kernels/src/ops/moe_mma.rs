//! Routed experts on tensor cores in decode steps (`cu/moe_mma.cu`): each expert's picks
//! against its bf16, FP8 or FP4 weights as bf16 `mma.sync`, the weights read once per 32
//! picks (8 at batches of up to 8 rows) in their own format and dequantized in registers.
//! No host synchronisation, so it runs inside captured graphs. The inputs of both
//! projections are rounded to bf16, as in the padded cuBLAS path; outside the fp32
//! reference mode and `--deterministic` only.
//! The same kernel body also runs the dense GEMMs of decode batches, bf16 and stored
//! weights alike ([`matmul_dense`]).

use crate::buf::shape_err;
use crate::device::{DenseKernel, ExpertKernel, Gpu};
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr, ExpertFormat, MmaVariant};
use crate::launch::grid_1d;
use crate::ops::numerics::{self, Activations, RoutedQuant};
use crate::ops::stored::{self, to_i32};
use crate::ops::tensors::bf16_of;
use crate::tensor::{Buf, GpuTensor, WeightOperand, WF_BF16, WF_FP4, WF_FP8};
use pdserve_engine::backend::{BResult, MoeParams};

/// Weight rows per block (`MMA_ROWS`), bytes of each per stage (`MMA_SLAB`).
const TILE_ROWS: usize = 128;
const SLAB_BYTES: usize = 128;

/// Largest batch the `_p8` kernels take: their 8 picks per pass (`8 PT` with `PT` 1) hold
/// every pick of an expert or row of a dense GEMM in one pass, with three blocks per SM.
const NARROW_MAX_ROWS: usize = 8;

/// The kernel for weights of format `format` in a batch of `rows` rows.
fn variant(format: ExpertFormat, rows: usize) -> MmaVariant {
    MmaVariant {
        format,
        narrow: rows <= NARROW_MAX_ROWS,
    }
}

/// Blocks of a kernel resident per SM: its launch bounds (moe_mma.cu), which its registers
/// and shared memory allow (the unit test below).
fn blocks_per_sm(v: MmaVariant) -> usize {
    if v.narrow {
        3
    } else {
        2
    }
}

/// Pick rows staged with each weight slab per pass (`8 PT` in moe_mma.cu).
fn tile_picks(v: MmaVariant) -> usize {
    if v.narrow {
        8
    } else {
        32
    }
}

/// Weights of a row per stage (`KS`) and stages in flight (`STAGES`) of each format's
/// `Slice*` in moe_mma.cu.
fn stage_shape(f: ExpertFormat) -> (usize, usize) {
    match f {
        ExpertFormat::Bf16 => (64, 4),
        ExpertFormat::Fp8 => (128, 4),
        ExpertFormat::Fp4 => (256, 3),
    }
}

/// Dynamic shared memory of a kernel: every stage's weight slab and the picks' bf16
/// activations of the same columns.
fn shared_bytes(v: MmaVariant) -> usize {
    let (ks, stages) = stage_shape(v.format);
    stages * (TILE_ROWS * SLAB_BYTES + tile_picks(v) * ks * 2)
}

/// The kernel variant of a weight format (`None`: f32, which these kernels do not take).
fn format_of(fmt: i32) -> Option<ExpertFormat> {
    match fmt {
        WF_BF16 => Some(ExpertFormat::Bf16),
        WF_FP8 => Some(ExpertFormat::Fp8),
        WF_FP4 => Some(ExpertFormat::Fp4),
        _ => None,
    }
}

/// Intermediate units per gate/up block and output channels per down block (8 warps of
/// 8 units, 8 warps of 16 channels).
const GATE_UP_UNITS: usize = 64;
const DOWN_CHANNELS: usize = 128;

/// Whether the tensor-core kernels take this MoE: not the fp32 reference mode or
/// `--deterministic`, weights in bf16 or a stored format, and each projection's reduction
/// a whole number of stages (which also keeps every row and unit 16-byte aligned). Every
/// format's shared memory fits (the unit test below).
pub(crate) fn takes(g: &Gpu, p: &MoeParams<'_, GpuTensor>, hidden: usize) -> bool {
    let fits = |t: &GpuTensor, k: usize| {
        t.buf
            .operand()
            .and_then(|o| format_of(o.fmt))
            .is_some_and(|f| k.is_multiple_of(stage_shape(f).0))
    };
    !g.fp32_reference
        && !g.deterministic
        && p.intermediate.is_multiple_of(8)
        && fits(p.gate_up, hidden)
        && fits(p.down, p.intermediate)
}

fn operand(t: &GpuTensor) -> BResult<(WeightOperand, ExpertFormat)> {
    t.buf
        .operand()
        .and_then(|o| format_of(o.fmt).map(|f| (o, f)))
        .ok_or_else(|| shape_err("moe", format!("expert weight of {} rows", t.rows)))
}

/// The routed experts of `x` given each expert's picks (`list`, `count`: see
/// `moe::expert_lists`). Returns `y`: `[rows * k, H]`, one row per pick.
pub(crate) fn routed(
    g: &Gpu,
    x: &GpuTensor,
    p: &MoeParams<'_, GpuTensor>,
    list: &DevMem<i32>,
    count: &DevMem<i32>,
    quant: Option<&RoutedQuant<'_>>,
) -> BResult<DevMem<f32>> {
    let (n, h) = (x.rows, x.cols);
    let (e, k, inter) = (p.n_experts, p.top_k, p.intermediate);
    let active = count.view_from(e);
    // One block column per expert that may be used: at most one per pick.
    let slots = e.min(n * k) as u32;
    let ((gu, gu_fmt), (down, down_fmt)) = (operand(p.gate_up)?, operand(p.down)?);
    // An expert has at most one pick per row.
    let (gu_kernel, down_kernel) = (variant(gu_fmt, n), variant(down_fmt, n));
    let xb = bf16_of(g, x, "moe")?;
    let act = g.uninit::<u16>(n * k * inter)?;
    g.launch(
        (slots, inter.div_ceil(GATE_UP_UNITS) as u32, 1),
        shared_bytes(gu_kernel) as u32,
        &kernels::MoeGateUpMma {
            variant: gu_kernel,
            x: DevPtr::of(xb),
            w: DevPtr(gu.w),
            s: DevPtr(gu.s),
            group_rows: gu.group_rows,
            list: DevPtr::of(list),
            active: DevPtr::of(&active),
            count: DevPtr::of(count),
            act: DevPtr::of(&act),
            rows: n as i32,
            e: e as i32,
            h: h as i32,
            i: inter as i32,
            k: k as i32,
            limit: p.swiglu_limit,
        },
    )?;
    if let Some(q) = quant {
        numerics::weight_act_quant(g, Activations::Bf16(&act), q, None, (n * k, inter))?;
    }
    let y = g.uninit::<f32>(n * k * h)?;
    g.launch(
        (slots, h.div_ceil(DOWN_CHANNELS) as u32, 1),
        shared_bytes(down_kernel) as u32,
        &kernels::MoeDownMma {
            variant: down_kernel,
            act: DevPtr::of(&act),
            w: DevPtr(down.w),
            s: DevPtr(down.s),
            group_rows: down.group_rows,
            list: DevPtr::of(list),
            active: DevPtr::of(&active),
            count: DevPtr::of(count),
            y: DevPtr::of(&y),
            rows: n as i32,
            e: e as i32,
            h: h as i32,
            i: inter as i32,
        },
    )?;
    Ok(y)
}

/// Largest batch the dense tensor-core GEMM takes: each 32 rows are one more block over the
/// same weight slab (read from L2 by all but the first); past it cuBLAS (stored weights:
/// after a bf16 copy). Measured on the H200 (bench decode, fp8, 4K, graphs): up to 128
/// rows it is faster (batch 128 8.32 -> 6.90 ms); at 256 it is not (10.5 -> 10.8 ms).
pub(crate) const DENSE_MAX_ROWS: usize = 128;

/// A weight as the dense tensor-core GEMM reads it: its operand and kernel variant.
pub(crate) struct DenseWeight {
    operand: WeightOperand,
    format: ExpertFormat,
}

/// The weight `w` (`k` inputs and `dout` outputs per group, `groups` of them) as the dense
/// tensor-core GEMM takes it for `rows` rows, or `None` where another kernel runs: past
/// [`DENSE_MAX_ROWS`], under the fp32 reference mode or `--deterministic`, for fp32 weights
/// and shapes off the kernel's grid, for bf16 weights unless [`DenseKernel::TensorCores`],
/// and where [`DenseKernel::Fused`] or [`ExpertKernel::CudaCores`] asks for the kernels it
/// replaced.
pub(crate) fn dense_weight(
    g: &Gpu,
    w: &GpuTensor,
    rows: usize,
    (k, dout, groups): (usize, usize, usize),
) -> Option<DenseWeight> {
    let operand = w.buf.operand()?;
    let format = format_of(operand.fmt)?;
    let chosen = g.expert_kernel != ExpertKernel::CudaCores
        && match (&w.buf, g.dense_kernel) {
            (Buf::Stored(_), DenseKernel::Fused) => rows > stored::FUSED_MAX_ROWS,
            (Buf::Stored(_), _) | (_, DenseKernel::TensorCores) => true,
            _ => false,
        };
    let fits = rows <= DENSE_MAX_ROWS
        && k.is_multiple_of(stage_shape(format).0)
        && (groups == 1 || dout.is_multiple_of(TILE_ROWS));
    (chosen && fits && !g.deterministic && !g.fp32_reference)
        .then_some(DenseWeight { operand, format })
}

/// `y[rows, groups * dout] = x @ w^T` per group over weight `w` (`dout` outputs and `k`
/// inputs per group; group i reads x's columns `i k ..`), `x` in bf16, the reduction split
/// over as many blocks as the device holds at once ([`splits`]); the splits' sums added in
/// a fixed order (the same bits every run).
pub(crate) fn matmul_dense(
    g: &Gpu,
    xb: &DevMem<u16>,
    w: &DenseWeight,
    y: &DevMem<f32>,
    (rows, k, dout, groups): (usize, usize, usize, usize),
) -> BResult<()> {
    let n = dout * groups;
    let stages = k / stage_shape(w.format).0;
    let kernel = variant(w.format, rows);
    let (row_blocks, col_blocks) = (rows.div_ceil(tile_picks(kernel)), n.div_ceil(TILE_ROWS));
    let splits = splits(
        blocks_per_sm(kernel) * g.sms,
        row_blocks * col_blocks,
        stages,
    );
    let partial = (splits > 1)
        .then(|| g.uninit::<f32>(splits * rows * n))
        .transpose()?;
    let ys = partial.as_ref().unwrap_or(y);
    g.launch(
        (row_blocks as u32, col_blocks as u32, splits as u32),
        shared_bytes(kernel) as u32,
        &kernels::MatmulMma {
            variant: kernel,
            x: DevPtr::of(xb),
            ldx: to_i32(k * groups, "row stride")?,
            w: DevPtr(w.operand.w),
            s: DevPtr(w.operand.s),
            group_rows: w.operand.group_rows,
            ys: DevPtr::of(ys),
            rows: to_i32(rows, "rows")?,
            n: to_i32(n, "outputs")?,
            k: to_i32(k, "inputs")?,
            dout: to_i32(dout, "group outputs")?,
        },
    )?;
    if let Some(partial) = &partial {
        g.launch(
            grid_1d(rows * n),
            0,
            &kernels::SplitSum {
                ys: DevPtr::of(partial),
                y: DevPtr::of(y),
                n: (rows * n) as i64,
                splits: splits as i32,
            },
        )?;
    }
    Ok(())
}

/// Splits of the reduction for `tiles` output tiles of `stages` stages on a device that
/// holds `slots` blocks at once: as many as fit in one wave. A partial second wave (what
/// rounding up gave: 288 blocks on 264 slots for a 4096 x 4096 weight at batch 1) costs a
/// whole block time for a few blocks; a short block mostly waits for its first loads.
fn splits(slots: usize, tiles: usize, stages: usize) -> usize {
    (slots / tiles.max(1)).clamp(1, stages.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MMA_SHARED;

    #[test]
    fn splits_fill_one_wave_at_most() {
        // H100/H200 with three blocks per SM: 396 slots.
        assert_eq!(splits(396, 32, 32), 12); // 384 blocks, not 13 x 32 = 416
        assert_eq!(splits(396, 256, 8), 1);
        assert_eq!(splits(396, 4, 8), 8); // no more splits than stages
        assert_eq!(splits(396, 1000, 8), 1);
    }

    #[test]
    fn stages_are_128_byte_slabs_and_the_resident_blocks_fit_an_sm() {
        // bf16 2 bytes, FP8 1, FP4 half a byte per weight: every stage slab is 128 bytes.
        assert_eq!(stage_shape(ExpertFormat::Bf16).0 * 2, SLAB_BYTES);
        assert_eq!(stage_shape(ExpertFormat::Fp8).0, SLAB_BYTES);
        assert_eq!(stage_shape(ExpertFormat::Fp4).0 / 2, SLAB_BYTES);
        // The blocks per SM of the kernels' launch bounds (two, three for `_p8`) within
        // sm_90's 227 KiB, each with the driver's 1 KiB.
        for format in [ExpertFormat::Bf16, ExpertFormat::Fp8, ExpertFormat::Fp4] {
            for narrow in [false, true] {
                let v = MmaVariant { format, narrow };
                assert!(
                    blocks_per_sm(v) * (shared_bytes(v) + 1024) <= MMA_SHARED,
                    "{v:?}"
                );
            }
        }
        let fp8 = |rows| shared_bytes(variant(ExpertFormat::Fp8, rows));
        assert_eq!(fp8(9), 4 * (16384 + 32 * 256));
        assert_eq!(fp8(8), 4 * (16384 + 8 * 256));
    }
}
