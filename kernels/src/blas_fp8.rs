//! cuBLASLt's FP8 GEMM with DeepSeek's block scaling, on the device's stream:
//! `out[n x m] (bf16, or f32 where asked and taken: [`Fp8Out`]) = x[n x k] (e4m3, one f32 scale per 1 x 128 block) @ w[m x k]^T
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

/// Bytes of cuBLASLt workspace one FP8 GEMM may use (the one figure cuBLAS's GEMMs use).
pub use crate::blas::WORKSPACE;

/// Which scales the GEMM's operands carry, and which operand is cuBLASLt's A.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Scaling {
    /// Weights one scale per 128 x 128 block, activations one per 1 x 128 (DeepSeek's),
    /// the weights as cuBLASLt's A operand.
    Blocks,
    /// The same scales with the activations as A (the pairing cuBLASLt may require): the
    /// output comes out transposed (`out^T`, m x n row-major).
    BlocksActivationsFirst,
    /// Both operands one scale per 1 x 128: the weights' 128 x 128 block scale repeated
    /// on each of its rows (the same products, a larger scale tensor).
    RowBlocks,
    /// One scale per tensor.
    Tensor,
}

/// The GEMM's output type: bf16 (as DeepSeek's reference GEMMs return), or the fp32 sums
/// unrounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Out {
    Bf16,
    F32,
}

impl Fp8Out {
    /// The order a forward asks for them in: fp32 first (no rounding, no widening pass).
    pub const UNROUNDED_FIRST: [Fp8Out; 2] = [Fp8Out::F32, Fp8Out::Bf16];

    fn dtype(self) -> sys::cudaDataType {
        match self {
            Fp8Out::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            Fp8Out::F32 => sys::cudaDataType::CUDA_R_32F,
        }
    }

    /// Bytes per output value.
    pub fn bytes(self) -> usize {
        match self {
            Fp8Out::Bf16 => 2,
            Fp8Out::F32 => 4,
        }
    }
}

/// How one operand's scales are laid out for cuBLASLt (an operand of `rows x k`, `k`
/// contiguous, `kb = ceil(k / 128)` blocks along `k`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperandScales {
    /// `VEC128_32F`: one per row and 128-block, `[kb][rows]` (the rows contiguous).
    Vec128,
    /// `BLK128x128_32F`: one per 128 x 128 block, `[ceil(rows/128)][pad4(kb)]` (the
    /// k-blocks contiguous, padded to a multiple of 4).
    Blk128,
    /// One for the whole operand.
    Scalar,
}

impl Fp8Scaling {
    /// The order [`Fp8Gemm::new`] tries them in: DeepSeek's scales as they are first.
    pub const PREFERENCE: [Fp8Scaling; 4] = [
        Fp8Scaling::Blocks,
        Fp8Scaling::BlocksActivationsFirst,
        Fp8Scaling::RowBlocks,
        Fp8Scaling::Tensor,
    ];

    pub(crate) fn activations_first(self) -> bool {
        self == Fp8Scaling::BlocksActivationsFirst
    }

    pub fn weight_scales(self) -> OperandScales {
        match self {
            Fp8Scaling::Blocks | Fp8Scaling::BlocksActivationsFirst => OperandScales::Blk128,
            Fp8Scaling::RowBlocks => OperandScales::Vec128,
            Fp8Scaling::Tensor => OperandScales::Scalar,
        }
    }

    pub fn activation_scales(self) -> OperandScales {
        match self {
            Fp8Scaling::Tensor => OperandScales::Scalar,
            _ => OperandScales::Vec128,
        }
    }

    /// In words, for a benchmark's column.
    pub fn describe(self) -> &'static str {
        match self {
            Fp8Scaling::Blocks => "128x128 weight / 1x128 activation scales",
            Fp8Scaling::BlocksActivationsFirst => {
                "128x128 weight / 1x128 activation scales, activations as operand A"
            }
            Fp8Scaling::RowBlocks => "1x128 scales on both (weight block scales per row)",
            Fp8Scaling::Tensor => "per-tensor scales",
        }
    }
}

