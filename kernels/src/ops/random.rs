//! Random tensors generated on the device (`cu/random.cu`): the same counter-based values
//! as `pdserve_engine::backend::random` computes on the host.

use crate::device::Gpu;
use crate::launch::{grid_1d, Arg};
use crate::tensor::{Buf, GpuTensor};
use pdserve_engine::backend::{BResult, WeightInit};

/// A `rows x cols` tensor of `init` values keyed by `seed`, stored bf16 or fp32, in its
/// own allocation (weights outlive every decode step).
pub(crate) fn random_tensor(
    g: &Gpu,
    rows: usize,
    cols: usize,
    bf16: bool,
    init: WeightInit,
    seed: u64,
) -> BResult<GpuTensor> {
    let n = rows * cols;
    let (kind, p0, p1) = init.kernel_params();
    let (buf, ptr, kernel) = if bf16 {
        let s = g.zeros_owned::<u16>(n)?;
        let p = g.ptr(&s);
        (Buf::Bf16(s), p, "k_random_bf16")
    } else {
        let s = g.zeros_owned::<f32>(n)?;
        let p = g.ptr(&s);
        (Buf::F32(s), p, "k_random_f32")
    };
    g.launch(
        kernel,
        grid_1d(n),
        0,
        &[
            Arg::Ptr(ptr),
            Arg::I64(n as i64),
            // The kernel reads the same 8 bytes as `unsigned long long`.
            Arg::I64(seed as i64),
            Arg::I32(kind),
            Arg::F32(p0),
            Arg::F32(p1),
        ],
    )?;
    Ok(GpuTensor { rows, cols, buf })
}
