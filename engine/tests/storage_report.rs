//! `model::storage::storage_report` (what `pdserve inspect` prints) on the quantized fixture
//! and the embedded bf16 model: every number computed here from the shapes by hand.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::fixtures_dir;
use pdserve_engine::checkpoint::Checkpoint;
use pdserve_engine::config::ModelConfig;
use pdserve_engine::model::storage::{storage_report, StorageClass, StorageReport};
use std::path::Path;

/// Tensor data bytes of a single-file checkpoint: the file less its header.
fn data_bytes(dir: &Path) -> u64 {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    bytes.len() as u64 - 8 - header
}

fn tensor<'a>(
    r: &'a StorageReport,
    name: &str,
) -> &'a pdserve_engine::model::storage::TensorStorage {
    r.tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("{name} not in the report"))
}

/// FP8 bytes of a `[rows, cols]` weight: one byte per element plus one per 128x128 block.
fn fp8_bytes(rows: u64, cols: u64) -> u64 {
    rows * cols + rows.div_ceil(128) * cols.div_ceil(128)
}

/// FP4 bytes of a `[rows, cols]` weight: half a byte per element plus one per 32.
fn fp4_bytes(rows: u64, cols: u64) -> u64 {
    rows * cols / 2 + rows * cols / 32
}

#[test]
fn quantized_fixture_storage_by_tensor_and_class() {
    let dir = fixtures_dir().join("quantized");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let r = storage_report(&ckpt, 2);

    let wq_a = tensor(&r, "model.layers.0.self_attn.q_a_proj.weight");
    assert_eq!(wq_a.disk_name, "layers.0.attn.wq_a.weight");
    assert_eq!(wq_a.class, StorageClass::Fp8);
    assert_eq!(wq_a.dtype, "F8_E4M3");
    assert_eq!(
        (wq_a.shape.clone(), wq_a.stored_shape.clone()),
        (vec![144, 160], vec![144, 160])
    );
    let scale = wq_a.scale.as_ref().unwrap();
    assert_eq!(
        (scale.name.as_str(), scale.dtype.as_str()),
        ("layers.0.attn.wq_a.scale", "F8_E8M0")
    );
    assert_eq!(scale.shape, [2, 2]);
    assert_eq!(wq_a.bytes, 144 * 160 + 4);
    assert_eq!(wq_a.gpu_bytes, wq_a.bytes, "FP8 held as stored");

    let gate_up = tensor(&r, "model.layers.1.mlp.experts.gate_up_proj");
    assert_eq!(gate_up.class, StorageClass::Fp4);
    assert_eq!(gate_up.parts, 8, "4 experts x (w1, w3)");
    assert_eq!(gate_up.disk_name, "layers.1.ffn.experts.0.w1.weight");
    assert_eq!(
        (gate_up.shape.clone(), gate_up.stored_shape.clone()),
        (vec![4, 128, 160], vec![64, 80])
    );
    assert_eq!(gate_up.bytes, 8 * fp4_bytes(64, 160));
    assert_eq!(gate_up.gpu_bytes, gate_up.bytes, "FP4 held as stored");

    // BF16 matrix: 2 bytes on the GPU; the router stays fp32; F32 hc maps; host-only tid2eid.
    let wkv = tensor(&r, "model.layers.0.self_attn.compressor.kv_proj.weight");
    assert_eq!(
        (wkv.class, wkv.bytes, wkv.gpu_bytes),
        (StorageClass::Bf16, 192 * 160 * 2, 192 * 160 * 2)
    );
    let router = tensor(&r, "model.layers.1.mlp.gate.weight");
    assert_eq!(
        (router.class, router.bytes, router.gpu_bytes),
        (StorageClass::Bf16, 4 * 160 * 2, 4 * 160 * 4)
    );
    let hc = tensor(&r, "model.layers.0.attn_hc.fn");
    assert_eq!(
        (hc.class, hc.bytes, hc.gpu_bytes),
        (StorageClass::F32, 24 * 640 * 4, 24 * 640 * 4)
    );
    let tid2eid = tensor(&r, "model.layers.0.mlp.gate.tid2eid");
    assert_eq!(
        (tid2eid.class, tid2eid.bytes, tid2eid.gpu_bytes),
        (StorageClass::Int, 96 * 2 * 8, 0)
    );

    // Per layer: wq_a, wq_b, wkv, wo_a, wo_b, shared w1, w3, w2; the CSA layer's indexer wq_b.
    let per_layer = fp8_bytes(144, 160)
        + fp8_bytes(192, 144)
        + fp8_bytes(96, 160)
        + fp8_bytes(160, 96)
        + fp8_bytes(160, 160)
        + 2 * fp8_bytes(64, 160)
        + fp8_bytes(160, 64);
    let fp8 = r.by_class[&StorageClass::Fp8];
    assert_eq!(fp8.tensors, 17);
    assert_eq!(fp8.bytes, 2 * per_layer + fp8_bytes(640, 144));
    assert_eq!(fp8.gpu_bytes, fp8.bytes);
    let fp4 = r.by_class[&StorageClass::Fp4];
    assert_eq!(fp4.tensors, 4, "gate_up and down per layer");
    assert_eq!(fp4.bytes, 2 * 4 * 3 * fp4_bytes(64, 160));
    assert_eq!(r.by_class[&StorageClass::Int].gpu_bytes, 0);

    // mtp.0: enorm [160] bf16, wq_a [144, 160] FP8, one FP4 expert w1 [64, 160].
    assert_eq!(
        r.unused_bytes,
        160 * 2 + fp8_bytes(144, 160) + fp4_bytes(64, 160)
    );
    assert_eq!(r.total.bytes + r.unused_bytes, data_bytes(&dir));
    let sum = |f: fn(&pdserve_engine::model::storage::ClassTotal) -> u64| -> u64 {
        r.by_class.values().map(f).sum()
    };
    assert_eq!(sum(|c| c.bytes), r.total.bytes);
    assert_eq!(sum(|c| c.gpu_bytes), r.total.gpu_bytes);
    assert_eq!(r.total.tensors, r.tensors.len());
}

