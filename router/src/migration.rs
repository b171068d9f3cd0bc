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

use crate::error::ApiError;
use crate::generation::Job;

/// How a started stream broke.
pub struct StreamFault {
    pub error: ApiError,
    /// The worker went away or stalled: another pair can continue the stream.
    pub migratable: bool,
}

impl StreamFault {
    /// The decode worker is gone or stuck (lost connection, stream cut, progress
    /// deadline).
    pub fn lost(error: ApiError) -> Self {
        StreamFault {
            error,
            migratable: true,
        }
    }

    /// A gRPC status the decode worker's stream ended with.
    pub fn status(s: &tonic::Status, worker: &str) -> Self {
        StreamFault {
            error: ApiError::from_status(s, worker),
            migratable: migratable(s.code()),
        }
    }

    pub fn fatal(error: ApiError) -> Self {
        StreamFault {
            error,
            migratable: false,
        }
    }
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

impl Job {
    /// The job that continues this one after `generated` (its tokens so far): the prompt
    /// grows by them, the token budget shrinks by them, sampling resumes after them.
    /// None when the budget is spent (only the finish event was lost).
    pub fn resumed(&self, generated: &[u32]) -> Option<Job> {
        let k = u32::try_from(generated.len()).ok()?;
        let left = self.max_new_tokens.checked_sub(k).filter(|&l| l > 0)?;
        let mut j = self.clone();
        j.prompt.extend_from_slice(generated);
        j.max_new_tokens = left;
        j.sampling.resumed_tokens = self.sampling.resumed_tokens.saturating_add(k);
        Some(j)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_proto::pb;

    fn job() -> Job {
        Job {
            request_id: "r".into(),
            prompt: vec![5, 6, 7],
            sampling: pb::SamplingParams {
                temperature: 0.7,
                seed: 9,
                ..Default::default()
            },
            max_new_tokens: 10,
            stop_tokens: vec![1],
            top_logprobs: Some(2),
        }
    }

    #[test]
    fn a_resumed_job_carries_the_tokens_so_far_and_the_rest_of_the_budget() {
        let j = job().resumed(&[40, 41, 42]).unwrap();
        assert_eq!(j.prompt, vec![5, 6, 7, 40, 41, 42]);
        assert_eq!(j.max_new_tokens, 7);
        assert_eq!(j.sampling.resumed_tokens, 3);
        assert_eq!((j.sampling.seed, j.sampling.temperature), (9, 0.7));
        assert_eq!((j.stop_tokens, j.top_logprobs), (vec![1], Some(2)));
        // A second migration counts from the original prompt on.
        let j2 = j.resumed(&[43]).unwrap();
        assert_eq!(j2.prompt, vec![5, 6, 7, 40, 41, 42, 43]);
        assert_eq!((j2.max_new_tokens, j2.sampling.resumed_tokens), (6, 4));
        // Every token already out: nothing to resume.
        assert!(job().resumed(&[1; 10]).is_none());
    }

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
