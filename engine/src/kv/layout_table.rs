//! Markdown tables of a model's KV layout in every dtype combination (docs/kv-layout.md
//! is generated from this, so the figures cannot drift from [`KvLayout`]).

use super::{EntryDtype, KvLayout, KvLayoutSpec, LayoutError};
use crate::config::{LayerKind, ModelConfig};
use std::fmt::Write;

/// Tables for `cfg` at `page_tokens` positions per page.
pub fn markdown(cfg: &ModelConfig, page_tokens: usize) -> Result<String, LayoutError> {
    let count = |k: LayerKind| cfg.layer_types.iter().filter(|&&x| x == k).count();
    let rate = |k: LayerKind| cfg.compress_rate(k).unwrap_or(0);
    let (hd, ihd) = (cfg.head_dim, cfg.index_head_dim);
    let mut s = String::new();
    let w = &mut s;
    // Writing to a String cannot fail.
    let _ = writeln!(
        w,
        "{} layers: {} sliding, {} CSA (rate {}), {} HCA (rate {}); head_dim {hd}, \
         index_head_dim {ihd}, sliding_window {}, {page_tokens} positions per page.\n",
        cfg.layer_types.len(),
        count(LayerKind::Sliding),
        count(LayerKind::Csa),
        rate(LayerKind::Csa),
        count(LayerKind::Hca),
        rate(LayerKind::Hca),
        cfg.sliding_window,
    );
    let _ = writeln!(w, "Bytes per entry:\n");
    let _ = writeln!(
        w,
        "| dtype | compressed-KV / window entry ({hd}) | index-K entry ({ihd}) |"
    );
    let _ = writeln!(w, "| --- | ---: | ---: |");
    for dt in EntryDtype::ALL {
        let kv = layout(cfg, page_tokens, dt, EntryDtype::F32)?.kv_entry_bytes();
        let _ = writeln!(w, "| {dt} | {kv} | {} |", dt.entry_bytes(ihd));
    }
    let _ = writeln!(
        w,
        "\nBytes per page (all layers) and per request state slot:\n"
    );
    let _ = writeln!(
        w,
        "| kv dtype | index-K dtype | CSA layer: comp-KV + index-K per page | HCA layer per page | page (all layers) | state slot | prefix snapshot per cut | fingerprint |"
    );
    let _ = writeln!(w, "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |");
    for kv in EntryDtype::ALL {
        for ik in EntryDtype::ALL {
            let l = layout(cfg, page_tokens, kv, ik)?;
            let per_layer = |k: LayerKind| -> String {
                let Some(li) = l.layers.iter().position(|x| x.kind == k) else {
                    return "-".into();
                };
                let x = &l.layers[li];
                let comp = x.comp_entries_per_page * l.kv_entry_bytes();
                match k {
                    LayerKind::Csa => format!(
                        "{comp} + {}",
                        x.index_entries_per_page * ik.entry_bytes(ihd)
                    ),
                    _ => comp.to_string(),
                }
            };
            let _ = writeln!(
                w,
                "| {kv} | {ik} | {} | {} | {} | {} | {} | `{}` |",
                per_layer(LayerKind::Csa),
                per_layer(LayerKind::Hca),
                l.page_bytes,
                l.state_bytes,
                l.cut_snapshot_bytes(),
                l.fingerprint()
            );
        }
    }
    Ok(s)
}

fn layout(
    cfg: &ModelConfig,
    page_tokens: usize,
    kv_dtype: EntryDtype,
    index_k_dtype: EntryDtype,
) -> Result<KvLayout, LayoutError> {
    let spec = KvLayoutSpec {
        page_tokens,
        kv_dtype,
        index_k_dtype,
        ..KvLayoutSpec::default_for(cfg)
    };
    KvLayout::new(cfg, spec)
}
