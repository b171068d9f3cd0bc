//! Which stored format each weight must have under a config's `quantization_config`, and
//! the check of a checkpoint's weights and `.scale` tensors against it.

use crate::config::{ExpertDtype, ModelConfig, FP4_GROUP, WEIGHT_BLOCK};

use super::names::{canonical, Canonical};
pub use super::stored::WeightFormat;
use super::{Checkpoint, DiskDtype, ShapeMismatch, StoredPart, ValidationReport};

/// Canonical-name suffixes of the weights DeepSeek's quantized checkpoints store as
/// block-scaled FP8 (`attn.wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`, `shared_experts.w1/2/3`,
/// `indexer.wq_b`); the compressors, the indexer's scorer, the router, embeddings and head
/// stay BF16.
const FP8_WEIGHTS: &[&str] = &[
    ".self_attn.q_a_proj.weight",
    ".self_attn.q_b_proj.weight",
    ".self_attn.kv_proj.weight",
    ".self_attn.o_a_proj.weight",
    ".self_attn.o_b_proj.weight",
    ".mlp.shared_experts.gate_proj.weight",
    ".mlp.shared_experts.up_proj.weight",
    ".mlp.shared_experts.down_proj.weight",
    ".compressor.indexer.q_b_proj.weight",
];

/// The stored format `cfg` prescribes for the float tensor with canonical `name`.
pub fn weight_format(cfg: &ModelConfig, name: &str) -> WeightFormat {
    let Some(q) = cfg.quantization else {
        return WeightFormat::Float;
    };
    if name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj") {
        match q.expert_dtype {
            ExpertDtype::Fp8 => WeightFormat::Fp8Block,
            ExpertDtype::Fp4 => WeightFormat::Fp4Packed,
        }
    } else if FP8_WEIGHTS.iter().any(|s| name.ends_with(s)) {
        WeightFormat::Fp8Block
    } else {
        WeightFormat::Float
    }
}

fn float_dtype(d: DiskDtype) -> bool {
    matches!(d, DiskDtype::F32 | DiskDtype::BF16 | DiskDtype::F16)
}

/// Check the float tensor with canonical `name` against `format`, adding each problem to
/// `report`. A float tensor is reported under its canonical name, as before quantized
/// formats existed (a scale next to it is unexpected); a quantized one part by part (several
/// for per-expert tensors) under the disk name at fault. Returns whether it is usable.
pub(super) fn check_stored(
    ckpt: &Checkpoint,
    name: &str,
    format: WeightFormat,
    report: &mut ValidationReport,
) -> bool {
    let parts = ckpt.stored_parts(name);
    let (weight_dtype, scale_shape): (DiskDtype, ScaleShape) = match format {
        WeightFormat::Fp8Block => (DiskDtype::F8_E4M3, fp8_scale_shape),
        WeightFormat::Fp4Packed => (DiskDtype::I8, fp4_scale_shape),
        WeightFormat::Float => {
            for scale in parts.iter().filter_map(|p| p.scale) {
                report.unexpected.push(match canonical(scale.name) {
                    Canonical::Whole(c) => c,
                    _ => scale.name.to_string(),
                });
            }
            return match parts.first() {
                Some(p) if !float_dtype(p.dtype) => {
                    report.bad_dtype.push((name.to_string(), p.dtype));
                    false
                }
                _ => true,
            };
        }
    };
    let mut usable = true;
    for part in parts {
        usable &= check_quantized_part(&part, weight_dtype, scale_shape, report);
    }
    usable
}

/// The scale shape a quantized weight of stored shape `shape` needs (`None`: not 2-D).
type ScaleShape = fn(&[usize]) -> Option<Vec<usize>>;

fn fp8_scale_shape(shape: &[usize]) -> Option<Vec<usize>> {
    match *shape {
        [rows, cols] => Some(vec![
            rows.div_ceil(WEIGHT_BLOCK[0]),
            cols.div_ceil(WEIGHT_BLOCK[1]),
        ]),
        _ => None,
    }
}

/// FP4 stores half the columns: `[out, in/2]` -> `[out, ceil(in/32)]`.
fn fp4_scale_shape(shape: &[usize]) -> Option<Vec<usize>> {
    match *shape {
        [rows, half_cols] => Some(vec![rows, (2 * half_cols).div_ceil(FP4_GROUP)]),
        _ => None,
    }
}

fn check_quantized_part(
    part: &StoredPart<'_>,
    weight_dtype: DiskDtype,
    scale_shape: ScaleShape,
    report: &mut ValidationReport,
) -> bool {
    let mut usable = part.dtype == weight_dtype;
    if !usable {
        report.bad_dtype.push((part.name.to_string(), part.dtype));
    }
    // Scales are defined for 2-D weights only (experts stored one tensor per expert).
    let Some(want_scale) = scale_shape(part.shape) else {
        report.bad_values.push(format!(
            "{}: a quantized weight is stored 2-D (per expert), found shape {:?}",
            part.name, part.shape
        ));
        return false;
    };
    let Some(scale) = part.scale else {
        report
            .missing
            .push(super::scale_name(part.name).unwrap_or_else(|| format!("{}.scale", part.name)));
        return false;
    };
    if scale.dtype != DiskDtype::F8_E8M0 {
        report.bad_dtype.push((scale.name.to_string(), scale.dtype));
        usable = false;
    }
    if scale.shape != want_scale.as_slice() {
        report.wrong_shape.push(ShapeMismatch {
            name: scale.name.to_string(),
            expected: want_scale,
            found: scale.shape.to_vec(),
        });
        usable = false;
    }
    usable
}
