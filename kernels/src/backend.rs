//! [`CudaBackend`]: the dense half of the Backend trait (embedding, GEMMs, norms, rope,
//! hyper-connections); paged-KV ops live in `kv_ops`, MoE in `moe`.

use crate::buf::{f32_buf, out_ptr, shape_err};
use crate::device::{DeviceError, Gpu};
use crate::devmem::DevMem;
use crate::graphs::{GraphCache, GraphStats};
use crate::kv_ops::{self, GpuKv, GpuSelection};
use crate::launch::{dev_err, grid_1d, Arg};
use crate::tensor::{keeps_f32, stores_bf16, Buf, GpuTensor, WeightDtype};
use crate::GraphMode;
use pdserve_engine::backend::StepForward;
use pdserve_engine::backend::{
    BResult, Backend, BatchPlan, CompressedKeys, CompressorParams, HcParams, HcPre, HostTensor,
    MoeParams, WeightInit,
};
use pdserve_engine::kv::{KvLayout, PageId, StateSlot};
use pdserve_engine::rope::Rope;
use std::path::PathBuf;
use std::sync::Mutex;

/// The CUDA backend: one device, one stream.
#[derive(Debug)]
pub struct CudaBackend {
    pub(crate) gpu: Gpu,
    weights: WeightDtype,
    graph_mode: GraphMode,
    verify_graphs: bool,
    graphs: Mutex<GraphCache>,
}

