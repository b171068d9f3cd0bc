#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use pdserve_engine::checkpoint::{
    expected_tensors, lm_head_name, validate, Checkpoint, CheckpointError, DiskDtype,
    ExpectedTensor, LoadProgress,
};
use pdserve_engine::config::ModelConfig;
use safetensors::tensor::TensorView;

/// hidden 8, 3 layers (sliding / CSA / HCA), 4 experts.
const TINY: &str = r#"{
    "model_type": "deepseek_v4",
    "vocab_size": 16, "hidden_size": 8, "moe_intermediate_size": 4, "num_hidden_layers": 3,
    "num_attention_heads": 2, "head_dim": 8, "partial_rotary_factor": 0.5, "q_lora_rank": 4,
    "num_experts_per_tok": 2, "n_routed_experts": 4, "o_groups": 2, "o_lora_rank": 3,
    "index_n_heads": 2, "index_head_dim": 4, "index_topk": 2, "hc_mult": 2, "sliding_window": 4,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}
}"#;

fn tiny(tied: bool) -> ModelConfig {
    let mut v: serde_json::Value = serde_json::from_str(TINY).unwrap();
    v["tie_word_embeddings"] = serde_json::Value::Bool(tied);
    ModelConfig::from_json_str(&v.to_string()).unwrap()
}

