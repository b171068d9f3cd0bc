//! Configuration of the `prefill`, `decode` and `router` roles: keys, defaults, flags,
//! validation (flags whose machinery does not exist yet are refused, never ignored).

use crate::engine_spec::{Device, GraphChoice};
use crate::layered::{self, flag, Entry, Flags};
use anyhow::{bail, Result};
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
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

    /// Refuse invalid values and values that need machinery this build lacks.
    pub fn validate(&self, role: WorkerRole) -> Result<()> {
        let cuda = matches!(self.device()?, Device::Cuda(_));
        pdserve_router::served_model::check_names(&self.served_model_name)?;
        EntryDtype::parse(&self.index_k_dtype)
            .map_err(|e| anyhow::anyhow!("--index-k-dtype: {e}"))?;
        let kv_dtype =
            EntryDtype::parse(&self.kv_dtype).map_err(|e| anyhow::anyhow!("--kv-dtype: {e}"))?;
        let spec = KvLayoutSpec {
            kv_dtype,
            numerics: crate::engine_spec::numerics(&self.numerics)?,
            page_tokens: 0,
            index_k_dtype: EntryDtype::F32,
        };
        if let Some(reason) = crate::engine_spec::cuda_refusal(&spec).filter(|_| cuda) {
            bail!("{reason}");
        }
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
    /// (DeepSeek's reference quantization; needs --kv-dtype fp8; CPU only for now). Part of
    /// the KV layout: prefill and decode must agree.
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

/// The cluster token flags every role takes.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ClusterTokenFlags {
    /// Shared secret of this cluster's processes (also PDSERVE_CLUSTER_TOKEN): workers
    /// refuse Prefill/Generate calls without it and prove it to the router. Prefer
    /// --cluster-token-file: flags show in `ps`.
    #[arg(long)]
    pub cluster_token: Option<String>,
    /// File holding the cluster token (its first line).
    #[arg(long)]
    pub cluster_token_file: Option<PathBuf>,
}

impl ClusterTokenFlags {
    fn put(&self, f: &mut Flags) {
        flag(f, "cluster_token", &self.cluster_token);
        flag(f, "cluster_token_file", &self.cluster_token_file);
    }
}

