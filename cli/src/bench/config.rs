//! The synthetic benchmark model: DeepSeek-V4-Flash's per-layer dimensions with a chosen
//! number of layers and experts, as a transformers `config.json` (parsed by the engine's
//! own [`ModelConfig`] parser, and given as-is to `scripts/peer_bench.py`).

use crate::engine_spec::{layout_spec, numerics};
use anyhow::{bail, Context, Result};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::KvLayout;
use serde_json::{json, Value};

/// Flags that describe the synthetic model and where it runs.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelFlags {
    /// Compute device: `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Decoder layers, in V4-Flash's order: 2 sliding-window layers, then CSA and HCA
    /// alternating; the first 3 use hash routing, the rest top-k routing. 4 covers every
    /// kind (sliding, sliding, CSA, HCA; hash x3, top-k).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Routed experts per layer (V4-Flash has 256; top-k stays 6). Each expert is 48 MiB
    /// of bf16 weights, so 64 experts x 4 layers is 12.9 GB.
    #[arg(long, default_value_t = 64)]
    pub experts: usize,
    /// A tiny model with the same structure (hidden 64, 4 heads of 32, vocab 97,
    /// window 8, compress rates 4/16) for CPU runs and tests, instead of V4-Flash's widths.
    #[arg(long)]
    pub tiny: bool,
    /// Seed of the random weights, KV contents and tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype of compressed-KV and sliding-window entries: f32, bf16 or fp8
    /// (FlashMLA's V4 entry: e4m3 non-rope values with one ue8m0 scale per 64, bf16 rope).
    #[arg(long, default_value = "bf16")]
    pub kv_dtype: String,
    /// Storage dtype of the indexer's index-K entries: f32, bf16 or fp8 (e4m3 + one f32 scale per entry).
    #[arg(long, default_value = "bf16")]
    pub index_k_dtype: String,
    /// Numerics: transformers (f32 activations) or deepseek (DeepSeek's reference
    /// quantization: FP8 activations before the FP8/FP4 linears, which then run on FP8
    /// tensor cores in a prefill; needs --kv-dtype fp8). `pdserve gpu-check --only
    /// deepseek` holds its GPU kernels to the CPU.
    #[arg(long, default_value = "transformers", value_parser = ["transformers", "deepseek"])]
    pub numerics: String,
    /// Weight storage on a CUDA device: bf16 (router and hyper-connection maps stay fp32)
    /// or f32.
    #[arg(long, default_value = "bf16")]
    pub cuda_weights: String,
    /// Format of the synthetic weights, as DeepSeek's checkpoints store them: bf16;
    /// fp8 (attention, shared-expert and routed-expert matrices block-scaled FP8, as the
    /// base checkpoints); fp8-fp4 (routed experts FP4, as the instruct checkpoints). The
    /// CUDA backend keeps FP8/FP4 weights as stored, and the decode floor counts the
    /// stored bytes. `bench decode` and `bench prefill` take a comma-separated list (one
    /// model load per format, each row labelled with its format); `bench config` takes one.
    #[arg(long, value_delimiter = ',', default_value = "bf16", value_parser = ["bf16", "fp8", "fp8-fp4"])]
    pub weights: Vec<String>,
    /// Batch-invariant CUDA kernels (`--deterministic`): measures what the mode costs.
    #[arg(long)]
    pub deterministic: bool,
    /// CUDA attention kernel: auto (tensor cores for bf16 and fp8 KV entries: wgmma on
    /// Hopper at head_dim 512, else mma.sync; the split-key kernel for f32), mma-sync (the
    /// mma.sync kernel wherever auto takes wgmma: what wgmma replaced) or split (the
    /// split-key kernel for every entry type; what the tensor cores replaced). The last two
    /// for A/B runs.
    #[arg(long, default_value = "auto", value_parser = ["auto", "mma-sync", "split"])]
    pub attention: String,
    /// CUDA routed-expert kernels of decode steps: auto (tensor cores for stored FP8/FP4
    /// experts at every batch, for bf16 past 2 rows),
    /// tensor-cores (wherever the shape allows), or cuda-cores (what the tensor-core kernels
    /// replaced: padded-batch cuBLAS GEMMs for bf16, CUDA-core grouped kernels, and the bf16
    /// copy + cuBLAS for dense FP8/FP4 GEMMs of 17-128 rows).
    #[arg(long, default_value = "auto", value_parser = ["auto", "tensor-cores", "cuda-cores"])]
    pub expert_kernel: String,
    /// CUDA dense GEMMs of decode-sized batches (up to 128 rows): auto (stored FP8/FP4
    /// weights on the tensor-core kernel that streams them, bf16 weights on cuBLAS),
    /// tensor-cores (bf16 weights too), or fused (stored weights of up to 16 rows on the
    /// fused CUDA-core kernel: what the tensor-core kernel replaced there).
    #[arg(long, default_value = "auto", value_parser = ["auto", "tensor-cores", "fused"])]
    pub dense_kernel: String,
    /// CUDA streams a prefill's per-expert GEMMs (block-scaled FP8 under `--numerics
    /// deepseek`, bf16 otherwise) spread over, so that experts too small to fill the GPU
    /// alone run at once; 1 queues them one after another on the device's stream (the A/B
    /// of that choice).
    #[arg(long, default_value_t = pdserve_kernels::DEFAULT_LANES, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=16), usize::from))]
    pub expert_lanes: usize,
    /// Launch the CUDA kernels plainly, without programmatic dependent launch (by default
    /// on sm_90+, each kernel may be scheduled while the previous one finishes and waits
    /// for it before touching memory): the A/B of that launch mode.
    #[arg(long)]
    pub no_pdl: bool,
    /// CUDA indexer scores of a prefill: auto (tensor cores for bf16 index-K under bf16
    /// weights, the causally invisible entries skipped) or gemm (every head's dot
    /// products as one cuBLAS GEMM, then a reduce pass: what the tensor-core kernel
    /// replaced, for A/B runs).
    #[arg(long, default_value = "auto", value_parser = ["auto", "gemm"])]
    pub indexer: String,
}

