//! Layered configuration: defaults < TOML file (`--config`) < environment (`PDSERVE_*`)
//! < command-line flags, with the source of every effective value kept for
//! `--print-config` and the workers' info RPC.

use anyhow::{bail, Context, Result};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::Path;

/// A provider under a name of our choosing (the name is what `--print-config` shows).
struct Named<P> {
    name: String,
    inner: P,
}

impl<P: Provider> Provider for Named<P> {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name.clone())
    }

    fn data(&self) -> std::result::Result<Map<Profile, Dict>, figment::Error> {
        self.inner.data()
    }
}

/// One effective value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: String,
    pub source: String,
}

/// Flags that were given on the command line, as a JSON object of config keys.
pub type Flags = serde_json::Map<String, serde_json::Value>;

/// Insert `value` under `key` when the flag was given.
pub fn flag<T: Serialize>(flags: &mut Flags, key: &str, value: &Option<T>) {
    if let Some(v) = value {
        if let Ok(j) = serde_json::to_value(v) {
            flags.insert(key.to_string(), j);
        }
    }
}

/// Extract `T` from the layers; `keys` are the config keys (environment: `PDSERVE_<KEY>`).
pub fn extract<T: Serialize + DeserializeOwned>(
    defaults: &T,
    file: Option<&Path>,
    keys: &[&str],
    flags: Flags,
) -> Result<(T, Vec<Entry>)> {
    let mut fig = Figment::from(Named {
        name: "default".into(),
        inner: Serialized::defaults(defaults),
    });
    if let Some(p) = file {
        if !p.is_file() {
            bail!("config file {} does not exist", p.display());
        }
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let table: toml_table::Table = toml_table::parse(&text)
            .with_context(|| format!("config file {} is not valid TOML", p.display()))?;
        if let Some(k) = table.keys().find(|k| !keys.contains(&k.as_str())) {
            bail!(
                "config file {}: unknown key `{k}` (known: {})",
                p.display(),
                keys.join(", ")
            );
        }
        fig = fig.merge(Named {
            name: format!("file {}", p.display()),
            inner: Toml::file(p),
        });
    }
    let owned: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    fig = fig.merge(Named {
        name: "env".into(),
        inner: Env::prefixed("PDSERVE_")
            .filter(move |k| owned.iter().any(|o| k.as_str().eq_ignore_ascii_case(o))),
    });
    fig = fig.merge(Named {
        name: "flag".into(),
        inner: Serialized::defaults(flags),
    });
    let cfg: T = fig
        .extract()
        .map_err(|e| anyhow::anyhow!("configuration: {e}"))?;
    let value = serde_json::to_value(&cfg)?;
    let mut entries = Vec::new();
    for k in keys {
        let v = value.get(*k).cloned().unwrap_or(serde_json::Value::Null);
        let source = match fig.find_metadata(k).map(|m| m.name.to_string()) {
            Some(n) if n == "env" => format!("env PDSERVE_{}", k.to_uppercase()),
            Some(n) if n == "flag" => format!("flag --{}", k.replace('_', "-")),
            Some(n) => n,
            None => "default".into(),
        };
        let value = match v {
            serde_json::Value::String(s) => s,
            serde_json::Value::Null => "(none)".into(),
            other => other.to_string(),
        };
        entries.push(Entry {
            key: k.to_string(),
            value,
            source,
        });
    }
    Ok((cfg, entries))
}

/// `key = value   # source`, one per line.
pub fn render(entries: &[Entry]) -> String {
    let w = entries.iter().map(|e| e.key.len()).max().unwrap_or(0);
    let vw = entries
        .iter()
        .map(|e| e.value.len())
        .max()
        .unwrap_or(0)
        .min(40);
    entries
        .iter()
        .map(|e| format!("{:w$} = {:vw$}  # {}\n", e.key, e.value, e.source))
        .collect()
}

/// Top-level keys of a TOML document (to refuse unknown keys instead of ignoring them).
mod toml_table {
    pub type Table = figment::value::Dict;

    pub fn parse(text: &str) -> anyhow::Result<Table> {
        use figment::providers::{Format, Toml};
        Ok(figment::Figment::from(Toml::string(text)).extract::<Table>()?)
    }
}
