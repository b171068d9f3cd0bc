//! Checks on a parsed config: every dimension positive and bounded, the cross-field
//! constraints the model needs, and the known keys with no [`ModelConfig`] field
//! (type-checked, refused where they would change the architecture).

use super::error::{ensure, Res};
use super::fields::Obj;
use super::ModelConfig;

/// Upper bound on any single dimension / count in the config.
const MAX_DIM: usize = 1 << 31;

impl ModelConfig {
    /// `self` parsed from the object `f`, once the rest of `f` and `self` pass the checks.
    pub(super) fn checked(self, f: &Obj) -> Res<Self> {
        check_other_fields(f)?;
        self.validate()?;
        Ok(self)
    }

    fn validate(&self) -> Res<()> {
        let dims = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("head_dim", self.head_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_routed_experts", self.n_routed_experts),
            ("max_position_embeddings", self.max_position_embeddings),
            ("hc_mult", self.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
            ("sliding_window", self.sliding_window),
            ("o_groups", self.o_groups),
            ("o_lora_rank", self.o_lora_rank),
            ("index_n_heads", self.index_n_heads),
            ("index_head_dim", self.index_head_dim),
            ("index_topk", self.index_topk),
            (
                "compress_rates.compressed_sparse_attention",
                self.compress_rate_csa,
            ),
            (
                "compress_rates.heavily_compressed_attention",
                self.compress_rate_hca,
            ),
        ];
        for (field, v) in dims {
            ensure(v > 0, field, || "must be > 0".into())?;
            // Keeps every product of two dimensions (tensor shapes, head widths) far from overflow.
            ensure(v <= MAX_DIM, field, || {
                format!("{v} is unreasonably large (limit {MAX_DIM})")
            })?;
        }
        let (rope, ihd) = (self.qk_rope_head_dim, self.index_head_dim);
        ensure(ihd >= rope, "index_head_dim", || {
            format!("must be >= qk_rope_head_dim ({rope}), got {ihd}")
        })?;
        let width = self.num_attention_heads * self.head_dim;
        // `checked_rem` rather than `is_multiple_of` (Rust 1.87) for the workspace MSRV 1.85.
        ensure(
            width.checked_rem(self.o_groups) == Some(0),
            "o_groups",
            || {
                format!(
                    "must divide num_attention_heads * head_dim = {width}, got {}",
                    self.o_groups
                )
            },
        )?;
        let (k, e) = (self.num_experts_per_tok, self.n_routed_experts);
        ensure(k <= e, "num_experts_per_tok", || {
            format!("must be <= n_routed_experts ({e}), got {k}")
        })?;
        let shared = self.n_shared_experts;
        ensure(shared == 1, "n_shared_experts", || {
            format!("must be 1 (the model has one shared MLP), got {shared}")
        })?;
        let floats = [
            ("routed_scaling_factor", self.routed_scaling_factor),
            ("hc_eps", self.hc_eps),
            ("swiglu_limit", self.swiglu_limit),
            ("rms_norm_eps", self.rms_norm_eps),
        ];
        for (field, v) in floats {
            ensure(v.is_finite() && v >= 0.0, field, || {
                format!("must be finite and >= 0, got {v}")
            })?;
        }
        Ok(())
    }
}

/// Known keys that do not map onto a [`ModelConfig`] field: type-checked, and rejected where the
/// value would change the architecture in a way the engine does not implement.
fn check_other_fields(f: &Obj) -> Res<()> {
    let kv_heads = f.usize_or("num_key_value_heads", 1)?;
    ensure(kv_heads == 1, "num_key_value_heads", || {
        format!("must be 1 (shared-KV MQA), got {kv_heads}")
    })?;
    let act = f.str_or("hidden_act", "silu")?;
    ensure(act == "silu", "hidden_act", || {
        format!("only \"silu\" is supported, got \"{act}\"")
    })?;
    let mlp_bias = f.bool_or("mlp_bias", false)?;
    ensure(!mlp_bias, "mlp_bias", || {
        "biased shared-expert projections are not supported".into()
    })?;
    for key in [
        "norm_topk_prob",
        "attention_bias",
        "use_cache",
        "output_router_logits",
    ] {
        f.bool_or(key, false)?;
    }
    f.usize_or("num_nextn_predict_layers", 0)?;
    f.opt_usize("pad_token_id")?;
    for key in [
        "initializer_range",
        "attention_dropout",
        "router_aux_loss_coef",
        "router_jitter_noise",
    ] {
        f.f64_or(key, 0.0)?;
    }
    Ok(())
}