impl OperandScales {
    fn mode(self) -> Option<u32> {
        use sys::cublasLtMatmulMatrixScale_t as S;
        match self {
            OperandScales::Vec128 => Some(S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as u32),
            OperandScales::Blk128 => Some(S::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as u32),
            OperandScales::Scalar => None,
        }
    }

    /// Scale elements of a `rows x k` operand.
    pub fn len(self, rows: usize, k: usize) -> usize {
        let kb = k.div_ceil(SCALE_BLOCK);
        match self {
            OperandScales::Vec128 => rows * kb,
            OperandScales::Blk128 => rows.div_ceil(SCALE_BLOCK) * kb.next_multiple_of(4),
            OperandScales::Scalar => 1,
        }
    }

    /// A `rows x k` operand's scales in this layout, from their natural grid: row-major
    /// `[ceil(rows / group_rows)][ceil(k / 128)]`, one scale per `group_rows x 128` block
    /// (1 for activations, 128 for DeepSeek's weights: the checkpoints' `.scale` tensor).
    pub fn lay_out(
        self,
        natural: &[f32],
        (rows, k): (usize, usize),
        group_rows: usize,
    ) -> Result<Vec<f32>, String> {
        let kb = k.div_ceil(SCALE_BLOCK);
        let groups = rows.div_ceil(group_rows.max(1));
        if natural.len() != groups * kb {
            return Err(format!(
                "{} scales for a {rows} x {k} operand in groups of {group_rows} rows: expected {}",
                natural.len(),
                groups * kb
            ));
        }
        let at = |row_group: usize, b: usize| natural[row_group * kb + b];
        match self {
            OperandScales::Vec128 => {
                let mut out = vec![0f32; rows * kb];
                for b in 0..kb {
                    for r in 0..rows {
                        out[b * rows + r] = at(r / group_rows, b);
                    }
                }
                Ok(out)
            }
            OperandScales::Blk128 if group_rows == SCALE_BLOCK => {
                let pad = kb.next_multiple_of(4);
                let mut out = vec![0f32; groups * pad];
                for g in 0..groups {
                    out[g * pad..g * pad + kb].copy_from_slice(&natural[g * kb..(g + 1) * kb]);
                }
                Ok(out)
            }
            OperandScales::Blk128 => Err(format!(
                "128 x 128 block scales from scales per {group_rows} rows"
            )),
            OperandScales::Scalar => match natural.split_first() {
                Some((&first, rest)) if rest.iter().all(|&v| v == first) => Ok(vec![first]),
                _ => Err("one scale per tensor from scales that differ".into()),
            },
        }
    }
}

/// Activation scales in their natural grid `[rows][kb]` from the VEC128 layout
/// `[kb][rows]` (the inverse of [`OperandScales::lay_out`] for one scale per row).
pub fn natural_from_vec128(by_block: &[f32], rows: usize, kb: usize) -> Vec<f32> {
    (0..rows * kb)
        .map(|i| by_block[(i % kb) * rows + i / kb])
        .collect()
}

/// Elements along `k` (and weight rows) one scale covers.
pub const SCALE_BLOCK: usize = 128;

/// Scale elements `(weights, activations)` a GEMM of `(n, m, k)` with `scaling` reads.
pub fn scale_counts(dims: (usize, usize, usize), scaling: Fp8Scaling) -> (usize, usize) {
    let (n, m, k) = dims;
    (
        scaling.weight_scales().len(m, k),
        scaling.activation_scales().len(n, k),
    )
}

/// One GEMM shape's descriptors and chosen algorithm (the heuristic's first pick).
pub struct Fp8Gemm {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
    /// Its own, or one shared by GEMMs that run on one stream (see [`Fp8Gemm::first_of_in`]).
    workspace: std::sync::Arc<crate::DevMem<u8>>,
    pub scaling: Fp8Scaling,
    pub out: Fp8Out,
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
    /// multiple of 16), with the first of [`Fp8Scaling::PREFERENCE`] the library takes.
    pub fn new(gpu: &crate::device::Gpu, dims: (usize, usize, usize)) -> BResult<Self> {
        Self::first_of(gpu, dims, &Fp8Scaling::PREFERENCE)
    }

