//! How a checkpoint stores its weights: `quantization_config` and `expert_dtype` of
//! DeepSeek's released config.json. Only the values the released V4 checkpoints use are
//! accepted; anything else is refused naming the field, because a misread format would
//! load as silently wrong weights.

use serde_json::Value;

use super::error::{field_err, Res};
use super::fields::{as_usize, Obj};

/// `quantization_config.quant_method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantMethod {
    /// Block-scaled FP8 linears.
    Fp8,
}

/// `quantization_config.fmt`: the element format of FP8 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Format {
    /// Sign, 4-bit exponent (bias 7), 3-bit mantissa; no infinities.
    E4m3,
}

/// `quantization_config.scale_fmt`: the element format of the `.scale` tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleFormat {
    /// Unsigned 8-bit exponent, byte `b` meaning `2^(b-127)`.
    Ue8m0,
}

/// `quantization_config.activation_scheme`: how the reference quantizes activations.
/// Under `--numerics deepseek` the engine does the same (`crate::numerics::act_quant`);
/// under the default `transformers` numerics activations stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationScheme {
    /// Per-128-element scales computed at run time.
    Dynamic,
}

/// `expert_dtype`: storage of the routed experts' `w1`/`w2`/`w3`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertDtype {
    /// Block-scaled FP8 like the attention weights (base checkpoints; the default).
    Fp8,
    /// FP4 e2m1, two per byte, one ue8m0 scale per 32 inputs (instruct checkpoints).
    Fp4,
}

/// The only block size the released checkpoints (and the loader) use.
pub const WEIGHT_BLOCK: [usize; 2] = [128, 128];
/// Inputs sharing one scale in an FP4 expert row.
pub const FP4_GROUP: usize = 32;

/// A quantized checkpoint's storage formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Quantization {
    pub method: QuantMethod,
    pub fmt: Fp8Format,
    pub scale_fmt: ScaleFormat,
    pub activation_scheme: ActivationScheme,
    /// `[rows, cols]` of weight elements sharing one scale.
    pub weight_block_size: [usize; 2],
    pub expert_dtype: ExpertDtype,
}

/// One string-valued field that must be one of `choices` (`(json value, typed value)`).
fn choice<T: Copy>(q: &Obj, key: &str, choices: &[(&str, T)], default: Option<&str>) -> Res<T> {
    let value = match (q.get(key), default) {
        (None, Some(d)) => d,
        (None, None) => return Err(field_err(q.name(key), "missing")),
        (Some(v), _) => v.as_str().ok_or_else(|| q.wrong(key, "a string", v))?,
    };
    choices
        .iter()
        .find(|(name, _)| *name == value)
        .map(|&(_, t)| t)
        .ok_or_else(|| {
            let known: Vec<String> = choices.iter().map(|(n, _)| format!("\"{n}\"")).collect();
            field_err(
                q.name(key),
                format!(
                    "unsupported value \"{value}\" (supported: {})",
                    known.join(", ")
                ),
            )
        })
}

/// `quantization_config` and `expert_dtype` of the top-level config object; `None` when the
/// checkpoint is not quantized (no `quantization_config`; `expert_dtype` is then ignored, as
/// a dequantized re-save may keep it).
pub(super) fn parse_quantization(f: &Obj) -> Res<Option<Quantization>> {
    let Some(map) = f.opt_object("quantization_config")? else {
        return Ok(None);
    };
    let q = Obj {
        map,
        prefix: "quantization_config",
    };
    let block_field = q.name("weight_block_size");
    let block = match q.get("weight_block_size") {
        None => return Err(field_err(block_field, "missing")),
        Some(Value::Array(items)) => items.iter().map(as_usize).collect::<Option<Vec<_>>>(),
        Some(_) => None,
    };
    let weight_block_size = match block.as_deref() {
        Some(&[r, c]) if [r, c] == WEIGHT_BLOCK => WEIGHT_BLOCK,
        _ => {
            let got = q.get("weight_block_size").map_or(Value::Null, Value::clone);
            return Err(field_err(
                block_field,
                format!("unsupported block size {got} (supported: [128, 128])"),
            ));
        }
    };
    Ok(Some(Quantization {
        method: choice(&q, "quant_method", &[("fp8", QuantMethod::Fp8)], None)?,
        fmt: choice(&q, "fmt", &[("e4m3", Fp8Format::E4m3)], Some("e4m3"))?,
        // Required: without it transformers' FP8 format means F32 `weight_scale_inv` scales.
        scale_fmt: choice(&q, "scale_fmt", &[("ue8m0", ScaleFormat::Ue8m0)], None)?,
        activation_scheme: choice(
            &q,
            "activation_scheme",
            &[("dynamic", ActivationScheme::Dynamic)],
            Some("dynamic"),
        )?,
        weight_block_size,
        expert_dtype: choice(
            f,
            "expert_dtype",
            &[("fp8", ExpertDtype::Fp8), ("fp4", ExpertDtype::Fp4)],
            Some("fp8"),
        )?,
    }))
}
