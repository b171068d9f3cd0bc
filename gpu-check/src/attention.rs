//! Each attention kernel against the one it replaced (`CudaBackend::set_attention_kernel`),
//! on the same inputs: the embedded model (64 window keys, compressed entries all visible
//! and selected, 4 heads of 64 channels), fp32 weights. The split-key kernel against the
//! one-block-per-row kernel for each KV entry type; the tensor-core kernel against the
//! split-key one for the entry types it takes (bf16, fp8): hi + lo products under fp32
//! weights (gated: an indexing fault would show far above the bound), and, for
//! information, the serving kernel's bf16 products under bf16 weights (the picks group
//! gates that setting). Prefill takes one split per row
//! over several tiles; decode at batch 1 splits the keys and combines, so both paths meet
//! the old kernel.

use crate::check::{bitwise_row, compare, CheckRow, PROMPTS, REL_TOL};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::generate::logits_prefill_decode;
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::{Engine, ForwardItem, Logits, PoolSize};
use pdserve_kernels::{AttentionKernel, CudaBackend, KeyConversion, WeightDtype};
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

pub(crate) type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// One row per pair of kernels and KV entry type: every prompt prefilled, then decoded
/// teacher-forced to 96 tokens, by both kernels.
pub fn check_attention_ab(ordinal: usize) -> AnyResult<Vec<CheckRow>> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let tok = Tokenizer::from_model_dir(&dir)?.ok_or("the embedded model has no tokenizer")?;
    let cfg = ModelConfig::from_model_dir(&dir)?;
    let (f32w, bf16w) = (WeightDtype::F32, WeightDtype::Bf16);
    let pairs = [
        (
            AttentionKernel::Split,
            AttentionKernel::Reference,
            EntryDtype::F32,
            f32w,
        ),
        (
            AttentionKernel::Split,
            AttentionKernel::Reference,
            EntryDtype::Bf16,
            f32w,
        ),
        (
            AttentionKernel::Split,
            AttentionKernel::Reference,
            EntryDtype::Fp8E4m3,
            f32w,
        ),
        (
            AttentionKernel::TensorCores,
            AttentionKernel::Split,
            EntryDtype::Bf16,
            f32w,
        ),
        (
            AttentionKernel::TensorCores,
            AttentionKernel::Split,
            EntryDtype::Fp8E4m3,
            f32w,
        ),
        (
            AttentionKernel::Auto,
            AttentionKernel::Split,
            EntryDtype::Bf16,
            bf16w,
        ),
    ];
    let mut out = Vec::new();
    for (new_kernel, old_kernel, kv, weights) in pairs {
        let mut spec = KvLayoutSpec::default_for(&cfg);
        spec.kv_dtype = kv;
        let engine = |kernel: AttentionKernel| -> AnyResult<Engine<CudaBackend>> {
            let mut b = CudaBackend::with_weights(ordinal, None, weights)?;
            b.set_attention_kernel(kernel);
            Ok(Engine::load(&dir, b, Some(spec), POOL)?)
        };
        let (mut old, mut new) = (engine(old_kernel)?, engine(new_kernel)?);
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for prompt in PROMPTS {
            let once = tok.encode(prompt)?;
            // Teacher-forced continuation: the prompt's own tokens again, so that decode
            // runs past the 64-key window.
            let ids = repeated(&once, 96);
            let k = once.len();
            want.extend(logits_prefill_decode(&mut old, &ids, k, 0)?);
            got.extend(logits_prefill_decode(&mut new, &ids, k, 0)?);
        }
        let (name, w) = match (new_kernel, weights) {
            (AttentionKernel::TensorCores, _) => {
                ("tensor-core attention (hi+lo) == split-key", "f32")
            }
            (AttentionKernel::Auto, _) => {
                ("tensor-core attention (bf16 products) vs split-key", "bf16")
            }
            _ => ("split-key attention == old kernel", "f32"),
        };
        let mut row = compare(
            format!("embedded w={w} kv={kv} {name}"),
            &got,
            &want,
            if kv == EntryDtype::F32 {
                AB_TOL
            } else {
                REL_TOL
            },
        );
        // bf16 products move logits as bf16 weights do, picks near a tie with them: the
        // picks group gates that setting (every jump traced to a flipped pick).
        row.gate = weights == WeightDtype::F32;
        out.push(row);
    }
    out.extend(check_bf16_io(ordinal, &dir, &tok, &cfg)?);
    out.push(check_key_conversion(ordinal, &dir, &tok, &cfg)?);
    out.extend(crate::attention_wgmma::check_wgmma(ordinal)?);
    Ok(out)
}

