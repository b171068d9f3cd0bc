//! Graph checks of `pdserve gpu-check`: decode steps replayed from captured graphs against
//! the same steps run eagerly (bitwise), over random batches of sequences at different
//! positions, and the graph speed-up at batch 1 on the embedded model.

use crate::batched::Span;
use crate::check::{decode_logits, CheckRow, REL_TOL};
use crate::picks::Trace;
use pdserve_engine::backend::PickLog;
use pdserve_engine::generate::prefill;
use pdserve_engine::{Engine, Logits, PoolSize, Sequence};
use pdserve_kernels::{CudaBackend, GraphMode};
use pdserve_tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::Instant;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const POOL: PoolSize = PoolSize {
    pages: 256,
    states: 32,
};

/// `check::PROMPTS`, then these: six sequences of different lengths.
const MORE_PROMPTS: &[&str] = &[
    "Hello",
    "In the beginning the universe was created. This has made a lot of people very angry",
    "a",
];

fn prompts() -> impl Iterator<Item = &'static str> + Clone {
    crate::check::PROMPTS.iter().chain(MORE_PROMPTS).copied()
}

fn argmax(v: &[f32]) -> u32 {
    crate::check::argmax(v) as u32
}

/// A small deterministic generator for batch choices (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n.max(1)
    }

    /// A random batch: 1 to `n` distinct indices below `n`, in random order.
    fn batch(&mut self, n: usize) -> Vec<usize> {
        let want = 1 + self.below(n);
        let mut pick: Vec<usize> = (0..n).collect();
        for i in (1..pick.len()).rev() {
            pick.swap(i, self.below(i + 1));
        }
        pick.truncate(want);
        pick
    }
}

fn engine(ordinal: usize, mode: GraphMode, verify: bool) -> AnyResult<Engine<CudaBackend>> {
    engine_with(ordinal, mode, verify, false)
}

/// [`engine`], with programmatic dependent launch on or off.
fn engine_with(
    ordinal: usize,
    mode: GraphMode,
    verify: bool,
    programmatic: bool,
) -> AnyResult<Engine<CudaBackend>> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let mut b = CudaBackend::new(ordinal, None)?;
    b.set_graph_mode(mode);
    b.set_verify_graphs(verify);
    b.set_programmatic_launch(programmatic);
    Ok(Engine::load(&dir, b, None, POOL)?)
}

/// Prefill every prompt (one sequence each, `copies` times over); returns the sequences
/// and each one's next greedy token.
fn start(
    e: &mut Engine<CudaBackend>,
    tok: &Tokenizer,
    copies: usize,
) -> AnyResult<(Vec<Sequence>, Vec<u32>)> {
    let (mut seqs, mut next) = (Vec::new(), Vec::new());
    for p in prompts().cycle().take(prompts().count() * copies) {
        let ids = tok.encode(p)?;
        let mut seq = e.new_sequence()?;
        let rows = prefill(e, &mut seq, &ids, 0, Logits::Last)?;
        next.push(rows.last().map_or(0, |r| argmax(r)));
        seqs.push(seq);
    }
    Ok((seqs, next))
}

/// One greedy decode step of the sequences `pick` (indices into `seqs`).
fn step(
    e: &mut Engine<CudaBackend>,
    seqs: &mut [Sequence],
    next: &mut [u32],
    pick: &[usize],
) -> AnyResult<()> {
    let toks: Vec<u32> = pick.iter().map(|&i| next[i]).collect();
    let mut chosen: Vec<(usize, &mut Sequence)> = seqs
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| pick.contains(i))
        .collect();
    chosen.sort_by_key(|(i, _)| pick.iter().position(|p| p == i));
    let outs = decode_logits(e, chosen.into_iter().map(|(_, s)| s), &toks)?;
    for (&i, o) in pick.iter().zip(outs) {
        next[i] = argmax(&o);
    }
    Ok(())
}

