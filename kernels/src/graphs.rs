//! Decode steps of [`CudaBackend`]: the batch is padded to a bucket size (padded rows use
//! the pool's dummy page and state slot), a dry pass records the step's signature and
//! staged inputs, then the step either runs eagerly or replays the graph captured for
//! that signature. `--verify-graphs` runs every step both ways and requires bitwise-equal
//! logits, greedy ids, pages and states. What the step copies back is in
//! [`crate::step_output`].

use crate::backend::CudaBackend;
use crate::graph_cache::Captured;
use crate::kv_store::{DevPlan, GpuKv};
use crate::launch::dev_err;
use crate::recorder::{StepMode, StepRecord};
use crate::step_output::{self, DeviceOut};
use crate::GraphMode;
use cudarc::driver::{sys, CudaGraph};
use pdserve_engine::backend::{
    check_outs, BResult, BackendError, BatchPlan, RowOut, SeqPlan, StepForward, StepOutput,
    StepRunner,
};
use pdserve_engine::kv::{PageId, StateSlot};
use std::time::Instant;

/// Graphs kept at most (least recently used dropped first).
const MAX_GRAPHS: usize = 64;

/// Batch sizes a decode step is padded to.
pub fn bucket(n: usize) -> usize {
    const BUCKETS: [usize; 14] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256];
    BUCKETS
        .iter()
        .copied()
        .find(|&b| b >= n)
        .unwrap_or_else(|| n.next_multiple_of(64))
}

/// Page-table length every sequence of a padded step gets.
fn table_len(plan: &BatchPlan) -> usize {
    let most = plan.seqs.iter().map(|s| s.pages.len()).max().unwrap_or(0);
    most.next_power_of_two().max(4)
}

/// `plan` padded to `rows` one-token sequences with page tables of one length: the
/// kernels' launches then depend only on the bucket, not on the batch's exact contents.
pub(crate) fn pad_plan(plan: &BatchPlan, rows: usize, page: PageId, state: StateSlot) -> BatchPlan {
    let cap = table_len(plan);
    // Built at its final size (one allocation per page table; cloning then resizing took
    // two, at 256 sequences of 32K tokens 256 KB of tables each step).
    let padded_table = |pages: &[PageId]| {
        let mut t = Vec::with_capacity(cap);
        t.extend_from_slice(pages);
        t.resize(cap, page);
        t
    };
    let mut out = BatchPlan {
        seqs: Vec::with_capacity(rows.max(plan.seqs.len())),
        tokens: Vec::with_capacity(rows),
        positions: Vec::with_capacity(rows),
        row_seq: Vec::with_capacity(rows),
        cuts: plan.cuts.clone(),
    };
    out.seqs.extend(plan.seqs.iter().map(|s| SeqPlan {
        pages: padded_table(&s.pages),
        ..*s
    }));
    out.tokens.extend_from_slice(&plan.tokens);
    out.positions.extend_from_slice(&plan.positions);
    out.row_seq.extend_from_slice(&plan.row_seq);
    for r in plan.rows()..rows {
        out.seqs.push(SeqPlan {
            start: 0,
            len: 1,
            row0: r,
            pages: vec![page; cap],
            state,
        });
        out.tokens.push(0);
        out.positions.push(0);
        out.row_seq.push(r);
    }
    out
}

/// Leaves step mode on every exit path (errors included).
struct StepGuard<'a>(&'a CudaBackend);

impl Drop for StepGuard<'_> {
    fn drop(&mut self) {
        let _ = self.0.gpu.end_step();
    }
}

/// One recorded pass of `forward` over `plan` in `mode`, with the launches `outs` needs.
fn pass(
    b: &CudaBackend,
    kv: &mut GpuKv,
    plan: &BatchPlan,
    step: &mut Step<'_, '_>,
    mode: StepMode,
) -> BResult<(StepRecord, DeviceOut)> {
    // `plan` stays borrowed until the step ends (below, or in the guard on an error), as
    // begin_step requires.
    b.gpu.begin_step(mode, plan)?;
    let guard = StepGuard(b);
    let out = (step.forward)(b, kv, plan).and_then(|t| step_output::launch(b, &t, step.outs));
    let rec = b.gpu.end_step()?;
    drop(guard);
    Ok((rec, out?))
}

/// A step's forward and what each of its real rows sends back.
struct Step<'f, 'a> {
    forward: &'f mut StepForward<'a, CudaBackend>,
    outs: &'f [RowOut],
}

