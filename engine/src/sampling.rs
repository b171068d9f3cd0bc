//! Token sampling: greedy, temperature, top-k, top-p; seeded and reproducible.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("no logits to sample from")]
    Empty,
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        Ok(())
    }
}

/// Highest logit; ties go to the lowest id. NaNs never win.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// Log-probabilities of a sampled token and of the most likely alternatives, from the
/// distribution the sampler drew from: `log_softmax(logits / temperature)` over the whole
/// vocabulary, before top-k / top-p cut it (greedy requests use temperature 1).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The `top_n` most likely ids with their log-probabilities, best first (ties: the
    /// lower id first).
    pub top: Vec<(u32, f32)>,
}

pub fn logprobs(logits: &[f32], temperature: f32, token: u32, top_n: usize) -> TokenLogprobs {
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let scaled = |v: f32| f64::from(v / t);
    let max = logits
        .iter()
        .filter(|v| !v.is_nan())
        .fold(f64::NEG_INFINITY, |m, &v| m.max(scaled(v)));
    let lse = max
        + logits
            .iter()
            .filter(|v| !v.is_nan())
            .map(|&v| (scaled(v) - max).exp())
            .sum::<f64>()
            .ln();
    let lp = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else {
            (scaled(v) - lse) as f32
        }
    };
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    if top_n > 0 {
        order.sort_by(|&a, &b| {
            lp(logits[b as usize])
                .total_cmp(&lp(logits[a as usize]))
                .then(a.cmp(&b))
        });
    }
    TokenLogprobs {
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&v| lp(v)),
        top: order
            .into_iter()
            .take(top_n)
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    }
}

/// A per-request sampler; its random stream depends only on the seed.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        Ok(Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        })
    }

    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        if self.params.temperature == 0.0 {
            return argmax(logits).ok_or(SamplingError::Empty);
        }
        let t = self.params.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v / t))
            .collect();
        if cand.is_empty() {
            return Err(SamplingError::Empty);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            cand.truncate(self.params.top_k);
        }
        let m = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, v)| (v - m).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.top_p < 1.0 {
            let mut acc = 0f32;
            let keep = probs
                .iter()
                .position(|p| {
                    acc += p;
                    acc >= self.params.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            cand.truncate(keep);
        }
        let mass: f32 = probs.iter().sum();
        let mut u = self.rng.random::<f32>() * mass;
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return Ok(cand[i].0);
            }
            u -= p;
        }
        Ok(cand[cand.len() - 1].0)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_after_temperature() {
        let logits = [1.0f32, 3.0, 2.0, f32::NAN];
        let lp = logprobs(&logits, 2.0, 2, 2);
        let z: f64 = [0.5f64, 1.5, 1.0].iter().map(|v| v.exp()).sum();
        assert!((f64::from(lp.logprob) - (1.0 - z.ln())).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((f64::from(lp.top[0].1) - (1.5 - z.ln())).abs() < 1e-6);
        // Greedy: temperature 1; the probabilities sum to 1.
        let g = logprobs(&logits, 0.0, 1, 3);
        let total: f32 = g.top.iter().map(|t| t.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn greedy_picks_max_lowest_on_tie() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).unwrap(), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 3,
            seed: 7,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p).unwrap();
            (0..100).map(|_| s.sample(&logits).unwrap()).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p).unwrap();
            (0..100).map(|_| s.sample(&logits).unwrap()).collect()
        };
        assert_eq!(a, b);
        let mut top: Vec<u32> = (0..50).collect();
        top.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
        assert!(a.iter().all(|t| top[..3].contains(t)));
        assert!(top[..3].iter().filter(|t| a.contains(t)).count() >= 2);
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = [0.0f32, 5.0, 1.0, 4.9];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            top_k: 0,
            seed: 1,
        })
        .unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&logits).unwrap(), 1);
        }
    }

    #[test]
    fn bad_params_rejected() {
        assert!(Sampler::new(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        })
        .is_err());
    }
}
