//! Views of a [`GpuTensor`]'s storage that op files need before a launch: the fp32
//! buffer of an activation, the address of an fp32 output. Errors are shape errors (a
//! caller passed the wrong kind of tensor), never device faults.

use crate::devmem::DevMem;
use crate::kernels::{DevPtr, Elem};
use crate::launch::dev_err;
use crate::tensor::{Buf, GpuTensor};
pub(crate) use pdserve_engine::backend::shapes::shape_err;
use pdserve_engine::backend::BResult;

/// The fp32 storage of activation `t`; a bf16 tensor is a shape error of `op`.
pub(crate) fn f32_buf<'a>(t: &'a GpuTensor, op: &'static str) -> BResult<&'a DevMem<f32>> {
    match &t.buf {
        Buf::F32(s) => Ok(s),
        Buf::Bf16(_) => Err(shape_err(
            op,
            format!(
                "expects an fp32 activation, got a bf16 [{}x{}] tensor",
                t.rows, t.cols
            ),
        )),
    }
}

/// Device address of fp32 output tensor `t`.
pub(crate) fn out_ptr(t: &GpuTensor) -> BResult<DevPtr> {
    match &t.buf {
        Buf::F32(s) => Ok(DevPtr::of(s)),
        Buf::Bf16(_) => Err(dev_err("bf16 output buffer")),
    }
}

/// Element type and device address of `t`'s storage: which variant of a kernel compiled
/// per storage reads it (embedding tables, expert weights).
pub(crate) fn storage(t: &GpuTensor) -> (Elem, u64) {
    match &t.buf {
        Buf::Bf16(s) => (Elem::Bf16, s.ptr()),
        Buf::F32(s) => (Elem::F32, s.ptr()),
    }
}