    /// Descriptors with the first of `scalings` the library takes (the ones it refused
    /// before it in [`Fp8Gemm::block_refused`]), or every refusal.
    pub fn first_of(
        gpu: &crate::device::Gpu,
        dims: (usize, usize, usize),
        scalings: &[Fp8Scaling],
    ) -> BResult<Self> {
        let workspace = std::sync::Arc::new(gpu.zeros_owned::<u8>(WORKSPACE)?);
        Self::first_of_in(dims, scalings, &[Fp8Out::Bf16], &workspace)
    }

    /// [`Fp8Gemm::first_of`] with the first of `outs` the library takes for a scaling
    /// (scalings first: the first scaling with any of `outs`), and `workspace` (at least
    /// [`WORKSPACE`] bytes), which GEMMs that run one after another on the device's stream
    /// may share.
    pub fn first_of_in(
        dims: (usize, usize, usize),
        scalings: &[Fp8Scaling],
        outs: &[Fp8Out],
        workspace: &std::sync::Arc<crate::DevMem<u8>>,
    ) -> BResult<Self> {
        let mut refusals = Vec::new();
        for &scaling in scalings {
            for &out in outs {
                match Self::with_workspace(dims, (scaling, out), workspace) {
                    Ok(mut gemm) => {
                        gemm.block_refused = (!refusals.is_empty()).then(|| refusals.join("; "));
                        return Ok(gemm);
                    }
                    Err(e) => refusals.push(format!("{scaling:?} to {out:?}: {e}")),
                }
            }
        }
        Err(dev_err(format!(
            "cuBLASLt FP8 GEMM: every scaling refused ({})",
            refusals.join("; ")
        )))
    }

    /// Descriptors for `(n, m, k)` with `scaling`, or the library's refusal.
    pub fn with(
        gpu: &crate::device::Gpu,
        dims: (usize, usize, usize),
        scaling: Fp8Scaling,
    ) -> BResult<Self> {
        let workspace = std::sync::Arc::new(gpu.zeros_owned::<u8>(WORKSPACE)?);
        Self::with_workspace(dims, (scaling, Fp8Out::Bf16), &workspace)
    }

