//! `--numerics deepseek` on the GPU, each piece the CPU's `pdserve_engine::numerics` bit for
//! bit on the same input (`cu/quant.cu`, `act_quant_warp` and `rotate_fp4` in common.cuh):
//! DeepSeek's activation quantization before the FP8/FP4 linears (act_quant per 128), the
//! routed experts' routing weight applied before `w2`'s input is quantized, and the
//! indexer's Hadamard rotation + FP4 simulation of queries (here) and keys (in the
//! compressor, `compress.rs`).

use crate::buf::{f32_buf, out_ptr, shape_err};
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::launch::{grid_1d, BLOCK};
use crate::ops::stored::to_i32;
use crate::ops::tensors::new_f32;
use crate::tensor::{Buf, GpuTensor};
use pdserve_engine::backend::BResult;
use pdserve_engine::numerics::{hadamard_scale, ACT_BLOCK, FP4_BLOCK};

/// Warps per launch of the per-block kernels: one 32-lane warp per 128-value block.
fn warps(blocks: usize) -> (u32, u32, u32) {
    grid_1d(blocks * 32)
}

/// [`pdserve_engine::backend::TensorOps::act_quant`]: `x` (fp32 or bf16 activations) with
/// every 128 values of a row replaced by their FP8 value, as a new fp32 tensor.
pub fn act_quant(g: &Gpu, x: &GpuTensor, block: usize) -> BResult<GpuTensor> {
    if block != ACT_BLOCK {
        return Err(shape_err(
            "act_quant",
            format!("blocks of {block} values; the kernel quantizes blocks of {ACT_BLOCK}"),
        ));
    }
    let (x32, x16) = match &x.buf {
        Buf::F32(s) => (DevPtr::of(s), DevPtr::NULL),
        Buf::Bf16(s) => (DevPtr::NULL, DevPtr::of(s)),
        Buf::Stored(_) => {
            return Err(shape_err(
                "act_quant",
                format!(
                    "a stored [{}x{}] weight is not an activation",
                    x.rows, x.cols
                ),
            ))
        }
    };
    let y = new_f32(g, x.rows, x.cols)?;
    if y.is_empty() {
        return Ok(y);
    }
    g.launch(
        warps(x.rows * x.cols.div_ceil(ACT_BLOCK)),
        0,
        &kernels::ActQuantF32 {
            x: x32,
            x16,
            y: out_ptr(&y)?,
            rows: to_i32(x.rows, "rows")?,
            cols: to_i32(x.cols, "columns")?,
        },
    )?;
    Ok(y)
}

/// A routed expert's SwiGLU activations, one row of `inter` values per pick.
pub(crate) enum Activations<'a> {
    F32(&'a DevMem<f32>),
    Bf16(&'a DevMem<u16>),
}

/// deepseek numerics for the routed experts: each pick's routing weight, and the weights
/// the combine applies instead (all 1, written by [`weight_act_quant`]).
pub(crate) struct RoutedQuant<'a> {
    pub wts: &'a DevMem<f32>,
    pub unit: &'a DevMem<f32>,
}

/// deepseek numerics, routed experts: each pick's activation row (row `pos[p]`, or `p`
/// without `pos`) times its routing weight, then act_quant, in place; the combine's
/// weights set to 1 (the routing weight is in the activation now).
pub(crate) fn weight_act_quant(
    g: &Gpu,
    act: Activations<'_>,
    q: &RoutedQuant<'_>,
    pos: Option<&DevMem<i32>>,
    (picks, inter): (usize, usize),
) -> BResult<()> {
    let (a32, a16, held) = match act {
        Activations::F32(a) => (DevPtr::of(a), DevPtr::NULL, a.len()),
        Activations::Bf16(a) => (DevPtr::NULL, DevPtr::of(a), a.len()),
    };
    if held < picks * inter || q.wts.len() < picks || q.unit.len() < picks {
        return Err(shape_err(
            "moe",
            format!(
                "{picks} picks of {inter} activations over {held} values, {} weights",
                q.wts.len()
            ),
        ));
    }
    if picks == 0 {
        return Ok(());
    }
    g.launch(
        warps(picks * inter.div_ceil(ACT_BLOCK)),
        0,
        &kernels::MoeWeightActQuant {
            act: a32,
            act16: a16,
            wts: DevPtr::of(q.wts),
            pos: pos.map_or(DevPtr::NULL, DevPtr::of),
            unit: DevPtr::of(q.unit),
            picks: to_i32(picks, "picks")?,
            inter: to_i32(inter, "intermediate size")?,
        },
    )
}

/// The f64 bits of `n^-0.5` the rotation kernels take, after checking that `n`-value
/// heads can be rotated (a power of two, whole FP4 blocks).
pub(crate) fn rotation_scale_bits(n: usize, op: &'static str) -> BResult<i64> {
    if !n.is_power_of_two() || !n.is_multiple_of(FP4_BLOCK) {
        return Err(shape_err(
            op,
            format!(
                "deepseek numerics rotate heads of {n} values; a power of two of at least {FP4_BLOCK} is required"
            ),
        ));
    }
    Ok(hadamard_scale(n).to_bits() as i64)
}

/// Largest head `k_rotate_fp4` rotates (one warp per head, 16 values a lane).
const MAX_WARP_ROTATION: usize = 512;

/// deepseek numerics, the indexer's queries (after their rope): each `head_dim`-wide head
/// of every row rotated and FP4-quantized, as a new fp32 tensor.
pub fn rotate_fp4(g: &Gpu, q: &GpuTensor, head_dim: usize) -> BResult<GpuTensor> {
    let scale_bits = rotation_scale_bits(head_dim, "index_select")?;
    if !q.cols.is_multiple_of(head_dim) {
        return Err(shape_err(
            "index_select",
            format!("queries of {} values in heads of {head_dim}", q.cols),
        ));
    }
    if head_dim > MAX_WARP_ROTATION {
        return Err(shape_err(
            "index_select",
            format!("heads of {head_dim} values; the rotation takes up to {MAX_WARP_ROTATION}"),
        ));
    }
    let x = f32_buf(q, "index_select")?;
    let out = new_f32(g, q.rows, q.cols)?;
    let heads = q.rows * (q.cols / head_dim);
    if out.is_empty() {
        return Ok(out);
    }
    let warps = (BLOCK / 32) as usize;
    let blocks = u32::try_from(heads.div_ceil(warps))
        .map_err(|_| shape_err("index_select", format!("{heads} heads")))?;
    g.launch(
        (blocks, 1, 1),
        0,
        &kernels::RotateFp4 {
            x: DevPtr::of(x),
            y: out_ptr(&out)?,
            n: heads as i64,
            hd: to_i32(head_dim, "head dim")?,
            scale_bits,
        },
    )?;
    Ok(out)
}
