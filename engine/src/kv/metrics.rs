//! KV metric names (fixed: dashboards and tests rely on them).

pub const PAGES_USED: &str = "pdserve_kv_pages_used";
pub const PAGES_TOTAL: &str = "pdserve_kv_pages_total";
pub const PREFIX_HIT_TOKENS: &str = "pdserve_prefix_cache_hit_tokens_total";
pub const PREFIX_MISS_TOKENS: &str = "pdserve_prefix_cache_miss_tokens_total";
pub const AUDIT_VIOLATIONS: &str = "pdserve_kv_audit_violations_total";

/// Set the used/total page gauges of `pool` ("device" or "host").
pub fn pages(pool: &'static str, used: usize, total: usize) {
    metrics::gauge!(PAGES_USED, "pool" => pool).set(used as f64);
    metrics::gauge!(PAGES_TOTAL, "pool" => pool).set(total as f64);
}

/// Prefix tokens served from `tier` ("device" or "host").
pub fn hit_tokens(tier: &'static str, n: usize) {
    if n > 0 {
        metrics::counter!(PREFIX_HIT_TOKENS, "tier" => tier).increment(n as u64);
    }
}

pub fn miss_tokens(n: usize) {
    if n > 0 {
        metrics::counter!(PREFIX_MISS_TOKENS).increment(n as u64);
    }
}

pub fn audit_violations(n: usize) {
    metrics::counter!(AUDIT_VIOLATIONS).increment(n as u64);
}
