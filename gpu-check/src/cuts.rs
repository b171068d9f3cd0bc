//! The states a forward leaves at cuts inside it (`Engine::forward_with_cuts`, the prefix
//! cache's page boundaries: the cut plan's window stores and compressor-ring writes, one
//! launch per layer for all cuts, and their one-copy read-back) against the CPU engine's,
//! on every fixture: fp32 weights and fp32 KV, so every live byte of a state slot is an
//! fp32 value (sliding windows, compressor and indexer rings) and the two differ only in
//! summation order. The CPU engine's cut states equal, byte for byte, those of forwards
//! ending at the cuts (`engine/tests/kv_cache.rs`).

use crate::check::{load_fixture, rel_err, CheckRow, REL_TOL_F32};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::{CpuBackend, Engine, ForwardItem, Logits, PoolSize};
use pdserve_kernels::{CudaBackend, WeightDtype};
use std::path::Path;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const POOL: PoolSize = PoolSize {
    pages: 64,
    states: 32,
};

/// The smallest page every compression rate of the model divides.
fn smallest_page(cfg: &ModelConfig) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    cfg.layer_types
        .iter()
        .filter_map(|k| cfg.compress_rate(*k))
        .fold(1, |a, r| a / gcd(a, r) * r)
}

/// The live state bytes at each cut as fp32 values.
fn cut_states<B: pdserve_engine::backend::Backend>(
    eng: &mut Engine<B>,
    tokens: &[u32],
    cuts: &[usize],
) -> AnyResult<Vec<Vec<f32>>> {
    let mut seq = eng.new_sequence()?;
    let item = ForwardItem {
        seq: &mut seq,
        tokens,
        logits: Logits::Last,
    };
    let out = eng.forward_with_cuts(item, cuts);
    eng.release(seq)?;
    let (_, states) = out?;
    Ok(states
        .iter()
        .map(|s| {
            s.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect())
}

/// One row per fixture whose prompt holds a cut the rings reach: each cut's live state
/// on the GPU within the fp32 bound of the CPU engine's (rows: cuts; greedy column: cuts
/// within the bound). `None` where no cut fits the fixture's prompt.
pub fn check_cuts(dir: &Path, ordinal: usize) -> AnyResult<Option<CheckRow>> {
    let fx = load_fixture(dir)?;
    let cfg = ModelConfig::from_model_dir(dir)?;
    let mut spec = KvLayoutSpec::default_for(&cfg);
    spec.kv_dtype = EntryDtype::F32;
    spec.index_k_dtype = EntryDtype::F32;
    spec.page_tokens = smallest_page(&cfg);
    let mut cpu = Engine::load(dir, CpuBackend, Some(spec), POOL)?;
    let gpu_b = CudaBackend::with_weights(ordinal, None, WeightDtype::F32)?;
    let mut gpu = Engine::load(dir, gpu_b, Some(spec), POOL)?;
    let (span, n) = (cpu.cut_span(), fx.tokens.len());
    let cuts: Vec<usize> = (1..)
        .map(|k| k * spec.page_tokens)
        .take_while(|&c| c < n)
        .filter(|&c| c >= span)
        .take(POOL.states - 2)
        .collect();
    if cuts.is_empty() {
        return Ok(None);
    }
    let want = cut_states(&mut cpu, &fx.tokens, &cuts)?;
    let got = cut_states(&mut gpu, &fx.tokens, &cuts)?;
    let errs: Vec<f64> = got
        .iter()
        .zip(&want)
        .map(|(g, w)| match g.len() == w.len() {
            true => rel_err(g, w),
            false => f64::INFINITY,
        })
        .collect();
    let (max_rel_err, worst_row) =
        errs.iter()
            .enumerate()
            .fold((0.0, 0), |a, (i, &e)| if e > a.0 { (e, i) } else { a });
    let within = errs.iter().filter(|&&e| e < REL_TOL_F32).count();
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(Some(CheckRow {
        name: format!("{name} w=f32 kv=f32 cut states (page {})", spec.page_tokens),
        rows: cuts.len(),
        max_rel_err,
        worst_row,
        greedy_same: within,
        near_ties: 0,
        pass: got.len() == cuts.len() && within == cuts.len(),
        gate: true,
    }))
}
