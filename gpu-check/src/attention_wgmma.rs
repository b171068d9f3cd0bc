//! The wgmma attention kernel (`k_attention_wgmma`, Hopper, head_dim 512) against the
//! `mma.sync` kernel it replaced, on the same random model: the embedded model's layers
//! (sliding, compressed-sparse and heavily-compressed attention) at the V4 models' head
//! shape (64 heads of 512 channels, 64 rope), a 128-key window and 64 indexer picks, so
//! that rows take several key tiles, partial tiles, the indexer's selection, the direct
//! launch with bf16 queries and output (prompts past the SM count) and the key splits with
//! their combine (shorter prompts, decode steps). Both kernels round the same queries and
//! probabilities to bf16 and sum in fp32 in different orders, so the logits sit within
//! rounding of each other, and never all bitwise equal (that would mean the wgmma kernel
//! did not run).

use crate::check::{argmax, rel_err, CheckRow};
use crate::deepseek::quantile;
use crate::stored::model_logits;
use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::model::weights::ModelWeights;
use pdserve_engine::{Engine, PoolSize};
use pdserve_kernels::{AttentionKernel, CudaBackend, WeightDtype};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Median row error the two kernels may differ by: rounding only (an indexing or layout
/// fault moves every row by ~1).
const MEDIAN_TOL: f64 = 1e-3;
/// Share of rows whose greedy token must agree (a flipped indexer pick near a tie may move
/// a few).
const GREEDY_SHARE: f64 = 0.9;

const POOL: PoolSize = PoolSize {
    pages: 256,
    states: 16,
};

/// The embedded model's config at the V4 attention shape.
fn config() -> AnyResult<ModelConfig> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    v["head_dim"] = 512.into();
    v["num_attention_heads"] = 64.into();
    v["qk_rope_head_dim"] = 64.into();
    v["partial_rotary_factor"] = 0.125.into();
    for part in ["main", "compress"] {
        v["rope_parameters"][part]["partial_rotary_factor"] = 0.125.into();
    }
    v["sliding_window"] = 128.into();
    v["index_topk"] = 64.into();
    v["index_head_dim"] = 128.into();
    Ok(ModelConfig::from_json_str(&v.to_string())?)
}

fn engine(
    ordinal: usize,
    cfg: &ModelConfig,
    kv: EntryDtype,
    kernel: AttentionKernel,
) -> AnyResult<Engine<CudaBackend>> {
    let mut backend = CudaBackend::with_weights(ordinal, None, WeightDtype::Bf16)?;
    backend.set_attention_kernel(kernel);
    let weights = ModelWeights::random(cfg, &backend, 7)?;
    let spec = KvLayoutSpec {
        kv_dtype: kv,
        ..KvLayoutSpec::default_for(cfg)
    };
    Ok(Engine::new(
        cfg.clone(),
        weights,
        backend,
        Some(spec),
        POOL,
    )?)
}

/// One row per KV entry type (bf16, fp8): 8 prompts of 20 to 279 tokens prefilled, then 6
/// decode steps of all 8, through the wgmma kernel and through mma.sync.
pub fn check_wgmma(ordinal: usize) -> AnyResult<Vec<CheckRow>> {
    let cfg = config()?;
    let mut out = Vec::new();
    for kv in [EntryDtype::Bf16, EntryDtype::Fp8E4m3] {
        let mut new = engine(ordinal, &cfg, kv, AttentionKernel::Auto)?;
        let name = format!("V4-shape attention kv={kv} wgmma vs mma.sync");
        if new.backend().gpu().arch != "compute_90" {
            out.push(info_row(format!(
                "{name}: not a Hopper GPU, wgmma not built"
            )));
            continue;
        }
        let got = model_logits(&mut new)?;
        let want = model_logits(&mut engine(ordinal, &cfg, kv, AttentionKernel::MmaSync)?)?;
        let errs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| rel_err(g, w)).collect();
        let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        let greedy = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| argmax(g) == argmax(w))
            .count();
        let (median, p90) = (quantile(&errs, 0.5), quantile(&errs, 0.9));
        let (worst_row, max_rel_err) = errs
            .iter()
            .copied()
            .enumerate()
            .fold((0, 0f64), |a, (i, e)| if e > a.1 { (i, e) } else { a });
        out.push(CheckRow {
            name: format!("{name} (median {median:.1e}, p90 {p90:.1e}, {differ} rows differ)"),
            rows: errs.len(),
            max_rel_err,
            worst_row,
            greedy_same: greedy,
            near_ties: 0,
            pass: median <= MEDIAN_TOL
                && greedy as f64 >= GREEDY_SHARE * errs.len() as f64
                && differ > 0,
            gate: true,
        });
    }
    Ok(out)
}

fn info_row(name: String) -> CheckRow {
    CheckRow {
        name,
        rows: 0,
        max_rel_err: 0.0,
        worst_row: 0,
        greedy_same: 0,
        near_ties: 0,
        pass: true,
        gate: false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use pdserve_engine::CpuBackend;

    #[test]
    fn the_check_model_has_the_v4_attention_shape_and_runs_on_the_cpu() {
        let cfg = config().unwrap();
        assert_eq!((cfg.head_dim, cfg.num_attention_heads), (512, 64));
        let weights = ModelWeights::random(&cfg, &CpuBackend, 7).unwrap();
        let mut e = Engine::new(cfg.clone(), weights, CpuBackend, None, POOL).unwrap();
        let mut s = e.new_sequence().unwrap();
        let logits = pdserve_engine::generate::prefill(
            &mut e,
            &mut s,
            &[3, 1, 4, 1, 5],
            0,
            pdserve_engine::Logits::Last,
        )
        .unwrap();
        assert!(logits.iter().flatten().all(|x| x.is_finite()));
    }
}
