//! Attention on tensor cores (`cu/attention_mma.cu`, `cu/attention_wgmma.cu`): which
//! kernel and launches it takes, how the keys of a row split across blocks, and the launch.
//!
//! Every head of a row shares one block (the split kernel groups at most 16), so each key
//! is read once per row and its products run on tensor cores with fp32 accumulators: on
//! Hopper's warpgroup `wgmma` at head_dim 512 (the V4 models'), elsewhere on `mma.sync`.
//! It takes bf16 and fp8 entries only: their values are exact in bf16, while fp32 entries
//! stay on the fp32 split kernel. The queries and probabilities are rounded to bf16 for the
//! products under bf16 weights. The fp32 reference mode keeps the split kernel: hi + lo
//! bf16 halves (the `_exact` variant, gpu-check's A/B) carry ~16 bits, and an fp8 or bf16
//! entry stored from a value that far off can round to the neighbouring code.

use crate::device::{AttentionKernel, Gpu, MMA_SHARED};
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr, Products};
use crate::kv_store::{DT_BF16, DT_FP8_KV};
use crate::launch::{dev_err, BLOCK};
use crate::ops::attention_split::{self, key_splits, AttentionArgs, DETERMINISTIC_SPLIT_KEYS};
use crate::rope_cache::RopeTable;
use pdserve_engine::backend::BResult;

/// Heads per block (`ATM_H`; the wgmma kernel's M).
const HEADS: usize = 64;
/// bf16 padding of every shared row of the mma.sync kernel (`ATM_PAD`).
const PAD: usize = 8;
/// Largest head_dim of the mma.sync kernel: each warp owns half of it, in at most
/// `ATM_MAXNT` (32) tiles of 8.
const MAX_HEAD_DIM: usize = 512;
/// The wgmma kernel's head_dim (`ATW_HD`).
const WGMMA_HEAD_DIM: usize = 512;

// `ATM_THREADS`: the launch's block, 8 warps (two warpgroups for wgmma).
const _: () = assert!(BLOCK == 256);

/// The tensor-core attention kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MmaKernel {
    /// `k_attention_mma`: warps of 16 heads on `mma.sync`, bf16 products.
    MmaSync,
    /// `k_attention_mma_exact`: the same, each query and probability as hi + lo bf16
    /// halves (gpu-check's A/B under fp32 weights).
    MmaSyncExact,
    /// `k_attention_wgmma`: two warpgroups of all 64 heads on `wgmma` (sm_90a, head_dim
    /// 512), bf16 products.
    Wgmma,
}

impl MmaKernel {
    /// Keys per tile (`ATM_T`, `ATW_T`).
    fn tile(self) -> usize {
        match self {
            MmaKernel::Wgmma => 64,
            _ => 32,
        }
    }

    fn products(self) -> Products {
        match self {
            MmaKernel::MmaSync => Products::Bf16,
            MmaKernel::MmaSyncExact => Products::HiLo,
            MmaKernel::Wgmma => Products::Bf16Wgmma,
        }
    }

    /// Dynamic shared memory of a block. mma.sync (`k_attention_mma`'s layout): key and
    /// scale addresses of two tiles, the warps' partial scores (8 warps x 16 heads x a
    /// tile), queries and two key tiles, each row padded; exact: the lo halves of the
    /// queries too. wgmma (`k_attention_wgmma`'s): queries and two key tiles of 64 rows
    /// unpadded (swizzled), the partial scores (256 threads x 32), two tiles' key and scale
    /// addresses, and 1 KiB to align the base to the swizzle's 1024 bytes.
    pub(crate) fn shared_bytes(self, hd: usize) -> usize {
        let tile = self.tile();
        match self {
            MmaKernel::Wgmma => 3 * HEADS * hd * 2 + BLOCK as usize * 32 * 4 + 4 * tile * 8 + 1024,
            MmaKernel::MmaSync | MmaKernel::MmaSyncExact => {
                let halves = if self == MmaKernel::MmaSyncExact {
                    2
                } else {
                    1
                };
                4 * tile * 8 + 8 * 16 * tile * 4 + (halves * HEADS + 2 * tile) * (hd + PAD) * 2
            }
        }
    }

