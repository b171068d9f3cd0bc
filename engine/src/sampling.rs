//! Token sampling: presence/frequency penalties, greedy, temperature, top-k, top-p,
//! min-p; seeded and reproducible.
//!
//! The random draw of a request's output token `i` is keyed by `(seed, i)` alone (word
//! `i` of the ChaCha8 stream of `seed`), never by what else the process sampled before:
//! a stream the router migrates to another worker pair after `k` tokens
//! ([`SamplingParams::resumed_tokens`]) draws token `k` exactly as the first worker would
//! have.

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
    /// Keep tokens at least this fraction as likely as the most likely one; 0 disables.
    pub min_p: f32,
    /// Subtracted once from the logit of every token already generated, in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted from a token's logit per time it was generated, in [-2, 2].
    pub frequency_penalty: f32,
    /// The prompt's last `resumed_tokens` tokens are this request's own earlier output (a
    /// stream migrated after a worker died): sampling continues at output token
    /// `resumed_tokens` and the penalties count those tokens as generated.
    #[serde(default)]
    pub resumed_tokens: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            resumed_tokens: 0,
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
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("{0} must be in [-2, 2], got {1}")]
    Penalty(&'static str, f32),
    #[error("resumed_tokens {resumed} exceeds the prompt's {prompt} tokens")]
    Resumed { resumed: u32, prompt: usize },
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(SamplingError::Penalty(name, v));
            }
        }
        Ok(())
    }
}

/// A logit that can be sampled: not NaN, and not -inf (a token masked out by logits
/// processing, e.g. a grammar).
fn samplable(v: f32) -> bool {
    !v.is_nan() && v != f32::NEG_INFINITY
}

/// Highest logit; ties go to the lowest id. NaNs and -inf (masked tokens) never win.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if !samplable(v) {
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

