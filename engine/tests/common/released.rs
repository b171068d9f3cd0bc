//! Writing small checkpoints in DeepSeek's released layout from a test: the tensor form
//! the tests build, the FP8-stored weights' released names, and the safetensors writer.

use pdserve_engine::checkpoint::DiskDtype;
use safetensors::tensor::TensorView;
use serde_json::Value;
use std::path::Path;

/// dtype, shape, little-endian bytes.
pub type Tensor = (DiskDtype, Vec<usize>, Vec<u8>);

/// Canonical name suffix -> released (upstream) name suffix of every block-scaled FP8 weight.
pub const FP8_NAMES: &[(&str, &str)] = &[
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    (
        "mlp.shared_experts.gate_proj.weight",
        "ffn.shared_experts.w1.weight",
    ),
    (
        "mlp.shared_experts.up_proj.weight",
        "ffn.shared_experts.w3.weight",
    ),
    (
        "mlp.shared_experts.down_proj.weight",
        "ffn.shared_experts.w2.weight",
    ),
    (
        "self_attn.compressor.indexer.q_b_proj.weight",
        "attn.indexer.wq_b.weight",
    ),
];

/// `config` and `tensors` as a single-file checkpoint in `dir`.
pub fn write(dir: &Path, config: &Value, tensors: &[(String, Tensor)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
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