/// `--verify-graphs` over `steps` random batches: every step runs eagerly and from its
/// graph, and logits, pages and states must be bitwise equal.
fn verify_random(ordinal: usize, tok: &Tokenizer, steps: usize) -> AnyResult<CheckRow> {
    let mut e = engine(ordinal, GraphMode::Capture, true)?;
    let (mut seqs, mut next) = start(&mut e, tok, 2)?;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut result = Ok(());
    let mut sizes = std::collections::BTreeSet::new();
    for _ in 0..steps {
        let pick = rng.batch(seqs.len());
        sizes.insert(pick.len());
        if let Err(err) = step(&mut e, &mut seqs, &mut next, &pick) {
            result = Err(err);
            break;
        }
    }
    let stats = e.backend().graph_stats();
    for s in seqs {
        e.release(s)?;
    }
    if let Err(err) = &result {
        eprintln!("verify-graphs: {err}");
    }
    Ok(CheckRow {
        name: format!(
            "graph == eager bitwise, {steps} random batches ({}-{} seqs, {} graphs, {} mismatches)",
            sizes.first().copied().unwrap_or(0),
            sizes.last().copied().unwrap_or(0),
            stats.captures,
            stats.verify_mismatches
        ),
        rows: steps,
        max_rel_err: 0.0,
        worst_row: 0,
        greedy_same: 0,
        near_ties: 0,
        pass: result.is_ok() && stats.replays >= steps as u64 && stats.verify_mismatches == 0,
        gate: true,
    })
}

/// The same prefills and `steps` random batches of greedy decode steps (graphs captured)
/// with kernels launched plainly and with programmatic dependent launch: every logit of
/// every step bitwise equal. The launch attribute only lets a kernel be scheduled early;
/// one that touched memory before waiting for its predecessor would race and show here.
fn programmatic_launch_same_bits(
    ordinal: usize,
    tok: &Tokenizer,
    steps: usize,
) -> AnyResult<CheckRow> {
    let run = |programmatic: bool| -> AnyResult<Vec<Vec<f32>>> {
        let mut e = engine_with(ordinal, GraphMode::Capture, false, programmatic)?;
        let (mut seqs, mut next) = start(&mut e, tok, 2)?;
        let mut rng = Rng(0x51_7CC1_B727_220A);
        let mut out = Vec::new();
        for _ in 0..steps {
            let mut pick = rng.batch(seqs.len());
            pick.sort_unstable();
            let toks: Vec<u32> = pick.iter().map(|&i| next[i]).collect();
            let chosen = seqs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| pick.contains(i))
                .map(|(_, s)| s);
            let logits = decode_logits(&mut e, chosen, &toks)?;
            for (&i, row) in pick.iter().zip(&logits) {
                next[i] = argmax(row);
            }
            out.extend(logits);
        }
        for s in seqs {
            e.release(s)?;
        }
        Ok(out)
    };
    let (plain, programmatic) = (run(false)?, run(true)?);
    let differ = plain
        .iter()
        .zip(&programmatic)
        .filter(|(a, b)| {
            a.iter()
                .map(|v| v.to_bits())
                .ne(b.iter().map(|v| v.to_bits()))
        })
        .count();
    Ok(CheckRow {
        name: format!(
            "programmatic dependent launch == plain launch bitwise, {steps} random batches ({differ} rows differ)"
        ),
        rows: plain.len(),
        max_rel_err: 0.0,
        worst_row: 0,
        greedy_same: 0,
        near_ties: 0,
        pass: differ == 0 && plain.len() == programmatic.len() && !plain.is_empty(),
        gate: true,
    })
}

/// Batched decode steps (every prompt twice: 12 sequences, so the MoE runs its
/// batched expert kernels) on the GPU against the fp32 CPU engine, teacher-forced with
/// the CPU's greedy tokens. A row above the bf16 tolerance passes only when a routing or
/// indexer pick on its path chose differently from the CPU (see `crate::picks`): the same
/// schedule runs again with both engines recording their picks, and every such row must
/// be traced there. Recording runs the GPU's forwards outside decode steps (whose key
/// splits follow the batch, not a captured bucket), so the re-run's logits may differ from
/// the graph run's in rounding; the row says whether they came out bitwise equal.
fn batched_vs_cpu(ordinal: usize, tok: &Tokenizer, steps: usize) -> AnyResult<CheckRow> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let prompt_ids: Vec<Vec<u32>> = prompts()
        .cycle()
        .take(prompts().count() * 2)
        .map(|p| tok.encode(p))
        .collect::<Result<_, _>>()?;
    let gpu = engine(ordinal, GraphMode::Capture, false)?;
    let cpu = Engine::load(&dir, pdserve_engine::CpuBackend, None, POOL)?;
    let run = teacher_forced(gpu, cpu, &prompt_ids, steps, None)?;
    let name = format!("embedded w=bf16 12 seqs x {steps} batched decode steps");
    let mut row = crate::check::compare(name.clone(), &run.got, &run.want, REL_TOL);
    let jumps: Vec<usize> = (0..run.got.len())
        .filter(|&i| crate::check::rel_err(&run.got[i], &run.want[i]) >= REL_TOL)
        .collect();
    if jumps.is_empty() || row.greedy_same + row.near_ties != row.rows {
        return Ok(row);
    }
    // The traced re-run: the same tokens, both engines recording their picks.
    let mut gpu = engine(ordinal, GraphMode::Eager, false)?;
    let mut cpu = Engine::load(&dir, pdserve_engine::CpuBackend, None, POOL)?;
    let (glog, clog) = (Arc::new(PickLog::default()), Arc::new(PickLog::default()));
    gpu.record_picks(Some(glog.clone()));
    cpu.record_picks(Some(clog.clone()));
    let traced = teacher_forced(
        gpu,
        cpu,
        &prompt_ids,
        steps,
        Some((glog.as_ref(), clog.as_ref())),
    )?;
    let (Some(gt), Some(ct)) = (traced.gpu_trace, traced.cpu_trace) else {
        return Err("the traced run recorded no picks".into());
    };
    let same = traced.got == run.got;
    let flipped = crate::picks::flips(&gt, &ct)?;
    let seqs = prompt_ids.len();
    let untraced = jumps
        .iter()
        .filter(|&&i| {
            let (seq, step) = (i % seqs, i / seqs);
            let position = prompt_ids[seq].len() + step;
            !flipped.iter().any(|f| f.at.0 == seq && f.at.1 <= position)
        })
        .count();
    row.name = format!(
        "{name}: {} rows above {REL_TOL:.0e}, {untraced} untraced ({} flipped picks{})",
        jumps.len(),
        flipped.len(),
        if same {
            "; re-run bitwise equal"
        } else {
            "; re-run differs in rounding"
        }
    );
    row.pass = untraced == 0 && row.greedy_same + row.near_ties == row.rows;
    Ok(row)
}