    /// Whether this kernel takes these arguments: bf16 or fp8 entries, every key row
    /// 16-byte aligned (its copies are 16 bytes); mma.sync: head_dim a multiple of 64 up
    /// to 512; wgmma: head_dim 512, whole blocks of 64 heads, a Hopper device.
    fn takes(self, g: &Gpu, a: &AttentionArgs) -> bool {
        let aligned = |v: i64| v % 16 == 0;
        let dt_ok = match a.dt {
            DT_BF16 => true,
            DT_FP8_KV => (a.hd - a.rd as usize).is_multiple_of(16),
            _ => false,
        };
        let shape_ok = match self {
            MmaKernel::Wgmma => {
                g.wgmma() && a.hd == WGMMA_HEAD_DIM && a.n_heads.is_multiple_of(HEADS)
            }
            _ => a.hd.is_multiple_of(64) && a.hd <= MAX_HEAD_DIM,
        };
        dt_ok
            && shape_ok
            && a.entry_bytes.is_multiple_of(16)
            && aligned(a.page_bytes)
            && aligned(a.state_bytes)
            && aligned(a.win_off)
            && aligned(a.comp_off)
            && self.shared_bytes(a.hd) <= MMA_SHARED
    }
}

// Under --deterministic every kernel splits at the same key counts.
const _: () = assert!(DETERMINISTIC_SPLIT_KEYS.is_multiple_of(64));

/// The tensor-core kernel for these arguments under the backend's settings, if any takes
/// them: under bf16 weights wgmma where it takes them, else mma.sync (only mma.sync under
/// [`AttentionKernel::MmaSync`]); under fp32 weights none, or the hi + lo mma.sync kernel
/// under [`AttentionKernel::TensorCores`] or [`AttentionKernel::MmaSync`].
pub(crate) fn choose_kernel(g: &Gpu, a: &AttentionArgs) -> Option<MmaKernel> {
    let wanted: &[MmaKernel] = match (g.attention_kernel, g.fp32_reference) {
        (AttentionKernel::Split | AttentionKernel::Reference, _) => &[],
        (AttentionKernel::Auto, true) => &[],
        (AttentionKernel::TensorCores | AttentionKernel::MmaSync, true) => {
            &[MmaKernel::MmaSyncExact]
        }
        (AttentionKernel::MmaSync, false) => &[MmaKernel::MmaSync],
        (AttentionKernel::Auto | AttentionKernel::TensorCores, false) => {
            &[MmaKernel::Wgmma, MmaKernel::MmaSync]
        }
    };
    wanted.iter().copied().find(|k| k.takes(g, a))
}

/// How one launch divides the keys of each row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MmaPlan {
    /// The kernel.
    pub kernel: MmaKernel,
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
    /// memory at head_dim 512 on mma.sync, ~226 KiB on wgmma). Under `--deterministic` the
    /// split is a constant, so that a row's result is the same function of its keys
    /// whatever the batch.
    pub(crate) fn choose(
        kernel: MmaKernel,
        rows: usize,
        n_heads: usize,
        max_keys: usize,
        sms: usize,
        deterministic: bool,
    ) -> MmaPlan {
        let blocks = rows * n_heads.div_ceil(HEADS);
        let (split_keys, nsplit, direct) =
            key_splits(max_keys, kernel.tile(), blocks, sms, deterministic);
        MmaPlan {
            kernel,
            split_keys,
            nsplit,
            direct,
        }
    }
}

/// A direct launch's bf16 queries and output instead of `AttentionArgs::q` and `out`: the
/// queries normed, roped and rounded already (`k_query_heads_bf16`), the output the
/// o-projection's bf16 input, its rope channels rotated back by the same tables.
pub(crate) struct Bf16Io<'a> {
    pub table: &'a RopeTable,
    pub q: &'a DevMem<u16>,
    pub out: &'a DevMem<u16>,
}