/// `once` repeated whole until it holds at least `len` tokens (once at least; none when
/// `once` is empty).
fn repeated(once: &[u32], len: usize) -> Vec<u32> {
    once.repeat(len.div_ceil(once.len().max(1)).max(1))
}

/// Prompt length of the bf16-io rows: more rows than the H200 has SMs (132), so that one
/// split covers each row's keys (the direct launch, as a prefill of thousands of tokens).
const DIRECT_PROMPT: usize = 200;
/// Sequences of the bf16-io decode row: a decode step of this many rows takes the direct
/// launch too (as batch 256 of the bench model does).
const DIRECT_BATCH: usize = 160;
/// Its decode steps, all sequences at once.
const DIRECT_STEPS: usize = 4;
/// Pages and state slots enough for the decode row's sequences.
const BATCH_POOL: PoolSize = PoolSize {
    pages: 4 * DIRECT_BATCH,
    states: DIRECT_BATCH + 8,
};

/// The direct tensor-core launch with bf16 queries and output (`set_attention_bf16_io`)
/// against the same launch reading fp32 queries and writing fp32 output, under bf16
/// weights, for bf16 and fp8 entries: the same norms, rope products and roundings in other
/// kernels, so the logits must be bitwise equal. Prefills of `DIRECT_PROMPT` tokens, then
/// single decode steps (the split plan in both); and `DIRECT_BATCH` sequences decoded
/// together (eager steps of `DIRECT_BATCH` rows: the direct plan).
fn check_bf16_io(
    ordinal: usize,
    dir: &std::path::Path,
    tok: &Tokenizer,
    cfg: &ModelConfig,
) -> AnyResult<Vec<CheckRow>> {
    let mut out = Vec::new();
    for kv in [EntryDtype::Bf16, EntryDtype::Fp8E4m3] {
        let mut spec = KvLayoutSpec::default_for(cfg);
        spec.kv_dtype = kv;
        let name = format!("embedded w=bf16 kv={kv} attention bf16 q/out == fp32 q/out");
        out.extend(bitwise_ab(
            tok,
            &name,
            DIRECT_PROMPT,
            16,
            |bf16_io, pool| {
                let mut b = CudaBackend::with_weights(ordinal, None, WeightDtype::Bf16)?;
                b.set_attention_bf16_io(bf16_io);
                Ok(Engine::load(dir, b, Some(spec), pool)?)
            },
        )?);
    }
    Ok(out)
}

/// Prefill chunk of the key-conversion row: each chunk's rows read the window ring the
/// chunk before left and the compressed entries of all its pages.
const KEY_CHUNK: usize = 48;

/// fp8 keys converted to bf16 once per batch (`KeyConversion::Once`) against the
/// tensor-core kernel converting them per tile (`PerTile`), under bf16 weights: the same
/// arithmetic, so the logits must be bitwise equal. Prompts of `DIRECT_PROMPT` tokens
/// prefilled in chunks of [`KEY_CHUNK`], then 16 eager decode steps (converted too: one
/// row, the split plan).
fn check_key_conversion(
    ordinal: usize,
    dir: &std::path::Path,
    tok: &Tokenizer,
    cfg: &ModelConfig,
) -> AnyResult<CheckRow> {
    let spec = KvLayoutSpec {
        kv_dtype: EntryDtype::Fp8E4m3,
        ..KvLayoutSpec::default_for(cfg)
    };
    let engine = |conversion| -> AnyResult<Engine<CudaBackend>> {
        let mut b = CudaBackend::with_weights(ordinal, None, WeightDtype::Bf16)?;
        b.set_key_conversion(conversion);
        Ok(Engine::load(dir, b, Some(spec), POOL)?)
    };
    let (mut old, mut new) = (
        engine(KeyConversion::PerTile)?,
        engine(KeyConversion::Once)?,
    );
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for p in PROMPTS {
        let ids = repeated(&tok.encode(p)?, DIRECT_PROMPT + 16);
        want.extend(logits_prefill_decode(
            &mut old,
            &ids,
            DIRECT_PROMPT,
            KEY_CHUNK,
        )?);
        got.extend(logits_prefill_decode(
            &mut new,
            &ids,
            DIRECT_PROMPT,
            KEY_CHUNK,
        )?);
    }
    let name = format!(
        "embedded w=bf16 kv=fp8 keys converted once == per tile, prefill {DIRECT_PROMPT} in \
         chunks of {KEY_CHUNK}, decode 16"
    );
    Ok(bitwise_row(&name, &got, &want))
}

