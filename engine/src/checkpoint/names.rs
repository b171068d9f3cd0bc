//! Tensor names on disk -> the canonical names of transformers' `DeepseekV4ForCausalLM`
//! modules (`model.layers.N.self_attn.q_a_proj.weight`, ...).
//!
//! transformers 5.17 `save_pretrained` writes the upstream DeepSeek names back out
//! (`attn.wq_a`, `ffn.experts.E.w1`, `ape`, `attn_sink`, `gate.bias`, `hc_attn_fn`,
//! `head.weight`) while keeping the `model.` prefix on most keys; upstream checkpoints
//! use the same names with no prefix. Both, and checkpoints already in canonical names,
//! map through [`canonical`]: the renames of transformers' `conversion_mapping.py`
//! (`deepseek_v4`), applied in the same order to the key without its `model.` prefix.
//! Per-expert `w1`/`w3` (gate/up) and `w2` (down) tensors are stacked into the packed
//! `experts.gate_up_proj` `[E, 2I, H]` and `experts.down_proj` `[E, H, I]`.

/// Which packed expert tensor a per-expert disk tensor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertPart {
    /// `w1`: gate rows, first half of `gate_up_proj`.
    Gate,
    /// `w3`: up rows, second half of `gate_up_proj`.
    Up,
    /// `w2`: `down_proj`.
    Down,
}

/// What a disk tensor is, in canonical terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Canonical {
    /// The tensor itself, under this name.
    Whole(String),
    /// One expert's slice of a packed tensor: `packed` is the canonical packed name.
    Expert {
        packed: String,
        expert: usize,
        part: ExpertPart,
    },
    /// Multi-token-prediction weights: not used for inference (transformers ignores them too).
    Ignored,
}

/// One rename of transformers' mapping.
enum Rule {
    /// First occurrence of a substring (`\.x\.` patterns).
    Mid(&'static str, &'static str),
    /// The whole key (`^x$` patterns).
    Whole(&'static str, &'static str),
    /// A suffix (`\.x$` patterns).
    Suffix(&'static str, &'static str),
}

/// transformers 5.17 `conversion_mapping.py`, `deepseek_v4`, in its order.
const RULES: &[Rule] = &[
    Rule::Mid(".attn.", ".self_attn."),
    Rule::Mid(".ffn.", ".mlp."),
    Rule::Mid(".indexer.compressor.", ".compressor.indexer."),
    Rule::Whole("embed.weight", "embed_tokens.weight"),
    Rule::Whole("head.weight", "lm_head.weight"),
    Rule::Whole("hc_head_fn", "hc_head.hc_fn"),
    Rule::Whole("hc_head_base", "hc_head.hc_base"),
    Rule::Whole("hc_head_scale", "hc_head.hc_scale"),
    Rule::Mid(".attn_norm.", ".input_layernorm."),
    Rule::Mid(".ffn_norm.", ".post_attention_layernorm."),
    Rule::Suffix(".hc_attn_fn", ".attn_hc.fn"),
    Rule::Suffix(".hc_attn_base", ".attn_hc.base"),
    Rule::Suffix(".hc_attn_scale", ".attn_hc.scale"),
    Rule::Suffix(".hc_ffn_fn", ".ffn_hc.fn"),
    Rule::Suffix(".hc_ffn_base", ".ffn_hc.base"),
    Rule::Suffix(".hc_ffn_scale", ".ffn_hc.scale"),
    Rule::Suffix(".attn_sink", ".sinks"),
    Rule::Mid(
        ".indexer.weights_proj.",
        ".compressor.indexer.scorer.weights_proj.",
    ),
    Rule::Mid(".indexer.wq_b.", ".compressor.indexer.q_b_proj."),
    Rule::Mid(".norm.", ".kv_norm."),
    Rule::Suffix(".ape", ".position_bias"),
    Rule::Mid(".wq_a.", ".q_a_proj."),
    Rule::Mid(".self_attn.wq_b.", ".self_attn.q_b_proj."),
    Rule::Mid(".wkv.", ".kv_proj."),
    Rule::Mid(".wgate.", ".gate_proj."),
    Rule::Mid(".wo_a.", ".o_a_proj."),
    Rule::Mid(".wo_b.", ".o_b_proj."),
    Rule::Mid(".q_norm.", ".q_a_norm."),
    Rule::Suffix(".gate.bias", ".gate.e_score_correction_bias"),
    Rule::Mid(".shared_experts.w1.", ".shared_experts.gate_proj."),
    Rule::Mid(".shared_experts.w2.", ".shared_experts.down_proj."),
    Rule::Mid(".shared_experts.w3.", ".shared_experts.up_proj."),
];

