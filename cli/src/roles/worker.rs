//! The `prefill` and `decode` servers' configuration: keys, defaults, flags, validation.

use super::{one_or_many, redact, ClusterTokenFlags};
use crate::engine_spec::{Device, GraphChoice};
use crate::layered::{self, flag, Entry, Flags};
use anyhow::{bail, Result};
use pdserve_engine::kv::EntryDtype;
use pdserve_engine::LoadFormat;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerRole {
    Prefill,
    Decode,
}

impl WorkerRole {
    pub fn name(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

/// Effective configuration of a prefill or decode server.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerConfig {
    /// Model folder; none: the embedded model.
    pub model: Option<PathBuf>,
    /// Where the weights come from: auto (the folder's safetensors) or dummy[:SEED]
    /// (random weights of config.json's shapes; every server must use the same seed).
    pub load_format: String,
    /// Names the model is served under (see [`pdserve_router::served_model`]); empty: the
    /// folder's name.
    #[serde(deserialize_with = "one_or_many")]
    pub served_model_name: Vec<String>,
    pub device: String,
    pub index_k_dtype: String,
    pub kv_dtype: String,
    pub numerics: String,
    pub page_tokens: Option<usize>,
    pub kv_pages: usize,
    pub max_batch: usize,
    pub chunked_prefill_size: usize,
    pub listen: String,
    pub transfer: String,
    pub hicache_ratio: f64,
    pub hicache_size: Option<f64>,
    pub cuda_graph: String,
    pub request_timeout_s: f64,
    pub metrics_listen: Option<String>,
    pub drain_timeout_s: f64,
    /// KV canary: check pages every N steps, state slots every step (0: off).
    pub kv_audit_every: u32,
    /// Decode on CUDA: run every N-th graphed step eagerly too and compare bitwise (0: off).
    pub verify_graphs_every: u32,
    /// Batch-invariant numerics (CUDA kernels with fixed reduction orders).
    pub deterministic: bool,
    pub transfer_progress_timeout_s: f64,
    pub cluster_token: Option<String>,
    pub cluster_token_file: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
}

pub const WORKER_KEYS: &[&str] = &[
    "model",
    "load_format",
    "served_model_name",
    "device",
    "index_k_dtype",
    "kv_dtype",
    "numerics",
    "page_tokens",
    "kv_pages",
    "max_batch",
    "chunked_prefill_size",
    "listen",
    "transfer",
    "hicache_ratio",
    "hicache_size",
    "cuda_graph",
    "request_timeout_s",
    "metrics_listen",
    "drain_timeout_s",
    "kv_audit_every",
    "verify_graphs_every",
    "deterministic",
    "transfer_progress_timeout_s",
    "cluster_token",
    "cluster_token_file",
    "tls_cert",
    "tls_key",
    "tls_ca",
];

impl WorkerConfig {
    pub fn defaults(role: WorkerRole) -> Self {
        WorkerConfig {
            model: None,
            load_format: "auto".into(),
            served_model_name: Vec::new(),
            device: "cpu".into(),
            index_k_dtype: "f32".into(),
            kv_dtype: "f32".into(),
            numerics: "transformers".into(),
            page_tokens: None,
            kv_pages: 1024,
            max_batch: 64,
            chunked_prefill_size: 512,
            listen: match role {
                WorkerRole::Prefill => "127.0.0.1:50061".into(),
                WorkerRole::Decode => "127.0.0.1:50062".into(),
            },
            transfer: "grpc".into(),
            hicache_ratio: 0.0,
            hicache_size: None,
            cuda_graph: "auto".into(),
            request_timeout_s: 120.0,
            metrics_listen: None,
            drain_timeout_s: 30.0,
            kv_audit_every: 0,
            verify_graphs_every: 0,
            deterministic: false,
            transfer_progress_timeout_s: 10.0,
            cluster_token: None,
            cluster_token_file: None,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
        }
    }

