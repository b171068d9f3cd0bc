//! What can go wrong in an engine, and which kind of failure each error is.

use crate::backend::BackendError;
use crate::kv::audit::AuditError;
use crate::kv::{LayoutError, PageId, PoolError, StateSlot};
use crate::model::LoadError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The caller's input is wrong (empty prompt, token outside the vocabulary, too long,
    /// bad sampling parameters): a client error.
    #[error("invalid request: {0}")]
    InvalidInput(String),
    /// An invariant of the engine or of data handed between engines broke (prefix-cache
    /// bookkeeping, a KV snapshot whose layout differs, a sampler failure): a server bug.
    #[error("internal error: {0}")]
    Internal(String),
    #[error("KV audit: pages {pages:?} and state slots {states:?} changed outside this step's expected writes; the request's KV state is corrupt")]
    KvAudit {
        pages: Vec<PageId>,
        states: Vec<StateSlot>,
    },
    #[error(transparent)]
    Host(#[from] crate::kv::HostPoolError),
    /// A pool size that cannot work (`--kv-mem-fraction` sized at load).
    #[error(transparent)]
    Sizing(#[from] crate::kv::sizing::SizingError),
}

/// What kind of failure an [`EngineError`] is, decided where it arises; the servers map
/// a class to a gRPC status in one place (`pdserve_worker`), the router to HTTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The request itself is wrong: the client can fix it (gRPC INVALID_ARGUMENT, HTTP 400).
    InvalidInput,
    /// Out of KV pages or state slots: retry later or elsewhere (RESOURCE_EXHAUSTED, 503).
    Exhausted,
    /// KV state found corrupt by the audit (DATA_LOSS, HTTP 502 `data_loss`).
    Corrupt,
    /// Anything else is the server's fault (INTERNAL, 500).
    Internal,
}

impl EngineError {
    pub fn class(&self) -> ErrorClass {
        match self {
            EngineError::InvalidInput(_) => ErrorClass::InvalidInput,
            EngineError::Pool(
                crate::kv::PoolError::PagesExhausted { .. }
                | crate::kv::PoolError::StatesExhausted { .. },
            ) => ErrorClass::Exhausted,
            EngineError::KvAudit { .. } => ErrorClass::Corrupt,
            EngineError::Config(_)
            | EngineError::Load(_)
            | EngineError::Checkpoint(_)
            | EngineError::Layout(_)
            | EngineError::Pool(_)
            | EngineError::Backend(_)
            | EngineError::Internal(_)
            | EngineError::Host(_)
            | EngineError::Sizing(_) => ErrorClass::Internal,
        }
    }
}

impl From<AuditError> for EngineError {
    fn from(e: AuditError) -> Self {
        match e {
            AuditError::Backend(e) => EngineError::Backend(e),
            AuditError::Corrupt { pages, states } => EngineError::KvAudit { pages, states },
        }
    }
}