struct T {
    dtype: DiskDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn f32_t(shape: &[usize], vals: &[f32]) -> T {
    T {
        dtype: DiskDtype::F32,
        shape: shape.to_vec(),
        bytes: vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn bf16_t(shape: &[usize], vals: &[f32]) -> T {
    let bytes = vals
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    T {
        dtype: DiskDtype::BF16,
        shape: shape.to_vec(),
        bytes,
    }
}

fn f16_t(shape: &[usize], vals: &[f32]) -> T {
    let bytes = vals
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    T {
        dtype: DiskDtype::F16,
        shape: shape.to_vec(),
        bytes,
    }
}

fn i64_t(shape: &[usize], vals: &[i64]) -> T {
    T {
        dtype: DiskDtype::I64,
        shape: shape.to_vec(),
        bytes: vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn write(path: &Path, tensors: &BTreeMap<String, T>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// A complete checkpoint for `cfg`: floats in bf16, `tid2eid` = (token + slot) % experts.
fn full_set(cfg: &ModelConfig) -> BTreeMap<String, T> {
    expected_tensors(cfg)
        .into_iter()
        .map(|ExpectedTensor { name, shape, int }| {
            let n: usize = shape.iter().product();
            let t = if int {
                let k = shape[1];
                i64_t(
                    &shape,
                    &(0..n)
                        .map(|j| ((j / k + j % k) % cfg.n_routed_experts) as i64)
                        .collect::<Vec<_>>(),
                )
            } else {
                bf16_t(&shape, &vec![0.5; n])
            };
            (name, t)
        })
        .collect()
}

#[test]
fn float_dtypes_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let vals = [1.0f32, -2.5, 0.15625, 24576.0, -0.0, 7.75];
    let mut m = BTreeMap::new();
    m.insert(
        "model.a".to_string(),
        f32_t(&[2, 3], &[1.1, -2.2, 3.3, 1e-30, -4e20, 0.1]),
    );
    m.insert("model.b".to_string(), bf16_t(&[3, 2], &vals));
    m.insert("model.c".to_string(), f16_t(&[6], &vals));
    m.insert("model.d".to_string(), i64_t(&[2, 2], &[0, -1, 1 << 40, 3]));
    m.insert(
        "model.e".to_string(),
        T {
            dtype: DiskDtype::I32,
            shape: vec![3],
            bytes: [5i32, -6, 7].iter().flat_map(|v| v.to_le_bytes()).collect(),
        },
    );
    m.insert(
        "model.f".to_string(),
        T {
            dtype: DiskDtype::U8,
            shape: vec![2],
            bytes: vec![1, 2],
        },
    );
    write(&dir.path().join("model.safetensors"), &m);

    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ck.names(),
        vec!["model.a", "model.b", "model.c", "model.d", "model.e", "model.f"]
    );
    assert_eq!(ck.shape("model.b"), Some(vec![3, 2]));
    assert_eq!(ck.dtype("model.c"), Some(DiskDtype::F16));
    assert_eq!(ck.shape("zz"), None);
    assert_eq!(ck.tensor_bytes("model.a"), 24);
    assert_eq!(ck.total_bytes(), 24 + 12 + 12 + 32 + 12 + 2);

    let a = ck.tensor_f32("model.a").unwrap();
    assert_eq!(a.shape, vec![2, 3]);
    assert_eq!(a.data, vec![1.1, -2.2, 3.3, 1e-30, -4e20, 0.1]);
    // all of `vals` are exact in bf16 and f16
    assert_eq!(ck.tensor_f32("model.b").unwrap().data, vals.to_vec());
    assert_eq!(ck.tensor_f32("model.c").unwrap().data, vals.to_vec());
    assert_eq!(
        ck.tensor_i64("model.d").unwrap(),
        (vec![2, 2], vec![0, -1, 1 << 40, 3])
    );
    assert_eq!(ck.tensor_i64("model.e").unwrap(), (vec![3], vec![5, -6, 7]));

    let err = ck.tensor_f32("model.f").unwrap_err();
    assert!(matches!(err, CheckpointError::Dtype { .. }));
    assert!(
        err.to_string().contains("`model.f`") && err.to_string().contains("U8"),
        "{err}"
    );
    let err = ck.tensor_i64("model.a").unwrap_err();
    assert!(
        err.to_string().contains("`model.a`") && err.to_string().contains("F32"),
        "{err}"
    );
    let err = ck.tensor_f32("missing").unwrap_err();
    assert!(matches!(err, CheckpointError::NotFound { .. }) && err.to_string().contains("missing"));
    let raw = ck.raw("model.b").unwrap();
    assert_eq!(
        (raw.dtype, raw.shape, raw.bytes.len()),
        (DiskDtype::BF16, &[3usize, 2][..], 12)
    );
}

#[test]
fn large_tensor_conversion_is_complete() {
    // crosses several parallel conversion chunks
    let dir = tempfile::tempdir().unwrap();
    let n = 200_003;
    let vals: Vec<f32> = (0..n).map(|i| (i % 256) as f32).collect();
    let mut m = BTreeMap::new();
    m.insert("model.big".to_string(), bf16_t(&[n], &vals));
    write(&dir.path().join("model.safetensors"), &m);
    let t = Checkpoint::open(dir.path())
        .unwrap()
        .tensor_f32("model.big")
        .unwrap();
    assert_eq!(t.data, vals);
}

#[test]
fn sharded_index() {
    let dir = tempfile::tempdir().unwrap();
    let mut s1 = BTreeMap::new();
    s1.insert("model.x".to_string(), f32_t(&[2], &[1.0, 2.0]));
    s1.insert("not_in_index".to_string(), f32_t(&[1], &[9.0]));
    let mut s2 = BTreeMap::new();
    s2.insert("model.y".to_string(), f16_t(&[1, 2], &[3.0, 4.0]));
    write(&dir.path().join("model-00001-of-00002.safetensors"), &s1);
    write(&dir.path().join("model-00002-of-00002.safetensors"), &s2);
    let index = serde_json::json!({
        "metadata": { "total_size": 12 },
        "weight_map": { "model.x": "model-00001-of-00002.safetensors", "model.y": "model-00002-of-00002.safetensors" }
    });
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.names(), vec!["model.x", "model.y"]);
    assert_eq!(ck.files().len(), 2);
    assert_eq!(ck.tensor_f32("model.x").unwrap().data, vec![1.0, 2.0]);
    assert_eq!(ck.tensor_f32("model.y").unwrap().data, vec![3.0, 4.0]);
    assert_eq!(ck.total_bytes(), 8 + 4);

    // index pointing at a tensor the shard lacks
    let index = serde_json::json!({ "weight_map": { "z": "model-00002-of-00002.safetensors" } });
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, CheckpointError::Index { .. }) && err.to_string().contains("`z`"),
        "{err}"
    );

    // index pointing at a missing file
    let index = serde_json::json!({ "weight_map": { "x": "nope.safetensors" } });
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(err.to_string().contains("nope.safetensors"), "{err}");

    std::fs::write(dir.path().join("model.safetensors.index.json"), "{}").unwrap();
    assert!(Checkpoint::open(dir.path())
        .unwrap_err()
        .to_string()
        .contains("weight_map"));
}

#[test]
fn open_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(matches!(err, CheckpointError::NoCheckpoint { .. }));
    assert!(
        err.to_string().contains(&dir.path().display().to_string()),
        "{err}"
    );

