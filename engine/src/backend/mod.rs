//! The backend trait: every numeric operation of the forward pass. The model code
//! ([`crate::model`]) is written once against it; `cpu` implements it in fp32 and the
//! CUDA backend implements it on the GPU.

pub mod cpu;
mod cpu_attention;
mod cpu_kv;
mod gemm;
pub mod random;
pub mod shapes;

use crate::kv::{KvLayout, PageId, StateSlot};
use crate::rope::Rope;
pub use random::WeightInit;

/// A 2-D tensor on the host, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("KV store: {0}")]
    Kv(String),
    #[error("device error: {0}")]
    Device(String),
}

/// One sequence's part of a batched forward.
#[derive(Debug, Clone)]
pub struct SeqPlan {
    /// Position of the sequence's first new token.
    pub start: usize,
    /// New tokens in this forward.
    pub len: usize,
    /// Row of its first new token in the batch tensors.
    pub row0: usize,
    /// Page table: page `i` covers positions `[i*page_tokens, (i+1)*page_tokens)`.
    pub pages: Vec<PageId>,
    pub state: StateSlot,
}

/// Host description of a ragged batch: rows are the new tokens of all sequences, in order.
#[derive(Debug, Clone, Default)]
pub struct BatchPlan {
    pub seqs: Vec<SeqPlan>,
    /// Token id of each row.
    pub tokens: Vec<u32>,
    /// Absolute position of each row.
    pub positions: Vec<usize>,
    /// Sequence index (into `seqs`) of each row.
    pub row_seq: Vec<usize>,
}

impl BatchPlan {
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }
}

/// Which of a CSA layer's two compressors an operation addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompressorPart {
    /// The attention compressor (head_dim entries into compressed-KV pages).
    Main,
    /// The lightning indexer's compressor (index_head_dim entries into index-K pages).
    Index,
}

/// Parameters of a softmax-gated pooling compressor.
pub struct CompressorParams<'a, T> {
    pub part: CompressorPart,
    pub position_bias: &'a T,
    pub norm_weight: &'a T,
    pub eps: f32,
    pub rope: &'a Rope,
}

/// Compressed entries that one attention call reads besides the sliding window.
pub enum CompressedKeys<'a, S> {
    /// Sliding layer: none.
    None,
    /// HCA: every entry the query may see (`w < (pos+1) / rate`).
    AllVisible,
    /// CSA: the indexer's picks, per row.
    Selected(&'a S),
}

/// Router and experts of one MoE layer.
pub struct MoeParams<'a, T> {
    pub router: &'a T,
    /// `e_score_correction_bias` (top-k layers).
    pub correction_bias: Option<&'a T>,
    /// Experts per row from `tid2eid` (hash layers): `rows * top_k` ids.
    pub hash_experts: Option<&'a [u32]>,
    /// `[E * 2I, H]`: per expert, gate rows then up rows.
    pub gate_up: &'a T,
    /// `[E * H, I]`.
    pub down: &'a T,
    pub shared_gate: &'a T,
    pub shared_up: &'a T,
    pub shared_down: &'a T,
    pub n_experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub scoring: crate::config::ScoringFunc,
    pub routed_scaling: f32,
    pub swiglu_limit: f32,
}

/// Hyper-connection parameters of one site.
pub struct HcParams<'a, T> {
    pub base: &'a T,
    pub scale: &'a T,
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// Output of [`Backend::hc_pre`].
pub struct HcPre<T> {
    /// `[rows, hc]` placement weights of the sublayer output.
    pub post: T,
    /// `[rows, hc*hc]` Sinkhorn-normalised stream mixer.
    pub comb: T,
    /// `[rows, hidden]` streams collapsed by the `pre` weights.
    pub collapsed: T,
}

pub type BResult<T> = Result<T, BackendError>;