    /// `--device`: cpu or cuda:N (`cuda` is device 0); a server never guesses (no `auto`).
    pub fn device(&self) -> Result<Device> {
        match self.device.parse::<Device>() {
            Ok(d @ (Device::Cpu | Device::Cuda(_))) => Ok(d),
            _ => bail!("--device `{}`: expected cpu or cuda:N", self.device),
        }
    }

    /// `--cuda-graph`.
    pub fn graphs(&self) -> Result<GraphChoice> {
        self.cuda_graph.parse()
    }

    pub fn load_format(&self) -> Result<LoadFormat> {
        self.load_format
            .parse()
            .map_err(|e| anyhow::anyhow!("--load-format: {e}"))
    }

    /// Refuse invalid values and values that need machinery this build lacks.
    pub fn validate(&self, role: WorkerRole) -> Result<()> {
        let cuda = matches!(self.device()?, Device::Cuda(_));
        pdserve_router::served_model::check_names(&self.served_model_name)?;
        self.load_format()?;
        EntryDtype::parse(&self.index_k_dtype)
            .map_err(|e| anyhow::anyhow!("--index-k-dtype: {e}"))?;
        EntryDtype::parse(&self.kv_dtype).map_err(|e| anyhow::anyhow!("--kv-dtype: {e}"))?;
        crate::engine_spec::numerics(&self.numerics)?;
        match self.transfer.as_str() {
            "grpc" => {}
            "nccl" if !cuda => bail!(
                "--transfer nccl moves KV pages GPU to GPU and needs --device cuda:N; with --device {} use --transfer grpc",
                self.device
            ),
            "nccl" => bail!("--transfer nccl: the NCCL transfer is not in this build yet; use --transfer grpc"),
            t => bail!("--transfer `{t}`: expected grpc or nccl"),
        }
        if !self.hicache_ratio.is_finite() || self.hicache_ratio < 0.0 {
            bail!(
                "--hicache-ratio must be a number >= 0, got {}",
                self.hicache_ratio
            );
        }
        if let Some(gb) = self.hicache_size {
            if !(gb.is_finite() && gb > 0.0) {
                bail!("--hicache-size must be a positive number of GB, got {gb}");
            }
            if self.hicache_ratio > 0.0 {
                bail!("--hicache-ratio and --hicache-size both size the host KV pool; give one");
            }
        }
        if self.hicache_ratio > 0.0 && self.hicache_ratio < 1.0 {
            bail!(
                "--hicache-ratio {} is below 1: the host pool must hold at least as many pages as the device pool (0 turns the host tier off)",
                self.hicache_ratio
            );
        }
        let host_tier = self.hicache_ratio > 0.0 || self.hicache_size.is_some();
        if host_tier && role == WorkerRole::Decode {
            bail!(
                "--hicache-ratio / --hicache-size: the host (hierarchical) KV cache backs the prefix cache of prefill servers; decode servers keep none, so leave them unset on decode"
            );
        }
        match self.graphs()? {
            GraphChoice::Auto | GraphChoice::Eager => {}
            GraphChoice::Capture if !cuda => bail!(
                "--cuda-graph capture needs --device cuda:N (device is {}); use eager or auto",
                self.device
            ),
            GraphChoice::Capture if role == WorkerRole::Prefill => {
                bail!("--cuda-graph capture applies to decode servers only")
            }
            GraphChoice::Capture => {}
        }
        if self.max_batch == 0 || self.kv_pages == 0 {
            bail!("--max-batch and --kv-pages must be at least 1");
        }
        if !(self.request_timeout_s.is_finite() && self.request_timeout_s > 0.0) {
            bail!("--request-timeout-s must be a positive number of seconds");
        }
        if self.verify_graphs_every > 0 && !(cuda && role == WorkerRole::Decode) {
            bail!("--verify-graphs / --verify-graphs-every check CUDA decode graphs: they need a decode server with --device cuda:N");
        }
        if !(self.drain_timeout_s.is_finite() && self.drain_timeout_s >= 0.0) {
            bail!(
                "--drain-timeout-s must be a number of seconds >= 0, got {}",
                self.drain_timeout_s
            );
        }
        let beat = pdserve_kv_transfer::HEARTBEAT.as_secs_f64();
        let progress = self.transfer_progress_timeout_s;
        if !(progress.is_finite() && progress >= 2.0 * beat) {
            bail!(
                "--transfer-progress-timeout-s must be at least {} s (twice the prefill servers' {beat} s heartbeat), got {progress}",
                2.0 * beat
            );
        }
        Ok(())
    }
}

/// Flags of the prefill and decode servers (each overrides the file and environment).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct WorkerFlags {
    /// TOML file with any of the config keys (see --print-config).
    #[arg(long, env = "PDSERVE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration with the source of each value, then exit.
    #[arg(long, env = "PDSERVE_PRINT_CONFIG")]
    pub print_config: bool,
    /// Model folder (config.json, *.safetensors, tokenizer.json). Default: the embedded model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the weights come from: `auto` (the folder's safetensors) or `dummy[:SEED]`
    /// (random weights of config.json's shapes and formats, seed 0 by default, as `pdserve
    /// bench` draws them; only config.json is read). Prefill and decode servers must use
    /// the same seed.
    #[arg(long)]
    pub load_format: Option<String>,
    /// Name(s) this server reports its model under (Worker.Info, the `model_name` metrics
    /// label; the first of several): give prefill and decode servers the router's
    /// --served-model-name. Default: the model folder's name.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Option<Vec<String>>,
    /// cpu or cuda:N.
    #[arg(long)]
    pub device: Option<String>,
    /// Index-K storage dtype: f32 or bf16. Must match between prefill and decode.
    #[arg(long)]
    pub index_k_dtype: Option<String>,
    /// Compressed-KV and sliding-window storage dtype: f32, bf16 or fp8 (FlashMLA's V4
    /// layout). Must match between prefill and decode.
    #[arg(long)]
    pub kv_dtype: Option<String>,
    /// Numerics: transformers (f32 activations, exact against transformers) or deepseek
    /// (DeepSeek's reference quantization; needs --kv-dtype fp8). Part of the KV layout:
    /// prefill and decode must agree.
    #[arg(long)]
    pub numerics: Option<String>,
    /// Positions per KV page (a multiple of every compress rate).
    #[arg(long)]
    pub page_tokens: Option<usize>,
    /// KV pages in this server's pool.
    #[arg(long)]
    pub kv_pages: Option<usize>,
    /// Most requests decoded together (decode) / state slots (prefill).
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// Prefill chunk size in tokens (0: whole prompt in one forward).
    #[arg(long)]
    pub chunked_prefill_size: Option<usize>,
    /// Address to listen on (host:port; port 0 picks a free one and prints it).
    #[arg(long)]
    pub listen: Option<String>,
    /// KV transfer: grpc or nccl.
    #[arg(long)]
    pub transfer: Option<String>,
    /// Prefill only: host (hierarchical) KV cache behind the prefix cache, as this many
    /// times the device pool's pages (>= 1; 0: off, evicted prefixes are dropped).
    #[arg(long)]
    pub hicache_ratio: Option<f64>,
    /// Prefill only: host KV cache size in GB instead of --hicache-ratio.
    #[arg(long)]
    pub hicache_size: Option<f64>,
    /// Decode CUDA graphs: auto, capture or eager.
    #[arg(long)]
    pub cuda_graph: Option<String>,
    /// Deadline for one request's prefill (queueing and compute), in seconds.
    #[arg(long)]
    pub request_timeout_s: Option<f64>,
    /// HTTP side port (host:port) serving GET /metrics (Prometheus), /live and /ready.
    /// Default: not served.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// On SIGTERM, seconds the requests in flight get to finish (new ones are refused)
    /// before they fail and the server exits.
    #[arg(long)]
    pub drain_timeout_s: Option<f64>,
    /// KV canary at every step: checksums of every page and state slot (computed on the
    /// device) fail exactly the requests whose KV changed outside the expected writes.
    /// Same as --kv-audit-every 1.
    #[arg(long, conflicts_with = "kv_audit_every", env = "PDSERVE_KV_AUDIT")]
    pub kv_audit: bool,
    /// KV canary checking pages every N steps (state slots every step); 0: off.
    /// See docs/kv-layout.md for what it costs.
    #[arg(long)]
    pub kv_audit_every: Option<u32>,
    /// Decode on CUDA: replay every graphed step eagerly too and compare bitwise; a
    /// mismatch keeps the eager result, drops the bucket's graph (recaptured at its next
    /// step) and counts pdserve_graph_verify_mismatches_total. Doubles step time. Same as
    /// --verify-graphs-every 1.
    #[arg(
        long,
        conflicts_with = "verify_graphs_every",
        env = "PDSERVE_VERIFY_GRAPHS"
    )]
    pub verify_graphs: bool,
    /// Decode on CUDA: the --verify-graphs check on every N-th step only (0: off).
    #[arg(long)]
    pub verify_graphs_every: Option<u32>,
    /// Batch-invariant numerics: a request's logits bitwise independent of its batch and of
    /// bucket padding (CUDA: fixed-order GEMMs instead of cuBLAS, grouped routed experts;
    /// slower). Give it to prefill and decode servers alike. The CPU is batch-invariant always.
    #[arg(long)]
    pub deterministic: bool,
    /// Test only: KIND@STEP (page, index-k or state) writes garbage into the oldest
    /// running request's KV after decode step STEP, past every writer the canary knows.
    #[arg(long, hide = true)]
    pub debug_kv_scribble: Option<String>,
    /// Decode only: a KV transfer fails when its prefill server sends nothing (not even
    /// its heartbeat) for this many seconds, freeing the request's slot and pages.
    #[arg(long)]
    pub transfer_progress_timeout_s: Option<f64>,
    #[command(flatten)]
    pub cluster: ClusterTokenFlags,
    #[command(flatten)]
    pub tls: crate::trust::TlsFlags,
}

