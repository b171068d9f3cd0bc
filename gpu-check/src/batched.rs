//! Batched decode on the GPU against the CPU engine (`pdserve gpu-check --only batched`):
//! many sequences of different prompt lengths (spanning several pages), prefilled one by
//! one as the prefill server does, then decoded teacher-forced (every step feeds the
//! corpus's next token, so every run sees the same tokens) in three ways: all sequences in
//! one batch, in small batches, and one at a time. Each row's logits are compared with the
//! fp32 CPU engine's one-shot forward of the same tokens. A batch-dependent defect (padded
//! rows, per-row grids, page tables at batch > 1, the MoE's padded expert batches) shows as
//! a batched error distribution unlike the one-at-a-time one; rounding noise does not.
//!
//! With fp32 weights there is no rounding to amplify, so every row must match to fp32
//! noise at every batch size; with bf16 weights the distributions are compared, and each
//! row where the greedy token differs from the CPU's is listed with the CPU's top-2 margin.

use crate::check::{argmax, decode_logits, rel_err, CheckRow, REL_TOL, REL_TOL_F32};
use pdserve_engine::backend::Backend;
use pdserve_engine::generate::prefill;
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::{CpuBackend, Engine, Logits, PoolSize, Sequence};
use pdserve_kernels::{CudaBackend, GraphMode, WeightDtype};
use pdserve_tokenizer::Tokenizer;
use std::path::Path;

pub(crate) type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

pub(crate) const POOL: PoolSize = PoolSize {
    pages: 2048,
    states: 64,
};

/// Sizes of the small batches: below the MoE's padded-GEMM threshold (rows * k < experts)
/// on the embedded model, so they take the grouped path that batch 1 takes.
const SMALL_BATCH: usize = 6;

/// One teacher-forced sequence: `tokens[..prompt]` is prefilled, `tokens[prompt..]` decoded.
pub(crate) struct Case {
    pub tokens: Vec<u32>,
    pub prompt: usize,
}

/// The rows one forward ran for one case: `len` tokens from position `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub case: usize,
    pub start: usize,
    pub len: usize,
}

/// Called after every forward with the spans it ran, in row order.
pub(crate) type OnForward<'a> = dyn FnMut(&[Span]) -> AnyResult<()> + 'a;

/// How the GPU engine is set up for one group of rows.
#[derive(Clone, Copy)]
struct Setup {
    weights: WeightDtype,
    index_k: EntryDtype,
    mode: GraphMode,
    /// `--deterministic`: rows must then be bitwise independent of their batch.
    deterministic: bool,
}

impl Setup {
    fn label(&self) -> String {
        format!(
            "w={} ik={} {}{}",
            match self.weights {
                WeightDtype::Bf16 => "bf16",
                WeightDtype::F32 => "f32",
            },
            self.index_k,
            self.mode,
            if self.deterministic {
                " --deterministic"
            } else {
                ""
            }
        )
    }
}

/// Whether two runs' rows are bitwise equal.
fn bitwise_equal(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len()
                && x.iter().zip(y).all(|(r, q)| {
                    r.len() == q.len() && r.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits())
                })
        })
}

/// `seqs` sequences from the corpus: prompt lengths spread over 5..~600 tokens, each
/// followed by `steps` tokens to decode.
pub(crate) fn cases(
    tok: &Tokenizer,
    corpus: &str,
    seqs: usize,
    steps: usize,
) -> AnyResult<Vec<Case>> {
    let ids = tok.encode(corpus)?;
    let longest = 605 + steps;
    if ids.len() < longest + seqs {
        return Err(format!("corpus of {} tokens is too short", ids.len()).into());
    }
    Ok((0..seqs)
        .map(|i| {
            let prompt = 5 + (i * 131) % 600;
            let start = (i * 7919) % (ids.len() - longest);
            Case {
                tokens: ids[start..start + prompt + steps].to_vec(),
                prompt,
            }
        })
        .collect())
}

/// The CPU engine's rows: the prompt's last row, then one per decoded token.
pub(crate) fn reference(
    dir: &Path,
    spec: KvLayoutSpec,
    cases: &[Case],
) -> AnyResult<Vec<Vec<Vec<f32>>>> {
    let mut cpu = Engine::load(dir, CpuBackend, Some(spec), POOL)?;
    reference_rows(&mut cpu, cases, &mut |_| Ok(()))
}

/// [`reference`] on a given CPU engine, reporting each case's one-shot forward.
pub(crate) fn reference_rows(
    cpu: &mut Engine<CpuBackend>,
    cases: &[Case],
    on_forward: &mut OnForward<'_>,
) -> AnyResult<Vec<Vec<Vec<f32>>>> {
    cases
        .iter()
        .enumerate()
        .map(|(case, c)| {
            let mut seq = cpu.new_sequence()?;
            let rows = prefill(cpu, &mut seq, &c.tokens, 0, Logits::All);
            cpu.release(seq)?;
            let mut rows = rows?;
            on_forward(&[Span {
                case,
                start: 0,
                len: c.tokens.len(),
            }])?;
            Ok(rows.split_off(c.prompt - 1))
        })
        .collect()
}