/// One step's forward pass as a backend runs it: `(backend, kv, plan)` -> the logits of
/// every row of `plan`, in row order, still on the device.
pub type StepForward<'a, B> =
    dyn FnMut(&B, &mut <B as Backend>::KvStore, &BatchPlan) -> BResult<<B as Backend>::Tensor> + 'a;

pub trait Backend: Send + Sync {
    /// A 2-D tensor (activations and weights; vectors are `[1, n]`).
    type Tensor: Send + Sync;
    /// Storage of all pages and state slots of one pool.
    type KvStore: Send + Sync;
    /// Per-row indexer picks.
    type Selection: Send + Sync;

    fn name(&self) -> String;
    fn dims(&self, t: &Self::Tensor) -> (usize, usize);
    fn upload(&self, t: HostTensor) -> BResult<Self::Tensor>;
    /// Upload checkpoint tensor `name` (the model's module name); a backend may choose its
    /// storage by name (the CUDA backend keeps the router and hyper-connection maps in
    /// fp32). Default: [`Backend::upload`].
    fn upload_weight(&self, name: &str, t: HostTensor) -> BResult<Self::Tensor> {
        let _ = name;
        self.upload(t)
    }
    /// A synthetic weight named `name` (stored as [`Backend::upload_weight`] would store
    /// it), `rows x cols` values drawn by `init` from the counter-based generator of
    /// [`random`] keyed by `seed`: deterministic, the same values on every backend (up to
    /// storage rounding). Default: generated on the host, then uploaded; the CUDA backend
    /// generates on the device.
    fn random_weight(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        init: WeightInit,
        seed: u64,
    ) -> BResult<Self::Tensor> {
        self.upload_weight(name, random::host_tensor(rows, cols, init, seed))
    }
    fn to_host(&self, t: &Self::Tensor) -> BResult<HostTensor>;
    /// Rows `rows` of `t`, in that order.
    fn gather_rows(&self, t: &Self::Tensor, rows: &[usize]) -> BResult<Self::Tensor>;

    fn alloc_kv(&self, layout: &KvLayout, pages: usize, states: usize) -> BResult<Self::KvStore>;
    /// Zero a state slot before a new sequence uses it.
    fn reset_state(
        &self,
        kv: &mut Self::KvStore,
        layout: &KvLayout,
        slot: StateSlot,
    ) -> BResult<()>;
    /// Raw bytes of a page / state slot (audits, transfers, tests).
    fn page_bytes(&self, kv: &Self::KvStore, layout: &KvLayout, page: PageId) -> BResult<Vec<u8>>;
    fn state_bytes(
        &self,
        kv: &Self::KvStore,
        layout: &KvLayout,
        slot: StateSlot,
    ) -> BResult<Vec<u8>>;
    /// Overwrite a whole page / state slot (`layout.page_bytes` / `layout.state_bytes` bytes).
    fn write_page(
        &self,
        kv: &mut Self::KvStore,
        layout: &KvLayout,
        page: PageId,
        bytes: &[u8],
    ) -> BResult<()>;
    fn write_state(
        &self,
        kv: &mut Self::KvStore,
        layout: &KvLayout,
        slot: StateSlot,
        bytes: &[u8],
    ) -> BResult<()>;

