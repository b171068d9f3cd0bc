//! [`CudaBackend`]: the Backend trait over one CUDA device. Every trait method forwards to
//! an op module (`ops/`) or the KV store (`kv_store`); `graphs` implements the step runner;
//! this file holds only the backend's settings and the weight-storage policy.

use crate::device::{
    AttentionKernel, DenseKernel, DeviceError, ExpertKernel, Gpu, IndexerBlocking, KeyConversion,
};
use crate::graph_cache::{GraphCache, GraphStats};
use crate::kv_store::GpuKv;
use crate::launch::dev_err;
use crate::ops::indexer::{self, GpuSelection};
use crate::ops::{
    attention, compress, dense, fp8_linear, hc, moe, numerics, random, stored, tensors,
};
use crate::tensor::{stores_bf16, GpuTensor, WeightDtype};
use crate::GraphMode;
use pdserve_engine::backend::{
    dequantized, BResult, BatchPlan, CompressedKeys, CompressorParams, CompressorPart, HcParams,
    HcPre, HeadRope, HostTensor, KvStorage, MoeParams, PickKind, PickLog, Picks, RowPicks,
    TensorOps, WeightInit, WeightUse,
};
use pdserve_engine::checkpoint::{StoredWeight, WeightFormat};
use pdserve_engine::kv::{KvLayout, PageId, StateSlot};
use pdserve_engine::numerics::ACT_BLOCK;
use pdserve_engine::rope::Rope;
use std::path::PathBuf;
use std::sync::Mutex;

/// The CUDA backend: one device, one stream.
#[derive(Debug)]
pub struct CudaBackend {
    pub(crate) gpu: Gpu,
    weights: WeightDtype,
    graph_mode: GraphMode,
    /// Verify every N-th graphed decode step (0: never).
    verify_every: u32,
    graphs: Mutex<GraphCache>,
    /// Test only: a page the next captured decode graph writes garbage into.
    planted: Mutex<Option<PageId>>,
    /// The FP8 linears' GEMM descriptors by shape (`--numerics deepseek` prefills).
    fp8_gemms: Mutex<fp8_linear::GemmCache>,
}

impl CudaBackend {
    /// Open CUDA device `ordinal`; kernels are compiled (or loaded from `cache`).
    pub fn new(ordinal: usize, cache: Option<PathBuf>) -> Result<Self, DeviceError> {
        Self::with_weights(ordinal, cache, WeightDtype::Bf16)
    }

    pub fn with_weights(
        ordinal: usize,
        cache: Option<PathBuf>,
        weights: WeightDtype,
    ) -> Result<Self, DeviceError> {
        let mut gpu = Gpu::open(ordinal, cache)?;
        gpu.fp32_reference = weights == WeightDtype::F32;
        Ok(CudaBackend {
            gpu,
            weights,
            graph_mode: GraphMode::default(),
            verify_every: 0,
            graphs: Mutex::new(GraphCache::default()),
            planted: Mutex::new(None),
            fp8_gemms: Mutex::new(fp8_linear::GemmCache::default()),
        })
    }

    /// Routed-expert GEMMs run on the block-scaled FP8 GEMM so far (`--numerics deepseek`
    /// prefills over FP8 experts).
    pub fn fp8_expert_gemm_runs(&self) -> BResult<u64> {
        let cache = self
            .fp8_gemms
            .lock()
            .map_err(|_| dev_err("FP8 GEMM cache lock poisoned"))?;
        Ok(cache.expert_runs)
    }

    /// How decode steps run (`--cuda-graph`).
    pub fn set_graph_mode(&mut self, mode: GraphMode) {
        self.graph_mode = mode;
    }

    pub fn graph_mode(&self) -> GraphMode {
        self.graph_mode
    }

    /// Run every decode step eagerly and as a graph replay and fail it unless logits,
    /// pages and states are bitwise equal (`--verify-graphs`; graph mode only).
    pub fn set_verify_graphs(&mut self, on: bool) {
        self.set_verify_graphs_every(u32::from(on));
    }

    /// Verify only every `n`-th decode step (`--verify-graphs-every`; 0: never), so the
    /// check can stay on in serving at 1/n of its cost.
    pub fn set_verify_graphs_every(&mut self, n: u32) {
        self.verify_every = n;
    }

    pub fn verify_graphs(&self) -> bool {
        self.verify_every > 0
    }