/// A per-request sampler; the draw of output token `i` depends only on `(seed, i)`, its
/// penalties on the tokens generated so far (the prefill and decode servers' samplers of
/// one request agree: the decode server re-samples the prefill's first token).
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Index of the next output token: its draw is word `next` of the seed's stream.
    next: u64,
    /// How often each token was sampled (for the penalties).
    counts: std::collections::HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler for a fresh request (`resumed_tokens` is ignored: see [`Sampler::for_prompt`]).
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        Self::continuing(params, &[])
    }

    /// The sampler of a request whose prompt is `prompt`: its last
    /// `params.resumed_tokens` tokens count as already generated.
    pub fn for_prompt(params: SamplingParams, prompt: &[u32]) -> Result<Self, SamplingError> {
        let resumed = params.resumed_tokens as usize;
        let Some(start) = prompt.len().checked_sub(resumed) else {
            return Err(SamplingError::Resumed {
                resumed: params.resumed_tokens,
                prompt: prompt.len(),
            });
        };
        Self::continuing(params, &prompt[start..])
    }

    /// A sampler that continues after `earlier`, the tokens this request generated
    /// before: the next draw is output token `earlier.len()`'s.
    fn continuing(params: SamplingParams, earlier: &[u32]) -> Result<Self, SamplingError> {
        params.validate()?;
        let mut counts = std::collections::HashMap::new();
        for &t in earlier {
            *counts.entry(t).or_insert(0) += 1;
        }
        Ok(Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            next: earlier.len() as u64,
            counts,
        })
    }

    /// The logits after the penalties: what the rest of sampling (and logprobs) sees.
    fn penalized<'a>(&self, logits: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        let (pp, fp) = (self.params.presence_penalty, self.params.frequency_penalty);
        if (pp == 0.0 && fp == 0.0) || self.counts.is_empty() {
            return std::borrow::Cow::Borrowed(logits);
        }
        let mut l = logits.to_vec();
        for (&t, &n) in &self.counts {
            if let Some(v) = l.get_mut(t as usize) {
                *v -= pp + fp * n as f32;
            }
        }
        std::borrow::Cow::Owned(l)
    }

    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        let l = self.penalized(logits);
        let t = self.draw(&l)?;
        self.sampled(t);
        Ok(t)
    }

    /// Sample, and the log-probabilities of the distribution drawn from (penalties and
    /// temperature applied, before top-k / top-p / min-p) with `top_n` alternatives.
    pub fn sample_scored(
        &mut self,
        logits: &[f32],
        top_n: usize,
    ) -> Result<(u32, TokenLogprobs), SamplingError> {
        let l = self.penalized(logits).into_owned();
        let t = self.draw(&l)?;
        self.sampled(t);
        Ok((t, logprobs(&l, self.params.temperature, t, top_n)))
    }

    /// Whether this request's token is the plain argmax of the model's logits (greedy,
    /// no penalties): then a backend's [`crate::backend::RowArgmax`] of those logits is
    /// the token [`Sampler::sample`] would draw, and the logits need not come back.
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature == 0.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0
    }

    /// Take `t`, the greedy token computed where the logits are (see
    /// [`Sampler::is_plain_greedy`]), as the next output token, exactly as
    /// [`Sampler::sample`] would have recorded it; `None` (no samplable logit) is
    /// [`SamplingError::Empty`], as `sample` fails on such logits.
    pub fn accept_greedy(&mut self, t: Option<u32>) -> Result<u32, SamplingError> {
        let t = t.ok_or(SamplingError::Empty)?;
        self.sampled(t);
        Ok(t)
    }

    fn sampled(&mut self, t: u32) {
        *self.counts.entry(t).or_insert(0) += 1;
        self.next += 1;
    }

    /// The uniform in [0, 1) of the next output token: word `next` of the seed's stream.
    fn uniform(&mut self) -> f32 {
        self.rng.set_word_pos(u128::from(self.next));
        self.rng.random::<f32>()
    }

    fn draw(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        if self.params.temperature == 0.0 {
            return argmax(logits).ok_or(SamplingError::Empty);
        }
        let t = self.params.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| samplable(**v))
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
        if self.params.min_p > 0.0 {
            // probs[0] is the most likely token's probability (cand is sorted).
            let floor = self.params.min_p * probs[0];
            let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
            probs.truncate(keep);
            cand.truncate(keep);
        }
        let mass: f32 = probs.iter().sum();
        let mut u = self.uniform() * mass;
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
    fn penalties_lower_repeated_tokens_and_min_p_cuts_the_tail() {
        // Greedy with a frequency penalty: token 1 wins until its logit has been lowered
        // below token 0's, then 0, then 1 again.
        let p = SamplingParams {
            frequency_penalty: 0.6,
            presence_penalty: 0.3,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(p).unwrap();
        let logits = [2.0f32, 3.0, -5.0];
        let picks: Vec<u32> = (0..3).map(|_| s.sample(&logits).unwrap()).collect();
        // after one 1: 3 - 0.9 = 2.1 > 2 -> 1; after two: 3 - 1.5 = 1.5 < 2 -> 0;
        // then 0 is 2 - 0.9 = 1.1 < 1.5 -> 1.
        assert_eq!(picks, vec![1, 1, 0]);
        let (t, lp) = s.sample_scored(&logits, 1).unwrap();
        assert_eq!(t, 1);
        // The logprobs are of the penalized logits [1.1, 1.5, -5].
        let z: f64 = [1.1f64, 1.5, -5.0].iter().map(|v| v.exp()).sum();
        assert!(
            (f64::from(lp.logprob) - (1.5 - z.ln())).abs() < 1e-5,
            "{lp:?}"
        );
        // min_p = 0.5 keeps only tokens at least half as likely as the best: with logits
        // [0, 0, -1] at temperature 1 (token 2: e^-1 < 0.5) token 2 never comes out.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: 3,
            ..SamplingParams::default()
        })
        .unwrap();
        let drawn: Vec<u32> = (0..200)
            .map(|_| s.sample(&[0.0, 0.0, -1.0]).unwrap())
            .collect();
        assert!(drawn.iter().all(|&t| t < 2) && drawn.contains(&0) && drawn.contains(&1));
        assert_eq!(
            SamplingParams {
                min_p: 1.5,
                ..SamplingParams::default()
            }
            .validate(),
            Err(SamplingError::MinP(1.5))
        );
    }

    #[test]
    fn masked_tokens_are_never_sampled() {
        let mut logits = vec![f32::NEG_INFINITY; 64];
        logits[7] = -50.0;
        logits[9] = -50.5;
        let mut s = Sampler::new(SamplingParams {
            temperature: 2.0,
            seed: 11,
            ..SamplingParams::default()
        })
        .unwrap();
        for _ in 0..500 {
            assert!([7, 9].contains(&s.sample(&logits).unwrap()));
        }
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), None);
    }

    #[test]
    fn an_accepted_greedy_token_continues_the_stream_as_a_sampled_one() {
        let logits = [0.5, 3.0, 3.0, -1.0];
        let greedy = SamplingParams::default();
        let mut host = Sampler::new(greedy).unwrap();
        let mut device = Sampler::new(greedy).unwrap();
        assert!(device.is_plain_greedy());
        assert_eq!(host.sample(&logits).unwrap(), 1);
        assert_eq!(device.accept_greedy(argmax(&logits)).unwrap(), 1);
        assert_eq!((host.next, &host.counts), (device.next, &device.counts));
        assert_eq!(device.accept_greedy(None), Err(SamplingError::Empty));
        for p in [
            SamplingParams {
                temperature: 0.7,
                ..greedy
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..greedy
            },
            SamplingParams {
                frequency_penalty: -0.5,
                ..greedy
            },
        ] {
            assert!(!Sampler::new(p).unwrap().is_plain_greedy(), "{p:?}");
        }
        // top-k / top-p / min-p do not change a greedy draw.
        let cut = SamplingParams {
            top_k: 1,
            top_p: 0.5,
            min_p: 0.2,
            ..greedy
        };
        assert!(Sampler::new(cut).unwrap().is_plain_greedy());
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
            ..SamplingParams::default()
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
    fn a_resumed_sampler_continues_the_unbroken_stream_exactly() {
        // Seeded with penalties: the draws after a prompt whose last k tokens are the
        // first k outputs equal outputs k.. of the unbroken run.
        let logits: Vec<f32> = (0..40).map(|i| (i as f32 * 0.61).cos()).collect();
        let p = SamplingParams {
            temperature: 0.9,
            top_k: 8,
            seed: 11,
            frequency_penalty: 0.4,
            presence_penalty: 0.2,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(p).unwrap();
        let unbroken: Vec<u32> = (0..30).map(|_| s.sample(&logits).unwrap()).collect();
        for k in [1usize, 7, 29] {
            let mut prompt = vec![1u32, 2, 3];
            prompt.extend(&unbroken[..k]);
            let q = SamplingParams {
                resumed_tokens: k as u32,
                ..p
            };
            let mut r = Sampler::for_prompt(q, &prompt).unwrap();
            let rest: Vec<u32> = (k..30).map(|_| r.sample(&logits).unwrap()).collect();
            assert_eq!(rest, unbroken[k..], "resumed after {k}");
        }
        // The draw of token i does not depend on how many samplers ran before.
        let mut again = Sampler::new(p).unwrap();
        assert_eq!(again.sample(&logits).unwrap(), unbroken[0]);
        assert_eq!(
            Sampler::for_prompt(
                SamplingParams {
                    resumed_tokens: 4,
                    ..p
                },
                &[1, 2, 3]
            )
            .unwrap_err(),
            SamplingError::Resumed {
                resumed: 4,
                prompt: 3
            }
        );
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = [0.0f32, 5.0, 1.0, 4.9];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            top_k: 0,
            seed: 1,
            ..SamplingParams::default()
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
