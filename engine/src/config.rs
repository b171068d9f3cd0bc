//! Model configuration: `config.json` with `model_type: deepseek_v4`, parsed as
//! transformers 5.17 `DeepseekV4Config` does (legacy keys folded in).

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
    /// YaRN; `attention_factor` is forced to 1.0 for the compress rope by transformers when unset.
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
}
