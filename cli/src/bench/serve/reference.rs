//! The reference check: every completed request's exact prompt tokens generated again in
//! this process, greedily, by the same model on the same device flags (`ModelArgs`, the
//! engine's `generate`: what `pdserve generate` runs), and the served token ids compared
//! with it one by one. For a request that differs, the first differing position and the
//! reference's logits there: the margin between its two best tokens (a near-tie, ~0,
//! is numerics; a wide one is a bug) and how far below the best the served token was.

use super::client::Completed;
use super::load::Outcome;
use crate::model_args::{Loaded, ModelArgs, OnEngine};
use anyhow::Result;
use indicatif::ProgressBar;
use pdserve_engine::backend::Backend;
use pdserve_engine::generate::{generate, prefill, FinishReason, GenerateRequest};
use pdserve_engine::sampling::SamplingParams;
use pdserve_engine::{Engine, ForwardItem, Logits, Sequence};

/// One served answer that differs from the reference.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Mismatch {
    pub session: usize,
    pub turn: usize,
    pub prompt_tokens: usize,
    /// First output position where the two differ (the shorter one's length when one is
    /// a prefix of the other).
    pub position: usize,
    pub served_tokens: usize,
    pub reference_tokens: usize,
    /// The token each produced at `position` (none: it had stopped).
    pub served_token: Option<u32>,
    pub reference_token: Option<u32>,
    pub served_finish: String,
    pub reference_finish: String,
    /// The reference's best minus second-best logit at `position`.
    pub top2_margin: Option<f32>,
    /// The reference's best logit minus its logit of `served_token`.
    pub served_deficit: Option<f32>,
}

#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Check {
    pub checked: usize,
    pub matched: usize,
    pub mismatched: usize,
    pub mismatches: Vec<Mismatch>,
}

/// The first position where `a` and `b` differ, or None when they are equal.
pub fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(p) => Some(p),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// Best minus second-best value of `row`, and best minus `row[token]`.
pub fn margins(row: &[f32], token: Option<u32>) -> (Option<f32>, Option<f32>) {
    let mut top = [f32::NEG_INFINITY; 2];
    for &v in row.iter().filter(|v| !v.is_nan()) {
        if v > top[0] {
            top = [v, top[0]];
        } else if v > top[1] {
            top[1] = v;
        }
    }
    let margin = (row.len() >= 2).then(|| top[0] - top[1]);
    let deficit = token.and_then(|t| row.get(t as usize)).map(|&v| top[0] - v);
    (margin, deficit)
}

/// The reference's next-token logits after `prompt` and then `answer` (prefilled in
/// `chunk`-sized pieces, then one-token decode steps: the path `generate` took).
fn logits_after<B: Backend>(
    engine: &mut Engine<B>,
    prompt: &[u32],
    answer: &[u32],
    chunk: usize,
) -> Result<Vec<f32>> {
    let mut seq = engine.new_sequence()?;
    let row = feed(engine, &mut seq, prompt, answer, chunk);
    engine.release(seq)?;
    row
}

fn feed<B: Backend>(
    engine: &mut Engine<B>,
    seq: &mut Sequence,
    prompt: &[u32],
    answer: &[u32],
    chunk: usize,
) -> Result<Vec<f32>> {
    let mut row = prefill(engine, seq, prompt, chunk, Logits::Last)?
        .pop()
        .unwrap_or_default();
    for t in answer {
        let out = engine.forward(&mut [ForwardItem {
            seq: &mut *seq,
            tokens: std::slice::from_ref(t),
            logits: Logits::Last,
        }])?;
        row = out.into_iter().next().map(|o| o.data).unwrap_or_default();
    }
    Ok(row)
}

/// Runs the check on whichever backend the model flags select.
struct Reference<'a> {
    todo: Vec<(&'a Outcome, &'a Completed)>,
    ignore_eos: bool,
    chunk: usize,
    progress: ProgressBar,
    out: &'a mut Check,
}

impl OnEngine for Reference<'_> {
    fn run<B: Backend>(self, loaded: Loaded<B>) -> Result<()> {
        let mut engine = loaded.engine;
        let stop_tokens = if self.ignore_eos {
            Vec::new()
        } else {
            engine.config().eos_token_ids.clone()
        };
        for (o, served) in self.todo {
            let req = GenerateRequest {
                prompt: o.prompt.clone(),
                max_new_tokens: o.max_tokens,
                sampling: SamplingParams::default(),
                stop_tokens: stop_tokens.clone(),
                chunk_size: self.chunk,
            };
            let reference = generate(&mut engine, &req, |_| {})?;
            self.out.checked += 1;
            self.progress.inc(1);
            let Some(p) = first_difference(&served.tokens, &reference.tokens) else {
                self.out.matched += 1;
                continue;
            };
            let served_token = served.tokens.get(p).copied();
            let (top2_margin, served_deficit) = if p < o.max_tokens {
                let row = logits_after(&mut engine, &o.prompt, &reference.tokens[..p], self.chunk)?;
                margins(&row, served_token)
            } else {
                (None, None)
            };
            self.out.mismatched += 1;
            self.out.mismatches.push(Mismatch {
                session: o.session,
                turn: o.turn,
                prompt_tokens: o.prompt.len(),
                position: p,
                served_tokens: served.tokens.len(),
                reference_tokens: reference.tokens.len(),
                served_token,
                reference_token: reference.tokens.get(p).copied(),
                served_finish: served.finish.clone(),
                reference_finish: match reference.finish {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                }
                .to_string(),
                top2_margin,
                served_deficit,
            });
        }
        Ok(())
    }
}

/// Check every completed outcome against the reference (greedy requests only).
pub fn check(
    model: &ModelArgs,
    outcomes: &[Outcome],
    ignore_eos: bool,
    progress: ProgressBar,
) -> Result<Check> {
    let todo: Vec<_> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok().map(|c| (o, c)))
        .collect();
    let mut out = Check::default();
    model.run(Reference {
        todo,
        ignore_eos,
        chunk: model.chunked_prefill_size,
        progress,
        out: &mut out,
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_difference_is_a_differing_token_or_the_shorter_length() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_difference(&[1, 2, 3], &[1]), Some(1));
        assert_eq!(first_difference(&[], &[]), None);
    }

    #[test]
    fn margins_are_best_minus_second_and_minus_the_served_token() {
        let row = [0.5, 3.0, f32::NAN, 2.25, -1.0];
        assert_eq!(margins(&row, Some(3)), (Some(0.75), Some(0.75)));
        assert_eq!(margins(&row, Some(4)), (Some(0.75), Some(4.0)));
        assert_eq!(margins(&row, None), (Some(0.75), None));
        assert_eq!(margins(&row, Some(99)).1, None);
        // a tie at the top is a zero margin
        assert_eq!(margins(&[1.0, 1.0], Some(0)), (Some(0.0), Some(0.0)));
        assert_eq!(margins(&[1.0], None), (None, None));
    }
}
