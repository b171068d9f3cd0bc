//! One CUDA device: context, the single stream every op runs on, cuBLAS, and the loaded
//! kernels. Every CUDA call's result is checked and returned as a `BackendError::Device`.

use crate::blas::Blas;
use crate::compile::{self, CompileError};
use crate::devmem::DevMem;
use crate::kernels::{Kernel, REGISTRY};
use crate::lanes::{Lanes, DEFAULT_LANES};
use crate::launch::{dev_err, launch_programmatic, Arg, BLOCK};
use crate::recorder::{StepMode, StepRecord};
use crate::rope_cache::RopeTableCache;
use crate::step::{StepState, Temp, Upload};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use pdserve_engine::backend::{BResult, BackendError};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Dynamic shared memory the attention kernel may use (Hopper allows up to 227 KiB).
pub(crate) const ATTENTION_SHARED: usize = 160 * 1024;
/// Dynamic shared memory the tensor-core attention kernels may take: sm_90's opt-in
/// maximum per block.
pub(crate) const MMA_SHARED: usize = 227 * 1024;
/// Dynamic shared memory `k_hc_pre` may keep a row of streams in: hc * hidden fp32 values
/// up to V4-Pro's 4 x 7168 (larger rows read the streams twice instead).
pub(crate) const HC_PRE_SHARED: usize = 112 * 1024;

/// Copies to the host at least this large go through the page-locked buffer.
const PINNED_MIN: usize = 1 << 20;

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

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: Blas,
    /// Decode-step recorder and arena (see `step`, `recorder`, `alloc`).
    step: Mutex<StepState>,
    /// Page-locked bounce buffer of large device-to-host copies.
    pinned: Mutex<Option<cudarc::driver::PinnedHostSlice<u8>>>,
    /// Page-locked buffer of early downloads (`crate::early_download`), between uses.
    early: Mutex<Option<cudarc::driver::PinnedHostSlice<u8>>>,
    /// Rope tables kept between calls outside decode steps (see `ops::rope_tables`).
    rope_tables: Mutex<RopeTableCache>,
    /// Side streams of a prefill's per-expert GEMMs, made at first use (`crate::lanes`,
    /// `ops/spread.rs`).
    pub(crate) lanes: Mutex<Option<Lanes>>,
    /// How many: 1 queues every expert GEMM on the stream (see
    /// [`crate::CudaBackend::set_expert_lanes`]).
    pub(crate) expert_lanes: usize,
    /// Every kernel of [`REGISTRY`] by name.
    funcs: HashMap<&'static str, CudaFunction>,
    pub arch: String,
    pub device_name: String,
    /// Streaming multiprocessors (how many blocks fill the device: attention's key splits).
    pub(crate) sms: usize,
    /// `--deterministic`: batch-invariant kernels only (see [`crate::CudaBackend::set_deterministic`]).
    pub(crate) deterministic: bool,
    /// Which kernel computes attention (see [`crate::CudaBackend::set_attention_kernel`]).
    pub(crate) attention_kernel: AttentionKernel,
    /// Whether the direct tensor-core attention reads bf16 queries and writes bf16 output
    /// (see [`crate::CudaBackend::set_attention_bf16_io`]).
    pub(crate) attention_bf16_io: bool,
    /// When the tensor-core attention's fp8 keys are converted to bf16 once per batch
    /// (see [`crate::CudaBackend::set_key_conversion`]).
    pub(crate) key_conversion: KeyConversion,
    /// Rows and entry tiles per block of the tensor-core indexer scores, when gpu-check
    /// fixes them (see [`crate::CudaBackend::set_indexer_blocking`]); `None`: chosen by
    /// the launch's shape.
    pub(crate) indexer_blocking: Option<IndexerBlocking>,
    /// Prefill indexer scores through the cuBLAS GEMM path even where the tensor-core
    /// kernel takes the layer (see [`crate::CudaBackend::set_indexer_gemm`]).
    pub(crate) indexer_gemm: bool,
    /// Which kernels run the routed experts inside decode steps (see
    /// [`crate::CudaBackend::set_expert_kernel`]).
    pub(crate) expert_kernel: ExpertKernel,
    /// Which kernel runs the dense GEMMs of decode-sized batches (see
    /// [`crate::CudaBackend::set_dense_kernel`]).
    pub(crate) dense_kernel: DenseKernel,
    /// Kernels launched with programmatic dependent launch (see
    /// [`crate::CudaBackend::set_programmatic_launch`]); on by default from sm_90.
    pub(crate) programmatic_launch: bool,
    /// fp32 weights, the reference mode gpu-check holds to the CPU engine: attention stays
    /// on the fp32 split-key kernel (unless [`AttentionKernel::TensorCores`] asks for tensor
    /// cores, whose products then take hi + lo bf16 halves) and the prefill indexer's GEMM
    /// is fp32. Under bf16 weights both round their query-side operands to bf16.
    pub(crate) fp32_reference: bool,
}

