//! The split-key decode attention against the one-block-per-row kernel it replaced
//! (`CudaBackend::set_reference_attention`), on the same inputs: the embedded model (64
//! window keys, compressed entries all visible and selected, 4 heads of 64 channels),
//! fp32 weights, each KV entry type. Prefill takes one split per row over several tiles;
//! decode at batch 1 splits the keys and combines, so both paths meet the old kernel.

use crate::check::{compare, CheckRow, PROMPTS, REL_TOL};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::generate::logits_prefill_decode;
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::{Engine, PoolSize};
use pdserve_kernels::{CudaBackend, WeightDtype};
use pdserve_tokenizer::Tokenizer;

/// Both kernels compute in fp32 and differ only in summation order: the bound with fp32
/// entries. With bf16 or fp8 entries an output one fp32 ulp apart can round a later stored
/// entry (this forward's keys, the compressors' pooled entries, index-K) to the
/// neighbouring value, and a pick near a tie can change: those rows take the bound of the
/// GPU-versus-CPU rows with such entries ([`REL_TOL`]), the greedy tokens still all equal.
pub const AB_TOL: f64 = 1e-5;

const POOL: PoolSize = PoolSize {
    pages: 64,
    states: 8,
};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// One row per KV entry type: every prompt prefilled, then decoded teacher-forced to 96
/// tokens, by both kernels.
pub fn check_attention_ab(ordinal: usize) -> AnyResult<Vec<CheckRow>> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let tok = Tokenizer::from_model_dir(&dir)?.ok_or("the embedded model has no tokenizer")?;
    let cfg = ModelConfig::from_model_dir(&dir)?;
    let mut out = Vec::new();
    for kv in [EntryDtype::F32, EntryDtype::Bf16, EntryDtype::Fp8E4m3] {
        let mut spec = KvLayoutSpec::default_for(&cfg);
        spec.kv_dtype = kv;
        let engine = |reference: bool| -> AnyResult<Engine<CudaBackend>> {
            let mut b = CudaBackend::with_weights(ordinal, None, WeightDtype::F32)?;
            b.set_reference_attention(reference);
            Ok(Engine::load(&dir, b, Some(spec), POOL)?)
        };
        let (mut old, mut new) = (engine(true)?, engine(false)?);
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for prompt in PROMPTS {
            let mut ids = tok.encode(prompt)?;
            // Teacher-forced continuation: the prompt's own tokens again, so that decode
            // runs past the 64-key window.
            let again = ids.clone();
            while ids.len() < 96 {
                ids.extend(&again);
            }
            let k = again.len();
            want.extend(logits_prefill_decode(&mut old, &ids, k, 0)?);
            got.extend(logits_prefill_decode(&mut new, &ids, k, 0)?);
        }
        out.push(compare(
            format!("embedded w=f32 kv={kv} split-key attention == old kernel"),
            &got,
            &want,
            if kv == EntryDtype::F32 {
                AB_TOL
            } else {
                REL_TOL
            },
        ));
    }
    Ok(out)
}
