//! The layer schedule: each decoder layer's attention kind (`layer_types`, or legacy
//! `compress_ratios`, or the V4-Pro default), its MoE routing kind (`mlp_layer_types` /
//! `num_hash_layers`) and the compression rate of each compressed kind.

use serde_json::Value;

use super::error::{ensure, field_err, Res};
use super::fields::Obj;

/// Attention flavour of one decoder layer (`layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum LayerKind {
    /// `sliding_attention`: sliding window only, "main" rope.
    Sliding,
    /// `compressed_sparse_attention`: window + overlapped compressed entries picked by the indexer.
    Csa,
    /// `heavily_compressed_attention`: window + non-overlapping compressed entries, no indexer.
    Hca,
}

/// MoE routing flavour of one decoder layer (`mlp_layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum MlpKind {
    /// `hash_moe`: experts chosen by `tid2eid[input_id]`.
    HashMoe,
    /// `moe`: top-k over scores + `e_score_correction_bias`.
    TopK,
}

const CSA: &str = "compressed_sparse_attention";
const HCA: &str = "heavily_compressed_attention";

/// Convert every entry of a JSON list, naming `field[i]` in errors.
fn entries<T>(
    items: &[Value],
    field: &str,
    expected: &str,
    conv: impl Fn(&Value) -> Option<T>,
) -> Res<Vec<T>> {
    let conv_one = |(i, v): (usize, &Value)| {
        conv(v).ok_or_else(|| {
            field_err(
                format!("{field}[{i}]"),
                format!("must be {expected}; got {v}"),
            )
        })
    };
    items.iter().enumerate().map(conv_one).collect()
}

/// Python truncates the schedules to `num_hidden_layers`, then requires exactly that many entries.
fn exact_len<T>(mut v: Vec<T>, n: usize, field: &str) -> Res<Vec<T>> {
    v.truncate(n);
    let len = v.len();
    ensure(len == n, field, || {
        format!("has {len} entries, num_hidden_layers is {n}")
    })?;
    Ok(v)
}

pub(super) fn parse_layer_types(f: &Obj, n: usize) -> Res<Vec<LayerKind>> {
    if let Some(items) = f.opt_array("layer_types")? {
        // Entries past `num_hidden_layers` are dropped before validation, as in Python.
        let kinds = entries(
            &items[..items.len().min(n)],
            "layer_types",
            "a DeepSeek-V4 layer type",
            |v| match v.as_str()? {
                "sliding_attention" => Some(LayerKind::Sliding),
                CSA => Some(LayerKind::Csa),
                HCA => Some(LayerKind::Hca),
                _ => None,
            },
        )?;
        return exact_len(kinds, n, "layer_types");
    }
    if let Some(items) = f.opt_array("compress_ratios")? {
        // Legacy per-layer ratios: every entry is mapped (Python maps before truncating).
        let kinds = entries(items, "compress_ratios", "0, 4 or 128", |v| {
            match v.as_u64()? {
                0 => Some(LayerKind::Sliding),
                4 => Some(LayerKind::Csa),
                128 => Some(LayerKind::Hca),
                _ => None,
            }
        })?;
        return exact_len(kinds, n, "compress_ratios");
    }
    // V4-Pro default: 2x HCA bootstrap, then `CSA if i % 2 else HCA` over the interleave.
    let mut kinds = vec![LayerKind::Hca; n.min(2)];
    kinds.extend((0..n.saturating_sub(2)).map(|i| {
        if i % 2 == 1 {
            LayerKind::Csa
        } else {
            LayerKind::Hca
        }
    }));
    Ok(kinds)
}

pub(super) fn parse_mlp_layer_types(f: &Obj, n: usize) -> Res<Vec<MlpKind>> {
    if let Some(items) = f.opt_array("mlp_layer_types")? {
        let kinds = entries(
            &items[..items.len().min(n)],
            "mlp_layer_types",
            "hash_moe or moe",
            |v| match v.as_str()? {
                "hash_moe" => Some(MlpKind::HashMoe),
                "moe" => Some(MlpKind::TopK),
                _ => None,
            },
        )?;
        return exact_len(kinds, n, "mlp_layer_types");
    }
    let n_hash = f.opt_usize("num_hash_layers")?.unwrap_or(3);
    Ok((0..n)
        .map(|i| {
            if i < n_hash {
                MlpKind::HashMoe
            } else {
                MlpKind::TopK
            }
        })
        .collect())
}

pub(super) fn parse_compress_rates(f: &Obj, kinds: &[LayerKind]) -> Res<(usize, usize)> {
    let mut rates = [
        (CSA, LayerKind::Csa, 4usize),
        (HCA, LayerKind::Hca, 128usize),
    ];
    if let Some(dict) = f.opt_object("compress_rates")? {
        let sub = Obj {
            map: dict,
            prefix: "compress_rates",
        };
        for (key, kind, rate) in rates.iter_mut() {
            match sub.opt_usize(key)? {
                Some(r) => *rate = r,
                // transformers replaces the default dict wholesale and would fail with a KeyError
                // when a layer of this kind is built; without such a layer the value is unused.
                None if kinds.contains(kind) => {
                    return Err(field_err(
                        sub.name(key),
                        "missing, but layers of this type exist",
                    ))
                }
                None => {}
            }
        }
    }
    if let Some(r) = f.opt_usize("compress_rate_csa")? {
        rates[0].2 = r;
    }
    if let Some(r) = f.opt_usize("compress_rate_hca")? {
        rates[1].2 = r;
    }
    Ok((rates[0].2, rates[1].2))
}
