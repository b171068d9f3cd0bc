//! cuBLASLt's FP8 GEMM with DeepSeek's block scaling, on the device's stream:
//! `out[n x m] (bf16) = x[n x k] (e4m3, one f32 scale per 1 x 128 block) @ w[m x k]^T
//! (e4m3, one f32 scale per 128 x 128 block)`, fp32 accumulation: the form of the
//! checkpoints' FP8 weights and of their reference activation quantization. Where the
//! library refuses the block modes (cuBLAS before 12.9, or a pairing it does not take),
//! one f32 scale per tensor, and the GEMM says so ([`Fp8Gemm::scaling`],
//! [`Fp8Gemm::block_refused`]).

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
    /// Weights one scale per 128 x 128 block, activations one per 1 x 128 (DeepSeek's),
    /// the weights as cuBLASLt's A operand.
    Blocks,
    /// The same scales with the activations as A (the pairing cuBLASLt may require): the
    /// output comes out transposed (`out^T`, m x n row-major).
    BlocksActivationsFirst,
    /// One scale per tensor.
    Tensor,
}

impl Fp8Scaling {
    fn activations_first(self) -> bool {
        self == Fp8Scaling::BlocksActivationsFirst
    }
}

/// Scale elements `(weights, activations)` a GEMM of `(n, m, k)` with `scaling` reads.
pub fn scale_counts(dims: (usize, usize, usize), scaling: Fp8Scaling) -> (usize, usize) {
    let (n, m, k) = dims;
    match scaling {
        Fp8Scaling::Blocks | Fp8Scaling::BlocksActivationsFirst => {
            (m.div_ceil(128) * k.div_ceil(128), n * k.div_ceil(128))
        }
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
        let mut refusals = Vec::new();
        for scaling in [
            Fp8Scaling::Blocks,
            Fp8Scaling::BlocksActivationsFirst,
            Fp8Scaling::Tensor,
        ] {
            match Self::plan(handle, dims, scaling) {
                Ok((desc, layouts, algo)) => {
                    return Ok(Fp8Gemm {
                        handle,
                        desc,
                        layouts,
                        algo,
                        workspace,
                        scaling,
                        block_refused: (!refusals.is_empty()).then(|| refusals.join("; ")),
                        dims,
                    })
                }
                Err(e) => {
                    refusals.push(format!("{scaling:?}: {e}"));
                    last = Some(e);
                }
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
        use sys::cublasLtMatmulMatrixScale_t as S;
        let (blk, vec) = (
            S::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as u32,
            S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as u32,
        );
        let (a_mode, b_mode) = match scaling {
            Fp8Scaling::Blocks => (Some(blk), Some(vec)),
            Fp8Scaling::BlocksActivationsFirst => (Some(vec), Some(blk)),
            Fp8Scaling::Tensor => (None, None),
        };
        if let (Some(a), Some(b)) = (a_mode, b_mode) {
            set(A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a)?;
            set(A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b)?;
        }
        let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
        // A is the weight (k x m stored, transposed) or, activations first, x (k x n).
        let (a_cols, b_cols) = match scaling.activations_first() {
            false => (m, n),
            true => (n, m),
        };
        let layouts = [
            lt::create_matrix_layout(e4m3, k, a_cols, k as i64),
            lt::create_matrix_layout(e4m3, k, b_cols, k as i64),
            lt::create_matrix_layout(
                sys::cudaDataType::CUDA_R_16BF,
                a_cols,
                b_cols,
                a_cols as i64,
            ),
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

    /// `out = x @ w^T` (its transpose under [`Fp8Scaling::BlocksActivationsFirst`]) with
    /// the scales (sized by [`scale_counts`]) on the device's stream, now.
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
        let ((a, a_scale), (b, b_scale)) = match self.scaling.activations_first() {
            false => ((w, w_scale), (x, x_scale)),
            true => ((x, x_scale), (w, w_scale)),
        };
        set_ptr(A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale)?;
        set_ptr(A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale)?;
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
                a as *const c_void,
                self.layouts[0],
                b as *const c_void,
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
