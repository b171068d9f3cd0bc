//! Mid-stream migration: when the decode worker of a started stream dies (its connection
//! lost, its stream broken, or no token within the progress deadline), the router asks
//! another prefill/decode pair for the rest: the prompt plus every token generated so far
//! as the new prompt, the remaining token budget, and the same sampling parameters with
//! `resumed_tokens` set, so that the sampler draws token `k` keyed by `(seed, k)` and counts
//! the earlier tokens for the penalties. The client's stream goes on; with
//! `--deterministic` workers and greedy or seeded sampling its tokens are exactly those of
//! an unbroken run (the CPU backend is batch- and chunk-invariant always).
//!
//! Not migrated: failures that say the request itself is wrong (invalid, refused,
//! mismatched layouts) or that the tokens already sent may be wrong (`DATA_LOSS`: corrupt
//! KV, a KV canary violation).
//!
//! This module decides which faults migrate; the move itself is `Started::migrate` and
//! the continued job `Job::resumed`, in `generation.rs`.

use crate::error::ApiError;
use pdserve_proto::FAILED_WORKER;

/// How a started stream broke.
pub struct StreamFault {
    pub error: ApiError,
    /// The worker went away or stalled: another pair can continue the stream.
    pub migratable: bool,
    /// The decode server says its prefill server failed (the stream had its first token,
    /// sent ahead of the KV, when the transfer broke): another prefill server continues.
    pub prefill_failed: bool,
}

impl StreamFault {
    /// The decode worker is gone or stuck (lost connection, stream cut, progress
    /// deadline).
    pub fn lost(error: ApiError) -> Self {
        StreamFault {
            error,
            migratable: true,
            prefill_failed: false,
        }
    }

    /// A gRPC status the decode worker's stream ended with.
    pub fn status(s: &tonic::Status, worker: &str) -> Self {
        StreamFault {
            error: ApiError::from_status(s, worker),
            migratable: migratable(s.code()),
            prefill_failed: prefill_failed(s),
        }
    }

    pub fn fatal(error: ApiError) -> Self {
        StreamFault {
            error,
            migratable: false,
            prefill_failed: false,
        }
    }
}

/// Whether a decode server's status names its prefill server as the worker that failed.
pub fn prefill_failed(status: &tonic::Status) -> bool {
    status
        .metadata()
        .get(FAILED_WORKER)
        .is_some_and(|v| v.as_bytes() == b"prefill")
}

/// Whether a stream that ended with `code` may continue on another pair: the transport
/// failed (h2 resets and broken connections arrive as UNAVAILABLE, UNKNOWN or CANCELLED),
/// the worker shut down or timed out, or it hit an internal fault of its own.
pub fn migratable(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(
        code,
        Unavailable | Unknown | Cancelled | Aborted | DeadlineExceeded | Internal
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lost_or_stuck_workers_migrate() {
        use tonic::Code::*;
        for c in [
            Unavailable,
            Unknown,
            Cancelled,
            Aborted,
            DeadlineExceeded,
            Internal,
        ] {
            assert!(migratable(c), "{c:?}");
        }
        for c in [
            InvalidArgument,
            OutOfRange,
            ResourceExhausted,
            FailedPrecondition,
            DataLoss,
            PermissionDenied,
            Unauthenticated,
        ] {
            assert!(!migratable(c), "{c:?}");
        }
    }
}
