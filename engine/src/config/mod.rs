//! Model configuration: `config.json` with `model_type: deepseek_v4`, parsed as
//! transformers 5.17 `DeepseekV4Config` does (legacy keys folded in).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

mod quant;

pub use quant::{
    ActivationScheme, ExpertDtype, Fp8Format, QuantMethod, Quantization, ScaleFormat, FP4_GROUP,
    WEIGHT_BLOCK,
};

/// Attention flavour of one decoder layer (`layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum LayerKind {
    /// `sliding_attention`: sliding window only, "main" rope.
    Sliding,
    /// `compressed_sparse_attention`: window + overlapped compressed entries picked by the indexer.
    Csa,
    /// `heavily_compressed_attention`: window + non-overlapping compressed entries, no indexer.
    Hca,
}

/// MoE routing flavour of one decoder layer (`mlp_layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum MlpKind {
    /// `hash_moe`: experts chosen by `tid2eid[input_id]`.
    HashMoe,
    /// `moe`: top-k over scores + `e_score_correction_bias`.
    TopK,
}

/// Router scoring function (`scoring_func`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ScoringFunc {
    SqrtSoftplus,
    Softmax,
    Sigmoid,
}

/// Rope frequency scaling of one rope family.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum RopeScaling {
    Default,
    /// YaRN with every derived value resolved. `attention_factor` is 1.0 for the compress rope of a
    /// flat (legacy `rope_scaling`) config when unset, as `DeepseekV4Config.__post_init__` injects;
    /// otherwise an unset value is derived from `factor` / `mscale` / `mscale_all_dim` like
    /// `_compute_yarn_parameters`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
    },
}

/// One rope family (`rope_parameters.main` or `rope_parameters.compress`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RopeParams {
    pub theta: f64,
    pub scaling: RopeScaling,
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

/// Why a `config.json` could not be turned into a [`ModelConfig`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin} is not valid JSON: {source}")]
    Json {
        origin: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("config field `{field}`: {reason}")]
    Field { field: String, reason: String },
}

fn field_err(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.into(),
        reason: reason.into(),
    }
}

/// `Err(Field)` with a lazily built reason unless `ok`.
fn ensure(ok: bool, field: &str, reason: impl FnOnce() -> String) -> Res<()> {
    if ok {
        Ok(())
    } else {
        Err(field_err(field, reason()))
    }
}

type Res<T> = Result<T, ConfigError>;

const CSA: &str = "compressed_sparse_attention";
const HCA: &str = "heavily_compressed_attention";
/// Upper bound on any single dimension / count in the config.
const MAX_DIM: usize = 1 << 31;

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
        check_other_fields(&f)?;
        cfg.validate()?;
        Ok(cfg)
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

