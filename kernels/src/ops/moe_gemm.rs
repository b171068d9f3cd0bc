//! Routed experts as cuBLAS GEMMs (prefill): the routing, copied to the host (the caller
//! waits for that copy only, with the shared expert queued behind it), picks sorted by
//! expert, their rows gathered (in bf16 next to bf16 weights), and each used
//! expert runs two tensor-core GEMMs over all of its picks (gate+up, then down), with
//! SwiGLU between; the outputs stay sorted, and the combine reads them through each pick's
//! position. Used outside decode steps only (the host reads the routing).

use crate::buf::{f32_buf, storage};
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::lanes::Lane;
use crate::launch::{dev_err, grid_1d};
use crate::ops::numerics::{self, Activations, RoutedQuant};
use crate::ops::stored;
use crate::tensor::{Buf, GpuTensor};
use pdserve_engine::backend::{BResult, MoeParams};

/// Whether the GEMM path pays: outside decode steps, with enough picks per expert on
/// average for a GEMM to beat re-reading weights on CUDA cores.
pub(crate) fn worthwhile(g: &Gpu, rows: usize, k: usize, experts: usize) -> bool {
    !g.in_step() && rows * k >= 4 * experts
}

/// Pick indices in expert order, and each expert's `(first, count)` in that order.
pub(crate) type SortedPicks = (Vec<i32>, Vec<(usize, usize)>);

/// The picks of `rows` rows of `k` (expert ids, as the host read them) sorted by expert
/// (ascending pick index within an expert); an error where there are not `rows * k`
/// picks or one names no expert (a corrupt routing, never a panic).
pub(crate) fn sort_picks(
    ids: &[i32],
    (rows, k): (usize, usize),
    experts: usize,
) -> BResult<SortedPicks> {
    if ids.len() != rows * k {
        return Err(dev_err(format!(
            "{} picks for {rows} rows of {k}",
            ids.len()
        )));
    }
    let mut counts = vec![0usize; experts];
    for &e in ids {
        let count = usize::try_from(e)
            .ok()
            .and_then(|e| counts.get_mut(e))
            .ok_or_else(|| dev_err(format!("a pick of expert {e} of {experts}")))?;
        *count += 1;
    }
    let mut spans = Vec::with_capacity(experts);
    let mut first = 0;
    for &c in &counts {
        spans.push((first, c));
        first += c;
    }
    let mut next: Vec<usize> = spans.iter().map(|s| s.0).collect();
    let mut order = vec![0i32; ids.len()];
    for (a, &e) in ids.iter().enumerate() {
        order[next[e as usize]] = a as i32;
        next[e as usize] += 1;
    }
    Ok((order, spans))
}

/// `c[rows, m] = a[rows, kd] @ w[m, kd]^T` for one expert's span; element offsets given.
#[allow(clippy::too_many_arguments)]
fn span_gemm(
    g: &Gpu,
    lane: Option<&Lane>,
    a: (u64, usize),
    (w, c): (u64, u64),
    (rows, m, kd): (usize, usize, usize),
    bf16: bool,
) -> BResult<()> {
    let esz = if bf16 { 2 } else { 4 } as u64;
    let (a_ptr, a_off) = a;
    let x = a_ptr + a_off as u64 * esz;
    let (dims, lds) = ((rows, m, kd), (kd, kd, m));
    match lane {
        Some(lane) => lane.blas.gemm_nt(x, w, c, dims, lds, (0, 0, 0), 1, bf16),
        None => g.gemm_nt(x, w, c, dims, lds, (0, 0, 0), 1, bf16),
    }
}

/// Routed experts' outputs sorted by expert: `y` holds one row per pick, pick `a`'s at row
/// `pos[a]` (what `k_moe_combine` reads).
pub(crate) struct SortedRows {
    pub y: DevMem<f32>,
    pub pos: DevMem<i32>,
}

