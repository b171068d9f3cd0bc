//! `pdserve gpu-check`: the CUDA backend against the CPU engine on reference fixtures.

use anyhow::{bail, Context, Result};
use pdserve_gpu_check::attention::check_attention_ab;
use pdserve_gpu_check::batched::check_batched;
use pdserve_gpu_check::check::{check_embedded, check_fixture, header, CheckRow};
use pdserve_gpu_check::cuts::check_cuts;
use pdserve_gpu_check::deepseek::check_deepseek;
use pdserve_gpu_check::graphs::check_graphs;
use pdserve_gpu_check::indexer::check_indexer_blocking;
use pdserve_gpu_check::picks::check_picks;
use pdserve_gpu_check::stored::check_stored;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct GpuCheckArgs {
    /// Folder of fixtures (each a checkpoint plus expected.safetensors and meta.json).
    #[arg(long, default_value = "tests/fixtures")]
    fixtures: PathBuf,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Run only these groups of checks (default: all).
    #[arg(long, value_delimiter = ',', value_parser = ["embedded", "fixtures", "graphs", "batched", "picks", "stored", "deepseek"])]
    only: Vec<String>,
    /// Text the `batched` and `picks` groups cut their teacher-forced sequences from.
    #[arg(long, default_value = "scripts/tokenizer_corpus.txt")]
    corpus: PathBuf,
    /// Sequences of the `batched` and `picks` groups (decoded together, in small batches, one by one).
    #[arg(long, default_value_t = 48)]
    batched_seqs: usize,
    /// Teacher-forced decode steps per sequence in the `batched` and `picks` groups.
    #[arg(long, default_value_t = 32)]
    batched_steps: usize,
}

pub fn gpu_check(a: GpuCheckArgs) -> Result<()> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&a.fixtures)
        .with_context(|| format!("reading {}", a.fixtures.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.safetensors").exists())
        .collect();
    dirs.sort();
    if dirs.is_empty() {
        bail!("no fixtures under {}", a.fixtures.display());
    }
    println!("{}", header());
    let mut failed = 0;
    let mut show = |rows: Vec<CheckRow>| {
        for r in rows {
            failed += usize::from(r.gate && !r.pass);
            println!("{r}");
        }
    };
    let run = |group: &str| a.only.is_empty() || a.only.iter().any(|g| g == group);
    if run("embedded") {
        show(check_embedded(a.device).map_err(|e| anyhow::anyhow!("embedded model: {e}"))?);
        show(
            check_attention_ab(a.device)
                .map_err(|e| anyhow::anyhow!("attention A/B on the embedded model: {e}"))?,
        );
        show(
            check_indexer_blocking(a.device)
                .map_err(|e| anyhow::anyhow!("indexer blocking on the embedded model: {e}"))?,
        );
    }
    if run("fixtures") {
        let mut cut_rows = Vec::new();
        for d in &dirs {
            show(check_fixture(d, a.device).map_err(|e| anyhow::anyhow!("{}: {e}", d.display()))?);
            cut_rows.extend(
                check_cuts(d, a.device)
                    .map_err(|e| anyhow::anyhow!("{} cut states: {e}", d.display()))?,
            );
        }
        if cut_rows.is_empty() {
            bail!("no fixture's prompt holds a cut: the cut-state check ran nowhere");
        }
        show(cut_rows);
    }
    if run("stored") {
        show(check_stored(a.device).map_err(|e| anyhow::anyhow!("stored FP8/FP4 weights: {e}"))?);
    }
    if run("deepseek") {
        show(check_deepseek(a.device).map_err(|e| anyhow::anyhow!("deepseek numerics: {e}"))?);
    }
    let mut figures = Vec::new();
    if run("graphs") {
        let (rows, f) = check_graphs(a.device).map_err(|e| anyhow::anyhow!("CUDA graphs: {e}"))?;
        show(rows);
        figures = f;
    }
    if run("batched") {
        let (rows, f) = check_batched(a.device, &a.corpus, a.batched_seqs, a.batched_steps)
            .map_err(|e| anyhow::anyhow!("batched decode: {e}"))?;
        show(rows);
        figures.extend(f);
    }
    if run("picks") {
        let (rows, f) = check_picks(a.device, &a.corpus, a.batched_seqs, a.batched_steps)
            .map_err(|e| anyhow::anyhow!("pick trace: {e}"))?;
        show(rows);
        figures.extend(f);
    }
    for f in figures {
        println!("{f}");
    }
    if failed > 0 {
        bail!("{failed} GPU check(s) failed");
    }
    println!("all GPU checks passed");
    Ok(())
}