impl Rule {
    fn apply(&self, key: String) -> String {
        match *self {
            Rule::Mid(from, to) => match key.find(from) {
                Some(i) => format!("{}{}{}", &key[..i], to, &key[i + from.len()..]),
                None => key,
            },
            Rule::Whole(from, to) if key == from => to.to_string(),
            Rule::Whole(..) => key,
            Rule::Suffix(from, to) => match key.strip_suffix(from) {
                Some(stem) => format!("{stem}{to}"),
                None => key,
            },
        }
    }
}

/// Canonical identity of a disk tensor name.
pub fn canonical(disk: &str) -> Canonical {
    let bare = disk.strip_prefix("model.").unwrap_or(disk);
    if bare.starts_with("mtp.") || bare.contains(".mtp.") {
        return Canonical::Ignored;
    }
    let k = RULES.iter().fold(bare.to_string(), |k, r| r.apply(k));
    if let Some(c) = expert_slice(&k) {
        return c;
    }
    if k == "lm_head.weight" {
        Canonical::Whole(k)
    } else {
        Canonical::Whole(format!("model.{k}"))
    }
}

/// `layers.N.mlp.experts.E.w1.weight` -> one expert's part of the packed tensor.
fn expert_slice(k: &str) -> Option<Canonical> {
    let (stem, rest) = k.split_once(".experts.")?;
    let (idx, tail) = rest.split_once('.')?;
    let expert: usize = idx.parse().ok()?;
    let (part, packed) = match tail {
        "w1.weight" => (ExpertPart::Gate, "gate_up_proj"),
        "w3.weight" => (ExpertPart::Up, "gate_up_proj"),
        "w2.weight" => (ExpertPart::Down, "down_proj"),
        _ => return None,
    };
    Some(Canonical::Expert {
        packed: format!("model.{stem}.experts.{packed}"),
        expert,
        part,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(s: &str) -> Canonical {
        Canonical::Whole(s.to_string())
    }

    #[test]
    fn saved_names_map_to_module_names() {
        let cases = [
            ("head.weight", "lm_head.weight"),
            ("model.embed_tokens.weight", "model.embed_tokens.weight"),
            ("embed.weight", "model.embed_tokens.weight"),
            ("model.norm.weight", "model.norm.weight"),
            ("norm.weight", "model.norm.weight"),
            ("hc_head_fn", "model.hc_head.hc_fn"),
            ("model.hc_head.hc_scale", "model.hc_head.hc_scale"),
            (
                "model.layers.1.attn.wq_a.weight",
                "model.layers.1.self_attn.q_a_proj.weight",
            ),
            (
                "model.layers.1.attn.q_norm.weight",
                "model.layers.1.self_attn.q_a_norm.weight",
            ),
            (
                "model.layers.1.attn.wq_b.weight",
                "model.layers.1.self_attn.q_b_proj.weight",
            ),
            (
                "model.layers.1.attn.wkv.weight",
                "model.layers.1.self_attn.kv_proj.weight",
            ),
            (
                "model.layers.1.attn.norm.weight",
                "model.layers.1.self_attn.kv_norm.weight",
            ),
            (
                "model.layers.1.attn.wo_a.weight",
                "model.layers.1.self_attn.o_a_proj.weight",
            ),
            (
                "model.layers.1.attn.wo_b.weight",
                "model.layers.1.self_attn.o_b_proj.weight",
            ),
            (
                "model.layers.1.attn.attn_sink",
                "model.layers.1.self_attn.sinks",
            ),
            (
                "model.layers.1.attn.compressor.wkv.weight",
                "model.layers.1.self_attn.compressor.kv_proj.weight",
            ),
            (
                "model.layers.1.attn.compressor.wgate.weight",
                "model.layers.1.self_attn.compressor.gate_proj.weight",
            ),
            (
                "model.layers.1.attn.compressor.ape",
                "model.layers.1.self_attn.compressor.position_bias",
            ),
            (
                "model.layers.1.attn.compressor.norm.weight",
                "model.layers.1.self_attn.compressor.kv_norm.weight",
            ),
            (
                "model.layers.1.attn.indexer.compressor.wkv.weight",
                "model.layers.1.self_attn.compressor.indexer.kv_proj.weight",
            ),
            (
                "model.layers.1.attn.indexer.compressor.ape",
                "model.layers.1.self_attn.compressor.indexer.position_bias",
            ),
            (
                "model.layers.1.attn.indexer.compressor.norm.weight",
                "model.layers.1.self_attn.compressor.indexer.kv_norm.weight",
            ),
            (
                "model.layers.1.attn.indexer.wq_b.weight",
                "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight",
            ),
            (
                "model.layers.1.attn.indexer.weights_proj.weight",
                "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
            ),
            (
                "model.layers.1.attn_norm.weight",
                "model.layers.1.input_layernorm.weight",
            ),
            (
                "model.layers.1.ffn_norm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ),
            ("model.layers.1.hc_attn_fn", "model.layers.1.attn_hc.fn"),
            ("model.layers.1.hc_ffn_scale", "model.layers.1.ffn_hc.scale"),
            (
                "model.layers.1.ffn.gate.weight",
                "model.layers.1.mlp.gate.weight",
            ),
            (
                "model.layers.1.ffn.gate.tid2eid",
                "model.layers.1.mlp.gate.tid2eid",
            ),
            (
                "model.layers.3.ffn.gate.bias",
                "model.layers.3.mlp.gate.e_score_correction_bias",
            ),
            (
                "model.layers.1.ffn.shared_experts.w1.weight",
                "model.layers.1.mlp.shared_experts.gate_proj.weight",
            ),
            (
                "model.layers.1.ffn.shared_experts.w2.weight",
                "model.layers.1.mlp.shared_experts.down_proj.weight",
            ),
            (
                "model.layers.1.ffn.shared_experts.w3.weight",
                "model.layers.1.mlp.shared_experts.up_proj.weight",
            ),
        ];
        for (disk, want) in cases {
            assert_eq!(canonical(disk), whole(want), "{disk}");
            // Canonical names are fixed points.
            assert_eq!(canonical(want), whole(want), "{want}");
        }
    }

    #[test]
    fn experts_and_mtp() {
        assert_eq!(
            canonical("model.layers.2.ffn.experts.7.w3.weight"),
            Canonical::Expert {
                packed: "model.layers.2.mlp.experts.gate_up_proj".into(),
                expert: 7,
                part: ExpertPart::Up
            }
        );
        assert_eq!(
            canonical("layers.0.ffn.experts.0.w2.weight"),
            Canonical::Expert {
                packed: "model.layers.0.mlp.experts.down_proj".into(),
                expert: 0,
                part: ExpertPart::Down
            }
        );
        assert_eq!(
            canonical("model.layers.0.mlp.experts.gate_up_proj"),
            whole("model.layers.0.mlp.experts.gate_up_proj")
        );
        assert_eq!(canonical("mtp.0.attn.wq_a.weight"), Canonical::Ignored);
    }
}
