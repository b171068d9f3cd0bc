//! The DeepSeek-V4 forward pass, written once against [`Backend`].

mod quantized_linears;
pub mod random_weights;
pub mod storage;
pub mod weights;

use crate::backend::{
    BResult, Backend, BackendError, BatchPlan, CompressedKeys, CompressorParams, CompressorPart,
    HcParams, HcPre, HeadRope, HostTensor, MoeParams, PickLog, RouteRecord,
};
use crate::config::{LayerKind, MlpKind, ModelConfig};
use crate::kv::KvLayout;
use crate::numerics::Numerics;
use crate::rope::Rope;
use quantized_linears::QuantizedLinears;
use std::sync::Arc;
use weights::{CompressorWeights, HcWeights, LayerWeights};
pub use weights::{LoadError, ModelWeights, TensorSource};

pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub weights: ModelWeights<B>,
    rope_main: Rope,
    rope_compress: Rope,
    /// Per layer, which linears take FP8 inputs under `deepseek` numerics.
    quantized: Vec<QuantizedLinears>,
    /// Where the forward records its routing and indexer picks ([`crate::backend::picks`]);
    /// `None` in serving.
    picks: Option<Arc<PickLog>>,
}

impl<B: Backend> Model<B> {
    pub fn new(cfg: ModelConfig, weights: ModelWeights<B>) -> Self {
        let rope_main = Rope::new(&cfg.rope_main, cfg.qk_rope_head_dim);
        let rope_compress = Rope::new(&cfg.rope_compress, cfg.qk_rope_head_dim);
        let quantized = (0..cfg.layer_types.len())
            .map(|li| QuantizedLinears::of(&cfg, li))
            .collect();
        Model {
            cfg,
            weights,
            rope_main,
            rope_compress,
            quantized,
            picks: None,
        }
    }

    /// Record every forward's picks into `log` from now on (`None`: stop).
    pub fn record_picks(&mut self, log: Option<Arc<PickLog>>) {
        self.picks = log;
    }

    pub fn records_picks(&self) -> bool {
        self.picks.is_some()
    }

    /// `x @ w^T`, its input first FP8-quantized per 128 when `deepseek` numerics run this
    /// linear as DeepSeek's reference does (an FP8/FP4-stored weight, `stored_quantized`).
    fn linear(
        &self,
        b: &B,
        layout: &KvLayout,
        x: &B::Tensor,
        w: &B::Tensor,
        stored_quantized: bool,
    ) -> BResult<B::Tensor> {
        if stored_quantized && layout.numerics == Numerics::Deepseek {
            b.quantized_matmul(x, w)
        } else {
            b.matmul(x, w)
        }
    }

    /// [`Model::linear`] of one input and several weights (each with its
    /// `stored_quantized`): where `deepseek` numerics quantize the input for every one of
    /// them, quantized once.
    fn linears(
        &self,
        b: &B,
        layout: &KvLayout,
        x: &B::Tensor,
        ws: &[(&B::Tensor, bool)],
    ) -> BResult<Vec<B::Tensor>> {
        if layout.numerics == Numerics::Deepseek && ws.iter().all(|&(_, q)| q) {
            let ws: Vec<&B::Tensor> = ws.iter().map(|&(w, _)| w).collect();
            return b.quantized_matmuls(x, &ws);
        }
        ws.iter()
            .map(|&(w, q)| self.linear(b, layout, x, w, q))
            .collect()
    }

