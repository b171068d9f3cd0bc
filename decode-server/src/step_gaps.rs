//! The decode loop's host time between steps, and where it goes.
//!
//! From the end of one decode step's forward (its logits back, so its kernels done) to the
//! start of the next one's while the batch stays busy, the GPU idles. The gap has three
//! parts: `sample` (sampling, streaming and finishing the step's requests), `admit`
//! (joining new requests: checking their transferred logits and importing their KV into
//! the pool) and `other` (cancellations, the KV canary's faults, building the next step).
//! Recorded as `pdserve_decode_step_gap_seconds` and, per part,
//! `pdserve_decode_step_gap_part_seconds{part}`; logged every [`StepGaps::REPORT_EVERY`]
//! gaps as quantiles, those with an admission apart.

use std::time::{Duration, Instant};

/// One gap, split.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Gap {
    pub sample: Duration,
    pub admit: Duration,
    pub other: Duration,
}

impl Gap {
    pub fn total(&self) -> Duration {
        self.sample + self.admit + self.other
    }
}

#[derive(Default)]
pub struct StepGaps {
    /// When the last step's forward returned; `None` after the batch went idle.
    forward_end: Option<Instant>,
    /// When that step's sampling and streaming were done.
    sampled: Option<Duration>,
    /// Admission time since the forward returned.
    admit: Duration,
    /// Gaps since the last report.
    recent: Vec<Gap>,
}

impl StepGaps {
    pub const REPORT_EVERY: usize = 1000;

    /// A step's forward returned now.
    pub fn forward_returned(&mut self) {
        self.forward_end = Some(Instant::now());
        self.sampled = None;
        self.admit = Duration::ZERO;
    }

    /// The step's tokens are sampled and streamed.
    pub fn step_done(&mut self) {
        self.sampled = self.forward_end.map(|t| t.elapsed());
    }

    /// The batch went idle: the next step's start is no gap.
    pub fn idle(&mut self) {
        self.forward_end = None;
    }

    /// An admission took `took`: part of the gap if it fell in one.
    pub fn admitted(&mut self, took: Duration) {
        if self.forward_end.is_some() {
            self.admit += took;
        }
    }

    /// A step starts now: the gap since the last forward, if the batch stayed busy.
    pub fn step_starts(&mut self, batch: usize) -> Option<Gap> {
        let total = self.forward_end.take()?.elapsed();
        let sample = self.sampled.unwrap_or(Duration::ZERO).min(total);
        let admit = self.admit.min(total - sample);
        let gap = Gap {
            sample,
            admit,
            other: total - sample - admit,
        };
        pdserve_worker::metrics::decode_step_gap(&gap.parts());
        self.recent.push(gap);
        if self.recent.len() >= Self::REPORT_EVERY {
            report(&mut self.recent, batch);
            self.recent.clear();
        }
        Some(gap)
    }
}

impl Gap {
    fn parts(&self) -> pdserve_worker::metrics::GapParts {
        pdserve_worker::metrics::GapParts {
            sample: self.sample.as_secs_f64(),
            admit: self.admit.as_secs_f64(),
            other: self.other.as_secs_f64(),
        }
    }
}

/// Quantiles in microseconds of `gaps` (sorted here).
fn quantiles(gaps: &mut [f64]) -> Option<[f64; 3]> {
    if gaps.is_empty() {
        return None;
    }
    gaps.sort_by(f64::total_cmp);
    let at = |q: f64| gaps[((gaps.len() - 1) as f64 * q) as usize] * 1e6;
    Some([at(0.5), at(0.99), at(1.0)])
}

fn report(gaps: &mut [Gap], batch: usize) {
    let n = gaps.len() as f64;
    let mean_us = |part: fn(&Gap) -> Duration| {
        format!(
            "{:.1}",
            gaps.iter().map(|g| part(g).as_secs_f64()).sum::<f64>() / n * 1e6
        )
    };
    let (sample_us, admit_us, other_us) = (
        mean_us(|g| g.sample),
        mean_us(|g| g.admit),
        mean_us(|g| g.other),
    );
    let (mut plain, mut admitted): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    for g in gaps.iter() {
        match g.admit.is_zero() {
            true => plain.push(g.total().as_secs_f64()),
            false => admitted.push(g.total().as_secs_f64()),
        }
    }
    let fmt = |q: Option<[f64; 3]>| match q {
        Some([p50, p99, max]) => format!("p50 {p50:.1} p99 {p99:.1} max {max:.1}"),
        None => "none".to_string(),
    };
    tracing::info!(
        steps = gaps.len(),
        batch,
        without_admission_us = fmt(quantiles(&mut plain)),
        with_admission = admitted.len(),
        with_admission_us = fmt(quantiles(&mut admitted)),
        mean_sample_us = sample_us,
        mean_admit_us = admit_us,
        mean_other_us = other_us,
        "decode loop: host time between steps"
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn spin(d: Duration) {
        let t = Instant::now();
        while t.elapsed() < d {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn a_gap_is_split_into_its_parts() {
        let mut g = StepGaps::default();
        assert_eq!(g.step_starts(1), None, "the first step follows no gap");
        g.forward_returned();
        spin(Duration::from_millis(3));
        g.step_done();
        let t = Instant::now();
        spin(Duration::from_millis(5));
        g.admitted(t.elapsed());
        spin(Duration::from_millis(1));
        let gap = g.step_starts(1).unwrap();
        assert!(gap.sample >= Duration::from_millis(3), "{gap:?}");
        assert!(gap.admit >= Duration::from_millis(5), "{gap:?}");
        assert_eq!(gap.total(), gap.sample + gap.admit + gap.other);
        assert!(gap.other >= Duration::from_millis(1), "{gap:?}");
        // An admission while idle is no part of any gap, and an idle batch starts none.
        g.idle();
        g.admitted(Duration::from_millis(2));
        assert_eq!(g.step_starts(1), None);
        g.forward_returned();
        g.step_done();
        let gap = g.step_starts(1).unwrap();
        assert_eq!(
            gap.admit,
            Duration::ZERO,
            "the earlier admissions were not carried over"
        );
    }
}
