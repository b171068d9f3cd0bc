//! Single-request drivers on top of [`Engine::forward`]: chunked prefill, decode loop,
//! per-position logits.

use crate::backend::Backend;
use crate::engine::{CutSlots, Engine, EngineError, ForwardItem, Logits, Sequence};
use crate::sampling::{Sampler, SamplingParams};

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token was produced (not included in the output).
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_tokens: Vec<u32>,
    /// Prefill chunk size in tokens (0: the whole prompt at once).
    pub chunk_size: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
}

/// Run `f` on a fresh sequence and always release it.
fn with_sequence<B: Backend, T>(
    engine: &mut Engine<B>,
    f: impl FnOnce(&mut Engine<B>, &mut Sequence) -> Result<T, EngineError>,
) -> Result<T, EngineError> {
    let mut seq = engine.new_sequence()?;
    let out = f(engine, &mut seq);
    let released = engine.release(seq);
    let v = out?;
    released?;
    Ok(v)
}

/// How a prefill splits its tokens into forwards.
#[derive(Debug, Clone, Copy)]
pub struct Chunking {
    /// Tokens per forward (0: all at once).
    pub chunk: usize,
    /// Also take the state at every multiple of this many positions (the prefix cache's
    /// cut points): inside a forward through [`Engine::forward_with_cuts`], forwards that
    /// stop before the prompt's end stopping on one.
    pub cut_every: Option<usize>,
}

/// The state slot's live bytes at one cut inside a forward
/// ([`crate::kv::KvLayout::state_ranges_live_at_cut`], one range after another).
pub struct CutState {
    pub pos: usize,
    pub state: Vec<u8>,
}

/// Read back the cuts a forward kept ([`Engine::forward_keeping_cuts`]), freeing their
/// slots: each one's position and live state.
pub fn read_cuts<B: Backend>(
    engine: &mut Engine<B>,
    cuts: CutSlots,
) -> Result<Vec<CutState>, EngineError> {
    let positions = cuts.positions();
    let states = engine.read_cut_states(cuts)?;
    Ok(positions
        .into_iter()
        .zip(states)
        .map(|(pos, state)| CutState { pos, state })
        .collect())
}

/// What a caller of [`prefill_chunks`] does around each forward.
pub trait ChunkHooks<B: Backend> {
    /// Before the forward that brings `seq` to `end` positions; `Ok(false)` stops the
    /// prefill there.
    fn before(
        &mut self,
        engine: &mut Engine<B>,
        seq: &Sequence,
        end: usize,
    ) -> Result<bool, EngineError>;
    /// After that forward (`seq.len()` is `end` now), with the cuts inside it, still to be
    /// read ([`read_cuts`]) or released ([`Engine::release_cut_slots`]): the hook takes
    /// them over, whatever it returns.
    fn after(
        &mut self,
        engine: &mut Engine<B>,
        seq: &Sequence,
        cuts: CutSlots,
    ) -> Result<(), EngineError>;
}

/// No hooks: a plain chunked prefill.
struct NoHooks;

impl<B: Backend> ChunkHooks<B> for NoHooks {
    fn before(&mut self, _: &mut Engine<B>, _: &Sequence, _: usize) -> Result<bool, EngineError> {
        Ok(true)
    }

    fn after(
        &mut self,
        engine: &mut Engine<B>,
        _: &Sequence,
        cuts: CutSlots,
    ) -> Result<(), EngineError> {
        engine.release_cut_slots(cuts)
    }
}

/// Where the forward from `from` (absolute) stops and the cuts inside it: at most `chunk`
/// tokens, up to `len`; short of `len` it stops on a cut point. A cut the rings cannot
/// reach from `from` (closer than `span`), or past the state slots free, ends the forward.
fn plan_forward(
    from: usize,
    len: usize,
    chunk: usize,
    cut: Option<usize>,
    span: usize,
    slots: usize,
) -> (usize, Vec<usize>) {
    let mut end = (from + chunk).min(len);
    let Some(p) = cut else {
        return (end, Vec::new());
    };
    if end < len && end / p * p > from {
        end = end / p * p;
    }
    let mut cuts = Vec::new();
    let mut c = (from / p + 1) * p;
    while c < end {
        if c - from < span || cuts.len() == slots {
            end = c;
            break;
        }
        cuts.push(c);
        c += p;
    }
    (end, cuts)
}

