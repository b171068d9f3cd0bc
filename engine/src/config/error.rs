//! Config errors: [`ConfigError`] and the helpers that build its `Field` variant.

use std::path::PathBuf;

/// Why a `config.json` could not be turned into a [`ModelConfig`](super::ModelConfig).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin} is not valid JSON: {source}")]
    Json {
        origin: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("config field `{field}`: {reason}")]
    Field { field: String, reason: String },
}

pub(super) fn field_err(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.into(),
        reason: reason.into(),
    }
}

/// `Err(Field)` with a lazily built reason unless `ok`.
pub(super) fn ensure(ok: bool, field: &str, reason: impl FnOnce() -> String) -> Res<()> {
    if ok {
        Ok(())
    } else {
        Err(field_err(field, reason()))
    }
}

pub(super) type Res<T> = Result<T, ConfigError>;