/// `int(head_dim * partial_rotary_factor)` as Python computes it.
fn rope_dim_of(head_dim: usize, prf: f64, field: &str) -> Res<usize> {
    let d = head_dim as f64 * prf;
    if !d.is_finite() || d < 0.0 {
        return Err(field_err(
            field,
            format!("gives an invalid rope dimension {d}"),
        ));
    }
    Ok(d.trunc() as usize)
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

/// Convert every entry of a JSON list, naming `field[i]` in errors.
fn entries<T>(
    items: &[Value],
    field: &str,
    expected: &str,
    conv: impl Fn(&Value) -> Option<T>,
) -> Res<Vec<T>> {
    let conv_one = |(i, v): (usize, &Value)| {
        conv(v).ok_or_else(|| {
            field_err(
                format!("{field}[{i}]"),
                format!("must be {expected}; got {v}"),
            )
        })
    };
    items.iter().enumerate().map(conv_one).collect()
}

/// Python truncates the schedules to `num_hidden_layers`, then requires exactly that many entries.
fn exact_len<T>(mut v: Vec<T>, n: usize, field: &str) -> Res<Vec<T>> {
    v.truncate(n);
    let len = v.len();
    ensure(len == n, field, || {
        format!("has {len} entries, num_hidden_layers is {n}")
    })?;
    Ok(v)
}

fn parse_layer_types(f: &Obj, n: usize) -> Res<Vec<LayerKind>> {
    if let Some(items) = f.opt_array("layer_types")? {
        // Entries past `num_hidden_layers` are dropped before validation, as in Python.
        let kinds = entries(
            &items[..items.len().min(n)],
            "layer_types",
            "a DeepSeek-V4 layer type",
            |v| match v.as_str()? {
                "sliding_attention" => Some(LayerKind::Sliding),
                CSA => Some(LayerKind::Csa),
                HCA => Some(LayerKind::Hca),
                _ => None,
            },
        )?;
        return exact_len(kinds, n, "layer_types");
    }
    if let Some(items) = f.opt_array("compress_ratios")? {
        // Legacy per-layer ratios: every entry is mapped (Python maps before truncating).
        let kinds = entries(items, "compress_ratios", "0, 4 or 128", |v| {
            match v.as_u64()? {
                0 => Some(LayerKind::Sliding),
                4 => Some(LayerKind::Csa),
                128 => Some(LayerKind::Hca),
                _ => None,
            }
        })?;
        return exact_len(kinds, n, "compress_ratios");
    }
    // V4-Pro default: 2x HCA bootstrap, then `CSA if i % 2 else HCA` over the interleave.
    let mut kinds = vec![LayerKind::Hca; n.min(2)];
    kinds.extend((0..n.saturating_sub(2)).map(|i| {
        if i % 2 == 1 {
            LayerKind::Csa
        } else {
            LayerKind::Hca
        }
    }));
    Ok(kinds)
}

fn parse_mlp_layer_types(f: &Obj, n: usize) -> Res<Vec<MlpKind>> {
    if let Some(items) = f.opt_array("mlp_layer_types")? {
        let kinds = entries(
            &items[..items.len().min(n)],
            "mlp_layer_types",
            "hash_moe or moe",
            |v| match v.as_str()? {
                "hash_moe" => Some(MlpKind::HashMoe),
                "moe" => Some(MlpKind::TopK),
                _ => None,
            },
        )?;
        return exact_len(kinds, n, "mlp_layer_types");
    }
    let n_hash = f.opt_usize("num_hash_layers")?.unwrap_or(3);
    Ok((0..n)
        .map(|i| {
            if i < n_hash {
                MlpKind::HashMoe
            } else {
                MlpKind::TopK
            }
        })
        .collect())
}

fn parse_compress_rates(f: &Obj, kinds: &[LayerKind]) -> Res<(usize, usize)> {
    let mut rates = [
        (CSA, LayerKind::Csa, 4usize),
        (HCA, LayerKind::Hca, 128usize),
    ];
    if let Some(dict) = f.opt_object("compress_rates")? {
        let sub = Obj {
            map: dict,
            prefix: "compress_rates",
        };
        for (key, kind, rate) in rates.iter_mut() {
            match sub.opt_usize(key)? {
                Some(r) => *rate = r,
                // transformers replaces the default dict wholesale and would fail with a KeyError
                // when a layer of this kind is built; without such a layer the value is unused.
                None if kinds.contains(kind) => {
                    return Err(field_err(
                        sub.name(key),
                        "missing, but layers of this type exist",
                    ))
                }
                None => {}
            }
        }
    }
    if let Some(r) = f.opt_usize("compress_rate_csa")? {
        rates[0].2 = r;
    }
    if let Some(r) = f.opt_usize("compress_rate_hca")? {
        rates[1].2 = r;
    }
    Ok((rates[0].2, rates[1].2))
}

/// Returns `(main, compress)`.
fn parse_rope(
    f: &Obj,
    max_pos: usize,
    head_dim: usize,
    rope_dim: usize,
) -> Res<(RopeParams, RopeParams)> {
    let rope_theta = f.f64_or("rope_theta", 10_000.0)?;
    let compress_rope_theta = f.f64_or("compress_rope_theta", 160_000.0)?;
    // `convert_rope_params_to_dict`: `rope_scaling or rope_parameters` (an empty dict is falsy).
    let (dict, name) = match f.opt_object("rope_scaling")? {
        Some(d) if !d.is_empty() => (Some(d), "rope_scaling"),
        _ => (f.opt_object("rope_parameters")?, "rope_parameters"),
    };
    let empty = Map::new();
    let dict = dict.unwrap_or(&empty);
    if !dict.contains_key("main") && !dict.contains_key("compress") {
        // Flat form: main = plain rope at `rope_theta`; compress = the flat dict at
        // `compress_rope_theta` with `attention_factor` defaulting to 1.0 for yarn.
        check_theta(rope_theta, "rope_theta")?;
        let main = RopeParams {
            theta: rope_theta,
            scaling: RopeScaling::Default,
        };
        let sub = Obj {
            map: dict,
            prefix: name,
        };
        // The flat dict's own `rope_theta` (if any) is overwritten by `compress_rope_theta`.
        check_theta(compress_rope_theta, "compress_rope_theta")?;
        let compress = rope_family(&sub, compress_rope_theta, max_pos, true)?;
        return Ok((main, compress));
    }
    let family = |label: &str| -> Res<RopeParams> {
        let field = format!("{name}.{label}");
        let Some(Value::Object(m)) = dict.get(label) else {
            return Err(field_err(
                field,
                "nested rope parameters need both `main` and `compress` objects",
            ));
        };
        let sub = Obj {
            map: m,
            prefix: &field,
        };
        // Nested families default their theta to the top-level `rope_theta` (standardize_rope_params).
        let theta = sub.f64_or("rope_theta", rope_theta)?;
        let theta_field = if sub.get("rope_theta").is_some() {
            sub.name("rope_theta")
        } else {
            "rope_theta".into()
        };
        check_theta(theta, &theta_field)?;
        // A per-family `partial_rotary_factor` sets that family's rope width in transformers; the
        // engine has one `qk_rope_head_dim`, so the families must agree with it.
        if let Some(p) = sub.opt_f64("partial_rotary_factor")? {
            let prf_field = sub.name("partial_rotary_factor");
            let d = rope_dim_of(head_dim, p, &prf_field)?;
            ensure(d == rope_dim, &prf_field, || {
                format!("gives rope dim {d}, but qk_rope_head_dim is {rope_dim}")
            })?;
        }
        rope_family(&sub, theta, max_pos, false)
    };
    Ok((family("main")?, family("compress")?))
}

/// One rope family dict. `theta` is already resolved; `flat_compress` applies the
/// `attention_factor = 1.0` default that `__post_init__` injects only in the flat form.
fn rope_family(sub: &Obj, theta: f64, max_pos: usize, flat_compress: bool) -> Res<RopeParams> {
    // standardize_rope_params: `setdefault("rope_type", get("type", "default"))`.
    let (type_key, type_value) = match sub.get("rope_type") {
        Some(v) => ("rope_type", Some(v)),
        None => ("type", sub.get("type")),
    };
    let rope_type = match type_value {
        None => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(sub.wrong(type_key, "a rope type string", other)),
    };
    match rope_type {
        "default" => Ok(RopeParams {
            theta,
            scaling: RopeScaling::Default,
        }),
        "yarn" => {
            let orig = sub
                .opt_f64("original_max_position_embeddings")?
                .unwrap_or(max_pos as f64);
            let orig_field = sub.name("original_max_position_embeddings");
            ensure(orig.is_finite() && orig > 0.0, &orig_field, || {
                format!("must be > 0, got {orig}")
            })?;
            let factor = match sub.get("factor") {
                None => return Err(field_err(sub.name("factor"), "required for yarn rope")),
                Some(Value::Null) => max_pos as f64 / orig,
                Some(_) => sub.f64_or("factor", 1.0)?,
            };
            ensure(
                factor.is_finite() && factor > 0.0,
                &sub.name("factor"),
                || format!("must be > 0, got {factor}"),
            )?;
            let attention_factor = match sub.opt_f64("attention_factor")? {
                Some(a) => a,
                None if flat_compress && sub.get("attention_factor").is_none() => 1.0,
                None => {
                    let mscale = sub.opt_f64("mscale")?.unwrap_or(0.0);
                    let mscale_all_dim = sub.opt_f64("mscale_all_dim")?.unwrap_or(0.0);
                    if mscale != 0.0 && mscale_all_dim != 0.0 {
                        get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                    } else {
                        get_mscale(factor, 1.0)
                    }
                }
            };
            // `rope_parameters.get("beta_fast") or 32`: missing, null and 0 all mean the default.
            let or_default = |key: &str, d: f64| -> Res<f64> {
                Ok(sub.opt_f64(key)?.filter(|v| *v != 0.0).unwrap_or(d))
            };
            Ok(RopeParams {
                theta,
                scaling: RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: orig,
                    beta_fast: or_default("beta_fast", 32.0)?,
                    beta_slow: or_default("beta_slow", 1.0)?,
                    attention_factor,
                },
            })
        }
        other => Err(field_err(
            sub.name("rope_type"),
            format!("unsupported rope type \"{other}\" (expected \"default\" or \"yarn\")"),
        )),
    }
}