/// The dry pass, after sizing the arena and staging buffer for it.
fn dry_pass(
    b: &CudaBackend,
    kv: &mut GpuKv,
    plan: &BatchPlan,
    step: &mut Step<'_, '_>,
) -> BResult<(StepRecord, DeviceOut)> {
    let (rec, out) = pass(b, kv, plan, step, StepMode::Dry)?;
    if !b.gpu.ensure_step_buffers(&rec)? {
        return Ok((rec, out));
    }
    // The buffers moved: every graph points at the old ones; addresses changed.
    b.graph_cache()?.graphs.clear();
    let (rec, out) = pass(b, kv, plan, step, StepMode::Dry)?;
    if b.gpu.ensure_step_buffers(&rec)? {
        return Err(BackendError::Device(
            "decode step buffers grew twice for one step".into(),
        ));
    }
    Ok((rec, out))
}

fn same_work(dry: &StepRecord, run: &StepRecord, what: &str) -> BResult<()> {
    if dry.signature != run.signature || dry.staged != run.staged {
        return Err(BackendError::Device(format!(
            "the {what} pass of a decode step launched different work than its dry pass"
        )));
    }
    Ok(())
}

fn eager(
    b: &CudaBackend,
    kv: &mut GpuKv,
    plan: &BatchPlan,
    step: &mut Step<'_, '_>,
    dry: &StepRecord,
) -> BResult<StepOutput> {
    let t0 = Instant::now();
    let (rec, out) = pass(b, kv, plan, step, StepMode::Eager)?;
    same_work(dry, &rec, "eager")?;
    b.graph_cache()?.phases.submit += t0.elapsed().as_secs_f64();
    step_output::fetch(b, out, step.outs)
}

fn replay(
    b: &CudaBackend,
    kv: &mut GpuKv,
    plan: &BatchPlan,
    step: &mut Step<'_, '_>,
    dry: &StepRecord,
    out: DeviceOut,
) -> BResult<StepOutput> {
    let mut cache = b.graph_cache()?;
    cache.tick += 1;
    let tick = cache.tick;
    if cache.graphs.get_mut(&dry.signature, tick).is_none() {
        drop(cache);
        let graph = capture(b, kv, plan, step, dry)?;
        cache = b.graph_cache()?;
        if cache.graphs.len() >= MAX_GRAPHS {
            cache.graphs.evict_oldest();
        }
        cache.captures += 1;
        crate::graph_metrics::captured();
        cache.graphs.insert(&dry.signature, Captured(graph), tick);
    }
    let t0 = Instant::now();
    b.gpu.copy_staged(dry)?;
    let Captured(graph) = cache
        .graphs
        .get_mut(&dry.signature, tick)
        .ok_or_else(|| BackendError::Device("captured graph missing".into()))?;
    graph.launch().map_err(dev_err)?;
    cache.replays += 1;
    crate::graph_metrics::replayed();
    cache.phases.submit += t0.elapsed().as_secs_f64();
    drop(cache);
    step_output::fetch(b, out, step.outs)
}

fn capture(
    b: &CudaBackend,
    kv: &mut GpuKv,
    plan: &BatchPlan,
    step: &mut Step<'_, '_>,
    dry: &StepRecord,
) -> BResult<CudaGraph> {
    let stream = &b.gpu.stream;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(dev_err)?;
    let traced = pass(b, kv, plan, step, StepMode::Capture);
    let planted = plant_write(b, kv);
    // End the capture whatever happened, so the stream is usable again.
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    let (rec, _) = traced?;
    planted?;
    same_work(dry, &rec, "captured")?;
    let graph = ended
        .map_err(dev_err)?
        .ok_or_else(|| BackendError::Device("stream capture produced no graph".into()))?;
    graph.upload().map_err(dev_err)?;
    Ok(graph)
}

/// Test only: a write of 0xA5 over the planted page, recorded into the graph being captured
/// (every replay then repeats it), as a kernel of the step writing out of bounds would.
#[allow(unsafe_code)]
fn plant_write(b: &CudaBackend, kv: &GpuKv) -> BResult<()> {
    let Some(page) = b.take_planted_write()? else {
        return Ok(());
    };
    let r = kv.page_range_of(page)?;
    // SAFETY: `r` lies inside the page buffer (checked by page_range_of); the memset is
    // recorded into the capture on this stream.
    unsafe {
        cudarc::driver::result::memset_d8_async(
            kv.pages.ptr() + r.start as u64,
            0xA5,
            r.len(),
            b.gpu.stream.cu_stream(),
        )
    }
    .map_err(dev_err)
}

