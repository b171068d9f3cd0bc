//! fp8 keys converted to bf16 once per batch (`k_kv_dequant_bf16` in `cu/attention_mma.cu`)
//! for the tensor-core attention kernels, which then read bf16 entries.
//!
//! Those kernels convert every fp8 key of every tile they load: in a prefill each key is
//! loaded by up to `window` rows (and a compressed entry by every later row that picks it),
//! so an 8K prompt converts each key hundreds of times, and the conversion, not the
//! products, bounds the kernel. Converting each key once, with the same arithmetic
//! (`atm_fp8_pair`), gives the same bf16 values, so the logits keep their bits.
//!
//! The converted keys take the layout the kernels already read, over one buffer: the
//! window rings, one per sequence of the batch (the sequence table's state slot becomes the
//! sequence's index); the compressed entries of every page of the batch's page tables
//! (concatenated, so the page table becomes 0, 1, 2, ...); then this forward's keys. Inside
//! decode steps (captured graphs) nothing is converted: one key is read by one row there.

use crate::buf::shape_err;
use crate::device::{Gpu, KeyConversion};
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::kv_store::{seq_table, DT_BF16, DT_FP8_KV, SEQ_INTS, SEQ_STATE};
use crate::launch::BLOCK;
use crate::ops::attention_split::{new_entries, AttentionArgs};
use crate::ops::stored::to_i32;
use pdserve_engine::backend::{BResult, BatchPlan};

/// Reads per converted key that repay converting it once (a write and a read of a bf16
/// row, against the conversion arithmetic of every read in the kernel). Prefills are far
/// above it (an 8K prompt: ~500), decode batches far below (at most one read per key).
const MIN_READS_PER_KEY: usize = 4;

/// The keys one batch's rows can read, in the converted buffer's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeySpans {
    /// Window ring slots: `window` per sequence.
    pub ring: usize,
    /// Compressed entries: `comp_epp` per page of every sequence (none in a layer
    /// without them).
    pub comp: usize,
    /// This forward's keys: one per row.
    pub new: usize,
}

impl KeySpans {
    pub(crate) fn of(a: &AttentionArgs, plan: &BatchPlan) -> KeySpans {
        let pages: usize = plan.seqs.iter().map(|s| s.pages.len()).sum();
        KeySpans {
            ring: plan.seqs.len() * a.window.max(0) as usize,
            comp: if a.mode == 0 {
                0
            } else {
                pages * a.comp_epp.max(1) as usize
            },
            new: a.rows,
        }
    }

    pub(crate) fn total(self) -> usize {
        self.ring + self.comp + self.new
    }
}

/// Whether `rows` rows reading at most `max_keys` keys each convert the `spans` keys once
/// under `conversion` (the keys being fp8 and the batch not a decode step).
pub(crate) fn converts_once(
    conversion: KeyConversion,
    rows: usize,
    max_keys: usize,
    spans: KeySpans,
) -> bool {
    match conversion {
        KeyConversion::PerTile => false,
        KeyConversion::Once => true,
        KeyConversion::Auto => rows * max_keys >= MIN_READS_PER_KEY * spans.total(),
    }
}

/// Arguments reading bf16 keys converted once, and the buffers they point into (kept
/// until the attention launch is queued).
pub(crate) struct Converted {
    pub args: AttentionArgs,
    _keys: DevMem<u8>,
    _seq: DevMem<i32>,
    _pt: DevMem<u32>,
}

/// `a` over bf16 copies of its fp8 keys when the backend's [`KeyConversion`] and the
/// batch's reuse call for it (see the module doc), else `None`.
pub(crate) fn convert_if_reused(
    g: &Gpu,
    a: &AttentionArgs,
    plan: &BatchPlan,
    max_keys: usize,
) -> BResult<Option<Converted>> {
    let spans = KeySpans::of(a, plan);
    if a.dt != DT_FP8_KV || g.in_step() || !converts_once(g.key_conversion, a.rows, max_keys, spans)
    {
        return Ok(None);
    }
    convert(g, a, plan, spans).map(Some)
}

