//! The peer's figures (`scripts/peer_bench.py`: the same synthetic model through
//! transformers' reference implementation), refused if its model differs from ours.

use anyhow::{bail, Context, Result};
use pdserve_engine::config::ModelConfig;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// Config fields that must agree between our model and the peer's.
const SAME: &[&str] = &[
    "num_hidden_layers",
    "n_routed_experts",
    "num_experts_per_tok",
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "moe_intermediate_size",
    "vocab_size",
    "sliding_window",
    "index_topk",
];

#[derive(Debug, Default)]
pub struct Peer {
    /// (batch, context) -> ms per decode step.
    pub decode: HashMap<(usize, usize), f64>,
    /// tokens -> seconds per prefill.
    pub prefill: HashMap<usize, f64>,
    pub label: String,
}

fn field(v: &Value, k: &str) -> Option<usize> {
    v.get(k)?.as_u64().map(|x| x as usize)
}

pub fn parse(text: &str, cfg: &ModelConfig) -> Result<Peer> {
    let v: Value = serde_json::from_str(text).context("peer JSON")?;
    let ours = serde_json::to_value(cfg)?;
    let theirs = v
        .get("config")
        .context("peer JSON has no `config` object")?;
    for k in SAME {
        let (a, b) = (ours.get(*k), theirs.get(*k));
        if a != b {
            bail!(
                "peer model differs in `{k}`: ours is {}, peer's is {}",
                a.map_or("absent".into(), Value::to_string),
                b.map_or("absent".into(), Value::to_string)
            );
        }
    }
    let mut p = Peer {
        label: v
            .get("label")
            .and_then(Value::as_str)
            .unwrap_or("peer")
            .to_string(),
        ..Default::default()
    };
    for r in v
        .get("decode")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let (Some(b), Some(c), Some(ms)) = (
            field(r, "batch"),
            field(r, "context"),
            r.get("ms_per_step").and_then(Value::as_f64),
        ) {
            p.decode.insert((b, c), ms);
        }
    }
    for r in v
        .get("prefill")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let (Some(t), Some(s)) = (field(r, "tokens"), r.get("seconds").and_then(Value::as_f64)) {
            p.prefill.insert(t, s);
        }
    }
    Ok(p)
}

pub fn load(path: &Path, cfg: &ModelConfig) -> Result<Peer> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text, cfg).with_context(|| format!("--peer {}", path.display()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::bench::config::ModelFlags;

    #[test]
    fn peer_rows_parse_and_a_different_model_is_refused() {
        let f = ModelFlags {
            device: "cpu".into(),
            layers: 4,
            experts: 8,
            tiny: true,
            seed: 0,
            kv_dtype: "f32".into(),
            index_k_dtype: "f32".into(),
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
        let mut conf = f.config_json().unwrap();
        let peer = serde_json::json!({
            "label": "transformers 5.17",
            "config": conf,
            "decode": [{"batch": 1, "context": 16, "ms_per_step": 2.5},
                       {"batch": 8, "context": 16, "error": "OOM"}],
            "prefill": [{"tokens": 32, "seconds": 0.25}],
        });
        let p = parse(&peer.to_string(), &cfg).unwrap();
        assert_eq!(p.decode.get(&(1, 16)), Some(&2.5));
        assert_eq!(p.decode.len(), 1);
        assert_eq!(p.prefill.get(&32), Some(&0.25));
        assert_eq!(p.label, "transformers 5.17");
        conf["n_routed_experts"] = 16.into();
        let bad = serde_json::json!({"config": conf});
        let e = parse(&bad.to_string(), &cfg).unwrap_err().to_string();
        assert!(e.contains("n_routed_experts") && e.contains("16"), "{e}");
    }
}
