//! Decode attention split over the keys (`cu/attention_split.cu`): how many heads share a
//! block and how many splits the keys of a row take, and the two launches.
//!
//! One block per (row, group of heads) leaves most of the device idle at small batches
//! (batch 1 of a 64-head model: 16 blocks on 132 SMs, each reading every key of its row);
//! splitting the keys fills it, and a combine merges the splits in a fixed order.

use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::launch::BLOCK;
use pdserve_engine::backend::BResult;

/// Keys per tile of the kernel (`ATS_TILE`: one per lane, `ATS_KPW` per warp).
const TILE: usize = 32;
/// Keys each warp scores per tile (`ATS_KPW`).
const KEYS_PER_WARP: usize = 4;
/// Most heads per block (`ATS_MAXG`).
const MAX_GROUP: usize = 16;
/// Channels per lane (`ATS_MAXQ`): head_dim at most 32 times this.
const MAX_Q: usize = 16;
/// Keys per split under `--deterministic`: a constant, so that every row's result is the
/// same function of its keys whatever the batch, bucket or prefill chunk.
pub(crate) const DETERMINISTIC_SPLIT_KEYS: usize = 4 * TILE;
/// Blocks per SM the split choice aims for (more hide the key loads' latency).
const BLOCKS_PER_SM: usize = 2;

const _: () = assert!(TILE == (BLOCK as usize / 32) * KEYS_PER_WARP);

/// How one launch divides its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitPlan {
    /// Heads per block.
    pub group: usize,
    /// Keys per split (a multiple of the tile).
    pub split_keys: usize,
    /// Splits per row (blocks along z).
    pub nsplit: usize,
    /// The single split writes the result itself (no combine launch).
    pub direct: bool,
}

impl SplitPlan {
    /// The division of `rows` rows of `n_heads` heads of `hd` channels over at most
    /// `max_keys` keys on a device of `sms` SMs. `None` where the kernel cannot take the
    /// head shape (head_dim not a multiple of 32 or above 512).
    pub(crate) fn choose(
        rows: usize,
        n_heads: usize,
        hd: usize,
        max_keys: usize,
        sms: usize,
        deterministic: bool,
    ) -> Option<SplitPlan> {
        if hd == 0 || !hd.is_multiple_of(32) || hd > 32 * MAX_Q || n_heads == 0 {
            return None;
        }
        let tiles = max_keys.div_ceil(TILE).max(1);
        let target = BLOCKS_PER_SM * sms;
        // Head groups the kernel takes: dividing the heads, 4 x 8-channel items per thread.
        let fits =
            |gr: usize| n_heads.is_multiple_of(gr) && (hd / 8) * gr.div_ceil(4) <= BLOCK as usize;
        let groups: Vec<usize> = [16, 8, 4, 2, 1]
            .into_iter()
            .filter(|&gr| gr <= MAX_GROUP && fits(gr))
            .collect();
        // The most heads per block (each key read by fewest blocks) that still fills the
        // device with every split taken; else the fewest heads (most blocks).
        let group = groups
            .iter()
            .copied()
            .find(|&gr| gr >= 4 && rows * (n_heads / gr) * tiles >= target)
            .or_else(|| groups.iter().copied().rfind(|&gr| gr >= 4))
            .or_else(|| groups.last().copied())?;
        let (split_keys, nsplit, direct) = key_splits(
            max_keys,
            TILE,
            rows * (n_heads / group),
            target,
            deterministic,
        );
        Some(SplitPlan {
            group,
            split_keys,
            nsplit,
            direct,
        })
    }

    /// Dynamic shared memory of a block (`k_attention_split`'s layout): queries, the
    /// tile's key values and scores, the running max/sum/rescale, key and scale addresses.
    pub(crate) fn shared_bytes(&self, hd: usize) -> usize {
        let gp = self.group.next_multiple_of(4);
        (self.group * hd + TILE * hd + TILE * gp + 3 * MAX_GROUP) * 4 + TILE * 16
    }
}

