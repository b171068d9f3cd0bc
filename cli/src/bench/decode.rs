//! `pdserve bench decode`: decode step time over batch sizes, contexts and graph modes,
//! against the floor `bytes the step must read / measured memory bandwidth`.

use super::config::ModelFlags;
use super::device::{self, BenchBackend};
use super::peer::{self, Peer};
use super::sampled::{finite_checked, row_outs, Sample};
use super::stats::median;
use super::table::{mb, num, Table};
use super::traffic::{step_bytes, StepBytes};
use super::{kvfill, progress, Prepared};
use anyhow::{bail, Context, Result};
use pdserve_engine::backend::{BatchPlan, SeqPlan};
use pdserve_engine::kv::checksum::sections;
use pdserve_engine::kv::KvLayout;
use pdserve_kernels::GraphMode;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub model: ModelFlags,
    /// Batch sizes (sequences decoding one token each per step), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128,256")]
    pub batch: Vec<usize>,
    /// Contexts: every sequence decodes starting at this position, its KV pages and state
    /// filled with random values (no prefill), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4096,32768")]
    pub context: Vec<usize>,
    /// Decode step modes: capture (replayed CUDA graphs) and/or eager, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "capture,eager")]
    pub graph: Vec<GraphMode>,
    /// Timed decode steps per row (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed decode steps before each row's timed ones.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Where each step's tokens are sampled: `device` asks for every row's greedy token
    /// (the CUDA backend takes the argmax inside the step and copies only ids back, as the
    /// decode server does for greedy requests), `host` copies every row's logits back.
    #[arg(long, value_enum, default_value = "device")]
    pub sample: Sample,
    /// JSON written by scripts/peer_bench.py: adds the peer's ms/step and our speed-up.
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Also write the rows (and the measured bandwidth) as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also draw the rows against their floor as an SVG figure at this path (ms/step
    /// against batch, one panel per context; `bench plot` redraws it from a --json file).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// One row of the decode table.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DecodeRow {
    pub batch: usize,
    pub context: usize,
    /// The `--weights` format of the model the row ran.
    pub weights: String,
    pub mode: String,
    pub ms_per_step: f64,
    /// Median host time of a step: its wall time less the time it waited on the device.
    pub host_ms: f64,
    /// Median time of a step's dry pass (the forward's host code; 0 where the backend
    /// has none, as the CPU). Absent from records made before it was measured.
    #[serde(default)]
    pub dry_ms: f64,
    /// Median time of a step's submission: eager launches, or the staged-input copy and
    /// the graph launch.
    #[serde(default)]
    pub submit_ms: f64,
    pub tokens_per_s: f64,
    pub experts_per_layer: f64,
    pub weight_bytes: f64,
    pub kv_bytes: f64,
    pub floor_ms: f64,
    pub logits_finite: bool,
}

/// The batch plan of one decode step: sequence `i` holds pages
/// `i * pages_per_seq ..` and state slot `i`, and decodes `tokens[i]` at `pos`.
pub fn step_plan(layout: &KvLayout, pages_per_seq: usize, pos: usize, tokens: &[u32]) -> BatchPlan {
    let n = tokens.len();
    let held = layout.pages_for(pos + 1);
    BatchPlan {
        seqs: (0..n)
            .map(|i| SeqPlan {
                start: pos,
                len: 1,
                row0: i,
                pages: (0..held).map(|p| (i * pages_per_seq + p) as u32).collect(),
                state: i as u32,
            })
            .collect(),
        tokens: tokens.to_vec(),
        positions: vec![pos; n],
        row_seq: (0..n).collect(),
        cuts: None,
    }
}

/// A whole `bench decode` run: what `--json` writes and `bench plot` reads back.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DecodeRecord {
    pub device: String,
    pub memory_bandwidth_bytes_per_s: f64,
    pub memory_bandwidth_how: String,
    pub rows: Vec<DecodeRow>,
    pub kv_canary: CanaryCost,
}

/// The KV pool every row decodes in: `max_batch` sequences of `pages_per_seq` pages each.
struct Pool<'a> {
    layout: &'a KvLayout,
    pages_per_seq: usize,
    max_batch: usize,
    /// Page and state contents the rows' sequences cycle through.
    variants: Vec<(Vec<u8>, Vec<u8>)>,
}

