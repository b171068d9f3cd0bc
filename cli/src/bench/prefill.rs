//! `pdserve bench prefill`: one sequence of N random tokens prefilled in one forward (or in
//! chunks of `--chunk` tokens, one forward each, as the prefill server runs long prompts),
//! tokens/s and the fraction of the GEMM rate measured in the same run.

use super::config::ModelFlags;
use super::device::BenchBackend;
use super::peer::{self, Peer};
use super::stats::median;
use super::table::{num, Table};
use super::traffic::prefill_flops;
use super::{progress, Prepared};
use anyhow::{bail, Context, Result};
use pdserve_engine::backend::{BatchPlan, Cut, SeqPlan};
use pdserve_engine::kv::KvLayout;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub model: ModelFlags,
    /// Prompt lengths, comma-separated: each is one sequence prefilled in one forward.
    #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
    pub tokens: Vec<usize>,
    /// Timed prefills per length (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Untimed prefills per length first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Prefill each prompt in chunks of at most this many tokens, one forward per chunk
    /// (its keys and compressor state carried to the next, as the prefill server's
    /// `--chunked-prefill-size` does); 0: the whole prompt in one forward. The time covers every
    /// chunk.
    #[arg(long, default_value_t = 0)]
    pub chunk: usize,
    /// Also write the state at every multiple of this many positions inside each forward
    /// and read those states' live bytes back after it, as the prefill server's prefix
    /// cache does at its page boundaries (its cuts: the KV page's tokens, 256 for the
    /// bench's layout); 0: no cuts. The time covers both; the read-back is also reported
    /// alone.
    #[arg(long, default_value_t = 0)]
    pub cut_every: usize,
    /// Leave the device idle this many milliseconds before each prefill (outside the
    /// time), as it is before a server's request that arrives alone: how much slower a
    /// forward starts from idle than back to back.
    #[arg(long, default_value_t = 0)]
    pub pause_ms: u64,
    /// JSON written by scripts/peer_bench.py: adds the peer's seconds and our speed-up.
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Also write the rows (and the measured GEMM rate) as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also draw the rows against the GEMM rate as an SVG figure at this path (TFLOP/s
    /// against prompt length; `bench plot` redraws it from a --json file).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PrefillRow {
    pub tokens: usize,
    /// Tokens per forward (`--chunk`; the whole prompt when it ran in one).
    #[serde(default)]
    pub chunk: usize,
    /// `--cut-every` (0: no cuts).
    #[serde(default)]
    pub cut_every: usize,
    /// Cuts over all the prompt's forwards.
    #[serde(default)]
    pub cuts: usize,
    /// Median seconds of reading the cuts' states back (inside `seconds`).
    #[serde(default)]
    pub cut_read_seconds: f64,
    /// The `--weights` format of the model the row ran.
    pub weights: String,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub flops_per_token: f64,
    pub tflops: f64,
    /// Of the GEMM rate of the weights' format (`gemm_rate_of`).
    pub gemm_fraction: f64,
    /// Which measured rate `gemm_fraction` is of: `bf16`, or `fp8` for the stored FP8
    /// formats where the device has an FP8 GEMM (the bf16 rate otherwise).
    #[serde(default)]
    pub gemm_rate_of: String,
    pub logits_finite: bool,
}

/// The measured GEMM rates a row's fraction can be of.
struct Rates {
    bf16: f64,
    fp8: Option<f64>,
}

impl Rates {
    /// The rate of weights `format` (FP8 for the stored FP8 formats, whose experts are FP8
    /// or FP4: Hopper has no faster GEMM for FP4) and its name.
    fn of(&self, format: &str) -> (f64, &'static str) {
        match (format.starts_with("fp8"), self.fp8) {
            (true, Some(r)) => (r, "fp8"),
            _ => (self.bf16, "bf16"),
        }
    }
}

/// A whole `bench prefill` run: what `--json` writes and `bench plot` reads back.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PrefillRecord {
    pub device: String,
    pub gemm_flops_per_s: f64,
    pub gemm_how: String,
    /// The FP8 GEMM rate, measured when a stored FP8 format ran on a device with one.
    #[serde(default)]
    pub fp8_gemm_flops_per_s: Option<f64>,
    #[serde(default)]
    pub fp8_gemm_how: Option<String>,
    pub rows: Vec<PrefillRow>,
}

