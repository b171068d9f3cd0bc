//! Pick trace (`pdserve gpu-check --only picks`): why a bf16 row's logits jump away from
//! the fp32 CPU engine. Both engines record every routing and indexer pick
//! ([`pdserve_engine::backend::picks`]) while the `batched` group's teacher-forced
//! sequences run, the GPU at batch 1 and with every sequence in one batch. A row is
//! *traced* when some pick on its path (at its own position or an earlier one of its
//! sequence, any layer) chose a different set than the CPU; the CPU's margin at that flip
//! (its score gap between the entries the two runs swapped) says how near a tie it was.
//!
//! The gate: every row whose error exceeds the bf16 tolerance is traced. A jump without a
//! flipped pick would be a defect, not rounding amplified by a discrete decision.

use crate::batched::{
    corpus_cases, decode_in_batches_reporting, errors, kv_spec, quantiles, quantiles_at,
    reference_rows, AnyResult, Case, Span, POOL,
};
use crate::check::{CheckRow, REL_TOL};
use pdserve_engine::backend::{Backend, PickKind, PickLog, RowPicks};
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::{CpuBackend, Engine};
use pdserve_kernels::{CudaBackend, GraphMode, WeightDtype};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Where one pick was made: case, position, layer, kind.
type PickAt = (usize, usize, usize, PickKind);

/// Logits rows per case, as [`crate::batched`] returns them.
type CaseRows = Vec<Vec<Vec<f32>>>;

/// Every pick of a run, by where it was made.
#[derive(Default)]
pub(crate) struct Trace(BTreeMap<PickAt, RowPicks>);

impl Trace {
    /// File the picks `log` holds for one forward that ran `spans` (its rows, in order).
    pub(crate) fn file(&mut self, log: &PickLog, spans: &[Span]) -> AnyResult<()> {
        let rows: Vec<(usize, usize)> = spans
            .iter()
            .flat_map(|s| (s.start..s.start + s.len).map(move |p| (s.case, p)))
            .collect();
        for ev in log.take() {
            if ev.rows.len() != rows.len() {
                return Err(format!(
                    "layer {} {} picks for {} rows, the forward ran {}",
                    ev.layer,
                    ev.kind,
                    ev.rows.len(),
                    rows.len()
                )
                .into());
            }
            for (picks, &(case, pos)) in ev.rows.into_iter().zip(&rows) {
                self.0.insert((case, pos, ev.layer, ev.kind), picks);
            }
        }
        Ok(())
    }
}

/// A pick where a run chose differently from the reference.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Flip {
    pub at: PickAt,
    /// The reference's score gap between what the two runs swapped (`None`: no scores).
    pub margin: Option<f32>,
}

/// Every flip of `got` against `want`, in (case, position, layer, kind) order.
pub(crate) fn flips(got: &Trace, want: &Trace) -> AnyResult<Vec<Flip>> {
    let mut out = Vec::new();
    for (at, w) in &want.0 {
        let g = got
            .0
            .get(at)
            .ok_or_else(|| format!("the run recorded no pick at {at:?}"))?;
        if w.differs(g) {
            out.push(Flip {
                at: *at,
                margin: w.flip_margin(g),
            });
        }
    }
    Ok(out)
}

/// One row of a case's results: the logits after the token at `position`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RowTrace {
    pub case: usize,
    pub position: usize,
    pub err: f64,
    /// The first flip (lowest layer) at the latest position of the row's path (its own
    /// position or an earlier one, same case) that has any.
    pub cause: Option<Flip>,
    /// Flips at that position.
    pub flips_there: usize,
}

/// Each row's error and its latest upstream flip. Rows are in (case, row) order, row `r`
/// of case `c` holding the logits after position `prompt - 1 + r`.
pub(crate) fn trace_rows(
    cases: &[Case],
    got: &[Vec<Vec<f32>>],
    want: &[Vec<Vec<f32>>],
    flipped: &[Flip],
) -> Vec<RowTrace> {
    let errs = errors(got, want);
    let mut out = Vec::with_capacity(errs.len());
    let mut at = 0;
    for (case, (c, rows)) in cases.iter().zip(want).enumerate() {
        for r in 0..rows.len() {
            let position = c.prompt - 1 + r;
            let latest = flipped
                .iter()
                .rfind(|f| f.at.0 == case && f.at.1 <= position)
                .map(|f| f.at.1);
            let there: Vec<&Flip> = flipped
                .iter()
                .filter(|f| f.at.0 == case && Some(f.at.1) == latest)
                .collect();
            out.push(RowTrace {
                case,
                position,
                err: errs.get(at).copied().unwrap_or(f64::INFINITY),
                cause: there.first().map(|f| (*f).clone()),
                flips_there: there.len(),
            });
            at += 1;
        }
    }
    out
}