/// Which kernels run the routed experts of a decode step (and of short forwards). The
/// serving choice is [`ExpertKernel::Auto`]; the others are for A/B runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertKernel {
    /// The tensor-core kernels (`k_moe_*_mma`) where the shape allows: stored FP8/FP4 experts
    /// at every batch, bf16 ones past 2 rows (measured faster than the padded-batch cuBLAS
    /// GEMMs at batch 8-256 with bf16 experts, and than the CUDA-core grouped kernels in
    /// every format there); else the CUDA-core grouped kernels.
    #[default]
    Auto,
    /// The tensor-core kernels wherever the shape allows, bf16 batches included.
    TensorCores,
    /// What the tensor-core kernels replaced: the padded-batch GEMMs for bf16 (with a pick
    /// per expert on average), else the CUDA-core grouped kernels; and for dense
    /// stored-format weights of 17-128 rows the bf16 copy + cuBLAS.
    CudaCores,
}

/// Which kernel runs a dense GEMM (`x @ w^T`) of a decode-sized batch, at most
/// `moe_mma::DENSE_MAX_ROWS` rows, outside the fp32 reference mode and `--deterministic`.
/// The serving choice is [`DenseKernel::Auto`]; the others are for A/B runs.
///
/// Measured on the H200 (bench decode, 4 V4-Flash layers, 64 experts, graphs; stop 36):
/// stored FP8 weights at batch 8 3.85 ms per step on the fused CUDA-core kernel, 3.04 on
/// the tensor-core kernel (batch 1 1.98 -> 1.89); bf16 weights on the tensor-core kernel
/// instead of cuBLAS were slower at every batch (1: 1.87 -> 1.95 ms, 64: 5.21 -> 5.57,
/// 128: 5.83 -> 6.91).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseKernel {
    /// Stored FP8/FP4 weights on the weight-streaming tensor-core kernel
    /// (`k_matmul_mma_*`), bf16 weights on cuBLAS.
    #[default]
    Auto,
    /// The tensor-core kernel for bf16 weights too.
    TensorCores,
    /// What the tensor-core kernel replaced for stored weights of at most
    /// `stored::FUSED_MAX_ROWS` rows: the fused CUDA-core kernel (`k_matmul_q`).
    Fused,
}

/// How the tensor-core indexer scores (`k_index_scores_mma`, `ops::indexer`) divide their
/// work: `rows` (1 or 2) consecutive plan rows and `tiles` consecutive tiles of 128 entries
/// per block. Two rows of one sequence share each entry tile; rows of different sequences
/// take turns. Every blocking gives the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexerBlocking {
    pub rows: usize,
    pub tiles: usize,
}

