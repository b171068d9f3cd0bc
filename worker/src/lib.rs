//! The runtime a prefill and a decode server share around their engine thread: the
//! `Worker` service with the live load counters, startup (waiting for the model), the
//! gRPC server both roles run, the one mapping of engine failures to gRPC statuses and
//! the sampling-parameter conversions.
//! `pdserve-proto` holds only the wire contract.

mod sampling;
mod serve;
mod status;
mod status_code;

pub use sampling::{sampling_from_pb, sampling_to_pb};
pub use serve::{engine_ready, serve_grpc, ServeError};
pub use status::{Load, WorkerService, WorkerStatus};
pub use status_code::Failure;
