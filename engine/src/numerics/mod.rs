//! Which numerics the forward pass follows, and DeepSeek's reference quantization
//! functions (`inference/kernel.py` of the model repo) as plain f32 algorithms.
//!
//! - [`Numerics::Transformers`]: f32 activations everywhere, exact against transformers'
//!   forward (which runs none of DeepSeek's quantization).
//! - [`Numerics::Deepseek`]: what DeepSeek's reference inference runs on the released
//!   weights: activations quantized to FP8 per 128 elements before every FP8/FP4 linear
//!   ([`act_quant`]), the compressed KV and sliding-window K=V stored as FP8 with a
//!   power-of-two scale per 64 non-rope values and bf16 rope values
//!   ([`crate::kv::fp8_kv`]), and the indexer's queries and keys Hadamard-rotated
//!   ([`hadamard`]) and FP4-quantized per 32 in simulation ([`fp4_act_quant`]).
//!
//! Under `deepseek` the index-K entries hold rotated keys, so the mode is part of the KV
//! layout ([`crate::kv::KvLayout::numerics`]) and prefill and decode must agree on it.

mod act_quant;
mod hadamard;

pub use act_quant::{
    act_quant, e2m1_to_f32, f32_to_e2m1, fp4_act_quant, pow2_scale, quantize_e4m3_block, ACT_BLOCK,
    FP4_BLOCK, FP4_MAX,
};
pub use hadamard::{hadamard, hadamard_scale};

/// The numerics mode of an engine (`--numerics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Numerics {
    /// f32 activations, exact against transformers (the default).
    #[default]
    Transformers,
    /// DeepSeek's reference quantization of activations, KV and indexer.
    Deepseek,
}

impl Numerics {
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Transformers => "transformers",
            Numerics::Deepseek => "deepseek",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "transformers" => Ok(Numerics::Transformers),
            "deepseek" => Ok(Numerics::Deepseek),
            other => Err(format!(
                "unknown numerics `{other}` (expected transformers or deepseek)"
            )),
        }
    }
}

impl std::fmt::Display for Numerics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
