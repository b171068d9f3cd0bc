//! A tiny checkpoint written in exactly DeepSeek's released layout (block-scaled FP8
//! attention / shared-expert weights, FP4 routed experts, BF16 rest, `mtp.*` present),
//! with dims past one 128-block so partial blocks occur: it loads to the values computed
//! here independently, runs bitwise like an f32 checkpoint holding those values, and
//! broken scales fail with one error naming every bad tensor.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::released::{write, Tensor, FP8_NAMES};
use common::*;
use half::bf16;
use pdserve_engine::checkpoint::{expected_tensors, validate, Checkpoint, DiskDtype};
use pdserve_engine::config::{ExpertDtype, ModelConfig};
use pdserve_engine::generate::logits_prefill_decode;
use pdserve_engine::kv::EntryDtype;
use safetensors::tensor::TensorView;
use serde_json::{json, Value};
use std::path::Path;

struct Rng(u64);

impl Rng {
    /// splitmix64.
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn byte_in(&mut self, lo: u8, hi: u8) -> u8 {
        lo + self.below(u64::from(hi - lo) + 1) as u8
    }
}

/// e4m3 by its definition (bias 7, subnormals at exponent 0), not the engine's table.
fn e4m3(b: u8) -> f64 {
    let e = i32::from((b >> 3) & 0xf);
    let m = f64::from(b & 7) / 8.0;
    let v = if e == 0 {
        m * 2f64.powi(-6)
    } else {
        (1.0 + m) * 2f64.powi(e - 7)
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// e2m1 by its definition (bias 1).
fn e2m1(n: u8) -> f64 {
    let e = i32::from((n >> 1) & 3);
    let m = f64::from(n & 1) / 2.0;
    let v = if e == 0 {
        m
    } else {
        (1.0 + m) * 2f64.powi(e - 1)
    };
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

fn ue8m0(b: u8) -> f64 {
    2f64.powi(i32::from(b) - 127)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A random block-scaled FP8 `[rows, cols]` weight: (weight, scale) tensors and its values.
fn fp8_weight(rng: &mut Rng, rows: usize, cols: usize) -> (Tensor, Tensor, Vec<f32>) {
    let q: Vec<u8> = (0..rows * cols)
        .map(|_| loop {
            let b = rng.next() as u8;
            if b & 0x7f != 0x7f {
                break b;
            }
        })
        .collect();
    let (sr, sc) = (rows.div_ceil(128), cols.div_ceil(128));
    let s: Vec<u8> = (0..sr * sc).map(|_| rng.byte_in(112, 118)).collect();
    let values = (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            (e4m3(q[k]) * ue8m0(s[(i / 128) * sc + j / 128])) as f32
        })
        .collect();
    (
        (DiskDtype::F8_E4M3, vec![rows, cols], q),
        (DiskDtype::F8_E8M0, vec![sr, sc], s),
        values,
    )
}

/// A random FP4 `[rows, cols]` expert weight stored as I8 `[rows, cols/2]`.
fn fp4_weight(rng: &mut Rng, rows: usize, cols: usize) -> (Tensor, Tensor, Vec<f32>) {
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
    let s: Vec<u8> = (0..rows * cols / 32)
        .map(|_| rng.byte_in(119, 124))
        .collect();
    let values = (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            let byte = packed[i * cols / 2 + j / 2];
            let nibble = if j % 2 == 0 { byte & 0xf } else { byte >> 4 };
            (e2m1(nibble) * ue8m0(s[i * (cols / 32) + j / 32])) as f32
        })
        .collect();
    (
        (DiskDtype::I8, vec![rows, cols / 2], packed),
        (DiskDtype::F8_E8M0, vec![rows, cols / 32], s),
        values,
    )
}

/// How the tiny checkpoint stores its weights.
#[derive(Clone, Copy, PartialEq)]
enum Stored {
    /// Everything F32 (the reference).
    F32,
    /// Released instruct layout: FP8 attention / shared experts, FP4 routed experts.
    Fp8Fp4,
    /// Base layout: FP8 routed experts too.
    Fp8,
}

/// config.json of the tiny model: the `mixed` fixture's, resized past one 128-block.
fn config_json(stored: Stored) -> Value {
    let fx = fixtures_dir().join("mixed/config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(fx).unwrap()).unwrap();
    for (k, v) in [
        ("hidden_size", json!(160)),
        ("q_lora_rank", json!(200)),
        ("num_attention_heads", json!(2)),
        ("head_dim", json!(64)),
        ("qk_rope_head_dim", json!(16)),
        ("o_groups", json!(2)),
        ("o_lora_rank", json!(80)),
        ("index_n_heads", json!(2)),
        ("index_head_dim", json!(32)),
        ("moe_intermediate_size", json!(96)),
        ("n_routed_experts", json!(4)),
        ("num_hidden_layers", json!(3)),
        (
            "layer_types",
            json!([
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention"
            ]),
        ),
        ("mlp_layer_types", json!(["hash_moe", "moe", "moe"])),
    ] {
        c[k] = v;
    }
    if stored != Stored::F32 {
        c["quantization_config"] = json!({
            "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128], "activation_scheme": "dynamic"
        });
        c["expert_dtype"] = json!(if stored == Stored::Fp8Fp4 {
            "fp4"
        } else {
            "fp8"
        });
    }
    c
}

/// The released-layout tensors (by disk name) and an f32 reference holding the
/// independently dequantized values (by canonical name).
struct Tiny {
    quantized: Vec<(String, Tensor)>,
    reference: Vec<(String, Tensor)>,
}

fn build(cfg: &ModelConfig) -> Tiny {
    let fp4_experts = cfg.quantization.unwrap().expert_dtype == ExpertDtype::Fp4;
    let mut rng = Rng(11);
    let mut tiny = Tiny {
        quantized: Vec::new(),
        reference: Vec::new(),
    };
    for t in expected_tensors(cfg) {
        let n = t.name.clone();
        if t.int {
            // Each token's experts distinct (as DeepSeek's tables and validation require).
            let (rows, k) = (t.shape[0], t.shape[1]);
            let e = cfg.n_routed_experts;
            let ids: Vec<u8> = (0..rows)
                .flat_map(|_| {
                    let first = rng.below(e as u64) as usize;
                    (0..k).map(move |j| ((first + j) % e) as i64)
                })
                .flat_map(i64::to_le_bytes)
                .collect();
            tiny.quantized
                .push((n.clone(), (DiskDtype::I64, t.shape.clone(), ids.clone())));
            tiny.reference.push((n, (DiskDtype::I64, t.shape, ids)));
            continue;
        }
        let fp8 = FP8_NAMES.iter().find(|(c, _)| n.ends_with(c));
        let experts = n.rsplit_once(".mlp.experts.");
        let values = if let Some((canon, upstream)) = fp8 {
            let stem = n
                .strip_prefix("model.")
                .unwrap()
                .strip_suffix(canon)
                .unwrap();
            let (w, s, values) = fp8_weight(&mut rng, t.shape[0], t.shape[1]);
            let disk = format!("{stem}{upstream}");
            tiny.quantized.push((disk.replace(".weight", ".scale"), s));
            tiny.quantized.push((disk, w));
            values
        } else if let Some((layer, packed)) = experts {
            let layer = layer.strip_prefix("model.").unwrap();
            let (rows, cols) = (t.shape[1], t.shape[2]);
            let parts: &[&str] = if packed == "gate_up_proj" {
                &["w1", "w3"]
            } else {
                &["w2"]
            };
            let part_rows = rows / parts.len();
            let mut values = Vec::new();
            for e in 0..t.shape[0] {
                for part in parts {
                    let (w, s, v) = if fp4_experts {
                        fp4_weight(&mut rng, part_rows, cols)
                    } else {
                        fp8_weight(&mut rng, part_rows, cols)
                    };
                    let stem = format!("{layer}.ffn.experts.{e}.{part}");
                    tiny.quantized.push((format!("{stem}.weight"), w));
                    tiny.quantized.push((format!("{stem}.scale"), s));
                    values.extend(v);
                }
            }
            values
        } else {
            let values: Vec<f32> = (0..t.shape.iter().product::<usize>())
                .map(|_| bf16::from_f32((rng.below(2001) as f32 - 1000.0) / 4000.0).to_f32())
                .collect();
            let bytes = values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect();
            tiny.quantized
                .push((n.clone(), (DiskDtype::BF16, t.shape.clone(), bytes)));
            values
        };
        tiny.reference
            .push((n, (DiskDtype::F32, t.shape, f32_bytes(&values))));
    }
    // Released checkpoints carry the MTP layer; it is not used for inference.
    let (w, s, _) = fp8_weight(&mut rng, 200, 160);
    tiny.quantized.push(("mtp.0.attn.wq_a.weight".into(), w));
    tiny.quantized.push(("mtp.0.attn.wq_a.scale".into(), s));
    tiny
}

/// Write `tensors` as two shards with an index, alternating, so that a weight and its
/// scale (adjacent in `tensors`) land in different files.
fn write_sharded(dir: &Path, config: &Value, tensors: &[(String, Tensor)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut weight_map = serde_json::Map::new();
    for shard in 0..2 {
        let file = format!("model-0000{}-of-00002.safetensors", shard + 1);
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .skip(shard)
            .step_by(2)
            .map(|(n, (d, s, b))| {
                weight_map.insert(n.clone(), json!(file));
                (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())
            })
            .collect();
        std::fs::write(
            dir.join(&file),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
    }
    let index = json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

fn tiny_cfg(stored: Stored) -> ModelConfig {
    ModelConfig::from_json_str(&config_json(stored).to_string()).unwrap()
}

#[test]
fn released_layout_loads_exactly_and_runs_like_its_f32_dequantization() {
    loads_exactly(Stored::Fp8Fp4, false);
}

#[test]
fn sharded_base_layout_with_fp8_experts_loads_exactly() {
    loads_exactly(Stored::Fp8, true);
}

fn loads_exactly(stored: Stored, sharded: bool) {
    let cfg = tiny_cfg(stored);
    let tiny = build(&cfg);
    let tmp = tempfile::tempdir().unwrap();
    let (qdir, fdir) = (tmp.path().join("quantized"), tmp.path().join("f32"));
    if sharded {
        write_sharded(&qdir, &config_json(stored), &tiny.quantized);
    } else {
        write(&qdir, &config_json(stored), &tiny.quantized);
    }
    write(&fdir, &config_json(Stored::F32), &tiny.reference);

    let q = Checkpoint::open(&qdir).unwrap();
    let f = Checkpoint::open(&fdir).unwrap();
    validate(&q, &cfg).unwrap();
    // Scales belong to their weights and mtp.* is ignored: the same canonical tensors.
    assert_eq!(q.names(), f.names());
    for name in f.names() {
        assert_eq!(q.shape(&name), f.shape(&name), "{name}");
        if f.dtype(&name) == Some(DiskDtype::I64) {
            assert_eq!(q.tensor_i64(&name).unwrap(), f.tensor_i64(&name).unwrap());
        } else {
            let (got, want) = (q.tensor_f32(&name).unwrap(), f.tensor_f32(&name).unwrap());
            assert!(got == want, "{name}: dequantized values differ");
        }
    }
    assert_eq!(
        q.dtype("model.layers.1.self_attn.q_a_proj.weight"),
        Some(DiskDtype::F8_E4M3)
    );
    let expert_dtype = if stored == Stored::Fp8Fp4 {
        DiskDtype::I8
    } else {
        DiskDtype::F8_E4M3
    };
    assert_eq!(
        q.dtype("model.layers.1.mlp.experts.gate_up_proj"),
        Some(expert_dtype)
    );

    let tokens: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 97).collect();
    let run = |dir: &Path| {
        let mut eng = engine(dir, EntryDtype::F32, None);
        logits_prefill_decode(&mut eng, &tokens, 20, 0).unwrap()
    };
    let (got, want) = (run(&qdir), run(&fdir));
    assert!(want.iter().flatten().all(|v| v.is_finite()));
    assert!(
        want.iter().all(|row| row.iter().any(|&v| v != row[0])),
        "degenerate logits"
    );
    let bits = |l: &[Vec<f32>]| -> Vec<u32> { l.iter().flatten().map(|v| v.to_bits()).collect() };
    assert_eq!(
        bits(&got),
        bits(&want),
        "logits differ from the f32 checkpoint's"
    );
}

#[test]
fn bad_scales_and_dtypes_fail_in_one_error_naming_each() {
    let cfg = tiny_cfg(Stored::Fp8Fp4);
    let mut tensors = build(&cfg).quantized;
    let missing = "layers.0.attn.wq_a.scale";
    let misshapen = "layers.1.ffn.shared_experts.w2.scale";
    let mistyped = "layers.2.ffn.experts.3.w3.scale";
    let wrong_weight = "layers.1.attn.wkv.weight";
    tensors.retain(|(n, _)| n != missing);
    for (n, (dtype, shape, bytes)) in &mut tensors {
        if n == misshapen {
            // [ceil(160/128), ceil(96/128)] = [2, 1] stored as [1, 2].
            *shape = vec![shape[1], shape[0]];
        } else if n == mistyped {
            *dtype = DiskDtype::BF16;
            *bytes = bytes.iter().flat_map(|&b| [0, b]).collect();
        } else if n == wrong_weight {
            // The config says FP8; a BF16 weight with a scale is not what it prescribes.
            *dtype = DiskDtype::BF16;
            *bytes = bytes.iter().flat_map(|&b| [0, b]).collect();
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &config_json(Stored::Fp8Fp4), &tensors);
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let err = validate(&ckpt, &cfg).unwrap_err().to_string();
    for name in [missing, misshapen, mistyped, wrong_weight] {
        assert!(err.contains(name), "error should name {name}:\n{err}");
    }
    let load = pdserve_engine::Engine::load(
        tmp.path(),
        pdserve_engine::CpuBackend,
        None,
        pdserve_engine::PoolSize {
            pages: 16,
            states: 2,
        },
    );
    let load_err = load.err().expect("loading must fail").to_string();
    for name in [missing, misshapen, mistyped, wrong_weight] {
        assert!(
            load_err.contains(name),
            "load error should name {name}:\n{load_err}"
        );
    }
}

#[test]
fn a_float_checkpoint_under_a_quantization_config_is_refused() {
    // f32 weights where the config prescribes FP8/FP4: every quantized tensor is named.
    let cfg = tiny_cfg(Stored::Fp8Fp4);
    let tmp = tempfile::tempdir().unwrap();
    write(
        tmp.path(),
        &config_json(Stored::Fp8Fp4),
        &build(&cfg).reference,
    );
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let err = validate(&ckpt, &cfg).unwrap_err().to_string();
    assert!(
        err.contains("model.layers.0.self_attn.q_a_proj.weight: F32"),
        "{err}"
    );
    // Per layer 5 attention + 3 shared-expert + 2 routed-expert weights, plus the one
    // CSA layer's indexer wq_b; the BF16-by-design tensors (norms, compressors) are fine.
    assert!(err.contains("unsupported dtypes (31)"), "{err}");
    assert!(!err.contains("kv_norm"), "{err}");
}

#[test]
fn a_nan_scale_fails_loading_naming_its_weight() {
    let cfg = tiny_cfg(Stored::Fp8Fp4);
    let mut tensors = build(&cfg).quantized;
    let scale = "layers.1.ffn.experts.0.w2.scale";
    let (_, (_, _, bytes)) = tensors.iter_mut().find(|(n, _)| n == scale).unwrap();
    bytes[5] = 0xff;
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &config_json(Stored::Fp8Fp4), &tensors);
    let err = pdserve_engine::Engine::load(
        tmp.path(),
        pdserve_engine::CpuBackend,
        None,
        pdserve_engine::PoolSize {
            pages: 16,
            states: 2,
        },
    )
    .err()
    .expect("a NaN scale must fail loading")
    .to_string();
    assert!(err.contains("layers.1.ffn.experts.0.w2.weight"), "{err}");
    assert!(err.contains("scale element 5 is NaN"), "{err}");
}

#[test]
fn a_scale_next_to_a_float_weight_is_unexpected() {
    let mut tensors = build(&tiny_cfg(Stored::Fp8Fp4)).reference;
    let scale = "model.layers.0.self_attn.q_a_proj.scale";
    tensors.push((scale.into(), (DiskDtype::F8_E8M0, vec![2, 2], vec![127; 4])));
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &config_json(Stored::F32), &tensors);
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let err = validate(&ckpt, &tiny_cfg(Stored::F32))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("unexpected tensors (1):\n  {scale}")),
        "{err}"
    );
    assert!(!err.contains("unsupported"), "{err}");
}

#[test]
fn a_packed_3d_quantized_expert_tensor_is_refused() {
    let cfg = tiny_cfg(Stored::Fp8);
    let mut tensors = build(&cfg).quantized;
    tensors.retain(|(n, _)| !(n.starts_with("layers.0.ffn.experts.") && n.contains(".w2.")));
    let packed = "model.layers.0.mlp.experts.down_proj";
    let shape = vec![4, 160, 96];
    let bytes = vec![0x38; shape.iter().product()];
    tensors.push((packed.into(), (DiskDtype::F8_E4M3, shape, bytes)));
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &config_json(Stored::Fp8), &tensors);
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let err = validate(&ckpt, &cfg).unwrap_err().to_string();
    assert!(
        err.contains(&format!("{packed}: a quantized weight is stored 2-D")),
        "{err}"
    );
}
