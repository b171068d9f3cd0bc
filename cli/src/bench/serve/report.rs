//! The figures of a run: throughput, TTFT / inter-token / end-to-end latency percentiles,
//! errors by class, finish reasons, and the reference check; as Markdown tables or JSON.

use super::load::Run;
use super::reference::Check;
use crate::bench::stats::Distribution;
use crate::bench::table::{num, Table};
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Counts {
    /// Sessions x turns.
    pub planned: usize,
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    /// Not sent: an earlier turn of their session failed.
    pub skipped: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorCount {
    pub class: String,
    pub count: usize,
    /// The message of the first request that failed so.
    pub example: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The run's flags (load shape, lengths, seed, URL).
    pub config: serde_json::Value,
    pub requests: Counts,
    /// Seconds from the first request sent to the last one ended.
    pub duration_s: f64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens of completed requests per second.
    pub output_throughput: f64,
    /// Prompt tokens of completed requests per second.
    pub prompt_throughput: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub ttft_ms: Distribution,
    /// Gaps between consecutive tokens of a request, all requests pooled.
    pub itl_ms: Distribution,
    /// Per request: (end-to-end - TTFT) / (output tokens - 1), for requests of 2+ tokens.
    pub tpot_ms: Distribution,
    pub e2e_ms: Distribution,
    /// Completed requests by finish reason (`stop`, `length`).
    pub finish: BTreeMap<String, usize>,
    /// Completed requests whose token count disagrees with their finish: `length` with a
    /// count other than max_tokens, or more tokens than max_tokens (must be 0).
    pub length_miscounts: usize,
    pub errors: Vec<ErrorCount>,
    /// None with --no-reference.
    pub reference: Option<Check>,
    /// Where the mean TTFT went, from the workers' metrics (with --worker-metrics).
    pub ttft_breakdown: Option<super::breakdown::Breakdown>,
    /// Every request sent, in (session, turn) order (JSON only).
    #[serde(rename = "per_request")]
    pub each: Vec<RequestFigures>,
}

/// One request's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestFigures {
    pub session: usize,
    pub turn: usize,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// None when it failed (then `error` says how).
    pub output_tokens: Option<usize>,
    pub finish: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub error: Option<String>,
}

impl Report {
    pub fn new(config: serde_json::Value, planned: usize, run: &Run) -> Report {
        let (mut ttft, mut itl, mut tpot, mut e2e) = (vec![], vec![], vec![], vec![]);
        let (mut prompt_tokens, mut output_tokens, mut miscounts) = (0, 0, 0);
        let mut finish: BTreeMap<String, usize> = BTreeMap::new();
        let mut errors: BTreeMap<String, ErrorCount> = BTreeMap::new();
        let mut each = Vec::with_capacity(run.outcomes.len());
        for o in &run.outcomes {
            let ok = o.result.as_ref().ok();
            each.push(RequestFigures {
                session: o.session,
                turn: o.turn,
                prompt_tokens: o.prompt.len(),
                max_tokens: o.max_tokens,
                output_tokens: ok.map(|c| c.tokens.len()),
                finish: ok.map(|c| c.finish.clone()),
                ttft_ms: ok.map(|c| c.ttft_s * 1e3),
                e2e_ms: ok.map(|c| c.e2e_s * 1e3),
                error: o
                    .result
                    .as_ref()
                    .err()
                    .map(|f| format!("{}: {}", f.class, f.message)),
            });
            match &o.result {
                Ok(c) => {
                    ttft.push(c.ttft_s);
                    e2e.push(c.e2e_s);
                    itl.extend(&c.itl_s);
                    if c.tokens.len() >= 2 {
                        tpot.push((c.e2e_s - c.ttft_s) / (c.tokens.len() - 1) as f64);
                    }
                    prompt_tokens += o.prompt.len();
                    output_tokens += c.tokens.len();
                    *finish.entry(c.finish.clone()).or_default() += 1;
                    let n = c.tokens.len();
                    if n > o.max_tokens || (c.finish == "length" && n != o.max_tokens) {
                        miscounts += 1;
                    }
                }
                Err(f) => {
                    let class = f.class.to_string();
                    errors
                        .entry(class.clone())
                        .or_insert_with(|| ErrorCount {
                            class,
                            count: 0,
                            example: f.message.clone(),
                        })
                        .count += 1;
                }
            }
        }
        let completed = run.outcomes.iter().filter(|o| o.result.is_ok()).count();
        let per_s = |x: usize| x as f64 / run.duration_s.max(1e-9);
        let ms = |v: Vec<f64>| Distribution::of(v).scaled(1e3);
        Report {
            config,
            requests: Counts {
                planned,
                sent: run.outcomes.len(),
                completed,
                failed: run.outcomes.len() - completed,
                skipped: run.skipped,
            },
            duration_s: run.duration_s,
            request_throughput: per_s(completed),
            output_throughput: per_s(output_tokens),
            prompt_throughput: per_s(prompt_tokens),
            prompt_tokens,
            output_tokens,
            ttft_ms: ms(ttft),
            itl_ms: ms(itl),
            tpot_ms: ms(tpot),
            e2e_ms: ms(e2e),
            finish,
            length_miscounts: miscounts,
            errors: errors.into_values().collect(),
            reference: None,
            ttft_breakdown: None,
            each,
        }
    }

