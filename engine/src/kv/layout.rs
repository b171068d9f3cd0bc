//! The one description of a request's KV state. Every buffer size (pages, state
//! slots, host copies, transfers) is computed from a [`KvLayout`] and nothing else.
//!
//! A request's KV state has two parts:
//! - **token pages**: one page covers `page_tokens` consecutive positions across ALL
//!   layers: for each CSA/HCA layer its compressed-KV entries (one per `rate`
//!   tokens) and for each CSA layer its index-K entries. A request holds a page
//!   table (list of page ids) that grows with its length.
//! - **a state slot**: fixed-size per-request state: for every layer its sliding-window
//!   ring (`sliding_window` K=V entries, slot = position % window), for CSA/HCA layers
//!   the compressor ring (raw projected kv + gate rows, fp32) of the tokens not yet
//!   pooled (and, for CSA, the previous window whose "Ca" half overlaps), and for CSA
//!   layers the indexer's compressor ring.

use super::fp8_kv::Fp8KvFormat;
use crate::config::{LayerKind, ModelConfig};
use crate::numerics::Numerics;
use sha2::{Digest, Sha256};

/// Index of a token page in a pool (pages are laid out by [`KvLayout::page_bytes`]).
pub type PageId = u32;
/// Index of a per-request state slot in a pool ([`KvLayout::state_bytes`] each).
pub type StateSlot = u32;

/// Storage type of a KV entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum EntryDtype {
    F32,
    Bf16,
    /// fp8 e4m3 values with scales, laid out per region. Index-K: one fp32 scale per
    /// entry ([`EntryDtype::entry_bytes`]). Compressed KV and sliding window: FlashMLA's
    /// DeepSeek-V4 layout, e4m3 non-rope values with one ue8m0 scale per 64, bf16 rope
    /// values ([`Fp8KvFormat`], [`KvLayout::kv_entry_bytes`]). Either way all entries of a
    /// region come first, then all their scales.
    Fp8E4m3,
}

impl EntryDtype {
    /// Every dtype, for tests and tables.
    pub const ALL: [EntryDtype; 3] = [EntryDtype::F32, EntryDtype::Bf16, EntryDtype::Fp8E4m3];

    /// Bytes of one value (fp8: the key byte; its entry also has a scale, see
    /// [`EntryDtype::entry_bytes`]).
    pub fn bytes(self) -> usize {
        match self {
            EntryDtype::F32 => 4,
            EntryDtype::Bf16 => 2,
            EntryDtype::Fp8E4m3 => 1,
        }
    }

    /// Bytes of one `dim`-wide entry, scale included, as index-K stores it (compressed-KV
    /// entries: [`KvLayout::kv_entry_bytes`]).
    pub fn entry_bytes(self, dim: usize) -> usize {
        dim * self.bytes() + self.scale_bytes()
    }

