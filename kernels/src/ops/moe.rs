//! MoE of [`CudaBackend`]: router GEMM (cuBLAS), routing kernel, picks grouped by expert,
//! routed experts over bf16, fp32 or stored FP8/FP4 weights (one warp per output unit of an expert, run
//! against all of that expert's picks; fp32 accumulation), shared expert, combine.

use crate::buf::{f32_buf, out_ptr, shape_err};
use crate::device::{ExpertKernel, Gpu};
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr, PickTile};
use crate::launch::{dev_err, BLOCK};
use crate::ops::dense::matmul;
use crate::ops::fp8_linear::GemmCache;
use crate::ops::moe_fp8;
use crate::ops::moe_gemm;
use crate::ops::moe_mma;
use crate::ops::numerics::{self, Activations, RoutedQuant};
use crate::ops::tensors::{new_f32, param_f32};
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{BResult, MoeParams, PickKind, Picks, RowPicks};
use std::sync::Mutex;

/// Batches of at most this many rows take the grouped kernels' small pick tile
/// (`MOE_TILE_SMALL` in moe.cu).
const SMALL_TILE_ROWS: usize = 2;
use pdserve_engine::config::ScoringFunc;
use pdserve_engine::numerics::ACT_BLOCK;

const WARPS: usize = BLOCK as usize / 32;
/// Picks per row the combine kernel orders in shared memory (`order[64]` in moe.cu).
const MAX_TOP_K: usize = 64;

/// Channels per block of `k_moe_combine` (`COMBINE_COLS` in moe.cu).
const COMBINE_COLS: usize = 1024;

/// Experts `k_moe_route` ranks (one warp per row, a 32-bit taken mask per lane).
const MAX_EXPERTS: usize = 1024;

/// Linears of one input over FP8/FP4 weights on FP8 activations (`deepseek` numerics: the
/// backend's `quantized_matmuls`, which may take the FP8 GEMM, quantizing the input once).
pub type QuantizedLinears<'a> = &'a dyn Fn(&GpuTensor, &[&GpuTensor]) -> BResult<Vec<GpuTensor>>;

/// Routed experts plus shared expert; under `deepseek` numerics the shared expert's
/// linears go through `quantized`, and a prefill's FP8 routed experts through the FP8
/// GEMMs of `gemms`.
pub fn moe(
    g: &Gpu,
    x: &GpuTensor,
    p: &MoeParams<'_, GpuTensor>,
    quantized: QuantizedLinears<'_>,
    gemms: &Mutex<GemmCache>,
) -> BResult<GpuTensor> {
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
        || e > MAX_EXPERTS
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
    // One warp per row.
    g.launch(
        ((n * 32).div_ceil(BLOCK as usize) as u32, 1, 1),
        0,
        &kernels::MoeRoute {
            logits: out_ptr(&logits)?,
            bias: bias.as_ref().map_or(DevPtr::NULL, DevPtr::of),
            hash: hash.as_ref().map_or(DevPtr::NULL, DevPtr::of),
            ids: DevPtr::of(&ids),
            wts: DevPtr::of(&wts),
            rows: n as i32,
            e: e as i32,
            k: k as i32,
            scoring,
            routed_scaling: p.routed_scaling,
        },
    )?;
    if let (Some(rec), None) = (p.record, p.hash_experts) {
        let picked = g.download(&ids, n * k)?;
        rec.log.push(Picks {
            layer: rec.layer,
            kind: PickKind::Route,
            rows: picked
                .chunks(k.max(1))
                .map(|r| RowPicks::new(r.iter().map(|&i| i as u32).collect(), None))
                .collect(),
        });
    }
    // deepseek numerics: the routed experts' input quantized per 128, each pick's routing
    // weight applied to its activation before w2's input is quantized, and the combine's
    // weights then 1 (the CPU's order).
    let (xq, unit);
    let (xr, quant) = if p.act_quant_routed {
        xq = numerics::act_quant(g, x, ACT_BLOCK)?;
        unit = g.uninit::<f32>(n * k)?;
        (
            &xq,
            Some(RoutedQuant {
                wts: &wts,
                unit: &unit,
            }),
        )
    } else {
        (x, None)
    };
    let q = quant.as_ref();
    // The sorted-GEMM path sorts the picks on the host: their copy starts now and the
    // shared expert is queued behind it, so the device runs that while the host sorts.
    let sorted_path = !g.deterministic && moe_gemm::worthwhile(g, n, k, e);
    let early_ids = match sorted_path {
        true => Some(g.download_early(&ids, n * k)?),
        false => None,
    };
    // Shared expert (its input and its SwiGLU output quantized under `deepseek`).
    // Gate and up read the same input: quantized once.
    let linears = |x: &GpuTensor, ws: &[&GpuTensor]| match p.act_quant_shared {
        true => quantized(x, ws),
        false => ws.iter().map(|w| matmul(g, x, w)).collect(),
    };
    let [sg, su]: [GpuTensor; 2] = linears(x, &[p.shared_gate, p.shared_up])?
        .try_into()
        .map_err(|_| dev_err("the shared expert's gate and up: not two outputs"))?;
    let sact = new_f32(g, n, p.shared_gate.rows)?;
    g.launch(
        crate::launch::grid_1d(sact.len()),
        0,
        &kernels::Swiglu {
            g: DevPtr::of(f32_buf(&sg, "moe")?),
            u: DevPtr::of(f32_buf(&su, "moe")?),
            y: out_ptr(&sact)?,
            n: sact.len() as i64,
            limit: p.swiglu_limit,
        },
    )?;
    let shared = linears(&sact, &[p.shared_down])?
        .pop()
        .ok_or_else(|| dev_err("the shared expert's down: no output"))?;
    // The routed experts' outputs, and where each pick's row is (None: in pick order).
    let (y, pos) = if let Some(early) = early_ids {
        let host_ids = early.finish()?;
        // FP8 experts under deepseek numerics on the FP8 GEMM, else bf16 GEMMs.
        let fp8 = match q {
            Some(q) if moe_fp8::takes(g, p, true) => {
                moe_fp8::routed(g, gemms, xr, p, &host_ids, q)?
            }
            _ => None,
        };
        let sorted = match fp8 {
            Some(sorted) => sorted,
            None => moe_gemm::routed(g, xr, p, &host_ids, q)?,
        };
        (sorted.y, Some(sorted.pos))
    } else if g.deterministic {
        (routed_grouped(g, xr, p, &ids, q)?, None)
    } else if tensor_cores(g, p, n) && moe_mma::takes(g, p, h) {
        let (list, count) = expert_lists(g, &ids, n, e, k)?;
        (moe_mma::routed(g, xr, p, &list, &count, q)?, None)
    } else if q.is_none() && moe_gemm::padded_worthwhile(p, n, k, e) {
        // (Its activations sit in per-expert slots: no deepseek step there.)
        let (list, count) = expert_lists(g, &ids, n, e, k)?;
        (moe_gemm::routed_padded(g, xr, p, &list, &count)?, None)
    } else {
        (routed_grouped(g, xr, p, &ids, q)?, None)
    };
    let combine_wts = q.map_or(&wts, |q| q.unit);
    let out = new_f32(g, n, h)?;
    g.launch(
        (n as u32, h.div_ceil(COMBINE_COLS) as u32, 1),
        0,
        &kernels::MoeCombine {
            y: DevPtr::of(&y),
            pos: pos.as_ref().map_or(DevPtr::NULL, DevPtr::of),
            ids: DevPtr::of(&ids),
            wts: DevPtr::of(combine_wts),
            shared: DevPtr::of(f32_buf(&shared, "moe")?),
            out: out_ptr(&out)?,
            h: h as i32,
            k: k as i32,
        },
    )?;
    Ok(out)
}