/// Attention kind of layer `i` in V4-Flash (`compress_ratios` 0, 0, 4, 128, 4, 128, ...).
pub fn flash_layer_type(i: usize) -> &'static str {
    match i {
        0 | 1 => "sliding_attention",
        _ if i.is_multiple_of(2) => "compressed_sparse_attention",
        _ => "heavily_compressed_attention",
    }
}

/// MoE routing of layer `i` in V4-Flash (`num_hash_layers` 3).
pub fn flash_mlp_type(i: usize) -> &'static str {
    if i < 3 {
        "hash_moe"
    } else {
        "moe"
    }
}

impl ModelFlags {
    /// The one weights format of a command that loads one model.
    pub fn format(&self) -> Result<&str> {
        match self.weights.as_slice() {
            [one] => Ok(one),
            [] => bail!("--weights needs a format"),
            many => bail!(
                "--weights lists {} formats ({}); this command loads one model: name one",
                many.len(),
                many.join(",")
            ),
        }
    }

    /// One flag set per `--weights` format, in the order given: `bench decode|prefill`
    /// load one model per format.
    pub fn per_format(&self) -> Result<Vec<ModelFlags>> {
        if self.weights.is_empty() {
            bail!("--weights needs a format");
        }
        for (i, w) in self.weights.iter().enumerate() {
            if self.weights[..i].contains(w) {
                bail!("--weights names {w} twice");
            }
        }
        Ok(self
            .weights
            .iter()
            .map(|w| ModelFlags {
                weights: vec![w.clone()],
                ..self.clone()
            })
            .collect())
    }

    /// The config as transformers' `DeepseekV4Config` keys.
    pub fn config_json(&self) -> Result<Value> {
        if self.layers == 0 {
            bail!("--layers must be at least 1");
        }
        let layer_types: Vec<&str> = (0..self.layers).map(flash_layer_type).collect();
        let mlp_types: Vec<&str> = (0..self.layers).map(flash_mlp_type).collect();
        let mut v = if self.tiny {
            json!({
                "vocab_size": 97, "hidden_size": 64, "moe_intermediate_size": 16,
                "num_attention_heads": 4, "head_dim": 32, "partial_rotary_factor": 0.25,
                "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
                "index_n_heads": 16, "index_head_dim": 16, "index_topk": 4,
                "num_experts_per_tok": 2, "sliding_window": 8,
                "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                "max_position_embeddings": 4096,
            })
        } else {
            json!({
                "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
                "num_attention_heads": 64, "head_dim": 512, "partial_rotary_factor": 0.125,
                "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
                "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
                "num_experts_per_tok": 6, "sliding_window": 128,
                "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                "max_position_embeddings": 1048576,
                "rope_parameters": {"rope_type": "yarn", "factor": 16.0,
                    "original_max_position_embeddings": 65536, "beta_fast": 32.0, "beta_slow": 1.0},
            })
        };
        let top_k = v["num_experts_per_tok"].as_u64().unwrap_or(0) as usize;
        if self.experts < top_k {
            bail!(
                "--experts {} is fewer than the {top_k} experts each token is routed to",
                self.experts
            );
        }
        let common = json!({
            "model_type": "deepseek_v4",
            "num_hidden_layers": self.layers,
            "layer_types": layer_types,
            "mlp_layer_types": mlp_types,
            "n_routed_experts": self.experts,
            "n_shared_experts": 1,
            "num_key_value_heads": 1,
            "scoring_func": "sqrtsoftplus",
            "routed_scaling_factor": 1.5,
            "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
            "swiglu_limit": 10.0,
            "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 0, "eos_token_id": 1,
            "tie_word_embeddings": false,
        });
        if let (Some(dst), Some(src)) = (v.as_object_mut(), common.as_object()) {
            for (k, val) in src {
                dst.insert(k.clone(), val.clone());
            }
        }
        if let Some(experts) = match self.format()? {
            "fp8" => Some("fp8"),
            "fp8-fp4" => Some("fp4"),
            _ => None,
        } {
            v["quantization_config"] = json!({
                "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128], "activation_scheme": "dynamic",
            });
            v["expert_dtype"] = json!(experts);
        }
        Ok(v)
    }