/// How the keys of each row divide among blocks, for both split kernels: `(keys per split
/// (a multiple of `tile`), splits, whether the single split writes the result itself)`,
/// so that `blocks` blocks per split (rows x head groups) make about `target` in all.
/// Under `--deterministic` the split is [`DETERMINISTIC_SPLIT_KEYS`] whatever the batch,
/// and the combine always runs.
pub(crate) fn key_splits(
    max_keys: usize,
    tile: usize,
    blocks: usize,
    target: usize,
    deterministic: bool,
) -> (usize, usize, bool) {
    if deterministic {
        let nsplit = max_keys.div_ceil(DETERMINISTIC_SPLIT_KEYS).max(1);
        return (DETERMINISTIC_SPLIT_KEYS, nsplit, false);
    }
    let tiles = max_keys.div_ceil(tile).max(1);
    let want = target.div_ceil(blocks.max(1)).clamp(1, tiles);
    let split_keys = tiles.div_ceil(want) * tile;
    let nsplit = max_keys.div_ceil(split_keys).max(1);
    (split_keys, nsplit, nsplit == 1)
}

/// The buffers and scalars both attention kernels read.
#[derive(Clone, Copy)]
pub(crate) struct AttentionArgs {
    pub pages: DevPtr,
    pub states: DevPtr,
    pub page_bytes: i64,
    pub state_bytes: i64,
    pub seq: DevPtr,
    pub pt: DevPtr,
    pub row_seq: DevPtr,
    pub positions: DevPtr,
    pub q: DevPtr,
    /// This forward's keys, fp32 rows of `hd`.
    pub kv_new: DevPtr,
    /// The same keys already as entries of `dt` (bf16 rows converted once, see
    /// `ops/attention_dequant.rs`), read instead of converting `kv_new`.
    pub new_stored: Option<DevPtr>,
    /// Bytes of one KV entry's row and of its fp8 scales (0 unless fp8): `KvLayout`'s.
    pub entry_bytes: usize,
    pub scale_bytes: usize,
    pub sinks: DevPtr,
    pub sel: DevPtr,
    pub topk: i32,
    pub out: DevPtr,
    pub rows: usize,
    pub n_heads: usize,
    pub hd: usize,
    pub window: i32,
    pub win_off: i64,
    pub rate: i32,
    pub mode: i32,
    pub comp_off: i64,
    pub comp_epp: i32,
    pub page_tokens: i32,
    pub dt: i32,
    pub scale: f32,
    pub rd: i32,
    pub win_scale_off: i64,
    pub comp_scale_off: i64,
}