#[test]
fn embedded_model_storage_follows_cuda_weights() {
    let dir = pdserve_engine::embedded::model_dir().unwrap();
    let cfg = ModelConfig::from_model_dir(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let (v, h) = (cfg.vocab_size as u64, cfg.hidden_size as u64);
    for elem in [2, 4] {
        let r = storage_report(&ckpt, elem);
        assert_eq!(r.unused_bytes, 0);
        assert_eq!(r.total.bytes, data_bytes(&dir));
        assert!(!r.by_class.contains_key(&StorageClass::Fp8));
        let embed = tensor(&r, "model.embed_tokens.weight");
        assert_eq!(
            (embed.class, embed.bytes, embed.gpu_bytes),
            (StorageClass::Bf16, v * h * 2, v * h * elem)
        );
        // Kept fp32 whatever --cuda-weights says: the router and the hc maps, and vectors.
        let router = tensor(&r, "model.layers.3.mlp.gate.weight");
        assert_eq!(router.gpu_bytes, 16 * h * 4);
        let hc = tensor(&r, "model.layers.0.ffn_hc.fn");
        assert_eq!(hc.gpu_bytes, 24 * 4 * h * 4);
        let norm = tensor(&r, "model.norm.weight");
        assert_eq!((norm.bytes, norm.gpu_bytes), (h * 2, h * 4));
        let ids = tensor(&r, "model.layers.0.mlp.gate.tid2eid");
        assert_eq!(ids.gpu_bytes, 0);
        let bf16 = r.by_class[&StorageClass::Bf16];
        assert_eq!(
            bf16.tensors + r.by_class[&StorageClass::Int].tensors,
            r.tensors.len()
        );
    }
    // bf16 matrices: halving the element size halves exactly the Matrix tensors' bytes.
    let (r2, r4) = (storage_report(&ckpt, 2), storage_report(&ckpt, 4));
    let matrix_bf16_bytes: u64 = r2
        .tensors
        .iter()
        .zip(&r4.tensors)
        .filter(|(a, b)| a.gpu_bytes != b.gpu_bytes)
        .map(|(a, b)| {
            assert_eq!(2 * a.gpu_bytes, b.gpu_bytes, "{}", a.name);
            a.gpu_bytes
        })
        .sum();
    assert_eq!(r4.total.gpu_bytes - r2.total.gpu_bytes, matrix_bf16_bytes);
    assert!(
        matrix_bf16_bytes > r2.total.bytes / 2,
        "most bytes are matrices"
    );
}
