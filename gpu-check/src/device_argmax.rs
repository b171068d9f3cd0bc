//! Sampling on the device (`pdserve gpu-check --only graphs`): the greedy token a CUDA
//! decode step computes (`k_argmax_rows`, inside the step's graph) against
//! `sampling::argmax` on the host, bit for bit: on chosen rows (ties, NaN, infinities,
//! signed zeros, V4's vocabulary) and on the logits of real decode steps of the embedded
//! model, every row asking for both its logits and its device argmax, over random batches
//! (most of them padded to a bucket), replayed from graphs and eager.

use crate::check::CheckRow;
use pdserve_engine::backend::{
    BatchPlan, HostTensor, KvStorage, RowArgmax, RowOut, SeqPlan, StepRunner,
};
use pdserve_engine::checkpoint::Checkpoint;
use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{KvLayout, KvLayoutSpec};
use pdserve_engine::model::{Model, ModelWeights};
use pdserve_kernels::graphs::bucket;
use pdserve_kernels::{CudaBackend, GraphMode};
use std::collections::BTreeSet;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Sequences the random batches are drawn from.
const SEQS: usize = 12;

fn row(name: String, rows: usize, same: usize, pass: bool) -> CheckRow {
    CheckRow {
        name,
        rows,
        max_rel_err: 0.0,
        worst_row: 0,
        greedy_same: same,
        near_ties: 0,
        pass,
        gate: true,
    }
}

/// Rows of `cols` logits that probe the argmax rule's corners.
fn chosen_rows(cols: usize) -> Vec<Vec<f32>> {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let last = cols - 1;
    let mut out = Vec::new();
    let mut with = |base: f32, set: &[(usize, f32)]| {
        let mut r = vec![base; cols];
        for &(i, v) in set {
            if i < cols {
                r[i] = v;
            }
        }
        out.push(r);
    };
    with(0.0, &[(7, 3.0), (300, 3.0), (last, 3.0)]);
    with(0.0, &[(last, 1.0)]);
    with(-1.0, &[(0, 2.0), (last, 2.0)]);
    with(-inf, &[]);
    with(nan, &[]);
    with(-inf, &[(last, -1e30)]);
    with(nan, &[(cols / 2, -5.0)]);
    with(0.0, &[(2, nan), (5, inf), (9, inf)]);
    with(-1.0, &[(3, -0.0), (1, 0.0)]);
    with(-1.0, &[(1, -0.0), (3, 0.0)]);
    // Few distinct values, NaNs and -inf among them: many ties spread over every thread.
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    out.push(
        (0..cols)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                match x % 7 {
                    0 => nan,
                    1 => -inf,
                    k => k as f32,
                }
            })
            .collect(),
    );
    out
}

/// The device argmax of chosen rows at several vocabulary sizes against the host's.
fn chosen(b: &CudaBackend) -> AnyResult<CheckRow> {
    let (mut rows, mut same) = (0, 0);
    for cols in [1, 300, 512, 1000, 129_280] {
        let want: Vec<Vec<f32>> = chosen_rows(cols);
        let host: Vec<RowArgmax> = want.iter().map(|r| RowArgmax::of(r)).collect();
        let t = HostTensor {
            rows: want.len(),
            cols,
            data: want.concat(),
        };
        let got = b.argmax_rows(t)?;
        for (r, (g, h)) in got.iter().zip(&host).enumerate() {
            if g == h {
                same += 1;
            } else {
                eprintln!(
                    "device argmax, {cols} columns, chosen row {r}: device {g:?}, host {h:?}"
                );
            }
        }
        rows += host.len();
    }
    Ok(row(
        "device argmax == host argmax, chosen rows (ties, NaN, inf)".into(),
        rows,
        same,
        same == rows,
    ))
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
}