    fn with_workspace(
        dims: (usize, usize, usize),
        (scaling, out): (Fp8Scaling, Fp8Out),
        workspace: &std::sync::Arc<crate::DevMem<u8>>,
    ) -> BResult<Self> {
        if workspace.len() < WORKSPACE {
            return Err(dev_err(format!(
                "an FP8 GEMM workspace of {} bytes; {WORKSPACE} needed",
                workspace.len()
            )));
        }
        let handle = lt::create_handle().map_err(|e| lt_err("handle", e))?;
        match Self::plan(handle, dims, (scaling, out), workspace.ptr()) {
            Ok((desc, layouts, algo)) => Ok(Fp8Gemm {
                handle,
                desc,
                layouts,
                algo,
                workspace: std::sync::Arc::clone(workspace),
                scaling,
                out,
                block_refused: None,
                dims,
            }),
            Err(e) => {
                // SAFETY: created above, not used after.
                unsafe {
                    let _ = lt::destroy_handle(handle);
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn plan(
        handle: sys::cublasLtHandle_t,
        dims: (usize, usize, usize),
        (scaling, out): (Fp8Scaling, Fp8Out),
        placeholder: u64,
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
        let (a_scales, b_scales) = match scaling.activations_first() {
            false => (scaling.weight_scales(), scaling.activation_scales()),
            true => (scaling.activation_scales(), scaling.weight_scales()),
        };
        if let (Some(a), Some(b)) = (a_scales.mode(), b_scales.mode()) {
            set(A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a)?;
            set(A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b)?;
            // Scale pointers for the heuristic to see (it may check them for
            // non-scalar modes): a placeholder until `run` sets the real ones.
            for attr in [
                A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            ] {
                // SAFETY: `desc` is live; the value is a device pointer.
                unsafe {
                    lt::set_matmul_desc_attribute(
                        desc,
                        attr,
                        (&placeholder as *const u64).cast(),
                        8,
                    )
                }
                .map_err(|e| lt_err("scale pointer", e))?;
            }
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
            lt::create_matrix_layout(out.dtype(), a_cols, b_cols, a_cols as i64),
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
                Err(lt_err(
                    &format!("no {scaling:?}-scaled algorithm to {out:?}"),
                    e,
                ))
            }
        }
    }

    /// `out = x @ w^T` (of type [`Fp8Gemm::out`]; its transpose under
    /// [`Fp8Scaling::BlocksActivationsFirst`]) with
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
        self.run_in(
            self.own_lane(gpu),
            self.layouts,
            (x, x_scale),
            (w, w_scale),
            out,
        )
    }

    /// The device's stream and this GEMM's own workspace.
    fn own_lane(&self, gpu: &crate::device::Gpu) -> (sys::cudaStream_t, u64) {
        (
            gpu.stream.cu_stream() as sys::cudaStream_t,
            self.workspace.ptr(),
        )
    }

    /// [`Fp8Gemm::run`] over `rows` rows of x (a multiple of 16), with this GEMM's
    /// algorithm (chosen for its own row count): one descriptor set serves a range of row
    /// counts, such as the experts' runs of a prefill. The library's refusal of the
    /// algorithm at that count is the error; the weights must be operand A.
    pub fn run_rows(
        &self,
        gpu: &crate::device::Gpu,
        rows: usize,
        x: (u64, u64),
        w: (u64, u64),
        out: u64,
    ) -> BResult<()> {
        self.run_rows_in(self.own_lane(gpu), rows, x, w, out)
    }

    /// [`Fp8Gemm::run_rows`] on a side stream with its own workspace (at least
    /// [`WORKSPACE`] bytes; GEMMs that may run at once must not share one).
    pub(crate) fn run_rows_on(
        &self,
        lane: &crate::lanes::Lane,
        rows: usize,
        x: (u64, u64),
        w: (u64, u64),
        out: u64,
    ) -> BResult<()> {
        if lane.workspace.len() < WORKSPACE {
            return Err(dev_err(format!(
                "a lane's FP8 GEMM workspace of {} bytes; {WORKSPACE} needed",
                lane.workspace.len()
            )));
        }
        let on = (
            lane.stream.cu_stream() as sys::cudaStream_t,
            lane.workspace.ptr(),
        );
        self.run_rows_in(on, rows, x, w, out)
    }

    fn run_rows_in(
        &self,
        lane: (sys::cudaStream_t, u64),
        rows: usize,
        x: (u64, u64),
        w: (u64, u64),
        out: u64,
    ) -> BResult<()> {
        if rows == self.dims.0 {
            return self.run_in(lane, self.layouts, x, w, out);
        }
        if self.scaling.activations_first() || !rows.is_multiple_of(16) {
            return Err(dev_err(format!(
                "an FP8 GEMM planned for {:?} over {rows} rows ({:?})",
                self.dims, self.scaling
            )));
        }
        let (m, k, n) = (self.dims.1 as u64, self.dims.2 as u64, rows as u64);
        let b = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_8F_E4M3, k, n, k as i64)
            .map_err(|e| lt_err("layout", e))?;
        let d = match lt::create_matrix_layout(self.out.dtype(), m, n, m as i64) {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: created above, not used after.
                unsafe {
                    let _ = lt::destroy_matrix_layout(b);
                }
                return Err(lt_err("layout", e));
            }
        };
        let ran = self.run_in(lane, [self.layouts[0], b, d], x, w, out);
        // SAFETY: created above; cuBLASLt reads layouts only while the call is made.
        unsafe {
            let _ = lt::destroy_matrix_layout(b);
            let _ = lt::destroy_matrix_layout(d);
        }
        ran
    }

