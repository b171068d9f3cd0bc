//! Real fixture checkpoints rewritten on the fly: other naming schemes and on-disk dtypes
//! load to the same model; broken checkpoints fail with one error naming every problem.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use half::{bf16, f16};
use pdserve_engine::checkpoint::{Checkpoint, DiskDtype};
use pdserve_engine::generate::logits_prefill_decode;
use pdserve_engine::kv::EntryDtype;
use pdserve_engine::{CpuBackend, Engine, PoolSize};
use safetensors::tensor::TensorView;
use std::path::Path;

/// A tensor to write: dtype, shape, little-endian bytes.
type Tensor = (DiskDtype, Vec<usize>, Vec<u8>);

fn write(dir: &Path, src: &Path, tensors: Vec<(String, Tensor)>) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
}

/// Every canonical tensor of `ckpt`, floats encoded with `enc`.
fn canonical_tensors(
    ckpt: &Checkpoint,
    dtype: DiskDtype,
    enc: fn(f32) -> Vec<u8>,
) -> Vec<(String, Tensor)> {
    ckpt.names()
        .into_iter()
        .map(|n| {
            if ckpt.dtype(&n) == Some(DiskDtype::I64) {
                let (shape, ids) = ckpt.tensor_i64(&n).unwrap();
                let bytes = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
                (n, (DiskDtype::I64, shape, bytes))
            } else {
                let t = ckpt.tensor_f32(&n).unwrap();
                let bytes = t.data.iter().flat_map(|&v| enc(v)).collect();
                (n, (dtype, t.shape, bytes))
            }
        })
        .collect()
}

fn f32_bytes(v: f32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn logits(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut eng = engine(dir, EntryDtype::F32, None);
    logits_prefill_decode(&mut eng, tokens, tokens.len() / 2, 0).unwrap()
}

#[test]
fn module_names_with_packed_experts_load_identically() {
    let fx = load_fixture("mixed");
    let ckpt = Checkpoint::open(&fx.dir).unwrap();
    // The fixture is stored as transformers saves it: per-expert upstream names.
    assert!(!ckpt.files().is_empty());
    assert!(ckpt.contains("model.layers.1.mlp.experts.gate_up_proj"));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf-names");
    write(
        &dir,
        &fx.dir,
        canonical_tensors(&ckpt, DiskDtype::F32, f32_bytes),
    );
    let tokens = &fx.tokens[..60];
    assert!(logits(&dir, tokens) == logits(&fx.dir, tokens));
}

#[test]
fn bf16_and_f16_on_disk_equal_their_f32_roundings() {
    let fx = load_fixture("mixed");
    let ckpt = Checkpoint::open(&fx.dir).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let tokens = &fx.tokens[..50];
    type Case = (&'static str, DiskDtype, fn(f32) -> Vec<u8>, fn(f32) -> f32);
    let cases: [Case; 2] = [
        (
            "bf16",
            DiskDtype::BF16,
            |v| bf16::from_f32(v).to_le_bytes().to_vec(),
            |v| bf16::from_f32(v).to_f32(),
        ),
        (
            "f16",
            DiskDtype::F16,
            |v| f16::from_f32(v).to_le_bytes().to_vec(),
            |v| f16::from_f32(v).to_f32(),
        ),
    ];
    for (name, dtype, enc, round) in cases {
        let low = tmp.path().join(name);
        write(&low, &fx.dir, canonical_tensors(&ckpt, dtype, enc));
        let rounded = tmp.path().join(format!("{name}-as-f32"));
        let mut ts = canonical_tensors(&ckpt, DiskDtype::F32, f32_bytes);
        for (_, (d, _, b)) in ts.iter_mut() {
            if *d == DiskDtype::F32 {
                for c in b.chunks_exact_mut(4) {
                    let v = round(f32::from_le_bytes(c.try_into().unwrap()));
                    c.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        write(&rounded, &fx.dir, ts);
        let a = logits(&low, tokens);
        assert!(
            a == logits(&rounded, tokens),
            "{name} checkpoint differs from its f32 rounding"
        );
        let (err, _) = max_rel_err(&a, &fx.logits[..tokens.len()]);
        println!("{name} weights: max rel err vs f32 reference {err:.3e}");
        assert!(err > 0.0 && err < 0.5, "{name}: rel err {err}");
    }
}

#[test]
fn broken_checkpoint_names_every_problem() {
    let fx = load_fixture("mixed");
    let ckpt = Checkpoint::open(&fx.dir).unwrap();
    let mut ts = canonical_tensors(&ckpt, DiskDtype::F32, f32_bytes);
    ts.retain(|(n, _)| n != "model.layers.2.self_attn.sinks" && n != "model.norm.weight");
    for (n, (_, shape, bytes)) in ts.iter_mut() {
        if n == "model.layers.0.self_attn.kv_proj.weight" {
            shape[0] -= 1;
            bytes.truncate(shape.iter().product::<usize>() * 4);
        }
    }
    ts.push((
        "model.layers.0.self_attn.surprise".into(),
        (DiskDtype::F32, vec![2], vec![0; 8]),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("broken");
    write(&dir, &fx.dir, ts);
    let err = match Engine::load(&dir, CpuBackend, None, PoolSize::default()) {
        Ok(_) => panic!("a broken checkpoint loaded"),
        Err(e) => e.to_string(),
    };
    for needle in [
        "model.layers.2.self_attn.sinks",
        "model.norm.weight",
        "model.layers.0.self_attn.kv_proj.weight",
        "model.layers.0.self_attn.surprise",
    ] {
        assert!(err.contains(needle), "error does not name {needle}:\n{err}");
    }
}

#[test]
fn incomplete_expert_set_is_refused() {
    let fx = load_fixture("mixed");
    let src = Checkpoint::open(&fx.dir).unwrap();
    // Rewrite with upstream per-expert names, dropping expert 3's up (w3) tensor.
    let mut ts = Vec::new();
    for n in src.names() {
        if let Some(stem) = n.strip_suffix(".mlp.experts.gate_up_proj") {
            let t = src.tensor_f32(&n).unwrap();
            {
                let (e, two_i, h) = (t.shape[0], t.shape[1], t.shape[2]);
                for x in 0..e {
                    for (part, half) in [("w1", 0), ("w3", 1)] {
                        if x == 3 && part == "w3" {
                            continue;
                        }
                        let rows = &t.data[(x * two_i + half * two_i / 2) * h
                            ..(x * two_i + (half + 1) * two_i / 2) * h];
                        let bytes = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
                        ts.push((
                            format!("{stem}.ffn.experts.{x}.{part}.weight"),
                            (DiskDtype::F32, vec![two_i / 2, h], bytes),
                        ));
                    }
                }
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("experts");
    write(&dir, &fx.dir, ts);
    let err = match Checkpoint::open(&dir) {
        Ok(_) => panic!("incomplete experts accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("expert 3"), "{err}");
}
