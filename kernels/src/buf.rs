//! Views of a [`GpuTensor`]'s storage that op files need before a launch: the fp32
//! buffer of an activation, the address of an fp32 output. Errors are shape errors (a
//! caller passed the wrong kind of tensor), never device faults.

use crate::devmem::DevMem;
use crate::kernels::{DevPtr, Elem};
use crate::launch::dev_err;
use crate::tensor::{Buf, GpuTensor};
pub(crate) use pdserve_engine::backend::shapes::shape_err;
use pdserve_engine::backend::BResult;

/// The fp32 storage of activation `t`; any other storage is a shape error of `op`.
pub(crate) fn f32_buf<'a>(t: &'a GpuTensor, op: &'static str) -> BResult<&'a DevMem<f32>> {
    match &t.buf {
        Buf::F32(s) => Ok(s),
        other => Err(shape_err(
            op,
            format!(
                "expects an fp32 activation, got a {} [{}x{}] tensor",
                kind(other),
                t.rows,
                t.cols
            ),
        )),
    }
}

/// What a storage is, for errors.
fn kind(b: &Buf) -> &'static str {
    match b {
        Buf::F32(_) => "fp32",
        Buf::Bf16(_) => "bf16",
        Buf::Stored(_) => "stored FP8/FP4",
    }
}

/// Device address of fp32 output tensor `t`.
pub(crate) fn out_ptr(t: &GpuTensor) -> BResult<DevPtr> {
    match &t.buf {
        Buf::F32(s) => Ok(DevPtr::of(s)),
        other => Err(dev_err(format!("{} output buffer", kind(other)))),
    }
}

/// Element type and device address of `t`'s storage: which variant of a kernel compiled
/// per storage reads it (embedding tables, expert weights). A stored FP8/FP4 weight has
/// its own kernels: a shape error of `op` here.
pub(crate) fn storage(t: &GpuTensor, op: &'static str) -> BResult<(Elem, u64)> {
    match &t.buf {
        Buf::Bf16(s) => Ok((Elem::Bf16, s.ptr())),
        Buf::F32(s) => Ok((Elem::F32, s.ptr())),
        Buf::Stored(_) => Err(shape_err(
            op,
            format!(
                "has no kernel for a stored FP8/FP4 [{}x{}] tensor",
                t.rows, t.cols
            ),
        )),
    }
}