pub fn run<B: BenchBackend>(a: &PrefillArgs, backend: B) -> Result<PrefillRecord> {
    if a.tokens.is_empty() || a.tokens.contains(&0) || a.repeats == 0 {
        bail!("--tokens needs lengths >= 1 and --repeats at least 1");
    }
    super::check_output(a.json.as_deref(), "--json")?;
    super::check_output(a.plot.as_deref(), "--plot")?;
    let formats = a.model.per_format()?;
    let cfg = formats
        .first()
        .context("--weights needs a format")?
        .config()?;
    let max_t = a.tokens.iter().copied().max().unwrap_or(1);
    if max_t > cfg.max_position_embeddings {
        bail!(
            "--tokens {max_t} exceeds the model's {} positions",
            cfg.max_position_embeddings
        );
    }
    let peer: Option<Peer> = a.peer.as_deref().map(|p| peer::load(p, &cfg)).transpose()?;
    if let Some(p) = &peer {
        println!("peer: {}", p.label);
    }
    let gemm = backend.gemm_rate()?;
    println!("GEMM rate: {:.1} TFLOP/s ({})", gemm.rate / 1e12, gemm.how);
    let fp8 = match a.model.weights.iter().any(|w| w.starts_with("fp8")) {
        // Without it the FP8 rows are measured against the bf16 rate, and say so.
        true => backend.fp8_gemm_rate().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "no FP8 GEMM rate: the fp8 rows are of the bf16 rate");
            None
        }),
        false => None,
    };
    if let Some(f) = &fp8 {
        println!("FP8 GEMM rate: {:.1} TFLOP/s ({})", f.rate / 1e12, f.how);
    }
    let rates = Rates {
        bf16: gemm.rate,
        fp8: fp8.as_ref().map(|f| f.rate),
    };
    let total = formats.len() * a.tokens.len() * (a.warmup + a.repeats);
    let bar = progress(total as u64, "prefills");
    let mut rows = Vec::new();
    for f in &formats {
        rows.extend(run_format(a, f, &backend, &rates, &bar)?);
    }
    bar.finish_and_clear();
    println!("{}", table(&rows, peer.as_ref()));
    let record = PrefillRecord {
        device: backend.name(),
        gemm_flops_per_s: gemm.rate,
        gemm_how: gemm.how,
        fp8_gemm_flops_per_s: fp8.as_ref().map(|f| f.rate),
        fp8_gemm_how: fp8.map(|f| f.how),
        rows,
    };
    if let Some(path) = &a.json {
        super::write_json(path, &serde_json::to_value(&record)?)?;
    }
    if let Some(path) = &a.plot {
        super::plot::write_svg(path, &super::plot::prefill_svg(&record)?)?;
        println!("plot: {}", path.display());
    }
    Ok(record)
}

/// Every prompt length on one weights format's model.
fn run_format<B: BenchBackend>(
    a: &PrefillArgs,
    flags: &ModelFlags,
    backend: &B,
    rates: &Rates,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<PrefillRow>> {
    let format = flags.format()?.to_string();
    let (gemm_rate, rate_of) = rates.of(&format);
    bar.set_message(format!("loading {format} weights"));
    let p = Prepared::new(flags, backend)?;
    let (cfg, layout) = (&p.model.cfg, &p.layout);
    let max_t = a.tokens.iter().copied().max().unwrap_or(1);
    let span = layout.longest_ring();
    // Scratch slots for the most cuts one forward has.
    let longest_forward = if a.chunk == 0 {
        max_t
    } else {
        a.chunk.min(max_t)
    };
    let max_cuts = longest_forward.checked_div(a.cut_every).unwrap_or(0);
    let mut kv = backend.alloc_kv(layout, layout.pages_for(max_t), 1 + max_cuts)?;
    let live = layout.state_ranges_live_at_cut();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.model.seed);
    let mut rows = Vec::new();
    for &n in &a.tokens {
        bar.set_message(format!("{format} {n} tokens"));
        let tokens: Vec<u32> = (0..n)
            .map(|_| rng.random_range(0..cfg.vocab_size as u32))
            .collect();
        let per = if a.chunk == 0 { n } else { a.chunk.min(n) };
        let mut plans: Vec<BatchPlan> = (0..n)
            .step_by(per)
            .map(|s| chunk_plan(layout, &tokens, s, per.min(n - s)))
            .collect();
        let mut cuts = 0;
        for plan in &mut plans {
            let c = chunk_cuts(plan, a.cut_every, span);
            cuts += c.len();
            plan.cuts = plan.cut_plan(&c)?;
        }
        let (mut times, mut read_times, mut finite) = (Vec::new(), Vec::new(), true);
        for i in 0..a.warmup + a.repeats {
            backend.reset_state(&mut kv, 0)?;
            backend.sync()?;
            if a.pause_ms > 0 {
                std::thread::sleep(std::time::Duration::from_millis(a.pause_ms));
            }
            let t = Instant::now();
            let (mut logits, mut read_s) = (None, 0.0);
            for plan in &plans {
                let last = plan.rows() - 1;
                logits = Some(p.model.forward(backend, &mut kv, layout, plan, &[last])?);
                if let Some(c) = &plan.cuts {
                    let slots: Vec<_> = c.seqs.iter().map(|s| s.state).collect();
                    backend.sync()?;
                    let r = Instant::now();
                    let states = backend.state_ranges(&kv, &slots, &live)?;
                    read_s += r.elapsed().as_secs_f64();
                    if states.len() != slots.len() {
                        bail!(
                            "{} cut states read back for {} cuts",
                            states.len(),
                            slots.len()
                        );
                    }
                }
            }
            backend.sync()?;
            let dt = t.elapsed().as_secs_f64();
            bar.inc(1);
            if i >= a.warmup {
                times.push(dt);
                read_times.push(read_s);
                finite &= logits.is_some_and(|l| l.data.iter().all(|v| v.is_finite()));
            }
        }
        let s = median(times);
        let flops = prefill_flops(cfg, n);
        rows.push(PrefillRow {
            tokens: n,
            chunk: per,
            cut_every: a.cut_every,
            cuts,
            cut_read_seconds: median(read_times),
            weights: format.clone(),
            seconds: s,
            tokens_per_s: n as f64 / s,
            flops_per_token: flops / n as f64,
            tflops: flops / s / 1e12,
            gemm_fraction: flops / s / gemm_rate,
            gemm_rate_of: rate_of.into(),
            logits_finite: finite,
        });
    }
    Ok(rows)
}

