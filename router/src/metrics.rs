//! Router request metrics through the `metrics` facade, rendered from the process-wide
//! Prometheus recorder at `GET /metrics` (anything else in the process that records with
//! `metrics::gauge!` etc. shows up there too).
//!
//! | name | kind | labels |
//! | --- | --- | --- |
//! | `pdserve_router_requests_total` | counter | `endpoint`, `status` (HTTP code) |
//! | `pdserve_router_stream_errors_total` | counter | errors after a stream began |
//! | `pdserve_router_running_requests` | gauge | generations in flight |
//! | `pdserve_router_time_to_first_token_seconds` | histogram | |
//! | `pdserve_router_inter_token_latency_seconds` | histogram | |
//! | `pdserve_router_e2e_latency_seconds` | histogram | request to last token |
//! | `pdserve_router_prompt_tokens_total` | counter | |
//! | `pdserve_router_completion_tokens_total` | counter | |
//! | `pdserve_router_retries_total` | counter | pairs retried before a first token |
//! | `pdserve_router_migrations_total` | counter | `outcome` (`ok`, `failed`): streams moved to another pair after their decode worker was lost |

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Install the Prometheus recorder once per process (every router in the process shares
/// it). Err when another recorder was installed first.
pub fn handle() -> Result<&'static PrometheusHandle, &'static str> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
                .map_err(|e| e.to_string())?;
            let h = builder.install_recorder().map_err(|e| {
                format!("another metrics recorder is installed in this process: {e}")
            })?;
            describe();
            Ok(h)
        })
        .as_ref()
        .map_err(String::as_str)
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "pdserve_router_requests_total",
        "API requests by endpoint and HTTP status"
    );
    describe_counter!(
        "pdserve_router_stream_errors_total",
        "Streams that ended with an error event after starting"
    );
    describe_gauge!(
        "pdserve_router_running_requests",
        "Generations in flight through this router"
    );
    describe_histogram!(
        "pdserve_router_time_to_first_token_seconds",
        Unit::Seconds,
        "Request arrival to first generated token"
    );
    describe_histogram!(
        "pdserve_router_inter_token_latency_seconds",
        Unit::Seconds,
        "Time between two generated tokens of a request"
    );
    describe_histogram!(
        "pdserve_router_e2e_latency_seconds",
        Unit::Seconds,
        "Request arrival to its last token"
    );
    describe_counter!("pdserve_router_prompt_tokens_total", "Prompt tokens served");
    describe_counter!("pdserve_router_completion_tokens_total", "Tokens generated");
    describe_counter!(
        "pdserve_router_retries_total",
        "Worker pairs retried before a request's first token"
    );
    describe_counter!(
        "pdserve_router_migrations_total",
        "Streams continued on another worker pair after their decode worker was lost mid-stream, by outcome"
    );
}

/// Periodic upkeep of the recorder (drains histogram buffers), until the task is dropped.
pub async fn upkeep(every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        if let Ok(h) = handle() {
            h.run_upkeep();
        }
    }
}

pub fn request(endpoint: &str, status: u16) {
    metrics::counter!("pdserve_router_requests_total", "endpoint" => endpoint.to_string(), "status" => status.to_string()).increment(1);
}

pub fn stream_error() {
    metrics::counter!("pdserve_router_stream_errors_total").increment(1);
}

pub fn time_to_first_token(d: Duration) {
    metrics::histogram!("pdserve_router_time_to_first_token_seconds").record(d.as_secs_f64());
}

pub fn inter_token(d: Duration) {
    metrics::histogram!("pdserve_router_inter_token_latency_seconds").record(d.as_secs_f64());
}

pub fn end_to_end(d: Duration) {
    metrics::histogram!("pdserve_router_e2e_latency_seconds").record(d.as_secs_f64());
}

pub fn prompt_tokens(n: usize) {
    metrics::counter!("pdserve_router_prompt_tokens_total").increment(n as u64);
}

pub fn completion_tokens(n: usize) {
    metrics::counter!("pdserve_router_completion_tokens_total").increment(n as u64);
}

pub fn retry() {
    metrics::counter!("pdserve_router_retries_total").increment(1);
}

/// A mid-stream migration: `ok` (the stream continued) or `failed`.
pub fn migration(outcome: &'static str) {
    metrics::counter!("pdserve_router_migrations_total", "outcome" => outcome).increment(1);
}

/// Counts a generation as running while alive.
pub struct Running(());

impl Default for Running {
    fn default() -> Self {
        Self::new()
    }
}

impl Running {
    pub fn new() -> Self {
        metrics::gauge!("pdserve_router_running_requests").increment(1.0);
        Running(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        metrics::gauge!("pdserve_router_running_requests").decrement(1.0);
    }
}