use pdserve_engine::backend::shapes;

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
        Ok(CudaBackend {
            gpu: Gpu::open(ordinal, cache)?,
            weights,
            graph_mode: GraphMode::default(),
            verify_graphs: false,
            graphs: Mutex::new(GraphCache::default()),
        })
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
        self.verify_graphs = on;
    }

    pub fn verify_graphs(&self) -> bool {
        self.verify_graphs
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
                held: c.held(),
                phases: c.phases,
            })
            .unwrap_or_default()
    }

    pub fn weight_dtype(&self) -> WeightDtype {
        self.weights
    }

    /// Whether weight `name` (`rows x cols`) is stored in bf16 (else fp32): the one rule
    /// for uploaded, generated and counted weights.
    pub fn weight_is_bf16(&self, name: &str, rows: usize, cols: usize) -> bool {
        self.weights == WeightDtype::Bf16 && stores_bf16(rows, cols) && !keeps_f32(name)
    }

    fn upload_as(&self, t: HostTensor, bf16: bool) -> BResult<GpuTensor> {
        if t.data.len() != t.rows * t.cols {
            return Err(shape_err(
                "upload",
                format!("{}x{} with {} values", t.rows, t.cols, t.data.len()),
            ));
        }
        let buf = if bf16 {
            let bits: Vec<u16> = t
                .data
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            Buf::Bf16(self.gpu.upload(&bits)?)
        } else {
            Buf::F32(self.gpu.upload(&t.data)?)
        };
        Ok(GpuTensor {
            rows: t.rows,
            cols: t.cols,
            buf,
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// An fp32 output tensor; every caller's kernel writes all of it.
    pub(crate) fn new_f32(&self, rows: usize, cols: usize) -> BResult<GpuTensor> {
        Ok(GpuTensor {
            rows,
            cols,
            buf: Buf::F32(self.gpu.uninit::<f32>(rows * cols)?),
        })
    }

    /// An fp32 view of a parameter (bf16 parameters are widened into a new buffer).
    pub(crate) fn param_f32(&self, t: &GpuTensor) -> BResult<DevMem<f32>> {
        match &t.buf {
            Buf::F32(s) => Ok(DevMem::view(s.ptr(), s.len())),
            Buf::Bf16(s) => {
                let out = self.gpu.uninit::<f32>(t.len())?;
                self.gpu.launch(
                    "k_bf16_to_f32",
                    grid_1d(t.len()),
                    0,
                    &[
                        Arg::Ptr(self.gpu.ptr(s)),
                        Arg::Ptr(self.gpu.ptr(&out)),
                        Arg::I64(t.len() as i64),
                    ],
                )?;
                Ok(out)
            }
        }
    }

    /// cos/sin tables `[rows, rope.dim()/2]` at `positions`, computed on the host exactly
    /// like the CPU backend.
    pub(crate) fn rope_tables(
        &self,
        rope: &Rope,
        positions: impl Iterator<Item = usize>,
    ) -> BResult<(DevMem<f32>, DevMem<f32>)> {
        let half = rope.dim() / 2;
        let (mut cs, mut sn) = (Vec::new(), Vec::new());
        let (mut c, mut s) = (vec![0f32; half], vec![0f32; half]);
        for p in positions {
            rope.cos_sin(p, &mut c, &mut s);
            cs.extend_from_slice(&c);
            sn.extend_from_slice(&s);
        }
        Ok((self.gpu.upload(&cs)?, self.gpu.upload(&sn)?))
    }

    /// `src` rounded to bf16 (a GEMM input next to bf16 weights).
    pub(crate) fn to_bf16(&self, src: &DevMem<f32>) -> BResult<DevMem<u16>> {
        let out = self.gpu.uninit::<u16>(src.len())?;
        self.gpu.launch(
            "k_f32_to_bf16",
            grid_1d(src.len()),
            0,
            &[
                Arg::Ptr(self.gpu.ptr(src)),
                Arg::Ptr(self.gpu.ptr(&out)),
                Arg::I64(src.len() as i64),
            ],
        )?;
        Ok(out)
    }

    fn matmul_into(&self, x: &GpuTensor, w: &GpuTensor, groups: usize) -> BResult<GpuTensor> {
        let xs = f32_buf(x, "matmul")?;
        let out = self.new_f32(x.rows, w.rows)?;
        let Buf::F32(o) = &out.buf else {
            return Err(dev_err("output buffer"));
        };
        let (din, dout) = (w.cols, w.rows / groups);
        let dims = (x.rows, dout, din);
        let lds = (x.cols, din, w.rows);
        let strides = (din as i64, (dout * din) as i64, dout as i64);
        match &w.buf {
            Buf::Bf16(wb) => {
                let xb = self.to_bf16(xs)?;
                let (xp, wp, op) = (self.gpu.ptr(&xb), self.gpu.ptr(wb), self.gpu.ptr(o));
                self.gpu
                    .gemm_nt(xp, wp, op, dims, lds, strides, groups, true)?;
            }
            Buf::F32(wf) => {
                let (xp, wp, op) = (self.gpu.ptr(xs), self.gpu.ptr(wf), self.gpu.ptr(o));
                self.gpu
                    .gemm_nt(xp, wp, op, dims, lds, strides, groups, false)?;
            }
        }
        Ok(out)
    }
}

impl Backend for CudaBackend {
    type Tensor = GpuTensor;
    type KvStore = GpuKv;
    type Selection = GpuSelection;

    fn name(&self) -> String {
        format!(
            "cuda ({}, {}, {:?} weights)",
            self.gpu.device_name, self.gpu.arch, self.weights
        )
    }

    fn dims(&self, t: &GpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn upload(&self, t: HostTensor) -> BResult<GpuTensor> {
        let bf16 = self.weights == WeightDtype::Bf16 && stores_bf16(t.rows, t.cols);
        self.upload_as(t, bf16)
    }

    fn upload_weight(&self, name: &str, t: HostTensor) -> BResult<GpuTensor> {
        let bf16 = self.weight_is_bf16(name, t.rows, t.cols);
        self.upload_as(t, bf16)
    }

    fn random_weight(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        init: WeightInit,
        seed: u64,
    ) -> BResult<GpuTensor> {
        crate::random::random_tensor(
            self,
            rows,
            cols,
            self.weight_is_bf16(name, rows, cols),
            init,
            seed,
        )
    }

    fn to_host(&self, t: &GpuTensor) -> BResult<HostTensor> {
        let data = match &t.buf {
            Buf::F32(s) => self.gpu.download(s, t.len())?,
            Buf::Bf16(s) => self
                .gpu
                .download(s, t.len())?
                .into_iter()
                .map(|b| half::bf16::from_bits(b).to_f32())
                .collect(),
        };
        Ok(HostTensor {
            rows: t.rows,
            cols: t.cols,
            data,
        })
    }

    fn gather_rows(&self, t: &GpuTensor, rows: &[usize]) -> BResult<GpuTensor> {
        if let Some(&r) = rows.iter().find(|&&r| r >= t.rows) {
            return Err(shape_err("gather_rows", format!("row {r} of {}", t.rows)));
        }
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idx = self.gpu.upload(&idx)?;
        let out = self.new_f32(rows.len(), t.cols)?;
        self.gpu.launch(
            "k_gather_rows",
            (rows.len() as u32, 1, 1),
            0,
            &[
                Arg::Ptr(self.gpu.ptr(f32_buf(t, "gather_rows")?)),
                Arg::Ptr(self.gpu.ptr(&idx)),
                Arg::Ptr(out_ptr(&out)?),
                Arg::I32(t.cols as i32),
            ],
        )?;
        Ok(out)
    }

    fn alloc_kv(&self, layout: &KvLayout, pages: usize, states: usize) -> BResult<GpuKv> {
        GpuKv::new(&self.gpu, layout, pages, states)
    }

    fn reset_state(&self, kv: &mut GpuKv, _layout: &KvLayout, slot: StateSlot) -> BResult<()> {
        kv.zero_state(&self.gpu, slot)
    }

    fn page_bytes(&self, kv: &GpuKv, _layout: &KvLayout, page: PageId) -> BResult<Vec<u8>> {
        kv.read_page(&self.gpu, page)
    }

    fn state_bytes(&self, kv: &GpuKv, _layout: &KvLayout, slot: StateSlot) -> BResult<Vec<u8>> {
        kv.read_state(&self.gpu, slot)
    }

    fn write_page(
        &self,
        kv: &mut GpuKv,
        _layout: &KvLayout,
        page: PageId,
        bytes: &[u8],
    ) -> BResult<()> {
        kv.write_page(&self.gpu, page, bytes)
    }

    fn write_state(
        &self,
        kv: &mut GpuKv,
        _layout: &KvLayout,
        slot: StateSlot,
        bytes: &[u8],
    ) -> BResult<()> {
        kv.write_state(&self.gpu, slot, bytes)
    }

    fn embed(&self, table: &GpuTensor, tokens: &[u32], copies: usize) -> BResult<GpuTensor> {
        shapes::check_embed(table.rows, tokens)?;
        let h = table.cols;
        let toks = self.gpu.upload(tokens)?;
        let out = self.new_f32(tokens.len(), copies * h)?;
        let (name, tp) = match &table.buf {
            Buf::Bf16(s) => ("k_embed_bf16", self.gpu.ptr(s)),
            Buf::F32(s) => ("k_embed_f32", self.gpu.ptr(s)),
        };
        self.gpu.launch(
            name,
            (tokens.len() as u32, 1, 1),
            0,
            &[
                Arg::Ptr(tp),
                Arg::Ptr(self.gpu.ptr(&toks)),
                Arg::Ptr(out_ptr(&out)?),
                Arg::I32(h as i32),
                Arg::I32(copies as i32),
            ],
        )?;
        Ok(out)
    }

    fn matmul(&self, x: &GpuTensor, w: &GpuTensor) -> BResult<GpuTensor> {
        shapes::check_matmul((x.rows, x.cols), (w.rows, w.cols))?;
        self.matmul_into(x, w, 1)
    }

    fn grouped_matmul(&self, x: &GpuTensor, w: &GpuTensor, groups: usize) -> BResult<GpuTensor> {
        shapes::check_grouped_matmul((x.rows, x.cols), (w.rows, w.cols), groups)?;
        self.matmul_into(x, w, groups)
    }

    fn rms_norm(
        &self,
        x: &GpuTensor,
        weight: Option<&GpuTensor>,
        group: usize,
        eps: f32,
    ) -> BResult<GpuTensor> {
        shapes::check_rms_norm(x.cols, weight.map(|w| w.len()), group)?;
        let w = weight.map(|w| self.param_f32(w)).transpose()?;
        let out = self.new_f32(x.rows, x.cols)?;
        self.gpu.launch(
            "k_rms_norm",
            ((x.len() / group) as u32, 1, 1),
            0,
            &[
                Arg::Ptr(self.gpu.ptr(f32_buf(x, "rms_norm")?)),
                Arg::Ptr(w.as_ref().map_or(0, |w| self.gpu.ptr(w))),
                Arg::Ptr(out_ptr(&out)?),
                Arg::I32(group as i32),
                Arg::F32(eps),
            ],
        )?;
        Ok(out)
    }

    fn rope(
        &self,
        x: &mut GpuTensor,
        head_dim: usize,
        rope: &Rope,
        positions: &[usize],
        inverse: bool,
    ) -> BResult<()> {
        shapes::check_rope((x.rows, x.cols), head_dim, positions.len(), rope.dim())?;
        let (cs, sn) = self.rope_tables(rope, positions.iter().copied())?;
        self.gpu.launch(
            "k_rope",
            (x.rows as u32, 1, 1),
            0,
            &[
                Arg::Ptr(out_ptr(x)?),
                Arg::Ptr(self.gpu.ptr(&cs)),
                Arg::Ptr(self.gpu.ptr(&sn)),
                Arg::I32(x.cols as i32),
                Arg::I32(head_dim as i32),
                Arg::I32(rope.dim() as i32),
                Arg::I32(inverse as i32),
            ],
        )
    }

    fn hc_pre(
        &self,
        streams: &GpuTensor,
        mix: &GpuTensor,
        p: &HcParams<'_, GpuTensor>,
    ) -> BResult<HcPre<GpuTensor>> {
        crate::hc::hc_pre(self, streams, mix, p)
    }

    fn hc_post(
        &self,
        streams: &GpuTensor,
        out: &GpuTensor,
        pre: &HcPre<GpuTensor>,
        hc: usize,
    ) -> BResult<GpuTensor> {
        crate::hc::hc_post(self, streams, out, pre, hc)
    }

    fn hc_head(
        &self,
        streams: &GpuTensor,
        mix: &GpuTensor,
        p: &HcParams<'_, GpuTensor>,
    ) -> BResult<GpuTensor> {
        crate::hc::hc_head(self, streams, mix, p)
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
        kv_ops::compress(self, kv, layout, layer, proj_kv, proj_gate, p, plan)
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
    ) -> BResult<GpuSelection> {
        kv_ops::index_select(self, kv, layout, layer, q, weights, n_heads, topk, plan)
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
        plan: &BatchPlan,
    ) -> BResult<GpuTensor> {
        kv_ops::attention(
            self, kv, layout, layer, q, kv_new, sinks, n_heads, compressed, plan,
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
        kv_ops::window_store(self, kv, layout, layer, kv_new, plan)
    }

    fn moe(&self, x: &GpuTensor, p: &MoeParams<'_, GpuTensor>) -> BResult<GpuTensor> {
        crate::moe::moe(self, x, p)
    }

    fn decode_step(
        &self,
        kv: &mut GpuKv,
        plan: &BatchPlan,
        forward: &mut StepForward<'_, Self>,
    ) -> BResult<HostTensor> {
        crate::graphs::decode_step(self, kv, plan, forward)
    }
}
