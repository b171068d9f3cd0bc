//! Where time to first token goes (`bench serve --worker-metrics URL,...`): each worker's
//! own histograms, scraped from its side port (`--metrics-listen`) before and after the
//! run; the differences' means, per role, against the client's mean TTFT:
//!
//! - decode admission: the decode server's wait for KV pages (`queue_time`, decode);
//! - prefill queue and prefill compute (`queue_time` and `prefill_time`, prefill);
//! - KV transfer: the decode server's whole pull (`kv_transfer_seconds`, decode, which
//!   includes the prefill's queue and compute) less those two;
//! - first token out: the client's TTFT less admission and pull (router, HTTP, joining
//!   the decode batch, the first step and streaming the token back).
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

/// (sum of seconds, count) per (role, histogram).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape(BTreeMap<(String, &'static str), (f64, f64)>);

impl Scrape {
    /// The three histograms' `_sum` and `_count` from a Prometheus text exposition,
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
            for h in [QUEUE, PREFILL, TRANSFER] {
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
    pub prefill_compute_ms: f64,
    pub kv_transfer_ms: f64,
    pub first_token_out_ms: f64,
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
        let (pull_ms, pulls) = need("decode", TRANSFER)?;
        let (decode_admission_ms, _) = need("decode", QUEUE)?;
        if prefill_compute_ms <= 0.0 {
            bail!("--worker-metrics: the prefills took no time");
        }
        Ok(Breakdown {
            ttft_mean_ms,
            decode_admission_ms,
            prefill_queue_ms,
            prefill_compute_ms,
            kv_transfer_ms: pull_ms - prefill_queue_ms - prefill_compute_ms,
            first_token_out_ms: ttft_mean_ms - decode_admission_ms - pull_ms,
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
            ("prefill compute", self.prefill_compute_ms),
            ("KV transfer (pull less prefill queue and compute)", self.kv_transfer_ms),
            ("first token out (router, batch join, first step, stream)", self.first_token_out_ms),
            ("TTFT (client)", self.ttft_mean_ms),
        ] {
            t.rows.push(vec![name.to_string(), format!("{ms:.2}"), share(ms)]);
        }
        write!(
            f,
            "{t}TTFT / prefill compute: {:.3} (over {} prefills, {} pulls)",
            self.ttft_over_prefill, self.prefills, self.pulls
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn exposition(prefill: (f64, f64, f64, f64), decode: (f64, f64, f64, f64)) -> String {
        let (pq, pn, pc, _) = prefill;
        let (dq, dn, dt, _) = decode;
        format!(
            "# HELP x y\n\
             {QUEUE}_sum{{model_name=\"m\",role=\"prefill\"}} {pq}\n\
             {QUEUE}_count{{model_name=\"m\",role=\"prefill\"}} {pn}\n\
             {PREFILL}_sum{{model_name=\"m\",role=\"prefill\"}} {pc}\n\
             {PREFILL}_count{{model_name=\"m\",role=\"prefill\"}} {pn}\n\
             {PREFILL}_bucket{{model_name=\"m\",role=\"prefill\",le=\"0.5\"}} {pn}\n\
             {QUEUE}_sum{{model_name=\"m\",role=\"decode\"}} {dq}\n\
             {QUEUE}_count{{model_name=\"m\",role=\"decode\"}} {dn}\n\
             {TRANSFER}_sum{{model_name=\"m\",role=\"decode\"}} {dt}\n\
             {TRANSFER}_count{{model_name=\"m\",role=\"decode\"}} {dn}\n"
        )
    }

    #[test]
    fn the_parts_are_the_run_s_differences_of_the_workers_means() {
        let before = Scrape::parse(&exposition((0.1, 1.0, 0.5, 0.0), (0.0, 1.0, 0.6, 0.0)));
        // Four more requests: prefill queue 10 ms, compute 500 ms; decode admission 2 ms,
        // pull 530 ms each.
        let after = Scrape::parse(&exposition((0.14, 5.0, 2.5, 0.0), (0.008, 5.0, 2.72, 0.0)));
        let b = Breakdown::new(540.0, &before, &after).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(b.prefill_queue_ms, 10.0));
        assert!(close(b.prefill_compute_ms, 500.0));
        assert!(close(b.decode_admission_ms, 2.0));
        assert!(close(b.kv_transfer_ms, 20.0));
        assert!(close(b.first_token_out_ms, 8.0));
        assert!(close(b.ttft_over_prefill, 1.08));
        assert_eq!((b.prefills, b.pulls), (4.0, 4.0));
        let text = b.to_string();
        assert!(text.contains("TTFT / prefill compute: 1.080"), "{text}");
    }

    #[test]
    fn workers_of_a_role_add_up_and_a_missing_role_is_named() {
        let one = exposition((0.0, 1.0, 1.0, 0.0), (0.0, 0.0, 0.0, 0.0));
        let mut s = Scrape::parse(&one);
        s.merge(Scrape::parse(&one));
        assert_eq!(s.0.get(&("prefill".into(), PREFILL)), Some(&(2.0, 2.0)));
        let err = Breakdown::new(10.0, &Scrape::default(), &s).unwrap_err().to_string();
        assert!(err.contains("decode"), "{err}");
    }
}