pub(crate) fn routed(
    g: &Gpu,
    x: &GpuTensor,
    p: &MoeParams<'_, GpuTensor>,
    host_ids: &[i32],
    quant: Option<&RoutedQuant<'_>>,
) -> BResult<SortedRows> {
    let (n, h) = (x.rows, x.cols);
    let (e, k, inter) = (p.n_experts, p.top_k, p.intermediate);
    let (order, spans) = sort_picks(host_ids, (n, k), e)?;
    let rows_of: Vec<i32> = order.iter().map(|&a| a / k as i32).collect();
    let mut pos = vec![0i32; order.len()];
    for (j, &a) in order.iter().enumerate() {
        pos[a as usize] = j as i32;
    }
    let picks = n * k;
    let gather = g.upload(&rows_of)?;
    let gu_w = ExpertWeights::new(g, p.gate_up, 2 * inter)?;
    let down_w = ExpertWeights::new(g, p.down, h)?;
    let (gu_bf16, down_bf16) = (gu_w.bf16, down_w.bf16);
    // Each pick's row, sorted by expert: bf16 (rounded as the GEMM input) or fp32.
    let xs = f32_buf(x, "moe")?;
    let xin = Gathered::new(g, gu_bf16, picks * h)?;
    let (x, idx, out, cols) = (DevPtr::of(xs), DevPtr::of(&gather), xin.dev_ptr(), h as i32);
    let rows = (picks as u32, 1, 1);
    if gu_bf16 {
        g.launch(rows, 0, &kernels::GatherRowsBf16 { x, idx, out, cols })?;
    } else {
        g.launch(rows, 0, &kernels::GatherRows { x, idx, out, cols })?;
    }
    // Gate and up rows of every pick: [picks, 2I].
    let gu = g.uninit::<f32>(picks * 2 * inter)?;
    // One GEMM per used expert, spread over side streams (each reads and writes only its
    // own rows; every buffer allocated before the fork).
    let used: Vec<(usize, (usize, usize))> = spans
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, (_, count))| *count > 0)
        .collect();
    g.spread(used.len(), |lane, slot, i| {
        let (ex, (first, count)) = used[i];
        let w = gu_w.expert(g, (lane, slot), ex)?;
        let c = gu.ptr() + (first * 2 * inter * 4) as u64;
        let a = (xin.ptr(), first * h);
        span_gemm(g, lane, a, (w, c), (count, 2 * inter, h), gu_bf16)
    })?;
    drop(xin);
    let act = Gathered::new(g, down_bf16, picks * inter)?;
    let (n, limit) = ((picks * inter) as i64, p.swiglu_limit);
    let (gu_in, act_out, halves) = (DevPtr::of(&gu), act.dev_ptr(), inter as i32);
    if down_bf16 {
        let k = kernels::SwigluHalvesBf16 {
            gu: gu_in,
            act: act_out,
            n,
            inter: halves,
            limit,
        };
        g.launch(grid_1d(picks * inter), 0, &k)?;
    } else {
        let k = kernels::SwigluHalves {
            x: gu_in,
            y: act_out,
            n,
            inter: halves,
            limit,
        };
        g.launch(grid_1d(picks * inter), 0, &k)?;
    }
    drop(gu);
    let pos = g.upload(&pos)?;
    if let Some(q) = quant {
        let a = match &act {
            Gathered::Bf16(b) => Activations::Bf16(b),
            Gathered::F32(b) => Activations::F32(b),
        };
        numerics::weight_act_quant(g, a, q, Some(&pos), (picks, inter))?;
    }
    let ys = g.uninit::<f32>(picks * h)?;
    g.spread(used.len(), |lane, slot, i| {
        let (ex, (first, count)) = used[i];
        let w = down_w.expert(g, (lane, slot), ex)?;
        let c = ys.ptr() + (first * h * 4) as u64;
        let a = (act.ptr(), first * inter);
        span_gemm(g, lane, a, (w, c), (count, h, inter), down_bf16)
    })?;
    Ok(SortedRows { y: ys, pos })
}