/// Logits rows (step by step, sequence by sequence) of a teacher-forced run, and the picks
/// each engine recorded when `logs` are given (installed on the engines by the caller).
struct TeacherForced {
    got: Vec<Vec<f32>>,
    want: Vec<Vec<f32>>,
    gpu_trace: Option<Trace>,
    cpu_trace: Option<Trace>,
}

/// Prefill each prompt on both engines (a sequence each), then `steps` batched decode
/// steps of every sequence, each fed the CPU's greedy token.
fn teacher_forced(
    mut gpu: Engine<CudaBackend>,
    mut cpu: Engine<pdserve_engine::CpuBackend>,
    prompt_ids: &[Vec<u32>],
    steps: usize,
    logs: Option<(&PickLog, &PickLog)>,
) -> AnyResult<TeacherForced> {
    let mut traces = logs.map(|_| (Trace::default(), Trace::default()));
    // File the picks of one forward on each engine that ran `spans`.
    let file = |spans: &[Span], traces: &mut Option<(Trace, Trace)>| -> AnyResult<()> {
        if let (Some((gl, cl)), Some((gt, ct))) = (logs, traces.as_mut()) {
            gt.file(gl, spans)?;
            ct.file(cl, spans)?;
        }
        Ok(())
    };
    let (mut gseqs, mut cseqs, mut next) = (Vec::new(), Vec::new(), Vec::new());
    for (case, ids) in prompt_ids.iter().enumerate() {
        let mut gs = gpu.new_sequence()?;
        prefill(&mut gpu, &mut gs, ids, 0, Logits::Last)?;
        let mut cs = cpu.new_sequence()?;
        let rows = prefill(&mut cpu, &mut cs, ids, 0, Logits::Last)?;
        file(
            &[Span {
                case,
                start: 0,
                len: ids.len(),
            }],
            &mut traces,
        )?;
        next.push(rows.last().map_or(0, |r| argmax(r)));
        gseqs.push(gs);
        cseqs.push(cs);
    }
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let toks = next.clone();
        let g = decode_logits(&mut gpu, &mut gseqs, &toks)?;
        let c = decode_logits(&mut cpu, &mut cseqs, &toks)?;
        let spans: Vec<Span> = prompt_ids
            .iter()
            .enumerate()
            .map(|(case, ids)| Span {
                case,
                start: ids.len() + step,
                len: 1,
            })
            .collect();
        file(&spans, &mut traces)?;
        for (n, row) in next.iter_mut().zip(&c) {
            *n = argmax(row);
        }
        got.extend(g);
        want.extend(c);
    }
    for s in gseqs {
        gpu.release(s)?;
    }
    let (gpu_trace, cpu_trace) = traces.map_or((None, None), |(g, c)| (Some(g), Some(c)));
    Ok(TeacherForced {
        got,
        want,
        gpu_trace,
        cpu_trace,
    })
}

