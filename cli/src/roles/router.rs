//! The `router`'s configuration: keys, defaults, flags, validation.

use super::{list_or_commas, one_or_many, redact, ClusterTokenFlags};
use crate::layered::{self, flag, Entry, Flags};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