    fn hc_params<'a>(&self, w: &'a HcWeights<B>) -> HcParams<'a, B::Tensor> {
        HcParams {
            base: &w.base,
            scale: &w.scale,
            hc: self.cfg.hc_mult,
            sinkhorn_iters: self.cfg.hc_sinkhorn_iters,
            eps: self.cfg.hc_eps,
        }
    }

    /// Mix logits of the hyper-connection mapping: `rmsnorm(streams) @ fn^T`.
    fn hc_mix(&self, b: &B, streams: &B::Tensor, fn_: &B::Tensor) -> BResult<B::Tensor> {
        b.rms_norm_matmul(streams, fn_, self.cfg.rms_norm_eps)
    }

    fn hc_pre(&self, b: &B, streams: &B::Tensor, w: &HcWeights<B>) -> BResult<HcPre<B::Tensor>> {
        b.hc_pre_mixed(streams, &w.fn_, self.cfg.rms_norm_eps, &self.hc_params(w))
    }

    /// Run one ragged batch. Returns the logits of the rows in `logit_rows`, in that order.
    pub fn forward(
        &self,
        b: &B,
        kv: &mut B::KvStore,
        layout: &KvLayout,
        plan: &BatchPlan,
        logit_rows: &[usize],
    ) -> BResult<HostTensor> {
        b.to_host(&self.forward_device(b, kv, layout, plan, logit_rows)?)
    }

    /// [`Model::forward`] leaving the logits on the device.
    pub fn forward_device(
        &self,
        b: &B,
        kv: &mut B::KvStore,
        layout: &KvLayout,
        plan: &BatchPlan,
        logit_rows: &[usize],
    ) -> BResult<B::Tensor> {
        let cfg = &self.cfg;
        let w = &self.weights;
        let mut x = b.embed(&w.embed_tokens, &plan.tokens, cfg.hc_mult)?;
        for (li, lw) in w.layers.iter().enumerate() {
            let pre = self.hc_pre(b, &x, &lw.attn_hc)?;
            let h = b.rms_norm(
                &pre.collapsed,
                Some(&lw.input_layernorm),
                cfg.hidden_size,
                cfg.rms_norm_eps,
            )?;
            let attn = self.attention(b, kv, layout, li, lw, &h, plan)?;
            x = b.hc_post(&x, &attn, &pre, cfg.hc_mult)?;

            let pre = self.hc_pre(b, &x, &lw.ffn_hc)?;
            let h = b.rms_norm(
                &pre.collapsed,
                Some(&lw.post_attention_layernorm),
                cfg.hidden_size,
                cfg.rms_norm_eps,
            )?;
            let mlp = self.moe(b, layout, li, lw, &h, plan)?;
            x = b.hc_post(&x, &mlp, &pre, cfg.hc_mult)?;
        }
        let x = b.gather_rows(&x, logit_rows)?;
        let mix = self.hc_mix(b, &x, &w.hc_head.fn_)?;
        let y = b.hc_head(&x, &mix, &self.hc_params(&w.hc_head))?;
        let y = b.rms_norm(&y, Some(&w.norm), cfg.hidden_size, cfg.rms_norm_eps)?;
        b.matmul(&y, w.lm_head())
    }

    fn compressor_params<'a>(
        &'a self,
        part: CompressorPart,
        cw: &'a CompressorWeights<B>,
    ) -> CompressorParams<'a, B::Tensor> {
        CompressorParams {
            part,
            position_bias: &cw.position_bias,
            norm_weight: &cw.kv_norm,
            eps: self.cfg.rms_norm_eps,
            rope: &self.rope_compress,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        b: &B,
        kv: &mut B::KvStore,
        layout: &KvLayout,
        li: usize,
        part: CompressorPart,
        cw: &CompressorWeights<B>,
        h: &B::Tensor,
        plan: &BatchPlan,
    ) -> BResult<()> {
        let pk = b.matmul(h, &cw.kv_proj)?;
        let pg = b.matmul(h, &cw.gate_proj)?;
        b.compress(
            kv,
            layout,
            li,
            &pk,
            &pg,
            &self.compressor_params(part, cw),
            plan,
        )?;
        if let Some(cuts) = &plan.cuts {
            b.compress_ring(kv, layout, li, part, &pk, &pg, cuts)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        b: &B,
        kv: &mut B::KvStore,
        layout: &KvLayout,
        li: usize,
        lw: &LayerWeights<B>,
        h: &B::Tensor,
        plan: &BatchPlan,
    ) -> BResult<B::Tensor> {
        let cfg = &self.cfg;
        let (hd, eps) = (cfg.head_dim, cfg.rms_norm_eps);
        let rope = if lw.kind == LayerKind::Sliding {
            &self.rope_main
        } else {
            &self.rope_compress
        };
        let quant = self.quantized[li];
        // q_a and kv read the same input (quantized once under `deepseek`).
        let [q_a, kv_proj]: [B::Tensor; 2] = self
            .linears(
                b,
                layout,
                h,
                &[(&lw.q_a_proj, quant.q_a), (&lw.kv_proj, quant.kv)],
            )?
            .try_into()
            .map_err(|_| BackendError::Device("q_a and kv: not two outputs".into()))?;
        let q_res = b.rms_norm(&q_a, Some(&lw.q_a_norm), cfg.q_lora_rank, eps)?;
        let q_b = self.linear(b, layout, &q_res, &lw.q_b_proj, quant.q_b)?;
        let mut kv_new = b.rms_norm(&kv_proj, Some(&lw.kv_norm), hd, eps)?;
        b.rope(&mut kv_new, hd, rope, &plan.positions, false)?;

        if let Some(cw) = &lw.compressor {
            self.compress(b, kv, layout, li, CompressorPart::Main, cw, h, plan)?;
        }
        let selection = match &lw.indexer {
            Some(iw) => {
                self.compress(
                    b,
                    kv,
                    layout,
                    li,
                    CompressorPart::Index,
                    &iw.compressor,
                    h,
                    plan,
                )?;
                let mut qi = self.linear(b, layout, &q_res, &iw.q_b_proj, quant.index_q_b)?;
                b.rope(
                    &mut qi,
                    cfg.index_head_dim,
                    &self.rope_compress,
                    &plan.positions,
                    false,
                )?;
                let wi = b.matmul(h, &iw.weights_proj)?;
                Some(b.index_select(
                    kv,
                    layout,
                    li,
                    &qi,
                    &wi,
                    cfg.index_n_heads,
                    cfg.index_topk,
                    plan,
                    self.picks.as_deref(),
                )?)
            }
            None => None,
        };
        let keys = match (lw.kind, &selection) {
            (LayerKind::Sliding, _) => CompressedKeys::None,
            (LayerKind::Hca, _) => CompressedKeys::AllVisible,
            (LayerKind::Csa, Some(sel)) => CompressedKeys::Selected(sel),
            (LayerKind::Csa, None) => CompressedKeys::None,
        };
        // The query heads normed and roped inside; K = V carries rope, so the output's rope
        // slice comes back rotated back at the query position.
        let head_rope = HeadRope {
            rope,
            q_norm_eps: eps,
        };
        let o = b.attention(
            kv,
            layout,
            li,
            &q_b,
            &kv_new,
            &lw.sinks,
            cfg.num_attention_heads,
            keys,
            head_rope,
            plan,
        )?;
        b.window_store(kv, layout, li, &kv_new, plan)?;
        if let Some(cuts) = &plan.cuts {
            b.window_store(kv, layout, li, &kv_new, cuts)?;
        }
        let g = b.grouped_matmul(&o, &lw.o_a_proj, cfg.o_groups)?;
        self.linear(b, layout, &g, &lw.o_b_proj, quant.o_b)
    }

    fn moe(
        &self,
        b: &B,
        layout: &KvLayout,
        li: usize,
        lw: &LayerWeights<B>,
        h: &B::Tensor,
        plan: &BatchPlan,
    ) -> BResult<B::Tensor> {
        let cfg = &self.cfg;
        let k = cfg.num_experts_per_tok;
        let deepseek = layout.numerics == Numerics::Deepseek;
        let hash: Option<Vec<u32>> = match (lw.mlp_kind, &lw.tid2eid) {
            (MlpKind::HashMoe, Some(table)) => Some(
                plan.tokens
                    .iter()
                    .flat_map(|&t| table[t as usize * k..(t as usize + 1) * k].iter().copied())
                    .collect(),
            ),
            _ => None,
        };
        b.moe(
            h,
            &MoeParams {
                router: &lw.router,
                correction_bias: lw.correction_bias.as_ref(),
                hash_experts: hash.as_deref(),
                gate_up: &lw.gate_up,
                down: &lw.down,
                shared_gate: &lw.shared_gate,
                shared_up: &lw.shared_up,
                shared_down: &lw.shared_down,
                n_experts: cfg.n_routed_experts,
                top_k: k,
                intermediate: cfg.moe_intermediate_size,
                scoring: cfg.scoring_func,
                routed_scaling: cfg.routed_scaling_factor,
                swiglu_limit: cfg.swiglu_limit,
                act_quant_routed: deepseek && self.quantized[li].routed,
                act_quant_shared: deepseek && self.quantized[li].shared,
                record: self
                    .picks
                    .as_deref()
                    .map(|log| RouteRecord { log, layer: li }),
            },
        )
    }
}
