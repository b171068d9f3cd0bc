//! One CUDA device: context, the single stream every op runs on, cuBLAS, and the loaded
//! kernels. Every CUDA call's result is checked and returned as a `BackendError::Device`.

use crate::compile::{self, CompileError};
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use pdserve_engine::backend::{BResult, BackendError};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Why a CUDA device cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("CUDA driver library (libcuda.so) not found")]
    NoDriver,
    #[error("cuBLAS (libcublas.so / libcublasLt.so) not found on the library path")]
    NoCublas,
    #[error("CUDA device {ordinal} not available: {detail}")]
    NoDevice { ordinal: usize, detail: String },
    #[error("CUDA: {0}")]
    Driver(String),
    #[error(transparent)]
    Compile(#[from] CompileError),
}

pub(crate) fn dev_err(e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{e:?}"))
}

/// A kernel argument, kept alive until the launch.
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

/// Threads per block of every kernel.
pub(crate) const BLOCK: u32 = 256;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<String, CudaFunction>,
    pub arch: String,
    pub device_name: String,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({}, {})", self.device_name, self.arch)
    }
}

/// Whether the CUDA driver library loads on this machine.
#[allow(unsafe_code)]
pub fn driver_present() -> bool {
    // SAFETY: only tries to load the dynamic library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[allow(unsafe_code)]
fn libs_present() -> Result<(), DeviceError> {
    // SAFETY: these only try to load the dynamic libraries.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Err(DeviceError::NoDriver);
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Err(DeviceError::NoCublas);
        }
    }
    if !compile::nvrtc_present() {
        return Err(CompileError::NvrtcMissing.into());
    }
    Ok(())
}

impl Gpu {
    /// Open device `ordinal`: check the libraries, create the context and stream, compile
    /// (or load cached) kernels for the device's compute capability.
    #[allow(unsafe_code)]
    pub fn open(ordinal: usize, cache: Option<PathBuf>) -> Result<Self, DeviceError> {
        libs_present()?;
        let count = CudaContext::device_count().map_err(|e| DeviceError::NoDevice {
            ordinal,
            detail: format!("{e:?}"),
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(DeviceError::NoDevice {
                ordinal,
                detail: format!("{count} device(s) present"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| DeviceError::NoDevice {
            ordinal,
            detail: format!("{e:?}"),
        })?;
        // One stream, no cross-stream event tracking (also required for graph capture).
        // SAFETY: every op of this backend runs on `stream`.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| DeviceError::Driver(format!("{e:?}")))?;
        let arch = format!("compute_{major}{minor}");
        let device_name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| DeviceError::Driver(format!("{e:?}")))?;
        let dir = cache.unwrap_or_else(compile::default_cache_dir);
        let mut funcs = HashMap::new();
        for (name, src) in compile::MODULES {
            let ptx = compile::cached_ptx(name, src, &arch, &dir)?;
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(|e| DeviceError::Driver(format!("loading module {name}: {e:?}")))?;
            for line in src.lines().filter(|l| l.contains("__global__ void ")) {
                let Some(f) = line
                    .split("__global__ void ")
                    .nth(1)
                    .and_then(|r| r.split('(').next())
                else {
                    continue;
                };
                let func = module
                    .load_function(f)
                    .map_err(|e| DeviceError::Driver(format!("kernel {f}: {e:?}")))?;
                funcs.insert(f.to_string(), func);
            }
        }
        Ok(Gpu {
            ctx,
            stream,
            blas,
            funcs,
            arch,
            device_name,
        })
    }

    pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> BResult<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(dev_err)
    }

    pub(crate) fn upload<T: DeviceRepr>(&self, v: &[T]) -> BResult<CudaSlice<T>> {
        if v.is_empty() {
            // A one-element buffer stands in for an empty one (never read).
            #[allow(unsafe_code)]
            // SAFETY: allocated, never read before a write.
            return unsafe { self.stream.alloc::<T>(1) }.map_err(dev_err);
        }
        self.stream.clone_htod(v).map_err(dev_err)
    }

    pub(crate) fn download<T: DeviceRepr + Default + Clone>(
        &self,
        s: &CudaSlice<T>,
        n: usize,
    ) -> BResult<Vec<T>> {
        let mut v = self.stream.clone_dtoh(s).map_err(dev_err)?;
        v.truncate(n);
        Ok(v)
    }

    /// Launch kernel `name` on the stream.
    #[allow(unsafe_code)]
    pub(crate) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        shared: u32,
        args: &[Arg],
    ) -> BResult<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| BackendError::Device(format!("kernel {name} not loaded")))?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::U64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: argument lists match the kernels' signatures in cu/*.cu; buffers are
        // sized by the callers, which validate shapes and KV ranges first.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| BackendError::Device(format!("launch {name}: {e:?}")))
    }

    /// `c[n,m] = x[n,k] @ w[m,k]^T` with row-major operands, batched over `batch` groups
    /// at the given element strides. `ab_bf16`: both inputs bf16 (else both f32); fp32 out.
    #[allow(unsafe_code, clippy::too_many_arguments)]
    pub(crate) fn gemm_nt(
        &self,
        x: u64,
        w: u64,
        c: u64,
        dims: (usize, usize, usize),
        lds: (usize, usize, usize),
        strides: (i64, i64, i64),
        batch: usize,
        ab_bf16: bool,
    ) -> BResult<()> {
        let (n, m, k) = dims;
        if n == 0 || m == 0 {
            return Ok(());
        }
        let (ldx, ldw, ldc) = lds;
        let dt = if ab_bf16 {
            blas_sys::cudaDataType::CUDA_R_16BF
        } else {
            blas_sys::cudaDataType::CUDA_R_32F
        };
        let alpha = 1f32;
        let beta = 0f32;
        let to_i =
            |v: usize| i32::try_from(v).map_err(|_| dev_err(format!("gemm dim {v} too large")));
        // SAFETY: pointers come from live device buffers sized by the caller.
        unsafe {
            blas_result::gemm_strided_batched_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                to_i(m)?,
                to_i(n)?,
                to_i(k)?,
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                dt,
                to_i(ldw)?,
                strides.1,
                x as *const std::ffi::c_void,
                dt,
                to_i(ldx)?,
                strides.0,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                to_i(ldc)?,
                strides.2,
                to_i(batch)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| BackendError::Device(format!("cublas gemm: {e:?}")))
    }

    pub fn synchronize(&self) -> BResult<()> {
        self.stream.synchronize().map_err(dev_err)
    }
}

/// Grid size for a grid-stride elementwise kernel over `n` values.
pub(crate) fn grid_1d(n: usize) -> (u32, u32, u32) {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 65_535);
    (blocks as u32, 1, 1)
}