    /// Bytes of the per-entry scale (fp8 only).
    pub fn scale_bytes(self) -> usize {
        match self {
            EntryDtype::Fp8E4m3 => 4,
            EntryDtype::F32 | EntryDtype::Bf16 => 0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EntryDtype::F32 => "f32",
            EntryDtype::Bf16 => "bf16",
            EntryDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    pub fn parse(s: &str) -> Result<Self, LayoutError> {
        match s {
            "f32" | "fp32" | "float32" => Ok(EntryDtype::F32),
            "bf16" | "bfloat16" => Ok(EntryDtype::Bf16),
            "fp8" | "fp8_e4m3" | "e4m3" => Ok(EntryDtype::Fp8E4m3),
            other => Err(LayoutError::Invalid {
                field: "dtype",
                reason: format!("unknown entry dtype `{other}` (expected f32, bf16 or fp8)"),
            }),
        }
    }
}

impl std::fmt::Display for EntryDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Runtime choices that, with the model config, fix the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayoutSpec {
    /// Positions covered by one page; a multiple of every compress rate.
    pub page_tokens: usize,
    /// Dtype of compressed-KV entries and sliding-window entries.
    pub kv_dtype: EntryDtype,
    /// Dtype of the indexer's index-K entries.
    pub index_k_dtype: EntryDtype,
    /// Numerics mode: under `deepseek` the entries hold DeepSeek's quantized values
    /// (index-K Hadamard-rotated), so it is part of the layout.
    pub numerics: Numerics,
}

impl KvLayoutSpec {
    /// Default page size: 256 positions, or the smallest multiple of every compress rate
    /// that is at least that.
    pub fn default_for(cfg: &ModelConfig) -> Self {
        KvLayoutSpec {
            page_tokens: default_page_tokens(cfg),
            kv_dtype: EntryDtype::F32,
            index_k_dtype: EntryDtype::F32,
            numerics: Numerics::Transformers,
        }
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn default_page_tokens(cfg: &ModelConfig) -> usize {
    let lcm = cfg
        .layer_types
        .iter()
        .filter_map(|k| cfg.compress_rate(*k))
        .fold(1usize, |acc, r| acc / gcd(acc, r) * r);
    256usize.div_ceil(lcm) * lcm
}

/// Where one layer's data sits inside a page and inside a state slot (byte offsets).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LayerKvLayout {
    pub kind: LayerKind,
    /// Compress rate (0 for sliding layers).
    pub rate: usize,
    /// Compressed-KV entries per page (0 for sliding layers).
    pub comp_entries_per_page: usize,
    pub comp_page_offset: usize,
    /// fp8 compressed KV: where the entries' scales start (after all rows); equal to the
    /// end of the entries for dtypes without scales.
    pub comp_scale_offset: usize,
    /// Index-K entries per page (CSA only).
    pub index_entries_per_page: usize,
    pub index_page_offset: usize,
    /// fp8 index-K: where the entries' fp32 scales start (after all keys); equal to
    /// the end of the keys for dtypes without scales.
    pub index_scale_offset: usize,
    /// Sliding-window ring in the state slot: `window` entries of `head_dim`.
    pub window_state_offset: usize,
    /// fp8: where the ring entries' scales start (as `comp_scale_offset`).
    pub window_scale_offset: usize,
    /// Compressor ring in the state slot: `comp_ring_slots` rows of `comp_row_floats` f32
    /// (projected kv then gate, each `comp_width` wide).
    pub comp_state_offset: usize,
    pub comp_ring_slots: usize,
    pub comp_width: usize,
    /// Indexer compressor ring (CSA only), same shape rules at `index_width`.
    pub index_state_offset: usize,
    pub index_ring_slots: usize,
    pub index_width: usize,
}

impl LayerKvLayout {
    /// f32 values in one compressor ring row (kv followed by gate).
    pub fn comp_row_floats(&self) -> usize {
        2 * self.comp_width
    }

    pub fn index_row_floats(&self) -> usize {
        2 * self.index_width
    }
}

/// Complete KV layout of one model under one runtime spec.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KvLayout {
    pub page_tokens: usize,
    pub head_dim: usize,
    pub index_head_dim: usize,
    /// Trailing rope channels of a compressed-KV entry (kept bf16 by fp8 storage).
    pub rope_dim: usize,
    pub sliding_window: usize,
    pub kv_dtype: EntryDtype,
    pub index_k_dtype: EntryDtype,
    pub numerics: Numerics,
    pub layers: Vec<LayerKvLayout>,
    /// Bytes of one token page (all layers).
    pub page_bytes: usize,
    /// Bytes of one per-request state slot (all layers).
    pub state_bytes: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("invalid KV layout: {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("KV layout mismatch in field `{field}`: ours is {ours}, peer's is {theirs}")]
    Mismatch {
        field: String,
        ours: String,
        theirs: String,
    },
}

/// Round up to 16 bytes so every region stays aligned for any entry dtype.
fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// `n` compressed-KV / window entries from byte `base`: where their scales start and where
/// the region ends. fp8 rows first, then (16-aligned) every entry's scales; other dtypes
/// have no scales (both offsets are the end of the rows).
fn kv_region(
    dtype: EntryDtype,
    fp8: Option<Fp8KvFormat>,
    head_dim: usize,
    base: usize,
    n: usize,
) -> (usize, usize) {
    match fp8 {
        Some(f) => {
            let scales = align16(base + n * f.row_bytes());
            (scales, scales + n * f.scale_bytes())
        }
        None => {
            let end = base + n * head_dim * dtype.bytes();
            (end, end)
        }
    }
}

/// What `deepseek` numerics needs of the layout: fp8 compressed-KV storage (its
/// quantization is the reference's), and power-of-two indexer heads (the Hadamard
/// rotation).
fn check_numerics(cfg: &ModelConfig, spec: &KvLayoutSpec) -> Result<(), LayoutError> {
    if spec.numerics != Numerics::Deepseek {
        return Ok(());
    }
    if spec.kv_dtype != EntryDtype::Fp8E4m3 {
        return Err(LayoutError::Invalid {
            field: "kv_dtype",
            reason: format!(
                "deepseek numerics stores compressed KV and the sliding window as fp8 (FlashMLA's V4 layout), not {}: use --kv-dtype fp8",
                spec.kv_dtype
            ),
        });
    }
    if !cfg.index_head_dim.is_power_of_two() {
        return Err(LayoutError::Invalid {
            field: "index_head_dim",
            reason: format!(
                "deepseek numerics Hadamard-rotates the indexer's heads, which needs a power of two, not {}",
                cfg.index_head_dim
            ),
        });
    }
    Ok(())
}

impl KvLayout {
    pub fn new(cfg: &ModelConfig, spec: KvLayoutSpec) -> Result<Self, LayoutError> {
        if spec.page_tokens == 0 {
            return Err(LayoutError::Invalid {
                field: "page_tokens",
                reason: "must be positive".into(),
            });
        }
        let hd = cfg.head_dim;
        let ihd = cfg.index_head_dim;
        check_numerics(cfg, &spec)?;
        let fp8_kv = (spec.kv_dtype == EntryDtype::Fp8E4m3)
            .then(|| Fp8KvFormat::new(hd, cfg.qk_rope_head_dim));
        let region = |base: usize, n: usize| kv_region(spec.kv_dtype, fp8_kv, hd, base, n);
        let mut page = 0usize;
        let mut state = 0usize;
        let mut layers = Vec::with_capacity(cfg.layer_types.len());
        for (i, &kind) in cfg.layer_types.iter().enumerate() {
            let rate = cfg.compress_rate(kind).unwrap_or(0);
            if rate > 0 && !spec.page_tokens.is_multiple_of(rate) {
                return Err(LayoutError::Invalid {
                    field: "page_tokens",
                    reason: format!(
                        "{} is not a multiple of layer {i}'s compress rate {rate}",
                        spec.page_tokens
                    ),
                });
            }
            let window_state_offset = state;
            let (window_scale_offset, window_end) = region(state, cfg.sliding_window);
            state = align16(window_end);
            let mut l = LayerKvLayout {
                kind,
                rate,
                comp_entries_per_page: 0,
                comp_page_offset: page,
                comp_scale_offset: page,
                index_entries_per_page: 0,
                index_page_offset: page,
                index_scale_offset: page,
                window_state_offset,
                window_scale_offset,
                comp_state_offset: state,
                comp_ring_slots: 0,
                comp_width: 0,
                index_state_offset: state,
                index_ring_slots: 0,
                index_width: 0,
            };
            match kind {
                LayerKind::Sliding => {}
                LayerKind::Hca => {
                    l.comp_entries_per_page = spec.page_tokens / rate;
                    let (scales, end) = region(page, l.comp_entries_per_page);
                    l.comp_scale_offset = scales;
                    page = align16(end);
                    l.comp_ring_slots = rate;
                    l.comp_width = hd;
                    state = align16(state + l.comp_ring_slots * l.comp_row_floats() * 4);
                }
                LayerKind::Csa => {
                    l.comp_entries_per_page = spec.page_tokens / rate;
                    let (scales, end) = region(page, l.comp_entries_per_page);
                    l.comp_scale_offset = scales;
                    page = align16(end);
                    l.index_page_offset = page;
                    l.index_entries_per_page = spec.page_tokens / rate;
                    let keys = l.index_entries_per_page * ihd * spec.index_k_dtype.bytes();
                    l.index_scale_offset = align16(page + keys);
                    let scales = l.index_entries_per_page * spec.index_k_dtype.scale_bytes();
                    page = align16(if scales > 0 {
                        l.index_scale_offset + scales
                    } else {
                        page + keys
                    });
                    // Overlapping windows: the ring keeps the previous window too.
                    l.comp_ring_slots = 2 * rate;
                    l.comp_width = 2 * hd;
                    state = align16(state + l.comp_ring_slots * l.comp_row_floats() * 4);
                    l.index_state_offset = state;
                    l.index_ring_slots = 2 * rate;
                    l.index_width = 2 * ihd;
                    state = align16(state + l.index_ring_slots * l.index_row_floats() * 4);
                }
            }
            layers.push(l);
        }
        Ok(KvLayout {
            page_tokens: spec.page_tokens,
            head_dim: hd,
            index_head_dim: ihd,
            rope_dim: cfg.qk_rope_head_dim,
            sliding_window: cfg.sliding_window,
            kv_dtype: spec.kv_dtype,
            index_k_dtype: spec.index_k_dtype,
            numerics: spec.numerics,
            layers,
            page_bytes: page.max(16),
            state_bytes: state.max(16),
        })
    }

    /// The fp8 compressed-KV entry format (`kv_dtype` fp8), else `None`.
    pub fn fp8_kv_format(&self) -> Option<Fp8KvFormat> {
        (self.kv_dtype == EntryDtype::Fp8E4m3)
            .then(|| Fp8KvFormat::new(self.head_dim, self.rope_dim))
    }

    /// Bytes of one compressed-KV / sliding-window entry, scales included (V4 fp8: 584).
    pub fn kv_entry_bytes(&self) -> usize {
        self.kv_row_bytes() + self.fp8_kv_format().map_or(0, |f| f.scale_bytes())
    }

    /// Bytes of one compressed-KV / window entry's row (without fp8 scales).
    pub fn kv_row_bytes(&self) -> usize {
        self.fp8_kv_format()
            .map_or(self.head_dim * self.kv_dtype.bytes(), |f| f.row_bytes())
    }

    /// Byte offsets of compressed-KV / window entry `slot` of the region whose rows start
    /// at `rows` and whose scales start at `scales`: the row, and for fp8 its scales.
    pub fn kv_entry_offsets(
        &self,
        rows: usize,
        scales: usize,
        slot: usize,
    ) -> (usize, Option<usize>) {
        let row = rows + slot * self.kv_row_bytes();
        let scale = self
            .fp8_kv_format()
            .map(|f| scales + slot * f.scale_bytes());
        (row, scale)
    }

    /// Pages needed to hold `len` positions.
    pub fn pages_for(&self, len: usize) -> usize {
        len.div_ceil(self.page_tokens)
    }

    /// Byte offsets inside a page of index-K entry `slot` of layer `l`: the key bytes,
    /// and for fp8 its fp32 scale.
    pub fn index_entry_offsets(&self, l: &LayerKvLayout, slot: usize) -> (usize, Option<usize>) {
        let key = l.index_page_offset + slot * self.index_head_dim * self.index_k_dtype.bytes();
        let scale = (self.index_k_dtype.scale_bytes() > 0)
            .then(|| l.index_scale_offset + slot * self.index_k_dtype.scale_bytes());
        (key, scale)
    }

    /// Byte ranges of a state slot that a sequence continuing from a page cut (a multiple
    /// of every compress rate) can still read: every sliding-window ring and the CSA
    /// compressor and indexer rings (they keep the previous window). HCA compressor rings
    /// are left out: at a cut all their windows are closed, and every row the next window
    /// pools is written after the cut. Sorted, disjoint, adjacent ranges merged.
    pub fn state_ranges_live_at_cut(&self) -> Vec<std::ops::Range<usize>> {
        let mut r: Vec<std::ops::Range<usize>> = Vec::new();
        for l in &self.layers {
            let (_, end) = kv_region(
                self.kv_dtype,
                self.fp8_kv_format(),
                self.head_dim,
                l.window_state_offset,
                self.sliding_window,
            );
            r.push(l.window_state_offset..end);
            if l.kind == LayerKind::Csa {
                let comp = l.comp_ring_slots * l.comp_row_floats() * 4;
                r.push(l.comp_state_offset..l.comp_state_offset + comp);
                let idx = l.index_ring_slots * l.index_row_floats() * 4;
                r.push(l.index_state_offset..l.index_state_offset + idx);
            }
        }
        r.sort_by_key(|x| x.start);
        let mut merged: Vec<std::ops::Range<usize>> = Vec::new();
        for x in r.into_iter().filter(|x| !x.is_empty()) {
            match merged.last_mut() {
                Some(m) if m.end >= x.start => m.end = m.end.max(x.end),
                _ => merged.push(x),
            }
        }
        merged
    }

    /// Rows a forward must run before a cut inside it for every ring live at the cut
    /// ([`KvLayout::state_ranges_live_at_cut`]: sliding windows, CSA compressor and
    /// indexer rings) to be whole, written by that forward alone.
    pub fn longest_ring(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| l.kind == LayerKind::Csa)
            .flat_map(|l| [l.comp_ring_slots, l.index_ring_slots])
            .chain([self.sliding_window])
            .max()
            .unwrap_or(0)
    }

    /// Bytes of a prefix-cache state snapshot ([`KvLayout::state_ranges_live_at_cut`]).
    pub fn cut_snapshot_bytes(&self) -> usize {
        self.state_ranges_live_at_cut()
            .iter()
            .map(|r| r.len())
            .sum()
    }

    /// Named scalar fields, in a fixed order; the fingerprint and the peer check use these.
    pub fn fields(&self) -> Vec<(String, String)> {
        let mut f = vec![
            ("page_tokens".to_string(), self.page_tokens.to_string()),
            ("head_dim".to_string(), self.head_dim.to_string()),
            (
                "index_head_dim".to_string(),
                self.index_head_dim.to_string(),
            ),
            (
                "sliding_window".to_string(),
                self.sliding_window.to_string(),
            ),
            ("rope_dim".to_string(), self.rope_dim.to_string()),
            ("kv_dtype".to_string(), self.kv_dtype.to_string()),
            ("index_k_dtype".to_string(), self.index_k_dtype.to_string()),
            ("numerics".to_string(), self.numerics.to_string()),
            ("num_layers".to_string(), self.layers.len().to_string()),
            ("page_bytes".to_string(), self.page_bytes.to_string()),
            ("state_bytes".to_string(), self.state_bytes.to_string()),
        ];
        for (i, l) in self.layers.iter().enumerate() {
            let mut push = |name: &str, v: String| f.push((format!("layers[{i}].{name}"), v));
            push("kind", format!("{:?}", l.kind));
            push("rate", l.rate.to_string());
            push("comp_entries_per_page", l.comp_entries_per_page.to_string());
            push("comp_page_offset", l.comp_page_offset.to_string());
            push("comp_scale_offset", l.comp_scale_offset.to_string());
            push(
                "index_entries_per_page",
                l.index_entries_per_page.to_string(),
            );
            push("index_page_offset", l.index_page_offset.to_string());
            push("index_scale_offset", l.index_scale_offset.to_string());
            push("window_state_offset", l.window_state_offset.to_string());
            push("window_scale_offset", l.window_scale_offset.to_string());
            push("comp_state_offset", l.comp_state_offset.to_string());
            push("index_state_offset", l.index_state_offset.to_string());
        }
        f
    }

    /// Stable hex fingerprint of [`KvLayout::fields`].
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        for (k, v) in self.fields() {
            h.update(k.as_bytes());
            h.update(b"=");
            h.update(v.as_bytes());
            h.update(b";");
        }
        h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Refuse a peer whose layout differs, naming the first differing field.
    pub fn check_compatible(&self, other: &KvLayout) -> Result<(), LayoutError> {
        self.check_peer_fields(&other.fields())
    }
}