/// Which kernel computes attention. The serving choice is [`AttentionKernel::Auto`]; the
/// others are the kernels it replaced, which gpu-check runs on the same inputs to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// Tensor cores under bf16 weights where the entries are bf16 or fp8 and the shape
    /// allows (`k_attention_wgmma` on Hopper at head_dim 512, else `k_attention_mma`;
    /// products in bf16); otherwise, and always under fp32 weights (the reference mode),
    /// the fp32 split-key kernel.
    #[default]
    Auto,
    /// Tensor cores wherever the entries and shape allow, under fp32 weights with each
    /// query and probability split into hi + lo bf16 halves (~16 bits: close to, not at,
    /// fp32), else the split-key kernel: gpu-check's A/B of the tensor-core kernel.
    TensorCores,
    /// The `mma.sync` kernel (`k_attention_mma`) where [`AttentionKernel::Auto`] takes
    /// wgmma (the kernel wgmma replaced: gpu-check's and the bench's A/B), hi + lo under
    /// fp32 weights as [`AttentionKernel::TensorCores`].
    MmaSync,
    /// The fp32 split-key kernel (`k_attention_split`) for every entry type.
    Split,
    /// One block per row and group of heads (`k_attention`), the first kernel.
    Reference,
}

/// Where the tensor-core attention converts fp8 KV entries to the bf16 its products take.
/// Both give the same bits; the serving choice is [`KeyConversion::Auto`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyConversion {
    /// Once per batch (`k_kv_dequant_bf16`) where its rows read each key often enough to
    /// repay the conversion (a prefill), else in the kernel.
    #[default]
    Auto,
    /// In the attention kernel, every time a tile loads a key.
    PerTile,
    /// Once per batch outside decode steps however few rows read each key (gpu-check's
    /// A/B on short prompts).
    Once,
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

/// How many CUDA devices the driver sees: 0 where no driver library loads.
#[allow(unsafe_code)]
pub fn count() -> Result<usize, DeviceError> {
    // SAFETY: this only tries to load the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Ok(0);
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(cudarc::driver::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE)) => {
            Ok(0)
        }
        Err(e) => Err(DeviceError::Driver(format!("counting devices: {e:?}"))),
    }
}

