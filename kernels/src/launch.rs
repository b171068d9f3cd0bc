//! Launch helpers every op file imports (nothing here imports back): the kernel argument
//! representation, the block size of every kernel, grid sizing and the device-error
//! conversion.

use pdserve_engine::backend::BackendError;

/// A CUDA call's failure as the backend's device error.
pub(crate) fn dev_err(e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{e:?}"))
}

/// A kernel argument, kept alive until the launch.
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// Threads per block of every kernel.
pub(crate) const BLOCK: u32 = 256;

/// Grid size for a grid-stride elementwise kernel over `n` values.
pub(crate) fn grid_1d(n: usize) -> (u32, u32, u32) {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 65_535);
    (blocks as u32, 1, 1)
}
