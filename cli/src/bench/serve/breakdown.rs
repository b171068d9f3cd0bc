//! Where time to first token goes (`bench serve --worker-metrics URL,...`): each worker's
//! own histograms, scraped from its side port (`--metrics-listen`) before and after the
//! run; the differences' means, per role, against the client's mean TTFT. The first
//! token's path, which adds up to the TTFT:
//!
//! - decode admission: the decode server's wait for KV pages (`queue_time`, decode);
//! - prefill queue (`queue_time`, prefill) and the prefill's compute up to the token
//!   sampled (`prefill_first_token`, prefill);
//! - first token to the decode server: the decode server's pull start to the token handed
//!   to the request's stream (`first_token`, decode) less those two (plain requests get
//!   the token ahead of the KV; the others when they join the batch, the KV imported);
//! - first token out: the client's TTFT less admission and that (router, HTTP, streaming
//!   the token back).
//!
//! Beside it: the whole prefill compute (`prefill_time`, the pages' export included: the
//! ratio's denominator), the KV transfer (the pull, `kv_transfer_seconds`, less the
//! prefill's queue and whole compute) and how long after the first token the KV was in.
//!
//! The means pool every request the workers served in the interval, so run it on a
//! cluster carrying only the bench's load.

use super::client::Client;
use anyhow::{bail, Result};
use serde::Serialize;
use std::collections::BTreeMap;

const QUEUE: &str = "pdserve_request_queue_time_seconds";
const PREFILL: &str = "pdserve_request_prefill_time_seconds";
const TRANSFER: &str = "pdserve_kv_transfer_seconds";
const PREFILL_FIRST: &str = "pdserve_request_prefill_first_token_seconds";
const FIRST: &str = "pdserve_first_token_seconds";
const HISTOGRAMS: [&str; 5] = [QUEUE, PREFILL, TRANSFER, PREFILL_FIRST, FIRST];

/// (sum of seconds, count) per (role, histogram).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape(BTreeMap<(String, &'static str), (f64, f64)>);

impl Scrape {
    /// The breakdown's histograms' `_sum` and `_count` from a Prometheus text exposition,
    /// summed per `role` label (several workers of a role add up).
    pub fn parse(text: &str) -> Scrape {
        let mut out = Scrape::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let role = labels
                .split(',')
                .find_map(|l| l.trim().strip_prefix("role=\""))
                .and_then(|r| r.split('"').next())
                .unwrap_or("")
                .to_string();
            for h in HISTOGRAMS {
                let slot = out.0.entry((role.clone(), h));
                if name == format!("{h}_sum") {
                    slot.or_default().0 += value;
                } else if name == format!("{h}_count") {
                    slot.or_default().1 += value;
                }
            }
        }
        out.0.retain(|_, v| v.1 > 0.0 || v.0 > 0.0);
        out
    }

    fn merge(&mut self, other: Scrape) {
        for (k, (s, c)) in other.0 {
            let e = self.0.entry(k).or_default();
            e.0 += s;
            e.1 += c;
        }
    }

    /// Mean milliseconds of `hist` on `role` between `before` and `self`, with the count.
    fn mean_ms(&self, before: &Scrape, role: &str, hist: &'static str) -> Option<(f64, f64)> {
        let key = (role.to_string(), hist);
        let (s1, c1) = self.0.get(&key).copied().unwrap_or_default();
        let (s0, c0) = before.0.get(&key).copied().unwrap_or_default();
        let n = c1 - c0;
        (n > 0.0).then(|| ((s1 - s0) / n * 1e3, n))
    }
}

/// Every worker's series, pooled.
pub async fn scrape_all(client: &Client, urls: &[String]) -> Result<Scrape> {
    let mut all = Scrape::default();
    for u in urls {
        all.merge(Scrape::parse(&client.get_text(u).await?));
    }
    Ok(all)
}