/// Prefill each case, then decode them teacher-forced in batches of `batch`; returns each
/// case's rows (same shape as [`reference`]).
fn decode_in_batches<B: Backend>(
    e: &mut Engine<B>,
    cases: &[Case],
    batch: usize,
) -> AnyResult<Vec<Vec<Vec<f32>>>> {
    decode_in_batches_reporting(e, cases, batch, &mut |_| Ok(()))
}

/// [`decode_in_batches`], reporting every forward's spans.
pub(crate) fn decode_in_batches_reporting<B: Backend>(
    e: &mut Engine<B>,
    cases: &[Case],
    batch: usize,
    on_forward: &mut OnForward<'_>,
) -> AnyResult<Vec<Vec<Vec<f32>>>> {
    let mut out = Vec::with_capacity(cases.len());
    for (g, group) in cases.chunks(batch.max(1)).enumerate() {
        let mut seqs: Vec<Sequence> = Vec::with_capacity(group.len());
        let result = decode_group(e, g * batch.max(1), group, &mut seqs, on_forward);
        for s in seqs {
            e.release(s)?;
        }
        out.extend(result?);
    }
    Ok(out)
}

fn decode_group<B: Backend>(
    e: &mut Engine<B>,
    first: usize,
    group: &[Case],
    seqs: &mut Vec<Sequence>,
    on_forward: &mut OnForward<'_>,
) -> AnyResult<Vec<Vec<Vec<f32>>>> {
    let mut rows: Vec<Vec<Vec<f32>>> = Vec::with_capacity(group.len());
    for (i, c) in group.iter().enumerate() {
        let mut seq = e.new_sequence()?;
        let last = prefill(e, &mut seq, &c.tokens[..c.prompt], 0, Logits::Last);
        seqs.push(seq);
        rows.push(last?);
        on_forward(&[Span {
            case: first + i,
            start: 0,
            len: c.prompt,
        }])?;
    }
    let steps = group
        .iter()
        .map(|c| c.tokens.len() - c.prompt)
        .min()
        .unwrap_or(0);
    for s in 0..steps {
        let toks: Vec<u32> = group.iter().map(|c| c.tokens[c.prompt + s]).collect();
        for (r, o) in rows
            .iter_mut()
            .zip(decode_logits(e, seqs.iter_mut(), &toks)?)
        {
            r.push(o);
        }
        let spans: Vec<Span> = group
            .iter()
            .enumerate()
            .map(|(i, c)| Span {
                case: first + i,
                start: c.prompt + s,
                len: 1,
            })
            .collect();
        on_forward(&spans)?;
    }
    Ok(rows)
}

/// Per-row errors of `got` against `want`, flattened in (case, row) order.
pub(crate) fn errors(got: &[Vec<Vec<f32>>], want: &[Vec<Vec<f32>>]) -> Vec<f64> {
    got.iter()
        .zip(want)
        .flat_map(|(g, w)| g.iter().zip(w).map(|(a, b)| rel_err(a, b)))
        .collect()
}

/// p50 / p90 / p99 / max of a distribution.
pub(crate) fn quantiles(v: &[f64]) -> [f64; 4] {
    quantiles_at(v, [0.5, 0.9, 0.99, 1.0])
}

