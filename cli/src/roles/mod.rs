//! Configuration of the `prefill`, `decode` and `router` roles: keys, defaults, flags,
//! validation (flags whose machinery does not exist yet are refused, never ignored).
//! One module per role family; what every role shares (the cluster token flags, secret
//! redaction, list-valued keys) lives here.

mod router;
mod worker;

pub use router::{RouterConfig, RouterFlags, ROUTER_KEYS};
pub use worker::{WorkerConfig, WorkerFlags, WorkerRole, WORKER_KEYS};

use crate::layered::{flag, Entry, Flags};
use anyhow::{bail, Result};
use serde::Deserialize;
use std::path::PathBuf;

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
