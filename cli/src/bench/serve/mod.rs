//! `pdserve bench serve`: a load generator against a running router (its OpenAI
//! completions endpoint, streamed), with a reference check. Sessions of one or more
//! turns are planned from `--seed` (`workload`), sent closed- or open-loop (`load`)
//! through a streaming HTTP client that times every token (`client`), then every
//! completed request's exact prompt is generated again in this process by the same model
//! on the same device flags and compared token by token (`reference`); `report` prints
//! the figures as tables or JSON.

mod breakdown;
mod client;
mod load;
mod reference;
mod report;
mod workload;

use crate::model_args::ModelArgs;
use anyhow::{bail, Context, Result};
use pdserve_engine::config::ModelConfig;
use pdserve_tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::Duration;

/// Closed-loop sessions in flight when neither --concurrency nor --request-rate is given.
const DEFAULT_CONCURRENCY: usize = 8;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The router's base URL (the OpenAI endpoints are under /v1).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Sent as `Authorization: Bearer KEY` (for a router that requires a key).
    #[arg(long, env = "PDSERVE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Closed loop: this many sessions at once, the next starting when one ends (default
    /// 8). With --request-rate: at most this many sessions in flight (default: no limit).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Open loop: sessions start at Poisson arrivals, this many per second (with
    /// --turns 1, requests per second).
    #[arg(long)]
    request_rate: Option<f64>,
    /// Sessions to run.
    #[arg(long, default_value_t = 32)]
    sessions: usize,
    /// Requests per session: each turn's prompt is the previous prompt, the answer the
    /// server gave to it and new user tokens (so later turns share a prefix with earlier ones).
    #[arg(long, default_value_t = 1)]
    turns: usize,
    /// New user tokens per turn: N, or MIN:MAX drawn uniformly.
    #[arg(long, default_value = "256")]
    prompt_len: workload::LenDist,
    /// `max_tokens` per request: N, or MIN:MAX drawn uniformly.
    #[arg(long, default_value = "64")]
    output_len: workload::LenDist,
    /// Tokens of a system prefix every session's first prompt starts with.
    #[arg(long, default_value_t = 0)]
    shared_prefix_len: usize,
    /// Seeds the prompts, lengths, arrivals and per-request sampling seeds.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sampling temperature; 0 (greedy) is what the reference check can compare, so a
    /// higher one needs --no-reference.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Ask the server not to stop at the model's end-of-sequence tokens (every request
    /// then returns exactly its max_tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Deadline of each request, from sending it to its last token, in seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout_s: f64,
    /// Skip the reference check (no model weights are loaded then).
    #[arg(long)]
    no_reference: bool,
    /// Print the report as one JSON object instead of tables.
    #[arg(long)]
    json: bool,
    /// The workers' metrics side ports (`--metrics-listen` of the prefill and decode
    /// servers), comma-separated, as HOST:PORT or full URLs: scraped before and after the
    /// run for a breakdown of the mean time to first token (decode admission, prefill
    /// queue and compute, KV transfer, first token out). Use a cluster that carries only
    /// this load: the workers' means pool every request they served meanwhile.
    #[arg(long, value_delimiter = ',')]
    worker_metrics: Vec<String>,
    /// The model the router serves (its tokenizer picks prompt tokens; the reference
    /// check runs it with these flags: use the servers' device and KV flags).
    #[command(flatten)]
    model: ModelArgs,
}

impl ServeArgs {
    fn mode(&self) -> Result<load::Mode> {
        if self.concurrency == Some(0) {
            bail!("--concurrency must be at least 1");
        }
        Ok(match self.request_rate {
            Some(rate) if !(rate.is_finite() && rate > 0.0) => {
                bail!("--request-rate must be a positive number of sessions per second, got {rate}")
            }
            Some(rate) => load::Mode::Open {
                rate,
                max_in_flight: self.concurrency,
            },
            None => load::Mode::Closed {
                concurrency: self.concurrency.unwrap_or(DEFAULT_CONCURRENCY),
            },
        })
    }

    fn shape(&self) -> workload::Shape {
        workload::Shape {
            sessions: self.sessions,
            turns: self.turns,
            prompt_len: self.prompt_len,
            output_len: self.output_len,
            shared_prefix_len: self.shared_prefix_len,
            seed: self.seed,
        }
    }

