//! Decode-graph counters in the process's `metrics` recorder (the workers' `/metrics`).

/// Graphs captured (a new batch signature, or one evicted and seen again).
pub const CAPTURES_TOTAL: &str = "pdserve_cuda_graph_captures_total";
/// Decode steps replayed from a captured graph.
pub const REPLAYS_TOTAL: &str = "pdserve_cuda_graph_replays_total";
/// Graphed steps whose eager replay differed (`--verify-graphs`).
pub const VERIFY_MISMATCHES_TOTAL: &str = "pdserve_graph_verify_mismatches_total";

/// Make the three series exist at zero, so a decode server exports them before its first
/// step (and on the CPU, where no graph is ever captured).
pub fn register() {
    metrics::counter!(CAPTURES_TOTAL).absolute(0);
    metrics::counter!(REPLAYS_TOTAL).absolute(0);
    metrics::counter!(VERIFY_MISMATCHES_TOTAL).absolute(0);
    metrics::describe_counter!(CAPTURES_TOTAL, "Decode-step CUDA graphs captured");
    metrics::describe_counter!(
        REPLAYS_TOTAL,
        "Decode steps replayed from a captured CUDA graph"
    );
}

pub(crate) fn captured() {
    metrics::counter!(CAPTURES_TOTAL).increment(1);
}

pub(crate) fn replayed() {
    metrics::counter!(REPLAYS_TOTAL).increment(1);
}

pub(crate) fn verify_mismatched() {
    metrics::counter!(VERIFY_MISMATCHES_TOTAL).increment(1);
}