/// The effective cluster token from its value or its file (not both).
pub fn cluster_token(
    value: &Option<String>,
    file: &Option<PathBuf>,
) -> Result<Option<pdserve_proto::cluster::ClusterToken>> {
    let secret = match (value, file) {
        (Some(_), Some(_)) => bail!("give --cluster-token or --cluster-token-file, not both"),
        (Some(v), None) => v.clone(),
        (None, Some(p)) => std::fs::read_to_string(p)
            .map_err(|e| anyhow::anyhow!("--cluster-token-file {}: {e}", p.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        (None, None) => return Ok(None),
    };
    Ok(Some(
        pdserve_proto::cluster::ClusterToken::new(&secret)
            .map_err(|e| anyhow::anyhow!("cluster token: {e}"))?,
    ))
}

impl WorkerFlags {
    pub fn resolve(&self, role: WorkerRole) -> Result<(WorkerConfig, Vec<Entry>)> {
        let mut f = Flags::new();
        flag(&mut f, "model", &self.model);
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

/// Effective configuration of the router.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouterConfig {
    pub model: Option<PathBuf>,
    #[serde(deserialize_with = "one_or_many")]
    pub served_model_name: Vec<String>,
    pub listen: String,
    #[serde(deserialize_with = "list_or_commas")]
    pub prefill: Vec<String>,
    #[serde(deserialize_with = "list_or_commas")]
    pub decode: Vec<String>,
    pub first_token_timeout_s: f64,
    pub token_timeout_s: f64,
    pub max_attempts: usize,
    pub migration_limit: u32,
    pub prefill_policy: String,
    pub decode_policy: String,
    pub health_interval_s: f64,
    pub max_body_bytes: usize,
    pub max_model_len: Option<usize>,
    pub chat_template: Option<String>,
    pub chat_template_kwargs: Option<String>,
    /// Keys for the OpenAI endpoints (`PDSERVE_API_KEY` may hold one, or several
    /// comma-separated).
    #[serde(deserialize_with = "one_or_many")]
    pub api_key: Vec<String>,
    pub api_key_file: Option<PathBuf>,
    /// Keys for `/workers` and `/config`.
    #[serde(deserialize_with = "one_or_many")]
    pub admin_key: Vec<String>,
    pub admin_key_file: Option<PathBuf>,
    pub allow_unauthenticated: bool,
    pub cluster_token: Option<String>,
    pub cluster_token_file: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    pub max_concurrent_requests: usize,
    pub header_timeout_s: f64,
    pub body_timeout_s: f64,
    pub max_connections: usize,
    #[serde(deserialize_with = "list_or_commas")]
    pub discover_prefill: Vec<String>,
    #[serde(deserialize_with = "list_or_commas")]
    pub discover_decode: Vec<String>,
    pub discover_interval_s: f64,
}

/// Config keys whose values are secrets: `--print-config`, `GET /config` and the logs
/// show only how many were given.
pub const SECRET_KEYS: &[&str] = &["api_key", "admin_key", "cluster_token"];

/// Replace secret values by a count, keeping their source.
pub fn redact(entries: &mut [Entry]) {
    for e in entries.iter_mut() {
        if SECRET_KEYS.contains(&e.key.as_str()) {
            let n = serde_json::from_str::<Vec<String>>(&e.value)
                .map(|v| v.len())
                .unwrap_or(usize::from(e.value != "(none)"));
            e.value = format!("({n} redacted)");
        }
    }
}

/// A list from a TOML/flag array, or from one string (an environment variable), split on
/// commas.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        // The environment layer reads an all-digit value as a number.
        Digits(u64),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => s.split(',').map(str::to_string).collect(),
        OneOrMany::Digits(n) => vec![n.to_string()],
        OneOrMany::Many(v) => v,
    })
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
    "served_model_name",
    "listen",
    "prefill",
    "decode",
    "first_token_timeout_s",
    "token_timeout_s",
    "max_attempts",
    "migration_limit",
    "prefill_policy",
    "decode_policy",
    "health_interval_s",
    "max_body_bytes",
    "max_model_len",
    "api_key",
    "api_key_file",
    "admin_key",
    "admin_key_file",
    "allow_unauthenticated",
    "cluster_token",
    "cluster_token_file",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "max_concurrent_requests",
    "header_timeout_s",
    "body_timeout_s",
    "max_connections",
    "chat_template",
    "chat_template_kwargs",
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
    /// Name(s) the model is served under, as vLLM's flag: GET /v1/models lists them,
    /// responses carry the first, and a request may name any of them or the model
    /// folder's name (others: 404 model_not_found). Default: the folder's name.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Option<Vec<String>>,
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
    /// Times one stream may move to another prefill/decode pair when its decode worker is
    /// lost mid-stream (0: never; the stream ends with an error event). Exact continuation
    /// needs --deterministic workers and greedy or seeded sampling.
    #[arg(long)]
    pub migration_limit: Option<u32>,
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
    /// API key clients must send as `Authorization: Bearer <key>` on /v1/... (repeat for
    /// several; also PDSERVE_API_KEY). Prefer --api-key-file: flags show in `ps`.
    #[arg(long)]
    pub api_key: Option<Vec<String>>,
    /// File with API keys, one per line (`#` comments); re-read on SIGHUP.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Key for /workers and /config (repeatable; also PDSERVE_ADMIN_KEY). With API keys
    /// but no admin key those endpoints are closed.
    #[arg(long)]
    pub admin_key: Option<Vec<String>>,
    /// File with admin keys, one per line; re-read on SIGHUP.
    #[arg(long)]
    pub admin_key_file: Option<PathBuf>,
    /// Serve without an API key on a non-loopback address (refused otherwise).
    #[arg(long)]
    pub allow_unauthenticated: bool,
    #[command(flatten)]
    pub cluster: ClusterTokenFlags,
    #[command(flatten)]
    pub tls: crate::trust::TlsFlags,
    /// Most completion requests in flight at once; past it a 429 with Retry-After.
    #[arg(long)]
    pub max_concurrent_requests: Option<usize>,
    /// Seconds a client has to send a request's headers; also how long an idle
    /// keep-alive connection stays open.
    #[arg(long)]
    pub header_timeout_s: Option<f64>,
    /// Seconds a request body may go without a byte arriving (then 408).
    #[arg(long)]
    pub body_timeout_s: Option<f64>,
    /// Most open client connections; more wait in the kernel's accept queue.
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// How chat messages become a prompt: `deepseek-v4` (the built-in DeepSeek-V4
    /// encoder) or a Jinja template file. Default: the model folder's
    /// chat_template.jinja, else tokenizer_config.json's chat_template, else deepseek-v4
    /// when the folder ships encoding/encoding_dsv4.py.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Default chat_template_kwargs as a JSON object (a request's own entries win), e.g.
    /// '{"thinking": true}'.
    #[arg(long)]
    pub chat_template_kwargs: Option<String>,
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
        pdserve_router::served_model::check_names(&self.served_model_name)?;
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
            ("--header-timeout-s", self.header_timeout_s),
            ("--body-timeout-s", self.body_timeout_s),
            ("--discover-interval-s", self.discover_interval_s),
        ] {
            if !(t.is_finite() && t > 0.0) {
                bail!("{flag} must be a positive number of seconds, got {t}");
            }
        }
        if self.max_concurrent_requests == 0 || self.max_connections == 0 {
            bail!("--max-concurrent-requests and --max-connections must be at least 1");
        }
        self.chat_template_kwargs()?;
        Ok(())
    }

    /// `--chat-template-kwargs` parsed (empty when unset).
    pub fn chat_template_kwargs(&self) -> Result<serde_json::Map<String, serde_json::Value>> {
        match &self.chat_template_kwargs {
            None => Ok(serde_json::Map::new()),
            Some(s) => match serde_json::from_str(s) {
                Ok(serde_json::Value::Object(o)) => Ok(o),
                Ok(_) => bail!("--chat-template-kwargs must be a JSON object, got {s}"),
                Err(e) => bail!("--chat-template-kwargs is not JSON ({e}): {s}"),
            },
        }
    }
}