    std::fs::write(dir.path().join("model.safetensors"), b"garbage!garbage!").unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(matches!(err, CheckpointError::Format { .. }), "{err}");
}

#[test]
fn expected_inventory_of_tiny_model() {
    let cfg = tiny(false);
    let exp = expected_tensors(&cfg);
    let get = |n: &str| {
        exp.iter()
            .find(|t| t.name == n)
            .unwrap_or_else(|| panic!("{n} not expected"))
    };
    let names: Vec<&str> = exp.iter().map(|t| t.name.as_str()).collect();
    // shared per layer: 8 attention + gate + 2 experts + 3 shared + 2 norms + 6 hc = 22
    // sliding+hash: 22 + tid2eid; CSA+moe: 22 + 4 + 6 + bias; HCA+moe: 22 + 4 + bias; globals: 1 + 4 + lm_head
    assert_eq!(exp.len(), 23 + 33 + 27 + 6);
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(*names.last().unwrap(), "lm_head.weight");
    assert_eq!(
        get("model.layers.0.self_attn.q_a_proj.weight").shape,
        vec![4, 8]
    );
    assert_eq!(
        get("model.layers.0.self_attn.q_b_proj.weight").shape,
        vec![16, 4]
    );
    assert_eq!(
        get("model.layers.0.self_attn.o_a_proj.weight").shape,
        vec![6, 8]
    );
    assert_eq!(
        get("model.layers.0.self_attn.o_b_proj.weight").shape,
        vec![8, 6]
    );
    assert_eq!(get("model.layers.0.self_attn.sinks").shape, vec![2]);
    let tid = get("model.layers.0.mlp.gate.tid2eid");
    assert!(tid.int);
    assert_eq!(tid.shape, vec![16, 2]);
    assert!(!names.contains(&"model.layers.0.mlp.gate.e_score_correction_bias"));
    assert!(!names
        .iter()
        .any(|n| n.starts_with("model.layers.0.self_attn.compressor")));
    assert_eq!(
        get("model.layers.1.self_attn.compressor.kv_proj.weight").shape,
        vec![16, 8]
    );
    assert_eq!(
        get("model.layers.1.self_attn.compressor.position_bias").shape,
        vec![2, 16]
    );
    assert_eq!(
        get("model.layers.1.self_attn.compressor.kv_norm.weight").shape,
        vec![8]
    );
    assert_eq!(
        get("model.layers.1.self_attn.compressor.indexer.gate_proj.weight").shape,
        vec![8, 8]
    );
    assert_eq!(
        get("model.layers.1.self_attn.compressor.indexer.position_bias").shape,
        vec![2, 8]
    );
    assert_eq!(
        get("model.layers.1.self_attn.compressor.indexer.kv_norm.weight").shape,
        vec![4]
    );
    assert_eq!(
        get("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight").shape,
        vec![8, 4]
    );
    assert_eq!(
        get("model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight").shape,
        vec![2, 8]
    );
    assert_eq!(
        get("model.layers.1.mlp.gate.e_score_correction_bias").shape,
        vec![4]
    );
    assert_eq!(
        get("model.layers.2.self_attn.compressor.gate_proj.weight").shape,
        vec![8, 8]
    );
    assert_eq!(
        get("model.layers.2.self_attn.compressor.position_bias").shape,
        vec![4, 8]
    );
    assert!(!names
        .iter()
        .any(|n| n.starts_with("model.layers.2.self_attn.compressor.indexer")));
    assert_eq!(
        get("model.layers.2.mlp.experts.gate_up_proj").shape,
        vec![4, 8, 8]
    );
    assert_eq!(
        get("model.layers.2.mlp.experts.down_proj").shape,
        vec![4, 8, 4]
    );
    assert_eq!(
        get("model.layers.2.mlp.shared_experts.down_proj.weight").shape,
        vec![8, 4]
    );
    assert_eq!(get("model.layers.2.ffn_hc.fn").shape, vec![8, 16]);
    assert_eq!(get("model.layers.2.attn_hc.base").shape, vec![8]);
    assert_eq!(get("model.layers.2.attn_hc.scale").shape, vec![3]);
    assert_eq!(get("model.hc_head.hc_fn").shape, vec![2, 16]);
    assert_eq!(get("model.hc_head.hc_scale").shape, vec![1]);
    assert_eq!(exp.iter().filter(|t| t.int).count(), 1);
    assert_eq!(lm_head_name(&cfg), "lm_head.weight");

    let tied = tiny(true);
    assert!(!expected_tensors(&tied)
        .iter()
        .any(|t| t.name == "lm_head.weight"));
    assert_eq!(lm_head_name(&tied), "model.embed_tokens.weight");
}