/// Pages and state slots a plan's sequences own.
fn touched(plan: &BatchPlan) -> (Vec<PageId>, Vec<StateSlot>) {
    let mut pages: Vec<PageId> = plan
        .seqs
        .iter()
        .flat_map(|s| s.pages.iter().copied())
        .collect();
    pages.sort_unstable();
    pages.dedup();
    let mut states: Vec<StateSlot> = plan.seqs.iter().map(|s| s.state).collect();
    states.sort_unstable();
    states.dedup();
    (pages, states)
}

type KvBytes = (Vec<Vec<u8>>, Vec<Vec<u8>>);

fn read_kv(
    b: &CudaBackend,
    kv: &GpuKv,
    pages: &[PageId],
    states: &[StateSlot],
) -> BResult<KvBytes> {
    let p = pages
        .iter()
        .map(|&p| kv.read_page(&b.gpu, p))
        .collect::<BResult<Vec<_>>>()?;
    let s = states
        .iter()
        .map(|&s| kv.read_state(&b.gpu, s))
        .collect::<BResult<Vec<_>>>()?;
    Ok((p, s))
}

fn write_kv(
    b: &CudaBackend,
    kv: &mut GpuKv,
    pages: &[PageId],
    states: &[StateSlot],
    bytes: &KvBytes,
) -> BResult<()> {
    for (&p, v) in pages.iter().zip(&bytes.0) {
        kv.write_page(&b.gpu, p, v)?;
    }
    for (&s, v) in states.iter().zip(&bytes.1) {
        kv.write_state(&b.gpu, s, v)?;
    }
    Ok(())
}

