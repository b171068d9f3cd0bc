#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::{
    ConfigError, LayerKind, MlpKind, ModelConfig, RopeParams, RopeScaling, ScoringFunc,
};
use serde_json::{json, Value};

/// Parse `extra` merged over `{"model_type": "deepseek_v4"}`.
fn parse(extra: Value) -> Result<ModelConfig, ConfigError> {
    let mut obj = json!({ "model_type": "deepseek_v4" });
    for (k, v) in extra.as_object().unwrap() {
        obj[k] = v.clone();
    }
    ModelConfig::from_json_str(&obj.to_string())
}

fn parse_ok(extra: Value) -> ModelConfig {
    parse(extra).unwrap()
}

/// The error message must name `field`.
fn assert_err(extra: Value, field: &str) {
    let err = parse(extra.clone()).expect_err(&format!("{extra} should be rejected"));
    let msg = err.to_string();
    assert!(
        msg.contains(field),
        "error for {extra} should name `{field}`: {msg}"
    );
    if let ConfigError::Field { field: f, .. } = &err {
        assert!(f.contains(field), "field {f} vs {field}");
    }
}

fn yarn(p: &RopeParams) -> (f64, f64, f64, f64, f64) {
    match p.scaling {
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
        } => (
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
        ),
        RopeScaling::Default => panic!("expected yarn, got {p:?}"),
    }
}

#[test]
fn defaults_are_v4_flash() {
    let c = parse_ok(json!({}));
    assert_eq!(c.vocab_size, 129_280);
    assert_eq!(c.hidden_size, 4096);
    assert_eq!(c.moe_intermediate_size, 2048);
    assert_eq!(c.num_hidden_layers, 43);
    assert_eq!(c.num_attention_heads, 64);
    assert_eq!(c.head_dim, 512);
    assert_eq!(c.qk_rope_head_dim, 64);
    assert_eq!(c.q_lora_rank, 1024);
    assert_eq!(c.num_experts_per_tok, 6);
    assert_eq!(c.n_routed_experts, 256);
    assert_eq!(c.n_shared_experts, 1);
    assert_eq!(c.scoring_func, ScoringFunc::SqrtSoftplus);
    assert_eq!(c.routed_scaling_factor, 1.5);
    assert_eq!(c.max_position_embeddings, 1_048_576);
    assert_eq!(
        c.rope_main,
        RopeParams {
            theta: 10_000.0,
            scaling: RopeScaling::Default
        }
    );
    assert_eq!(
        c.rope_compress,
        RopeParams {
            theta: 160_000.0,
            scaling: RopeScaling::Default
        }
    );
    assert_eq!((c.compress_rate_csa, c.compress_rate_hca), (4, 128));
    assert_eq!((c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps), (4, 20, 1.0e-6));
    assert_eq!(c.swiglu_limit, 10.0);
    assert_eq!(c.sliding_window, 128);
    assert_eq!((c.o_groups, c.o_lora_rank), (8, 1024));
    assert_eq!(
        (c.index_n_heads, c.index_head_dim, c.index_topk),
        (64, 128, 512)
    );
    assert_eq!(c.rms_norm_eps, 1.0e-6);
    assert_eq!(c.bos_token_id, Some(0));
    assert_eq!(c.eos_token_ids, vec![1]);
    assert!(!c.tie_word_embeddings);

    // 2x HCA, then `CSA if i % 2 else HCA` over the remaining 41 layers.
    assert_eq!(c.layer_types.len(), 43);
    assert_eq!(
        &c.layer_types[..6],
        &[
            LayerKind::Hca,
            LayerKind::Hca,
            LayerKind::Hca,
            LayerKind::Csa,
            LayerKind::Hca,
            LayerKind::Csa
        ]
    );
    assert_eq!(
        c.layer_types
            .iter()
            .filter(|k| **k == LayerKind::Csa)
            .count(),
        20
    );
    assert_eq!(c.layer_types[42], LayerKind::Hca);
    assert_eq!(
        &c.mlp_layer_types[..4],
        &[
            MlpKind::HashMoe,
            MlpKind::HashMoe,
            MlpKind::HashMoe,
            MlpKind::TopK
        ]
    );
    assert_eq!(
        c.mlp_layer_types
            .iter()
            .filter(|k| **k == MlpKind::HashMoe)
            .count(),
        3
    );

    assert_eq!(c.compress_rate(LayerKind::Sliding), None);
    assert_eq!(c.compress_rate(LayerKind::Csa), Some(4));
    assert_eq!(c.compress_rate(LayerKind::Hca), Some(128));
    assert_eq!(c.rope_for(LayerKind::Sliding).theta, 10_000.0);
    assert_eq!(c.rope_for(LayerKind::Csa).theta, 160_000.0);
    assert_eq!(c.rope_for(LayerKind::Hca).theta, 160_000.0);
}

