//! What a step must move and compute, from the config, the weight inventory
//! ([`expected_tensors`]: the same names and shapes the loader builds) and the KV layout
//! ([`KvLayout`]: the one source of every KV size).
//!
//! Decode bytes (the floor's numerator): every dense weight of every layer once (attention
//! projections, compressor, indexer, router, shared expert, hyper-connection maps, norms),
//! the embedding rows of the batch's tokens, the LM head and final maps, the routed experts
//! the batch touches (hash layers: exactly, from `tid2eid` and the tokens; top-k layers:
//! the upper bound `min(E, batch * top_k)`), and per row the KV entries its attention reads:
//! sliding-window ring entries before it (`min(pos, window - 1)`), for CSA the
//! `min(index_topk, visible)` selected compressed entries plus all `visible` index-K
//! entries the indexer scores, for HCA all `visible` compressed entries, where
//! `visible = (pos + 1) / rate`. Compressor-ring state reads (only on the 1-in-`rate` steps
//! that close a window) and all writes are left out.

use pdserve_engine::checkpoint::expected_tensors;
use pdserve_engine::config::{LayerKind, MlpKind, ModelConfig};
use pdserve_engine::kv::KvLayout;
use pdserve_engine::model::weights::rows_cols;
use std::collections::BTreeSet;

/// Weight bytes as one backend stores them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WeightBytes {
    /// Every weight on the device.
    pub total: u64,
    /// Per layer: weights every step reads whole (everything but routed experts).
    pub dense_per_layer: Vec<u64>,
    /// Per layer: bytes of one routed expert (gate, up and down rows).
    pub expert_per_layer: Vec<u64>,
    /// Outside the layers, read whole every step: final norm, `hc_head`, LM head.
    pub head: u64,
    /// One embedding row.
    pub embed_row: u64,
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

fn is_expert(name: &str) -> bool {
    name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj")
}

/// `tensor_bytes(name, rows, cols)`: bytes that weight occupies on the backend (stored
/// FP8/FP4 weights: their bytes and scales).
pub fn weight_bytes(
    cfg: &ModelConfig,
    tensor_bytes: impl Fn(&str, usize, usize) -> u64,
) -> WeightBytes {
    let n = cfg.num_hidden_layers;
    let mut w = WeightBytes {
        dense_per_layer: vec![0; n],
        expert_per_layer: vec![0; n],
        ..Default::default()
    };
    for t in expected_tensors(cfg) {
        if t.int {
            continue; // tid2eid stays on the host
        }
        let (rows, cols) = rows_cols(&t.shape);
        let bytes = tensor_bytes(&t.name, rows, cols);
        w.total += bytes;
        match layer_of(&t.name) {
            Some(l) if is_expert(&t.name) => {
                w.expert_per_layer[l] += bytes / cfg.n_routed_experts as u64
            }
            Some(l) => w.dense_per_layer[l] += bytes,
            None if t.name == "model.embed_tokens.weight" => {
                w.embed_row = bytes / cfg.vocab_size as u64;
                if cfg.tie_word_embeddings {
                    w.head += bytes;
                }
            }
            None => w.head += bytes,
        }
    }
    w
}

/// Distinct experts a layer's routing touches for the batch's `tokens`.
pub fn experts_touched(
    cfg: &ModelConfig,
    layer: usize,
    tokens: &[u32],
    tid2eid: Option<&[u32]>,
) -> usize {
    let (e, k) = (cfg.n_routed_experts, cfg.num_experts_per_tok);
    match (cfg.mlp_layer_types[layer], tid2eid) {
        (MlpKind::HashMoe, Some(table)) => tokens
            .iter()
            .flat_map(|&t| table[t as usize * k..(t as usize + 1) * k].iter().copied())
            .collect::<BTreeSet<u32>>()
            .len(),
        _ => e.min(tokens.len() * k),
    }
}

/// KV bytes one decode row at absolute position `pos` reads, summed over layers.
pub fn kv_read_bytes(cfg: &ModelConfig, layout: &KvLayout, pos: usize) -> u64 {
    let kv_entry = layout.kv_entry_bytes() as u64;
    let idx_entry = layout.index_k_dtype.entry_bytes(layout.index_head_dim) as u64;
    let window = pos.min(layout.sliding_window.saturating_sub(1)) as u64;
    layout
        .layers
        .iter()
        .map(|l| {
            let visible = (pos + 1).checked_div(l.rate).unwrap_or(0) as u64;
            window * kv_entry
                + match l.kind {
                    LayerKind::Sliding => 0,
                    LayerKind::Hca => visible * kv_entry,
                    LayerKind::Csa => {
                        visible.min(cfg.index_topk as u64) * kv_entry + visible * idx_entry
                    }
                }
        })
        .sum()
}