    pub fn config(&self) -> Result<ModelConfig> {
        let text = self.config_json()?.to_string();
        ModelConfig::from_json_str(&text).context("synthetic bench config")
    }

    pub fn layout(&self, cfg: &ModelConfig) -> Result<KvLayout> {
        let mut spec = layout_spec(cfg, &self.index_k_dtype, &self.kv_dtype, None)?;
        spec.numerics = numerics(&self.numerics)?;
        KvLayout::new(cfg, spec).context("KV layout")
    }
}

/// `--config` subcommand flags.
#[derive(clap::Args, Debug)]
pub struct ConfigArgs {
    #[command(flatten)]
    pub model: ModelFlags,
    /// Write the config.json here instead of stdout.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

pub fn print_config(a: ConfigArgs) -> Result<()> {
    let text = serde_json::to_string_pretty(&a.model.config_json()?)?;
    a.model.config()?;
    match a.out {
        Some(p) => {
            // A new model folder: `--out DIR/config.json` makes DIR.
            if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::write(&p, text + "\n").with_context(|| format!("writing {}", p.display()))
        }
        None => {
            println!("{text}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::bench::config::*;
    use pdserve_engine::config::{LayerKind, MlpKind};

    fn flags(layers: usize, experts: usize, tiny: bool) -> ModelFlags {
        ModelFlags {
            device: "cpu".into(),
            layers,
            experts,
            tiny,
            seed: 0,
            kv_dtype: "bf16".into(),
            index_k_dtype: "bf16".into(),
            numerics: "transformers".into(),
            cuda_weights: "bf16".into(),
            weights: vec!["bf16".into()],
            deterministic: false,
            attention: "auto".into(),
            expert_kernel: "auto".into(),
            dense_kernel: "auto".into(),
            expert_lanes: pdserve_kernels::DEFAULT_LANES,
            no_pdl: false,
            indexer: "auto".into(),
        }
    }

    #[test]
    fn flash_dims_and_layer_order() {
        let cfg = flags(6, 64, false).config().unwrap();
        assert_eq!(
            (
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.head_dim,
                cfg.qk_rope_head_dim
            ),
            (4096, 64, 512, 64)
        );
        assert_eq!(
            (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank),
            (1024, 8, 1024)
        );
        assert_eq!(
            (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk),
            (64, 128, 512)
        );
        assert_eq!((cfg.n_routed_experts, cfg.num_experts_per_tok), (64, 6));
        assert_eq!((cfg.moe_intermediate_size, cfg.vocab_size), (2048, 129_280));
        assert_eq!(
            (
                cfg.sliding_window,
                cfg.compress_rate_csa,
                cfg.compress_rate_hca
            ),
            (128, 4, 128)
        );
        use LayerKind::*;
        assert_eq!(cfg.layer_types, vec![Sliding, Sliding, Csa, Hca, Csa, Hca]);
        use MlpKind::*;
        assert_eq!(
            cfg.mlp_layer_types,
            vec![HashMoe, HashMoe, HashMoe, TopK, TopK, TopK]
        );
        // Last layer of the real 43 is CSA (compress_ratios[42] = 4).
        assert_eq!(flash_layer_type(42), "compressed_sparse_attention");
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(flags(0, 64, false).config().is_err());
        let e = flags(4, 5, false).config().unwrap_err().to_string();
        assert!(e.contains("--experts 5"), "{e}");
        assert!(flags(4, 2, true).config().is_ok());
    }

    #[test]
    fn a_weights_list_splits_into_one_model_per_format() {
        let mut f = flags(4, 64, false);
        f.weights = vec!["bf16".into(), "fp8-fp4".into()];
        let e = f.config().unwrap_err().to_string();
        assert!(e.contains("2 formats (bf16,fp8-fp4)"), "{e}");
        let each = f.per_format().unwrap();
        assert_eq!(each.len(), 2);
        assert_eq!(each[0].format().unwrap(), "bf16");
        assert_eq!(each[1].format().unwrap(), "fp8-fp4");
        assert!(each[0].config_json().unwrap().get("expert_dtype").is_none());
        assert_eq!(each[1].config_json().unwrap()["expert_dtype"], "fp4");
        assert_eq!((each[1].layers, each[1].experts), (4, 64));
        f.weights = vec!["fp8".into(), "fp8".into()];
        let e = f.per_format().unwrap_err().to_string();
        assert!(e.contains("fp8 twice"), "{e}");
    }
}
