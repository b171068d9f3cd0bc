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

/// Launches `func` on `stream` with programmatic stream serialization allowed: the kernel
/// may be scheduled before the previous kernel in the stream completes, and waits for it
/// in `pdl_enter()` (cu/common.cuh), the first statement of every kernel.
///
/// # Safety
/// `args` must match the kernel's parameters in order and type, as for any launch, and
/// the kernel must begin with `pdl_enter()` (the CPU test
/// `every_kernel_waits_for_its_predecessor_before_anything_else`).
#[allow(unsafe_code)]
pub(crate) unsafe fn launch_programmatic(
    func: &cudarc::driver::CudaFunction,
    stream: &cudarc::driver::CudaStream,
    grid: (u32, u32, u32),
    shared: u32,
    args: &[Arg],
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    use std::ffi::c_void;
    let mut params: Vec<*mut c_void> = args
        .iter()
        .map(|a| match a {
            Arg::Ptr(v) => v as *const u64 as *mut c_void,
            Arg::I32(v) => v as *const i32 as *mut c_void,
            Arg::I64(v) => v as *const i64 as *mut c_void,
            Arg::F32(v) => v as *const f32 as *mut c_void,
        })
        .collect();
    // SAFETY: an all-zero launch attribute is valid plain data; the one field set below is
    // the one the attribute's id names.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: BLOCK,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    stream.context().bind_to_thread()?;
    // SAFETY: `params` points at the argument values, alive for the call; the caller
    // vouches for their match with the kernel.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}
