//! What happens to a request's logits before its sampler sees them, in vLLM's order: the
//! structured-output mask (llguidance), `logit_bias`, `min_tokens` (the stop tokens
//! masked until that many tokens came out), then `repetition_penalty` over the prompt's
//! and the generated tokens. Requests without any of these skip this module entirely.
//!
//! The grammar's mask for a request's next token depends only on the tokens it already
//! has, so the batch loop computes it ([`Processing::prepare`]) on another thread while
//! the forward runs: a request with a grammar costs the others nothing.

use pdserve_grammar::{Constraint, GrammarError, Mask};
use std::collections::{HashMap, HashSet};

/// A request's logits processing.
pub struct Processing {
    grammar: Option<Constraint>,
    /// The mask for the next token, from [`Processing::prepare`].
    mask: Option<Result<Mask, GrammarError>>,
    min_tokens: u32,
    /// Masked while fewer than `min_tokens` were generated.
    stop_tokens: Vec<u32>,
    bias: Vec<(u32, f32)>,
    /// 1 disables.
    repetition_penalty: f32,
    /// Every token of the prompt and the reply so far (for the repetition penalty).
    seen: HashSet<u32>,
}

/// What a request asked for (validated by the service).
pub struct Spec {
    pub grammar: Option<Constraint>,
    pub min_tokens: u32,
    pub logit_bias: HashMap<u32, f32>,
    pub repetition_penalty: f32,
}

impl Spec {
    /// Nothing to do: the request samples from the model's logits as they are.
    pub fn is_empty(&self) -> bool {
        self.grammar.is_none()
            && self.min_tokens == 0
            && self.logit_bias.is_empty()
            && self.repetition_penalty == 1.0
    }
}

impl Processing {
    pub fn new(spec: Spec, prompt: &[u32], stop_tokens: &[u32]) -> Self {
        let mut bias: Vec<(u32, f32)> = spec.logit_bias.into_iter().collect();
        bias.sort_by_key(|b| b.0);
        Processing {
            grammar: spec.grammar,
            mask: None,
            min_tokens: spec.min_tokens,
            stop_tokens: stop_tokens.to_vec(),
            bias,
            repetition_penalty: spec.repetition_penalty,
            seen: if spec.repetition_penalty == 1.0 {
                HashSet::new()
            } else {
                prompt.iter().copied().collect()
            },
        }
    }

    pub fn has_grammar(&self) -> bool {
        self.grammar.is_some()
    }

    /// Compute the grammar's mask for the next token (any thread; a no-op without one).
    pub fn prepare(&mut self) {
        if let Some(g) = self.grammar.as_mut() {
            self.mask = Some(g.mask());
        }
    }

    /// The logits the sampler sees for the next token after `generated` tokens.
    pub fn apply(&mut self, logits: &[f32], generated: u32) -> Result<Vec<f32>, GrammarError> {
        let mut l = logits.to_vec();
        if self.grammar.is_some() {
            match self.mask.take() {
                Some(Ok(m)) => m.apply(&mut l),
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(GrammarError::Failed(
                        "no token mask was computed for this step".into(),
                    ))
                }
            }
        }
        for &(t, b) in &self.bias {
            if let Some(v) = l.get_mut(t as usize) {
                *v += b;
            }
        }
        if generated < self.min_tokens {
            for &t in &self.stop_tokens {
                if let Some(v) = l.get_mut(t as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        if self.repetition_penalty != 1.0 {
            let p = self.repetition_penalty;
            for &t in &self.seen {
                if let Some(v) = l.get_mut(t as usize) {
                    *v = if *v > 0.0 { *v / p } else { *v * p };
                }
            }
        }
        Ok(l)
    }

    /// Take a sampled (not stopping) token. `Ok(true)`: the grammar is complete, the
    /// reply ends here.
    pub fn commit(&mut self, t: u32) -> Result<bool, GrammarError> {
        if self.repetition_penalty != 1.0 {
            self.seen.insert(t);
        }
        match self.grammar.as_mut() {
            Some(g) => {
                g.commit(t)?;
                Ok(g.is_finished())
            }
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn spec() -> Spec {
        Spec {
            grammar: None,
            min_tokens: 0,
            logit_bias: HashMap::new(),
            repetition_penalty: 1.0,
        }
    }

    #[test]
    fn bias_min_tokens_and_repetition_penalty_change_the_logits_as_vllm_does() {
        let logits = [2.0f32, -1.0, 0.5, 3.0];
        let mut p = Processing::new(
            Spec {
                logit_bias: HashMap::from([(2, 5.0), (0, -100.0)]),
                min_tokens: 2,
                repetition_penalty: 2.0,
                ..spec()
            },
            &[1],
            &[3],
        );
        // Token 1 is in the prompt: -1 * 2. Token 3 (the stop token) masked before 2
        // tokens came out. Token 2: 0.5 + 5, not seen.
        assert_eq!(
            p.apply(&logits, 0).unwrap(),
            vec![-98.0, -2.0, 5.5, f32::NEG_INFINITY]
        );
        assert!(!p.commit(2).unwrap());
        // Token 2 now seen: (0.5 + 5) / 2; at 2 generated tokens the stop token is back.
        assert_eq!(p.apply(&logits, 2).unwrap(), vec![-98.0, -2.0, 2.75, 3.0]);
        assert!(spec().is_empty());
    }
}