/// `steps` decode steps of random subsets of [`SEQS`] sequences (each starting at position
/// 0, fed its host-argmax token), every row returning both logits and device argmax.
fn decode_steps(ordinal: usize, mode: GraphMode, steps: usize) -> AnyResult<CheckRow> {
    let dir = pdserve_engine::embedded::model_dir()?;
    let cfg = ModelConfig::from_model_dir(&dir)?;
    let mut b = CudaBackend::new(ordinal, None)?;
    b.set_graph_mode(mode);
    let model = Model::new(
        cfg.clone(),
        ModelWeights::load(&Checkpoint::open(&dir)?, &cfg, &b)?,
    );
    let layout = KvLayout::new(&cfg, KvLayoutSpec::default_for(&cfg))?;
    let per_seq = layout.pages_for(steps + 1);
    let mut kv = b.alloc_kv(&layout, SEQS * per_seq, SEQS)?;
    for s in 0..SEQS {
        b.reset_state(&mut kv, s as u32)?;
    }
    let mut pos = [0usize; SEQS];
    let mut next: Vec<u32> = (0..SEQS)
        .map(|i| (i * 37 % cfg.vocab_size) as u32)
        .collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ steps as u64);
    let (mut rows, mut same, mut padded) = (0, 0, 0);
    let mut sizes = BTreeSet::new();
    for _ in 0..steps {
        let mut pick: Vec<usize> = (0..SEQS).collect();
        for i in (1..SEQS).rev() {
            pick.swap(i, rng.below(i + 1));
        }
        pick.truncate(1 + rng.below(SEQS));
        let n = pick.len();
        sizes.insert(n);
        padded += usize::from(bucket(n) != n);
        let plan = BatchPlan {
            seqs: pick
                .iter()
                .enumerate()
                .map(|(r, &s)| SeqPlan {
                    start: pos[s],
                    len: 1,
                    row0: r,
                    pages: (0..layout.pages_for(pos[s] + 1))
                        .map(|p| (s * per_seq + p) as u32)
                        .collect(),
                    state: s as u32,
                })
                .collect(),
            tokens: pick.iter().map(|&s| next[s]).collect(),
            positions: pick.iter().map(|&s| pos[s]).collect(),
            row_seq: (0..n).collect(),
            cuts: None,
        };
        let out = b.decode_step(
            &mut kv,
            &plan,
            &vec![RowOut::BOTH; n],
            &mut |bk: &CudaBackend,
                  kv: &mut <CudaBackend as KvStorage>::KvStore,
                  plan: &BatchPlan| {
                let all: Vec<usize> = (0..plan.rows()).collect();
                model.forward_device(bk, kv, &layout, plan, &all)
            },
        )?;
        let cols = out.logits.cols.max(1);
        for ((r, &s), logits) in pick.iter().enumerate().zip(out.logits.data.chunks(cols)) {
            let host = RowArgmax::of(logits);
            let device = out.argmax.get(r).copied().flatten();
            if device == Some(host) {
                same += 1;
            } else {
                eprintln!("device argmax, {mode} step of {n} rows, row {r}: device {device:?}, host {host:?}");
            }
            rows += 1;
            next[s] = host.token.unwrap_or(0);
            pos[s] += 1;
        }
    }
    let replayed = mode == GraphMode::Eager || b.graph_stats().replays > 0;
    Ok(row(
        format!(
            "device argmax == host, {steps} {mode} steps ({}-{} rows, {padded} padded)",
            sizes.first().copied().unwrap_or(0),
            sizes.last().copied().unwrap_or(0),
        ),
        rows,
        same,
        same == rows && replayed,
    ))
}

/// The device-sampling rows of the graphs group.
pub fn check_device_argmax(ordinal: usize) -> AnyResult<Vec<CheckRow>> {
    let b = CudaBackend::new(ordinal, None)?;
    Ok(vec![
        chosen(&b)?,
        decode_steps(ordinal, GraphMode::Capture, 80)?,
        decode_steps(ordinal, GraphMode::Eager, 30)?,
    ])
}
