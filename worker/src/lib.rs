//! The runtime a prefill and a decode server share around their engine thread: the
//! `Worker` service with the live load counters, startup (waiting for the model) and the
//! gRPC server both roles run. `pdserve-proto` holds only the wire contract.

mod serve;
mod status;

pub use serve::{engine_ready, serve_grpc, ServeError};
pub use status::{Load, WorkerService, WorkerStatus};