/// Keep memory freed into the device's default pool cached there instead of handing it
/// back to the driver at every synchronisation (the pool's default threshold is 0): each
/// forward frees and allocates its temporaries again (hundreds of MiB per MoE layer in a
/// long prefill), and re-mapping them after every routing download cost milliseconds.
#[allow(unsafe_code)]
fn keep_freed_memory_pooled(ctx: &CudaContext) -> Result<(), DeviceError> {
    use cudarc::driver::sys;
    let fail = |what: &str, r: sys::CUresult| DeviceError::Driver(format!("{what}: {r:?}"));
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is written by the driver for the context's device; the attribute
    // value is a u64, as CU_MEMPOOL_ATTR_RELEASE_THRESHOLD takes.
    unsafe {
        let r = sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device());
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(fail("default memory pool", r));
        }
        let mut keep = u64::MAX;
        let r = sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        );
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(fail("memory pool release threshold", r));
        }
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
        // A created stream: the legacy default stream cannot be captured.
        let stream = ctx
            .new_stream()
            .map_err(|e| DeviceError::Driver(format!("creating a stream: {e:?}")))?;
        keep_freed_memory_pooled(&ctx)?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| DeviceError::Driver(format!("{e:?}")))?;
        let arch = format!("compute_{major}{minor}");
        let device_name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| DeviceError::Driver(format!("multiprocessor count: {e:?}")))?
            .max(1) as usize;
        let blas = Blas::new(&stream).map_err(DeviceError::Driver)?;
        let dir = cache.unwrap_or_else(compile::default_cache_dir);
        let mut funcs = HashMap::new();
        for (name, src) in compile::MODULES {
            let ptx = compile::cached_ptx(name, src, &compile::module_arch(name, &arch), &dir)?;
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(|e| DeviceError::Driver(format!("loading module {name}: {e:?}")))?;
            let kernels = REGISTRY
                .iter()
                .filter(|(m, _)| m == name)
                .flat_map(|(_, fs)| fs.iter().copied());
            for f in kernels {
                let func = module
                    .load_function(f)
                    .map_err(|e| DeviceError::Driver(format!("kernel {f}: {e:?}")))?;
                let shared = match f {
                    // Scores of long contexts' compressed keys live in shared memory.
                    "k_attention" | "k_attention_split" => Some(ATTENTION_SHARED),
                    // A row of hyper-connection streams between the norm and the collapse.
                    "k_hc_pre" => Some(HC_PRE_SHARED),
                    // Queries and two key tiles of all 64 heads (and their lo halves).
                    "k_attention_mma"
                    | "k_attention_mma_exact"
                    | "k_attention_wgmma"
                    | "k_index_scores_mma" => Some(MMA_SHARED),
                    // Stages of expert weight slabs and their picks' activations.
                    f if f.contains("_mma_")
                        && (f.starts_with("k_moe_") || f.starts_with("k_matmul_")) =>
                    {
                        Some(MMA_SHARED)
                    }
                    _ => None,
                };
                if let Some(shared) = shared {
                    func.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        shared as i32,
                    )
                    .map_err(|e| DeviceError::Driver(format!("kernel {f}: shared memory: {e:?}")))?;
                }
                funcs.insert(f, func);
            }
        }
        Ok(Gpu {
            ctx,
            stream,
            blas,
            step: Mutex::new(StepState::default()),
            pinned: Mutex::new(None),
            early: Mutex::new(None),
            rope_tables: Mutex::new(RopeTableCache::default()),
            lanes: Mutex::new(None),
            expert_lanes: DEFAULT_LANES,
            funcs,
            arch,
            device_name,
            sms,
            deterministic: false,
            attention_kernel: AttentionKernel::Auto,
            attention_bf16_io: true,
            key_conversion: KeyConversion::Auto,
            indexer_blocking: None,
            indexer_gemm: false,
            expert_kernel: ExpertKernel::Auto,
            dense_kernel: DenseKernel::Auto,
            // griddepcontrol (pdl_enter) needs sm_90; older devices launch plainly.
            programmatic_launch: major >= 9,
            fp32_reference: true,
        })
    }

    pub(crate) fn rope_tables(&self) -> BResult<std::sync::MutexGuard<'_, RopeTableCache>> {
        self.rope_tables
            .lock()
            .map_err(|_| BackendError::Device("rope table cache poisoned by a panic".into()))
    }

    /// Whether Hopper's arch-specific kernels (`wgmma`) are built for this device
    /// (compute capability 9.0: `compile::module_arch`).
    pub fn wgmma(&self) -> bool {
        compile::module_arch("attention_mma", &self.arch) == "compute_90a"
    }

    fn step(&self) -> BResult<std::sync::MutexGuard<'_, StepState>> {
        self.step
            .lock()
            .map_err(|_| BackendError::Device("decode-step state poisoned by a panic".into()))
    }

    /// A zero-filled buffer of `n` values: from the step arena inside a decode step,
    /// else a new allocation.
    pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> BResult<DevMem<T>> {
        let bytes = n.max(1) * std::mem::size_of::<T>();
        let Temp::Arena { ptr, fill_now } = self.step()?.temp(bytes)? else {
            return self.zeros_owned(n);
        };
        if fill_now {
            // SAFETY: `ptr` is `bytes` bytes inside the live arena.
            #[allow(unsafe_code)]
            unsafe {
                cudarc::driver::result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream())
            }
            .map_err(dev_err)?;
        }
        Ok(DevMem::view(ptr, n))
    }

    /// A buffer of `n` values the caller's kernel overwrites entirely before any read:
    /// like [`Gpu::zeros`] without the fill (one graph node less per op).
    #[allow(unsafe_code)]
    pub(crate) fn uninit<T: DeviceRepr>(&self, n: usize) -> BResult<DevMem<T>> {
        let Temp::Arena { ptr, .. } = self.step()?.temp(n.max(1) * std::mem::size_of::<T>())?
        else {
            // SAFETY: the caller writes every value before reading any.
            let s = unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(dev_err)?;
            return Ok(DevMem::owned(s, &self.stream, n));
        };
        Ok(DevMem::view(ptr, n))
    }

    /// A new zero-filled allocation that outlives any step (weights, KV pools).
    pub(crate) fn zeros_owned<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> BResult<DevMem<T>> {
        let s = self.stream.alloc_zeros::<T>(n.max(1)).map_err(dev_err)?;
        Ok(DevMem::owned(s, &self.stream, n))
    }

    /// Copy `v` to the device: into the step's staging buffer inside a decode step
    /// (copied right away when eager, before the graph launch otherwise), else into a new
    /// allocation.
    #[allow(unsafe_code)]
    pub(crate) fn upload<T: DeviceRepr>(&self, v: &[T]) -> BResult<DevMem<T>> {
        // SAFETY: plain-old-data values (DeviceRepr) viewed as their bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v))
        };
        let mut st = self.step()?;
        let Upload::Staged { ptr, copy_now } = st.upload(bytes)? else {
            drop(st);
            if v.is_empty() {
                // A one-element buffer stands in for an empty one (never read).
                // SAFETY: allocated, never read before a write.
                let s = unsafe { self.stream.alloc::<T>(1) }.map_err(dev_err)?;
                return Ok(DevMem::owned(s, &self.stream, 0));
            }
            let s = self.stream.clone_htod(v).map_err(dev_err)?;
            return Ok(DevMem::owned(s, &self.stream, v.len()));
        };
        if let Some(range) = copy_now {
            // SAFETY: the staging buffer holds the range's end (sized by the dry pass);
            // a pageable-memory copy has read its source when the call returns.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    ptr,
                    &st.staged()[range],
                    self.stream.cu_stream(),
                )
            }
            .map_err(dev_err)?;
        }
        Ok(DevMem::view(ptr, v.len()))
    }

    #[allow(unsafe_code)]
    pub(crate) fn download<T: DeviceRepr + Default + Clone>(
        &self,
        s: &DevMem<T>,
        n: usize,
    ) -> BResult<Vec<T>> {
        if self.step()?.in_step() {
            return Err(BackendError::Device(
                "a device-to-host copy inside a decode step".into(),
            ));
        }
        let n = n.min(s.len());
        let bytes = n * std::mem::size_of::<T>();
        if bytes >= PINNED_MIN {
            return self.download_pinned(s.ptr(), n);
        }
        let mut v = vec![T::default(); n];
        if n > 0 {
            // SAFETY: `s` holds at least `n` values; the stream is synchronised before `v`
            // is read.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut v[..],
                    s.ptr(),
                    self.stream.cu_stream(),
                )
            }
            .map_err(dev_err)?;
        }
        self.synchronize()?;
        Ok(v)
    }

    /// The early downloads' page-locked buffer between uses (`take` it for a copy, put it
    /// back once the copy is read).
    pub(crate) fn early_buffer(
        &self,
    ) -> BResult<std::sync::MutexGuard<'_, Option<cudarc::driver::PinnedHostSlice<u8>>>> {
        self.early
            .lock()
            .map_err(|_| BackendError::Device("early buffer poisoned by a panic".into()))
    }

    /// A large copy to the host through a reused page-locked buffer (pageable copies of
    /// tens of MB, such as a large batch's logits, run several times slower).
    #[allow(unsafe_code)]
    fn download_pinned<T: DeviceRepr>(&self, src: u64, n: usize) -> BResult<Vec<T>> {
        let bytes = n * std::mem::size_of::<T>();
        self.with_pinned_pieces(&[(src, bytes)], |host| {
            let mut v = Vec::<T>::with_capacity(n);
            // SAFETY: `bytes` bytes of plain-old-data values (DeviceRepr) copied into
            // capacity for exactly `n` values, then the length is set.
            unsafe {
                std::ptr::copy_nonoverlapping(host.as_ptr(), v.as_mut_ptr().cast::<u8>(), bytes);
                v.set_len(n);
            }
            v
        })
    }

    /// `pieces` (device address, bytes) copied to the host one after another, then split
    /// into vectors of `group_bytes` each (the pieces' total must be a multiple of it):
    /// one asynchronous copy per piece into the reused page-locked buffer, one wait, and
    /// one host copy per group (no device-side gather, no intermediate vector).
    pub(crate) fn download_grouped(
        &self,
        pieces: &[(u64, usize)],
        group_bytes: usize,
    ) -> BResult<Vec<Vec<u8>>> {
        if self.in_step() {
            return Err(BackendError::Device(
                "a device-to-host copy inside a decode step".into(),
            ));
        }
        let total: usize = pieces.iter().map(|p| p.1).sum();
        if group_bytes == 0 || !total.is_multiple_of(group_bytes) {
            return Err(BackendError::Device(format!(
                "{total} bytes of pieces do not split into groups of {group_bytes}"
            )));
        }
        self.with_pinned_pieces(pieces, |host| {
            host.chunks_exact(group_bytes).map(<[u8]>::to_vec).collect()
        })
    }

    /// Copy `pieces` back to back into the reused page-locked buffer, wait for the
    /// stream, and return what `read` makes of the filled bytes (read while the buffer is
    /// held).
    #[allow(unsafe_code)]
    fn with_pinned_pieces<R>(
        &self,
        pieces: &[(u64, usize)],
        read: impl FnOnce(&[u8]) -> R,
    ) -> BResult<R> {
        let bytes: usize = pieces.iter().map(|p| p.1).sum();
        let mut pinned = self
            .pinned
            .lock()
            .map_err(|_| BackendError::Device("pinned buffer poisoned by a panic".into()))?;
        if pinned.as_ref().is_none_or(|p| p.len() < bytes) {
            *pinned = None;
            // SAFETY: plain page-locked bytes; every byte read below was written by a copy.
            let buf = unsafe {
                self.ctx
                    .alloc_pinned_with_flags::<u8>(bytes.next_power_of_two(), 0)
            }
            .map_err(dev_err)?;
            *pinned = Some(buf);
        }
        let buf = pinned
            .as_mut()
            .ok_or_else(|| BackendError::Device("pinned buffer missing".into()))?;
        let host = buf.as_mut_ptr().map_err(dev_err)?;
        let mut at = 0;
        for &(src, n) in pieces.iter().filter(|p| p.1 > 0) {
            // SAFETY: `host` holds at least `bytes` bytes, so `at .. at + n` is inside it;
            // the stream is synchronised before any of them is read.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(host.add(at), n);
                cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
                    .map_err(dev_err)?;
            }
            at += n;
        }
        self.synchronize()?;
        // SAFETY: the first `bytes` bytes were written by the copies above, now complete.
        Ok(read(unsafe {
            std::slice::from_raw_parts(host.cast_const(), bytes)
        }))
    }

    /// `bytes` bytes from device address `src` to `dst` on the stream (outside a decode
    /// step).
    #[allow(unsafe_code)]
    pub(crate) fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> BResult<()> {
        if self.in_step() {
            return Err(BackendError::Device(
                "a device-to-device copy inside a decode step".into(),
            ));
        }
        // SAFETY: callers pass two `bytes`-long ranges inside live allocations.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        }
        .map_err(dev_err)
    }

    /// Copy `bytes` to device address `dst` (outside a decode step).
    #[allow(unsafe_code)]
    pub(crate) fn copy_to_device(&self, dst: u64, bytes: &[u8]) -> BResult<()> {
        if self.in_step() {
            return Err(BackendError::Device(
                "a direct host-to-device copy inside a decode step".into(),
            ));
        }
        // SAFETY: callers pass a destination range inside a live allocation; a
        // pageable-memory copy has read its source when the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, bytes, self.stream.cu_stream()) }
            .map_err(dev_err)
    }

    /// Start recording a pass of a decode step in `mode` over `plan`, which the caller
    /// keeps borrowed until [`Gpu::end_step`] (see [`crate::step::StepState::begin`]).
    pub(crate) fn begin_step(
        &self,
        mode: StepMode,
        plan: &pdserve_engine::backend::BatchPlan,
    ) -> BResult<()> {
        self.step()?.begin(mode, plan);
        Ok(())
    }

    /// Stop recording; returns what the step recorded.
    pub(crate) fn end_step(&self) -> BResult<StepRecord> {
        Ok(self.step()?.end())
    }

    /// Size the arena and staging buffer for `rec`; true when they moved.
    pub(crate) fn ensure_step_buffers(&self, rec: &StepRecord) -> BResult<bool> {
        self.step()?.ensure(&self.stream, rec)
    }

    /// Copy a dry pass's staged data to the staging buffer (before a graph launch).
    #[allow(unsafe_code)]
    pub(crate) fn copy_staged(&self, rec: &StepRecord) -> BResult<()> {
        if rec.staged.is_empty() {
            return Ok(());
        }
        let base = self.step()?.staging_base();
        // SAFETY: `ensure_step_buffers(rec)` sized the staging buffer for these bytes.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                base,
                &rec.staged[..],
                self.stream.cu_stream(),
            )
        }
        .map_err(dev_err)
    }

    /// Where this pass of a decode step staged a plan equal to `plan` (see
    /// [`crate::step::StepState::staged_plan`]).
    pub(crate) fn staged_plan(
        &self,
        pool: u64,
        plan: &pdserve_engine::backend::BatchPlan,
    ) -> BResult<Option<[(u64, usize); 4]>> {
        Ok(self.step()?.staged_plan(pool, plan))
    }

    /// Remember where this pass staged `plan` (nothing outside a step).
    pub(crate) fn keep_plan(
        &self,
        pool: u64,
        plan: &pdserve_engine::backend::BatchPlan,
        at: [(u64, usize); 4],
    ) -> BResult<()> {
        self.step()?.keep_plan(pool, plan, at);
        Ok(())
    }

    /// Whether a decode step is being recorded (dummy page and state ids are then valid).
    pub(crate) fn in_step(&self) -> bool {
        self.step().map(|s| s.in_step()).unwrap_or(false)
    }

    /// Launch `kernel` on the stream over `grid` blocks with `shared` bytes of dynamic
    /// shared memory.
    pub(crate) fn launch<K: Kernel>(
        &self,
        grid: (u32, u32, u32),
        shared: u32,
        kernel: &K,
    ) -> BResult<()> {
        kernel.with_args(|args| self.launch_args(&self.stream, kernel.name(), grid, shared, args))
    }

    /// [`Gpu::launch`] on side stream `on` (a [`crate::lanes::Lane`]'s, outside decode
    /// steps), or on the device's stream where `on` is `None`.
    pub(crate) fn launch_on<K: Kernel>(
        &self,
        on: Option<&CudaStream>,
        grid: (u32, u32, u32),
        shared: u32,
        kernel: &K,
    ) -> BResult<()> {
        let Some(stream) = on else {
            return self.launch(grid, shared, kernel);
        };
        if self.in_step() {
            return Err(dev_err(format!(
                "{} launched on a side stream inside a decode step",
                kernel.name()
            )));
        }
        kernel.with_args(|args| self.launch_args(stream, kernel.name(), grid, shared, args))
    }

    #[allow(unsafe_code)]
    fn launch_args(
        &self,
        stream: &CudaStream,
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
        if !self.step()?.launch(name, grid, shared, args) {
            return Ok(());
        }
        if self.programmatic_launch {
            // SAFETY: as below; every kernel begins with pdl_enter() (a CPU test checks).
            return unsafe { launch_programmatic(f, stream, grid, shared, args) }
                .map_err(|e| BackendError::Device(format!("launch {name}: {e:?}")));
        }
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
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
    #[allow(clippy::too_many_arguments)]
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
        let words = [
            x,
            w,
            c,
            n as u64,
            m as u64,
            k as u64,
            ldx as u64,
            ldw as u64,
            ldc as u64,
            strides.0 as u64,
            strides.1 as u64,
            strides.2 as u64,
            batch as u64,
            ab_bf16 as u64,
        ];
        if !self.step()?.gemm(&words) {
            return Ok(());
        }
        self.blas
            .gemm_nt(x, w, c, dims, lds, strides, batch, ab_bf16)
    }

    pub fn synchronize(&self) -> BResult<()> {
        self.stream.synchronize().map_err(dev_err)
    }
}
