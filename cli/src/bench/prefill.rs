//! `pdserve bench prefill`: one sequence of N random tokens prefilled in one forward,
//! tokens/s and the fraction of the GEMM rate measured in the same run.

use super::config::ModelFlags;
use super::device::BenchBackend;
use super::peer::{self, Peer};
use super::stats::median;
use super::table::{num, Table};
use super::traffic::prefill_flops;
use super::{progress, Prepared};
use anyhow::{bail, Result};
use pdserve_engine::backend::{BatchPlan, SeqPlan};
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
    /// JSON written by scripts/peer_bench.py: adds the peer's seconds and our speed-up.
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Also write the rows (and the measured GEMM rate) as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct PrefillRow {
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub flops_per_token: f64,
    pub tflops: f64,
    pub gemm_fraction: f64,
    pub logits_finite: bool,
}

pub fn run<B: BenchBackend>(a: &PrefillArgs, backend: B) -> Result<Vec<PrefillRow>> {
    if a.tokens.is_empty() || a.tokens.contains(&0) || a.repeats == 0 {
        bail!("--tokens needs lengths >= 1 and --repeats at least 1");
    }
    let p = Prepared::new(&a.model, &backend)?;
    let (cfg, layout) = (&p.model.cfg, &p.layout);
    let max_t = a.tokens.iter().copied().max().unwrap_or(1);
    if max_t > cfg.max_position_embeddings {
        bail!(
            "--tokens {max_t} exceeds the model's {} positions",
            cfg.max_position_embeddings
        );
    }
    let peer: Option<Peer> = a.peer.as_deref().map(|p| peer::load(p, cfg)).transpose()?;
    if let Some(p) = &peer {
        println!("peer: {}", p.label);
    }
    let gemm = backend.gemm_rate()?;
    println!("GEMM rate: {:.1} TFLOP/s ({})", gemm.rate / 1e12, gemm.how);
    let mut kv = backend.alloc_kv(layout, layout.pages_for(max_t), 1)?;
    let bar = progress((a.tokens.len() * (a.warmup + a.repeats)) as u64, "prefills");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.model.seed);
    let mut rows = Vec::new();
    for &n in &a.tokens {
        bar.set_message(format!("{n} tokens"));
        let tokens: Vec<u32> = (0..n)
            .map(|_| rng.random_range(0..cfg.vocab_size as u32))
            .collect();
        let plan = BatchPlan {
            seqs: vec![SeqPlan {
                start: 0,
                len: n,
                row0: 0,
                pages: (0..layout.pages_for(n) as u32).collect(),
                state: 0,
            }],
            tokens,
            positions: (0..n).collect(),
            row_seq: vec![0; n],
        };
        let (mut times, mut finite) = (Vec::new(), true);
        for i in 0..a.warmup + a.repeats {
            backend.reset_state(&mut kv, 0)?;
            backend.sync()?;
            let t = Instant::now();
            let logits = p
                .model
                .forward(&backend, &mut kv, layout, &plan, &[n - 1])?;
            backend.sync()?;
            let dt = t.elapsed().as_secs_f64();
            bar.inc(1);
            if i >= a.warmup {
                times.push(dt);
                finite &= logits.data.iter().all(|v| v.is_finite());
            }
        }
        let s = median(times);
        let flops = prefill_flops(cfg, n);
        rows.push(PrefillRow {
            tokens: n,
            seconds: s,
            tokens_per_s: n as f64 / s,
            flops_per_token: flops / n as f64,
            tflops: flops / s / 1e12,
            gemm_fraction: flops / s / gemm.rate,
            logits_finite: finite,
        });
    }
    bar.finish_and_clear();
    println!("{}", table(&rows, peer.as_ref()));
    if let Some(path) = &a.json {
        let v = serde_json::json!({
            "device": backend.name(),
            "gemm_flops_per_s": gemm.rate,
            "gemm_how": gemm.how,
            "rows": rows,
        });
        super::write_json(path, &v)?;
    }
    Ok(rows)
}

pub fn table(rows: &[PrefillRow], peer: Option<&Peer>) -> Table {
    let mut headers = vec![
        "tokens",
        "seconds",
        "tok/s",
        "GFLOP/token",
        "TFLOP/s",
        "x GEMM rate",
    ];
    if peer.is_some() {
        headers.extend(["peer s", "speed-up vs peer"]);
    }
    headers.push("finite");
    let rows = rows
        .iter()
        .map(|r| {
            let mut v = vec![
                r.tokens.to_string(),
                num(r.seconds),
                num(r.tokens_per_s),
                num(r.flops_per_token / 1e9),
                num(r.tflops),
                num(r.gemm_fraction),
            ];
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
