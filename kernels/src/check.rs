//! GPU-versus-CPU check on reference fixtures (`pdserve gpu-check`, scripts/gpu-check.sh):
//! prefill + decode logits of the CUDA backend against the fp32 CPU engine, per-row
//! relative error and greedy tokens, plus a prefill-on-GPU / decode-on-CPU KV transfer.

use crate::CudaBackend;
use pdserve_engine::backend::Backend;
use pdserve_engine::generate::{logits_prefill_decode, prefill};
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::{CpuBackend, Engine, EngineError, ForwardItem, Logits, PoolSize};
use std::path::{Path, PathBuf};

/// Per-row relative error bound of bf16 GPU logits against the fp32 CPU engine.
pub const REL_TOL: f64 = 2e-2;

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("fixture {dir}: {detail}")]
    Fixture { dir: PathBuf, detail: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// One line of the table.
#[derive(Debug, Clone)]
pub struct CheckRow {
    pub name: String,
    pub rows: usize,
    pub max_rel_err: f64,
    pub greedy_same: usize,
    pub pass: bool,
}

impl std::fmt::Display for CheckRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:<44} {:>5} {:>12.3e} {:>9} {}",
            self.name,
            self.rows,
            self.max_rel_err,
            format!("{}/{}", self.greedy_same, self.rows),
            if self.pass { "PASS" } else { "FAIL" }
        )
    }
}

pub fn header() -> String {
    format!(
        "{:<44} {:>5} {:>12} {:>9} result",
        "check", "rows", "max rel err", "greedy"
    )
}

struct Fixture {
    tokens: Vec<u32>,
    prefill_lens: Vec<usize>,
}

fn load_fixture(dir: &Path) -> Result<Fixture, CheckError> {
    let fx_err = |detail: String| CheckError::Fixture {
        dir: dir.to_path_buf(),
        detail,
    };
    let bytes = std::fs::read(dir.join("expected.safetensors")).map_err(|e| fx_err(e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| fx_err(e.to_string()))?;
    let toks = st.tensor("tokens").map_err(|e| fx_err(e.to_string()))?;
    let tokens = toks
        .data()
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            i64::from_le_bytes(b) as u32
        })
        .collect();
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("meta.json")).map_err(|e| fx_err(e.to_string()))?,
    )
    .map_err(|e| fx_err(e.to_string()))?;
    let prefill_lens = meta["prefill_lens"]
        .as_array()
        .ok_or_else(|| fx_err("meta.json has no prefill_lens".into()))?
        .iter()
        .filter_map(|v| v.as_u64().map(|v| v as usize))
        .collect();
    Ok(Fixture {
        tokens,
        prefill_lens,
    })
}

fn spec(dir: &Path, kv: EntryDtype) -> Result<KvLayoutSpec, CheckError> {
    let cfg = pdserve_engine::config::ModelConfig::from_model_dir(dir)
        .map_err(EngineError::from)?;
    let mut s = KvLayoutSpec::default_for(&cfg);
    s.kv_dtype = kv;
    s.index_k_dtype = kv;
    Ok(s)
}

const POOL: PoolSize = PoolSize {
    pages: 64,
    states: 8,
};

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, x)| if *x > v[b] { i } else { b })
}

fn compare(name: String, got: &[Vec<f32>], want: &[Vec<f32>]) -> CheckRow {
    let max_rel_err = got
        .iter()
        .zip(want)
        .map(|(g, w)| rel_err(g, w))
        .fold(0.0, f64::max);
    let greedy_same = got
        .iter()
        .zip(want)
        .filter(|(g, w)| argmax(g) == argmax(w))
        .count();
    let rows = want.len();
    CheckRow {
        name,
        rows,
        max_rel_err,
        greedy_same,
        pass: got.len() == rows && max_rel_err < REL_TOL && greedy_same == rows,
    }
}

/// Prefill `k` tokens on `a`, move the sequence's KV to `b`, decode the rest there.
fn transfer_logits<A: Backend, B: Backend>(
    a: &mut Engine<A>,
    b: &mut Engine<B>,
    tokens: &[u32],
    k: usize,
) -> Result<Vec<Vec<f32>>, EngineError> {
    let mut seq = a.new_sequence()?;
    let mut rows = prefill(a, &mut seq, &tokens[..k], 0, Logits::All)?;
    let snap = a.export_sequence(&seq)?;
    a.release(seq)?;
    let mut seq = b.import_sequence(&snap)?;
    for t in &tokens[k..] {
        let out = b.forward(&mut [ForwardItem {
            seq: &mut seq,
            tokens: std::slice::from_ref(t),
            logits: Logits::Last,
        }])?;
        rows.extend(out.into_iter().map(|o| o.data));
    }
    b.release(seq)?;
    Ok(rows)
}

/// Run every check on fixture folder `dir` with CUDA device `ordinal`.
pub fn check_fixture(dir: &Path, ordinal: usize) -> Result<Vec<CheckRow>, Box<dyn std::error::Error>> {
    let fx = load_fixture(dir)?;
    let fname = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut out = Vec::new();
    for kv in [EntryDtype::F32, EntryDtype::Bf16] {
        let s = spec(dir, kv)?;
        let mut cpu = Engine::load(dir, CpuBackend, Some(s), POOL)?;
        let mut gpu = Engine::load(dir, CudaBackend::new(ordinal, None)?, Some(s), POOL)?;
        for &k in &fx.prefill_lens {
            let want = logits_prefill_decode(&mut cpu, &fx.tokens, k, 0)?;
            let got = logits_prefill_decode(&mut gpu, &fx.tokens, k, 0)?;
            out.push(compare(format!("{fname} kv={kv} prefill {k} + decode"), &got, &want));
        }
        let k = fx.prefill_lens[0];
        let want = logits_prefill_decode(&mut cpu, &fx.tokens, k, 0)?;
        let chunked = logits_prefill_decode(&mut gpu, &fx.tokens, k, 7)?;
        out.push(compare(format!("{fname} kv={kv} prefill {k} chunks of 7"), &chunked, &want));
        let moved = transfer_logits(&mut gpu, &mut cpu, &fx.tokens, k)?;
        out.push(compare(format!("{fname} kv={kv} prefill {k} GPU -> decode CPU"), &moved, &want));
    }
    Ok(out)
}
