//! Which linears DeepSeek's reference runs as FP8/FP4 GEMMs, and so, under `deepseek`
//! numerics, feed FP8-quantized activations (`linear()` of the reference's `model.py`
//! quantizes exactly when the weight is stored FP8 or FP4).

use crate::checkpoint::{weight_format, WeightFormat};
use crate::config::ModelConfig;

/// One layer's linears whose weights the checkpoint stores FP8/FP4. `wo_a` is stored FP8
/// too, but the reference dequantizes it to bf16 when converting (its `model.py` declares
/// `wo_a` bf16) and runs the grouped output projection unquantized; the compressors, the
/// indexer's `weights_proj`, the router and the head are bf16/fp32 linears.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct QuantizedLinears {
    pub q_a: bool,
    pub q_b: bool,
    pub kv: bool,
    pub o_b: bool,
    pub index_q_b: bool,
    pub shared: bool,
    pub routed: bool,
}

impl QuantizedLinears {
    /// From the stored formats `cfg`'s `quantization_config` prescribes for layer `li`
    /// (none without one: a bf16 checkpoint's linears are bf16 in the reference too).
    pub fn of(cfg: &ModelConfig, li: usize) -> Self {
        let stored = |suffix: &str| {
            weight_format(cfg, &format!("model.layers.{li}.{suffix}")) != WeightFormat::Float
        };
        QuantizedLinears {
            q_a: stored("self_attn.q_a_proj.weight"),
            q_b: stored("self_attn.q_b_proj.weight"),
            kv: stored("self_attn.kv_proj.weight"),
            o_b: stored("self_attn.o_b_proj.weight"),
            index_q_b: stored("self_attn.compressor.indexer.q_b_proj.weight"),
            shared: stored("mlp.shared_experts.gate_proj.weight"),
            routed: stored("mlp.experts.gate_up_proj"),
        }
    }
}