/// A GEMM input built for it: bf16 next to bf16 (or dequantized) weights, else fp32.
enum Gathered {
    Bf16(DevMem<u16>),
    F32(DevMem<f32>),
}

impl Gathered {
    /// `n` values, bf16 when `bf16`, written by the caller's kernel.
    fn new(g: &Gpu, bf16: bool, n: usize) -> BResult<Self> {
        Ok(if bf16 {
            Gathered::Bf16(g.uninit::<u16>(n)?)
        } else {
            Gathered::F32(g.uninit::<f32>(n)?)
        })
    }

    fn dev_ptr(&self) -> DevPtr {
        DevPtr(self.ptr())
    }

    fn ptr(&self) -> u64 {
        match self {
            Gathered::Bf16(b) => b.ptr(),
            Gathered::F32(b) => b.ptr(),
        }
    }
}

/// One projection of every expert (`per` rows each) as GEMM operands: bf16 or fp32 rows
/// in place, or a stored FP8/FP4 weight whose expert is dequantized just before its GEMM
/// into a bf16 buffer reused by the GEMMs of one stream (the only bf16 copy, one expert at
/// a time per stream: one buffer per lane of [`Gpu::spread`]).
struct ExpertWeights<'a> {
    w: &'a GpuTensor,
    per: usize,
    bf16: bool,
    scratch: Vec<DevMem<u16>>,
}

impl<'a> ExpertWeights<'a> {
    fn new(g: &Gpu, w: &'a GpuTensor, per: usize) -> BResult<Self> {
        let buffers = match w.stored() {
            Some(_) => g.expert_lanes.max(1),
            None => 0,
        };
        let scratch = (0..buffers)
            .map(|_| g.uninit::<u16>(per * w.cols))
            .collect::<BResult<Vec<_>>>()?;
        Ok(ExpertWeights {
            w,
            per,
            bf16: !matches!(w.buf, Buf::F32(_)),
            scratch,
        })
    }

    /// Device address of expert `ex`'s rows, as its GEMM on `lane` (`slot` of
    /// [`Gpu::spread`]'s lanes; `None`: the device's stream) reads them. A stored expert is
    /// dequantized on that stream into its slot's buffer, which the stream's previous GEMM
    /// has read by then.
    fn expert(&self, g: &Gpu, (lane, slot): (Option<&Lane>, usize), ex: usize) -> BResult<u64> {
        let row0 = ex * self.per;
        match (&self.w.buf, self.scratch.get(slot)) {
            (Buf::Stored(sw), Some(buf)) => {
                let on = lane.map(|l| &*l.stream);
                stored::dequant_into(g, on, sw, (row0, self.per, self.w.cols), buf)?;
                Ok(buf.ptr())
            }
            (Buf::Stored(_), None) => Err(dev_err(format!(
                "a stored expert without a dequantization buffer for stream {slot}"
            ))),
            _ => {
                let (_, ptr) = storage(self.w, "moe")?;
                let esz = if self.bf16 { 2 } else { 4 };
                Ok(ptr + (row0 * self.w.cols * esz) as u64)
            }
        }
    }
}

/// Whether the padded-batch GEMM path pays inside a decode step: bf16 experts and at least
/// one pick per expert on average (so most experts' weights are read anyway).
pub(crate) fn padded_worthwhile(
    p: &MoeParams<'_, GpuTensor>,
    rows: usize,
    k: usize,
    experts: usize,
) -> bool {
    p.gate_up.is_bf16() && p.down.is_bf16() && rows * k >= experts
}