/// Why a graph replay and an eager run of the same step differ, if they do.
fn first_difference(
    eager: (&StepOutput, &KvBytes),
    graph: (&StepOutput, &KvBytes),
    pages: &[PageId],
    states: &[StateSlot],
) -> Option<String> {
    let bits = |t: &StepOutput| {
        t.logits
            .data
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    let (le, lg) = (bits(eager.0), bits(graph.0));
    if let Some(i) = le.iter().zip(&lg).position(|(a, b)| a != b) {
        let cols = eager.0.logits.cols.max(1);
        return Some(format!("logits row {} column {}", i / cols, i % cols));
    }
    if let Some(r) = (0..eager.0.argmax.len()).find(|&r| eager.0.argmax[r] != graph.0.argmax[r]) {
        return Some(format!("greedy id of row {r}"));
    }
    if let Some(i) = (0..pages.len()).find(|&i| eager.1 .0[i] != graph.1 .0[i]) {
        return Some(format!("Page({})", pages[i]));
    }
    if let Some(i) = (0..states.len()).find(|&i| eager.1 .1[i] != graph.1 .1[i]) {
        return Some(format!("State({})", states[i]));
    }
    None
}

/// [`pdserve_engine::backend::StepRunner::decode_step`] of the CUDA backend.
pub(crate) fn decode_step(
    b: &CudaBackend,
    kv: &mut GpuKv,
    plan: &BatchPlan,
    outs: &[RowOut],
    forward: &mut StepForward<'_, CudaBackend>,
) -> BResult<StepOutput> {
    DevPlan::validate(kv, plan)?;
    check_outs(plan.rows(), outs)?;
    let step = &mut Step { forward, outs };
    let n = plan.seqs.len();
    for (i, s) in plan.seqs.iter().enumerate() {
        if s.len != 1 || s.row0 != i || plan.rows() != n {
            return Err(crate::buf::shape_err(
                "decode_step",
                format!(
                    "sequence {i} has {} rows at row {}; a decode step has one row per sequence",
                    s.len, s.row0
                ),
            ));
        }
        let needed = s.start / kv.page_tokens.max(1);
        if needed >= s.pages.len() {
            return Err(BackendError::Kv(format!(
                "position {} needs page {needed}, sequence holds {}",
                s.start,
                s.pages.len()
            )));
        }
    }
    let t0 = Instant::now();
    let padded = pad_plan(plan, bucket(n), kv.dummy_page(), kv.dummy_state());
    let (dry, out) = dry_pass(b, kv, &padded, step)?;
    let step_no = {
        let mut c = b.graph_cache()?;
        c.phases.steps += 1;
        c.phases.dry += t0.elapsed().as_secs_f64();
        c.phases.steps
    };
    match (b.graph_mode(), b.verifies_step(step_no)) {
        (GraphMode::Eager, _) => eager(b, kv, &padded, step, &dry),
        (GraphMode::Capture, false) => replay(b, kv, &padded, step, &dry, out),
        (GraphMode::Capture, true) => {
            let (pages, states) = touched(plan);
            let before = read_kv(b, kv, &pages, &states)?;
            let le = eager(b, kv, &padded, step, &dry)?;
            let ke = read_kv(b, kv, &pages, &states)?;
            write_kv(b, kv, &pages, &states, &before)?;
            let lg = replay(b, kv, &padded, step, &dry, out)?;
            let kg = read_kv(b, kv, &pages, &states)?;
            match first_difference((&le, &ke), (&lg, &kg), &pages, &states) {
                None => Ok(lg),
                Some(what) => {
                    // Keep the eager result (the reference), drop the graph so that the
                    // next step of this signature captures afresh, and count it.
                    write_kv(b, kv, &pages, &states, &ke)?;
                    let mut c = b.graph_cache()?;
                    c.graphs.remove(&dry.signature);
                    c.verify_mismatches += 1;
                    drop(c);
                    crate::graph_metrics::verify_mismatched();
                    tracing::error!(
                        sequences = n,
                        differs_at = %what,
                        "--verify-graphs: graph replay and eager run of a decode step differ; kept the eager result, dropped the graph"
                    );
                    Ok(le)
                }
            }
        }
    }
}

/// Decode steps replayed from captured graphs (`--cuda-graph`).
impl StepRunner for CudaBackend {
    fn decode_step(
        &self,
        kv: &mut GpuKv,
        plan: &BatchPlan,
        outs: &[RowOut],
        forward: &mut StepForward<'_, Self>,
    ) -> BResult<StepOutput> {
        decode_step(self, kv, plan, outs, forward)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn plan(starts: &[usize], pages: &[usize]) -> BatchPlan {
        let mut p = BatchPlan::default();
        for (i, (&s, &n)) in starts.iter().zip(pages).enumerate() {
            p.seqs.push(SeqPlan {
                start: s,
                len: 1,
                row0: i,
                pages: (0..n as PageId).map(|x| x + 10 * i as PageId).collect(),
                state: i as StateSlot,
            });
            p.tokens.push(5 + i as u32);
            p.positions.push(s);
            p.row_seq.push(i);
        }
        p
    }

    #[test]
    fn buckets_cover_every_batch_size_with_few_shapes() {
        for n in 1..=600 {
            let b = bucket(n);
            assert!(b >= n, "bucket({n}) = {b}");
            assert!(b <= n * 2 || n <= 2, "bucket({n}) = {b} wastes too much");
        }
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(3), 4);
        assert_eq!(bucket(64), 64);
        assert_eq!(bucket(65), 96);
        assert_eq!(bucket(300), 320);
        let distinct: std::collections::BTreeSet<usize> = (1..=256).map(bucket).collect();
        assert_eq!(distinct.len(), 14);
    }

    #[test]
    fn padding_adds_dummy_rows_and_equal_page_tables() {
        let p = plan(&[37, 300, 5], &[1, 2, 1]);
        let padded = pad_plan(&p, 8, 99, 7);
        assert_eq!(padded.rows(), 8);
        assert_eq!(padded.seqs.len(), 8);
        // Real sequences keep their pages and positions, padded with the dummy page.
        assert_eq!(padded.seqs[1].pages, vec![10, 11, 99, 99]);
        assert_eq!(padded.seqs[0].start, 37);
        assert_eq!(padded.positions[..3], [37, 300, 5]);
        assert_eq!(padded.tokens[..3], [5, 6, 7]);
        for (i, s) in padded.seqs.iter().enumerate().skip(3) {
            assert_eq!((s.start, s.len, s.row0, s.state), (0, 1, i, 7));
            assert_eq!(s.pages, vec![99; 4]);
            assert_eq!(padded.row_seq[i], i);
        }
        // Every page table has one length, so the staged plan has one size per bucket.
        assert!(padded.seqs.iter().all(|s| s.pages.len() == 4));
        let longer = pad_plan(&plan(&[1], &[5]), 1, 99, 7);
        assert_eq!(longer.seqs[0].pages.len(), 8);
    }
}
