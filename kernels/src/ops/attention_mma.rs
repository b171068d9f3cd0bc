//! Attention on tensor cores (`cu/attention_mma.cu`): which launches it takes, how the
//! keys of a row split across blocks, and the launch.
//!
//! Every head of a row shares one block (the split kernel groups at most 16), so each key
//! is read once per row and its products run as bf16 `mma.sync` with fp32 accumulators.
//! It takes bf16 and fp8 entries only: their values are exact in bf16, while fp32 entries
//! stay on the fp32 split kernel. The queries and probabilities are rounded to bf16 for the
//! products under bf16 weights. The fp32 reference mode keeps the split kernel: hi + lo
//! bf16 halves (the `_exact` variant, gpu-check's A/B) carry ~16 bits, and an fp8 or bf16
//! entry stored from a value that far off can round to the neighbouring code.

use crate::device::{Gpu, MMA_SHARED};
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr, Products};
use crate::launch::{dev_err, BLOCK};
use crate::ops::attention_split::{self, key_splits, AttentionArgs, DETERMINISTIC_SPLIT_KEYS};
use crate::rope_cache::RopeTable;
use pdserve_engine::backend::BResult;

/// Heads per block (`ATM_H`).
const HEADS: usize = 64;
/// Keys per tile (`ATM_T`).
const TILE: usize = 32;
/// bf16 padding of every shared row (`ATM_PAD`).
const PAD: usize = 8;
/// Largest head_dim: each warp owns half of it, in at most `ATM_MAXNT` (32) tiles of 8.
const MAX_HEAD_DIM: usize = 512;
/// Partial scores the warps swap with their pairs (`sx`): 8 warps x 16 heads x `TILE` keys.
const PARTIAL_SCORES: usize = 8 * 16 * TILE;
/// KV entry dtype codes (`kv_dt_code`): bf16, and fp8 in FlashMLA's V4 layout.
const DT_BF16: i32 = 1;
const DT_FP8: i32 = 3;

// `ATM_THREADS`: the launch's block, 8 warps.
const _: () = assert!(BLOCK == 256);
const _: () = assert!(DETERMINISTIC_SPLIT_KEYS.is_multiple_of(TILE));

/// How one launch divides the keys of each row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MmaPlan {
    /// Keys per split (a multiple of the tile).
    pub split_keys: usize,
    /// Splits per row (blocks along z).
    pub nsplit: usize,
    /// The single split writes the result itself (no combine launch).
    pub direct: bool,
}

impl MmaPlan {
    /// The division of `rows` rows of `n_heads` heads over at most `max_keys` keys on a
    /// device of `sms` SMs (one block per SM fits: the block takes ~147 KiB of shared
    /// memory at head_dim 512). Under `--deterministic` the split is a constant, so that
    /// a row's result is the same function of its keys whatever the batch.
    pub(crate) fn choose(
        rows: usize,
        n_heads: usize,
        max_keys: usize,
        sms: usize,
        deterministic: bool,
    ) -> MmaPlan {
        let blocks = rows * n_heads.div_ceil(HEADS);
        let (split_keys, nsplit, direct) = key_splits(max_keys, TILE, blocks, sms, deterministic);
        MmaPlan {
            split_keys,
            nsplit,
            direct,
        }
    }

    /// Dynamic shared memory of a block (`k_attention_mma`'s layout): key and scale
    /// addresses of two tiles, the warps' partial scores, queries and two key tiles;
    /// `exact`: the lo halves of the queries too.
    pub(crate) fn shared_bytes(hd: usize, exact: bool) -> usize {
        let halves = if exact { 2 } else { 1 };
        4 * TILE * 8 + PARTIAL_SCORES * 4 + (halves * HEADS + 2 * TILE) * (hd + PAD) * 2
    }
}

/// Whether the tensor-core kernel takes these arguments: bf16 or fp8 entries, head_dim a
/// multiple of 64 up to 512, and every key row 16-byte aligned (its copies are 16 bytes).
pub(crate) fn takes(a: &AttentionArgs, exact: bool) -> bool {
    let aligned = |v: i64| v % 16 == 0;
    let dt_ok = match a.dt {
        DT_BF16 => true,
        DT_FP8 => (a.hd - a.rd as usize).is_multiple_of(16),
        _ => false,
    };
    dt_ok
        && a.hd.is_multiple_of(64)
        && a.hd <= MAX_HEAD_DIM
        && a.entry_bytes.is_multiple_of(16)
        && aligned(a.page_bytes)
        && aligned(a.state_bytes)
        && aligned(a.win_off)
        && aligned(a.comp_off)
        && MmaPlan::shared_bytes(a.hd, exact) <= MMA_SHARED
}

/// A direct launch's bf16 queries and output instead of `AttentionArgs::q` and `out`: the
/// queries normed, roped and rounded already (`k_query_heads_bf16`), the output the
/// o-projection's bf16 input, its rope channels rotated back by the same tables.
pub(crate) struct Bf16Io<'a> {
    pub table: &'a RopeTable,
    pub q: &'a DevMem<u16>,
    pub out: &'a DevMem<u16>,
}

