//! Random tensors generated on the device (`cu/random.cu`): the same counter-based values
//! as `pdserve_engine::backend::counter_rng` computes on the host.

use crate::device::Gpu;
use crate::kernels::{self, DevPtr, Elem};
use crate::launch::grid_1d;
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
    let (buf, ptr, elem) = if bf16 {
        let s = g.zeros_owned::<u16>(n)?;
        let p = DevPtr::of(&s);
        (Buf::Bf16(s), p, Elem::Bf16)
    } else {
        let s = g.zeros_owned::<f32>(n)?;
        let p = DevPtr::of(&s);
        (Buf::F32(s), p, Elem::F32)
    };
    g.launch(
        grid_1d(n),
        0,
        &kernels::Random {
            variant: elem,
            out: ptr,
            n: n as i64,
            seed,
            kind,
            a: p0,
            b: p1,
        },
    )?;
    Ok(GpuTensor::new(rows, cols, buf))
}
