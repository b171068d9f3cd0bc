//! The committed `quantized` fixture (scripts/gen_fixtures.py + scripts/released_layout.py):
//! a transformers-made checkpoint in exactly DeepSeek's released layout. These tests pin
//! that it IS that layout (so a regenerated fixture cannot silently turn float) and that the
//! CPU engine reproduces transformers' logits on it, greedy tokens included. parity.rs runs
//! its chunking / batching / transfer checks on it as on every fixture.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use pdserve_engine::checkpoint::{
    expected_tensors, validate, weight_format, Checkpoint, DiskDtype, WeightFormat,
};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::generate::logits_prefill_decode;
use pdserve_engine::kv::EntryDtype;

const TOL: f64 = 1e-4;

fn disk_names(dir: &std::path::Path) -> Vec<String> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.tensors().into_keys().collect()
}

#[test]
fn the_quantized_fixture_is_in_the_released_layout() {
    let dir = fixtures_dir().join("quantized");
    let cfg = ModelConfig::from_model_dir(&dir).unwrap();
    let q = cfg
        .quantization
        .expect("config.json has a quantization_config");
    assert_eq!(
        q.expert_dtype,
        pdserve_engine::config::ExpertDtype::Fp4,
        "instruct layout: FP4 routed experts"
    );
    let ckpt = Checkpoint::open(&dir).unwrap();
    validate(&ckpt, &cfg).unwrap();

    let names = disk_names(&dir);
    assert!(
        names.iter().all(|n| !n.starts_with("model.")),
        "upstream names carry no `model.` prefix"
    );
    assert!(names.iter().any(|n| n.starts_with("mtp.")), "mtp.* present");
    for n in ["embed.weight", "head.weight", "norm.weight", "hc_head_fn"] {
        assert!(names.iter().any(|d| d == n), "{n} on disk");
    }

    let (mut fp8, mut fp4, mut partial) = (0, 0, 0);
    for t in expected_tensors(&cfg) {
        let parts = ckpt.stored_parts(&t.name);
        assert!(!parts.is_empty(), "{} stored", t.name);
        match weight_format(&cfg, &t.name) {
            WeightFormat::Fp8Block => {
                let p = &parts[0];
                assert_eq!(p.dtype, DiskDtype::F8_E4M3, "{}", p.name);
                let s = p.scale.unwrap();
                assert_eq!(s.dtype, DiskDtype::F8_E8M0, "{}", s.name);
                let (rows, cols) = (p.shape[0], p.shape[1]);
                assert_eq!(s.shape, [rows.div_ceil(128), cols.div_ceil(128)]);
                partial += usize::from(rows % 128 != 0 || cols % 128 != 0);
                fp8 += 1;
            }
            WeightFormat::Fp4Packed => {
                for p in &parts {
                    assert_eq!(p.dtype, DiskDtype::I8, "{}", p.name);
                    let s = p.scale.unwrap();
                    assert_eq!(s.shape, [p.shape[0], 2 * p.shape[1] / 32], "{}", s.name);
                    fp4 += 1;
                }
            }
            WeightFormat::Float if t.int => assert_eq!(parts[0].dtype, DiskDtype::I64),
            WeightFormat::Float => {
                // F32: sinks and the hyper-connection tensors; BF16 everything else.
                let f32_by_design = t.name.ends_with(".sinks")
                    || t.name.contains("_hc.")
                    || t.name.contains(".hc_head.");
                let want = if f32_by_design {
                    DiskDtype::F32
                } else {
                    DiskDtype::BF16
                };
                assert_eq!(parts[0].dtype, want, "{}", parts[0].name);
            }
        }
    }
    let layers = cfg.num_hidden_layers;
    let csa = cfg
        .layer_types
        .iter()
        .filter(|k| **k == pdserve_engine::config::LayerKind::Csa)
        .count();
    assert_eq!(
        fp8,
        8 * layers + csa,
        "5 attention + 3 shared-expert weights per layer, indexer wq_b per CSA layer"
    );
    assert_eq!(fp4, 3 * cfg.n_routed_experts * layers);
    assert_eq!(partial, fp8, "every FP8 weight has a partial 128-block");
}

#[test]
fn the_quantized_fixture_matches_transformers_with_the_same_greedy_tokens() {
    let fx = load_fixture("quantized");
    let mut eng = engine(&fx.dir, EntryDtype::F32, None);
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold(0, |b, (i, x)| if *x > v[b] { i } else { b })
    };
    for &k in &fx.prefill_lens {
        let got = logits_prefill_decode(&mut eng, &fx.tokens, k, 0).unwrap();
        let (err, row) = max_rel_err(&got, &fx.logits);
        println!("quantized: prefill {k}: max rel err {err:.3e} (row {row})");
        assert!(err < TOL, "prefill {k}: rel err {err:.3e} at row {row}");
        for (t, (g, w)) in got.iter().zip(&fx.logits).enumerate() {
            assert_eq!(argmax(g), argmax(w), "prefill {k}: greedy token of row {t}");
        }
    }
}
