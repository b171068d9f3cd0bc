//! Fixture loading shared by the parity tests.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

pub mod released;

use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::{CpuBackend, Engine, PoolSize};
use std::path::{Path, PathBuf};

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

pub struct Fixture {
    pub name: String,
    pub dir: PathBuf,
    pub tokens: Vec<u32>,
    /// `[n][vocab]` one-shot reference logits.
    pub logits: Vec<Vec<f32>>,
    pub prefill_lens: Vec<usize>,
}

pub fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures exists")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("expected.safetensors").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(
        !names.is_empty(),
        "no fixtures found under {}",
        fixtures_dir().display()
    );
    names
}

pub fn load_fixture(name: &str) -> Fixture {
    let dir = fixtures_dir().join(name);
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let toks = st.tensor("tokens").unwrap();
    let tokens: Vec<u32> = toks
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let lg = st.tensor("logits").unwrap();
    let vocab = lg.shape()[1];
    let flat: Vec<f32> = lg
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let logits = flat.chunks(vocab).map(<[f32]>::to_vec).collect();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let prefill_lens = meta["prefill_lens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    Fixture {
        name: name.to_string(),
        dir,
        tokens,
        logits,
        prefill_lens,
    }
}

pub fn engine(dir: &Path, index_k: EntryDtype, page_tokens: Option<usize>) -> Engine<CpuBackend> {
    let cfg = pdserve_engine::config::ModelConfig::from_model_dir(dir).unwrap();
    let mut spec = KvLayoutSpec::default_for(&cfg);
    spec.index_k_dtype = index_k;
    if let Some(p) = page_tokens {
        spec.page_tokens = p;
    }
    Engine::load(
        dir,
        CpuBackend,
        Some(spec),
        PoolSize {
            pages: 256,
            states: 16,
        },
    )
    .unwrap()
}

/// Relative L2 error of one row.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Largest per-row relative error and the row where it occurs.
pub fn max_rel_err(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f64, usize) {
    assert_eq!(got.len(), want.len(), "row count");
    got.iter()
        .zip(want)
        .enumerate()
        .map(|(i, (g, w))| (rel_err(g, w), i))
        .fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a })
}

/// Smallest page size the fixture's compress rates allow (many cut points).
pub fn smallest_page_tokens(dir: &Path) -> usize {
    let cfg = pdserve_engine::config::ModelConfig::from_model_dir(dir).unwrap();
    cfg.layer_types
        .iter()
        .filter_map(|k| cfg.compress_rate(*k))
        .fold(1, |a, r| {
            let g = (1..=a.min(r))
                .rev()
                .find(|d| a % d == 0 && r % d == 0)
                .unwrap();
            a / g * r
        })
}

/// Engine with a chosen index-K dtype, page size and pool size.
pub fn engine_sized(
    dir: &Path,
    index_k: EntryDtype,
    page_tokens: usize,
    pages: usize,
) -> Engine<CpuBackend> {
    engine_dtypes(dir, EntryDtype::F32, index_k, page_tokens, pages)
}

/// Engine with chosen KV and index-K dtypes, page size and pool size.
pub fn engine_dtypes(
    dir: &Path,
    kv: EntryDtype,
    index_k: EntryDtype,
    page_tokens: usize,
    pages: usize,
) -> Engine<CpuBackend> {
    let cfg = pdserve_engine::config::ModelConfig::from_model_dir(dir).unwrap();
    let mut spec = KvLayoutSpec::default_for(&cfg);
    spec.kv_dtype = kv;
    spec.index_k_dtype = index_k;
    spec.page_tokens = page_tokens;
    Engine::load(dir, CpuBackend, Some(spec), PoolSize { pages, states: 16 }).unwrap()
}
