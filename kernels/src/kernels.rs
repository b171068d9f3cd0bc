//! One typed handle per `__global__` kernel of `cu/*.cu`: a struct whose fields are the
//! kernel's parameters, in the `.cu` order, written once here. Call sites fill the fields
//! by name, so an argument cannot be passed in the wrong position, and a pointer cannot go
//! where an integer is expected; the test below checks every handle against the `.cu`
//! signature (names, count, kinds) and that every kernel has a handle. [`REGISTRY`] is
//! the list of functions [`crate::device::Gpu::open`] loads from each module.

use crate::devmem::DevMem;
use crate::launch::Arg;

/// A device address passed to a kernel (null where the kernel accepts a missing buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevPtr(pub(crate) u64);

impl DevPtr {
    pub(crate) const NULL: DevPtr = DevPtr(0);

    pub(crate) fn of<T>(m: &DevMem<T>) -> DevPtr {
        DevPtr(m.ptr())
    }

    /// The address `bytes` past this one.
    pub(crate) fn offset(self, bytes: usize) -> DevPtr {
        DevPtr(self.0 + bytes as u64)
    }
}

/// Element type of the kernels compiled once per storage (`_bf16` / `_f32` variants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    Bf16,
    F32,
}

/// The selector of a handle with several kernels: the position of the name that runs.
pub(crate) trait Variant: Copy {
    fn index(self) -> usize;
}

impl Variant for Elem {
    fn index(self) -> usize {
        usize::from(self == Elem::F32)
    }
}

/// Products of the tensor-core attention: queries and probabilities rounded to bf16 (on
/// `mma.sync`, or on Hopper's `wgmma`), or split into hi + lo bf16 halves (gpu-check's A/B
/// under fp32 weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Products {
    Bf16,
    HiLo,
    Bf16Wgmma,
}

impl Variant for Products {
    fn index(self) -> usize {
        self as usize
    }
}

/// Picks per pass of the grouped expert kernels: 8, or 2 for batches of at most 2 rows
/// (fewer registers, more loads in flight; the same arithmetic per pick).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PickTile {
    Full,
    Small,
}

impl Variant for PickTile {
    fn index(self) -> usize {
        usize::from(self == PickTile::Small)
    }
}

/// Weight format of the tensor-core expert and dense kernels: one kernel per format (each
/// its own register allocation), in the order of their names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertFormat {
    Bf16,
    Fp8,
    Fp4,
}

/// A tensor-core expert or dense kernel: its weight format and picks per pass (`narrow`:
/// 8 instead of 32, the `_p8` kernels, three blocks per SM; for batches of at most 8 rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MmaVariant {
    pub format: ExpertFormat,
    pub narrow: bool,
}

impl Variant for MmaVariant {
    fn index(self) -> usize {
        2 * self.format as usize + usize::from(self.narrow)
    }
}

/// Kind of a kernel parameter as the `.cu` signature declares it.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Param {
    /// Any pointer.
    Ptr,
    /// `int`.
    I32,
    /// `i64`.
    I64,
    /// `unsigned long long`.
    U64,
    /// `float`.
    F32,
}

/// A Rust type a kernel parameter can have.
pub(crate) trait KernelArg: Copy {
    #[cfg(test)]
    const PARAM: Param;
    fn arg(self) -> Arg;
}

impl KernelArg for DevPtr {
    #[cfg(test)]
    const PARAM: Param = Param::Ptr;
    fn arg(self) -> Arg {
        Arg::Ptr(self.0)
    }
}

impl KernelArg for i32 {
    #[cfg(test)]
    const PARAM: Param = Param::I32;
    fn arg(self) -> Arg {
        Arg::I32(self)
    }
}

impl KernelArg for i64 {
    #[cfg(test)]
    const PARAM: Param = Param::I64;
    fn arg(self) -> Arg {
        Arg::I64(self)
    }
}

impl KernelArg for u64 {
    #[cfg(test)]
    const PARAM: Param = Param::U64;
    /// The kernel reads the same 8 bytes as `unsigned long long`.
    fn arg(self) -> Arg {
        Arg::I64(self as i64)
    }
}

impl KernelArg for f32 {
    #[cfg(test)]
    const PARAM: Param = Param::F32;
    fn arg(self) -> Arg {
        Arg::F32(self)
    }
}

