//! MoE of [`CudaBackend`]: router GEMM (cuBLAS), routing kernel, picks grouped by expert,
//! routed experts over bf16 or fp32 weights (one warp per output unit of an expert, run
//! against all of that expert's picks; fp32 accumulation), shared expert, combine.

use crate::buf::{f32_buf, out_ptr, shape_err};
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::launch::{Arg, BLOCK};
use crate::ops::dense::matmul;
use crate::ops::moe_gemm;
use crate::ops::tensors::{new_f32, param_f32};
use crate::tensor::{Buf, GpuTensor};
use pdserve_engine::backend::{BResult, MoeParams};
use pdserve_engine::config::ScoringFunc;

const WARPS: usize = BLOCK as usize / 32;
/// Picks per row the combine kernel orders in shared memory (`order[64]` in moe.cu).
const MAX_TOP_K: usize = 64;

/// Kernel name suffix and device pointer of an expert weight.
pub(crate) fn weight(t: &GpuTensor) -> (&'static str, u64) {
    match &t.buf {
        Buf::Bf16(s) => ("_bf16", s.ptr()),
        Buf::F32(s) => ("_f32", s.ptr()),
    }
}

pub fn moe(g: &Gpu, x: &GpuTensor, p: &MoeParams<'_, GpuTensor>) -> BResult<GpuTensor> {
    let (n, h) = (x.rows, x.cols);
    let (e, k, inter) = (p.n_experts, p.top_k, p.intermediate);
    if p.router.rows != e
        || p.gate_up.rows != e * 2 * inter
        || p.down.rows != e * h
        || p.gate_up.cols != h
        || p.down.cols != inter
        || k == 0
        || k > e
        || k > MAX_TOP_K
    {
        return Err(shape_err(
            "moe",
            format!(
                "router {} experts, gate_up rows {}",
                p.router.rows, p.gate_up.rows
            ),
        ));
    }
    let hash = match p.hash_experts {
        Some(hash) => {
            if hash.len() != n * k {
                return Err(shape_err(
                    "moe",
                    format!("{} hash ids for {n} rows", hash.len()),
                ));
            }
            if let Some(&bad) = hash.iter().find(|&&i| i as usize >= e) {
                return Err(shape_err("moe", format!("expert id {bad} >= {e}")));
            }
            Some(g.upload(hash)?)
        }
        None => None,
    };
    let logits = matmul(g, x, p.router)?;
    let bias = p.correction_bias.map(|t| param_f32(g, t)).transpose()?;
    let ids = g.zeros::<i32>(n * k)?;
    let wts = g.zeros::<f32>(n * k)?;
    let scoring = match p.scoring {
        ScoringFunc::SqrtSoftplus => 0,
        ScoringFunc::Sigmoid => 1,
        ScoringFunc::Softmax => 2,
    };
    g.launch(
        "k_moe_route",
        (n.div_ceil(BLOCK as usize) as u32, 1, 1),
        0,
        &[
            Arg::Ptr(out_ptr(&logits)?),
            Arg::Ptr(bias.as_ref().map_or(0, |s| g.ptr(s))),
            Arg::Ptr(hash.as_ref().map_or(0, |s| g.ptr(s))),
            Arg::Ptr(g.ptr(&ids)),
            Arg::Ptr(g.ptr(&wts)),
            Arg::I32(n as i32),
            Arg::I32(e as i32),
            Arg::I32(k as i32),
            Arg::I32(scoring),
            Arg::F32(p.routed_scaling),
        ],
    )?;
    let y = if moe_gemm::worthwhile(g, n, k, e) {
        moe_gemm::routed(g, x, p, &ids)?
    } else if moe_gemm::padded_worthwhile(p, n, k, e) {
        let (list, count) = expert_lists(g, &ids, n, e, k)?;
        moe_gemm::routed_padded(g, x, p, &list, &count)?
    } else {
        routed_grouped(g, x, p, &ids)?
    };
    // Shared expert.
    let sg = matmul(g, x, p.shared_gate)?;
    let su = matmul(g, x, p.shared_up)?;
    let sact = new_f32(g, n, p.shared_gate.rows)?;
    g.launch(
        "k_swiglu",
        crate::launch::grid_1d(sact.len()),
        0,
        &[
            Arg::Ptr(g.ptr(f32_buf(&sg, "moe")?)),
            Arg::Ptr(g.ptr(f32_buf(&su, "moe")?)),
            Arg::Ptr(out_ptr(&sact)?),
            Arg::I64(sact.len() as i64),
            Arg::F32(p.swiglu_limit),
        ],
    )?;
    let shared = matmul(g, &sact, p.shared_down)?;
    let out = new_f32(g, n, h)?;
    g.launch(
        "k_moe_combine",
        (n as u32, 1, 1),
        0,
        &[
            Arg::Ptr(g.ptr(&y)),
            Arg::Ptr(g.ptr(&ids)),
            Arg::Ptr(g.ptr(&wts)),
            Arg::Ptr(g.ptr(f32_buf(&shared, "moe")?)),
            Arg::Ptr(out_ptr(&out)?),
            Arg::I32(h as i32),
            Arg::I32(k as i32),
        ],
    )?;
    Ok(out)
}

