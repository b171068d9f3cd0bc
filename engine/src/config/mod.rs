//! Model configuration: `config.json` with `model_type: deepseek_v4`, parsed as
//! transformers 5.17 `DeepseekV4Config` does (legacy keys folded in).

use std::path::Path;

use serde_json::{Map, Value};

mod error;
mod fields;
mod quant;
mod rope;
mod schedule;
mod validate;

pub use error::ConfigError;
pub use quant::{
    ActivationScheme, ExpertDtype, Fp8Format, QuantMethod, Quantization, ScaleFormat, FP4_GROUP,
    WEIGHT_BLOCK,
};
pub use rope::{RopeParams, RopeScaling};
pub use schedule::{LayerKind, MlpKind};

use error::{field_err, Res};
use fields::{kind_of, Obj};
use rope::{parse_rope, rope_dim_of};
use schedule::{parse_compress_rates, parse_layer_types, parse_mlp_layer_types};

/// Router scoring function (`scoring_func`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ScoringFunc {
    SqrtSoftplus,
    Softmax,
    Sigmoid,
}

/// Effective DeepSeek-V4 configuration.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub head_dim: usize,
    /// Trailing rope channels of each head: `int(head_dim * partial_rotary_factor)`.
    pub qk_rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub num_experts_per_tok: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub scoring_func: ScoringFunc,
    pub routed_scaling_factor: f32,
    pub max_position_embeddings: usize,
    pub rope_main: RopeParams,
    pub rope_compress: RopeParams,
    pub layer_types: Vec<LayerKind>,
    pub mlp_layer_types: Vec<MlpKind>,
    /// Compression rate of CSA layers (`compress_rates.compressed_sparse_attention`).
    pub compress_rate_csa: usize,
    /// Compression rate of HCA layers (`compress_rates.heavily_compressed_attention`).
    pub compress_rate_hca: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub swiglu_limit: f32,
    pub sliding_window: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub rms_norm_eps: f32,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub tie_word_embeddings: bool,
    /// `quantization_config` + `expert_dtype`: `None` for a float (f32/bf16/f16) checkpoint.
    pub quantization: Option<Quantization>,
}

impl ModelConfig {
    /// Parse the text of a `config.json`.
    pub fn from_json_str(s: &str) -> Result<Self, ConfigError> {
        Self::parse(s, "config JSON")
    }