#[test]
fn default_layer_types_small_counts() {
    let kinds = |n: usize| parse_ok(json!({ "num_hidden_layers": n })).layer_types;
    assert_eq!(kinds(1), vec![LayerKind::Hca]);
    assert_eq!(kinds(2), vec![LayerKind::Hca; 2]);
    assert_eq!(
        kinds(4),
        vec![
            LayerKind::Hca,
            LayerKind::Hca,
            LayerKind::Hca,
            LayerKind::Csa
        ]
    );
    assert_eq!(
        parse_ok(json!({ "num_hidden_layers": 2 })).mlp_layer_types,
        vec![MlpKind::HashMoe; 2]
    );
}

#[test]
fn legacy_keys_fold_in() {
    let c = parse_ok(json!({
        "num_hidden_layers": 4,
        // one extra entry (the MTP layer in upstream configs) is truncated away
        "compress_ratios": [0, 4, 128, 4, 128],
        "compress_rate_csa": 8,
        "compress_rate_hca": 64,
        "num_hash_layers": 1,
        "qk_rope_head_dim": 128,
        "rope_theta": 20000,
        "compress_rope_theta": 150000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
            "beta_fast": 32, "beta_slow": 1, "rope_theta": 1.0
        },
        "eos_token_id": [1, 7],
        "bos_token_id": null,
    }));
    assert_eq!(
        c.layer_types,
        vec![
            LayerKind::Sliding,
            LayerKind::Csa,
            LayerKind::Hca,
            LayerKind::Csa
        ]
    );
    assert_eq!((c.compress_rate_csa, c.compress_rate_hca), (8, 64));
    assert_eq!(
        c.mlp_layer_types,
        vec![
            MlpKind::HashMoe,
            MlpKind::TopK,
            MlpKind::TopK,
            MlpKind::TopK
        ]
    );
    assert_eq!(c.qk_rope_head_dim, 128);
    assert_eq!(
        c.rope_main,
        RopeParams {
            theta: 20_000.0,
            scaling: RopeScaling::Default
        }
    );
    // flat form: compress takes `compress_rope_theta`; yarn `attention_factor` defaults to 1.0
    assert_eq!(c.rope_compress.theta, 150_000.0);
    assert_eq!(yarn(&c.rope_compress), (16.0, 65536.0, 32.0, 1.0, 1.0));
    assert_eq!(c.eos_token_ids, vec![1, 7]);
    assert_eq!(c.bos_token_id, None);

    // explicit fields win over legacy ones
    let c = parse_ok(json!({
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "compress_ratios": [4, 4],
        "mlp_layer_types": ["moe", "hash_moe"],
        "num_hash_layers": 2,
        "partial_rotary_factor": 0.25,
        "qk_rope_head_dim": 64,
        "compress_rates": { "compressed_sparse_attention": 16, "heavily_compressed_attention": 32 },
    }));
    assert_eq!(c.layer_types, vec![LayerKind::Sliding; 2]);
    assert_eq!(c.mlp_layer_types, vec![MlpKind::TopK, MlpKind::HashMoe]);
    assert_eq!(c.qk_rope_head_dim, 128);
    assert_eq!((c.compress_rate_csa, c.compress_rate_hca), (16, 32));

    // legacy scalar rates override the dict
    let c = parse_ok(json!({
        "compress_rates": { "compressed_sparse_attention": 16, "heavily_compressed_attention": 32 },
        "compress_rate_hca": 256,
    }));
    assert_eq!((c.compress_rate_csa, c.compress_rate_hca), (16, 256));
    assert_eq!(
        parse_ok(json!({ "eos_token_id": 5 })).eos_token_ids,
        vec![5]
    );
    assert!(parse_ok(json!({ "eos_token_id": null }))
        .eos_token_ids
        .is_empty());
}