/// Routed experts on CUDA cores, picks grouped by expert on the device (no host
/// synchronisation: the decode-step path). Returns `y`: `[rows * k, H]`, one row per pick.
fn routed_grouped(
    g: &Gpu,
    x: &GpuTensor,
    p: &MoeParams<'_, GpuTensor>,
    ids: &DevMem<i32>,
) -> BResult<DevMem<f32>> {
    let (n, h) = (x.rows, x.cols);
    let (e, k, inter) = (p.n_experts, p.top_k, p.intermediate);
    // Picks grouped by expert, so each expert's weights are read once per MOE_TILE picks
    // instead of once per pick.
    let (list, count) = expert_lists(g, ids, n, e, k)?;
    let active = count.view_from(e);
    // One block column per expert that may be used: at most one per pick.
    let slots = e.min(n * k) as u32;
    let act = g.uninit::<f32>(n * k * inter)?;
    let y = g.uninit::<f32>(n * k * h)?;
    let xs = f32_buf(x, "moe")?;
    let (gu_kind, gu_ptr) = weight(p.gate_up);
    let (down_kind, down_ptr) = weight(p.down);
    g.launch(
        &format!("k_moe_gate_up_grouped{gu_kind}"),
        (slots, inter.div_ceil(WARPS) as u32, 1),
        0,
        &[
            Arg::Ptr(g.ptr(xs)),
            Arg::Ptr(gu_ptr),
            Arg::Ptr(g.ptr(&list)),
            Arg::Ptr(g.ptr(&active)),
            Arg::Ptr(g.ptr(&count)),
            Arg::Ptr(g.ptr(&act)),
            Arg::I32(n as i32),
            Arg::I32(e as i32),
            Arg::I32(h as i32),
            Arg::I32(inter as i32),
            Arg::I32(k as i32),
            Arg::F32(p.swiglu_limit),
        ],
    )?;
    g.launch(
        &format!("k_moe_down_grouped{down_kind}"),
        (slots, h.div_ceil(WARPS) as u32, 1),
        0,
        &[
            Arg::Ptr(g.ptr(&act)),
            Arg::Ptr(down_ptr),
            Arg::Ptr(g.ptr(&list)),
            Arg::Ptr(g.ptr(&active)),
            Arg::Ptr(g.ptr(&count)),
            Arg::Ptr(g.ptr(&y)),
            Arg::I32(n as i32),
            Arg::I32(e as i32),
            Arg::I32(h as i32),
            Arg::I32(inter as i32),
        ],
    )?;
    Ok(y)
}

/// Picks by expert on the device: `list[e * rows + j]` is the j-th pick (row * k + slot) of
/// expert e; `count` holds `E` counts, then the used experts in ascending order, then how
/// many are used (see `k_moe_lists`).
fn expert_lists(
    g: &Gpu,
    ids: &DevMem<i32>,
    n: usize,
    e: usize,
    k: usize,
) -> BResult<(DevMem<i32>, DevMem<i32>)> {
    let list = g.uninit::<i32>(e * n)?;
    let count = g.uninit::<i32>(2 * e + 1)?;
    let active = count.view_from(e);
    g.launch(
        "k_moe_lists",
        (1, 1, 1),
        0,
        &[
            Arg::Ptr(g.ptr(ids)),
            Arg::Ptr(g.ptr(&list)),
            Arg::Ptr(g.ptr(&count)),
            Arg::Ptr(g.ptr(&active)),
            Arg::I32(n as i32),
            Arg::I32(e as i32),
            Arg::I32(k as i32),
        ],
    )?;
    Ok((list, count))
}
