//! Device tensors: fp32 activations, bf16 weight matrices.

use crate::devmem::DevMem;

/// Storage of a [`GpuTensor`].
#[derive(Debug)]
pub enum Buf {
    F32(DevMem<f32>),
    /// bf16 bits.
    Bf16(DevMem<u16>),
}

/// A row-major 2-D tensor on the device.
#[derive(Debug)]
pub struct GpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub buf: Buf,
}

impl GpuTensor {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_bf16(&self) -> bool {
        matches!(self.buf, Buf::Bf16(_))
    }
}

/// Storage of uploaded weight matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// bf16 matrices (the router and hyper-connection maps stay fp32); bf16 GEMMs with
    /// fp32 accumulation.
    #[default]
    Bf16,
    /// Everything fp32, fp32 GEMMs: a reference mode for checking kernels.
    F32,
}

impl std::str::FromStr for WeightDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" | "bfloat16" => Ok(WeightDtype::Bf16),
            "f32" | "fp32" | "float32" => Ok(WeightDtype::F32),
            other => Err(format!(
                "unknown weight dtype `{other}` (expected bf16 or f32)"
            )),
        }
    }
}

/// Whether an uploaded tensor is stored in bf16: matrices (weights used by GEMMs and the
/// expert kernels) are; vectors (norm weights, sinks, biases, hyper-connection scales)
/// stay fp32.
pub fn stores_bf16(rows: usize, cols: usize) -> bool {
    rows >= 2 && cols >= 2
}