fn check_theta(theta: f64, field: &str) -> Res<()> {
    ensure(theta.is_finite() && theta > 1.0, field, || {
        format!("rope base must be > 1, got {theta}")
    })
}

/// `get_mscale` of `_compute_yarn_parameters`.
fn get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeParams {
    /// Inverse frequencies (one per rotated pair, `ceil(rope_dim / 2)` entries) computed with the
    /// same float32 steps as transformers: `compute_default_rope_parameters` /
    /// `_compute_yarn_parameters`. `rope_dim` should be even (true of `qk_rope_head_dim`).
    pub fn inv_freq(&self, rope_dim: usize) -> Vec<f32> {
        let dim_f = rope_dim as f32;
        let base = self.theta as f32;
        // torch: `base ** (arange(0, dim, 2).float() / dim)`, every step in float32.
        let pos_freqs: Vec<f32> = (0..rope_dim)
            .step_by(2)
            .map(|i| base.powf(i as f32 / dim_f))
            .collect();
        match &self.scaling {
            RopeScaling::Default => pos_freqs.iter().map(|p| 1.0f32 / p).collect(),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                ..
            } => {
                // transformers reads `truncate` from `config.rope_parameters` — the NESTED
                // {main, compress} dict for V4 — so a per-family `truncate` is never seen and the
                // correction range is always truncated.
                let truncate = true;
                let (low, high) = find_correction_range(
                    *beta_fast,
                    *beta_slow,
                    rope_dim,
                    self.theta,
                    *original_max_position_embeddings,
                    truncate,
                );
                // linear_ramp_factor(low, high, dim // 2): Python scalars, cast to f32 by torch.
                let max = if low == high { high + 0.001 } else { high };
                let min_f = low as f32;
                let span = (max - low) as f32;
                let factor_f = *factor as f32;
                pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(k, &p)| {
                        let ramp = ((k as f32 - min_f) / span).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0f32 - ramp;
                        let extrapolation = 1.0f32 / p;
                        let interpolation = 1.0f32 / (factor_f * p);
                        interpolation * (1.0f32 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect()
            }
        }
    }

    /// Factor applied to cos and sin: 1.0 for default rope, YaRN's `attention_factor` otherwise.
    pub fn attention_scaling(&self) -> f64 {
        match &self.scaling {
            RopeScaling::Default => 1.0,
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
        }
    }
}

/// `find_correction_range` of `_compute_yarn_parameters` (Python float math).
fn find_correction_range(
    low_rot: f64,
    high_rot: f64,
    dim: usize,
    base: f64,
    max_pos: f64,
    truncate: bool,
) -> (f64, f64) {
    let correction_dim = |rot: f64| {
        (dim as f64 * (max_pos / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(low_rot), correction_dim(high_rot));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed access to one JSON object; errors carry the dotted field path.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Obj<'a> {
    fn name(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    fn wrong(&self, key: &str, expected: &str, v: &Value) -> ConfigError {
        field_err(
            self.name(key),
            format!("expected {expected}, got {} ({v})", kind_of(v)),
        )
    }

    /// Missing or null -> `None`; otherwise `conv` must accept the value.
    fn opt<T>(
        &self,
        key: &str,
        expected: &str,
        conv: impl Fn(&'a Value) -> Option<T>,
    ) -> Res<Option<T>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => conv(v)
                .map(Some)
                .ok_or_else(|| self.wrong(key, expected, v)),
        }
    }

    /// Missing -> `default`; null is a type error (the Python field is not optional).
    fn req<T>(
        &self,
        key: &str,
        default: T,
        expected: &str,
        conv: impl Fn(&'a Value) -> Option<T>,
    ) -> Res<T> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => conv(v).ok_or_else(|| self.wrong(key, expected, v)),
        }
    }

    fn opt_usize(&self, key: &str) -> Res<Option<usize>> {
        self.opt(key, "a non-negative integer", as_usize)
    }

    fn usize_or(&self, key: &str, default: usize) -> Res<usize> {
        self.req(key, default, "a non-negative integer", as_usize)
    }

    fn opt_f64(&self, key: &str) -> Res<Option<f64>> {
        self.opt(key, "a number", Value::as_f64)
    }

    fn f64_or(&self, key: &str, default: f64) -> Res<f64> {
        self.req(key, default, "a number", Value::as_f64)
    }

    fn bool_or(&self, key: &str, default: bool) -> Res<bool> {
        self.req(key, default, "a boolean", Value::as_bool)
    }

    fn str_or(&self, key: &str, default: &'static str) -> Res<&'a str> {
        self.req(key, default, "a string", Value::as_str)
    }

    fn opt_array(&self, key: &str) -> Res<Option<&'a Vec<Value>>> {
        self.opt(key, "an array", Value::as_array)
    }

    fn opt_object(&self, key: &str) -> Res<Option<&'a Map<String, Value>>> {
        self.opt(key, "an object", Value::as_object)
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|x| usize::try_from(x).ok())
}
