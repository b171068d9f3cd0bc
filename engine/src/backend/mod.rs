//! What a backend implements, in three traits: [`TensorOps`] (every numeric operation
//! of the forward pass), [`KvStorage`] (a pool's pages and state slots as bytes) and
//! [`StepRunner`] (how a decode step runs); [`Backend`] is all three. The model code
//! ([`crate::model`]) is written once against them; `cpu` implements them in fp32 and
//! the CUDA backend on the GPU.

pub mod counter_rng;
pub mod cpu;
mod cpu_attention;
mod cpu_kv;
mod cpu_math;
mod gemm;
mod kv_storage;
mod ops;
pub mod picks;
pub mod shapes;
mod step;

use crate::kv::{PageId, StateSlot};
use crate::rope::Rope;
pub use counter_rng::WeightInit;
pub use kv_storage::{check_state_ranges, KvStorage};
pub use ops::{dequantized, TensorOps, WeightUse};
pub use picks::{PickKind, PickLog, Picks, RouteRecord, RowPicks};
pub use step::{check_outs, RowArgmax, RowOut, StepForward, StepOutput, StepRunner};

/// A 2-D fp32 tensor on the host, row-major: what backends upload from and download to,
/// and the CPU backend's own tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        HostTensor {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
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
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Cuts inside this forward whose state is wanted too (the prefix cache's page
    /// boundaries), as one plan of this forward's rows with a sequence per cut: the
    /// single sequence's `len` ending at the cut, with a state slot of its own. Only the
    /// ring writers ([`TensorOps::window_store`], [`TensorOps::compress_ring`]) take it,
    /// once per layer for all cuts: each cut's slot gets the rings the sequence would have
    /// if the forward ended there. Its sequences share rows, so `row_seq` (all the first
    /// cut's) is not theirs: the ring writers address rows by sequence.
    pub cuts: Option<Box<BatchPlan>>,
}

/// A cut inside a forward of one sequence: its position and the state slot that gets the
/// sequence's rings as they would be had the forward ended there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    pub pos: usize,
    pub state: StateSlot,
}

impl BatchPlan {
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// The plan of `cuts` inside this forward of a single sequence ([`BatchPlan::cuts`]):
    /// this forward's rows, one sequence per cut, the sequence up to the cut writing the
    /// cut's slot. `None` without cuts; an error for cuts outside the forward's positions
    /// (a cut must have rows after it: one at the forward's end is the forward itself).
    pub fn cut_plan(&self, cuts: &[Cut]) -> BResult<Option<Box<BatchPlan>>> {
        if cuts.is_empty() {
            return Ok(None);
        }
        let bad = |detail: String| BackendError::Shape {
            op: "cut_plan",
            detail,
        };
        let [seq] = self.seqs.as_slice() else {
            return Err(bad(format!(
                "cuts in a forward of {} sequences",
                self.seqs.len()
            )));
        };
        let seqs = cuts
            .iter()
            .map(|c| {
                if c.pos <= seq.start || c.pos >= seq.start + seq.len {
                    return Err(bad(format!(
                        "cut at {} outside the forward's positions {}..{}",
                        c.pos,
                        seq.start,
                        seq.start + seq.len
                    )));
                }
                let mut s = seq.clone();
                s.len = c.pos - seq.start;
                s.state = c.state;
                Ok(s)
            })
            .collect::<BResult<Vec<_>>>()?;
        Ok(Some(Box::new(BatchPlan {
            seqs,
            tokens: self.tokens.clone(),
            positions: self.positions.clone(),
            row_seq: self.row_seq.clone(),
            cuts: None,
        })))
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

impl CompressorPart {
    /// Where this compressor's ring lives in layer `l`'s part of the state slot: its byte
    /// offset, its slots (rows) and the width of a row's kv (and of its gate) half.
    pub fn ring(self, l: &crate::kv::LayerKvLayout) -> (usize, usize, usize) {
        match self {
            CompressorPart::Main => (l.comp_state_offset, l.comp_ring_slots, l.comp_width),
            CompressorPart::Index => (l.index_state_offset, l.index_ring_slots, l.index_width),
        }
    }
}

/// Parameters of a softmax-gated pooling compressor.
pub struct CompressorParams<'a, T> {
    pub part: CompressorPart,
    pub position_bias: &'a T,
    pub norm_weight: &'a T,
    pub eps: f32,
    pub rope: &'a Rope,
}

/// The query norm and rope around one layer's attention: each query head RMS-normed
/// (unweighted) and roped at its row's position before the products, the output's rope
/// channels rotated back after them (K = V carries rope).
#[derive(Clone, Copy)]
pub struct HeadRope<'a> {
    pub rope: &'a Rope,
    /// eps of the query heads' RMS norm.
    pub q_norm_eps: f32,
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
    /// `deepseek` numerics, where the routed experts' / the shared expert's weights are
    /// stored FP8/FP4: their linears' inputs are quantized ([`TensorOps::act_quant`]), and
    /// a routed expert's routing weight scales its activation before `down`, as DeepSeek's
    /// reference does.
    pub act_quant_routed: bool,
    pub act_quant_shared: bool,
    /// Where to record this layer's routed experts ([`picks`]); `None` in serving.
    pub record: Option<RouteRecord<'a>>,
}

/// Hyper-connection parameters of one site.
pub struct HcParams<'a, T> {
    pub base: &'a T,
    pub scale: &'a T,
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// Output of [`TensorOps::hc_pre`].
pub struct HcPre<T> {
    /// `[rows, hc]` placement weights of the sublayer output.
    pub post: T,
    /// `[rows, hc*hc]` Sinkhorn-normalised stream mixer.
    pub comb: T,
    /// `[rows, hidden]` streams collapsed by the `pre` weights.
    pub collapsed: T,
}

pub type BResult<T> = Result<T, BackendError>;

/// A whole backend: its tensor ops, its KV storage and its step runner.
pub trait Backend: StepRunner {}

impl<T: StepRunner> Backend for T {}