/// Launch the plan's tensor-core kernel (and the combine, unless the plan writes
/// directly); `bf16_io` (a direct plan, bf16 products) reads and writes bf16 instead of
/// fp32.
pub(crate) fn launch(
    g: &Gpu,
    a: &AttentionArgs,
    plan: MmaPlan,
    bf16_io: Option<Bf16Io<'_>>,
) -> BResult<()> {
    if bf16_io.is_some() && (plan.kernel == MmaKernel::MmaSyncExact || !plan.direct) {
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
    let new = attention_split::new_keys(g, a)?;
    g.launch(
        (
            rows as u32,
            n_heads.div_ceil(HEADS) as u32,
            plan.nsplit as u32,
        ),
        plan.kernel.shared_bytes(hd) as u32,
        &kernels::AttentionMma {
            variant: plan.kernel.products(),
            pages: a.pages,
            states: a.states,
            page_bytes: a.page_bytes,
            state_bytes: a.state_bytes,
            seq: a.seq,
            pt: a.pt,
            row_seq: a.row_seq,
            positions: a.positions,
            q: a.q,
            new_rows: new.rows,
            new_scales: new.scales,
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
        for kernel in [
            MmaKernel::MmaSync,
            MmaKernel::MmaSyncExact,
            MmaKernel::Wgmma,
        ] {
            let bytes = kernel.shared_bytes(512);
            assert!(bytes <= MMA_SHARED, "{kernel:?}: {bytes}");
            // Two blocks would not fit an SM (228 KiB): the plan aims at one per SM.
            assert!(2 * bytes > 228 * 1024, "{kernel:?}");
        }
        assert!(MmaKernel::MmaSyncExact.shared_bytes(512) > MmaKernel::MmaSync.shared_bytes(512));
        // attention_wgmma.cu's layout: queries, two key tiles, partial scores, addresses.
        assert_eq!(
            MmaKernel::Wgmma.shared_bytes(512),
            3 * 65536 + 8 * 256 * 16 + 4 * 64 * 8 + 1024
        );
    }

    #[test]
    fn batch_one_splits_the_keys_and_a_prefill_takes_one_split() {
        for kernel in [MmaKernel::MmaSync, MmaKernel::Wgmma] {
            let tile = kernel.tile();
            let one = MmaPlan::choose(kernel, 1, 64, 640, 132, false);
            assert!(one.nsplit > 1 && !one.direct, "{one:?}");
            assert!(one.split_keys * one.nsplit >= 640);
            assert!(
                one.split_keys * (one.nsplit - 1) < 640,
                "no empty split: {one:?}"
            );
            assert_eq!(one.split_keys % tile, 0);
            let full = MmaPlan::choose(kernel, 8192, 64, 640, 132, false);
            assert_eq!(
                full,
                MmaPlan {
                    kernel,
                    split_keys: 640,
                    nsplit: 1,
                    direct: true
                }
            );
            // More heads than one block holds: the head groups count towards filling the
            // device.
            let wide = MmaPlan::choose(kernel, 33, 128, 640, 132, false);
            assert_eq!(wide.nsplit, 2, "{wide:?}");
        }
    }

    #[test]
    fn deterministic_split_ignores_the_batch_and_the_kernel() {
        for kernel in [MmaKernel::MmaSync, MmaKernel::Wgmma] {
            for rows in [1, 7, 64, 4096] {
                let p = MmaPlan::choose(kernel, rows, 64, 640, 132, true);
                assert_eq!(p.split_keys, DETERMINISTIC_SPLIT_KEYS);
                assert_eq!(p.nsplit, 640usize.div_ceil(DETERMINISTIC_SPLIT_KEYS));
                assert!(!p.direct);
            }
        }
    }
}