/// Feed `tokens` to `seq` in forwards of [`Chunking::chunk`], calling `hooks` around each;
/// returns the logits `want` asks for, stacked, or `None` when a hook stopped it.
pub fn prefill_chunks<B: Backend>(
    engine: &mut Engine<B>,
    seq: &mut Sequence,
    tokens: &[u32],
    chunking: Chunking,
    want: Logits,
    hooks: &mut dyn ChunkHooks<B>,
) -> Result<Option<Vec<Vec<f32>>>, EngineError> {
    let start = seq.len();
    let chunk = match chunking.chunk {
        0 => tokens.len(),
        n => n,
    };
    let mut rows = Vec::new();
    let mut fed = 0;
    while fed < tokens.len() {
        let (span, slots) = (engine.cut_span(), engine.allocator().free_state_count());
        let (to, cuts) = plan_forward(
            start + fed,
            start + tokens.len(),
            chunk,
            chunking.cut_every,
            span,
            slots,
        );
        let end = to - start;
        if !hooks.before(engine, seq, to)? {
            return Ok(None);
        }
        let logits = match want {
            Logits::All => Logits::All,
            Logits::Last if end == tokens.len() => Logits::Last,
            _ => Logits::None,
        };
        let item = ForwardItem {
            seq: &mut *seq,
            tokens: &tokens[fed..end],
            logits,
        };
        let t0 = std::time::Instant::now();
        let n_cuts = cuts.len();
        let (out, kept) = if cuts.is_empty() {
            (engine.forward(&mut [item])?, CutSlots::default())
        } else {
            let (t, kept) = engine.forward_keeping_cuts(item, &cuts)?;
            (vec![t], kept)
        };
        let forward_s = t0.elapsed().as_secs_f64();
        for t in out {
            rows.extend(t.data.chunks(t.cols.max(1)).map(<[f32]>::to_vec));
        }
        hooks.after(engine, seq, kept)?;
        tracing::debug!(
            from = start + fed,
            to,
            cuts = n_cuts,
            forward_ms = forward_s * 1e3,
            after_ms = (t0.elapsed().as_secs_f64() - forward_s) * 1e3,
            "prefill forward"
        );
        fed = end;
    }
    Ok(Some(rows))
}

/// Feed `tokens` in chunks of `chunk` (0: all at once); returns the logits `want` asks for, stacked.
pub fn prefill<B: Backend>(
    engine: &mut Engine<B>,
    seq: &mut Sequence,
    tokens: &[u32],
    chunk: usize,
    want: Logits,
) -> Result<Vec<Vec<f32>>, EngineError> {
    let chunking = Chunking {
        chunk,
        cut_every: None,
    };
    prefill_chunks(engine, seq, tokens, chunking, want, &mut NoHooks)?
        .ok_or_else(|| EngineError::Internal("prefill stopped without a stopping hook".into()))
}

/// Logits after each token of `tokens`: a prefill of the first `prefill_len` (in `chunk`-sized
/// pieces), then one-token decode steps.
pub fn logits_prefill_decode<B: Backend>(
    engine: &mut Engine<B>,
    tokens: &[u32],
    prefill_len: usize,
    chunk: usize,
) -> Result<Vec<Vec<f32>>, EngineError> {
    if prefill_len == 0 || prefill_len > tokens.len() {
        return Err(EngineError::InvalidInput(format!(
            "prefill length {prefill_len} must be in 1..={}",
            tokens.len()
        )));
    }
    with_sequence(engine, |engine, seq| {
        let mut rows = prefill(engine, seq, &tokens[..prefill_len], chunk, Logits::All)?;
        for t in &tokens[prefill_len..] {
            let out = engine.forward(&mut [ForwardItem {
                seq: &mut *seq,
                tokens: std::slice::from_ref(t),
                logits: Logits::Last,
            }])?;
            rows.extend(out.into_iter().map(|o| o.data));
        }
        Ok(rows)
    })
}

