//! The wgmma attention kernel (`k_attention_wgmma`, Hopper, head_dim 512) against the
//! `mma.sync` kernel it replaced, on the same random model: the embedded model's layers
//! (sliding, compressed-sparse and heavily-compressed attention) at the V4 models' head
//! shape (64 heads of 512 channels, 64 rope), a 128-key window and 64 indexer picks.
//!
//! - Rows whose keys fit one tile of both kernels (32 keys: positions up to 24) must give
//!   the same bits: one tile is the same products summed in the same k-step order on both
//!   (the online softmax never rescales), so any layout, swizzle, fragment or epilogue
//!   fault shows there. Both the direct launch (bf16 queries and output) and, under
//!   `--deterministic`, the split launch's partials and combine.
//! - Longer rows (several tiles, partial tiles, the indexer's selection, prompts past the
//!   SM count and decode steps): the two kernels' online softmax steps over 64 and 32 keys
//!   round the probabilities against other running maxima, which a random bf16 model
//!   amplifies to ~1e-2 in the logits. Both are held to the fp32 split-key kernel: the
//!   wgmma kernel's median row error within twice the mma.sync kernel's.
//! - fp8 keys converted to bf16 once per batch against per tile, on the wgmma kernel:
//!   bitwise.

use crate::check::{argmax, bitwise_row, decode_logits, rel_err, CheckRow};
use crate::deepseek::{bit_errors, quantile, row};
use crate::stored::model_logits;
use pdserve_engine::config::ModelConfig;
use pdserve_engine::generate::prefill;
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::model::weights::ModelWeights;
use pdserve_engine::{Engine, Logits, PoolSize};
use pdserve_kernels::{AttentionKernel, CudaBackend, KeyConversion, WeightDtype};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// How far the wgmma kernel's median row error to the split-key kernel may exceed the
/// mma.sync kernel's (the same roundings at another tile size).
const MEDIAN_RATIO: f64 = 2.0;
/// Share of rows whose greedy token must agree with the split-key kernel's (a flipped
/// indexer pick near a tie may move a few).
const GREEDY_SHARE: f64 = 0.9;
/// Prompt lengths of the one-tile rows, decoded [`SHORT_STEPS`] steps together: the last
/// position is 24 (25 window keys and 6 compressed entries at rate 4).
const SHORT_PROMPTS: [usize; 4] = [6, 11, 16, 19];
const SHORT_STEPS: usize = 5;

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
    (kernel, deterministic, conversion): (AttentionKernel, bool, KeyConversion),
) -> AnyResult<Engine<CudaBackend>> {
    let mut backend = CudaBackend::with_weights(ordinal, None, WeightDtype::Bf16)?;
    backend.set_attention_kernel(kernel);
    backend.set_deterministic(deterministic);
    backend.set_key_conversion(conversion);
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

/// Every position's logits of the [`SHORT_PROMPTS`], then [`SHORT_STEPS`] decode steps of
/// all of them together.
fn short_logits(e: &mut Engine<CudaBackend>) -> AnyResult<Vec<Vec<f32>>> {
    let vocab = e.config().vocab_size;
    let (mut out, mut seqs) = (Vec::new(), Vec::new());
    for (i, &len) in SHORT_PROMPTS.iter().enumerate() {
        let p: Vec<u32> = (0..len)
            .map(|t| ((t * 31 + i * 97) % vocab) as u32)
            .collect();
        let mut s = e.new_sequence()?;
        out.extend(prefill(e, &mut s, &p, 0, Logits::All)?);
        seqs.push(s);
    }
    for step in 0..SHORT_STEPS {
        let toks: Vec<u32> = (0..seqs.len())
            .map(|i| ((i * 13 + step * 5) % vocab) as u32)
            .collect();
        out.extend(decode_logits(e, seqs.iter_mut(), &toks)?);
    }
    Ok(out)
}

/// Per KV entry type (bf16, fp8): the one-tile rows bitwise (direct launch, then the split
/// launch under `--deterministic`), and the long rows against the split-key kernel.
pub fn check_wgmma(ordinal: usize) -> AnyResult<Vec<CheckRow>> {
    let cfg = config()?;
    let mut out = Vec::new();
    for kv in [EntryDtype::Bf16, EntryDtype::Fp8E4m3] {
        let name = format!("V4-shape attention kv={kv} wgmma");
        let make = |kernel, deterministic| {
            engine(
                ordinal,
                &cfg,
                kv,
                (kernel, deterministic, KeyConversion::PerTile),
            )
        };
        let mut wgmma = make(AttentionKernel::Auto, false)?;
        if !wgmma.backend().gpu().wgmma() {
            out.push(info_row(format!(
                "{name}: not a Hopper GPU, wgmma not built"
            )));
            continue;
        }
        for deterministic in [false, true] {
            let got = short_logits(&mut make(AttentionKernel::Auto, deterministic)?)?;
            let want = short_logits(&mut make(AttentionKernel::MmaSync, deterministic)?)?;
            let vocab = want.first().map_or(1, Vec::len).max(1);
            let bits = bit_errors(&got.concat(), &want.concat(), vocab);
            let differ = bits.iter().filter(|&&e| e > 0.0).count();
            let errs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| rel_err(g, w)).collect();
            let launch = if deterministic { "split" } else { "direct" };
            let mut r = row(
                format!("{name} == mma.sync bitwise, one tile, {launch} ({differ} rows differ)"),
                &errs,
                differ == 0 && got.len() == want.len() && !errs.is_empty(),
            );
            r.greedy_same = errs.len() - differ;
            out.push(r);
        }
        let split = model_logits(&mut make(AttentionKernel::Split, false)?)?;
        let got = model_logits(&mut wgmma)?;
        let old = model_logits(&mut make(AttentionKernel::MmaSync, false)?)?;
        let errs: Vec<f64> = got.iter().zip(&split).map(|(g, w)| rel_err(g, w)).collect();
        let old_errs: Vec<f64> = old.iter().zip(&split).map(|(g, w)| rel_err(g, w)).collect();
        let greedy = got
            .iter()
            .zip(&split)
            .filter(|(g, w)| argmax(g) == argmax(w))
            .count();
        let (median, old_median) = (quantile(&errs, 0.5), quantile(&old_errs, 0.5));
        let mut r = row(
            format!("{name} vs split-key (median {median:.1e}; mma.sync {old_median:.1e})"),
            &errs,
            median <= MEDIAN_RATIO * old_median
                && greedy as f64 >= GREEDY_SHARE * errs.len() as f64,
        );
        r.greedy_same = greedy;
        out.push(r);
        if kv == EntryDtype::Fp8E4m3 {
            let once = (AttentionKernel::Auto, false, KeyConversion::Once);
            let converted = model_logits(&mut engine(ordinal, &cfg, kv, once)?)?;
            out.push(bitwise_row(
                &format!("{name}: keys converted once == per tile"),
                &converted,
                &got,
            ));
        }
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