    /// Read and parse a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Read and parse `dir/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        Self::from_file(&dir.join("config.json"))
    }

    /// Compression rate of a layer kind; `None` for sliding-only layers.
    pub fn compress_rate(&self, kind: LayerKind) -> Option<usize> {
        match kind {
            LayerKind::Sliding => None,
            LayerKind::Csa => Some(self.compress_rate_csa),
            LayerKind::Hca => Some(self.compress_rate_hca),
        }
    }

    /// Rope family of a layer kind: sliding layers use "main", CSA/HCA layers (and their
    /// compressor / indexer) use "compress".
    pub fn rope_for(&self, kind: LayerKind) -> &RopeParams {
        match kind {
            LayerKind::Sliding => &self.rope_main,
            LayerKind::Csa | LayerKind::Hca => &self.rope_compress,
        }
    }

    fn parse(text: &str, origin: &str) -> Res<Self> {
        let value: Value = serde_json::from_str(text).map_err(|source| ConfigError::Json {
            origin: origin.to_string(),
            source,
        })?;
        let Value::Object(map) = value else {
            return Err(field_err(
                "<root>",
                format!("expected a JSON object, got {}", kind_of(&value)),
            ));
        };
        Self::from_map(&map)
    }

    fn from_map(map: &Map<String, Value>) -> Res<Self> {
        let f = Obj { map, prefix: "" };
        match f.get("model_type") {
            Some(Value::String(t)) if t == "deepseek_v4" => {}
            Some(v) => {
                return Err(field_err(
                    "model_type",
                    format!("must be \"deepseek_v4\", got {v}"),
                ))
            }
            None => return Err(field_err("model_type", "missing; must be \"deepseek_v4\"")),
        }
        let n = f.usize_or("num_hidden_layers", 43)?;
        let head_dim = f.usize_or("head_dim", 512)?;
        let max_pos = f.usize_or("max_position_embeddings", 1_048_576)?;

        // `partial_rotary_factor` = explicit > legacy `qk_rope_head_dim / head_dim` > 64 / 512.
        let (prf, prf_field) = match f.opt_f64("partial_rotary_factor")? {
            Some(p) => (p, "partial_rotary_factor"),
            None => match f.opt_usize("qk_rope_head_dim")? {
                Some(q) => (q as f64 / head_dim as f64, "qk_rope_head_dim"),
                None => (64.0 / 512.0, "partial_rotary_factor"),
            },
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(field_err(
                "head_dim",
                format!("must be even and > 0, got {head_dim}"),
            ));
        }
        let qk_rope_head_dim = rope_dim_of(head_dim, prf, prf_field)?;
        if qk_rope_head_dim == 0 || qk_rope_head_dim % 2 != 0 || qk_rope_head_dim > head_dim {
            return Err(field_err(
                prf_field,
                format!("rope dim int(head_dim * partial_rotary_factor) = {qk_rope_head_dim} must be even, > 0 and <= head_dim ({head_dim})"),
            ));
        }

        let layer_types = parse_layer_types(&f, n)?;
        let mlp_layer_types = parse_mlp_layer_types(&f, n)?;
        let (compress_rate_csa, compress_rate_hca) = parse_compress_rates(&f, &layer_types)?;
        let (rope_main, rope_compress) = parse_rope(&f, max_pos, head_dim, qk_rope_head_dim)?;

        let scoring_func = match f.str_or("scoring_func", "sqrtsoftplus")? {
            "sqrtsoftplus" => ScoringFunc::SqrtSoftplus,
            "softmax" => ScoringFunc::Softmax,
            "sigmoid" => ScoringFunc::Sigmoid,
            other => {
                return Err(field_err(
                    "scoring_func",
                    format!("unknown scoring function \"{other}\" (expected sqrtsoftplus, softmax or sigmoid)"),
                ))
            }
        };
        let bos_token_id = match f.get("bos_token_id") {
            None => Some(0),
            Some(Value::Null) => None,
            Some(v) => Some(token_id(v, "bos_token_id")?),
        };
        let eos_token_ids = match f.get("eos_token_id") {
            None => vec![1],
            Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| token_id(v, &format!("eos_token_id[{i}]")))
                .collect::<Res<_>>()?,
            Some(v) => vec![token_id(v, "eos_token_id")?],
        };

        let cfg = ModelConfig {
            vocab_size: f.usize_or("vocab_size", 129_280)?,
            hidden_size: f.usize_or("hidden_size", 4096)?,
            moe_intermediate_size: f.usize_or("moe_intermediate_size", 2048)?,
            num_hidden_layers: n,
            num_attention_heads: f.usize_or("num_attention_heads", 64)?,
            head_dim,
            qk_rope_head_dim,
            q_lora_rank: f.usize_or("q_lora_rank", 1024)?,
            num_experts_per_tok: f.usize_or("num_experts_per_tok", 6)?,
            n_routed_experts: f.usize_or("n_routed_experts", 256)?,
            n_shared_experts: f.usize_or("n_shared_experts", 1)?,
            scoring_func,
            routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.5)? as f32,
            max_position_embeddings: max_pos,
            rope_main,
            rope_compress,
            layer_types,
            mlp_layer_types,
            compress_rate_csa,
            compress_rate_hca,
            hc_mult: f.usize_or("hc_mult", 4)?,
            hc_sinkhorn_iters: f.usize_or("hc_sinkhorn_iters", 20)?,
            hc_eps: f.f64_or("hc_eps", 1.0e-6)? as f32,
            swiglu_limit: f.f64_or("swiglu_limit", 10.0)? as f32,
            sliding_window: f.usize_or("sliding_window", 128)?,
            o_groups: f.usize_or("o_groups", 8)?,
            o_lora_rank: f.usize_or("o_lora_rank", 1024)?,
            index_n_heads: f.usize_or("index_n_heads", 64)?,
            index_head_dim: f.usize_or("index_head_dim", 128)?,
            index_topk: f.usize_or("index_topk", 512)?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1.0e-6)? as f32,
            bos_token_id,
            eos_token_ids,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            quantization: quant::parse_quantization(&f)?,
        };
        cfg.checked(&f)
    }
}

fn token_id(v: &Value, field: &str) -> Res<u32> {
    let id = v.as_u64().and_then(|x| u32::try_from(x).ok());
    id.ok_or_else(|| {
        field_err(
            field,
            format!("expected a token id (integer in 0..2^32), got {v}"),
        )
    })
}