    /// `table[tokens[r]]`, repeated `copies` times along the row: `[rows, copies*H]`.
    fn embed(&self, table: &Self::Tensor, tokens: &[u32], copies: usize) -> BResult<Self::Tensor>;
    /// `x @ w^T`: `[n,k] x [m,k] -> [n,m]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Tensor) -> BResult<Self::Tensor>;
    /// Block-diagonal `x @ w^T`: group `g` of `x`'s columns times rows `g*m/groups..` of `w`.
    fn grouped_matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        groups: usize,
    ) -> BResult<Self::Tensor>;
    /// RMS-normalise each consecutive `group` values of every row, times `weight` (length `group`) if given.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: Option<&Self::Tensor>,
        group: usize,
        eps: f32,
    ) -> BResult<Self::Tensor>;
    /// Interleaved rope on the trailing `rope.dim()` channels of every `head_dim` head,
    /// at each row's position (`positions[r]`); `inverse` rotates back (`-sin`).
    fn rope(
        &self,
        x: &mut Self::Tensor,
        head_dim: usize,
        rope: &Rope,
        positions: &[usize],
        inverse: bool,
    ) -> BResult<()>;

    /// Hyper-connection mapping from precomputed mix logits (`[rows, (2+hc)*hc]`).
    fn hc_pre(
        &self,
        streams: &Self::Tensor,
        mix: &Self::Tensor,
        p: &HcParams<'_, Self::Tensor>,
    ) -> BResult<HcPre<Self::Tensor>>;
    /// `new[k] = post[k] * out + sum_j comb[j,k] * streams[j]`.
    fn hc_post(
        &self,
        streams: &Self::Tensor,
        out: &Self::Tensor,
        pre: &HcPre<Self::Tensor>,
        hc: usize,
    ) -> BResult<Self::Tensor>;
    /// Final collapse: `sum_k (sigmoid(mix_k*scale + base_k) + eps) * streams[k]`.
    fn hc_head(
        &self,
        streams: &Self::Tensor,
        mix: &Self::Tensor,
        p: &HcParams<'_, Self::Tensor>,
    ) -> BResult<Self::Tensor>;

    /// Feed projected `kv`/`gate` rows into a compressor ring; every window a row closes
    /// is pooled (softmax over slots + position bias), normed, roped at `w*rate`, and
    /// stored as entry `w` in the sequence's pages.
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        kv: &mut Self::KvStore,
        layout: &KvLayout,
        layer: usize,
        proj_kv: &Self::Tensor,
        proj_gate: &Self::Tensor,
        p: &CompressorParams<'_, Self::Tensor>,
        plan: &BatchPlan,
    ) -> BResult<()>;
    /// Lightning indexer: score every visible index-K entry, keep the top `topk` per row.
    #[allow(clippy::too_many_arguments)]
    fn index_select(
        &self,
        kv: &Self::KvStore,
        layout: &KvLayout,
        layer: usize,
        q: &Self::Tensor,
        weights: &Self::Tensor,
        n_heads: usize,
        topk: usize,
        plan: &BatchPlan,
    ) -> BResult<Self::Selection>;
    /// Sink attention of every row over its sliding window (earlier positions from the
    /// ring, this forward's from `kv_new`) and the given compressed entries.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        kv: &Self::KvStore,
        layout: &KvLayout,
        layer: usize,
        q: &Self::Tensor,
        kv_new: &Self::Tensor,
        sinks: &Self::Tensor,
        n_heads: usize,
        compressed: CompressedKeys<'_, Self::Selection>,
        plan: &BatchPlan,
    ) -> BResult<Self::Tensor>;
    /// Store this forward's K=V rows into the sliding-window rings.
    fn window_store(
        &self,
        kv: &mut Self::KvStore,
        layout: &KvLayout,
        layer: usize,
        kv_new: &Self::Tensor,
        plan: &BatchPlan,
    ) -> BResult<()>;
    /// Routed experts plus shared expert.
    fn moe(&self, x: &Self::Tensor, p: &MoeParams<'_, Self::Tensor>) -> BResult<Self::Tensor>;

    /// Run one decode step: every sequence of `plan` has exactly one new row, and
    /// `forward` returns the logits of every row. A backend may pad the batch and replay a
    /// captured graph (the CUDA backend does); the default runs `forward` once.
    fn decode_step(
        &self,
        kv: &mut Self::KvStore,
        plan: &BatchPlan,
        forward: &mut StepForward<'_, Self>,
    ) -> BResult<HostTensor>
    where
        Self: Sized,
    {
        let logits = forward(self, kv, plan)?;
        self.to_host(&logits)
    }
}