/// Whether the tensor-core expert kernels are asked for. Auto: stored FP8/FP4 experts at
/// every batch (their 8-pick kernels measured faster than the CUDA-core small-tile ones at
/// 1 and 2 rows: H100, fp8 batch 2 2.53 -> 2.26 ms/step), bf16 experts past 2 rows (where
/// the small-tile kernels read bf16 weights as fast). Always or never when a benchmark
/// asks.
fn tensor_cores(g: &Gpu, p: &MoeParams<'_, GpuTensor>, rows: usize) -> bool {
    match g.expert_kernel {
        ExpertKernel::Auto => rows > SMALL_TILE_ROWS || p.gate_up.stored().is_some(),
        ExpertKernel::TensorCores => true,
        ExpertKernel::CudaCores => false,
    }
}

/// Routed experts on CUDA cores, picks grouped by expert on the device (no host
/// synchronisation: the decode-step path). Returns `y`: `[rows * k, H]`, one row per pick.
fn routed_grouped(
    g: &Gpu,
    x: &GpuTensor,
    p: &MoeParams<'_, GpuTensor>,
    ids: &DevMem<i32>,
    quant: Option<&RoutedQuant<'_>>,
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
    let lists = (DevPtr::of(&list), DevPtr::of(&active), DevPtr::of(&count));
    let dims = (n as i32, e as i32, h as i32, inter as i32);
    let operand = |t: &GpuTensor| {
        t.buf
            .operand()
            .ok_or_else(|| shape_err("moe", format!("expert weight of {} rows", t.rows)))
    };
    let (gu, down) = (operand(p.gate_up)?, operand(p.down)?);
    // An expert has at most one pick per row (a row's picks are distinct experts).
    let tile = if n <= SMALL_TILE_ROWS {
        PickTile::Small
    } else {
        PickTile::Full
    };
    g.launch(
        (slots, inter.div_ceil(WARPS) as u32, 1),
        0,
        &kernels::MoeGateUpGrouped {
            variant: tile,
            x: DevPtr::of(xs),
            w: DevPtr(gu.w),
            s: DevPtr(gu.s),
            fmt: gu.fmt,
            group_rows: gu.group_rows,
            list: lists.0,
            active: lists.1,
            count: lists.2,
            act: DevPtr::of(&act),
            rows: dims.0,
            e: dims.1,
            h: dims.2,
            i: dims.3,
            k: k as i32,
            limit: p.swiglu_limit,
        },
    )?;
    if let Some(q) = quant {
        numerics::weight_act_quant(g, Activations::F32(&act), q, None, (n * k, inter))?;
    }
    g.launch(
        (slots, h.div_ceil(WARPS) as u32, 1),
        0,
        &kernels::MoeDownGrouped {
            variant: tile,
            act: DevPtr::of(&act),
            w: DevPtr(down.w),
            s: DevPtr(down.s),
            fmt: down.fmt,
            group_rows: down.group_rows,
            list: lists.0,
            active: lists.1,
            count: lists.2,
            y: DevPtr::of(&y),
            rows: dims.0,
            e: dims.1,
            h: dims.2,
            i: dims.3,
        },
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
        (1, 1, 1),
        0,
        &kernels::MoeLists {
            ids: DevPtr::of(ids),
            list: DevPtr::of(&list),
            count: DevPtr::of(&count),
            active: DevPtr::of(&active),
            rows: n as i32,
            e: e as i32,
            k: k as i32,
        },
    )?;
    Ok((list, count))
}