/// The gated row and the figures of one run.
fn judge(
    label: &str,
    rows: &[RowTrace],
    flipped: &[Flip],
    all_margins: &[f64],
) -> (CheckRow, Vec<String>) {
    let jumps: Vec<&RowTrace> = rows.iter().filter(|r| r.err > REL_TOL).collect();
    let untraced = jumps.iter().filter(|r| r.cause.is_none()).count();
    let at_own = jumps
        .iter()
        .filter(|r| r.cause.as_ref().is_some_and(|f| f.at.1 == r.position))
        .count();
    let (worst_row, max_rel_err) =
        rows.iter().enumerate().fold(
            (0, 0.0),
            |a, (i, r)| if r.err > a.1 { (i, r.err) } else { a },
        );
    let row = CheckRow {
        name: format!("picks {label}: every row above {REL_TOL:.0e} traced to a flipped pick"),
        rows: rows.len(),
        max_rel_err,
        worst_row,
        greedy_same: rows.len() - jumps.len(),
        near_ties: untraced,
        pass: untraced == 0,
        gate: true,
    };
    let clean: Vec<f64> = rows
        .iter()
        .filter(|r| r.cause.is_none())
        .map(|r| r.err)
        .collect();
    let traced: Vec<f64> = rows
        .iter()
        .filter(|r| r.cause.is_some())
        .map(|r| r.err)
        .collect();
    let margins: Vec<f64> = flipped
        .iter()
        .filter_map(|f| f.margin.map(f64::from))
        .collect();
    let by_kind = |k: PickKind| flipped.iter().filter(|f| f.at.3 == k).count();
    let [c50, _, c99, cmax] = quantiles(&clean);
    let [t50, _, t99, tmax] = quantiles(&traced);
    let [m50, _, _, mmax] = quantiles(&margins);
    let [a10, a50] = quantiles_at(all_margins, [0.1, 0.5]);
    let mut figures = vec![
        format!(
            "picks {label}: {} flipped picks ({} route, {} index) of {} rows' paths; \
             CPU margin at a flip p50 {m50:.2e} max {mmax:.2e} (all CPU picks' boundary \
             margin p10 {a10:.2e} p50 {a50:.2e})",
            flipped.len(),
            by_kind(PickKind::Route),
            by_kind(PickKind::Index),
            rows.len()
        ),
        format!(
            "picks {label}: rows without a flip upstream: {} (rel err p50 {c50:.2e} p99 {c99:.2e} \
             max {cmax:.2e}); with one: {} (p50 {t50:.2e} p99 {t99:.2e} max {tmax:.2e}); \
             {} rows above {REL_TOL:.0e}: {at_own} with a flip at their own position, \
             {untraced} untraced",
            clean.len(),
            traced.len(),
            jumps.len()
        ),
    ];
    let mut worst: Vec<&&RowTrace> = jumps.iter().collect();
    worst.sort_by(|a, b| b.err.total_cmp(&a.err));
    figures.extend(worst.iter().take(8).map(|r| match &r.cause {
        Some(f) => format!(
            "picks {label}: seq{}@{} rel err {:.2e} <- {} flip(s) at position {}, the first \
             a {} pick in layer {} (CPU margin {})",
            r.case,
            r.position,
            r.err,
            r.flips_there,
            f.at.1,
            f.at.3,
            f.at.2,
            f.margin.map_or("-".into(), |m| format!("{m:.3e}"))
        ),
        None => format!(
            "picks {label}: seq{}@{} rel err {:.2e} UNTRACED (no pick differs on its path)",
            r.case, r.position, r.err
        ),
    }));
    (row, figures)
}

/// The CPU reference's rows and picks, and every pick's boundary margin.
pub(crate) fn reference_trace(
    dir: &Path,
    spec: KvLayoutSpec,
    cases: &[Case],
) -> AnyResult<(CaseRows, Trace, Vec<f64>)> {
    let mut cpu = Engine::load(dir, CpuBackend, Some(spec), POOL)?;
    let log = Arc::new(PickLog::default());
    cpu.record_picks(Some(log.clone()));
    let mut trace = Trace::default();
    let rows = reference_rows(&mut cpu, cases, &mut |spans| trace.file(&log, spans))?;
    let margins = trace
        .0
        .values()
        .filter_map(|p| p.boundary_margin().map(f64::from))
        .collect();
    Ok((rows, trace, margins))
}

/// One run of `e` at `batch`, recording its picks.
pub(crate) fn run_trace<B: Backend>(
    e: &mut Engine<B>,
    cases: &[Case],
    batch: usize,
) -> AnyResult<(CaseRows, Trace)> {
    let log = Arc::new(PickLog::default());
    e.record_picks(Some(log.clone()));
    let mut trace = Trace::default();
    let rows = decode_in_batches_reporting(e, cases, batch, &mut |spans| trace.file(&log, spans));
    e.record_picks(None);
    Ok((rows?, trace))
}

