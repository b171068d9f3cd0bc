//! A worker's own Prometheus series, rendered at `GET /metrics` on its side port
//! (`--metrics-listen`). Every series carries the global labels `model_name` and `role`;
//! counters end in `_total`, gauges do not, enums are labels. Beside these, the process
//! recorder holds the engine's KV series (`pdserve_kv_pages_*{pool}`,
//! `pdserve_prefix_cache_*`, `pdserve_kv_audit_violations_total`) and the decode graphs'
//! (`pdserve_cuda_graph_*_total`).
//!
//! | name | kind | what |
//! | --- | --- | --- |
//! | `pdserve_num_requests_running` | gauge | in the decode batch / on the prefill engine (vLLM's `num_requests_running`) |
//! | `pdserve_num_requests_waiting` | gauge | waiting for admission or the engine (vLLM's `num_requests_waiting`) |
//! | `pdserve_kv_cache_usage_perc` | gauge | fraction (0..1) of device KV pages held by requests, prefix-cache pages excluded (vLLM's `kv_cache_usage_perc`) |
//! | `pdserve_kv_pages_free` | gauge | device KV pages free |
//! | `pdserve_kv_pages_cached` | gauge | device KV pages held only by the prefix cache (evictable) |
//! | `pdserve_worker_phase` | gauge | 1 for the current `phase` (`loading`, `ready`, `draining`), 0 for the others |
//! | `pdserve_kv_transfers_total` | counter | KV transfers (prefill: sent; decode: received) |
//! | `pdserve_kv_transfer_bytes_total` | counter | their bytes (pages + state + logits) |
//! | `pdserve_kv_transfer_seconds` | histogram | one transfer (prefill: streaming it; decode: the whole pull, prefill compute included) |
//! | `pdserve_request_queue_time_seconds` | histogram | arrival to admission (decode) / to the engine starting it (prefill) |
//! | `pdserve_request_prefill_time_seconds` | histogram | prefill compute of one prompt, its pages' export included (prefill) |
//! | `pdserve_request_prefill_first_token_seconds` | histogram | prefill compute of one prompt up to its first token sampled (prefill) |
//! | `pdserve_first_token_seconds` | histogram | a pull's start to the request's first token handed to its stream: ahead of the KV for plain requests, at admission otherwise (decode) |
//! | `pdserve_decode_step_seconds` | histogram | one batched decode step, sampling included (decode) |
//! | `pdserve_decode_batch_size` | histogram | requests in one decode step (decode) |
//! | `pdserve_decode_step_gap_seconds` | histogram | host time from one decode step's end to the next one's start while the batch is busy: the GPU's idle time (decode) |
//! | `pdserve_decode_step_gap_part_seconds` | histogram | that gap's parts, by `part`: `sample` (sampling and streaming the step's tokens), `admit` (joining new requests, their KV imported), `other` (decode) |

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

pub const NUM_REQUESTS_RUNNING: &str = "pdserve_num_requests_running";
pub const NUM_REQUESTS_WAITING: &str = "pdserve_num_requests_waiting";
pub const KV_CACHE_USAGE: &str = "pdserve_kv_cache_usage_perc";
pub const KV_PAGES_FREE: &str = "pdserve_kv_pages_free";
pub const KV_PAGES_CACHED: &str = "pdserve_kv_pages_cached";
pub const WORKER_PHASE: &str = "pdserve_worker_phase";
pub const KV_TRANSFERS: &str = "pdserve_kv_transfers_total";
pub const KV_TRANSFER_BYTES: &str = "pdserve_kv_transfer_bytes_total";
pub const KV_TRANSFER_SECONDS: &str = "pdserve_kv_transfer_seconds";
pub const QUEUE_TIME: &str = "pdserve_request_queue_time_seconds";
pub const PREFILL_TIME: &str = "pdserve_request_prefill_time_seconds";
pub const PREFILL_FIRST_TOKEN: &str = "pdserve_request_prefill_first_token_seconds";
pub const FIRST_TOKEN: &str = "pdserve_first_token_seconds";
pub const DECODE_STEP: &str = "pdserve_decode_step_seconds";
pub const BATCH_SIZE: &str = "pdserve_decode_batch_size";
pub const DECODE_STEP_GAP: &str = "pdserve_decode_step_gap_seconds";
pub const DECODE_STEP_GAP_PART: &str = "pdserve_decode_step_gap_part_seconds";