/// Routed experts as two strided-batched GEMMs over every expert, each with `rows` padded
/// pick slots (an expert gets at most one pick per row): no host synchronisation, so it
/// runs inside captured decode steps. Reads every expert's weights once; the padding costs
/// tensor-core time only. Returns `y`: `[rows * k, H]`, one row per pick.
pub(crate) fn routed_padded(
    g: &Gpu,
    x: &GpuTensor,
    p: &MoeParams<'_, GpuTensor>,
    list: &DevMem<i32>,
    count: &DevMem<i32>,
) -> BResult<DevMem<f32>> {
    let (n, h) = (x.rows, x.cols);
    let (e, k, inter) = (p.n_experts, p.top_k, p.intermediate);
    let (_, gu_ptr) = storage(p.gate_up, "moe")?;
    let (_, down_ptr) = storage(p.down, "moe")?;
    let xp = g.uninit::<u16>(e * n * h)?;
    let grid = (e as u32, n as u32, 1);
    g.launch(
        grid,
        0,
        &kernels::MoeGatherPadded {
            x: DevPtr::of(f32_buf(x, "moe")?),
            list: DevPtr::of(list),
            count: DevPtr::of(count),
            xp: DevPtr::of(&xp),
            rows: n as i32,
            h: h as i32,
            k: k as i32,
        },
    )?;
    let gu = g.uninit::<f32>(e * n * 2 * inter)?;
    g.gemm_nt(
        xp.ptr(),
        gu_ptr,
        gu.ptr(),
        (n, 2 * inter, h),
        (h, h, 2 * inter),
        (
            (n * h) as i64,
            (2 * inter * h) as i64,
            (n * 2 * inter) as i64,
        ),
        e,
        true,
    )?;
    let act = g.uninit::<u16>(e * n * inter)?;
    g.launch(
        grid_1d(e * n * inter),
        0,
        &kernels::SwigluHalvesBf16 {
            gu: DevPtr::of(&gu),
            act: DevPtr::of(&act),
            n: (e * n * inter) as i64,
            inter: inter as i32,
            limit: p.swiglu_limit,
        },
    )?;
    let yp = g.uninit::<f32>(e * n * h)?;
    g.gemm_nt(
        act.ptr(),
        down_ptr,
        yp.ptr(),
        (n, h, inter),
        (inter, inter, h),
        ((n * inter) as i64, (h * inter) as i64, (n * h) as i64),
        e,
        true,
    )?;
    let y = g.uninit::<f32>(n * k * h)?;
    g.launch(
        grid,
        0,
        &kernels::MoeScatterPadded {
            yp: DevPtr::of(&yp),
            list: DevPtr::of(list),
            count: DevPtr::of(count),
            y: DevPtr::of(&y),
            rows: n as i32,
            h: h as i32,
        },
    )?;
    Ok(y)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn picks_sort_by_expert_keeping_pick_order() {
        // 3 rows x k=2 over 4 experts.
        let ids = [2, 0, 0, 3, 2, 1];
        let (order, spans) = sort_picks(&ids, (3, 2), 4).unwrap();
        assert_eq!(order, vec![1, 2, 5, 0, 4, 3]);
        assert_eq!(spans, vec![(0, 2), (2, 1), (3, 2), (5, 1)]);
        let (order, spans) = sort_picks(&[1, 1], (1, 2), 3).unwrap();
        assert_eq!(order, vec![0, 1]);
        assert_eq!(spans, vec![(0, 0), (0, 2), (2, 0)]);
    }

    #[test]
    fn picks_of_the_wrong_count_or_no_expert_are_errors() {
        let short = sort_picks(&[0, 1, 2], (2, 2), 4).unwrap_err().to_string();
        assert!(short.contains("3 picks for 2 rows of 2"), "{short}");
        let past = sort_picks(&[0, 4], (1, 2), 4).unwrap_err().to_string();
        assert!(past.contains("a pick of expert 4 of 4"), "{past}");
        let negative = sort_picks(&[-1, 0], (1, 2), 4).unwrap_err().to_string();
        assert!(negative.contains("a pick of expert -1 of 4"), "{negative}");
    }
}