#[test]
fn validate_accepts_complete_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(false);
    let mut set = full_set(&cfg);
    set.insert("mtp.0.enorm.weight".into(), f32_t(&[8], &[0.0; 8]));
    set.insert("model.mtp.1.x".into(), f32_t(&[1], &[0.0]));
    write(&dir.path().join("model.safetensors"), &set);
    let ck = Checkpoint::open(dir.path()).unwrap();
    validate(&ck, &cfg).unwrap();
    assert_eq!(
        ck.tensor_f32("model.norm.weight").unwrap().data,
        vec![0.5; 8]
    );

    // tied: lm_head may be absent, or present with the right shape
    let tied = tiny(true);
    let err = validate(&ck, &tied);
    assert!(err.is_ok(), "{err:?}");
    set.remove("lm_head.weight");
    write(&dir.path().join("model.safetensors"), &set);
    validate(&Checkpoint::open(dir.path()).unwrap(), &tied).unwrap();
    let err = validate(&Checkpoint::open(dir.path()).unwrap(), &cfg).unwrap_err();
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
}

#[test]
fn validate_lists_every_problem_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(false);
    let mut set = full_set(&cfg);
    set.remove("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight");
    set.remove("model.hc_head.hc_base");
    set.insert(
        "model.layers.0.self_attn.surprise.weight".into(),
        f32_t(&[1], &[0.0]),
    );
    set.insert(
        "model.layers.2.self_attn.sinks".into(),
        f32_t(&[3], &[0.0; 3]),
    );
    set.insert(
        "model.layers.1.mlp.gate.weight".into(),
        T {
            dtype: DiskDtype::F64,
            shape: vec![4, 8],
            bytes: vec![0; 256],
        },
    );
    let mut ids: Vec<i64> = (0..32).map(|i| (i % 4) as i64).collect();
    ids[5] = 4;
    ids[6] = -1;
    set.insert(
        "model.layers.0.mlp.gate.tid2eid".into(),
        i64_t(&[16, 2], &ids),
    );
    write(&dir.path().join("model.safetensors"), &set);

    let err = validate(&Checkpoint::open(dir.path()).unwrap(), &cfg).unwrap_err();
    let CheckpointError::Invalid(report) = &err else {
        panic!("{err}")
    };
    assert_eq!(
        report.missing,
        vec![
            "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight",
            "model.hc_head.hc_base"
        ]
    );
    assert_eq!(
        report.unexpected,
        vec!["model.layers.0.self_attn.surprise.weight"]
    );
    assert_eq!(report.wrong_shape.len(), 1);
    assert_eq!(report.wrong_shape[0].name, "model.layers.2.self_attn.sinks");
    assert_eq!(
        (
            report.wrong_shape[0].expected.clone(),
            report.wrong_shape[0].found.clone()
        ),
        (vec![2], vec![3])
    );
    assert_eq!(
        report.bad_dtype,
        vec![("model.layers.1.mlp.gate.weight".to_string(), DiskDtype::F64)]
    );
    assert_eq!(report.bad_values.len(), 1);
    let msg = err.to_string();
    for needle in [
        "missing tensors (2)",
        "model.hc_head.hc_base",
        "unexpected tensors (1)",
        "surprise",
        "model.layers.2.self_attn.sinks: expected [2], found [3]",
        "model.layers.1.mlp.gate.weight: F64",
        "model.layers.0.mlp.gate.tid2eid: 2 expert ids outside 0..4",
    ] {
        assert!(msg.contains(needle), "missing `{needle}` in:\n{msg}");
    }

    // a token routed to one expert twice is refused, naming the token
    let mut dup: Vec<i64> = (0..32).map(|i| (i % 4) as i64).collect();
    dup[6] = 2;
    dup[7] = 2;
    set.insert(
        "model.layers.0.mlp.gate.tid2eid".into(),
        i64_t(&[16, 2], &dup),
    );
    write(&dir.path().join("model.safetensors"), &set);
    let err = validate(&Checkpoint::open(dir.path()).unwrap(), &cfg).unwrap_err();
    assert!(
        err.to_string().contains(
            "model.layers.0.mlp.gate.tid2eid: 1 tokens route to one expert twice (first: token 3, expert 2)"
        ),
        "{err}"
    );

    // an int tensor stored as float is a dtype problem
    set.insert(
        "model.layers.0.mlp.gate.tid2eid".into(),
        f32_t(&[16, 2], &[0.0; 32]),
    );
    write(&dir.path().join("model.safetensors"), &set);
    let err = validate(&Checkpoint::open(dir.path()).unwrap(), &cfg).unwrap_err();
    assert!(
        err.to_string()
            .contains("model.layers.0.mlp.gate.tid2eid: F32"),
        "{err}"
    );
}

#[test]
fn report_is_capped() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(false);
    let mut set = BTreeMap::new();
    set.insert("only".to_string(), f32_t(&[1], &[0.0]));
    write(&dir.path().join("model.safetensors"), &set);
    let err = validate(&Checkpoint::open(dir.path()).unwrap(), &cfg).unwrap_err();
    let n = expected_tensors(&cfg).len();
    let msg = err.to_string();
    assert!(msg.contains(&format!("missing tensors ({n}):")), "{msg}");
    assert!(msg.contains(&format!("... and {} more", n - 20)), "{msg}");
    assert!(msg.lines().count() < 30, "{msg}");
}

#[test]
fn non_deepseek_config_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 8}"#,
    )
    .unwrap();
    let err = ModelConfig::from_model_dir(dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("model_type") && err.to_string().contains("llama"),
        "{err}"
    );
}

#[test]
fn progress_is_hidden_for_small_loads() {
    let p = LoadProgress::new(1024);
    assert!(!p.is_visible());
    p.advance(512);
    p.finish();
    // tests never run with stderr as a terminal under cargo's capture; either way it must not panic
    let big = LoadProgress::new(LoadProgress::MIN_BYTES);
    big.advance(1);
    big.finish();
}