/// Bytes one decode step of `tokens` (one per sequence, at `positions`) must read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepBytes {
    pub weights: u64,
    pub kv: u64,
    /// Mean distinct routed experts per layer.
    pub experts_per_layer: f64,
}

pub fn step_bytes(
    cfg: &ModelConfig,
    layout: &KvLayout,
    w: &WeightBytes,
    tid2eid: &[Option<&[u32]>],
    tokens: &[u32],
    positions: &[usize],
) -> StepBytes {
    let mut weights = w.head + w.embed_row * tokens.len() as u64;
    let mut experts = 0usize;
    for l in 0..cfg.num_hidden_layers {
        let touched = experts_touched(cfg, l, tokens, tid2eid.get(l).copied().flatten());
        experts += touched;
        weights += w.dense_per_layer[l] + w.expert_per_layer[l] * touched as u64;
    }
    StepBytes {
        weights,
        kv: positions
            .iter()
            .map(|&p| kv_read_bytes(cfg, layout, p))
            .sum(),
        experts_per_layer: experts as f64 / cfg.num_hidden_layers.max(1) as f64,
    }
}

/// Multiply-add FLOPs (2 per MAC) of a prefill of `tokens` tokens from position 0 with
/// logits for the last row only: every token through every dense projection, its
/// `top_k` routed experts and the shared expert; attention scores and weighted sums over
/// the keys each row sees (window, plus CSA's selected or HCA's visible compressed
/// entries); the indexer's scores over every visible index-K entry; the LM head once.
/// Compressor pooling, norms and elementwise work are left out (they are not GEMMs).
pub fn prefill_flops(cfg: &ModelConfig, tokens: usize) -> f64 {
    let t = tokens as f64;
    let mut per_token = 0f64;
    let mut once = 0f64;
    for e in expected_tensors(cfg) {
        let (rows, cols) = rows_cols(&e.shape);
        let mac = (rows * cols) as f64;
        if e.name.ends_with("_proj.weight")
            || e.name.ends_with("mlp.gate.weight")
            || e.name.ends_with("_hc.fn")
        {
            per_token += 2.0 * mac;
        } else if is_expert(&e.name) {
            per_token += 2.0 * mac / cfg.n_routed_experts as f64 * cfg.num_experts_per_tok as f64;
        } else if e.name == "lm_head.weight" || e.name == "model.hc_head.hc_fn" {
            once += 2.0 * mac;
        }
    }
    if cfg.tie_word_embeddings {
        once += 2.0 * (cfg.vocab_size * cfg.hidden_size) as f64;
    }
    let (nh, hd) = (cfg.num_attention_heads as f64, cfg.head_dim as f64);
    let idx = (cfg.index_n_heads * cfg.index_head_dim) as f64;
    let mut attn = 0f64;
    for &kind in &cfg.layer_types {
        let rate = cfg.compress_rate(kind).unwrap_or(1);
        for p in 0..tokens {
            let window = (p + 1).min(cfg.sliding_window) as f64;
            let visible = ((p + 1) / rate) as f64;
            let keys = match kind {
                LayerKind::Sliding => window,
                LayerKind::Hca => window + visible,
                LayerKind::Csa => window + visible.min(cfg.index_topk as f64),
            };
            attn += 4.0 * nh * hd * keys;
            if kind == LayerKind::Csa {
                attn += 2.0 * idx * visible;
            }
        }
    }
    per_token * t + attn + once
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::bench::config::ModelFlags;

    fn flash(layers: usize, experts: usize) -> (ModelConfig, KvLayout) {
        let f = ModelFlags {
            device: "cpu".into(),
            layers,
            experts,
            tiny: false,
            seed: 0,
            kv_dtype: "bf16".into(),
            index_k_dtype: "bf16".into(),
            numerics: "transformers".into(),
            cuda_weights: "bf16".into(),
            weights: vec!["bf16".into()],
            deterministic: false,
            attention: "auto".into(),
            expert_kernel: "auto".into(),
            dense_kernel: "auto".into(),
            expert_lanes: pdserve_kernels::DEFAULT_LANES,
            no_pdl: false,
            indexer: "auto".into(),
        };
        let cfg = f.config().unwrap();
        let layout = f.layout(&cfg).unwrap();
        (cfg, layout)
    }

    #[test]
    fn weight_bytes_of_flash_layers() {
        let (cfg, _) = flash(4, 64);
        let w = weight_bytes(&cfg, |_, r, c| (2 * r * c) as u64);
        // One expert: gate+up [2*2048, 4096] and down [4096, 2048], bf16.
        assert_eq!(w.expert_per_layer, vec![3 * 2048 * 4096 * 2; 4]);
        assert_eq!(w.embed_row, 4096 * 2);
        // Head: lm_head [129280, 4096] + final norm + hc_head (fn [4, 16384], base, scale).
        assert_eq!(w.head, (129_280 * 4096 + 4096 + 4 * 16384 + 4 + 1) * 2);
        let experts_total: u64 = w.expert_per_layer.iter().sum::<u64>() * 64;
        let dense: u64 = w.dense_per_layer.iter().sum();
        assert_eq!(
            w.total,
            experts_total + dense + w.head + 129_280 * w.embed_row
        );
        // A sliding layer's attention alone: q_a, q_b, kv, o_a, o_b.
        let attn = 1024 * 4096 + 64 * 512 * 1024 + 512 * 4096 + 8192 * 4096 + 4096 * 8192;
        assert!(w.dense_per_layer[0] > attn * 2);
        // CSA adds its compressor and indexer to the same layer shape.
        assert!(w.dense_per_layer[2] > w.dense_per_layer[0]);
    }

    #[test]
    fn kv_bytes_follow_the_layout() {
        let (cfg, layout) = flash(4, 64);
        let e = 512 * 2; // bf16 entry
        let ie = 128 * 2;
        // pos 4096: window 127 entries in each of 4 layers; CSA sees 1024 entries (512
        // picked, 1024 scored); HCA sees 32.
        let want = 4 * 127 * e + 512 * e + 1024 * ie + 32 * e;
        assert_eq!(kv_read_bytes(&cfg, &layout, 4096), want as u64);
        // pos 0 reads nothing.
        assert_eq!(kv_read_bytes(&cfg, &layout, 0), 0);
    }

    #[test]
    fn experts_touched_hash_exact_topk_bound() {
        let (cfg, _) = flash(4, 64);
        let table: Vec<u32> = (0..cfg.vocab_size * 6).map(|i| (i % 64) as u32).collect();
        // Tokens 0 and 1: ids 0..6 and 6..12 -> 12 distinct; token 0 twice -> 6.
        assert_eq!(experts_touched(&cfg, 0, &[0, 1], Some(&table)), 12);
        assert_eq!(experts_touched(&cfg, 0, &[0, 0], Some(&table)), 6);
        // Layer 3 is top-k: min(E, batch * k).
        assert_eq!(experts_touched(&cfg, 3, &[0; 8], None), 48);
        assert_eq!(experts_touched(&cfg, 3, &[0; 64], None), 64);
    }

    #[test]
    fn prefill_flops_per_token_are_dense_plus_attention() {
        let (cfg, _) = flash(4, 64);
        let one = prefill_flops(&cfg, 1);
        let two = prefill_flops(&cfg, 2);
        // Routed experts: 6 of 3*2048*4096 MACs per layer per token.
        let experts = 4.0 * 6.0 * 2.0 * (3 * 2048 * 4096) as f64;
        assert!(one > experts);
        // f(2) - 2 f(1) = attention(position 1) - attention(position 0) - once-per-sequence
        // work (LM head + hc_head map). Position 0 sees 1 key, position 1 sees 2 (no
        // compressed entry is visible yet), in each of 4 layers: 4 * (4 * 64 * 512).
        let once = 2.0 * (129_280.0 * 4096.0 + 4.0 * 16384.0);
        let attn_step = 4.0 * 4.0 * 64.0 * 512.0;
        assert!(
            (two - 2.0 * one + once - attn_step).abs() < 1.0,
            "{}",
            two - 2.0 * one + once
        );
    }
}