pub fn run<B: BenchBackend>(a: &DecodeArgs, mut backend: B) -> Result<DecodeRecord> {
    if a.batch.is_empty() || a.context.is_empty() || a.graph.is_empty() {
        bail!("--batch, --context and --graph each need at least one value");
    }
    if a.batch.contains(&0) || a.steps == 0 {
        bail!("--batch values and --steps must be at least 1");
    }
    super::check_output(a.json.as_deref(), "--json")?;
    super::check_output(a.plot.as_deref(), "--plot")?;
    let formats = a.model.per_format()?;
    // The formats change the weights only: one config decides positions, the peer check
    // and the KV layout for all of them.
    let first = formats.first().context("--weights needs a format")?;
    let cfg = first.config()?;
    let layout = first.layout(&cfg)?;
    let span = a.warmup + a.steps;
    let max_c = a.context.iter().copied().max().unwrap_or(0);
    if max_c + span >= cfg.max_position_embeddings {
        bail!(
            "--context {max_c} + {span} steps reaches the model's {} positions",
            cfg.max_position_embeddings
        );
    }
    let peer: Option<Peer> = a.peer.as_deref().map(|p| peer::load(p, &cfg)).transpose()?;
    if let Some(p) = &peer {
        println!("peer: {}", p.label);
    }
    let bw = backend.memory_bandwidth()?;
    println!("memory bandwidth: {:.1} GB/s ({})", bw.rate / 1e9, bw.how);

    let max_b = a.batch.iter().copied().max().unwrap_or(1);
    let pages_per_seq = layout.pages_for(max_c + span + 1);
    let pages = max_b * pages_per_seq;
    println!(
        "KV pool: {max_b} sequences x {pages_per_seq} pages of {} B + state slots of {} B = {}",
        layout.page_bytes,
        layout.state_bytes,
        super::table::size(pool_bytes(&layout, pages_per_seq, max_b) as f64)
    );
    println!(
        "sampling: {}",
        match (a.sample, a.warmup) {
            (Sample::Host, _) => "every row's logits copied back (--sample host)",
            (Sample::Device, 0) =>
                "greedy tokens from the backend (--sample device); not checked against the host (--warmup 0)",
            (Sample::Device, _) =>
                "greedy tokens from the backend (--sample device), checked against the host's argmax of the same logits on each row's first warmup step",
        }
    );
    let mut kv = backend.alloc_kv(&layout, pages, max_b)?;
    let pool = Pool {
        layout: &layout,
        pages_per_seq,
        max_batch: max_b,
        variants: (0..8)
            .map(|v| {
                (
                    kvfill::page(&layout, a.model.seed ^ v),
                    kvfill::state(&layout, a.model.seed ^ v),
                )
            })
            .collect(),
    };
    let total_steps =
        (formats.len() * a.context.len() * a.batch.len() * a.graph.len() * span) as u64;
    let bar = progress(total_steps, "decode steps");
    let mut rows = Vec::new();
    for f in &formats {
        rows.extend(run_format(
            a,
            f,
            &mut backend,
            &mut kv,
            &pool,
            bw.rate,
            &bar,
        )?);
    }
    bar.finish_and_clear();
    let canary = canary_cost(&backend, &kv, &layout, bw.rate)?;
    println!("{}", table(&rows, peer.as_ref()));
    println!("{}", canary.describe());
    if let Some(t) = graph_speedups(&rows) {
        println!("CUDA graphs against eager launches:\n{t}");
    }
    let record = DecodeRecord {
        device: backend.name(),
        memory_bandwidth_bytes_per_s: bw.rate,
        memory_bandwidth_how: bw.how,
        rows,
        kv_canary: canary,
    };
    if let Some(path) = &a.json {
        super::write_json(path, &serde_json::to_value(&record)?)?;
    }
    if let Some(path) = &a.plot {
        super::plot::write_svg(path, &super::plot::decode_svg(&record)?)?;
        println!("plot: {}", path.display());
    }
    Ok(record)
}

/// Bytes of a pool of `max_batch` sequences x `pages_per_seq` pages plus one state slot
/// each: what the largest row set of a run holds at once.
pub fn pool_bytes(layout: &KvLayout, pages_per_seq: usize, max_batch: usize) -> usize {
    max_batch * (pages_per_seq * layout.page_bytes + layout.state_bytes)
}