/// A kernel launch's function name and argument list.
pub(crate) trait Kernel {
    fn name(&self) -> &'static str;
    /// Calls `f` with the arguments in the `.cu` parameter order.
    fn with_args<R>(&self, f: impl FnOnce(&[Arg]) -> R) -> R;
}

/// One handle struct; a handle with several names gets a `variant` field (of the type
/// named after `by`) choosing which runs.
macro_rules! kernel_handle {
    ($(#[$doc:meta])* $ty:ident, [$name:literal], [], { $($field:ident: $fty:ty),+ }) => {
        $(#[$doc])*
        pub(crate) struct $ty {
            $(pub $field: $fty),+
        }

        impl Kernel for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn with_args<R>(&self, f: impl FnOnce(&[Arg]) -> R) -> R {
                f(&[$(self.$field.arg()),+])
            }
        }
    };
    ($(#[$doc:meta])* $ty:ident, [$first:literal $(, $more:literal)+], [$sel:ty], { $($field:ident: $fty:ty),+ }) => {
        $(#[$doc])*
        pub(crate) struct $ty {
            /// Which variant runs.
            pub variant: $sel,
            $(pub $field: $fty),+
        }

        impl Kernel for $ty {
            fn name(&self) -> &'static str {
                let names: &[&'static str] = &[$first $(, $more)+];
                names.get(Variant::index(self.variant)).copied().unwrap_or($first)
            }

            fn with_args<R>(&self, f: impl FnOnce(&[Arg]) -> R) -> R {
                f(&[$(self.$field.arg()),+])
            }
        }
    };
}

/// The handles of every module, plus [`REGISTRY`] and (in tests) `SIGNATURES`.
macro_rules! kernels {
    ($(
        module $module:literal {
            $(
                $(#[$doc:meta])*
                $ty:ident = $($name:literal)|+ $(by $sel:ty)? { $($field:ident: $fty:ty),+ $(,)? }
            )+
        }
    )+) => {
        $($(
            kernel_handle!($(#[$doc])* $ty, [$($name),+], [$($sel)?], { $($field: $fty),+ });
        )+)+

        /// Every kernel function by module: what the device loads.
        pub(crate) const REGISTRY: &[(&str, &[&str])] = &[$(
            ($module, &[$($($name),+),+]),
        )+];

        /// Every handle's names and parameters (name, kind), in field order.
        #[cfg(test)]
        #[allow(clippy::type_complexity)]
        pub(crate) const SIGNATURES: &[(&str, &[&str], &[(&str, Param)])] = &[$($(
            (
                $module,
                &[$($name),+],
                &[$((stringify!($field), <$fty as KernelArg>::PARAM)),+],
            ),
        )+)+];
    };
}

kernels! {
    module "elementwise" {
        /// fp32 values rounded to bf16 (GEMM inputs next to bf16 weights).
        F32ToBf16 = "k_f32_to_bf16" {
            x: DevPtr, y: DevPtr, n: i64,
        }
        /// bf16 values widened to fp32 (bf16 parameters read as fp32).
        Bf16ToF32 = "k_bf16_to_f32" {
            x: DevPtr, y: DevPtr, n: i64,
        }
        /// Elementwise clamped SwiGLU of gate `g` and up `u` (the shared expert).
        Swiglu = "k_swiglu" {
            g: DevPtr, u: DevPtr, y: DevPtr, n: i64, limit: f32,
        }
        /// SwiGLU of rows holding gate columns then up columns (prefill expert GEMMs).
        SwigluHalves = "k_swiglu_halves" {
            x: DevPtr, y: DevPtr, n: i64, inter: i32, limit: f32,
        }
        /// Embedding rows of `tokens`, `copies` times over; one variant per table storage.
        Embed = "k_embed_bf16" | "k_embed_f32" by Elem {
            table: DevPtr, tokens: DevPtr, out: DevPtr, h: i32, copies: i32,
        }
        /// `out[r] = x[idx[r]]`, one block per row.
        GatherRows = "k_gather_rows" {
            x: DevPtr, idx: DevPtr, out: DevPtr, cols: i32,
        }
        /// `out[r] = bf16(x[idx[r]])`, one block per row.
        GatherRowsBf16 = "k_gather_rows_bf16" {
            x: DevPtr, idx: DevPtr, out: DevPtr, cols: i32,
        }
        /// `rinv[r] = 1 / sqrt(mean(x[r]^2) + eps)`, one block per row.
        RowInvRms = "k_row_inv_rms" {
            x: DevPtr, rinv: DevPtr, cols: i32, eps: f32,
        }
        /// `y[r, c] *= s[r]`.
        ScaleRows = "k_scale_rows" {
            y: DevPtr, s: DevPtr, rows: i32, cols: i32,
        }
        /// `--deterministic` GEMM: each output's reduction order fixed, whatever the batch.
        MatmulRows = "k_matmul_rows_bf16" | "k_matmul_rows_f32" by Elem {
            x: DevPtr, w: DevPtr, y: DevPtr, m: i32, n: i32, k: i32, ldx: i32, dout: i32,
        }
    }
    module "norm_rope" {
        /// RMS norm over groups of `group` values; `w` may be null.
        RmsNorm = "k_rms_norm" {
            x: DevPtr, w: DevPtr, out: DevPtr, group: i32, eps: f32,
        }
        /// The same norm, one warp per group (small groups: per-head norms).
        RmsNormWarp = "k_rms_norm_warp" {
            x: DevPtr, w: DevPtr, out: DevPtr, group: i32, groups: i32, eps: f32,
        }
        /// Attention's bf16 queries: every head RMS-normed, roped and rounded.
        QueryHeadsBf16 = "k_query_heads_bf16" {
            x: DevPtr, cs: DevPtr, sn: DevPtr, out: DevPtr, head_dim: i32, groups: i32,
            heads_per_row: i32, rd: i32, eps: f32,
        }
        /// Interleaved partial rope of every head, in place; `inverse` uses -sin.
        Rope = "k_rope" {
            x: DevPtr, cs: DevPtr, sn: DevPtr, cols: i32, head_dim: i32, rd: i32, inverse: i32,
        }
    }
    module "hc" {
        /// Hyper-connection pre-mapping: post and comb (Sinkhorn) maps and the collapsed row;
        /// with `norm` (1; 2: the row kept in shared memory between the norm and the
        /// collapse), the mix logits of the raw rows scaled by each row's RMS norm first.
        HcPre = "k_hc_pre" {
            streams: DevPtr, mix: DevPtr, base: DevPtr, scale: DevPtr, post: DevPtr,
            comb: DevPtr, collapsed: DevPtr, h: i32, hc: i32, iters: i32, eps: f32,
            norm: i32, norm_eps: f32,
        }
        /// Hyper-connection stream update from a block output.
        HcPost = "k_hc_post" {
            streams: DevPtr, out: DevPtr, post: DevPtr, comb: DevPtr, res: DevPtr, h: i32,
            hc: i32,
        }
        /// Hyper-connection head: the streams collapsed before the final norm.
        HcHead = "k_hc_head" {
            streams: DevPtr, mix: DevPtr, base: DevPtr, scale: DevPtr, out: DevPtr, h: i32,
            hc: i32, eps: f32,
        }
    }
    module "compress" {
        /// Compressor: ring update and, at each rate boundary, one pooled, normed, roped entry.
        Compress = "k_compress" {
            pages: DevPtr, states: DevPtr, page_bytes: i64, state_bytes: i64, seq: DevPtr,
            pt: DevPtr, proj_kv: DevPtr, proj_gate: DevPtr, bias: DevPtr, norm_w: DevPtr,
            cs: DevPtr, sn: DevPtr, width: i32, rate: i32, slots: i32, overlap: i32,
            ring_off: i64, entry_off: i64, scale_off: i64, entries_per_page: i32,
            page_tokens: i32, dt: i32, rd: i32, eps: f32, by_window: i32, rot_scale_bits: i64,
        }
        /// After a compress by window: each sequence's last rows into its ring.
        CompressRing = "k_compress_ring" {
            states: DevPtr, state_bytes: i64, seq: DevPtr, proj_kv: DevPtr, proj_gate: DevPtr,
            width: i32, slots: i32, ring_off: i64,
        }
    }
    module "indexer" {
        /// Lightning-indexer scores of every visible compressed entry.
        IndexScores = "k_index_scores" {
            pages: DevPtr, page_bytes: i64, seq: DevPtr, pt: DevPtr, row_seq: DevPtr,
            positions: DevPtr, q: DevPtr, wts: DevPtr, scores: DevPtr, max_nv: i32,
            n_heads: i32, ihd: i32, rate: i32, entry_off: i64, scale_off: i64,
            entries_per_page: i32, page_tokens: i32, dt: i32, softmax_scale: f32,
            weight_scale: f32,
        }
        /// The same scores on tensor cores (bf16 entries, queries rounded to bf16).
        IndexScoresMma = "k_index_scores_mma" {
            pages: DevPtr, page_bytes: i64, seq: DevPtr, pt: DevPtr, row_seq: DevPtr,
            positions: DevPtr, q: DevPtr, wts: DevPtr, scores: DevPtr, max_nv: i32,
            n_heads: i32, ihd: i32, rate: i32, entry_off: i64, entries_per_page: i32,
            page_tokens: i32, softmax_scale: f32, weight_scale: f32, rows: i32,
            rows_per_block: i32, tiles: i32,
        }
        /// One sequence's visible index-K entries as a dense fp32 matrix (prefill path).
        GatherIndexK = "k_gather_index_k" {
            pages: DevPtr, page_bytes: i64, seq: DevPtr, pt: DevPtr, si: i32, nv: i32,
            ihd: i32, rate: i32, entry_off: i64, scale_off: i64, entries_per_page: i32,
            page_tokens: i32, dt: i32, out: DevPtr, out_bf16: i32,
        }
        /// Indexer scores of a chunk of rows from its per-head dot products (prefill path).
        IndexReduce = "k_index_reduce" {
            d: DevPtr, nvs: i32, positions: DevPtr, wts: DevPtr, scores: DevPtr, row0: i32,
            max_nv: i32, n_heads: i32, rate: i32, softmax_scale: f32, weight_scale: f32,
        }
        /// Top-k entry ids of each row's indexer scores, ascending, `-1` padded.
        Topk = "k_topk" {
            scores: DevPtr, positions: DevPtr, sel: DevPtr, max_nv: i32, topk: i32, rate: i32,
        }
    }
    module "attention" {
        /// Sink attention over the sliding window plus none, all or the selected compressed entries.
        Attention = "k_attention" {
            pages: DevPtr, states: DevPtr, page_bytes: i64, state_bytes: i64, seq: DevPtr,
            pt: DevPtr, row_seq: DevPtr, positions: DevPtr, q: DevPtr, kv_new: DevPtr,
            sinks: DevPtr, sel: DevPtr, topk: i32, out: DevPtr, n_heads: i32, hd: i32,
            window: i32, win_off: i64, rate: i32, mode: i32, comp_off: i64, comp_epp: i32,
            page_tokens: i32, dt: i32, scale: f32, max_keys: i32, g: i32, rd: i32,
            win_scale_off: i64, comp_scale_off: i64,
        }
        /// New keys into each sequence's sliding-window ring.
        WindowStore = "k_window_store" {
            states: DevPtr, state_bytes: i64, seq: DevPtr, kv_new: DevPtr, hd: i32,
            window: i32, win_off: i64, dt: i32, rd: i32, win_scale_off: i64,
        }
        /// fp8 KV: rows as storing and loading one entry gives them (this forward's keys).
        KvRoundTrip = "k_kv_round_trip" {
            x: DevPtr, out: DevPtr, hd: i32, rd: i32,
        }
    }
    module "attention_split" {
        /// The same attention split over the keys: partials per split, or the result (`direct`).
        AttentionSplit = "k_attention_split" {
            pages: DevPtr, states: DevPtr, page_bytes: i64, state_bytes: i64, seq: DevPtr,
            pt: DevPtr, row_seq: DevPtr, positions: DevPtr, q: DevPtr, new_rows: DevPtr,
            new_scales: DevPtr, sinks: DevPtr, sel: DevPtr, topk: i32, out: DevPtr,
            part: DevPtr, part_ml: DevPtr,
            n_heads: i32, hd: i32, window: i32, win_off: i64, rate: i32, mode: i32,
            comp_off: i64, comp_epp: i32, page_tokens: i32, dt: i32, scale: f32, g: i32,
            rd: i32, win_scale_off: i64, comp_scale_off: i64, split_keys: i32, nsplit: i32,
            direct: i32,
        }
        /// This forward's keys as entries of the KV dtype (what the split kernel reads).
        KvEntries = "k_kv_entries" {
            x: DevPtr, rows: DevPtr, scales: DevPtr, hd: i32, rd: i32, dt: i32,
        }
        /// Merges the splits' partials in split order, with the sink.
        AttentionCombine = "k_attention_combine" {
            part: DevPtr, part_ml: DevPtr, sinks: DevPtr, out: DevPtr, n_heads: i32, hd: i32,
            nsplit: i32,
        }
    }
    module "attention_mma" {
        /// The same attention on tensor cores, all heads of a row per block (bf16/fp8
        /// entries), its products in bf16 (mma.sync or wgmma) or as hi + lo halves.
        AttentionMma = "k_attention_mma" | "k_attention_mma_exact" | "k_attention_wgmma" by Products {
            pages: DevPtr, states: DevPtr, page_bytes: i64, state_bytes: i64, seq: DevPtr,
            pt: DevPtr, row_seq: DevPtr, positions: DevPtr, q: DevPtr, new_rows: DevPtr,
            new_scales: DevPtr, sinks: DevPtr, sel: DevPtr, topk: i32, q_bf16: DevPtr,
            out: DevPtr, un_cs: DevPtr, un_sn: DevPtr, out_bf16: DevPtr, part: DevPtr, part_ml: DevPtr,
            n_heads: i32, hd: i32, window: i32, win_off: i64, rate: i32, mode: i32,
            comp_off: i64, comp_epp: i32, page_tokens: i32, dt: i32, scale: f32,
            rd: i32, win_scale_off: i64, comp_scale_off: i64, split_keys: i32, nsplit: i32,
            direct: i32,
        }
        /// fp8 KV entries (window rings, compressed entries, this forward's keys) as bf16
        /// rows, converted once for all of a prefill's rows.
        KvDequantBf16 = "k_kv_dequant_bf16" {
            pages: DevPtr, states: DevPtr, page_bytes: i64, state_bytes: i64, seq: DevPtr,
            pt: DevPtr, new_rows: DevPtr, new_scales: DevPtr, out: DevPtr, n_ring: i32,
            n_comp: i32, n_new: i32, window: i32, win_off: i64, win_scale_off: i64,
            comp_off: i64, comp_scale_off: i64, comp_epp: i32, hd: i32, rd: i32,
        }
    }
    module "moe" {
        /// MoE routing: scores, top-k expert ids and weights of each row.
        MoeRoute = "k_moe_route" {
            logits: DevPtr, bias: DevPtr, hash: DevPtr, ids: DevPtr, wts: DevPtr, rows: i32,
            e: i32, k: i32, scoring: i32, routed_scaling: f32,
        }
        /// Picks grouped by expert, and the used experts in ascending order.
        MoeLists = "k_moe_lists" {
            ids: DevPtr, list: DevPtr, count: DevPtr, active: DevPtr, rows: i32, e: i32,
            k: i32,
        }
        /// Routed experts' gate+up and SwiGLU over each expert's picks, over weights `w`
        /// in format `fmt` (f32, bf16, or stored FP8/FP4 with scales `s`).
        MoeGateUpGrouped = "k_moe_gate_up_grouped" | "k_moe_gate_up_grouped_small" by PickTile {
            x: DevPtr, w: DevPtr, s: DevPtr, fmt: i32, group_rows: i32, list: DevPtr,
            active: DevPtr, count: DevPtr, act: DevPtr, rows: i32, e: i32, h: i32, i: i32,
            k: i32, limit: f32,
        }
        /// Routed experts' down projection over each expert's picks, as [`MoeGateUpGrouped`].
        MoeDownGrouped = "k_moe_down_grouped" | "k_moe_down_grouped_small" by PickTile {
            act: DevPtr, w: DevPtr, s: DevPtr, fmt: i32, group_rows: i32, list: DevPtr,
            active: DevPtr, count: DevPtr, y: DevPtr, rows: i32, e: i32, h: i32, i: i32,
        }
        /// Picks of each expert gathered into padded bf16 batches for one batched GEMM.
        MoeGatherPadded = "k_moe_gather_padded" {
            x: DevPtr, list: DevPtr, count: DevPtr, xp: DevPtr, rows: i32, h: i32, k: i32,
        }
        /// [`SwigluHalves`] with bf16 output (the padded-batch expert path).
        SwigluHalvesBf16 = "k_swiglu_halves_bf16" {
            gu: DevPtr, act: DevPtr, n: i64, inter: i32, limit: f32,
        }
        /// Padded-batch expert outputs back to pick order.
        MoeScatterPadded = "k_moe_scatter_padded" {
            yp: DevPtr, list: DevPtr, count: DevPtr, y: DevPtr, rows: i32, h: i32,
        }
        /// Weighted sum of each row's picks plus the shared expert.
        MoeCombine = "k_moe_combine" {
            y: DevPtr, pos: DevPtr, ids: DevPtr, wts: DevPtr, shared: DevPtr, out: DevPtr, h: i32,
            k: i32,
        }
    }
    module "moe_mma" {
        /// Routed experts' gate/up projections on tensor cores (bf16 inputs, bf16 SwiGLU
        /// output; bf16 or stored FP8/FP4 weights dequantized in registers).
        MoeGateUpMma = "k_moe_gate_up_mma_bf16" | "k_moe_gate_up_mma_bf16_p8" | "k_moe_gate_up_mma_fp8" | "k_moe_gate_up_mma_fp8_p8"
            | "k_moe_gate_up_mma_fp4" | "k_moe_gate_up_mma_fp4_p8" by MmaVariant {
            x: DevPtr, w: DevPtr, s: DevPtr, group_rows: i32, list: DevPtr,
            active: DevPtr, count: DevPtr, act: DevPtr, rows: i32, e: i32, h: i32, i: i32,
            k: i32, limit: f32,
        }
        /// Their down projection on tensor cores, as [`MoeGateUpMma`].
        MoeDownMma = "k_moe_down_mma_bf16" | "k_moe_down_mma_bf16_p8" | "k_moe_down_mma_fp8" | "k_moe_down_mma_fp8_p8"
            | "k_moe_down_mma_fp4" | "k_moe_down_mma_fp4_p8" by MmaVariant {
            act: DevPtr, w: DevPtr, s: DevPtr, group_rows: i32, list: DevPtr,
            active: DevPtr, count: DevPtr, y: DevPtr, rows: i32, e: i32, h: i32, i: i32,
        }
        /// A dense stored-format GEMM on tensor cores (decode batches past the fused
        /// kernel's), each split's partial sums to `ys`.
        MatmulMma = "k_matmul_mma_bf16" | "k_matmul_mma_bf16_p8" | "k_matmul_mma_fp8" | "k_matmul_mma_fp8_p8"
            | "k_matmul_mma_fp4" | "k_matmul_mma_fp4_p8" by MmaVariant {
            x: DevPtr, ldx: i32, w: DevPtr, s: DevPtr, group_rows: i32, ys: DevPtr, rows: i32,
            n: i32, k: i32, dout: i32,
        }
        /// The splits' partial sums added in split order.
        SplitSum = "k_split_sum" {
            ys: DevPtr, y: DevPtr, n: i64, splits: i32,
        }
    }
    module "quant" {
        /// `x @ w^T` over a stored FP8/FP4 weight, dequantized in the inner loop (small
        /// batches; batch-invariant); activations fp32 `x` or bf16 `xb` (the other null).
        MatmulQ = "k_matmul_q" {
            x: DevPtr, xb: DevPtr, q: DevPtr, s: DevPtr, fmt: i32, group_rows: i32, y: DevPtr,
            m: i32, n: i32, k: i32, ldx: i32, dout: i32,
        }
        /// A stored FP8/FP4 weight as bf16 (exact), for the tensor-core GEMMs.
        DequantBf16 = "k_dequant_bf16" {
            q: DevPtr, s: DevPtr, fmt: i32, group_rows: i32, out: DevPtr, rows: i32, cols: i32,
        }
        /// fp32 values to block-scaled FP8, one block per 128x128 block.
        QuantizeFp8 = "k_quantize_fp8" {
            x: DevPtr, q: DevPtr, s: DevPtr, rows: i32, cols: i32, group_rows: i32,
        }
        /// fp32 values to group-scaled FP4.
        QuantizeFp4 = "k_quantize_fp4" {
            x: DevPtr, q: DevPtr, s: DevPtr, rows: i32, cols: i32,
        }
        /// DeepSeek's act_quant: e4m3 codes and one power-of-two f32 scale per 128 values
        /// of a row (the scales `[block][row]`, cuBLASLt's VEC128 layout).
        ActQuantE4m3 = "k_act_quant_e4m3" {
            x: DevPtr, ldx: i32, q: DevPtr, s: DevPtr, rows: i32, cols: i32, srows: i32,
        }
        /// The e4m3 conversions against their integer forms over every f32 bit pattern
        /// (failures counted into bad[0], the smallest failing pattern into bad[1]).
        E4m3SelfCheck = "k_e4m3_selfcheck" {
            bad: DevPtr,
        }
        /// deepseek numerics' act_quant: each value replaced by its FP8 value per 128 of
        /// a row (f32 or bf16 in, f32 out).
        ActQuantF32 = "k_act_quant_f32" {
            x: DevPtr, x16: DevPtr, y: DevPtr, rows: i32, cols: i32,
        }
        /// deepseek numerics, routed experts: each pick's activation times its routing
        /// weight, then act_quant, in place; unit weights for the combine.
        MoeWeightActQuant = "k_moe_weight_act_quant" {
            act: DevPtr, act16: DevPtr, wts: DevPtr, pos: DevPtr, unit: DevPtr, picks: i32,
            inter: i32,
        }
        /// deepseek numerics, routed experts on the FP8 GEMM: each sorted pick's row of
        /// the tokens' act_quant (codes and [block][token] scales over `n` tokens) copied
        /// into its expert's padded run (codes and VEC128 scales).
        GatherQuantizedPicks = "k_gather_quantized_picks" {
            xq: DevPtr, xs: DevPtr, n: i32, map: DevPtr, q: DevPtr, s: DevPtr, picks: i32,
            cols: i32, k: i32,
        }
        /// deepseek numerics, FP4 experts on the FP8 GEMM: rows expanded exactly to e4m3
        /// codes with one f32 scale per 1 x 128 (VEC128).
        Fp4ToE4m3 = "k_fp4_to_e4m3" {
            q4: DevPtr, s4: DevPtr, q8: DevPtr, s8: DevPtr, rows: i32, cols: i32,
        }
        /// deepseek numerics, routed experts on the FP8 GEMM: SwiGLU of the gate/up rows
        /// (the GEMM's bf16 or fp32 output) times the routing weight, quantized per 128
        /// (w2's FP8 operand).
        MoeSwigluQuantE4m3 = "k_moe_swiglu_quant_e4m3_bf16" | "k_moe_swiglu_quant_e4m3_f32" by Elem {
            gu: DevPtr, map: DevPtr, wts: DevPtr, unit: DevPtr, q: DevPtr, s: DevPtr,
            picks: i32, inter: i32, limit: f32,
        }
        /// deepseek numerics, the indexer's queries: each head rotated (Hadamard) and
        /// FP4-quantized.
        RotateFp4 = "k_rotate_fp4" {
            x: DevPtr, y: DevPtr, n: i64, hd: i32, scale_bits: i64,
        }
    }
    module "random" {
        /// Counter-based random values (the host generator's arithmetic); one variant per storage.
        Random = "k_random_bf16" | "k_random_f32" by Elem {
            out: DevPtr, n: i64, seed: u64, kind: i32, a: f32, b: f32,
        }
        /// Read-bandwidth probe: 16-byte loads summed into one value per block.
        ReadProbe = "k_read_probe" {
            x: DevPtr, n4: i64, out: DevPtr,
        }
    }
    module "audit" {
        /// The KV canary's checksum of each of `gridDim.x` regions of `words` 8-byte words.
        RegionChecksums = "k_region_checksums" {
            base: DevPtr, words: i64, out: DevPtr,
        }
    }
    module "sample" {
        /// Greedy token of each logits row (`sampling::argmax`'s rule) and whether the row
        /// is all finite: `out` holds the ids, then the flags.
        ArgmaxParts = "k_argmax_parts" {
            logits: DevPtr, cols: i32, span: i32, part_v: DevPtr, part_i: DevPtr, part_f: DevPtr,
        }
        ArgmaxRows = "k_argmax_rows" {
            part_v: DevPtr, part_i: DevPtr, part_f: DevPtr, parts: i32, rows: i32, out: DevPtr,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::collections::BTreeMap;

    /// `(module, kernel) -> [(parameter name, kind)]` of every `__global__` kernel in the
    /// `.cu` sources.
    fn cu_signatures() -> BTreeMap<(String, String), Vec<(String, Param)>> {
        let mut out = BTreeMap::new();
        for (module, src) in crate::compile::MODULES {
            for part in src.split("__global__ void ").skip(1) {
                let (name, rest) = part.split_once('(').expect("kernel name");
                let (params, _) = rest.split_once(')').expect("parameter list");
                let params = params
                    .split(',')
                    .map(|p| {
                        let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
                        let at = p
                            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                            .map_or(0, |i| i + 1);
                        let (ty, pname) = p.split_at(at);
                        let ty = ty.trim().trim_start_matches("const ").trim();
                        let kind = if ty.contains('*') {
                            Param::Ptr
                        } else {
                            match ty {
                                "int" => Param::I32,
                                "i64" => Param::I64,
                                "unsigned long long" => Param::U64,
                                "float" => Param::F32,
                                other => panic!("{name}: parameter type `{other}` unknown"),
                            }
                        };
                        (pname.to_lowercase(), kind)
                    })
                    .collect();
                out.insert((module.to_string(), name.trim().to_string()), params);
            }
        }
        out
    }

    #[test]
    fn every_handle_matches_its_cu_signature_and_every_kernel_has_one() {
        let mut cu = cu_signatures();
        assert!(cu.len() > 20, "parsed only {} kernels", cu.len());
        for (module, names, params) in SIGNATURES {
            let want: Vec<(String, Param)> =
                params.iter().map(|(n, k)| (n.to_string(), *k)).collect();
            for name in *names {
                let got = cu
                    .remove(&(module.to_string(), name.to_string()))
                    .unwrap_or_else(|| panic!("{name}: no such kernel in {module}.cu"));
                assert_eq!(want, got, "{name}: handle fields vs {module}.cu parameters");
            }
        }
        assert!(cu.is_empty(), "kernels without a handle: {:?}", cu.keys());
    }

    #[test]
    fn every_kernel_waits_for_its_predecessor_before_anything_else() {
        // Programmatic dependent launch lets a kernel start before the previous one ends:
        // only the wait at the top of its body keeps it from reading or writing too early.
        let mut kernels = 0;
        for (module, src) in crate::compile::MODULES {
            for part in src.split("__global__ void ").skip(1) {
                let name = part.split_once('(').map_or(part, |(n, _)| n).trim();
                let body = part.split_once('{').map_or("", |(_, b)| b);
                assert!(
                    body.trim_start().starts_with("pdl_enter();"),
                    "{module}.cu {name}: the body must begin with pdl_enter();"
                );
                kernels += 1;
            }
        }
        assert!(kernels > 20, "parsed only {kernels} kernels");
    }

    #[test]
    fn the_registry_lists_every_handle_once() {
        let mut listed: Vec<&str> = REGISTRY
            .iter()
            .flat_map(|(_, n)| n.iter().copied())
            .collect();
        let total = listed.len();
        listed.sort_unstable();
        listed.dedup();
        assert_eq!(listed.len(), total);
        let handles: usize = SIGNATURES.iter().map(|(_, n, _)| n.len()).sum();
        assert_eq!(total, handles);
    }

    #[test]
    fn arguments_follow_field_order() {
        let k = Random {
            variant: Elem::F32,
            out: DevPtr(7),
            n: 3,
            seed: u64::MAX,
            kind: 1,
            a: 0.5,
            b: 2.0,
        };
        assert_eq!(k.name(), "k_random_f32");
        let words = k.with_args(|args| {
            args.iter()
                .map(|a| match a {
                    Arg::Ptr(v) => format!("p{v}"),
                    Arg::I32(v) => format!("i{v}"),
                    Arg::I64(v) => format!("l{v}"),
                    Arg::F32(v) => format!("f{v}"),
                })
                .collect::<Vec<_>>()
        });
        assert_eq!(words, ["p7", "l3", "l-1", "i1", "f0.5", "f2"]);
    }
}