    /// Whether decode step number `step` (counted from 1) is verified.
    pub(crate) fn verifies_step(&self, step: u64) -> bool {
        self.verify_every > 0 && step.is_multiple_of(u64::from(self.verify_every))
    }

    /// `--deterministic`: every row's result independent of its batch, of bucket padding
    /// and of prefill chunking: GEMMs by a kernel with one fixed reduction order per output
    /// instead of cuBLAS (whose algorithm, split-K and tiles follow the shape), routed
    /// experts always by the grouped kernels (the padded cuBLAS path rounds activations to
    /// bf16 and is taken only at larger batches). Slower; see docs/performance.md.
    pub fn set_deterministic(&mut self, on: bool) {
        self.gpu.deterministic = on;
    }

    pub fn deterministic(&self) -> bool {
        self.gpu.deterministic
    }

    /// Which kernel computes attention: [`AttentionKernel::Auto`] (tensor cores for bf16
    /// and fp8 entries) unless gpu-check compares it with the kernels it replaced on the
    /// same inputs. The others are slower; not a serving option.
    pub fn set_attention_kernel(&mut self, kernel: AttentionKernel) {
        self.gpu.attention_kernel = kernel;
    }

    /// Whether the tensor-core attention, when one split covers every row's keys (a
    /// prefill) under bf16 products, takes its queries normed, roped and rounded to bf16
    /// by one kernel and writes the o-projection's bf16 input itself (on, the default), or
    /// reads fp32 queries and writes fp32 output for the rope and rounding passes (off:
    /// gpu-check's A/B, which holds both to the same bits).
    pub fn set_attention_bf16_io(&mut self, on: bool) {
        self.gpu.attention_bf16_io = on;
    }

    /// Where the tensor-core attention converts fp8 KV entries to bf16: once per batch
    /// where the rows read each key often enough ([`KeyConversion::Auto`], the default: a
    /// prefill), or in the kernel for every tile ([`KeyConversion::PerTile`]), or once for
    /// any batch outside decode steps ([`KeyConversion::Once`]). All give the same bits
    /// (gpu-check holds them to it).
    pub fn set_key_conversion(&mut self, conversion: KeyConversion) {
        self.gpu.key_conversion = conversion;
    }

    /// How many rows (1 or 2) and tiles of 128 entries each block of the tensor-core
    /// indexer scores takes (`None`, the default: one row and one tile in decode steps,
    /// row pairs over up to eight tiles in a prefill). Each (row, entry)'s arithmetic is
    /// the same at any blocking: gpu-check holds one against another bitwise.
    pub fn set_indexer_blocking(&mut self, blocking: Option<IndexerBlocking>) {
        self.gpu.indexer_blocking = blocking;
    }

    /// Whether a prefill's indexer scores go through the per-head cuBLAS GEMM and a reduce
    /// pass (what the tensor-core kernel replaced under bf16 weights and index-K: the
    /// bench's A/B) instead of `k_index_scores_mma`. Off by default.
    pub fn set_indexer_gemm(&mut self, on: bool) {
        self.gpu.indexer_gemm = on;
    }

    /// Which kernels run the routed experts in decode steps: [`ExpertKernel::Auto`] unless
    /// a benchmark compares the tensor-core kernels with what they replaced.
    pub fn set_expert_kernel(&mut self, kernel: ExpertKernel) {
        self.gpu.expert_kernel = kernel;
    }

    /// Which kernel runs the dense GEMMs of decode-sized batches: [`DenseKernel::Auto`]
    /// unless a benchmark compares the tensor-core kernel with what it replaced.
    pub fn set_dense_kernel(&mut self, kernel: DenseKernel) {
        self.gpu.dense_kernel = kernel;
    }

    /// Side streams the routed experts' GEMMs of a prefill (block-scaled FP8 or bf16) spread
    /// over (one GEMM per used expert and projection; several run at once where one does
    /// not fill the device): `1` queues them all on the device's stream, the A/B of that choice
    /// (`bench prefill --expert-lanes`). The same bits either way.
    pub fn set_expert_lanes(&mut self, lanes: usize) {
        self.gpu.expert_lanes = lanes.max(1);
    }

    /// Whether kernels are launched with programmatic dependent launch (each may be
    /// scheduled while the previous one finishes, and waits for it in its first
    /// statement), eagerly and inside captured graphs alike. On by default where the
    /// device has it (sm_90 and later); off for A/B runs (`bench --no-pdl`).
    pub fn set_programmatic_launch(&mut self, on: bool) {
        self.gpu.programmatic_launch = on;
    }

