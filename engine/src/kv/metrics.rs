//! KV metric names (fixed: dashboards and tests rely on them) and their recording through
//! the `metrics` facade (a worker's recorder serves them at its `/metrics`).

pub const PAGES_USED: &str = "pdserve_kv_pages_used";
/// Pages a pool holds in all (a gauge: no `_total` suffix, which Prometheus keeps for
/// counters).
pub const PAGES_CAPACITY: &str = "pdserve_kv_pages_capacity";
pub const PREFIX_HIT_TOKENS: &str = "pdserve_prefix_cache_hit_tokens_total";
pub const PREFIX_MISS_TOKENS: &str = "pdserve_prefix_cache_miss_tokens_total";
/// vLLM's pair (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`, in tokens): the
/// hit rate is `rate(hits) / rate(queries)`, whatever the tier.
pub const PREFIX_QUERIES: &str = "pdserve_prefix_cache_queries_total";
pub const PREFIX_HITS: &str = "pdserve_prefix_cache_hits_total";
pub const AUDIT_VIOLATIONS: &str = "pdserve_kv_audit_violations_total";

/// Make every counter series exist at zero and describe them all, so a fresh worker
/// exports the full set before its first request.
pub fn register() {
    use metrics::{describe_counter, describe_gauge};
    for tier in ["device", "host"] {
        metrics::counter!(PREFIX_HIT_TOKENS, "tier" => tier).absolute(0);
    }
    for name in [
        PREFIX_MISS_TOKENS,
        PREFIX_QUERIES,
        PREFIX_HITS,
        AUDIT_VIOLATIONS,
    ] {
        metrics::counter!(name).absolute(0);
    }
    describe_gauge!(PAGES_USED, "KV pages in use, by pool (device or host)");
    describe_gauge!(
        PAGES_CAPACITY,
        "KV pages in the pool, by pool (device or host)"
    );
    describe_counter!(
        PREFIX_HIT_TOKENS,
        "Prompt tokens served from the prefix cache, by tier"
    );
    describe_counter!(
        PREFIX_MISS_TOKENS,
        "Prompt tokens computed (not in the prefix cache)"
    );
    describe_counter!(
        PREFIX_QUERIES,
        "Prompt tokens looked up in the prefix cache"
    );
    describe_counter!(
        PREFIX_HITS,
        "Prompt tokens found in the prefix cache (any tier)"
    );
    describe_counter!(
        AUDIT_VIOLATIONS,
        "KV pages or states written outside their owner (--kv-audit)"
    );
}

/// Set the used/capacity page gauges of `pool` ("device" or "host").
pub fn pages(pool: &'static str, used: usize, total: usize) {
    metrics::gauge!(PAGES_USED, "pool" => pool).set(used as f64);
    metrics::gauge!(PAGES_CAPACITY, "pool" => pool).set(total as f64);
}

/// One prefix-cache lookup: prompt tokens found on the device, on the host, and computed.
pub fn lookup(device_hit: usize, host_hit: usize, miss: usize) {
    for (tier, n) in [("device", device_hit), ("host", host_hit)] {
        if n > 0 {
            metrics::counter!(PREFIX_HIT_TOKENS, "tier" => tier).increment(n as u64);
        }
    }
    if miss > 0 {
        metrics::counter!(PREFIX_MISS_TOKENS).increment(miss as u64);
    }
    metrics::counter!(PREFIX_HITS).increment((device_hit + host_hit) as u64);
    metrics::counter!(PREFIX_QUERIES).increment((device_hit + host_hit + miss) as u64);
}

pub fn audit_violations(n: usize) {
    metrics::counter!(AUDIT_VIOLATIONS).increment(n as u64);
}