    /// The GEMM on `stream` with `workspace` (a [`WORKSPACE`] no GEMM running at the same
    /// time uses).
    fn run_in(
        &self,
        (stream, workspace): (sys::cudaStream_t, u64),
        layouts: [sys::cublasLtMatrixLayout_t; 3],
        (x, x_scale): (u64, u64),
        (w, w_scale): (u64, u64),
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
        // SAFETY: the pointers are live device buffers of the sizes `dims` and
        // `scale_counts` give; the workspace lives with `self` or its lane.
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a as *const c_void,
                layouts[0],
                b as *const c_void,
                layouts[1],
                out as *const c_void,
                layouts[2],
                out as *mut c_void,
                layouts[2],
                &self.algo,
                workspace as *mut c_void,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn vec128_puts_the_rows_of_each_k_block_together() {
        // 3 activation rows, k = 300 (3 blocks): natural [r][b] = 10 r + b.
        let natural: Vec<f32> = (0..3)
            .flat_map(|r| (0..3).map(move |b| (10 * r + b) as f32))
            .collect();
        let out = OperandScales::Vec128
            .lay_out(&natural, (3, 300), 1)
            .unwrap();
        assert_eq!(out, vec![0., 10., 20., 1., 11., 21., 2., 12., 22.]);
        assert_eq!(out.len(), OperandScales::Vec128.len(3, 300));
    }

    #[test]
    fn vec128_repeats_a_weight_block_scale_on_each_of_its_rows() {
        // 130 weight rows (two row blocks), k = 256: natural [g][b] = 10 g + b.
        let natural = vec![0., 1., 10., 11.];
        let out = OperandScales::Vec128
            .lay_out(&natural, (130, 256), 128)
            .unwrap();
        assert_eq!(out.len(), 260);
        assert_eq!((out[0], out[127], out[128], out[129]), (0., 0., 10., 10.));
        assert_eq!((out[130], out[257], out[258]), (1., 1., 11.));
    }

    #[test]
    fn natural_from_vec128_undoes_the_layout() {
        let natural: Vec<f32> = (0..21).map(|i| i as f32).collect();
        let laid = OperandScales::Vec128
            .lay_out(&natural, (7, 384), 1)
            .unwrap();
        assert_eq!(natural_from_vec128(&laid, 7, 3), natural);
    }

    #[test]
    fn blk128_pads_the_k_blocks_of_each_row_block_to_four() {
        // 256 rows (two blocks), k = 640 (5 blocks, padded to 8).
        let natural: Vec<f32> = (0..10).map(|i| i as f32 + 1.0).collect();
        let out = OperandScales::Blk128
            .lay_out(&natural, (256, 640), 128)
            .unwrap();
        assert_eq!(out.len(), OperandScales::Blk128.len(256, 640));
        assert_eq!(&out[..8], &[1., 2., 3., 4., 5., 0., 0., 0.]);
        assert_eq!(&out[8..], &[6., 7., 8., 9., 10., 0., 0., 0.]);
    }

    #[test]
    fn layouts_refuse_what_they_cannot_express() {
        assert!(OperandScales::Blk128
            .lay_out(&[1.0; 3], (3, 128), 1)
            .is_err());
        assert!(OperandScales::Scalar
            .lay_out(&[1.0, 2.0], (2, 128), 1)
            .is_err());
        assert_eq!(
            OperandScales::Scalar.lay_out(&[0.5, 0.5], (2, 128), 1),
            Ok(vec![0.5])
        );
        let short = OperandScales::Vec128.lay_out(&[1.0; 2], (3, 128), 1);
        assert!(short.unwrap_err().contains("expected 3"));
    }

    #[test]
    fn scale_counts_follow_each_operands_layout() {
        let dims = (256, 384, 640);
        assert_eq!(scale_counts(dims, Fp8Scaling::Blocks), (3 * 8, 256 * 5));
        assert_eq!(
            scale_counts(dims, Fp8Scaling::RowBlocks),
            (384 * 5, 256 * 5)
        );
        assert_eq!(scale_counts(dims, Fp8Scaling::Tensor), (1, 1));
    }
}