/// The values at fractions `ps` of a distribution (nearest rank; 0 when it is empty).
pub(crate) fn quantiles_at<const N: usize>(v: &[f64], ps: [f64; N]) -> [f64; N] {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    ps.map(|p| {
        s.get(((s.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(0.0)
    })
}

/// Rows whose greedy token differs from the CPU's, each with the CPU's logit margin between
/// its own top token and the GPU's pick.
fn flips(got: &[Vec<Vec<f32>>], want: &[Vec<Vec<f32>>]) -> Vec<(usize, usize, f32)> {
    let mut out = Vec::new();
    for (c, (g, w)) in got.iter().zip(want).enumerate() {
        for (r, (a, b)) in g.iter().zip(w).enumerate() {
            let (ga, wa) = (argmax(a), argmax(b));
            if ga != wa {
                out.push((c, r, b[wa] - b[ga]));
            }
        }
    }
    out
}

fn row(
    name: String,
    got: &[Vec<Vec<f32>>],
    want: &[Vec<Vec<f32>>],
    tol: f64,
    gate: bool,
) -> CheckRow {
    let errs = errors(got, want);
    let (worst_row, max_rel_err) = errs
        .iter()
        .copied()
        .enumerate()
        .fold((0, 0.0), |a, (i, e)| if e > a.1 { (i, e) } else { a });
    let flipped = flips(got, want);
    let near_ties = flipped.iter().filter(|f| f.2 < 0.05).count();
    let rows = errs.len();
    CheckRow {
        name,
        rows,
        max_rel_err,
        worst_row,
        greedy_same: rows - flipped.len(),
        near_ties,
        pass: max_rel_err < tol && (flipped.is_empty() || !gate || near_ties == flipped.len()),
        gate,
    }
}

fn describe(label: &str, what: &str, errs: &[f64], flipped: &[(usize, usize, f32)]) -> String {
    let [p50, p90, p99, max] = quantiles(errs);
    let mut margins: Vec<String> = flipped
        .iter()
        .map(|(c, r, m)| format!("seq{c}@{r}:{m:.3}"))
        .collect();
    margins.truncate(12);
    format!(
        "{label} {what:<10} rel err p50 {p50:.2e} p90 {p90:.2e} p99 {p99:.2e} max {max:.2e}; \
         greedy flips {} [{}]",
        flipped.len(),
        margins.join(" ")
    )
}

/// The greedy noise of batching, measured: two runs whose logits differ by at most `d` on
/// a row can choose different tokens there only where the top-2 margin is below `2 d`.
/// `d` is the largest |logit| difference between the batch-1 and the all-in-one-batch
/// runs over every row (pick flips included, as serving sees them). Printed with a
/// `noise_bound=` token that scripts/gpu-check.sh hands to the serving check, which gates
/// the default mode's mismatches on it.
fn noise_bound(label: &str, one: &[Vec<Vec<f32>>], all: &[Vec<Vec<f32>>]) -> String {
    let d = one
        .iter()
        .flatten()
        .zip(all.iter().flatten())
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0.0f32, f32::max);
    format!(
        "{label} greedy noise: max |logit b1 - b{}| {d:.3}, top-2 margins below noise_bound={:.3} \
         can flip",
        all.len(),
        2.0 * d
    )
}

/// All rows of one setup: batch of everything, small batches, one at a time.
fn check_setup(
    ordinal: usize,
    dir: &Path,
    setup: Setup,
    cases: &[Case],
    want: &[Vec<Vec<f32>>],
) -> AnyResult<(Vec<CheckRow>, Vec<String>)> {
    let mut backend = CudaBackend::with_weights(ordinal, None, setup.weights)?;
    backend.set_graph_mode(setup.mode);
    backend.set_deterministic(setup.deterministic);
    let spec = KvLayoutSpec {
        index_k_dtype: setup.index_k,
        ..kv_spec(dir)?
    };
    let mut e = Engine::load(dir, backend, Some(spec), POOL)?;
    let label = setup.label();
    let (tol, exact) = match setup.weights {
        WeightDtype::F32 => (REL_TOL_F32, true),
        WeightDtype::Bf16 => (REL_TOL, false),
    };
    let one = decode_in_batches(&mut e, cases, 1)?;
    let small = decode_in_batches(&mut e, cases, SMALL_BATCH)?;
    let all = decode_in_batches(&mut e, cases, cases.len())?;
    let n = cases.len();
    let mut rows = vec![
        row(
            format!("batched {label}, 1 x {n} seqs"),
            &one,
            want,
            tol,
            exact,
        ),
        row(
            format!("batched {label}, {SMALL_BATCH} per batch"),
            &small,
            want,
            tol,
            exact,
        ),
        row(
            format!("batched {label}, {n} per batch"),
            &all,
            want,
            tol,
            exact,
        ),
    ];
    let (e1, es, ea) = (errors(&one, want), errors(&small, want), errors(&all, want));
    let mut figures = vec![
        describe(&label, "batch 1", &e1, &flips(&one, want)),
        describe(
            &label,
            &format!("batch {SMALL_BATCH}"),
            &es,
            &flips(&small, want),
        ),
        describe(&label, &format!("batch {n}"), &ea, &flips(&all, want)),
    ];
    if setup.deterministic {
        let same = bitwise_equal(&one, &small) && bitwise_equal(&one, &all);
        rows.push(CheckRow {
            name: format!("batched {label}: batch 1 == {SMALL_BATCH} == {n} bitwise"),
            rows: ea.len(),
            max_rel_err: errors(&all, &one).into_iter().fold(0.0, f64::max),
            worst_row: 0,
            greedy_same: 0,
            near_ties: 0,
            pass: same,
            gate: true,
        });
    } else if !exact {
        // Same distribution: the batched p90/p99 may not exceed batch 1's by more than
        // half again (plus a floor for rows at fp32 noise).
        let (q1, qa) = (quantiles(&e1), quantiles(&ea));
        let same = qa[1] <= 1.5 * q1[1] + 1e-4 && qa[2] <= 1.5 * q1[2] + 1e-4;
        rows.push(CheckRow {
            name: format!("batched {label}: batch-{n} error distribution == batch 1"),
            rows: ea.len(),
            max_rel_err: qa[2],
            worst_row: 0,
            greedy_same: 0,
            near_ties: 0,
            pass: same,
            gate: true,
        });
        figures.push(describe(
            &label,
            "GPU b1 vs b48",
            &errors(&all, &one),
            &flips(&all, &one),
        ));
        figures.push(noise_bound(&label, &one, &all));
    }
    Ok((rows, figures))
}

pub(crate) fn kv_spec(dir: &Path) -> AnyResult<KvLayoutSpec> {
    let cfg = pdserve_engine::config::ModelConfig::from_model_dir(dir)?;
    Ok(KvLayoutSpec::default_for(&cfg))
}

/// The embedded model's folder and `seqs` teacher-forced sequences of `steps` decode steps
/// cut from the text at `corpus` (what the `batched` and `picks` groups run).
pub(crate) fn corpus_cases(
    corpus: &Path,
    seqs: usize,
    steps: usize,
) -> AnyResult<(std::path::PathBuf, Vec<Case>)> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let tok = Tokenizer::from_model_dir(&dir)?.ok_or("the embedded model has no tokenizer")?;
    let text = std::fs::read_to_string(corpus)
        .map_err(|e| format!("reading corpus {}: {e}", corpus.display()))?;
    let cases = cases(&tok, &text, seqs, steps)?;
    Ok((dir, cases))
}

/// The check: `seqs` sequences of `steps` decode steps each on the embedded model, for fp32
/// and bf16 weights, fp32 and bf16 index-K, graphs and eager.
pub fn check_batched(
    ordinal: usize,
    corpus: &Path,
    seqs: usize,
    steps: usize,
) -> AnyResult<(Vec<CheckRow>, Vec<String>)> {
    let (dir, cases) = corpus_cases(corpus, seqs, steps)?;
    let setups = [
        (WeightDtype::F32, EntryDtype::F32, GraphMode::Capture),
        (WeightDtype::Bf16, EntryDtype::F32, GraphMode::Capture),
        (WeightDtype::Bf16, EntryDtype::Bf16, GraphMode::Capture),
        (WeightDtype::Bf16, EntryDtype::Bf16, GraphMode::Eager),
        (WeightDtype::Bf16, EntryDtype::Fp8E4m3, GraphMode::Capture),
    ]
    .map(|(w, ik, m)| (w, ik, m, false))
    .into_iter()
    .chain([(
        WeightDtype::Bf16,
        EntryDtype::Bf16,
        GraphMode::Capture,
        true,
    )]);
    let (mut rows, mut figures) = (Vec::new(), Vec::new());
    let mut want_for = std::collections::HashMap::new();
    for (weights, index_k, mode, deterministic) in setups {
        let spec = KvLayoutSpec {
            index_k_dtype: index_k,
            ..kv_spec(&dir)?
        };
        if let std::collections::hash_map::Entry::Vacant(slot) = want_for.entry(index_k) {
            slot.insert(reference(&dir, spec, &cases)?);
        }
        let want = want_for.get(&index_k).ok_or("reference rows")?;
        let setup = Setup {
            weights,
            index_k,
            mode,
            deterministic,
        };
        let (r, f) = check_setup(ordinal, &dir, setup, &cases, want)?;
        rows.extend(r);
        figures.extend(f);
    }
    Ok((rows, figures))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// On the CPU, batching changes nothing: every way of batching gives the reference's
    /// rows bit for bit (the property the GPU rows are measured against).
    #[test]
    fn cpu_batched_decode_equals_the_one_shot_reference() {
        let dir = pdserve_engine::embedded::model_dir().unwrap();
        let tok = Tokenizer::from_model_dir(&dir).unwrap().unwrap();
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tokenizer_corpus.txt");
        let text = std::fs::read_to_string(corpus).unwrap();
        let cases = cases(&tok, &text, 5, 4).unwrap();
        assert!(
            cases.iter().any(|c| c.prompt > 256),
            "some prompt spans pages"
        );
        let spec = kv_spec(&dir).unwrap();
        let want = reference(&dir, spec, &cases).unwrap();
        assert!(want.iter().all(|r| r.len() == 5));
        let mut cpu = Engine::load(&dir, CpuBackend, Some(spec), POOL).unwrap();
        for batch in [1, 2, 5] {
            let got = decode_in_batches(&mut cpu, &cases, batch).unwrap();
            assert_eq!(got, want, "batch {batch}");
        }
        let [p50, _, _, max] = quantiles(&errors(&want, &want));
        assert_eq!((p50, max), (0.0, 0.0));
    }
}