impl WorkerFlags {
    pub fn resolve(&self, role: WorkerRole) -> Result<(WorkerConfig, Vec<Entry>)> {
        let mut f = Flags::new();
        flag(&mut f, "model", &self.model);
        flag(&mut f, "load_format", &self.load_format);
        flag(&mut f, "served_model_name", &self.served_model_name);
        flag(&mut f, "device", &self.device);
        flag(&mut f, "index_k_dtype", &self.index_k_dtype);
        flag(&mut f, "kv_dtype", &self.kv_dtype);
        flag(&mut f, "numerics", &self.numerics);
        flag(&mut f, "page_tokens", &self.page_tokens);
        flag(&mut f, "kv_pages", &self.kv_pages);
        flag(&mut f, "max_batch", &self.max_batch);
        flag(&mut f, "chunked_prefill_size", &self.chunked_prefill_size);
        flag(&mut f, "listen", &self.listen);
        flag(&mut f, "transfer", &self.transfer);
        flag(&mut f, "hicache_ratio", &self.hicache_ratio);
        flag(&mut f, "hicache_size", &self.hicache_size);
        flag(&mut f, "cuda_graph", &self.cuda_graph);
        flag(&mut f, "request_timeout_s", &self.request_timeout_s);
        flag(&mut f, "metrics_listen", &self.metrics_listen);
        flag(&mut f, "drain_timeout_s", &self.drain_timeout_s);
        let audit_every = self.kv_audit_every.or(self.kv_audit.then_some(1));
        flag(&mut f, "kv_audit_every", &audit_every);
        let verify_every = self.verify_graphs_every.or(self.verify_graphs.then_some(1));
        flag(&mut f, "verify_graphs_every", &verify_every);
        flag(&mut f, "deterministic", &self.deterministic.then_some(true));
        flag(
            &mut f,
            "transfer_progress_timeout_s",
            &self.transfer_progress_timeout_s,
        );
        self.cluster.put(&mut f);
        self.tls.put(&mut f);
        let (cfg, mut entries) = layered::extract(
            &WorkerConfig::defaults(role),
            self.config.as_deref(),
            WORKER_KEYS,
            f,
        )?;
        redact(&mut entries);
        Ok((cfg, entries))
    }
}
