//! Moving a prefilled sequence's KV state from a prefill server to a decode server over
//! gRPC: the layouts are compared field by field before anything is computed or sent,
//! pages travel in chunks that each carry a CRC32 the receiver verifies before use, and
//! every wait on the stream has a deadline.

mod chunks;
mod early;
mod layout;
mod pull;

pub use chunks::{
    encode_prefill, first_token_message, max_message_bytes, prefill_messages, progress_message,
    Assembler, Expected, Prefilled, MAX_CHUNK_BYTES,
};
pub use early::EarlyToken;
pub use layout::{check_peer, layout_info};
pub use pull::{pull_prefill, PullOptions, PullRequest, HEARTBEAT};

use pdserve_engine::kv::LayoutError;

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The peers' KV layouts differ; names the field.
    #[error("prefill and decode KV layouts differ: {0}")]
    Layout(#[from] LayoutError),
    #[error(
        "checksum mismatch in {what}: sender's crc32 {sent:08x}, received data hashes to {got:08x}"
    )]
    Checksum { what: String, sent: u32, got: u32 },
    #[error("KV transfer protocol error: {0}")]
    Protocol(String),
    #[error("prefill server {addr} unreachable: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("prefill server {addr} failed: {}", status.message())]
    Peer { addr: String, status: tonic::Status },
    #[error("KV transfer from {addr} timed out after {secs:.1} s waiting for {what}")]
    Timeout {
        addr: String,
        what: &'static str,
        secs: f64,
    },
}

impl TransferError {
    /// The gRPC status a decode server reports for this failure.
    pub fn to_status(&self) -> tonic::Status {
        let msg = self.to_string();
        match self {
            TransferError::Layout(_) => tonic::Status::failed_precondition(msg),
            TransferError::Checksum { .. } | TransferError::Protocol(_) => {
                tonic::Status::data_loss(msg)
            }
            TransferError::Unreachable { .. } => tonic::Status::unavailable(msg),
            TransferError::Peer { status, .. } => tonic::Status::new(status.code(), msg),
            TransferError::Timeout { .. } => tonic::Status::deadline_exceeded(msg),
        }
    }
}
