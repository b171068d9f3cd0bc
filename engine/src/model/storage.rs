//! What every tensor of a checkpoint occupies: on disk (dtype, shape, `.scale`, bytes) and
//! in the GPU backend's memory, for `pdserve inspect`. Read from the safetensors headers
//! only: no tensor data is touched, so it is instant on a 150 GB checkpoint.
//!
//! GPU bytes follow the CUDA backend's storage rules: FP8 / FP4 weights are held as stored
//! (weight and scale bytes, no bf16 copy: its FP8/FP4 GEMMs read them); every other float
//! tensor as [`weight_use`] decides (a [`WeightUse::Matrix`] at the `--cuda-weights` element
//! size, the rest fp32); integer tables (`tid2eid`) stay on the host.

use std::collections::BTreeMap;

use serde::Serialize;

use super::weights::{rows_cols, weight_use};
use crate::backend::WeightUse;
use crate::checkpoint::{Checkpoint, DiskDtype, StoredPart};

/// How a tensor is stored, the classes `pdserve inspect` totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageClass {
    /// F8_E4M3 with an F8_E8M0 block scale.
    Fp8,
    /// FP4 e2m1 packed in I8 with an F8_E8M0 group scale.
    Fp4,
    Bf16,
    F16,
    F32,
    /// I64 / I32 (`tid2eid`).
    Int,
}

impl StorageClass {
    fn of(part: &StoredPart<'_>) -> Option<Self> {
        Some(match part.dtype {
            DiskDtype::F8_E4M3 => StorageClass::Fp8,
            DiskDtype::I8 if part.scale.is_some() => StorageClass::Fp4,
            DiskDtype::BF16 => StorageClass::Bf16,
            DiskDtype::F16 => StorageClass::F16,
            DiskDtype::F32 => StorageClass::F32,
            DiskDtype::I64 | DiskDtype::I32 => StorageClass::Int,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            StorageClass::Fp8 => "fp8",
            StorageClass::Fp4 => "fp4",
            StorageClass::Bf16 => "bf16",
            StorageClass::F16 => "f16",
            StorageClass::F32 => "f32",
            StorageClass::Int => "int",
        }
    }
}

/// A stored `.scale` tensor (of the first part, for per-expert tensors).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScaleStorage {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
}

/// One tensor the model uses (canonical name), as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TensorStorage {
    /// Canonical name (transformers' module path).
    pub name: String,
    /// Disk name of its first stored part.
    pub disk_name: String,
    /// Stored tensors behind it (per-expert checkpoints: one per expert and projection).
    pub parts: usize,
    pub class: StorageClass,
    /// Element dtype on disk, as safetensors names it.
    pub dtype: String,
    /// Shape as the model uses it (FP4: twice the stored columns; experts stacked).
    pub shape: Vec<usize>,
    /// Shape of one stored part.
    pub stored_shape: Vec<usize>,
    pub scale: Option<ScaleStorage>,
    /// Bytes on disk, scales included.
    pub bytes: u64,
    /// Bytes the GPU backend holds for it.
    pub gpu_bytes: u64,
}

/// Tensor count and bytes of one storage class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ClassTotal {
    pub tensors: usize,
    pub bytes: u64,
    pub gpu_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StorageReport {
    pub tensors: Vec<TensorStorage>,
    pub by_class: BTreeMap<StorageClass, ClassTotal>,
    /// All tensors the model uses.
    pub total: ClassTotal,
    /// Bytes on disk the model never reads (`mtp.*`).
    pub unused_bytes: u64,
    /// Element size of a GPU matrix weight (2: `--cuda-weights bf16`, 4: f32).
    pub gpu_matrix_elem_bytes: u64,
}

/// The storage of every tensor `ckpt` holds under a canonical name. `gpu_matrix_elem_bytes`
/// is the CUDA backend's element size for [`WeightUse::Matrix`] float weights.
pub fn storage_report(ckpt: &Checkpoint, gpu_matrix_elem_bytes: u64) -> StorageReport {
    let tensors: Vec<TensorStorage> = ckpt
        .names()
        .into_iter()
        .filter_map(|name| tensor_storage(ckpt, name, gpu_matrix_elem_bytes))
        .collect();
    let mut by_class: BTreeMap<StorageClass, ClassTotal> = BTreeMap::new();
    let mut total = ClassTotal::default();
    for t in &tensors {
        for sum in [by_class.entry(t.class).or_default(), &mut total] {
            sum.tensors += 1;
            sum.bytes += t.bytes;
            sum.gpu_bytes += t.gpu_bytes;
        }
    }
    StorageReport {
        unused_bytes: ckpt.total_bytes().saturating_sub(total.bytes),
        tensors,
        by_class,
        total,
        gpu_matrix_elem_bytes,
    }
}

fn tensor_storage(ckpt: &Checkpoint, name: String, matrix_elem: u64) -> Option<TensorStorage> {
    let parts = ckpt.stored_parts(&name);
    let first = parts.first()?;
    let class = StorageClass::of(first)?;
    let shape = ckpt.shape(&name)?;
    let bytes = ckpt.tensor_bytes(&name);
    let numel = shape.iter().product::<usize>() as u64;
    let (rows, cols) = rows_cols(&shape);
    let gpu_bytes = match class {
        StorageClass::Fp8 | StorageClass::Fp4 => bytes,
        StorageClass::Int => 0,
        _ if weight_use(&name, rows, cols) == WeightUse::Matrix => numel * matrix_elem,
        _ => numel * 4,
    };
    Some(TensorStorage {
        disk_name: first.name.to_string(),
        parts: parts.len(),
        class,
        dtype: format!("{:?}", first.dtype),
        stored_shape: first.shape.to_vec(),
        scale: first.scale.map(|s| ScaleStorage {
            name: s.name.to_string(),
            dtype: format!("{:?}", s.dtype),
            shape: s.shape.to_vec(),
        }),
        shape,
        bytes,
        gpu_bytes,
        name,
    })
}
