//! cuBLAS on the device's stream: one handle with a fixed workspace, so that no GEMM
//! allocates (required under stream capture), and the one GEMM form the backend uses.

use crate::launch::dev_err;
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use pdserve_engine::backend::{BResult, BackendError};
use std::sync::Arc;

/// Bytes of workspace one cuBLAS or cuBLASLt GEMM may use (Hopper GEMMs want up to 32
/// MiB); GEMMs that may run at once each need their own.
pub const WORKSPACE: usize = 32 << 20;

pub(crate) struct Blas {
    handle: CudaBlas,
    /// Set once as the handle's workspace; lives as long as the handle.
    _workspace: CudaSlice<u8>,
}

impl Blas {
    /// A handle on `stream` with its workspace set; the error says which step failed.
    #[allow(unsafe_code)]
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, String> {
        let blas = CudaBlas::new(stream.clone()).map_err(|e| format!("{e:?}"))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE)
            .map_err(|e| format!("cuBLAS workspace: {e:?}"))?;
        {
            let (wp, _sync) = workspace.device_ptr(stream);
            // SAFETY: the workspace lives as long as the handle (both in `Blas`).
            unsafe {
                blas_sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    wp as *mut std::ffi::c_void,
                    WORKSPACE,
                )
            }
            .result()
            .map_err(|e| format!("cublasSetWorkspace: {e:?}"))?;
        }
        Ok(Blas {
            handle: blas,
            _workspace: workspace,
        })
    }

    /// `c = x @ w^T` as [`crate::device::Gpu::gemm_nt`] describes it, on the stream now.
    #[allow(unsafe_code, clippy::too_many_arguments)]
    pub fn gemm_nt(
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
                *self.handle.handle(),
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
}
