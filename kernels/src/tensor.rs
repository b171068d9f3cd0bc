//! Device tensors: fp32 activations, bf16 weight matrices.

use cudarc::driver::CudaSlice;

/// Storage of a [`GpuTensor`].
#[derive(Debug)]
pub enum Buf {
    F32(CudaSlice<f32>),
    /// bf16 bits.
    Bf16(CudaSlice<u16>),
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

/// Whether an uploaded tensor is stored in bf16: matrices (weights used by GEMMs and the
/// expert kernels) are; vectors (norm weights, sinks, biases, hyper-connection scales)
/// stay fp32.
pub fn stores_bf16(rows: usize, cols: usize) -> bool {
    rows >= 2 && cols >= 2
}
