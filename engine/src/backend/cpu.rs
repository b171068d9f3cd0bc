//! fp32 CPU backend: its tensors are [`HostTensor`]s. Dense ops here; paged KV ops in
//! `cpu_attention`.

use super::cpu_kv::{CpuKv, Region};
use super::cpu_math::{rms_norm_into, sigmoid, silu, softmax, softplus};
use super::gemm::matmul_nt;
use super::picks::{PickKind, PickLog, Picks, RowPicks};
use super::shapes::shape_err;
use super::{
    cpu_attention, shapes, BResult, BatchPlan, CompressedKeys, CompressorParams, CompressorPart,
    HcParams, HcPre, HeadRope, HostTensor, KvStorage, MoeParams, StepRunner, TensorOps,
};
use crate::config::ScoringFunc;
use crate::kv::{KvLayout, PageId, StateSlot};
use crate::numerics::{act_quant, ACT_BLOCK};
use crate::rope::Rope;
use rayon::prelude::*;
use std::borrow::Cow;

/// The CPU backend; matmuls use rayon's global pool.
#[derive(Debug, Default, Clone)]
pub struct CpuBackend;

impl CpuBackend {
    fn mm(&self, x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> HostTensor {
        let mut out = HostTensor::zeros(n, m);
        matmul_nt(x, n, k, w, m, &mut out.data);
        out
    }

    /// `x`, FP8-quantized per 128 when `quantize` ([`TensorOps::act_quant`]).
    fn act_quant_if<'a>(&self, quantize: bool, x: &'a HostTensor) -> BResult<Cow<'a, HostTensor>> {
        Ok(if quantize {
            Cow::Owned(self.act_quant(x, ACT_BLOCK)?)
        } else {
            Cow::Borrowed(x)
        })
    }

    /// Clamped SwiGLU of `[gate | up]` halves.
    fn swiglu(gate: &[f32], up: &[f32], limit: f32, out: &mut [f32]) {
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu(g.min(limit)) * u.clamp(-limit, limit);
        }
    }
}

impl KvStorage for CpuBackend {
    type KvStore = CpuKv;

    fn alloc_kv(&self, layout: &KvLayout, pages: usize, states: usize) -> BResult<CpuKv> {
        Ok(CpuKv::new(layout, pages, states))
    }

    fn reset_state(&self, kv: &mut CpuKv, slot: StateSlot) -> BResult<()> {
        kv.zero(Region::State(slot))
    }

    fn page_bytes(&self, kv: &CpuKv, page: PageId) -> BResult<Vec<u8>> {
        kv.bytes(Region::Page(page))
    }

    fn state_bytes(&self, kv: &CpuKv, slot: StateSlot) -> BResult<Vec<u8>> {
        kv.bytes(Region::State(slot))
    }

    fn state_ranges(
        &self,
        kv: &CpuKv,
        slots: &[StateSlot],
        ranges: &[std::ops::Range<usize>],
    ) -> BResult<Vec<Vec<u8>>> {
        kv.ranges_of(slots, ranges)
    }

    fn write_page(&self, kv: &mut CpuKv, page: PageId, bytes: &[u8]) -> BResult<()> {
        kv.write_bytes(Region::Page(page), bytes)
    }

    fn write_state(&self, kv: &mut CpuKv, slot: StateSlot, bytes: &[u8]) -> BResult<()> {
        kv.write_bytes(Region::State(slot), bytes)
    }

    fn page_checksums(&self, kv: &CpuKv) -> BResult<Vec<u64>> {
        Ok(kv.page_checksums())
    }

    fn state_checksums(&self, kv: &CpuKv) -> BResult<Vec<u64>> {
        Ok(kv.state_checksums())
    }
}

/// One forward per decode step (no graphs on the CPU).
impl StepRunner for CpuBackend {}

impl TensorOps for CpuBackend {
    type Tensor = HostTensor;
    type Selection = Vec<Vec<u32>>;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn memory_free(&self) -> Option<u64> {
        crate::kv::sizing::host_memory_available()
    }

