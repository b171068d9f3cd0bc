//! The runtime a prefill and a decode server share around their engine thread: the
//! `Worker` service with the live load counters, the lifecycle (loading, ready,
//! draining) behind the probes and the graceful drain, the HTTP side port with the
//! worker's Prometheus series, startup (waiting for the model), the gRPC server both roles
//! run, the one mapping of engine failures to gRPC statuses and the sampling-parameter
//! conversions. `pdserve-proto` holds only the wire contract.

pub mod http;
pub mod lifecycle;
pub mod metrics;
mod sampling;
mod serve;
mod status;
mod status_code;

pub use lifecycle::{InFlight, Lifecycle, NotTaking, Phase};
pub use sampling::{sampling_from_pb, sampling_to_pb};
pub use serve::{engine_ready, no_delay, serve_grpc, Ports, ServeError, Startup};
pub use status::{Load, WorkerService, WorkerStatus};
pub use status_code::Failure;

/// The gRPC status for a request a worker does not take (loading or draining):
/// UNAVAILABLE, so a router retries it on another worker before the first token.
pub fn not_taking_status(e: NotTaking) -> tonic::Status {
    tonic::Status::unavailable(e.to_string())
}