/// Greedy tokens/s of one sequence decoding `steps` tokens.
fn batch1_rate(
    ordinal: usize,
    tok: &Tokenizer,
    mode: GraphMode,
    steps: usize,
) -> AnyResult<(f64, Vec<u32>, String)> {
    let mut e = engine(ordinal, mode, false)?;
    let (mut seqs, mut next) = start(&mut e, tok, 1)?;
    let mut tokens = Vec::new();
    // Warm-up: kernel loading, the first capture.
    for _ in 0..3 {
        step(&mut e, &mut seqs, &mut next, &[0])?;
    }
    let before = e.backend().graph_stats().phases;
    let t0 = Instant::now();
    for _ in 0..steps {
        step(&mut e, &mut seqs, &mut next, &[0])?;
        tokens.push(next[0]);
    }
    let rate = steps as f64 / t0.elapsed().as_secs_f64();
    let after = e.backend().graph_stats().phases;
    let per = |a: f64, b: f64| (a - b) * 1e6 / steps as f64;
    let phases = format!(
        "{mode}: dry pass {:.0} us, submit {:.0} us, wait {:.0} us per step",
        per(after.dry, before.dry),
        per(after.submit, before.submit),
        per(after.wait, before.wait)
    );
    for s in seqs {
        e.release(s)?;
    }
    Ok((rate, tokens, phases))
}

/// A write planted inside a captured decode graph (test only) over a page of a sequence
/// the step does not run: the KV canary (`--kv-audit`) must mark exactly that sequence
/// corrupt after the step, and the step's own sequences none.
fn planted_write_in_graph(ordinal: usize, tok: &Tokenizer) -> AnyResult<CheckRow> {
    let mut e = engine(ordinal, GraphMode::Capture, false)?;
    e.set_kv_audit(true);
    let (mut seqs, mut next) = start(&mut e, tok, 1)?;
    let all: Vec<usize> = (0..seqs.len()).collect();
    let others: Vec<usize> = (1..seqs.len()).collect();
    let mut clean = true;
    for _ in 0..3 {
        clean &= step(&mut e, &mut seqs, &mut next, &all).is_ok();
    }
    let victim = seqs[0].kv().pages[0];
    e.backend().debug_plant_write_in_next_graph(Some(victim))?;
    let replays = e.backend().graph_stats().replays;
    let stepped = step(&mut e, &mut seqs, &mut next, &others);
    let replayed = e.backend().graph_stats().replays > replays;
    e.backend().debug_plant_write_in_next_graph(None)?;
    let caught = e.kv_fault(&seqs[0]).is_some();
    let spared = seqs[1..].iter().all(|s| e.kv_fault(s).is_none());
    if let Err(err) = &stepped {
        eprintln!("planted write: the step itself failed: {err}");
    }
    for s in seqs {
        e.release(s)?;
    }
    Ok(CheckRow {
        name: "--kv-audit catches a write planted inside a captured graph".into(),
        rows: 1,
        max_rel_err: 0.0,
        worst_row: 0,
        greedy_same: 0,
        near_ties: 0,
        pass: clean && stepped.is_ok() && replayed && caught && spared,
        gate: true,
    })
}

/// The graph rows of the table, plus lines of figures to print under it.
pub fn check_graphs(ordinal: usize) -> AnyResult<(Vec<CheckRow>, Vec<String>)> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let tok = Tokenizer::from_model_dir(&dir)?.ok_or("the embedded model has no tokenizer")?;
    let mut rows = vec![
        verify_random(ordinal, &tok, 200)?,
        batched_vs_cpu(ordinal, &tok, 30)?,
        planted_write_in_graph(ordinal, &tok)?,
        programmatic_launch_same_bits(ordinal, &tok, 100)?,
    ];
    rows.extend(crate::device_argmax::check_device_argmax(ordinal)?);
    let steps = 200;
    let (eager, eager_toks, eager_phases) = batch1_rate(ordinal, &tok, GraphMode::Eager, steps)?;
    let (graph, graph_toks, graph_phases) = batch1_rate(ordinal, &tok, GraphMode::Capture, steps)?;
    let same = graph_toks
        .iter()
        .zip(&eager_toks)
        .take_while(|(a, b)| a == b)
        .count();
    rows.push(CheckRow {
        name: format!("graph vs eager greedy, batch 1 x {steps} steps"),
        rows: steps,
        max_rel_err: 0.0,
        worst_row: 0,
        greedy_same: same,
        near_ties: 0,
        pass: graph_toks == eager_toks,
        gate: true,
    });
    let info = vec![
        format!(
            "decode batch 1, embedded model: eager {eager:.0} tok/s, graph {graph:.0} tok/s ({:.2}x)",
            graph / eager.max(1e-9)
        ),
        eager_phases,
        graph_phases,
    ];
    Ok((rows, info))
}