impl RouterFlags {
    pub fn resolve(&self) -> Result<(RouterConfig, Vec<Entry>)> {
        let mut f = Flags::new();
        flag(&mut f, "model", &self.model);
        flag(&mut f, "served_model_name", &self.served_model_name);
        flag(&mut f, "listen", &self.listen);
        flag(&mut f, "prefill", &self.prefill);
        flag(&mut f, "decode", &self.decode);
        flag(&mut f, "first_token_timeout_s", &self.first_token_timeout_s);
        flag(&mut f, "token_timeout_s", &self.token_timeout_s);
        flag(&mut f, "max_attempts", &self.max_attempts);
        flag(&mut f, "migration_limit", &self.migration_limit);
        flag(&mut f, "prefill_policy", &self.prefill_policy);
        flag(&mut f, "decode_policy", &self.decode_policy);
        flag(&mut f, "health_interval_s", &self.health_interval_s);
        flag(&mut f, "max_body_bytes", &self.max_body_bytes);
        flag(&mut f, "max_model_len", &self.max_model_len);
        flag(&mut f, "api_key", &self.api_key);
        flag(&mut f, "api_key_file", &self.api_key_file);
        flag(&mut f, "admin_key", &self.admin_key);
        flag(&mut f, "admin_key_file", &self.admin_key_file);
        flag(
            &mut f,
            "allow_unauthenticated",
            &self.allow_unauthenticated.then_some(true),
        );
        self.cluster.put(&mut f);
        self.tls.put(&mut f);
        flag(
            &mut f,
            "max_concurrent_requests",
            &self.max_concurrent_requests,
        );
        flag(&mut f, "header_timeout_s", &self.header_timeout_s);
        flag(&mut f, "body_timeout_s", &self.body_timeout_s);
        flag(&mut f, "max_connections", &self.max_connections);
        flag(&mut f, "chat_template", &self.chat_template);
        flag(&mut f, "chat_template_kwargs", &self.chat_template_kwargs);
        flag(&mut f, "discover_prefill", &self.discover_prefill);
        flag(&mut f, "discover_decode", &self.discover_decode);
        flag(&mut f, "discover_interval_s", &self.discover_interval_s);
        let (cfg, mut entries) = layered::extract(
            &RouterConfig::defaults(),
            self.config.as_deref(),
            ROUTER_KEYS,
            f,
        )?;
        redact(&mut entries);
        Ok((cfg, entries))
    }
}

impl RouterConfig {
    pub fn defaults() -> Self {
        RouterConfig {
            model: None,
            served_model_name: Vec::new(),
            listen: "127.0.0.1:8000".into(),
            prefill: Vec::new(),
            decode: Vec::new(),
            first_token_timeout_s: 120.0,
            token_timeout_s: 30.0,
            max_attempts: 3,
            migration_limit: 1,
            prefill_policy: "prefix_affinity".into(),
            decode_policy: "least_load".into(),
            health_interval_s: 0.5,
            max_body_bytes: 2 << 20,
            max_model_len: None,
            api_key: Vec::new(),
            api_key_file: None,
            admin_key: Vec::new(),
            admin_key_file: None,
            allow_unauthenticated: false,
            cluster_token: None,
            cluster_token_file: None,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            max_concurrent_requests: 1024,
            header_timeout_s: 10.0,
            body_timeout_s: 10.0,
            max_connections: 4096,
            chat_template: None,
            chat_template_kwargs: None,
            discover_prefill: Vec::new(),
            discover_decode: Vec::new(),
            discover_interval_s: 5.0,
        }
    }
}