    fn dims(&self, t: &HostTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn upload(&self, t: HostTensor) -> BResult<HostTensor> {
        if t.data.len() != t.rows * t.cols {
            return Err(shape_err(
                "upload",
                format!("{}x{} with {} values", t.rows, t.cols, t.data.len()),
            ));
        }
        Ok(t)
    }

    fn to_host(&self, t: &HostTensor) -> BResult<HostTensor> {
        Ok(t.clone())
    }

    fn gather_rows(&self, t: &HostTensor, rows: &[usize]) -> BResult<HostTensor> {
        let mut out = HostTensor::zeros(rows.len(), t.cols);
        for (i, &r) in rows.iter().enumerate() {
            if r >= t.rows {
                return Err(shape_err("gather_rows", format!("row {r} of {}", t.rows)));
            }
            out.data[i * t.cols..(i + 1) * t.cols].copy_from_slice(t.row(r));
        }
        Ok(out)
    }

    fn embed(&self, table: &HostTensor, tokens: &[u32], copies: usize) -> BResult<HostTensor> {
        shapes::check_embed(table.rows, tokens)?;
        let h = table.cols;
        let mut out = HostTensor::zeros(tokens.len(), copies * h);
        for (i, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            for c in 0..copies {
                let o = i * copies * h + c * h;
                out.data[o..o + h].copy_from_slice(table.row(t));
            }
        }
        Ok(out)
    }

    fn matmul(&self, x: &HostTensor, w: &HostTensor) -> BResult<HostTensor> {
        shapes::check_matmul((x.rows, x.cols), (w.rows, w.cols))?;
        Ok(self.mm(&x.data, x.rows, x.cols, &w.data, w.rows))
    }

    fn grouped_matmul(&self, x: &HostTensor, w: &HostTensor, groups: usize) -> BResult<HostTensor> {
        shapes::check_grouped_matmul((x.rows, x.cols), (w.rows, w.cols), groups)?;
        let (din, dout) = (w.cols, w.rows / groups);
        let mut out = HostTensor::zeros(x.rows, w.rows);
        for g in 0..groups {
            let xg: Vec<f32> = (0..x.rows)
                .flat_map(|r| x.row(r)[g * din..(g + 1) * din].iter().copied())
                .collect();
            let y = self.mm(
                &xg,
                x.rows,
                din,
                &w.data[g * dout * din..(g + 1) * dout * din],
                dout,
            );
            for r in 0..x.rows {
                out.data[r * w.rows + g * dout..r * w.rows + (g + 1) * dout]
                    .copy_from_slice(y.row(r));
            }
        }
        Ok(out)
    }

    fn rms_norm(
        &self,
        x: &HostTensor,
        weight: Option<&HostTensor>,
        group: usize,
        eps: f32,
    ) -> BResult<HostTensor> {
        shapes::check_rms_norm(x.cols, weight.map(|w| w.data.len()), group)?;
        let mut out = HostTensor::zeros(x.rows, x.cols);
        let w = weight.map(|w| w.data.as_slice());
        out.data
            .par_chunks_mut(group)
            .zip(x.data.par_chunks(group))
            .for_each(|(o, v)| rms_norm_into(v, w, eps, o));
        Ok(out)
    }

    fn rope(
        &self,
        x: &mut HostTensor,
        head_dim: usize,
        rope: &Rope,
        positions: &[usize],
        inverse: bool,
    ) -> BResult<()> {
        shapes::check_rope((x.rows, x.cols), head_dim, positions.len(), rope.dim())?;
        let cols = x.cols;
        x.data
            .par_chunks_mut(cols)
            .zip(positions.par_iter())
            .for_each(|(row, &p)| {
                let mut cos = vec![0f32; rope.dim() / 2];
                let mut sin = vec![0f32; rope.dim() / 2];
                rope.cos_sin(p, &mut cos, &mut sin);
                for head in row.chunks_mut(head_dim) {
                    rope.apply(head, &cos, &sin, inverse);
                }
            });
        Ok(())
    }

    fn hc_pre(
        &self,
        streams: &HostTensor,
        mix: &HostTensor,
        p: &HcParams<'_, HostTensor>,
    ) -> BResult<HcPre<HostTensor>> {
        let hc = p.hc;
        shapes::check_hc_pre(
            (streams.rows, streams.cols),
            (mix.rows, mix.cols),
            p.base.data.len(),
            p.scale.data.len(),
            hc,
        )?;
        let n = streams.rows;
        let h = streams.cols / hc;
        let (base, scale) = (&p.base.data, &p.scale.data);
        let mut post = HostTensor::zeros(n, hc);
        let mut comb = HostTensor::zeros(n, hc * hc);
        let mut collapsed = HostTensor::zeros(n, h);
        for r in 0..n {
            let m = mix.row(r);
            let pre: Vec<f32> = (0..hc)
                .map(|k| sigmoid(m[k] * scale[0] + base[k]) + p.eps)
                .collect();
            for k in 0..hc {
                post.data[r * hc + k] = 2.0 * sigmoid(m[hc + k] * scale[1] + base[hc + k]);
            }
            let c = &mut comb.data[r * hc * hc..(r + 1) * hc * hc];
            for i in 0..hc * hc {
                c[i] = m[2 * hc + i] * scale[2] + base[2 * hc + i];
            }
            for row in c.chunks_mut(hc) {
                softmax(row);
                for v in row.iter_mut() {
                    *v += p.eps;
                }
            }
            normalize_cols(c, hc, p.eps);
            for _ in 1..p.sinkhorn_iters {
                normalize_rows(c, hc, p.eps);
                normalize_cols(c, hc, p.eps);
            }
            let s = streams.row(r);
            let out = &mut collapsed.data[r * h..(r + 1) * h];
            for d in 0..h {
                let mut acc = 0f32;
                for k in 0..hc {
                    acc += pre[k] * s[k * h + d];
                }
                out[d] = acc;
            }
        }
        Ok(HcPre {
            post,
            comb,
            collapsed,
        })
    }

    fn hc_post(
        &self,
        streams: &HostTensor,
        out: &HostTensor,
        pre: &HcPre<HostTensor>,
        hc: usize,
    ) -> BResult<HostTensor> {
        let h = out.cols;
        shapes::check_hc_post(
            (streams.rows, streams.cols),
            (out.rows, out.cols),
            pre.post.data.len(),
            pre.comb.data.len(),
            hc,
        )?;
        let mut res = HostTensor::zeros(streams.rows, streams.cols);
        for r in 0..streams.rows {
            let s = streams.row(r);
            let o = out.row(r);
            let post = pre.post.row(r);
            let comb = pre.comb.row(r);
            for k in 0..hc {
                let dst = &mut res.data[r * hc * h + k * h..r * hc * h + (k + 1) * h];
                for d in 0..h {
                    let mut mixv = 0f32;
                    for j in 0..hc {
                        mixv += comb[j * hc + k] * s[j * h + d];
                    }
                    dst[d] = post[k] * o[d] + mixv;
                }
            }
        }
        Ok(res)
    }

    fn hc_head(
        &self,
        streams: &HostTensor,
        mix: &HostTensor,
        p: &HcParams<'_, HostTensor>,
    ) -> BResult<HostTensor> {
        let hc = p.hc;
        shapes::check_hc_head(
            (streams.rows, streams.cols),
            (mix.rows, mix.cols),
            p.base.data.len(),
            p.scale.data.len(),
            hc,
        )?;
        let h = streams.cols / hc;
        let mut out = HostTensor::zeros(streams.rows, h);
        for r in 0..streams.rows {
            let m = mix.row(r);
            let pre: Vec<f32> = (0..hc)
                .map(|k| sigmoid(m[k] * p.scale.data[0] + p.base.data[k]) + p.eps)
                .collect();
            let s = streams.row(r);
            for d in 0..h {
                let mut acc = 0f32;
                for k in 0..hc {
                    acc += pre[k] * s[k * h + d];
                }
                out.data[r * h + d] = acc;
            }
        }
        Ok(out)
    }

    fn compress(
        &self,
        kv: &mut CpuKv,
        layout: &KvLayout,
        layer: usize,
        proj_kv: &HostTensor,
        proj_gate: &HostTensor,
        p: &CompressorParams<'_, HostTensor>,
        plan: &BatchPlan,
    ) -> BResult<()> {
        cpu_attention::compress(kv, layout, layer, proj_kv, proj_gate, p, plan)
    }

    fn compress_ring(
        &self,
        kv: &mut CpuKv,
        layout: &KvLayout,
        layer: usize,
        part: CompressorPart,
        proj_kv: &HostTensor,
        proj_gate: &HostTensor,
        plan: &BatchPlan,
    ) -> BResult<()> {
        cpu_attention::compress_ring(kv, layout, layer, part, proj_kv, proj_gate, plan)
    }

    fn index_select(
        &self,
        kv: &CpuKv,
        layout: &KvLayout,
        layer: usize,
        q: &HostTensor,
        weights: &HostTensor,
        n_heads: usize,
        topk: usize,
        plan: &BatchPlan,
        record: Option<&PickLog>,
    ) -> BResult<Vec<Vec<u32>>> {
        cpu_attention::index_select(kv, layout, layer, q, weights, n_heads, topk, plan, record)
    }

    fn attention(
        &self,
        kv: &CpuKv,
        layout: &KvLayout,
        layer: usize,
        q: &HostTensor,
        kv_new: &HostTensor,
        sinks: &HostTensor,
        n_heads: usize,
        compressed: CompressedKeys<'_, Vec<Vec<u32>>>,
        head_rope: HeadRope<'_>,
        plan: &BatchPlan,
    ) -> BResult<HostTensor> {
        let (hd, rope) = (layout.head_dim, head_rope.rope);
        let mut q = self.rms_norm(q, None, hd, head_rope.q_norm_eps)?;
        self.rope(&mut q, hd, rope, &plan.positions, false)?;
        let mut o = cpu_attention::attention(
            kv, layout, layer, &q, kv_new, sinks, n_heads, compressed, plan,
        )?;
        self.rope(&mut o, hd, rope, &plan.positions, true)?;
        Ok(o)
    }

    fn window_store(
        &self,
        kv: &mut CpuKv,
        layout: &KvLayout,
        layer: usize,
        kv_new: &HostTensor,
        plan: &BatchPlan,
    ) -> BResult<()> {
        cpu_attention::window_store(kv, layout, layer, kv_new, plan)
    }

    fn act_quant(&self, x: &HostTensor, block: usize) -> BResult<HostTensor> {
        let mut out = x.clone();
        out.data
            .par_chunks_mut(x.cols.max(1))
            .for_each(|row| act_quant(row, block));
        Ok(out)
    }

    fn moe(&self, x: &HostTensor, p: &MoeParams<'_, HostTensor>) -> BResult<HostTensor> {
        let (n, h) = (x.rows, x.cols);
        let (e, k, inter) = (p.n_experts, p.top_k, p.intermediate);
        if p.router.rows != e || p.gate_up.rows != e * 2 * inter || p.down.rows != e * h {
            return Err(shape_err(
                "moe",
                format!(
                    "router {} experts, gate_up rows {}",
                    p.router.rows, p.gate_up.rows
                ),
            ));
        }
        let logits = self.matmul(x, p.router)?;
        let mut scores = logits.data.clone();
        for row in scores.chunks_mut(e) {
            match p.scoring {
                ScoringFunc::SqrtSoftplus => row.iter_mut().for_each(|v| *v = softplus(*v).sqrt()),
                ScoringFunc::Sigmoid => row.iter_mut().for_each(|v| *v = sigmoid(*v)),
                ScoringFunc::Softmax => softmax(row),
            }
        }
        // (expert, weight) per row.
        let mut picks: Vec<Vec<(usize, f32)>> = Vec::with_capacity(n);
        let mut recorded = Vec::new();
        for r in 0..n {
            let s = &scores[r * e..(r + 1) * e];
            let ids: Vec<usize> = match p.hash_experts {
                Some(hash) => hash[r * k..(r + 1) * k]
                    .iter()
                    .map(|&i| i as usize)
                    .collect(),
                None => {
                    let bias = p.correction_bias.map(|b| b.data.as_slice());
                    let mut order: Vec<usize> = (0..e).collect();
                    let key = |i: usize| s[i] + bias.map_or(0.0, |b| b[i]);
                    order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
                    order.truncate(k);
                    if p.record.is_some() {
                        recorded.push(RowPicks::new(
                            order.iter().map(|&i| i as u32).collect(),
                            Some((0..e).map(key).collect()),
                        ));
                    }
                    order
                }
            };
            if let Some(&bad) = ids.iter().find(|&&i| i >= e) {
                return Err(shape_err("moe", format!("expert id {bad} >= {e}")));
            }
            let sum: f32 = ids.iter().map(|&i| s[i]).sum::<f32>() + 1e-20;
            picks.push(
                ids.iter()
                    .map(|&i| (i, s[i] / sum * p.routed_scaling))
                    .collect(),
            );
        }
        if let (Some(rec), false) = (p.record, recorded.is_empty()) {
            rec.log.push(Picks {
                layer: rec.layer,
                kind: PickKind::Route,
                rows: recorded,
            });
        }
        let mut out = HostTensor::zeros(n, h);
        let mut act = Vec::new();
        let xr = self.act_quant_if(p.act_quant_routed, x)?;
        for ex in 0..e {
            let rows: Vec<(usize, f32)> = picks
                .iter()
                .enumerate()
                .flat_map(|(r, pk)| {
                    pk.iter()
                        .filter(|(i, _)| *i == ex)
                        .map(move |(_, w)| (r, *w))
                })
                .collect();
            if rows.is_empty() {
                continue;
            }
            let xs: Vec<f32> = rows
                .iter()
                .flat_map(|(r, _)| xr.row(*r).iter().copied())
                .collect();
            let gu = &p.gate_up.data[ex * 2 * inter * h..(ex + 1) * 2 * inter * h];
            let y = self.mm(&xs, rows.len(), h, gu, 2 * inter);
            act.resize(rows.len() * inter, 0.0);
            for i in 0..rows.len() {
                let yr = y.row(i);
                Self::swiglu(
                    &yr[..inter],
                    &yr[inter..],
                    p.swiglu_limit,
                    &mut act[i * inter..(i + 1) * inter],
                );
                if p.act_quant_routed {
                    let a = &mut act[i * inter..(i + 1) * inter];
                    a.iter_mut().for_each(|v| *v *= rows[i].1);
                    act_quant(a, ACT_BLOCK);
                }
            }
            let dw = &p.down.data[ex * h * inter..(ex + 1) * h * inter];
            let d = self.mm(&act, rows.len(), inter, dw, h);
            for (i, (r, w)) in rows.iter().enumerate() {
                let w = if p.act_quant_routed { 1.0 } else { *w };
                for (o, v) in out.data[r * h..(r + 1) * h].iter_mut().zip(d.row(i)) {
                    *o += v * w;
                }
            }
        }
        let xs = self.act_quant_if(p.act_quant_shared, x)?;
        let g = self.matmul(&xs, p.shared_gate)?;
        let u = self.matmul(&xs, p.shared_up)?;
        let si = p.shared_gate.rows;
        let mut sact = HostTensor::zeros(n, si);
        for r in 0..n {
            Self::swiglu(
                g.row(r),
                u.row(r),
                p.swiglu_limit,
                &mut sact.data[r * si..(r + 1) * si],
            );
        }
        if p.act_quant_shared {
            sact = self.act_quant(&sact, ACT_BLOCK)?;
        }
        let shared = self.matmul(&sact, p.shared_down)?;
        for (o, s) in out.data.iter_mut().zip(&shared.data) {
            *o += s;
        }
        Ok(out)
    }
}

fn normalize_rows(c: &mut [f32], hc: usize, eps: f32) {
    for row in c.chunks_mut(hc) {
        let s: f32 = row.iter().sum::<f32>() + eps;
        row.iter_mut().for_each(|v| *v /= s);
    }
}

fn normalize_cols(c: &mut [f32], hc: usize, eps: f32) {
    for j in 0..hc {
        let s: f32 = (0..hc).map(|i| c[i * hc + j]).sum::<f32>() + eps;
        for i in 0..hc {
            c[i * hc + j] /= s;
        }
    }
}