/// Two settings of one backend that must give the same bits, `engine(false, pool)` the
/// old and `engine(true, pool)` the new: every test prompt repeated to `prompt + steps`
/// tokens, prefilled `prompt` (every position's logits) and decoded teacher-forced; then
/// `DIRECT_BATCH` short prompts decoded together. Rows "`name`, prefill `prompt`" and
/// "`name`, decode batch `DIRECT_BATCH`", with the error figures of the other rows,
/// passing only when bitwise equal.
pub(crate) fn bitwise_ab(
    tok: &Tokenizer,
    name: &str,
    prompt: usize,
    steps: usize,
    engine: impl Fn(bool, PoolSize) -> AnyResult<Engine<CudaBackend>>,
) -> AnyResult<Vec<CheckRow>> {
    let (mut old, mut new) = (engine(false, POOL)?, engine(true, POOL)?);
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for p in PROMPTS {
        let ids = repeated(&tok.encode(p)?, prompt + steps);
        want.extend(logits_prefill_decode(&mut old, &ids, prompt, 0)?);
        got.extend(logits_prefill_decode(&mut new, &ids, prompt, 0)?);
    }
    let mut out = vec![bitwise_row(
        &format!("{name}, prefill {prompt}"),
        &got,
        &want,
    )];
    drop((old, new));
    let prompts = batch_prompts(tok)?;
    let want = batched_steps(&mut engine(false, BATCH_POOL)?, &prompts)?;
    let got = batched_steps(&mut engine(true, BATCH_POOL)?, &prompts)?;
    let what = format!("{name}, decode batch {DIRECT_BATCH}");
    out.push(bitwise_row(&what, &got, &want));
    Ok(out)
}

/// `DIRECT_BATCH` prompts of 6 to 13 tokens: the test prompts' tokens, rotated and cut.
fn batch_prompts(tok: &Tokenizer) -> AnyResult<Vec<Vec<u32>>> {
    let mut all = Vec::new();
    for prompt in PROMPTS {
        all.extend(tok.encode(prompt)?);
    }
    if all.is_empty() {
        return Err("the test prompts encode to no tokens".into());
    }
    Ok((0..DIRECT_BATCH)
        .map(|i| {
            (0..6 + i % 8)
                .map(|j| all[(i * 7 + j) % all.len()])
                .collect()
        })
        .collect())
}

/// Each prompt prefilled alone, then `DIRECT_STEPS` decode steps of every sequence at once
/// (each feeding its prompt's tokens again): the steps' logits, one row per sequence.
fn batched_steps(
    engine: &mut Engine<CudaBackend>,
    prompts: &[Vec<u32>],
) -> AnyResult<Vec<Vec<f32>>> {
    let mut seqs = Vec::with_capacity(prompts.len());
    for p in prompts {
        let mut seq = engine.new_sequence()?;
        engine.forward(&mut [ForwardItem {
            seq: &mut seq,
            tokens: p,
            logits: Logits::Last,
        }])?;
        seqs.push(seq);
    }
    let mut rows = Vec::new();
    for step in 0..DIRECT_STEPS {
        let toks: Vec<u32> = prompts.iter().map(|p| p[step % p.len()]).collect();
        let mut items: Vec<ForwardItem<'_>> = seqs
            .iter_mut()
            .zip(&toks)
            .map(|(seq, t)| ForwardItem {
                seq,
                tokens: std::slice::from_ref(t),
                logits: Logits::Last,
            })
            .collect();
        rows.extend(engine.forward(&mut items)?.into_iter().map(|o| o.data));
    }
    for seq in seqs {
        engine.release(seq)?;
    }
    Ok(rows)
}