/// Every row of one weights format: its model loaded, the pool filled per context.
fn run_format<B: BenchBackend>(
    a: &DecodeArgs,
    flags: &ModelFlags,
    backend: &mut B,
    kv: &mut B::KvStore,
    pool: &Pool,
    bandwidth: f64,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<DecodeRow>> {
    let format = flags.format()?.to_string();
    bar.set_message(format!("loading {format} weights"));
    let p = Prepared::new(flags, backend)?;
    let (cfg, layout) = (&p.model.cfg, pool.layout);
    if p.layout.fingerprint() != layout.fingerprint() {
        bail!("--weights {format} changes the KV layout; run it on its own");
    }
    let span = a.warmup + a.steps;
    let wb = device::weight_bytes_on(cfg, backend);
    let tid2eid: Vec<Option<&[u32]>> = p
        .model
        .weights
        .layers
        .iter()
        .map(|l| l.tid2eid.as_deref())
        .collect();

    let mut rows = Vec::new();
    for &c in &a.context {
        bar.set_message(format!("filling KV for context {c}"));
        for s in 0..pool.max_batch {
            for pg in 0..layout.pages_for(c + span + 1) {
                let (page, _) = &pool.variants[(s + pg) % pool.variants.len()];
                backend.write_page(kv, (s * pool.pages_per_seq + pg) as u32, page)?;
            }
            let (_, state) = &pool.variants[s % pool.variants.len()];
            backend.write_state(kv, s as u32, state)?;
        }
        for &b in &a.batch {
            for &mode in &a.graph {
                bar.set_message(format!("{format} batch {b} context {c} {mode}"));
                let label = backend.apply_graph_mode(mode);
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
                    a.model.seed ^ ((c as u64) << 20) ^ b as u64,
                );
                let (mut times, mut bytes, mut finite) = (Vec::new(), StepBytes::default(), true);
                let (mut host, mut dry, mut submit) = (Vec::new(), Vec::new(), Vec::new());
                for step in 0..span {
                    let pos = c + step;
                    let tokens: Vec<u32> = (0..b)
                        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
                        .collect();
                    let plan = step_plan(layout, pool.pages_per_seq, pos, &tokens);
                    let model = &p.model;
                    let outs = row_outs(a.sample, b, step == 0);
                    let t = Instant::now();
                    let before = backend.step_phases();
                    let out = backend.decode_step(
                        kv,
                        &plan,
                        &outs,
                        &mut |bk: &B, kv: &mut B::KvStore, plan: &BatchPlan| {
                            let all: Vec<usize> = (0..plan.rows()).collect();
                            model.forward_device(bk, kv, layout, plan, &all)
                        },
                    )?;
                    backend.sync()?;
                    let dt = t.elapsed().as_secs_f64();
                    let phases = backend.step_phases() - before;
                    bar.inc(1);
                    let step_finite = finite_checked(&outs, &out)?;
                    if step < a.warmup {
                        continue;
                    }
                    times.push(dt);
                    host.push(dt - phases.wait);
                    dry.push(phases.dry);
                    submit.push(phases.submit);
                    finite &= step_finite;
                    let sb = step_bytes(cfg, layout, &wb, &tid2eid, &tokens, &plan.positions);
                    bytes.weights += sb.weights;
                    bytes.kv += sb.kv;
                    bytes.experts_per_layer += sb.experts_per_layer;
                }
                let n = times.len() as f64;
                let ms = median(times) * 1e3;
                let (w, k) = (bytes.weights as f64 / n, bytes.kv as f64 / n);
                rows.push(DecodeRow {
                    batch: b,
                    context: c,
                    weights: format.clone(),
                    mode: label,
                    ms_per_step: ms,
                    host_ms: median(host) * 1e3,
                    dry_ms: median(dry) * 1e3,
                    submit_ms: median(submit) * 1e3,
                    tokens_per_s: b as f64 / (ms / 1e3),
                    experts_per_layer: bytes.experts_per_layer / n,
                    weight_bytes: w,
                    kv_bytes: k,
                    floor_ms: (w + k) / bandwidth * 1e3,
                    logits_finite: finite,
                });
            }
        }
    }
    Ok(rows)
}