#[test]
fn flat_rope_variants() {
    // rope_scaling wins over rope_parameters; an empty rope_scaling is ignored
    let c = parse_ok(json!({
        "rope_scaling": { "rope_type": "yarn", "factor": 4.0 },
        "rope_parameters": { "rope_type": "yarn", "factor": 8.0 },
    }));
    // original_max_position_embeddings defaults to max_position_embeddings
    assert_eq!(yarn(&c.rope_compress), (4.0, 1_048_576.0, 32.0, 1.0, 1.0));
    let c = parse_ok(
        json!({ "rope_scaling": {}, "rope_parameters": { "rope_type": "yarn", "factor": 8.0, "attention_factor": 0.5 } }),
    );
    assert_eq!(yarn(&c.rope_compress).0, 8.0);
    assert_eq!(c.rope_compress.attention_scaling(), 0.5);
    // an explicit null attention_factor is kept by setdefault and then derived
    let c = parse_ok(
        json!({ "rope_parameters": { "rope_type": "yarn", "factor": 16, "attention_factor": null } }),
    );
    assert_eq!(c.rope_compress.attention_scaling(), 1.277_258_872_223_978_2);
    // null factor: max_position_embeddings / original_max_position_embeddings
    let c = parse_ok(json!({ "max_position_embeddings": 8192,
        "rope_parameters": { "rope_type": "yarn", "factor": null, "original_max_position_embeddings": 2048 } }));
    assert_eq!(yarn(&c.rope_compress).0, 4.0);
    // default-typed flat dict: compress is plain rope at compress_rope_theta
    let c = parse_ok(json!({ "rope_parameters": { "rope_type": "default", "factor": 3.0 } }));
    assert_eq!(
        c.rope_compress,
        RopeParams {
            theta: 160_000.0,
            scaling: RopeScaling::Default
        }
    );
}

#[test]
fn nested_rope() {
    let c = parse_ok(json!({
        "rope_theta": 12345.0,
        "rope_parameters": {
            "main": { "rope_type": "default" },
            "compress": { "type": "yarn", "rope_theta": 160000, "factor": 16,
                          "original_max_position_embeddings": 65536, "beta_fast": 0, "beta_slow": null,
                          "partial_rotary_factor": 0.125 },
            "rope_theta": 1.0,
        },
    }));
    // nested families default their theta to the top-level rope_theta
    assert_eq!(
        c.rope_main,
        RopeParams {
            theta: 12345.0,
            scaling: RopeScaling::Default
        }
    );
    assert_eq!(c.rope_compress.theta, 160_000.0);
    // nested: attention_factor is NOT injected -> derived 0.1 ln(16) + 1; beta 0/null -> 32/1
    assert_eq!(
        yarn(&c.rope_compress),
        (16.0, 65536.0, 32.0, 1.0, 1.277_258_872_223_978_2)
    );

    let c = parse_ok(json!({ "rope_parameters": {
        "main": { "rope_type": "yarn", "rope_theta": 10000, "factor": 40, "mscale": 0.707, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096 },
        "compress": { "rope_type": "yarn", "rope_theta": 160000, "factor": 16, "attention_factor": 1.0,
                      "original_max_position_embeddings": 65536 },
    }}));
    let (_, _, _, _, af) = yarn(&c.rope_main);
    assert!((af - 0.921_042_355_316_339_9).abs() < 1e-15, "{af}");
    assert_eq!(c.rope_compress.attention_scaling(), 1.0);
    assert_eq!(c.rope_for(LayerKind::Sliding), &c.rope_main);
    assert_eq!(c.rope_for(LayerKind::Csa), &c.rope_compress);
}

fn assert_close_ulp(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ulps = (g.to_bits() as i64 - w.to_bits() as i64).abs();
        assert!(
            ulps <= 1,
            "inv_freq[{i}]: got {g:e}, want {w:e} ({ulps} ulp)"
        );
    }
}

