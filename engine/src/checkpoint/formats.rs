//! Which stored format each weight must have under a config's `quantization_config`, and
//! the check of a checkpoint's weights and `.scale` tensors against it.

use crate::config::{ExpertDtype, ModelConfig, FP4_GROUP, WEIGHT_BLOCK};

use super::{Checkpoint, DiskDtype, ShapeMismatch, StoredPart, ValidationReport};

/// How one float tensor is stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// F32, BF16 or F16.
    Float,
    /// F8_E4M3 with an F8_E8M0 `.scale` of shape `[ceil(out/128), ceil(in/128)]`.
    Fp8Block,
    /// FP4 e2m1 packed two per byte as I8 `[out, in/2]`, F8_E8M0 `.scale` `[out, in/32]`.
    Fp4Packed,
}

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

/// Check every stored part of canonical `name` (several for per-expert tensors) and its
/// scale against `format`, adding each problem to `report` under the disk name at fault.
/// Returns whether the tensor is usable.
pub(super) fn check_stored(
    ckpt: &Checkpoint,
    name: &str,
    format: WeightFormat,
    report: &mut ValidationReport,
) -> bool {
    let mut usable = true;
    for part in ckpt.stored_parts(name) {
        usable &= check_part(&part, format, report);
    }
    usable
}

fn check_part(part: &StoredPart<'_>, format: WeightFormat, report: &mut ValidationReport) -> bool {
    let weight_dtype = match format {
        WeightFormat::Float => float_dtype(part.dtype),
        WeightFormat::Fp8Block => part.dtype == DiskDtype::F8_E4M3,
        WeightFormat::Fp4Packed => part.dtype == DiskDtype::I8,
    };
    let mut usable = weight_dtype;
    if !weight_dtype {
        report.bad_dtype.push((part.name.to_string(), part.dtype));
    }
    let want_scale = match (format, part.shape) {
        (WeightFormat::Float, _) => {
            if let Some(s) = part.scale {
                report.unexpected.push(s.name.to_string());
            }
            return usable;
        }
        (WeightFormat::Fp8Block, &[rows, cols]) => {
            vec![
                rows.div_ceil(WEIGHT_BLOCK[0]),
                cols.div_ceil(WEIGHT_BLOCK[1]),
            ]
        }
        (WeightFormat::Fp4Packed, &[rows, half_cols]) => {
            vec![rows, (2 * half_cols).div_ceil(FP4_GROUP)]
        }
        // Not 2-D: the logical shape check reports it; no scale shape to derive.
        _ => return false,
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
