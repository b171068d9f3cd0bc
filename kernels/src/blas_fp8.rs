//! cuBLASLt's FP8 GEMM with DeepSeek's block scaling, on the device's stream:
//! `out[n x m] (bf16) = x[n x k] (e4m3, one f32 scale per 1 x 128 block) @ w[m x k]^T
//! (e4m3, one f32 scale per 128 x 128 block)`, fp32 accumulation: the form of the
//! checkpoints' FP8 weights and of their reference activation quantization. Where the
//! library lacks the block modes (cuBLAS before 12.9), one f32 scale per tensor, and the
//! GEMM says so ([`Fp8Gemm::scaling`]).

use crate::launch::dev_err;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use pdserve_engine::backend::BResult;
use std::ffi::c_void;

/// Bytes of cuBLASLt workspace.
const WORKSPACE: usize = 32 << 20;

/// How the operands' scales are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// Weights one scale per 128 x 128 block, activations one per 1 x 128 (DeepSeek's).
    Blocks,
    /// One scale per tensor.
    Tensor,
}

/// Scale elements `(weights, activations)` a GEMM of `(n, m, k)` with `scaling` reads.
pub fn scale_counts(dims: (usize, usize, usize), scaling: Fp8Scaling) -> (usize, usize) {
    let (n, m, k) = dims;
    match scaling {
        Fp8Scaling::Blocks => (m.div_ceil(128) * k.div_ceil(128), n * k.div_ceil(128)),
        Fp8Scaling::Tensor => (1, 1),
    }
}

/// One GEMM shape's descriptors and chosen algorithm (the heuristic's first pick).
pub struct Fp8Gemm {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: crate::DevMem<u8>,
    pub scaling: Fp8Scaling,
    /// Why block scaling was not taken, when it was not.
    pub block_refused: Option<String>,
    pub dims: (usize, usize, usize),
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> pdserve_engine::backend::BackendError {
    dev_err(format!("cuBLASLt {what}: {e:?}"))
}

#[allow(unsafe_code)]
impl Fp8Gemm {
    /// Descriptors for `(n, m, k)` (rows of x, rows of w, the shared dimension; each a
    /// multiple of 16), block-scaled where the library can, per-tensor otherwise.
    pub fn new(gpu: &crate::device::Gpu, dims: (usize, usize, usize)) -> BResult<Self> {
        let workspace = gpu.zeros_owned::<u8>(WORKSPACE)?;
        let handle = lt::create_handle().map_err(|e| lt_err("handle", e))?;
        let mut last: Option<pdserve_engine::backend::BackendError> = None;
        for scaling in [Fp8Scaling::Blocks, Fp8Scaling::Tensor] {
            match Self::plan(handle, dims, scaling) {
                Ok((desc, layouts, algo)) => {
                    return Ok(Fp8Gemm {
                        handle,
                        desc,
                        layouts,
                        algo,
                        workspace,
                        scaling,
                        block_refused: last.map(|e| e.to_string()),
                        dims,
                    })
                }
                Err(e) => last = Some(e),
            }
        }
        // SAFETY: created above, not used after.
        unsafe {
            let _ = lt::destroy_handle(handle);
        }
        Err(last.unwrap_or_else(|| dev_err("cuBLASLt FP8 GEMM: no plan")))
    }

    #[allow(clippy::type_complexity)]
    fn plan(
        handle: sys::cublasLtHandle_t,
        dims: (usize, usize, usize),
        scaling: Fp8Scaling,
    ) -> BResult<(
        sys::cublasLtMatmulDesc_t,
        [sys::cublasLtMatrixLayout_t; 3],
        sys::cublasLtMatmulAlgo_t,
    )> {
        let (n, m, k) = dims;
        let (n, m, k) = (n as u64, m as u64, k as u64);
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| lt_err("matmul desc", e))?;
        use sys::cublasLtMatmulDescAttributes_t as A;
        let set = |attr: A, v: &u32| {
            // SAFETY: `desc` is live; the attribute's value is a 4-byte enum.
            unsafe {
                lt::set_matmul_desc_attribute(desc, attr, (v as *const u32).cast(), 4)
                    .map_err(|e| lt_err("desc attribute", e))
            }
        };
        // Column-major: D (m x n) = W^T-stored (k x m, transposed) . X (k x n).
        set(
            A::CUBLASLT_MATMUL_DESC_TRANSA,
            &(cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as u32),
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_TRANSB,
            &(cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N as u32),
        )?;
        if scaling == Fp8Scaling::Blocks {
            use sys::cublasLtMatmulMatrixScale_t as S;
            set(
                A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                &(S::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as u32),
            )?;
            set(
                A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                &(S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as u32),
            )?;
        }
        let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
        let layouts = [
            lt::create_matrix_layout(e4m3, k, m, k as i64),
            lt::create_matrix_layout(e4m3, k, n, k as i64),
            lt::create_matrix_layout(sys::cudaDataType::CUDA_R_16BF, m, n, m as i64),
        ];
        let mut ok = Vec::new();
        for l in layouts {
            ok.push(l.map_err(|e| lt_err("layout", e))?);
        }
        let layouts = [ok[0], ok[1], ok[2]];
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("preference", e))?;
        let ws = WORKSPACE as u64;
        // SAFETY: every descriptor is live; the preference is destroyed right after.
        let heur = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )
            .map_err(|e| lt_err("preference attribute", e))?;
            let h = lt::get_matmul_algo_heuristic(
                handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref,
            );
            let _ = lt::destroy_matmul_pref(pref);
            h
        };
        match heur {
            Ok(h) => Ok((desc, layouts, h.algo)),
            Err(e) => {
                // SAFETY: created above, not used after.
                unsafe {
                    let _ = lt::destroy_matmul_desc(desc);
                    for l in layouts {
                        let _ = lt::destroy_matrix_layout(l);
                    }
                }
                Err(lt_err(&format!("no {scaling:?}-scaled algorithm"), e))
            }
        }
    }

    /// `out = x @ w^T` with the scales (sized by [`scale_counts`]) on `stream`, now.
    pub fn run(
        &self,
        gpu: &crate::device::Gpu,
        x: u64,
        x_scale: u64,
        w: u64,
        w_scale: u64,
        out: u64,
    ) -> BResult<()> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let set_ptr = |attr: A, p: u64| {
            // SAFETY: `desc` is live; the value is a device pointer.
            unsafe {
                lt::set_matmul_desc_attribute(self.desc, attr, (&p as *const u64).cast(), 8)
                    .map_err(|e| lt_err("scale pointer", e))
            }
        };
        set_ptr(A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, w_scale)?;
        set_ptr(A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, x_scale)?;
        let (alpha, beta) = (1f32, 0f32);
        let stream = gpu.stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: the pointers are live device buffers of the sizes `dims` and
        // `scale_counts` give; the workspace lives with `self`.
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                self.layouts[0],
                x as *const c_void,
                self.layouts[1],
                out as *const c_void,
                self.layouts[2],
                out as *mut c_void,
                self.layouts[2],
                &self.algo,
                self.workspace.ptr() as *mut c_void,
                WORKSPACE,
                stream,
            )
        }
        .map_err(|e| lt_err("matmul", e))
    }
}

#[allow(unsafe_code)]
impl Drop for Fp8Gemm {
    fn drop(&mut self) {
        // SAFETY: created by `new`, used by nothing after the drop.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