/// The cuts of one chunk's forward: every multiple of `every` inside it at least `span`
/// rows past its start (the rings a cut's state holds are whole only there), each with a
/// scratch state slot of its own (slot 0 is the sequence's).
fn chunk_cuts(plan: &BatchPlan, every: usize, span: usize) -> Vec<Cut> {
    let (Some(seq), true) = (plan.seqs.first(), every > 0) else {
        return Vec::new();
    };
    let (lo, end) = (seq.start + span.max(1), seq.start + seq.len);
    (lo.div_ceil(every) * every..end)
        .step_by(every)
        .zip(1..)
        .map(|(pos, state)| Cut { pos, state })
        .collect()
}

/// Chunk `start .. start + len` of one sequence's prompt `tokens`, after `start` tokens
/// already prefilled into the same pages and state.
fn chunk_plan(layout: &KvLayout, tokens: &[u32], start: usize, len: usize) -> BatchPlan {
    BatchPlan {
        seqs: vec![SeqPlan {
            start,
            len,
            row0: 0,
            pages: (0..layout.pages_for(start + len) as u32).collect(),
            state: 0,
        }],
        tokens: tokens[start..start + len].to_vec(),
        positions: (start..start + len).collect(),
        row_seq: vec![0; len],
        cuts: None,
    }
}

pub fn table(rows: &[PrefillRow], peer: Option<&Peer>) -> Table {
    let mut headers = vec![
        "tokens",
        "chunk",
        "weights",
        "seconds",
        "tok/s",
        "GFLOP/token",
        "TFLOP/s",
        "x GEMM rate",
        "rate of",
    ];
    let cuts = rows.iter().any(|r| r.cut_every > 0);
    if cuts {
        headers.extend(["cut every", "cuts", "read-back ms"]);
    }
    if peer.is_some() {
        headers.extend(["peer s", "speed-up vs peer"]);
    }
    headers.push("finite");
    let rows = rows
        .iter()
        .map(|r| {
            let mut v = vec![
                r.tokens.to_string(),
                r.chunk.to_string(),
                r.weights.clone(),
                num(r.seconds),
                num(r.tokens_per_s),
                num(r.flops_per_token / 1e9),
                num(r.tflops),
                num(r.gemm_fraction),
                r.gemm_rate_of.clone(),
            ];
            if cuts {
                v.extend([
                    r.cut_every.to_string(),
                    r.cuts.to_string(),
                    num(r.cut_read_seconds * 1e3),
                ]);
            }
            if let Some(p) = peer {
                match p.prefill.get(&r.tokens) {
                    Some(&s) => v.extend([num(s), num(s / r.seconds)]),
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
    use super::*;

    fn plan(start: usize, len: usize) -> BatchPlan {
        BatchPlan {
            seqs: vec![SeqPlan {
                start,
                len,
                row0: 0,
                pages: Vec::new(),
                state: 0,
            }],
            tokens: vec![0; len],
            positions: (start..start + len).collect(),
            row_seq: vec![0; len],
            cuts: None,
        }
    }

    #[test]
    fn cuts_at_every_multiple_inside_the_forward_past_the_rings() {
        let at = |p: &BatchPlan, every, span| -> Vec<(usize, u32)> {
            chunk_cuts(p, every, span)
                .iter()
                .map(|c| (c.pos, c.state))
                .collect()
        };
        // An 8K forward from 0, pages of 256, rings of 128: the 31 page boundaries inside
        // it, slots 1..=31 (not the forward's end: that state is the sequence's own).
        let c = at(&plan(0, 8192), 256, 128);
        assert_eq!(c.len(), 31);
        assert_eq!((c[0], c[30]), ((256, 1), (7936, 31)));
        // A later chunk: the first boundary at least 128 rows past 8192 is 8448.
        let c = at(&plan(8192, 1000), 256, 128);
        assert_eq!(c, vec![(8448, 1), (8704, 2), (8960, 3)]);
        // Rings longer than the page: the boundaries they reach past.
        assert_eq!(at(&plan(0, 1024), 256, 300)[0], (512, 1));
        assert!(at(&plan(0, 8192), 0, 128).is_empty());
        assert!(at(&plan(0, 200), 256, 128).is_empty());
    }
}
