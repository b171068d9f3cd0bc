//! THE mapping from an engine failure to the gRPC status a worker answers with. The
//! class is decided where the error arises ([`EngineError::class`]); here it only picks
//! the code, so a server bug is INTERNAL, never INVALID_ARGUMENT.

use pdserve_engine::{EngineError, ErrorClass};
use tonic::Status;

/// A failed request in engine terms: its class and the words for the client. Engine
/// threads hand this (not a gRPC status) to their service, which converts at the edge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub class: ErrorClass,
    pub message: String,
}

impl Failure {
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        Failure {
            class,
            message: message.into(),
        }
    }

    /// `e` in its own class, its message prefixed with `context` when one is given
    /// (`"decode step failed"`). A client's own mistake is reported in its bare words.
    pub fn from_engine(e: &EngineError, context: Option<&str>) -> Self {
        let message = match e {
            EngineError::InvalidInput(m) => m.clone(),
            other => other.to_string(),
        };
        let message = match context {
            Some(c) => format!("{c}: {message}"),
            None => message,
        };
        Failure::new(e.class(), message)
    }

    /// The gRPC status for this failure.
    pub fn to_status(&self) -> Status {
        let message = self.message.clone();
        match self.class {
            ErrorClass::InvalidInput => Status::invalid_argument(message),
            ErrorClass::Exhausted => Status::resource_exhausted(message),
            ErrorClass::Corrupt => Status::data_loss(message),
            ErrorClass::Internal => Status::internal(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_engine::kv::PoolError;
    use tonic::Code;

    #[test]
    fn each_class_has_its_code() {
        let cases = [
            (ErrorClass::InvalidInput, Code::InvalidArgument),
            (ErrorClass::Exhausted, Code::ResourceExhausted),
            (ErrorClass::Corrupt, Code::DataLoss),
            (ErrorClass::Internal, Code::Internal),
        ];
        for (class, code) in cases {
            let s = Failure::new(class, "why").to_status();
            assert_eq!((s.code(), s.message()), (code, "why"), "{class:?}");
        }
    }

    fn engine_status(e: &EngineError, context: Option<&str>) -> Status {
        Failure::from_engine(e, context).to_status()
    }

    #[test]
    fn engine_errors_map_by_their_class() {
        let s = engine_status(&EngineError::InvalidInput("empty prompt".into()), None);
        assert_eq!(
            (s.code(), s.message()),
            (Code::InvalidArgument, "empty prompt")
        );
        let bug = EngineError::Internal("prefix node 3 missing".into());
        let s = engine_status(&bug, Some("decode step failed"));
        assert_eq!(s.code(), Code::Internal);
        assert_eq!(
            s.message(),
            "decode step failed: internal error: prefix node 3 missing"
        );
        let full = EngineError::Pool(PoolError::PagesExhausted {
            asked: 4,
            free: 1,
            total: 2,
        });
        assert_eq!(engine_status(&full, None).code(), Code::ResourceExhausted);
        let audit = EngineError::KvAudit {
            pages: Vec::new(),
            states: Vec::new(),
        };
        assert_eq!(engine_status(&audit, None).code(), Code::DataLoss);
    }
}