/// What the KV canary's checksums cost on this pool (`--kv-audit-every`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CanaryCost {
    pub page_bytes: f64,
    pub state_bytes: f64,
    /// Median time of one checksum pass over every page / every state slot.
    pub pages_ms: f64,
    pub states_ms: f64,
    /// Bytes per second of the page pass, against the measured memory bandwidth.
    pub pages_rate: f64,
    pub bandwidth: f64,
}

impl CanaryCost {
    fn describe(&self) -> String {
        format!(
            "KV canary on this pool: page pass {:.3} ms over {} ({:.0} GB/s, {:.0}% of the bandwidth), state pass {:.3} ms over {}.\n  Per step: 2 state passes + 2 page passes every N steps (--kv-audit-every N); the page pass scales with the pool, not the batch.",
            self.pages_ms,
            super::table::size(self.page_bytes),
            self.pages_rate / 1e9,
            100.0 * self.pages_rate / self.bandwidth,
            self.states_ms,
            super::table::size(self.state_bytes),
        )
    }
}

fn canary_cost<B: BenchBackend>(
    backend: &B,
    kv: &B::KvStore,
    layout: &pdserve_engine::kv::KvLayout,
    bandwidth: f64,
) -> Result<CanaryCost> {
    let time = |f: &dyn Fn() -> Result<Vec<u64>>| -> Result<(f64, usize)> {
        let mut n = f()?.len();
        let mut times = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            n = f()?.len();
            times.push(t.elapsed().as_secs_f64());
        }
        Ok((median(times) * 1e3, n))
    };
    let (pages_ms, page_sums) = time(&|| Ok(backend.page_checksums(kv)?))?;
    let (states_ms, state_sums) = time(&|| Ok(backend.state_checksums(kv)?))?;
    // Each region gives one checksum per section of it.
    let bytes_summed = |sums: usize, region: usize| (sums / sections(region) * region) as f64;
    let page_bytes = bytes_summed(page_sums, layout.page_bytes);
    Ok(CanaryCost {
        page_bytes,
        state_bytes: bytes_summed(state_sums, layout.state_bytes),
        pages_ms,
        states_ms,
        pages_rate: page_bytes / (pages_ms / 1e3),
        bandwidth,
    })
}

/// Eager step time over graph step time for every (batch, context, weights) run both ways with
/// graphs really applied (`None` when there is no such pair, e.g. on the CPU).
pub fn graph_speedups(rows: &[DecodeRow]) -> Option<Table> {
    let out: Vec<Vec<String>> = rows
        .iter()
        .filter(|r| r.mode == "capture")
        .filter_map(|g| {
            let e = rows.iter().find(|e| {
                e.mode == "eager"
                    && (e.batch, e.context, &e.weights) == (g.batch, g.context, &g.weights)
            })?;
            Some(vec![
                g.batch.to_string(),
                g.context.to_string(),
                g.weights.clone(),
                num(e.ms_per_step),
                num(g.ms_per_step),
                num(e.ms_per_step / g.ms_per_step),
            ])
        })
        .collect();
    (!out.is_empty()).then(|| Table {
        headers: vec![
            "batch",
            "context",
            "weights",
            "eager ms",
            "capture ms",
            "eager / capture",
        ],
        rows: out,
    })
}