    /// Test only: drop every captured graph and plant, in the next one captured, a write
    /// over `page` (what the KV canary must catch inside a graph). `None` drops the graphs
    /// again, so the next capture is clean.
    #[doc(hidden)]
    pub fn debug_plant_write_in_next_graph(&self, page: Option<PageId>) -> BResult<()> {
        self.graph_cache()?.graphs.clear();
        *self
            .planted
            .lock()
            .map_err(|_| dev_err("planted write poisoned by a panic"))? = page;
        Ok(())
    }

    pub(crate) fn take_planted_write(&self) -> BResult<Option<PageId>> {
        Ok(self
            .planted
            .lock()
            .map_err(|_| dev_err("planted write poisoned by a panic"))?
            .take())
    }

    pub(crate) fn graph_cache(&self) -> BResult<std::sync::MutexGuard<'_, GraphCache>> {
        self.graphs
            .lock()
            .map_err(|_| dev_err("graph cache poisoned by a panic"))
    }

    /// Graphs captured and replayed so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graph_cache()
            .map(|c| GraphStats {
                captures: c.captures,
                replays: c.replays,
                verify_mismatches: c.verify_mismatches,
                held: c.held(),
                phases: c.phases,
            })
            .unwrap_or_default()
    }

    pub fn weight_dtype(&self) -> WeightDtype {
        self.weights
    }

    /// Whether a weight the model uses as `usage` is stored in bf16 (else fp32): the one
    /// rule for uploaded, generated and counted weights.
    pub fn weight_is_bf16(&self, usage: WeightUse) -> bool {
        self.weights == WeightDtype::Bf16 && usage == WeightUse::Matrix
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl KvStorage for CudaBackend {
    type KvStore = GpuKv;

    fn alloc_kv(&self, layout: &KvLayout, pages: usize, states: usize) -> BResult<GpuKv> {
        GpuKv::new(&self.gpu, layout, pages, states)
    }

    fn reset_state(&self, kv: &mut GpuKv, slot: StateSlot) -> BResult<()> {
        kv.zero_state(&self.gpu, slot)
    }

    fn page_bytes(&self, kv: &GpuKv, page: PageId) -> BResult<Vec<u8>> {
        kv.read_page(&self.gpu, page)
    }

    fn state_bytes(&self, kv: &GpuKv, slot: StateSlot) -> BResult<Vec<u8>> {
        kv.read_state(&self.gpu, slot)
    }

    fn state_ranges(
        &self,
        kv: &GpuKv,
        slots: &[StateSlot],
        ranges: &[std::ops::Range<usize>],
    ) -> BResult<Vec<Vec<u8>>> {
        kv.read_state_ranges(&self.gpu, slots, ranges)
    }

    fn write_page(&self, kv: &mut GpuKv, page: PageId, bytes: &[u8]) -> BResult<()> {
        kv.write_page(&self.gpu, page, bytes)
    }

    fn write_state(&self, kv: &mut GpuKv, slot: StateSlot, bytes: &[u8]) -> BResult<()> {
        kv.write_state(&self.gpu, slot, bytes)
    }

    fn page_checksums(&self, kv: &GpuKv) -> BResult<Vec<u64>> {
        kv.page_checksums(&self.gpu)
    }

    fn state_checksums(&self, kv: &GpuKv) -> BResult<Vec<u64>> {
        kv.state_checksums(&self.gpu)
    }
}

impl TensorOps for CudaBackend {
    type Tensor = GpuTensor;
    type Selection = GpuSelection;

    fn name(&self) -> String {
        format!(
            "cuda ({}, {}, {:?} weights)",
            self.gpu.device_name, self.gpu.arch, self.weights
        )
    }

    fn memory_free(&self) -> Option<u64> {
        self.gpu
            .ctx
            .mem_get_info()
            .ok()
            .map(|(free, _total)| free as u64)
    }

    fn dims(&self, t: &GpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn upload(&self, t: HostTensor) -> BResult<GpuTensor> {
        let bf16 = self.weights == WeightDtype::Bf16 && stores_bf16(t.rows, t.cols);
        tensors::upload(&self.gpu, t, bf16)
    }

    fn upload_weight(&self, t: HostTensor, usage: WeightUse) -> BResult<GpuTensor> {
        let bf16 = self.weight_is_bf16(usage);
        tensors::upload(&self.gpu, t, bf16)
    }

    fn random_weight(
        &self,
        rows: usize,
        cols: usize,
        init: WeightInit,
        seed: u64,
        usage: WeightUse,
    ) -> BResult<GpuTensor> {
        let bf16 = self.weight_is_bf16(usage);
        random::random_tensor(&self.gpu, rows, cols, bf16, init, seed)
    }

    /// Kept as stored under bf16 weights; the fp32 reference mode (`--cuda-weights f32`)
    /// takes the exact values in fp32, like the CPU backend.
    fn upload_stored(&self, w: StoredWeight, usage: WeightUse) -> BResult<GpuTensor> {
        if self.weights == WeightDtype::F32 || usage != WeightUse::Matrix {
            return self.upload_weight(dequantized(&w)?, usage);
        }
        stored::upload(&self.gpu, w)
    }

    fn random_stored(
        &self,
        shape: (usize, usize),
        format: WeightFormat,
        group_rows: usize,
        init: WeightInit,
        seed: u64,
        usage: WeightUse,
    ) -> BResult<GpuTensor> {
        let t = stored::random(&self.gpu, shape, format, group_rows, init, seed)?;
        if self.weights == WeightDtype::F32 || usage != WeightUse::Matrix {
            return self.upload_weight(self.to_host(&t)?, usage);
        }
        Ok(t)
    }

    fn to_host(&self, t: &GpuTensor) -> BResult<HostTensor> {
        tensors::to_host(&self.gpu, t)
    }

    fn gather_rows(&self, t: &GpuTensor, rows: &[usize]) -> BResult<GpuTensor> {
        dense::gather_rows(&self.gpu, t, rows)
    }

    fn embed(&self, table: &GpuTensor, tokens: &[u32], copies: usize) -> BResult<GpuTensor> {
        dense::embed(&self.gpu, table, tokens, copies)
    }

    fn matmul(&self, x: &GpuTensor, w: &GpuTensor) -> BResult<GpuTensor> {
        dense::matmul(&self.gpu, x, w)
    }

    fn grouped_matmul(&self, x: &GpuTensor, w: &GpuTensor, groups: usize) -> BResult<GpuTensor> {
        dense::grouped_matmul(&self.gpu, x, w, groups)
    }

    fn rms_norm(
        &self,
        x: &GpuTensor,
        weight: Option<&GpuTensor>,
        group: usize,
        eps: f32,
    ) -> BResult<GpuTensor> {
        dense::rms_norm(&self.gpu, x, weight, group, eps)
    }

    fn rms_norm_matmul(&self, x: &GpuTensor, w: &GpuTensor, eps: f32) -> BResult<GpuTensor> {
        dense::rms_norm_matmul(&self.gpu, x, w, eps)
    }

    fn rope(
        &self,
        x: &mut GpuTensor,
        head_dim: usize,
        rope: &Rope,
        positions: &[usize],
        inverse: bool,
    ) -> BResult<()> {
        dense::rope(&self.gpu, x, head_dim, rope, positions, inverse)
    }

    fn hc_pre(
        &self,
        streams: &GpuTensor,
        mix: &GpuTensor,
        p: &HcParams<'_, GpuTensor>,
    ) -> BResult<HcPre<GpuTensor>> {
        hc::hc_pre(&self.gpu, streams, mix, p)
    }

    fn hc_pre_mixed(
        &self,
        streams: &GpuTensor,
        fn_: &GpuTensor,
        norm_eps: f32,
        p: &HcParams<'_, GpuTensor>,
    ) -> BResult<HcPre<GpuTensor>> {
        hc::hc_pre_mixed(&self.gpu, streams, fn_, norm_eps, p)
    }

    fn hc_post(
        &self,
        streams: &GpuTensor,
        out: &GpuTensor,
        pre: &HcPre<GpuTensor>,
        hc: usize,
    ) -> BResult<GpuTensor> {
        hc::hc_post(&self.gpu, streams, out, pre, hc)
    }

    fn hc_head(
        &self,
        streams: &GpuTensor,
        mix: &GpuTensor,
        p: &HcParams<'_, GpuTensor>,
    ) -> BResult<GpuTensor> {
        hc::hc_head(&self.gpu, streams, mix, p)
    }

    fn compress(
        &self,
        kv: &mut GpuKv,
        layout: &KvLayout,
        layer: usize,
        proj_kv: &GpuTensor,
        proj_gate: &GpuTensor,
        p: &CompressorParams<'_, GpuTensor>,
        plan: &BatchPlan,
    ) -> BResult<()> {
        compress::compress(&self.gpu, kv, layout, layer, proj_kv, proj_gate, p, plan)
    }

    fn compress_ring(
        &self,
        kv: &mut GpuKv,
        layout: &KvLayout,
        layer: usize,
        part: CompressorPart,
        proj_kv: &GpuTensor,
        proj_gate: &GpuTensor,
        plan: &BatchPlan,
    ) -> BResult<()> {
        compress::compress_ring(&self.gpu, kv, layout, layer, part, proj_kv, proj_gate, plan)
    }

    fn index_select(
        &self,
        kv: &GpuKv,
        layout: &KvLayout,
        layer: usize,
        q: &GpuTensor,
        weights: &GpuTensor,
        n_heads: usize,
        topk: usize,
        plan: &BatchPlan,
        record: Option<&PickLog>,
    ) -> BResult<GpuSelection> {
        let sel = indexer::index_select(
            &self.gpu, kv, layout, layer, q, weights, n_heads, topk, plan,
        )?;
        if let Some(log) = record {
            log.push(Picks {
                layer,
                kind: PickKind::Index,
                rows: sel
                    .to_host(&self.gpu)?
                    .into_iter()
                    .map(|ids| RowPicks::new(ids, None))
                    .collect(),
            });
        }
        Ok(sel)
    }

    fn attention(
        &self,
        kv: &GpuKv,
        layout: &KvLayout,
        layer: usize,
        q: &GpuTensor,
        kv_new: &GpuTensor,
        sinks: &GpuTensor,
        n_heads: usize,
        compressed: CompressedKeys<'_, GpuSelection>,
        head_rope: HeadRope<'_>,
        plan: &BatchPlan,
    ) -> BResult<GpuTensor> {
        attention::attention(
            &self.gpu, kv, layout, layer, q, kv_new, sinks, n_heads, compressed, head_rope, plan,
        )
    }

    fn window_store(
        &self,
        kv: &mut GpuKv,
        layout: &KvLayout,
        layer: usize,
        kv_new: &GpuTensor,
        plan: &BatchPlan,
    ) -> BResult<()> {
        attention::window_store(&self.gpu, kv, layout, layer, kv_new, plan)
    }

    fn moe(&self, x: &GpuTensor, p: &MoeParams<'_, GpuTensor>) -> BResult<GpuTensor> {
        moe::moe(
            &self.gpu,
            x,
            p,
            &|x, ws| self.quantized_matmuls(x, ws),
            &self.fp8_gemms,
        )
    }

    fn act_quant(&self, x: &GpuTensor, block: usize) -> BResult<GpuTensor> {
        numerics::act_quant(&self.gpu, x, block)
    }

    /// A prefill-sized batch over an FP8 weight on cuBLASLt's block-scaled FP8 GEMM
    /// (`fp8_linear::takes`); otherwise act_quant, then the matmul the weight's format
    /// takes.
    fn quantized_matmul(&self, x: &GpuTensor, w: &GpuTensor) -> BResult<GpuTensor> {
        if fp8_linear::takes(&self.gpu, x, w) {
            let mut cache = self
                .fp8_gemms
                .lock()
                .map_err(|_| dev_err("FP8 GEMM cache lock poisoned"))?;
            return fp8_linear::linear(&self.gpu, &mut cache, x, w);
        }
        self.matmul(&self.act_quant(x, ACT_BLOCK)?, w)
    }

    /// Where every weight takes the FP8 GEMM, `x` quantized once for all of them; else
    /// each as [`Self::quantized_matmul`].
    fn quantized_matmuls(&self, x: &GpuTensor, ws: &[&GpuTensor]) -> BResult<Vec<GpuTensor>> {
        if ws.iter().all(|w| fp8_linear::takes(&self.gpu, x, w)) {
            let mut cache = self
                .fp8_gemms
                .lock()
                .map_err(|_| dev_err("FP8 GEMM cache lock poisoned"))?;
            return fp8_linear::linears(&self.gpu, &mut cache, x, ws);
        }
        ws.iter().map(|w| self.quantized_matmul(x, w)).collect()
    }
}