/// Reference values (f32 bit patterns): `_compute_yarn_parameters` replayed in Python with every
/// tensor op rounded to float32 (struct pack/unpack), theta=160000, factor=16, original 65536,
/// beta 32/1, dim 64 (correction range (15, 25)).
const YARN64_BITS: [u32; 32] = [
    0x3f800000, 0x3f300a3a, 0x3ef21c1f, 0x3ea67d01, 0x3e64f92e, 0x3e1d7475, 0x3dd88cb4, 0x3d94e963,
    0x3d4ccccd, 0x3d0cd4fb, 0x3cc1b019, 0x3c8530ce, 0x3c372dbf, 0x3bfbed88, 0x3bad3d5e, 0x3b6e4237,
    0x3b147ae1, 0x3ab714e0, 0x3a5ebdb6, 0x3a0530ce, 0x399bb3af, 0x39305978, 0x38be904d, 0x383e9b5f,
    0x37a3d70c, 0x36b443d0, 0x3677eba6, 0x362a7be8, 0x35ea77ff, 0x35a13bdc, 0x355dbf30, 0x35187c4d,
];

/// `compute_default_rope_parameters`, theta=10000, dim 64, float32.
const DEFAULT64_BITS: [u32; 32] = [
    0x3f800000, 0x3f3ff911, 0x3f0ff59a, 0x3ed7e89b, 0x3ea1e89b, 0x3e72d423, 0x3e361887, 0x3e088d77,
    0x3dcccccd, 0x3d99940d, 0x3d6655c2, 0x3d2cba15, 0x3d0186e3, 0x3cc2434f, 0x3c91ad39, 0x3c5a7bf2,
    0x3c23d70a, 0x3bf5b9b0, 0x3bb8449c, 0x3b8a2e77, 0x3b4f3e38, 0x3b1b690d, 0x3ae91528, 0x3aaec98e,
    0x3a83126f, 0x3a44948c, 0x3a136a16, 0x39dd1725, 0x39a5cb60, 0x3978a815, 0x393a7753, 0x390bd472,
];

/// theta=10000, factor=4, original 64, beta 8/2, dim 8: correction range (0, 1), so pair 0
/// extrapolates and the rest interpolate (inv_freq / factor).
const YARN8_BITS: [u32; 4] = [0x3f800000, 0x3ccccccd, 0x3b23d70a, 0x3983126f];

fn from_bits(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|b| f32::from_bits(*b)).collect()
}