pub fn table(rows: &[DecodeRow], peer: Option<&Peer>) -> Table {
    let mut headers = vec![
        "batch",
        "context",
        "weights",
        "mode",
        "ms/step",
        "host ms",
        "dry ms",
        "submit ms",
        "tok/s",
        "experts/layer",
        "weights MB",
        "KV MB",
        "floor ms",
        "x floor",
    ];
    if peer.is_some() {
        headers.extend(["peer ms", "speed-up vs peer"]);
    }
    headers.push("finite");
    let rows = rows
        .iter()
        .map(|r| {
            let mut v = vec![
                r.batch.to_string(),
                r.context.to_string(),
                r.weights.clone(),
                r.mode.clone(),
                num(r.ms_per_step),
                num(r.host_ms),
                num(r.dry_ms),
                num(r.submit_ms),
                num(r.tokens_per_s),
                num(r.experts_per_layer),
                mb(r.weight_bytes),
                mb(r.kv_bytes),
                num(r.floor_ms),
                num(r.ms_per_step / r.floor_ms),
            ];
            if let Some(p) = peer {
                match p.decode.get(&(r.batch, r.context)) {
                    Some(&ms) => v.extend([num(ms), num(ms / r.ms_per_step)]),
                    None => v.extend(["-".into(), "-".into()]),
                }
            }
            v.push(if r.logits_finite { "yes" } else { "NO" }.into());
            v
        })
        .collect();
    Table { headers, rows }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn row(batch: usize, mode: &str, ms: f64) -> DecodeRow {
        DecodeRow {
            batch,
            context: 4096,
            weights: "bf16".into(),
            mode: mode.into(),
            ms_per_step: ms,
            host_ms: ms / 10.0,
            dry_ms: ms / 20.0,
            submit_ms: ms / 40.0,
            tokens_per_s: batch as f64 / ms * 1e3,
            experts_per_layer: 6.0,
            weight_bytes: 1e9,
            kv_bytes: 1e6,
            floor_ms: 0.25,
            logits_finite: true,
        }
    }

    #[test]
    fn graph_speedup_pairs_capture_with_eager_rows() {
        let rows = vec![
            row(1, "capture", 1.0),
            row(1, "eager", 2.5),
            row(8, "capture", 2.0),
            row(64, "eager", 9.0),
            DecodeRow {
                weights: "fp8".into(),
                ..row(8, "eager", 4.0)
            },
        ];
        let t = graph_speedups(&rows).unwrap();
        assert_eq!(
            t.rows.len(),
            1,
            "batch 8 (bf16 against fp8) and 64 have no pair"
        );
        assert_eq!(t.rows[0], vec!["1", "4096", "bf16", "2.50", "1.00", "2.50"]);
        // CPU rows: graphs not applied, nothing to compare.
        let cpu = vec![
            row(1, "eager (cpu has no graphs)", 1.0),
            row(1, "eager", 1.0),
        ];
        assert!(graph_speedups(&cpu).is_none());
    }

    /// The default table (batch 1 to 256, contexts 4K and 32K) at the default model holds
    /// its whole pool at once: 256 sequences of 32K context with bf16 KV take 3.1 GB,
    /// beside 16.1 GB of bf16 weights, well inside an H200's 141 GB, so no default row is
    /// skipped for memory.
    #[test]
    fn the_default_table_fits_one_pool_on_an_h200() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            decode: DecodeArgs,
        }
        let a = <Cli as clap::Parser>::parse_from(["decode"]).decode;
        assert_eq!(a.batch, vec![1, 8, 32, 64, 128, 256]);
        assert_eq!(a.context, vec![4096, 32768]);
        assert_eq!((a.model.layers, a.model.experts), (4, 64));
        let cfg = a.model.config().unwrap();
        let layout = a.model.layout(&cfg).unwrap();
        let pages_per_seq = layout.pages_for(32768 + a.warmup + a.steps + 1);
        let bytes = pool_bytes(&layout, pages_per_seq, 256);
        eprintln!("default pool: {bytes} B");
        assert!((3.0e9..3.5e9).contains(&(bytes as f64)), "{bytes}");
    }

    #[test]
    fn plan_holds_the_pages_up_to_the_position() {
        let f = crate::bench::config::ModelFlags {
            device: "cpu".into(),
            layers: 4,
            experts: 4,
            tiny: true,
            seed: 0,
            kv_dtype: "bf16".into(),
            index_k_dtype: "bf16".into(),
            numerics: "transformers".into(),
            cuda_weights: "bf16".into(),
            weights: vec!["bf16".into()],
            deterministic: false,
            attention: "auto".into(),
            expert_kernel: "auto".into(),
            dense_kernel: "auto".into(),
            expert_lanes: pdserve_kernels::DEFAULT_LANES,
            no_pdl: false,
            indexer: "auto".into(),
        };
        let cfg = f.config().unwrap();
        let layout = f.layout(&cfg).unwrap();
        let pt = layout.page_tokens;
        let p = step_plan(&layout, 10, pt, &[3, 4]);
        assert_eq!(p.rows(), 2);
        // Position page_tokens is the first of the second page.
        assert_eq!(p.seqs[0].pages, vec![0, 1]);
        assert_eq!(p.seqs[1].pages, vec![10, 11]);
        assert_eq!(
            (p.seqs[1].state, p.seqs[1].row0, p.seqs[1].start),
            (1, 1, pt)
        );
        assert_eq!(p.positions, vec![pt, pt]);
        assert_eq!(p.row_seq, vec![0, 1]);
    }
}
