//! docs/kv-layout.md's tables are generated from KvLayout for V4-Flash's real
//! dimensions (the config defaults). `PDSERVE_UPDATE_DOCS=1` rewrites them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{layout_table, EntryDtype, KvLayout, KvLayoutSpec};
use std::path::Path;

const BEGIN: &str = "<!-- BEGIN GENERATED: kv_layout_doc.rs -->\n";
const END: &str = "<!-- END GENERATED -->";

fn v4_flash() -> ModelConfig {
    ModelConfig::from_json_str(r#"{"model_type": "deepseek_v4"}"#).unwrap()
}

#[test]
fn v4_flash_figures_match_the_serving_systems() {
    let cfg = v4_flash();
    assert_eq!(
        (cfg.head_dim, cfg.index_head_dim, cfg.layer_types.len()),
        (512, 128, 43)
    );
    let spec = KvLayoutSpec {
        page_tokens: 256,
        kv_dtype: EntryDtype::Bf16,
        index_k_dtype: EntryDtype::Fp8E4m3,
        ..KvLayoutSpec::default_for(&cfg)
    };
    let l = KvLayout::new(&cfg, spec).unwrap();
    let csa = l.layers.iter().find(|x| x.rate == 4).unwrap();
    // BRIEF: fp8 index-K = 132 B/entry, 64 entries per 256-token page = 8192 B keys + 256 B scales.
    assert_eq!(EntryDtype::Fp8E4m3.entry_bytes(128), 132);
    assert_eq!(EntryDtype::Bf16.entry_bytes(128), 256);
    assert_eq!(csa.index_entries_per_page, 64);
    assert_eq!(csa.index_scale_offset - csa.index_page_offset, 8192);
    // bf16 compressed-KV: 1024 B per entry.
    assert_eq!(EntryDtype::Bf16.entry_bytes(512), 1024);
    // A prefix-cache snapshot keeps the windows (128 x 512 bf16 per layer) and the CSA
    // rings (8 rows of 2 x 1024 + 8 rows of 2 x 256 fp32), not the HCA rings.
    let want = 43 * 128 * 512 * 2 + 20 * (8 * 2048 * 4 + 8 * 512 * 4);
    assert_eq!(l.cut_snapshot_bytes(), want);
    let ranges = l.state_ranges_live_at_cut();
    assert!(ranges.windows(2).all(|w| w[0].end < w[1].start));
    assert!(ranges.last().unwrap().end <= l.state_bytes);

    // fp8 compressed KV in FlashMLA's V4 layout: 448 e4m3 + 64 bf16 (576 B rows), then
    // 7 scale bytes + 1 pad per entry = 584 B; an HCA page (2 entries) is 1152 + 16 B.
    let fp8 = KvLayout::new(
        &cfg,
        KvLayoutSpec {
            kv_dtype: EntryDtype::Fp8E4m3,
            ..spec
        },
    )
    .unwrap();
    assert_eq!(fp8.kv_entry_bytes(), 584);
    let hca = fp8.layers.iter().find(|x| x.rate == 128).unwrap();
    assert_eq!(hca.comp_scale_offset - hca.comp_page_offset, 2 * 576);
    let csa = fp8.layers.iter().find(|x| x.rate == 4).unwrap();
    assert_eq!(csa.comp_scale_offset - csa.comp_page_offset, 64 * 576);
    assert_eq!(csa.index_page_offset, csa.comp_scale_offset + 64 * 8);
    // Windows hold the same entries: 128 x 584 B per layer in a prefix snapshot.
    let want = 43 * 128 * 584 + 20 * (8 * 2048 * 4 + 8 * 512 * 4);
    assert_eq!(fp8.cut_snapshot_bytes(), want);
}

#[test]
fn docs_table_is_current() {
    let table = layout_table::markdown(&v4_flash(), 256).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/kv-layout.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let start = doc.find(BEGIN).expect("begin marker") + BEGIN.len();
    let end = doc.find(END).expect("end marker");
    if std::env::var_os("PDSERVE_UPDATE_DOCS").is_some() {
        let new = format!("{}{table}{}", &doc[..start], &doc[end..]);
        std::fs::write(&path, new).unwrap();
        return;
    }
    assert!(
        doc[start..end] == table,
        "docs/kv-layout.md is stale: run `PDSERVE_UPDATE_DOCS=1 cargo test -p pdserve-engine --test kv_layout_doc`\n{table}"
    );
}