fn convert(g: &Gpu, a: &AttentionArgs, plan: &BatchPlan, spans: KeySpans) -> BResult<Converted> {
    let row = a.hd * 2;
    let keys = g.uninit::<u8>(spans.total() * row)?;
    let (new_rows, new_scales) = new_entries(g, a)?.ok_or_else(|| {
        shape_err(
            "attention key conversion",
            "fp8 keys without entries".to_string(),
        )
    })?;
    let (mut seq, pt) = seq_table(plan)?;
    let warps = (BLOCK / 32) as usize;
    g.launch(
        (spans.total().div_ceil(warps) as u32, 1, 1),
        0,
        &kernels::KvDequantBf16 {
            pages: a.pages,
            states: a.states,
            page_bytes: a.page_bytes,
            state_bytes: a.state_bytes,
            seq: a.seq,
            pt: a.pt,
            new_rows: DevPtr::of(&new_rows),
            new_scales: DevPtr::of(&new_scales),
            out: DevPtr::of(&keys),
            n_ring: to_i32(spans.ring, "window slots")?,
            n_comp: to_i32(spans.comp, "compressed entries")?,
            n_new: to_i32(spans.new, "rows")?,
            window: a.window,
            win_off: a.win_off,
            win_scale_off: a.win_scale_off,
            comp_off: a.comp_off,
            comp_scale_off: a.comp_scale_off,
            comp_epp: a.comp_epp,
            hd: a.hd as i32,
            rd: a.rd,
        },
    )?;
    // Sequence s's ring is the s-th of the buffer; page j of the concatenated tables the
    // j-th block of entries.
    for (s, entry) in seq.chunks_mut(SEQ_INTS).enumerate() {
        entry[SEQ_STATE] = to_i32(s, "sequence")?;
    }
    let identity: Vec<u32> = (0..pt.len().max(1) as u32).collect();
    let (seq, pt) = (g.upload(&seq)?, g.upload(&identity)?);
    let base = DevPtr::of(&keys);
    let args = AttentionArgs {
        states: base,
        state_bytes: (a.window.max(0) as usize * row) as i64,
        win_off: 0,
        win_scale_off: 0,
        pages: base.offset(spans.ring * row),
        page_bytes: (a.comp_epp.max(1) as usize * row) as i64,
        comp_off: 0,
        comp_scale_off: 0,
        seq: DevPtr::of(&seq),
        pt: DevPtr::of(&pt),
        new_stored: Some(base.offset((spans.ring + spans.comp) * row)),
        entry_bytes: row,
        scale_bytes: 0,
        dt: DT_BF16,
        ..*a
    };
    Ok(Converted {
        args,
        _keys: keys,
        _seq: seq,
        _pt: pt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// V4-Flash's compressed-sparse layer: 128 window keys and 512 picks per row; pages of
    /// 256 tokens hold 64 entries at rate 4.
    fn spans(seqs: usize, rows: usize, tokens_per_seq: usize) -> KeySpans {
        KeySpans {
            ring: seqs * 128,
            comp: seqs * tokens_per_seq.div_ceil(256) * 64,
            new: rows,
        }
    }

    #[test]
    fn a_prefill_converts_once_and_a_decode_batch_does_not() {
        let auto = KeyConversion::Auto;
        // An 8K prompt: every row reads 640 keys, ~10K distinct.
        assert!(converts_once(auto, 8192, 640, spans(1, 8192, 8192)));
        // A 128K prompt's last 8K chunk: 40K distinct keys, still ~130 reads each.
        assert!(converts_once(auto, 8192, 640, spans(1, 8192, 131072)));
        // Decode: one row per sequence, each reading its own keys.
        for batch in [1, 8, 64, 256] {
            assert!(!converts_once(auto, batch, 640, spans(batch, batch, 4096)));
        }
        // A short prompt whose rows read few keys each.
        assert!(!converts_once(auto, 4, 4, spans(1, 4, 4)));
        assert!(converts_once(
            KeyConversion::Once,
            1,
            640,
            spans(1, 1, 4096)
        ));
        assert!(!converts_once(
            KeyConversion::PerTile,
            8192,
            640,
            spans(1, 8192, 8192)
        ));
    }
}