/// The breakdown of the run's mean TTFT, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Breakdown {
    pub ttft_mean_ms: f64,
    pub decode_admission_ms: f64,
    pub prefill_queue_ms: f64,
    /// The prefill's compute up to its first token sampled.
    pub prefill_to_first_token_ms: f64,
    /// From the token sampled to the decode server handing it to the request's stream.
    pub first_token_to_decode_ms: f64,
    /// Router, HTTP and streaming: the TTFT less admission and the decode's first token.
    pub first_token_out_ms: f64,
    /// The whole prefill compute, the pages' export included.
    pub prefill_compute_ms: f64,
    /// The pull less the prefill's queue and whole compute.
    pub kv_transfer_ms: f64,
    /// The pull's end after the first token was streamed (0 when it came with the KV).
    pub kv_after_first_token_ms: f64,
    /// Mean TTFT over mean prefill compute (the target: at most 1.05).
    pub ttft_over_prefill: f64,
    /// Prefills and pulls the means are over.
    pub prefills: f64,
    pub pulls: f64,
}

impl Breakdown {
    pub fn new(ttft_mean_ms: f64, before: &Scrape, after: &Scrape) -> Result<Breakdown> {
        let need = |role: &str, h: &'static str| {
            after.mean_ms(before, role, h).ok_or_else(|| {
                anyhow::anyhow!(
                    "--worker-metrics: no {h} recorded by a {role} worker during the run (is \
                     a {role} server's --metrics-listen address among the URLs?)"
                )
            })
        };
        let (prefill_queue_ms, prefills) = need("prefill", QUEUE)?;
        let (prefill_compute_ms, _) = need("prefill", PREFILL)?;
        let (to_token_ms, _) = need("prefill", PREFILL_FIRST)?;
        let (pull_ms, pulls) = need("decode", TRANSFER)?;
        let (decode_admission_ms, _) = need("decode", QUEUE)?;
        let (decode_token_ms, _) = need("decode", FIRST)?;
        if prefill_compute_ms <= 0.0 {
            bail!("--worker-metrics: the prefills took no time");
        }
        Ok(Breakdown {
            ttft_mean_ms,
            decode_admission_ms,
            prefill_queue_ms,
            prefill_to_first_token_ms: to_token_ms,
            first_token_to_decode_ms: decode_token_ms - prefill_queue_ms - to_token_ms,
            first_token_out_ms: ttft_mean_ms - decode_admission_ms - decode_token_ms,
            prefill_compute_ms,
            kv_transfer_ms: pull_ms - prefill_queue_ms - prefill_compute_ms,
            kv_after_first_token_ms: (pull_ms - decode_token_ms).max(0.0),
            ttft_over_prefill: ttft_mean_ms / prefill_compute_ms,
            prefills,
            pulls,
        })
    }
}