/// Launch the tensor-core kernel (and the combine, unless the plan writes directly), its
/// products exact (hi + lo halves) or in bf16; `bf16_io` (a direct plan, bf16 products)
/// reads and writes bf16 instead of fp32.
pub(crate) fn launch(
    g: &Gpu,
    a: &AttentionArgs,
    plan: MmaPlan,
    exact: bool,
    bf16_io: Option<Bf16Io<'_>>,
) -> BResult<()> {
    if bf16_io.is_some() && (exact || !plan.direct) {
        return Err(dev_err(
            "bf16 attention queries and output need a direct plan and bf16 products",
        ));
    }
    let (q_bf16, un_cs, un_sn, out_bf16) = bf16_io.as_ref().map_or(
        (DevPtr::NULL, DevPtr::NULL, DevPtr::NULL, DevPtr::NULL),
        |io| {
            (
                DevPtr::of(io.q),
                DevPtr::of(&io.table.cs),
                DevPtr::of(&io.table.sn),
                DevPtr::of(io.out),
            )
        },
    );
    let (rows, n_heads, hd) = (a.rows, a.n_heads, a.hd);
    let parts = if plan.direct {
        0
    } else {
        rows * n_heads * plan.nsplit
    };
    let part: DevMem<f32> = g.uninit(parts * hd)?;
    let part_ml: DevMem<f32> = g.uninit(parts * 2)?;
    let entries = attention_split::new_entries(g, a)?;
    let (new_rows, new_scales) = entries.as_ref().map_or((a.kv_new, DevPtr::NULL), |(r, s)| {
        (DevPtr::of(r), DevPtr::of(s))
    });
    g.launch(
        (
            rows as u32,
            n_heads.div_ceil(HEADS) as u32,
            plan.nsplit as u32,
        ),
        MmaPlan::shared_bytes(hd, exact) as u32,
        &kernels::AttentionMma {
            variant: if exact {
                Products::HiLo
            } else {
                Products::Bf16
            },
            pages: a.pages,
            states: a.states,
            page_bytes: a.page_bytes,
            state_bytes: a.state_bytes,
            seq: a.seq,
            pt: a.pt,
            row_seq: a.row_seq,
            positions: a.positions,
            q: a.q,
            new_rows,
            new_scales,
            sinks: a.sinks,
            sel: a.sel,
            topk: a.topk,
            q_bf16,
            out: a.out,
            un_cs,
            un_sn,
            out_bf16,
            part: DevPtr::of(&part),
            part_ml: DevPtr::of(&part_ml),
            n_heads: n_heads as i32,
            hd: hd as i32,
            window: a.window,
            win_off: a.win_off,
            rate: a.rate,
            mode: a.mode,
            comp_off: a.comp_off,
            comp_epp: a.comp_epp,
            page_tokens: a.page_tokens,
            dt: a.dt,
            scale: a.scale,
            rd: a.rd,
            win_scale_off: a.win_scale_off,
            comp_scale_off: a.comp_scale_off,
            split_keys: plan.split_keys as i32,
            nsplit: plan.nsplit as i32,
            direct: i32::from(plan.direct),
        },
    )?;
    if plan.direct {
        return Ok(());
    }
    attention_split::combine(g, a, &part, &part_ml, plan.nsplit)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_block_fits_the_shared_memory_at_head_dim_512() {
        for exact in [false, true] {
            let bytes = MmaPlan::shared_bytes(512, exact);
            assert!(bytes <= MMA_SHARED, "{bytes}");
            // Two blocks would not fit an SM (228 KiB): the plan aims at one per SM.
            assert!(2 * bytes > 228 * 1024);
        }
        assert!(MmaPlan::shared_bytes(512, true) > MmaPlan::shared_bytes(512, false));
    }

    #[test]
    fn batch_one_splits_the_keys_and_a_prefill_takes_one_split() {
        let one = MmaPlan::choose(1, 64, 640, 132, false);
        assert!(one.nsplit > 1 && !one.direct, "{one:?}");
        assert!(one.split_keys * one.nsplit >= 640);
        assert!(
            one.split_keys * (one.nsplit - 1) < 640,
            "no empty split: {one:?}"
        );
        assert_eq!(one.split_keys % TILE, 0);
        let full = MmaPlan::choose(8192, 64, 640, 132, false);
        assert_eq!(
            full,
            MmaPlan {
                split_keys: 640,
                nsplit: 1,
                direct: true
            }
        );
        // More heads than one block holds: the head groups count towards filling the device.
        let wide = MmaPlan::choose(33, 128, 640, 132, false);
        assert_eq!(wide.nsplit, 2, "{wide:?}");
    }

    #[test]
    fn deterministic_split_ignores_the_batch() {
        for rows in [1, 7, 64, 4096] {
            let p = MmaPlan::choose(rows, 64, 640, 132, true);
            assert_eq!(p.split_keys, DETERMINISTIC_SPLIT_KEYS);
            assert_eq!(p.nsplit, 640usize.div_ceil(DETERMINISTIC_SPLIT_KEYS));
            assert!(!p.direct);
        }
    }
}