/// Launch the split kernel (and the combine, unless the plan writes directly).
pub(crate) fn launch(g: &Gpu, a: &AttentionArgs, plan: SplitPlan) -> BResult<()> {
    let (rows, n_heads, hd) = (a.rows, a.n_heads, a.hd);
    // Partials only where a combine reads them (a one-element placeholder otherwise).
    let parts = if plan.direct {
        0
    } else {
        rows * n_heads * plan.nsplit
    };
    let part: DevMem<f32> = g.uninit(parts * hd)?;
    let part_ml: DevMem<f32> = g.uninit(parts * 2)?;
    let new = new_keys(g, a)?;
    g.launch(
        (
            rows as u32,
            (n_heads / plan.group) as u32,
            plan.nsplit as u32,
        ),
        plan.shared_bytes(hd) as u32,
        &kernels::AttentionSplit {
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
            out: a.out,
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
            g: plan.group as i32,
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
    combine(g, a, &part, &part_ml, plan.nsplit)
}

/// This forward's keys as the kernels read them (entries of `dt` and their fp8 scales).
pub(crate) struct NewKeys {
    pub rows: DevPtr,
    pub scales: DevPtr,
    /// The buffers made for them, kept until the launch is queued.
    _made: Option<(DevMem<u8>, DevMem<u8>)>,
}

/// `a.new_stored` where set, else this forward's keys made entries here ([`new_entries`]).
pub(crate) fn new_keys(g: &Gpu, a: &AttentionArgs) -> BResult<NewKeys> {
    if let Some(rows) = a.new_stored {
        return Ok(NewKeys {
            rows,
            scales: DevPtr::NULL,
            _made: None,
        });
    }
    let made = new_entries(g, a)?;
    let (rows, scales) = made.as_ref().map_or((a.kv_new, DevPtr::NULL), |(r, s)| {
        (DevPtr::of(r), DevPtr::of(s))
    });
    Ok(NewKeys {
        rows,
        scales,
        _made: made,
    })
}

/// This forward's keys as entries of the KV dtype, rows then fp8 scales (what both
/// kernels read back for keys not yet stored); `None` for fp32 entries (the rows
/// themselves).
pub(crate) fn new_entries(g: &Gpu, a: &AttentionArgs) -> BResult<Option<(DevMem<u8>, DevMem<u8>)>> {
    if a.dt == 0 {
        return Ok(None);
    }
    let new_rows = g.uninit(a.rows * a.entry_bytes)?;
    let new_scales = g.uninit(a.rows * a.scale_bytes)?;
    g.launch(
        (a.rows as u32, 1, 1),
        0,
        &kernels::KvEntries {
            x: a.kv_new,
            rows: DevPtr::of(&new_rows),
            scales: DevPtr::of(&new_scales),
            hd: a.hd as i32,
            rd: a.rd,
            dt: a.dt,
        },
    )?;
    Ok(Some((new_rows, new_scales)))
}

/// `k_attention_combine`: the splits' partials of each (row, head) merged in split order.
pub(crate) fn combine(
    g: &Gpu,
    a: &AttentionArgs,
    part: &DevMem<f32>,
    part_ml: &DevMem<f32>,
    nsplit: usize,
) -> BResult<()> {
    g.launch(
        (a.rows as u32, a.n_heads as u32, 1),
        0,
        &kernels::AttentionCombine {
            part: DevPtr::of(part),
            part_ml: DevPtr::of(part_ml),
            sinks: a.sinks,
            out: a.out,
            n_heads: a.n_heads as i32,
            hd: a.hd as i32,
            nsplit: nsplit as i32,
        },
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// V4-Flash: 64 heads of 512 channels; a CSA layer's 128 window keys + 512 picks.
    const FLASH: (usize, usize, usize) = (64, 512, 640);

    #[test]
    fn batch_one_fills_the_device_and_a_full_batch_takes_one_split() {
        let (h, hd, keys) = FLASH;
        let one = SplitPlan::choose(1, h, hd, keys, 132, false).unwrap();
        let blocks = (h / one.group) * one.nsplit;
        assert!(blocks >= 132, "{one:?}: {blocks} blocks");
        assert!(one.nsplit > 1 && !one.direct);
        assert!(one.split_keys * one.nsplit >= keys);
        assert!(
            one.split_keys * (one.nsplit - 1) < keys,
            "no split is empty: {one:?}"
        );
        let full = SplitPlan::choose(128, h, hd, keys, 132, false).unwrap();
        assert_eq!(
            full,
            SplitPlan {
                group: 16,
                split_keys: keys,
                nsplit: 1,
                direct: true
            }
        );
    }

    #[test]
    fn deterministic_split_size_ignores_the_batch() {
        let (h, hd, keys) = FLASH;
        for rows in [1, 3, 8, 64, 128, 4096] {
            let p = SplitPlan::choose(rows, h, hd, keys, 132, true).unwrap();
            assert_eq!(p.split_keys, DETERMINISTIC_SPLIT_KEYS, "rows {rows}");
            assert_eq!(p.nsplit, keys.div_ceil(DETERMINISTIC_SPLIT_KEYS));
            assert!(!p.direct, "rows {rows}: the combine always runs");
        }
    }

    #[test]
    fn groups_divide_the_heads_and_fit_the_block() {
        for (h, hd) in [(64, 512), (8, 64), (6, 64), (3, 32), (16, 256), (1, 512)] {
            for rows in [1, 2, 64, 1000] {
                let p = SplitPlan::choose(rows, h, hd, 200, 132, false).unwrap();
                assert_eq!(h % p.group, 0, "{h} heads, {p:?}");
                assert!((hd / 8) * p.group.div_ceil(4) <= BLOCK as usize, "{p:?}");
                assert!(
                    p.shared_bytes(hd) <= crate::device::ATTENTION_SHARED,
                    "{p:?}"
                );
                assert_eq!(p.split_keys % TILE, 0);
            }
        }
        assert!(SplitPlan::choose(1, 64, 48, 10, 132, false).is_none());
        assert!(SplitPlan::choose(1, 64, 1024, 10, 132, false).is_none());
    }
}