    fn check(&self) -> Result<()> {
        if self.sessions == 0 || self.turns == 0 {
            bail!("--sessions and --turns must be at least 1");
        }
        if !(0.0..=2.0).contains(&self.temperature) {
            bail!("--temperature must be in [0, 2], got {}", self.temperature);
        }
        if self.temperature > 0.0 && !self.no_reference {
            bail!("--temperature {} is not greedy: the reference check compares greedy outputs only; add --no-reference", self.temperature);
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            bail!("--timeout-s must be a positive number of seconds");
        }
        Ok(())
    }

    fn config_json(&self, mode: load::Mode, max_model_len: usize) -> serde_json::Value {
        let (name, concurrency, rate) = match mode {
            load::Mode::Closed { concurrency } => ("closed", Some(concurrency), None),
            load::Mode::Open {
                rate,
                max_in_flight,
            } => ("open", max_in_flight, Some(rate)),
        };
        serde_json::json!({
            "url": self.url,
            "mode": name,
            "concurrency": concurrency,
            "request_rate": rate,
            "sessions": self.sessions,
            "turns": self.turns,
            "prompt_len": self.prompt_len.to_string(),
            "output_len": self.output_len.to_string(),
            "shared_prefix_len": self.shared_prefix_len,
            "seed": self.seed,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "reference": !self.no_reference,
            "max_model_len": max_model_len,
            "device": self.model.device,
        })
    }
}

pub fn run(a: ServeArgs) -> Result<()> {
    a.check()?;
    let mode = a.mode()?;
    let shape = a.shape();
    let dir = a.model.model_dir()?;
    let cfg = ModelConfig::from_model_dir(&dir)
        .with_context(|| format!("reading the model config in {}", dir.display()))?;
    let tokenizer = Tokenizer::from_model_dir(&dir)?;
    if tokenizer.is_none() {
        tracing::warn!(model = %dir.display(), "no tokenizer.json: prompt tokens are any id but BOS/EOS");
    }
    let excluded: Vec<u32> = cfg
        .bos_token_id
        .into_iter()
        .chain(cfg.eos_token_ids.iter().copied())
        .collect();
    let mut vocab = workload::Vocab::new(cfg.vocab_size, excluded, tokenizer.as_ref())?;
    let (prefix, sessions) = workload::plan(&shape, &mut vocab)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = client::Client::new(
        &a.url,
        a.api_key.clone(),
        Duration::from_secs_f64(a.timeout_s),
    )?;
    let max_model_len = rt.block_on(client.max_model_len())?;
    if shape.max_context() > max_model_len {
        bail!(
            "the longest request can need {} tokens (--shared-prefix-len + --turns x (max --prompt-len + max --output-len)) but the router's max_model_len is {max_model_len}",
            shape.max_context()
        );
    }
    let metrics_urls: Vec<String> = a.worker_metrics.iter().map(|u| metrics_url(u)).collect();
    let before = match metrics_urls.is_empty() {
        true => None,
        false => Some(rt.block_on(breakdown::scrape_all(&client, &metrics_urls))?),
    };
    let planned = shape.sessions * shape.turns;
    let progress = crate::bench::progress(planned as u64, "requests");
    let ctx = Arc::new(load::Ctx {
        client,
        prefix,
        temperature: a.temperature,
        ignore_eos: a.ignore_eos,
        seed: a.seed,
        progress: progress.clone(),
    });
    let run = rt.block_on(load::run(ctx.clone(), sessions, mode))?;
    progress.finish_and_clear();
    let after = match &before {
        None => None,
        Some(_) => Some(rt.block_on(breakdown::scrape_all(&ctx.client, &metrics_urls))?),
    };
    drop(rt);

    let mut report = report::Report::new(a.config_json(mode, max_model_len), planned, &run);
    if let (Some(b), Some(a)) = (&before, &after) {
        report.ttft_breakdown = Some(breakdown::Breakdown::new(report.ttft_ms.mean, b, a)?);
    }
    if !a.no_reference {
        let bar = crate::bench::progress(report.requests.completed as u64, "reference");
        report.reference = Some(reference::check(
            &a.model,
            &run.outcomes,
            a.ignore_eos,
            bar.clone(),
        )?);
        bar.finish_and_clear();
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    match report.failure() {
        Some(why) => bail!("{why}"),
        None => Ok(()),
    }
}

/// A `--worker-metrics` entry as the URL of its `/metrics` (HOST:PORT gets `http://` and
/// `/metrics`).
fn metrics_url(entry: &str) -> String {
    match entry.contains("://") {
        true => entry.to_string(),
        false => format!("http://{}/metrics", entry.trim_end_matches('/')),
    }
}