#[test]
fn inv_freq_matches_python() {
    let c = parse_ok(json!({ "rope_scaling": {
        "type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1 } }));
    assert_close_ulp(&c.rope_compress.inv_freq(64), &from_bits(&YARN64_BITS));
    assert_close_ulp(&c.rope_main.inv_freq(64), &from_bits(&DEFAULT64_BITS));
    assert_eq!(c.rope_main.attention_scaling(), 1.0);
    assert_eq!(c.rope_compress.attention_scaling(), 1.0);

    let p = RopeParams {
        theta: 10_000.0,
        scaling: RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64.0,
            beta_fast: 8.0,
            beta_slow: 2.0,
            attention_factor: 1.0,
        },
    };
    assert_close_ulp(&p.inv_freq(8), &from_bits(&YARN8_BITS));
}

#[test]
fn truncated_explicit_layer_types() {
    let c = parse_ok(json!({
        "num_hidden_layers": 2,
        "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "bogus"],
        "mlp_layer_types": ["moe", "moe", "moe"],
    }));
    assert_eq!(c.layer_types, vec![LayerKind::Hca, LayerKind::Csa]);
    assert_eq!(c.mlp_layer_types, vec![MlpKind::TopK; 2]);
}

#[test]
fn error_paths_name_their_field() {
    assert_err(json!({ "model_type": "llama" }), "model_type");
    let err = ModelConfig::from_json_str("{}").unwrap_err();
    assert!(err.to_string().contains("model_type"), "{err}");
    assert_err(json!({ "num_key_value_heads": 2 }), "num_key_value_heads");
    assert_err(json!({ "head_dim": 511 }), "head_dim");
    assert_err(json!({ "head_dim": 0 }), "head_dim");
    assert_err(
        json!({ "partial_rotary_factor": 0.127 }),
        "partial_rotary_factor",
    );
    assert_err(
        json!({ "partial_rotary_factor": 2.0 }),
        "partial_rotary_factor",
    );
    assert_err(json!({ "qk_rope_head_dim": 1024 }), "qk_rope_head_dim");
    assert_err(json!({ "qk_rope_head_dim": 63 }), "qk_rope_head_dim");
    assert_err(json!({ "o_groups": 3 }), "o_groups");
    assert_err(json!({ "index_head_dim": 32 }), "index_head_dim");
    assert_err(json!({ "num_experts_per_tok": 300 }), "num_experts_per_tok");
    assert_err(
        json!({ "compress_rates": { "compressed_sparse_attention": 0, "heavily_compressed_attention": 128 } }),
        "compress_rates.compressed_sparse_attention",
    );
    assert_err(
        json!({ "compress_rate_hca": 0 }),
        "compress_rates.heavily_compressed_attention",
    );
    assert_err(
        json!({ "compress_rates": { "compressed_sparse_attention": 4 } }),
        "compress_rates.heavily_compressed_attention",
    );
    assert_err(json!({ "sliding_window": 0 }), "sliding_window");
    assert_err(json!({ "n_shared_experts": 2 }), "n_shared_experts");
    assert_err(json!({ "hc_mult": 0 }), "hc_mult");
    assert_err(json!({ "scoring_func": "relu" }), "scoring_func");
    assert_err(json!({ "vocab_size": 0 }), "vocab_size");
    assert_err(
        json!({ "moe_intermediate_size": 0 }),
        "moe_intermediate_size",
    );
    assert_err(json!({ "hidden_act": "gelu" }), "hidden_act");
    assert_err(json!({ "mlp_bias": true }), "mlp_bias");
    assert_err(json!({ "rms_norm_eps": -1.0 }), "rms_norm_eps");
    // layer schedules
    assert_err(
        json!({ "num_hidden_layers": 3, "layer_types": ["sliding_attention"] }),
        "layer_types",
    );
    assert_err(
        json!({ "num_hidden_layers": 1, "layer_types": ["full_attention"] }),
        "layer_types[0]",
    );
    assert_err(
        json!({ "num_hidden_layers": 3, "compress_ratios": [0, 4] }),
        "compress_ratios",
    );
    assert_err(
        json!({ "num_hidden_layers": 2, "compress_ratios": [0, 2] }),
        "compress_ratios[1]",
    );
    assert_err(
        json!({ "num_hidden_layers": 3, "mlp_layer_types": ["moe"] }),
        "mlp_layer_types",
    );
    assert_err(
        json!({ "num_hidden_layers": 1, "mlp_layer_types": ["dense"] }),
        "mlp_layer_types[0]",
    );
    // rope
    assert_err(
        json!({ "rope_parameters": { "rope_type": "linear", "factor": 2.0 } }),
        "rope_parameters.rope_type",
    );
    assert_err(
        json!({ "rope_scaling": { "type": "dynamic", "factor": 2.0 } }),
        "rope_scaling.rope_type",
    );
    assert_err(
        json!({ "rope_parameters": { "rope_type": "yarn" } }),
        "rope_parameters.factor",
    );
    assert_err(
        json!({ "rope_parameters": { "rope_type": "yarn", "factor": 0 } }),
        "rope_parameters.factor",
    );
    assert_err(
        json!({ "rope_parameters": { "rope_type": null } }),
        "rope_parameters.rope_type",
    );
    assert_err(
        json!({ "rope_parameters": { "main": { "rope_type": "default" } } }),
        "rope_parameters.compress",
    );
    assert_err(
        json!({ "rope_parameters": { "main": { "rope_type": "longrope" }, "compress": {} } }),
        "rope_parameters.main.rope_type",
    );
    assert_err(
        json!({ "rope_parameters": { "main": {}, "compress": { "partial_rotary_factor": 0.25 } } }),
        "rope_parameters.compress.partial_rotary_factor",
    );
    assert_err(
        json!({ "rope_parameters": { "main": { "rope_theta": 0.5 }, "compress": {} } }),
        "rope_parameters.main.rope_theta",
    );
    assert_err(json!({ "compress_rope_theta": 0 }), "compress_rope_theta");
    // wrong JSON types
    assert_err(json!({ "hidden_size": "4096" }), "hidden_size");
    assert_err(json!({ "hidden_size": 4096.5 }), "hidden_size");
    assert_err(json!({ "hidden_size": null }), "hidden_size");
    assert_err(json!({ "tie_word_embeddings": 1 }), "tie_word_embeddings");
    assert_err(json!({ "rms_norm_eps": "small" }), "rms_norm_eps");
    assert_err(json!({ "eos_token_id": "x" }), "eos_token_id");
    assert_err(json!({ "eos_token_id": [1, -2] }), "eos_token_id[1]");
    assert_err(json!({ "bos_token_id": 1.5 }), "bos_token_id");
    assert_err(json!({ "layer_types": "sliding_attention" }), "layer_types");
    assert_err(json!({ "compress_rates": [4, 128] }), "compress_rates");
    assert_err(json!({ "rope_parameters": "yarn" }), "rope_parameters");
    assert_err(json!({ "num_hash_layers": -1 }), "num_hash_layers");
    assert_err(json!({ "norm_topk_prob": "yes" }), "norm_topk_prob");
    // unknown keys are fine
    parse_ok(json!({ "architectures": ["DeepseekV4ForCausalLM"], "torch_dtype": "bfloat16" }));
}

#[test]
fn io_and_json_errors() {
    assert!(matches!(
        ModelConfig::from_json_str("{"),
        Err(ConfigError::Json { .. })
    ));
    let err = ModelConfig::from_json_str("[1]").unwrap_err();
    assert!(err.to_string().contains("<root>"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let err = ModelConfig::from_model_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ConfigError::Io { .. }));
    assert!(err.to_string().contains("config.json"), "{err}");

    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "deepseek_v4", "num_hidden_layers": 5}"#,
    )
    .unwrap();
    let c = ModelConfig::from_model_dir(dir.path()).unwrap();
    assert_eq!(c.num_hidden_layers, 5);
    assert_eq!(
        c,
        ModelConfig::from_file(&dir.path().join("config.json")).unwrap()
    );

    std::fs::write(dir.path().join("config.json"), "{not json").unwrap();
    let err = ModelConfig::from_model_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("config.json"), "{err}");
}

