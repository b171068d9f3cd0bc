//! Every numeric operation of the forward pass, on a backend's own tensors (and, for the
//! paged attention ops, its KV storage).

use super::counter_rng::{self, WeightInit};
use super::{
    picks::PickLog, BResult, BackendError, BatchPlan, CompressedKeys, CompressorParams,
    CompressorPart, HcParams, HcPre, HeadRope, HostTensor, KvStorage, MoeParams,
};
use crate::checkpoint::{StoredWeight, WeightFormat};
use crate::kv::KvLayout;
use crate::rope::Rope;

/// What the model uses a weight for, which decides how a backend may store it (the model
/// decides: [`crate::model::weights::weight_use`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightUse {
    /// A matrix read by GEMMs or the expert kernels: a backend may keep it in reduced
    /// precision (the CUDA backend: bf16 under bf16 weights).
    Matrix,
    /// A matrix whose products must stay fp32.
    KeepF32,
    /// A vector (norm weight, sink, bias, scale): fp32.
    Vector,
}

pub trait TensorOps: KvStorage {
    /// A 2-D tensor (activations and weights; vectors are `[1, n]`).
    type Tensor: Send + Sync;
    /// Per-row indexer picks.
    type Selection: Send + Sync;

    fn name(&self) -> String;
    /// Bytes free now where this backend keeps its KV pool (host `MemAvailable` for the
    /// CPU, the device's free memory for CUDA); `None` where unknown. `--kv-mem-fraction`
    /// sizes the pool from it once the weights are loaded.
    fn memory_free(&self) -> Option<u64>;
    fn dims(&self, t: &Self::Tensor) -> (usize, usize);
    fn upload(&self, t: HostTensor) -> BResult<Self::Tensor>;
    /// Upload a weight the model uses as `usage`; the backend stores it accordingly (the
    /// CUDA backend keeps [`WeightUse::Matrix`] in bf16 under bf16 weights, the rest fp32).
    /// Default: [`TensorOps::upload`].
    fn upload_weight(&self, t: HostTensor, usage: WeightUse) -> BResult<Self::Tensor> {
        let _ = usage;
        self.upload(t)
    }
    /// A synthetic weight used as `usage` (stored as [`TensorOps::upload_weight`] would
    /// store it), `rows x cols` values drawn by `init` from the counter-based generator of
    /// [`counter_rng`] keyed by `seed`: deterministic, the same values on every backend (up to
    /// storage rounding). Default: generated on the host, then uploaded; the CUDA backend
    /// generates on the device.
    fn random_weight(
        &self,
        rows: usize,
        cols: usize,
        init: WeightInit,
        seed: u64,
        usage: WeightUse,
    ) -> BResult<Self::Tensor> {
        self.upload_weight(counter_rng::host_tensor(rows, cols, init, seed), usage)
    }
    /// Upload a weight kept in its stored format (block-scaled FP8, group-scaled FP4). The
    /// CUDA backend keeps the bytes and computes on them; the default (the CPU backend, the
    /// oracle) takes the exact f32 values ([`StoredWeight::dequantize`]).
    fn upload_stored(&self, w: StoredWeight, usage: WeightUse) -> BResult<Self::Tensor> {
        self.upload_weight(dequantized(&w)?, usage)
    }
    /// A synthetic weight in stored `format` (groups of `group_rows` rows, see
    /// [`StoredWeight`]): the values [`TensorOps::random_weight`] draws, quantized as
    /// [`StoredWeight::quantize`] does, then stored as [`TensorOps::upload_stored`] stores
    /// them. Default: on the host; the CUDA backend quantizes on the device.
    #[allow(clippy::too_many_arguments)]
    fn random_stored(
        &self,
        (rows, cols): (usize, usize),
        format: WeightFormat,
        group_rows: usize,
        init: WeightInit,
        seed: u64,
        usage: WeightUse,
    ) -> BResult<Self::Tensor> {
        let t = counter_rng::host_tensor(rows, cols, init, seed);
        let w =
            StoredWeight::quantize(format, &t.data, rows, cols, group_rows).map_err(|detail| {
                BackendError::Shape {
                    op: "random_stored",
                    detail,
                }
            })?;
        self.upload_stored(w, usage)
    }
    fn to_host(&self, t: &Self::Tensor) -> BResult<HostTensor>;
    /// Rows `rows` of `t`, in that order.
    fn gather_rows(&self, t: &Self::Tensor, rows: &[usize]) -> BResult<Self::Tensor>;

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
    /// `rms_norm(x, None, <x's columns>, eps) @ w^T`: the hyper-connection mix logits.
    /// Default: those two ops; the CUDA backend runs the GEMM on the raw rows and scales
    /// each row's result by its norm (no normalised copy of the streams).
    fn rms_norm_matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
    ) -> BResult<Self::Tensor> {
        let (_, cols) = self.dims(x);
        let normed = self.rms_norm(x, None, cols, eps)?;
        self.matmul(&normed, w)
    }
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
    /// [`TensorOps::hc_pre`] with the mix logits `rms_norm_matmul(streams, fn_, norm_eps)`.
    /// Default: those two ops; the CUDA backend folds each row's norm into the mapping
    /// kernel (the same values, one pass over the streams fewer).
    fn hc_pre_mixed(
        &self,
        streams: &Self::Tensor,
        fn_: &Self::Tensor,
        norm_eps: f32,
        p: &HcParams<'_, Self::Tensor>,
    ) -> BResult<HcPre<Self::Tensor>> {
        let mix = self.rms_norm_matmul(streams, fn_, norm_eps)?;
        self.hc_pre(streams, &mix, p)
    }
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
    /// The ring writes of [`TensorOps::compress`] without the pooling: each sequence's
    /// last projected rows into its compressor ring. A cut inside a longer forward (a
    /// prefix of a sequence's rows, with a state slot of its own) gets the ring that
    /// sequence would have if the forward had ended at the cut.
    #[allow(clippy::too_many_arguments)]
    fn compress_ring(
        &self,
        kv: &mut Self::KvStore,
        layout: &KvLayout,
        layer: usize,
        part: CompressorPart,
        proj_kv: &Self::Tensor,
        proj_gate: &Self::Tensor,
        plan: &BatchPlan,
    ) -> BResult<()>;
    /// Lightning indexer: score every visible index-K entry, keep the top `topk` per row;
    /// with `record`, append every row's picks to it ([`super::picks`]).
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
        record: Option<&PickLog>,
    ) -> BResult<Self::Selection>;
    /// Sink attention of every row over its sliding window (earlier positions from the
    /// ring, this forward's from `kv_new`) and the given compressed entries. `q` is the
    /// query projection: its heads are normed and roped, and the output's rope channels
    /// rotated back, as `head_rope` says. The result is the o-projection's input: a
    /// backend may hand it over in the form its GEMMs read (bf16 on the GPU, rounded
    /// exactly as the GEMM would).
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
        head_rope: HeadRope<'_>,
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
    /// `deepseek` numerics: `x` with every `block` consecutive values of a row replaced by
    /// their FP8 value under a power-of-two scale ([`crate::numerics::act_quant`]), the
    /// input of an FP8/FP4 linear. Default: refused, for a backend that does not implement
    /// the mode (the CPU and CUDA backends both do).
    fn act_quant(&self, x: &Self::Tensor, block: usize) -> BResult<Self::Tensor> {
        let _ = (x, block);
        Err(super::BackendError::Device(format!(
            "{}: --numerics deepseek (FP8 activation quantization) is not implemented on this backend",
            self.name()
        )))
    }

    /// `deepseek` numerics' FP8/FP4 linear: `act_quant(x) @ w^T`, the input quantized per
    /// [`crate::numerics::ACT_BLOCK`]. Default: those two ops; a backend may run the
    /// product on FP8 tensor cores instead (the same products, its own summation).
    fn quantized_matmul(&self, x: &Self::Tensor, w: &Self::Tensor) -> BResult<Self::Tensor> {
        self.matmul(&self.act_quant(x, crate::numerics::ACT_BLOCK)?, w)
    }

    /// [`TensorOps::quantized_matmul`] of one input and several weights (`deepseek`
    /// numerics' linears that share an input). Default: `x` quantized once, then each
    /// product; a backend may run each as its `quantized_matmul` does, quantizing once.
    fn quantized_matmuls(
        &self,
        x: &Self::Tensor,
        ws: &[&Self::Tensor],
    ) -> BResult<Vec<Self::Tensor>> {
        let xq = self.act_quant(x, crate::numerics::ACT_BLOCK)?;
        ws.iter().map(|w| self.matmul(&xq, w)).collect()
    }
}

/// The exact f32 values of stored weight `w` as a host tensor (what a backend without
/// FP8/FP4 kernels, or a reference mode, uploads).
pub fn dequantized(w: &StoredWeight) -> BResult<HostTensor> {
    let data = w.dequantize().map_err(|detail| BackendError::Shape {
        op: "upload_stored",
        detail,
    })?;
    Ok(HostTensor {
        rows: w.rows,
        cols: w.cols,
        data,
    })
}