    /// Why the run counts as failed (any error, miscount or mismatch), if it does.
    pub fn failure(&self) -> Option<String> {
        let mut why = Vec::new();
        if self.requests.failed > 0 {
            why.push(format!(
                "{} of {} requests failed",
                self.requests.failed, self.requests.sent
            ));
        }
        if self.length_miscounts > 0 {
            why.push(format!(
                "{} requests returned a token count that disagrees with their finish reason",
                self.length_miscounts
            ));
        }
        if let Some(r) = self.reference.as_ref().filter(|r| r.mismatched > 0) {
            why.push(format!(
                "{} of {} outputs differ from the reference",
                r.mismatched, r.checked
            ));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }
}

fn dist_row(name: &str, d: &Distribution) -> Vec<String> {
    let mut r = vec![name.to_string(), d.count.to_string()];
    r.extend([d.mean, d.p50, d.p90, d.p99, d.max].map(num));
    r
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.requests;
        let summary = Table {
            headers: vec![
                "requests",
                "completed",
                "failed",
                "skipped",
                "duration s",
                "req/s",
                "output tok/s",
                "prompt tok/s",
            ],
            rows: vec![vec![
                c.sent.to_string(),
                c.completed.to_string(),
                c.failed.to_string(),
                c.skipped.to_string(),
                num(self.duration_s),
                num(self.request_throughput),
                num(self.output_throughput),
                num(self.prompt_throughput),
            ]],
        };
        writeln!(f, "{summary}")?;
        let latency = Table {
            headers: vec!["latency ms", "count", "mean", "p50", "p90", "p99", "max"],
            rows: vec![
                dist_row("TTFT", &self.ttft_ms),
                dist_row("ITL", &self.itl_ms),
                dist_row("TPOT", &self.tpot_ms),
                dist_row("end-to-end", &self.e2e_ms),
            ],
        };
        writeln!(f, "{latency}")?;
        let finish: Vec<String> = self
            .finish
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(
            f,
            "tokens: {} prompt, {} output; finish: {}; length miscounts: {}",
            self.prompt_tokens,
            self.output_tokens,
            if finish.is_empty() {
                "-".to_string()
            } else {
                finish.join(", ")
            },
            self.length_miscounts
        )?;
        if let Some(b) = &self.ttft_breakdown {
            writeln!(f, "\n{b}")?;
        }
        if !self.errors.is_empty() {
            let t = Table {
                headers: vec!["error", "count", "first message"],
                rows: self
                    .errors
                    .iter()
                    .map(|e| vec![e.class.clone(), e.count.to_string(), e.example.clone()])
                    .collect(),
            };
            writeln!(f, "\n{t}")?;
        }
        match &self.reference {
            None => writeln!(f, "reference check: skipped (--no-reference)")?,
            Some(r) => {
                writeln!(
                    f,
                    "reference check: {} checked, {} match, {} differ",
                    r.checked, r.matched, r.mismatched
                )?;
                if !r.mismatches.is_empty() {
                    let opt = |v: Option<f32>| v.map_or("-".to_string(), |x| num(f64::from(x)));
                    let tok = |v: Option<u32>| v.map_or("end".to_string(), |x| x.to_string());
                    let t = Table {
                        headers: vec![
                            "session",
                            "turn",
                            "prompt",
                            "position",
                            "served",
                            "reference",
                            "top-2 margin",
                            "served deficit",
                        ],
                        rows: r
                            .mismatches
                            .iter()
                            .map(|m| {
                                vec![
                                    m.session.to_string(),
                                    m.turn.to_string(),
                                    m.prompt_tokens.to_string(),
                                    m.position.to_string(),
                                    tok(m.served_token),
                                    tok(m.reference_token),
                                    opt(m.top2_margin),
                                    opt(m.served_deficit),
                                ]
                            })
                            .collect(),
                    };
                    writeln!(f, "\n{t}")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::bench::serve::client::{Completed, ErrorClass, Failure};
    use crate::bench::serve::load::Outcome;

    fn done(n: usize, finish: &str, ttft: f64, e2e: f64) -> Result<Completed, Failure> {
        Ok(Completed {
            tokens: (0..n as u32).collect(),
            finish: finish.into(),
            ttft_s: ttft,
            e2e_s: e2e,
            itl_s: vec![(e2e - ttft) / (n - 1) as f64; n - 1],
        })
    }

    fn outcome(turn: usize, max_tokens: usize, result: Result<Completed, Failure>) -> Outcome {
        Outcome {
            session: 0,
            turn,
            prompt: vec![1; 10],
            max_tokens,
            result,
        }
    }

    #[test]
    fn figures_count_completed_requests_and_classify_failures() {
        let busy = || Failure {
            class: ErrorClass::Http {
                status: 503,
                kind: "unavailable".into(),
            },
            message: "no worker".into(),
        };
        let run = Run {
            outcomes: vec![
                outcome(0, 5, done(5, "length", 0.1, 0.5)),
                outcome(1, 5, done(3, "stop", 0.2, 0.4)),
                outcome(2, 5, Err(busy())),
                outcome(3, 5, Err(busy())),
                outcome(4, 4, done(3, "length", 0.1, 0.3)),
            ],
            skipped: 1,
            duration_s: 2.0,
        };
        let r = Report::new(serde_json::json!({}), 6, &run);
        assert_eq!(
            r.requests,
            Counts {
                planned: 6,
                sent: 5,
                completed: 3,
                failed: 2,
                skipped: 1
            }
        );
        assert_eq!((r.prompt_tokens, r.output_tokens), (30, 11));
        assert_eq!(r.request_throughput, 1.5);
        assert_eq!(r.output_throughput, 5.5);
        assert_eq!(r.ttft_ms.count, 3);
        assert!((r.ttft_ms.max - 200.0).abs() < 1e-9);
        assert_eq!(r.itl_ms.count, 4 + 2 + 2);
        assert!((r.tpot_ms.p50 - 100.0).abs() < 1e-9, "{:?}", r.tpot_ms);
        assert_eq!(
            r.finish,
            BTreeMap::from([("length".into(), 2), ("stop".into(), 1)])
        );
        assert_eq!(
            r.length_miscounts, 1,
            "3 tokens with finish length of max 4"
        );
        assert_eq!(r.each.len(), 5);
        assert_eq!(
            (r.each[1].output_tokens, r.each[1].finish.as_deref()),
            (Some(3), Some("stop"))
        );
        assert_eq!(r.each[1].e2e_ms, Some(400.0));
        assert_eq!(r.each[2].output_tokens, None);
        assert_eq!(
            r.each[2].error.as_deref(),
            Some("http 503 unavailable: no worker")
        );
        assert_eq!(r.errors.len(), 1);
        assert_eq!(
            (r.errors[0].class.as_str(), r.errors[0].count),
            ("http 503 unavailable", 2)
        );
        let why = r.failure().unwrap();
        assert!(
            why.contains("2 of 5 requests failed") && why.contains("1 requests"),
            "{why}"
        );
        let text = r.to_string();
        assert!(text.contains("| TTFT |") || text.contains("TTFT"), "{text}");
        assert!(text.contains("http 503 unavailable"), "{text}");
    }
}