/// Generate a completion; `on_token` sees each new token as it is sampled.
pub fn generate<B: Backend>(
    engine: &mut Engine<B>,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, EngineError> {
    if req.prompt.is_empty() {
        return Err(EngineError::InvalidInput("empty prompt".into()));
    }
    let mut sampler = Sampler::for_prompt(req.sampling, &req.prompt)
        .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
    with_sequence(engine, |engine, seq| {
        let mut tokens = Vec::new();
        if req.max_new_tokens == 0 {
            return Ok(Generation {
                tokens,
                finish: FinishReason::Length,
            });
        }
        let logits = prefill(engine, seq, &req.prompt, req.chunk_size, Logits::Last)?
            .pop()
            .unwrap_or_default();
        let sampling =
            |e: crate::sampling::SamplingError| EngineError::Internal(format!("sampling: {e}"));
        let mut t = sampler.sample(&logits).map_err(sampling)?;
        // A plain greedy request takes the decode steps' greedy token (on the GPU only
        // its id comes back), any other samples each step's logits.
        let want = match sampler.is_plain_greedy() {
            true => Logits::Greedy,
            false => Logits::Last,
        };
        loop {
            if req.stop_tokens.contains(&t) {
                return Ok(Generation {
                    tokens,
                    finish: FinishReason::Stop,
                });
            }
            tokens.push(t);
            on_token(t);
            if tokens.len() >= req.max_new_tokens {
                return Ok(Generation {
                    tokens,
                    finish: FinishReason::Length,
                });
            }
            let out = engine
                .forward_each(&mut [ForwardItem {
                    seq: &mut *seq,
                    tokens: &[t],
                    logits: want,
                }])?
                .into_iter()
                .next()
                .ok_or_else(|| EngineError::Internal("a forward returned no output".into()))??;
            t = match out.greedy {
                Some(g) => sampler.accept_greedy(g.token),
                None => sampler.sample(&out.logits.data),
            }
            .map_err(sampling)?;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::plan_forward;

    #[test]
    fn a_forward_runs_its_whole_chunk_with_the_page_cuts_inside() {
        // 8K prompt, pages of 256, rings of 128, slots enough: one forward, 31 cuts.
        let (end, cuts) = plan_forward(0, 8192 + 30, 8192, Some(256), 128, 64);
        assert_eq!(end, 8192);
        assert_eq!(cuts, (1..32).map(|k| k * 256).collect::<Vec<_>>());
        // The tail after the last page: one forward, no cut.
        assert_eq!(
            plan_forward(8192, 8222, 8192, Some(256), 128, 64),
            (8222, vec![])
        );
        // No cut points asked for: the chunk alone.
        assert_eq!(plan_forward(0, 1000, 600, None, 128, 64), (600, vec![]));
    }

    #[test]
    fn a_chunk_short_of_the_prompt_ends_on_a_page() {
        // A chunk of 600 from 0 ends at 512 (cut at 256 inside); the next starts there.
        assert_eq!(
            plan_forward(0, 2000, 600, Some(256), 128, 64),
            (512, vec![256])
        );
        assert_eq!(
            plan_forward(512, 2000, 600, Some(256), 128, 64),
            (1024, vec![768])
        );
        // A chunk within one page stops mid-page.
        assert_eq!(
            plan_forward(0, 2000, 100, Some(256), 128, 64),
            (100, vec![])
        );
        assert_eq!(
            plan_forward(100, 2000, 100, Some(256), 128, 64),
            (200, vec![])
        );
    }

    #[test]
    fn a_cut_the_rings_or_slots_cannot_take_ends_the_forward() {
        // Rings longer than the rows before the first cut: the forward ends at it.
        assert_eq!(
            plan_forward(200, 2000, 2000, Some(256), 128, 64),
            (256, vec![])
        );
        assert_eq!(plan_forward(0, 2000, 2000, Some(16), 32, 64), (16, vec![]));
        // Two free slots: two cuts, the forward ends at the third.
        assert_eq!(
            plan_forward(0, 2000, 2000, Some(256), 128, 2),
            (768, vec![256, 512])
        );
        assert_eq!(
            plan_forward(0, 2000, 2000, Some(256), 128, 0),
            (256, vec![])
        );
    }
}