fn released_quant() -> Value {
    json!({
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128], "activation_scheme": "dynamic"
    })
}

#[test]
fn quantization_config_parses_the_released_values() {
    use pdserve_engine::config::{ExpertDtype, Quantization, WEIGHT_BLOCK};
    assert_eq!(parse_ok(json!({})).quantization, None);
    let q: Quantization = parse_ok(json!({ "quantization_config": released_quant() }))
        .quantization
        .unwrap();
    assert_eq!(q.weight_block_size, WEIGHT_BLOCK);
    assert_eq!(q.expert_dtype, ExpertDtype::Fp8);
    let fp4 = parse_ok(json!({ "quantization_config": released_quant(), "expert_dtype": "fp4" }));
    assert_eq!(fp4.quantization.unwrap().expert_dtype, ExpertDtype::Fp4);
    // Without quantization_config nothing is quantized, whatever expert_dtype says.
    assert_eq!(
        parse_ok(json!({ "expert_dtype": "fp4" })).quantization,
        None
    );
}

#[test]
fn quantization_config_refuses_unknown_values_by_field() {
    let with = |key: &str, v: Value| {
        let mut q = released_quant();
        q[key] = v;
        json!({ "quantization_config": q })
    };
    let cases = [
        ("quant_method", json!("gptq")),
        ("fmt", json!("e5m2")),
        ("scale_fmt", json!("float32")),
        ("activation_scheme", json!("static")),
        ("weight_block_size", json!([64, 64])),
        ("weight_block_size", json!([128])),
        ("weight_block_size", json!("128x128")),
    ];
    for (key, v) in cases {
        let bad = v.to_string();
        let value = bad.trim_matches('"').to_string();
        let err = parse(with(key, v)).unwrap_err().to_string();
        assert!(err.contains(&format!("quantization_config.{key}")), "{err}");
        assert!(err.contains(&value), "{err} should name {value}");
    }
    let mut no_method = released_quant();
    no_method.as_object_mut().unwrap().remove("quant_method");
    assert_err(
        json!({ "quantization_config": no_method }),
        "quantization_config.quant_method",
    );
    let mut no_scale_fmt = released_quant();
    no_scale_fmt.as_object_mut().unwrap().remove("scale_fmt");
    assert_err(
        json!({ "quantization_config": no_scale_fmt }),
        "quantization_config.scale_fmt",
    );
    assert_err(
        json!({ "quantization_config": released_quant(), "expert_dtype": "int4" }),
        "expert_dtype",
    );
}
