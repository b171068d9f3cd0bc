//! Summaries of repeated measurements.

/// The middle of `v` (the upper one of an even count); NaN when empty. Every timed row
/// and measured ceiling reports this.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Mean, percentiles and maximum of a latency sample (NaN throughout when it is empty).
/// Percentiles interpolate linearly between the two nearest ranks, as numpy's default
/// does (what vLLM's and SGLang's serving benchmarks report), so figures compare.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Distribution {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Distribution {
    pub fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        let mean = if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        };
        Distribution {
            count: v.len(),
            mean,
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }

    /// Every figure times `k` (seconds to milliseconds).
    pub fn scaled(self, k: f64) -> Self {
        Distribution {
            count: self.count,
            mean: self.mean * k,
            p50: self.p50 * k,
            p90: self.p90 * k,
            p99: self.p99 * k,
            max: self.max * k,
        }
    }
}

/// The `q`-th percentile (0..=100) of ascending `sorted`: rank `q/100 * (n-1)`,
/// interpolated between its neighbours; NaN when empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let Some(last) = sorted.len().checked_sub(1) else {
        return f64::NAN;
    };
    let rank = (q / 100.0).clamp(0.0, 1.0) * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        // numpy.percentile(range(1, 11), [0, 50, 90, 99, 100]) = 1, 5.5, 9.1, 9.91, 10
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert!((percentile(&v, 50.0) - 5.5).abs() < 1e-12);
        assert!((percentile(&v, 90.0) - 9.1).abs() < 1e-12);
        assert!((percentile(&v, 99.0) - 9.91).abs() < 1e-12);
        assert_eq!(percentile(&v, 100.0), 10.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn distribution_sorts_and_summarises() {
        let d = Distribution::of(vec![4.0, 1.0, 3.0, 2.0]);
        assert_eq!(d.count, 4);
        assert_eq!(d.mean, 2.5);
        assert_eq!(d.p50, 2.5);
        assert!((d.p90 - 3.7).abs() < 1e-12);
        assert_eq!(d.max, 4.0);
        let ms = d.scaled(1000.0);
        assert_eq!((ms.mean, ms.max, ms.count), (2500.0, 4000.0, 4));
        let empty = Distribution::of(Vec::new());
        assert_eq!(empty.count, 0);
        assert!(empty.mean.is_nan() && empty.p99.is_nan() && empty.max.is_nan());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