impl std::fmt::Display for Breakdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let share = |ms: f64| format!("{:.1}%", ms / self.ttft_mean_ms.max(1e-9) * 100.0);
        let mut t = crate::bench::table::Table {
            headers: vec!["part of the mean TTFT", "ms", "share"],
            rows: Vec::new(),
        };
        for (name, ms) in [
            ("decode admission (KV pages)", self.decode_admission_ms),
            ("prefill queue", self.prefill_queue_ms),
            (
                "prefill compute to the first token",
                self.prefill_to_first_token_ms,
            ),
            (
                "first token to the decode server",
                self.first_token_to_decode_ms,
            ),
            (
                "first token out (router, HTTP, stream)",
                self.first_token_out_ms,
            ),
            ("TTFT (client)", self.ttft_mean_ms),
        ] {
            t.rows
                .push(vec![name.to_string(), format!("{ms:.2}"), share(ms)]);
        }
        let mut beside = crate::bench::table::Table {
            headers: vec!["beside the first token's path", "ms"],
            rows: Vec::new(),
        };
        for (name, ms) in [
            (
                "prefill compute (pages' export included)",
                self.prefill_compute_ms,
            ),
            (
                "KV transfer (pull less prefill queue and compute)",
                self.kv_transfer_ms,
            ),
            (
                "KV in after the first token streamed",
                self.kv_after_first_token_ms,
            ),
        ] {
            beside.rows.push(vec![name.to_string(), format!("{ms:.2}")]);
        }
        write!(
            f,
            "{t}{beside}TTFT / prefill compute: {:.3} (over {} prefills, {} pulls)",
            self.ttft_over_prefill, self.prefills, self.pulls
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// (queue sum, count, compute sum, compute-to-token sum) of the prefill role; (queue
    /// sum, count, pull sum, first-token sum) of the decode role.
    fn exposition(prefill: (f64, f64, f64, f64), decode: (f64, f64, f64, f64)) -> String {
        let (pq, pn, pc, pf) = prefill;
        let (dq, dn, dt, df) = decode;
        format!(
            "# HELP x y\n\
             {QUEUE}_sum{{model_name=\"m\",role=\"prefill\"}} {pq}\n\
             {QUEUE}_count{{model_name=\"m\",role=\"prefill\"}} {pn}\n\
             {PREFILL}_sum{{model_name=\"m\",role=\"prefill\"}} {pc}\n\
             {PREFILL}_count{{model_name=\"m\",role=\"prefill\"}} {pn}\n\
             {PREFILL}_bucket{{model_name=\"m\",role=\"prefill\",le=\"0.5\"}} {pn}\n\
             {PREFILL_FIRST}_sum{{model_name=\"m\",role=\"prefill\"}} {pf}\n\
             {PREFILL_FIRST}_count{{model_name=\"m\",role=\"prefill\"}} {pn}\n\
             {FIRST}_sum{{model_name=\"m\",role=\"decode\"}} {df}\n\
             {FIRST}_count{{model_name=\"m\",role=\"decode\"}} {dn}\n\
             {QUEUE}_sum{{model_name=\"m\",role=\"decode\"}} {dq}\n\
             {QUEUE}_count{{model_name=\"m\",role=\"decode\"}} {dn}\n\
             {TRANSFER}_sum{{model_name=\"m\",role=\"decode\"}} {dt}\n\
             {TRANSFER}_count{{model_name=\"m\",role=\"decode\"}} {dn}\n"
        )
    }

    #[test]
    fn the_parts_are_the_run_s_differences_of_the_workers_means() {
        let before = Scrape::parse(&exposition((0.1, 1.0, 0.5, 0.4), (0.0, 1.0, 0.6, 0.5)));
        // Four more requests: prefill queue 10 ms, compute 500 ms of which 490 to the
        // first token; decode admission 2 ms, the token 503 ms and the pull 530 ms after
        // the pull's start.
        let after = Scrape::parse(&exposition(
            (0.14, 5.0, 2.5, 2.36),
            (0.008, 5.0, 2.72, 2.512),
        ));
        let b = Breakdown::new(510.0, &before, &after).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(b.prefill_queue_ms, 10.0));
        assert!(close(b.prefill_to_first_token_ms, 490.0));
        assert!(close(b.first_token_to_decode_ms, 3.0));
        assert!(close(b.decode_admission_ms, 2.0));
        assert!(close(b.first_token_out_ms, 5.0));
        assert!(close(b.prefill_compute_ms, 500.0));
        assert!(close(b.kv_transfer_ms, 20.0));
        assert!(close(b.kv_after_first_token_ms, 27.0));
        assert!(close(b.ttft_over_prefill, 1.02));
        assert_eq!((b.prefills, b.pulls), (4.0, 4.0));
        let text = b.to_string();
        assert!(text.contains("TTFT / prefill compute: 1.020"), "{text}");
    }

    #[test]
    fn workers_of_a_role_add_up_and_a_missing_role_is_named() {
        let one = exposition((0.0, 1.0, 1.0, 0.0), (0.0, 0.0, 0.0, 0.0));
        let mut s = Scrape::parse(&one);
        s.merge(Scrape::parse(&one));
        assert_eq!(s.0.get(&("prefill".into(), PREFILL)), Some(&(2.0, 2.0)));
        let err = Breakdown::new(10.0, &Scrape::default(), &s)
            .unwrap_err()
            .to_string();
        assert!(err.contains("decode"), "{err}");
    }
}