const SECONDS_BUCKETS: [f64; 17] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0,
];
/// The gap between decode steps is tens of microseconds (the target: below 100).
const GAP_BUCKETS: [f64; 10] = [
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 1e-1,
];
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// Install the process's Prometheus recorder (once; later calls return the first one),
/// labelling every series with `model_name` and `role`. Call it before the engine thread
/// starts, so the engine's pool gauges set while loading are kept.
pub fn install(model_name: &str, role: &str) -> Result<&'static PrometheusHandle, &'static str> {
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .add_global_label("model_name", model_name)
                .add_global_label("role", role)
                .set_buckets_for_metric(Matcher::Full(DECODE_STEP_GAP.into()), &GAP_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(DECODE_STEP_GAP_PART.into()),
                        &GAP_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), &BATCH_BUCKETS)
                })
                .map_err(|e| e.to_string())?
                .install_recorder()
                .map_err(|e| {
                    format!("another metrics recorder is installed in this process: {e}")
                })?;
            register();
            pdserve_engine::kv::metrics::register();
            Ok(handle)
        })
        .as_ref()
        .map_err(String::as_str)
}

fn register() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    metrics::counter!(KV_TRANSFERS).absolute(0);
    metrics::counter!(KV_TRANSFER_BYTES).absolute(0);
    describe_gauge!(NUM_REQUESTS_RUNNING, "Requests running on the engine");
    describe_gauge!(
        NUM_REQUESTS_WAITING,
        "Requests waiting for admission or the engine"
    );
    describe_gauge!(
        KV_CACHE_USAGE,
        "Fraction of device KV pages held by requests (prefix-cache pages excluded)"
    );
    describe_gauge!(KV_PAGES_FREE, "Device KV pages free");
    describe_gauge!(
        KV_PAGES_CACHED,
        "Device KV pages held only by the prefix cache"
    );
    describe_gauge!(
        WORKER_PHASE,
        "1 for the worker's current phase, 0 for the others"
    );
    describe_counter!(
        KV_TRANSFERS,
        "KV transfers (prefill: sent, decode: received)"
    );
    describe_counter!(KV_TRANSFER_BYTES, Unit::Bytes, "Bytes of KV transfers");
    describe_histogram!(
        KV_TRANSFER_SECONDS,
        Unit::Seconds,
        "Duration of one KV transfer"
    );
    describe_histogram!(
        QUEUE_TIME,
        Unit::Seconds,
        "Arrival to admission or engine start"
    );
    describe_histogram!(PREFILL_TIME, Unit::Seconds, "Prefill compute of one prompt");
    describe_histogram!(
        PREFILL_FIRST_TOKEN,
        Unit::Seconds,
        "Prefill compute of one prompt up to its first token"
    );
    describe_histogram!(
        FIRST_TOKEN,
        Unit::Seconds,
        "A pull's start to the request's first token streamed"
    );
    describe_histogram!(DECODE_STEP, Unit::Seconds, "One batched decode step");
    describe_histogram!(BATCH_SIZE, "Requests in one decode step");
}

/// One finished KV transfer.
pub fn transfer(bytes: u64, took: Duration) {
    metrics::counter!(KV_TRANSFERS).increment(1);
    metrics::counter!(KV_TRANSFER_BYTES).increment(bytes);
    metrics::histogram!(KV_TRANSFER_SECONDS).record(took.as_secs_f64());
}

pub fn queue_time(d: Duration) {
    metrics::histogram!(QUEUE_TIME).record(d.as_secs_f64());
}

pub fn prefill_time(d: Duration) {
    metrics::histogram!(PREFILL_TIME).record(d.as_secs_f64());
}

pub fn prefill_first_token(d: Duration) {
    metrics::histogram!(PREFILL_FIRST_TOKEN).record(d.as_secs_f64());
}

/// Decode: from a pull's start to the request's first token handed to its stream.
pub fn first_token(d: Duration) {
    metrics::histogram!(FIRST_TOKEN).record(d.as_secs_f64());
}

/// One decode step of `batch` requests.
pub fn decode_step(d: Duration, batch: usize) {
    metrics::histogram!(DECODE_STEP).record(d.as_secs_f64());
    metrics::histogram!(BATCH_SIZE).record(batch as f64);
}

/// Host time between two decode steps of a busy batch, in seconds, by part.
#[derive(Debug, Clone, Copy)]
pub struct GapParts {
    pub sample: f64,
    pub admit: f64,
    pub other: f64,
}

pub fn decode_step_gap(g: &GapParts) {
    metrics::histogram!(DECODE_STEP_GAP).record(g.sample + g.admit + g.other);
    for (part, v) in [("sample", g.sample), ("admit", g.admit), ("other", g.other)] {
        metrics::histogram!(DECODE_STEP_GAP_PART, "part" => part).record(v);
    }
}

/// The recorder, once [`install`] succeeded.
pub fn handle() -> Result<&'static PrometheusHandle, &'static str> {
    HANDLE
        .get()
        .ok_or("the metrics recorder was not installed")?
        .as_ref()
        .map_err(String::as_str)
}

/// Periodic upkeep of the recorder (drains histogram buffers), until the task is dropped.
pub async fn upkeep(every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        if let Some(Ok(h)) = HANDLE.get() {
            h.run_upkeep();
        }
    }
}
