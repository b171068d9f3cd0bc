//! Configuration of the `prefill`, `decode` and `router` roles: keys, defaults, flags,
//! validation (flags whose machinery does not exist yet are refused, never ignored).

use crate::engine_spec::{Device, GraphChoice};
use crate::layered::{self, flag, Entry, Flags};
use anyhow::{bail, Result};
use pdserve_engine::kv::EntryDtype;
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
    pub device: String,
    pub index_k_dtype: String,
    pub kv_dtype: String,
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
    /// Decode on CUDA: replay every graphed step eagerly too and compare bitwise.
    pub verify_graphs: bool,
    /// Batch-invariant numerics (CUDA kernels with fixed reduction orders).
    pub deterministic: bool,
}

pub const WORKER_KEYS: &[&str] = &[
    "model",
    "device",
    "index_k_dtype",
    "kv_dtype",
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
    "verify_graphs",
    "deterministic",
];

impl WorkerConfig {
    pub fn defaults(role: WorkerRole) -> Self {
        WorkerConfig {
            model: None,
            device: "cpu".into(),
            index_k_dtype: "f32".into(),
            kv_dtype: "f32".into(),
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
            verify_graphs: false,
            deterministic: false,
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

    /// Refuse invalid values and values that need machinery this build lacks.
    pub fn validate(&self, role: WorkerRole) -> Result<()> {
        let cuda = matches!(self.device()?, Device::Cuda(_));
        EntryDtype::parse(&self.index_k_dtype)
            .map_err(|e| anyhow::anyhow!("--index-k-dtype: {e}"))?;
        EntryDtype::parse(&self.kv_dtype).map_err(|e| anyhow::anyhow!("--kv-dtype: {e}"))?;
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
        if !(self.drain_timeout_s.is_finite() && self.drain_timeout_s >= 0.0) {
            bail!(
                "--drain-timeout-s must be a number of seconds >= 0, got {}",
                self.drain_timeout_s
            );
        }
        if self.verify_graphs && !(cuda && role == WorkerRole::Decode) {
            bail!("--verify-graphs checks CUDA decode graphs: it needs a decode server with --device cuda:N");
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
    /// cpu or cuda:N.
    #[arg(long)]
    pub device: Option<String>,
    /// Index-K storage dtype: f32 or bf16. Must match between prefill and decode.
    #[arg(long)]
    pub index_k_dtype: Option<String>,
    /// Compressed-KV and sliding-window storage dtype: f32 or bf16.
    #[arg(long)]
    pub kv_dtype: Option<String>,
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
    /// Deadline for one request's prefill or KV transfer, in seconds.
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
    /// See docs/kv-canary.md for what it costs.
    #[arg(long)]
    pub kv_audit_every: Option<u32>,
    /// Decode on CUDA: replay every graphed step eagerly too and compare bitwise; a
    /// mismatch fails the step's requests and recaptures the bucket's graph (slow).
    #[arg(long)]
    pub verify_graphs: bool,
    /// Batch-invariant numerics: a request's logits bitwise independent of its batch and of
    /// bucket padding (CUDA: fixed-order GEMMs instead of cuBLAS, grouped routed experts;
    /// slower). Give it to prefill and decode servers alike. The CPU is batch-invariant always.
    #[arg(long)]
    pub deterministic: bool,
    /// Test only: KIND@STEP (page, index-k or state) writes garbage into the oldest
    /// running request's KV after decode step STEP, past every writer the canary knows.
    #[arg(long, hide = true)]
    pub debug_kv_scribble: Option<String>,
}

impl WorkerFlags {
    pub fn resolve(&self, role: WorkerRole) -> Result<(WorkerConfig, Vec<Entry>)> {
        let mut f = Flags::new();
        flag(&mut f, "model", &self.model);
        flag(&mut f, "device", &self.device);
        flag(&mut f, "index_k_dtype", &self.index_k_dtype);
        flag(&mut f, "kv_dtype", &self.kv_dtype);
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
        flag(&mut f, "verify_graphs", &self.verify_graphs.then_some(true));
        flag(&mut f, "deterministic", &self.deterministic.then_some(true));
        let (cfg, entries) = layered::extract(
            &WorkerConfig::defaults(role),
            self.config.as_deref(),
            WORKER_KEYS,
            f,
        )?;
        Ok((cfg, entries))
    }
}

/// Effective configuration of the router.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouterConfig {
    pub model: Option<PathBuf>,
    pub listen: String,
    #[serde(deserialize_with = "list_or_commas")]
    pub prefill: Vec<String>,
    #[serde(deserialize_with = "list_or_commas")]
    pub decode: Vec<String>,
    pub first_token_timeout_s: f64,
    pub token_timeout_s: f64,
    pub max_attempts: usize,
    pub prefill_policy: String,
    pub decode_policy: String,
    pub health_interval_s: f64,
    pub max_body_bytes: usize,
    pub max_model_len: Option<usize>,
    #[serde(deserialize_with = "list_or_commas")]
    pub discover_prefill: Vec<String>,
    #[serde(deserialize_with = "list_or_commas")]
    pub discover_decode: Vec<String>,
    pub discover_interval_s: f64,
}

/// An address list as TOML writes it (`["a:1", "b:2"]`) or as an environment variable
/// does (`PDSERVE_DECODE=a:1,b:2`, the flags' comma-separated form).
fn list_or_commas<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ListOrCommas {
        List(Vec<String>),
        Commas(String),
    }
    Ok(match ListOrCommas::deserialize(d)? {
        ListOrCommas::List(v) => v,
        ListOrCommas::Commas(s) => s
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(String::from)
            .collect(),
    })
}

pub const ROUTER_KEYS: &[&str] = &[
    "model",
    "listen",
    "prefill",
    "decode",
    "first_token_timeout_s",
    "token_timeout_s",
    "max_attempts",
    "prefill_policy",
    "decode_policy",
    "health_interval_s",
    "max_body_bytes",
    "max_model_len",
    "discover_prefill",
    "discover_decode",
    "discover_interval_s",
];

#[derive(clap::Args, Debug, Clone, Default)]
pub struct RouterFlags {
    /// TOML file with any of the config keys (see --print-config).
    #[arg(long, env = "PDSERVE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration with the source of each value, then exit.
    #[arg(long, env = "PDSERVE_PRINT_CONFIG")]
    pub print_config: bool,
    /// Model folder (for the tokenizer and end tokens). Default: the embedded model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on (host:port; port 0 picks a free one and prints it).
    #[arg(long)]
    pub listen: Option<String>,
    /// Prefill worker addresses (host:port), repeated or comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub prefill: Option<Vec<String>>,
    /// Decode worker addresses (host:port), repeated or comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub decode: Option<Vec<String>>,
    /// Deadline from request to first token, in seconds.
    #[arg(long)]
    pub first_token_timeout_s: Option<f64>,
    /// Deadline between two tokens of a stream, in seconds.
    #[arg(long)]
    pub token_timeout_s: Option<f64>,
    /// Worker pairs tried before the first token.
    #[arg(long)]
    pub max_attempts: Option<usize>,
    /// How prefill workers are chosen: prefix_affinity (requests sharing a prompt prefix
    /// go to the worker whose prefix cache holds it), least_load or round_robin.
    #[arg(long)]
    pub prefill_policy: Option<String>,
    /// How decode workers are chosen: least_load, round_robin or prefix_affinity.
    #[arg(long)]
    pub decode_policy: Option<String>,
    /// Seconds between two health/load polls of every worker.
    #[arg(long)]
    pub health_interval_s: Option<f64>,
    /// Largest request body accepted, in bytes (larger: 413).
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Context length requests are checked against (prompt + max_tokens); default and
    /// upper bound: the model's max_position_embeddings.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// DNS names (host:port; repeated or comma-separated) whose addresses are prefill
    /// workers, re-resolved every --discover-interval-s: workers join and leave as the
    /// name's addresses do (a Kubernetes headless Service lists its ready pods).
    #[arg(long, value_delimiter = ',')]
    pub discover_prefill: Option<Vec<String>>,
    /// DNS names (host:port) whose addresses are decode workers (as --discover-prefill).
    #[arg(long, value_delimiter = ',')]
    pub discover_decode: Option<Vec<String>>,
    /// Seconds between two resolutions of the --discover-* names.
    #[arg(long)]
    pub discover_interval_s: Option<f64>,
}

impl RouterConfig {
    /// Refuse unknown policies and non-positive durations.
    pub fn validate(&self) -> Result<()> {
        for (flag, name) in [
            ("--prefill-policy", &self.prefill_policy),
            ("--decode-policy", &self.decode_policy),
        ] {
            pdserve_router::policy::by_name(name).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
        }
        for (flag, t) in [
            ("--first-token-timeout-s", self.first_token_timeout_s),
            ("--token-timeout-s", self.token_timeout_s),
            ("--health-interval-s", self.health_interval_s),
            ("--discover-interval-s", self.discover_interval_s),
        ] {
            if !(t.is_finite() && t > 0.0) {
                bail!("{flag} must be a positive number of seconds, got {t}");
            }
        }
        Ok(())
    }
}

impl RouterFlags {
    pub fn resolve(&self) -> Result<(RouterConfig, Vec<Entry>)> {
        let mut f = Flags::new();
        flag(&mut f, "model", &self.model);
        flag(&mut f, "listen", &self.listen);
        flag(&mut f, "prefill", &self.prefill);
        flag(&mut f, "decode", &self.decode);
        flag(&mut f, "first_token_timeout_s", &self.first_token_timeout_s);
        flag(&mut f, "token_timeout_s", &self.token_timeout_s);
        flag(&mut f, "max_attempts", &self.max_attempts);
        flag(&mut f, "prefill_policy", &self.prefill_policy);
        flag(&mut f, "decode_policy", &self.decode_policy);
        flag(&mut f, "health_interval_s", &self.health_interval_s);
        flag(&mut f, "max_body_bytes", &self.max_body_bytes);
        flag(&mut f, "max_model_len", &self.max_model_len);
        flag(&mut f, "discover_prefill", &self.discover_prefill);
        flag(&mut f, "discover_decode", &self.discover_decode);
        flag(&mut f, "discover_interval_s", &self.discover_interval_s);
        layered::extract(
            &RouterConfig::defaults(),
            self.config.as_deref(),
            ROUTER_KEYS,
            f,
        )
    }
}

impl RouterConfig {
    pub fn defaults() -> Self {
        RouterConfig {
            model: None,
            listen: "127.0.0.1:8000".into(),
            prefill: Vec::new(),
            decode: Vec::new(),
            first_token_timeout_s: 120.0,
            token_timeout_s: 30.0,
            max_attempts: 3,
            prefill_policy: "prefix_affinity".into(),
            decode_policy: "least_load".into(),
            health_interval_s: 0.5,
            max_body_bytes: 2 << 20,
            max_model_len: None,
            discover_prefill: Vec::new(),
            discover_decode: Vec::new(),
            discover_interval_s: 5.0,
        }
    }
}