/// The check: the `batched` group's sequences on bf16 weights and bf16 index-K (the
/// setting of the production failure), at batch 1 and with all sequences in one batch;
/// with fp32 KV entries (the split-key attention kernel) and bf16 ones (the tensor-core
/// kernel, whose products round queries and probabilities to bf16).
pub fn check_picks(
    ordinal: usize,
    corpus: &Path,
    seqs: usize,
    steps: usize,
) -> AnyResult<(Vec<CheckRow>, Vec<String>)> {
    let (dir, cases) = corpus_cases(corpus, seqs, steps)?;
    let (mut rows, mut figures) = (Vec::new(), Vec::new());
    for kv in [EntryDtype::F32, EntryDtype::Bf16] {
        let spec = KvLayoutSpec {
            index_k_dtype: EntryDtype::Bf16,
            kv_dtype: kv,
            ..kv_spec(&dir)?
        };
        let (want, want_picks, all_margins) = reference_trace(&dir, spec, &cases)?;
        let mut backend = CudaBackend::with_weights(ordinal, None, WeightDtype::Bf16)?;
        backend.set_graph_mode(GraphMode::Eager);
        let mut e = Engine::load(&dir, backend, Some(spec), POOL)?;
        for batch in [1, cases.len()] {
            let (got, picks) = run_trace(&mut e, &cases, batch)?;
            let flipped = flips(&picks, &want_picks)?;
            let traced = trace_rows(&cases, &got, &want, &flipped);
            let label = format!("w=bf16 kv={kv} ik=bf16 batch {batch}");
            let (row, f) = judge(&label, &traced, &flipped, &all_margins);
            rows.push(row);
            figures.extend(f);
        }
    }
    Ok((rows, figures))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn cases_of(seqs: usize, steps: usize) -> Vec<Case> {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tokenizer_corpus.txt");
        corpus_cases(&corpus, seqs, steps).unwrap().1
    }

    /// The CPU against itself: every pick recorded at every (case, position) of both
    /// runs, none flipped, every error zero; a batched run files its rows under the same
    /// (case, position) keys as the one-shot reference.
    #[test]
    fn the_cpu_against_itself_flips_nothing() {
        let dir = pdserve_engine::embedded::model_dir().unwrap();
        let cases = cases_of(3, 3);
        let spec = kv_spec(&dir).unwrap();
        let (want, want_picks, margins) = reference_trace(&dir, spec, &cases).unwrap();
        assert!(!margins.is_empty() && margins.iter().all(|m| *m >= 0.0));
        let kinds: std::collections::HashSet<PickKind> = want_picks.0.keys().map(|k| k.3).collect();
        assert!(
            kinds.contains(&PickKind::Route),
            "top-k layers record routing"
        );
        let mut cpu = Engine::load(&dir, CpuBackend, Some(spec), POOL).unwrap();
        let (got, picks) = run_trace(&mut cpu, &cases, 3).unwrap();
        assert_eq!(picks.0.len(), want_picks.0.len());
        let flipped = flips(&picks, &want_picks).unwrap();
        assert!(flipped.is_empty());
        let rows = trace_rows(&cases, &got, &want, &flipped);
        assert_eq!(rows.len(), 3 * 4);
        assert!(rows.iter().all(|r| r.err == 0.0 && r.cause.is_none()));
    }

    /// fp8 index-K against an f32 reference on the CPU: the indexer's picks flip at some
    /// positions (fp8 keeps ~98% of them), and each flip is filed where it happened, with
    /// the reference's margin; rows after a flip name it as their cause.
    #[test]
    fn fp8_index_k_flips_are_found_and_traced() {
        let dir = pdserve_engine::embedded::model_dir().unwrap();
        let cases = cases_of(4, 4);
        let f32_spec = KvLayoutSpec {
            index_k_dtype: EntryDtype::F32,
            ..kv_spec(&dir).unwrap()
        };
        let (want, want_picks, _) = reference_trace(&dir, f32_spec, &cases).unwrap();
        let fp8_spec = KvLayoutSpec {
            index_k_dtype: EntryDtype::Fp8E4m3,
            ..f32_spec
        };
        let mut cpu = Engine::load(&dir, CpuBackend, Some(fp8_spec), POOL).unwrap();
        let (got, picks) = run_trace(&mut cpu, &cases, 4).unwrap();
        let flipped = flips(&picks, &want_picks).unwrap();
        assert!(
            flipped.iter().any(|f| f.at.3 == PickKind::Index),
            "fp8 index-K flips some indexer pick"
        );
        assert!(flipped.iter().all(|f| f.margin.is_some_and(|m| m >= 0.0)));
        let rows = trace_rows(&cases, &got, &want, &flipped);
        let first = &flipped[0];
        let after = rows
            .iter()
            .find(|r| r.case == first.at.0 && r.position >= first.at.1)
            .unwrap();
        assert!(after.cause.is_some());
        let before = rows
            .iter()
            .filter(|r| r.case == first.at.0 && r.position < first.at.1)
            .all(|r| r.cause.is_none());
        assert!(before);
    }
}
