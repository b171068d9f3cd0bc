//! The continuous-batching loop on the engine's own thread. Every step it admits the
//! requests whose KV has arrived (each samples its first token from the transferred
//! logits), drops cancelled ones, runs ONE forward over every running request, samples
//! each and streams the tokens out; finished requests release their pages at once.
//! Plain greedy requests take the step's greedy token (computed on the device by the CUDA
//! backend) instead of a logits row.

use crate::admission::Permit;
use crate::events::{Courier, Event, Events, WireSender};
use crate::logits::Processing;
use crate::step_gaps::StepGaps;
use pdserve_engine::backend::Backend;
use pdserve_engine::config::LayerKind;
use pdserve_engine::generate::FinishReason;
use pdserve_engine::kv::audit::{Scribble, ScribbleTarget};
use pdserve_engine::kv::KvLayout;
use pdserve_engine::sampling::{Sampler, SamplingError, TokenLogprobs};
use pdserve_engine::{Engine, EngineError, ErrorClass, ForwardItem, ItemOutput, Logits, Sequence};
use pdserve_kv_transfer::Prefilled;
use pdserve_worker::{Failure, InFlight, Lifecycle, Load};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// A request whose KV has arrived, ready to join the batch.
pub struct Admit {
    pub request_id: String,
    pub prefilled: Prefilled,
    /// The request's sampler (built where the prompt is known: it may resume a migrated
    /// stream).
    pub sampler: Sampler,
    pub max_new_tokens: u32,
    pub stop_tokens: Vec<u32>,
    pub prompt_tokens: u32,
    /// Some(n): tokens go out with their log-probabilities and the n best alternatives.
    pub top_logprobs: Option<u32>,
    /// Logits processing (structured output, min_tokens, ...), None when there is none.
    pub processing: Option<Processing>,
    /// The first token, sampled from the transferred logits by [`first_token`].
    pub first: (u32, Option<TokenLogprobs>),
    /// The service already streamed `first` (the prefill server's token, sent ahead of
    /// the KV): it counts, but does not go out again.
    pub first_streamed: bool,
    /// When the request's pull started (for the first-token histogram).
    pub pull_started: std::time::Instant,
    /// The request's stream (the batch loop's [`Courier`] delivers to it).
    pub events: WireSender,
    pub permit: Permit,
    /// Counts the request for the drain until it leaves the batch.
    pub inflight: InFlight,
}

pub struct Ready {
    pub layout: KvLayout,
    pub total_pages: usize,
    pub total_states: usize,
    pub max_positions: usize,
    pub vocab_size: usize,
}

type ReadyRx = oneshot::Receiver<Result<Ready, EngineError>>;

/// Test-only: after decode step `after_step` (counted from 1), garbage lands in the KV of
/// the longest-running request, written past every writer the canary knows, as a kernel
/// writing out of bounds would. The canary must fail exactly that request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebugScribble {
    pub kind: ScribbleKind,
    pub after_step: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScribbleKind {
    /// The request's first page.
    Page,
    /// One index-K entry of the first CSA layer in its first page.
    IndexK,
    /// Its state slot.
    State,
}

pub fn spawn<B, F>(
    make_engine: F,
    load: Arc<Load>,
    life: Arc<Lifecycle>,
    scribble: Option<DebugScribble>,
) -> std::io::Result<(mpsc::Sender<Admit>, ReadyRx)>
where
    B: Backend + 'static,
    F: FnOnce() -> Result<Engine<B>, EngineError> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(1024);
    let (ready_tx, ready_rx) = oneshot::channel();
    let courier = Courier::spawn()?;
    std::thread::Builder::new()
        .name("decode-engine".into())
        .spawn(move || {
            let engine = match make_engine() {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(Ready {
                layout: engine.layout().clone(),
                total_pages: engine.allocator().total_pages(),
                total_states: engine.allocator().total_states(),
                max_positions: engine.config().max_position_embeddings,
                vocab_size: engine.config().vocab_size,
            }));
            Batch {
                engine,
                running: Vec::new(),
                load,
                life,
                steps: 0,
                scribble,
                gaps: StepGaps::default(),
                courier,
            }
            .run(rx);
        })?;
    Ok((tx, ready_rx))
}

/// What a request's logits processing failed with: the request's grammar could not go
/// on. Its own terminal error; the batch carries on.
fn grammar_failure(e: &pdserve_grammar::GrammarError) -> Failure {
    Failure::new(ErrorClass::InvalidInput, e.to_string())
}

/// The first token from the transferred logits, checked against the one the prefill
/// server sampled (done where the KV arrives, before the request reaches the batch loop:
/// an argmax over the vocabulary is no work for the loop's time between steps).
///
/// The logits were checksummed: failing to sample them, or sampling another token than
/// the prefill server did, means the KV state is not what P sent. (The prefill server
/// samples the model's logits as they are: with logits processing a copy of the sampler
/// checks that, and the batch loop samples the processed logits for the request; without,
/// `sampler` advances as the prefill server's did.)
pub fn first_token(
    sampler: &mut Sampler,
    processing: bool,
    prefilled: &Prefilled,
    top_logprobs: Option<u32>,
) -> Result<(u32, Option<TokenLogprobs>), Failure> {
    let mut check = sampler.clone();
    let checked = match processing {
        false => sample(sampler, &prefilled.last_logits, top_logprobs),
        true => sample(&mut check, &prefilled.last_logits, None),
    };
    let (t, lp) = checked.map_err(|e| Failure::new(ErrorClass::Corrupt, e.to_string()))?;
    if t != prefilled.first_token {
        return Err(Failure::new(
            ErrorClass::Corrupt,
            format!(
                "prefill server sampled token {} but the transferred logits give {t}",
                prefilled.first_token
            ),
        ));
    }
    Ok((t, lp))
}

/// What a plain request's first token does (no logits processing: what [`Running::emit`]
/// decides for any token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Early {
    /// It streams and decoding goes on.
    Goes,
    /// The request ends with it: a stop token (not streamed) or the last token allowed.
    Ends { emitted: bool, reason: FinishReason },
}

pub fn first_ends(t: u32, stop_tokens: &[u32], max_new_tokens: u32) -> Early {
    if stop_tokens.contains(&t) {
        Early::Ends {
            emitted: false,
            reason: FinishReason::Stop,
        }
    } else if max_new_tokens <= 1 {
        Early::Ends {
            emitted: true,
            reason: FinishReason::Length,
        }
    } else {
        Early::Goes
    }
}

/// A token from `logits`, with its log-probabilities when the request asked for them.
fn sample(
    sampler: &mut Sampler,
    logits: &[f32],
    top_logprobs: Option<u32>,
) -> Result<(u32, Option<TokenLogprobs>), SamplingError> {
    match top_logprobs {
        Some(n) => sampler
            .sample_scored(logits, n as usize)
            .map(|(t, lp)| (t, Some(lp))),
        None => sampler.sample(logits).map(|t| (t, None)),
    }
}

struct Running {
    request_id: String,
    seq: Sequence,
    sampler: Sampler,
    /// Last sampled token: the next forward's input.
    last: u32,
    generated: u32,
    max_new_tokens: u32,
    stop_tokens: Vec<u32>,
    prompt_tokens: u32,
    top_logprobs: Option<u32>,
    processing: Option<Processing>,
    events: Events,
    _permit: Permit,
    _inflight: InFlight,
}

impl Running {
    /// Stream `t` (with its log-probabilities when asked) out; true when the request is
    /// finished.
    fn emit(&mut self, t: u32, lp: Option<TokenLogprobs>) -> bool {
        if self.stop_tokens.contains(&t) {
            self.finished(FinishReason::Stop);
            return true;
        }
        let complete = match self.processing.as_mut().map(|p| p.commit(t)) {
            Some(Err(e)) => {
                let _ = self.events.send(Event::Failed(grammar_failure(&e)));
                return true;
            }
            Some(Ok(c)) => c,
            None => false,
        };
        self.last = t;
        self.generated += 1;
        let event = match lp {
            Some(lp) => Event::Scored(t, lp),
            None => Event::Token(t),
        };
        if self.events.send(event).is_err() {
            return true;
        }
        if complete {
            // The grammar allows nothing more: the reply is whole.
            self.finished(FinishReason::Stop);
            return true;
        }
        if self.generated >= self.max_new_tokens {
            self.finished(FinishReason::Length);
            return true;
        }
        false
    }

    /// Sample the next token from the model's `logits`, processed when the request asks.
    fn sample_next(&mut self, logits: &[f32]) -> Result<(u32, Option<TokenLogprobs>), Failure> {
        let processed;
        let l = match self.processing.as_mut() {
            Some(p) => {
                processed = p
                    .apply(logits, self.generated)
                    .map_err(|e| grammar_failure(&e))?;
                &processed[..]
            }
            None => logits,
        };
        sample(&mut self.sampler, l, self.top_logprobs)
            .map_err(|e| Failure::new(ErrorClass::Internal, format!("sampling: {e}")))
    }

    /// Whether the next token is the plain argmax of the model's logits (greedy, no
    /// penalties, logprobs or logits processing): the step then asks for the greedy
    /// token alone ([`Logits::Greedy`]; on the GPU only its id comes back).
    fn plain_greedy(&self) -> bool {
        self.processing.is_none() && self.top_logprobs.is_none() && self.sampler.is_plain_greedy()
    }

    /// The next token from a step's output: its greedy token, or sampled from its logits.
    fn next_token(&mut self, out: &ItemOutput) -> Result<(u32, Option<TokenLogprobs>), Failure> {
        let sampling =
            |e: SamplingError| Failure::new(ErrorClass::Internal, format!("sampling: {e}"));
        match out.greedy {
            Some(g) => self
                .sampler
                .accept_greedy(g.token)
                .map(|t| (t, None))
                .map_err(sampling),
            None => self.sample_next(&out.logits.data),
        }
    }

    fn finished(&self, reason: FinishReason) {
        let _ = self.events.send(Event::Finished {
            reason,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.generated,
        });
    }
}

struct Batch<B: Backend> {
    engine: Engine<B>,
    running: Vec<Running>,
    load: Arc<Load>,
    life: Arc<Lifecycle>,
    /// Decode steps run so far.
    steps: u64,
    scribble: Option<DebugScribble>,
    /// The host time between steps (see [`StepGaps`]).
    gaps: StepGaps,
    /// Delivers the requests' events, flushed once per loop turn.
    courier: Courier,
}

impl<B: Backend> Batch<B> {
    fn run(mut self, mut rx: mpsc::Receiver<Admit>) {
        loop {
            if self.running.is_empty() {
                self.gaps.idle();
                match rx.blocking_recv() {
                    Some(a) => self.admit(a),
                    None => break,
                }
            }
            while let Ok(a) = rx.try_recv() {
                let t = std::time::Instant::now();
                self.admit(a);
                self.gaps.admitted(t.elapsed());
            }
            // The admitted requests' first tokens go out now, not after the step.
            self.courier.flush();
            self.drop_cancelled();
            if self.life.is_aborted() {
                self.fail_all(Event::ShuttingDown);
            }
            if !self.running.is_empty() {
                self.step();
            }
            self.courier.flush();
            self.publish_load();
        }
        self.fail_all(Event::ShuttingDown);
        self.courier.flush();
    }

    /// End every running request with `why` (the drain's deadline passed, or the engine
    /// is stopping) and free its pages.
    fn fail_all(&mut self, why: Event) {
        if !self.running.is_empty() {
            tracing::warn!(
                requests = self.running.len(),
                "failing every running request"
            );
        }
        for r in std::mem::take(&mut self.running) {
            let _ = r.events.send(why.clone());
            self.finish(r);
        }
        self.publish_load();
    }

    fn publish_load(&self) {
        self.load
            .running
            .store(self.running.len() as u32, Ordering::Relaxed);
        self.load.free_pages.store(
            self.engine.allocator().free_page_count() as u64,
            Ordering::Relaxed,
        );
    }

    fn finish(&mut self, r: Running) {
        if let Err(e) = self.engine.release(r.seq) {
            tracing::error!(request_id = %r.request_id, error = %e, "releasing a finished request's pages");
        }
    }

    fn admit(&mut self, a: Admit) {
        let _span = tracing::info_span!("admit", request_id = %a.request_id).entered();
        let fail = |events: &Events, f: Failure| {
            tracing::warn!(error = %f.message, "request failed at admission");
            let _ = events.send(Event::Failed(f));
        };
        let events = self.courier.events(a.events);
        let (t, lp) = a.first;
        let t0 = std::time::Instant::now();
        let seq = match self.engine.import_sequence(&a.prefilled.snapshot) {
            Ok(s) => s,
            Err(e) => return fail(&events, Failure::from_engine(&e, Some("importing KV"))),
        };
        let mut r = Running {
            request_id: a.request_id,
            seq,
            sampler: a.sampler,
            last: t,
            generated: 0,
            max_new_tokens: a.max_new_tokens,
            stop_tokens: a.stop_tokens,
            prompt_tokens: a.prompt_tokens,
            top_logprobs: a.top_logprobs,
            processing: a.processing,
            events,
            _permit: a.permit,
            _inflight: a.inflight,
        };
        tracing::debug!(
            positions = r.seq.len(),
            import_ms = t0.elapsed().as_secs_f64() * 1e3,
            "joined the batch"
        );
        if a.first_streamed {
            // Streamed by the service as it arrived (a plain request, which it would have
            // ended there had the token ended it): counted, not sent again.
            r.last = t;
            r.generated = 1;
            self.running.push(r);
            return;
        }
        let (t, lp) = match r.processing.as_mut() {
            None => (t, lp),
            Some(p) => {
                // This one request's first mask, here on the engine thread: admission
                // happens once per request.
                p.prepare();
                match r.sample_next(&a.prefilled.last_logits) {
                    Ok(s) => s,
                    Err(f) => {
                        tracing::warn!(error = %f.message, "request failed at its first token");
                        let _ = r.events.send(Event::Failed(f));
                        self.finish(r);
                        return;
                    }
                }
            }
        };
        let done = r.emit(t, lp);
        pdserve_worker::metrics::first_token(a.pull_started.elapsed());
        if done {
            self.finish(r);
        } else {
            self.running.push(r);
        }
    }

    fn drop_cancelled(&mut self) {
        let (gone, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|r| r.events.is_closed());
        self.running = keep;
        for r in gone {
            tracing::info!(request_id = %r.request_id, generated = r.generated, "client went away; pages freed");
            self.finish(r);
        }
    }

    /// Fail, alone, the requests whose pages or state slot the KV canary found corrupt.
    fn fail_kv_faults(&mut self) {
        let mut keep = Vec::with_capacity(self.running.len());
        for r in std::mem::take(&mut self.running) {
            match self.engine.kv_fault(&r.seq) {
                Some(e) => self.fail_one(r, &e),
                None => keep.push(r),
            }
        }
        self.running = keep;
    }

    fn fail_one(&mut self, r: Running, e: &EngineError) {
        tracing::error!(request_id = %r.request_id, error = %e, "request failed: its KV is corrupt");
        let _ = r
            .events
            .send(Event::Failed(Failure::from_engine(e, Some("KV canary"))));
        self.finish(r);
    }

    /// Arm the test-only scribble when its step comes.
    fn plant_scribble(&mut self) {
        let Some(s) = self.scribble.filter(|s| s.after_step == self.steps + 1) else {
            return;
        };
        let Some(victim) = self.running.first() else {
            return;
        };
        let kv = victim.seq.kv();
        let csa = self
            .engine
            .layout()
            .layers
            .iter()
            .position(|l| l.kind == LayerKind::Csa);
        let target = match (s.kind, kv.pages.first(), csa) {
            (ScribbleKind::State, _, _) => ScribbleTarget::State(kv.state),
            (ScribbleKind::Page, Some(&page), _) => ScribbleTarget::Page(page),
            (ScribbleKind::IndexK, Some(&page), Some(layer)) => ScribbleTarget::IndexK {
                page,
                layer,
                entry: 0,
            },
            _ => {
                tracing::error!(kind = ?s.kind, "debug scribble: no such target in this model");
                return;
            }
        };
        tracing::warn!(request_id = %victim.request_id, ?target, "debug scribble planted");
        self.engine.debug_scribble(Scribble {
            target,
            in_step: false,
        });
    }

    fn step(&mut self) {
        self.fail_kv_faults();
        if self.running.is_empty() {
            return;
        }
        self.plant_scribble();
        self.steps += 1;
        let mut items: Vec<ForwardItem<'_>> = Vec::with_capacity(self.running.len());
        let mut grammars: Vec<&mut Processing> = Vec::new();
        for r in self.running.iter_mut() {
            let logits = match r.plain_greedy() {
                true => Logits::Greedy,
                false => Logits::Last,
            };
            items.push(ForwardItem {
                seq: &mut r.seq,
                tokens: std::slice::from_ref(&r.last),
                logits,
            });
            if let Some(p) = r.processing.as_mut().filter(|p| p.has_grammar()) {
                grammars.push(p);
            }
        }
        self.gaps.step_starts(items.len());
        let t0 = std::time::Instant::now();
        let engine = &mut self.engine;
        // The grammars' masks for this step's tokens, on their own thread while the
        // forward runs. A mask that did not come (the thread panicked) fails its request
        // alone when it samples. (The scope only hands forward_each's own result out.)
        #[allow(clippy::result_large_err)]
        let out = std::thread::scope(|s| {
            let masks = (!grammars.is_empty()).then(|| {
                s.spawn(move || {
                    for p in grammars {
                        p.prepare();
                    }
                })
            });
            let out = engine.forward_each(&mut items);
            if masks.is_some_and(|h| h.join().is_err()) {
                tracing::error!("computing the structured-output masks panicked");
            }
            out
        });
        self.gaps.forward_returned();
        drop(items);
        let outputs = match out {
            Ok(o) => o,
            Err(e) => {
                tracing::error!(error = %e, batch = self.running.len(), "decode step failed");
                let failure = Failure::from_engine(&e, Some("decode step failed"));
                for r in std::mem::take(&mut self.running) {
                    let _ = r.events.send(Event::Failed(failure.clone()));
                    self.finish(r);
                }
                return;
            }
        };
        // Requests that end this step, in ascending index order; a KV fault fails its
        // request, the others finish normally.
        let mut gone: Vec<(usize, Option<EngineError>)> = Vec::new();
        for (i, (r, o)) in self.running.iter_mut().zip(outputs).enumerate() {
            let o = match o {
                Ok(o) => o,
                Err(e) => {
                    gone.push((i, Some(e)));
                    continue;
                }
            };
            match r.next_token(&o) {
                Ok((t, lp)) => {
                    if r.emit(t, lp) {
                        gone.push((i, None));
                    }
                }
                Err(f) => {
                    let _ = r.events.send(Event::Failed(f));
                    gone.push((i, None));
                }
            }
        }
        pdserve_worker::metrics::decode_step(t0.elapsed(), self.running.len());
        for (i, e) in gone.into_iter().rev() {
            let r = self.running.swap_remove(i);
            match e {
                Some(e) => self.fail_one(r, &e),
                None => self.finish(r),
            }
        }
        self.courier.flush();
        self.gaps.step_done();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use pdserve_engine::sampling::SamplingParams;
    use pdserve_engine::SeqSnapshot;

    fn prefilled(logits: &[f32], first_token: u32) -> Prefilled {
        Prefilled {
            snapshot: SeqSnapshot {
                layout_fingerprint: String::new(),
                len: 0,
                pages: Vec::new(),
                state: Vec::new(),
            },
            last_logits: logits.to_vec(),
            first_token,
        }
    }

    #[test]
    fn the_first_token_is_checked_against_the_prefill_servers() {
        let logits = [0.1, 0.2, 3.0, -1.0];
        let mut greedy = Sampler::new(SamplingParams::default()).unwrap();
        let got = first_token(&mut greedy, false, &prefilled(&logits, 2), None).unwrap();
        assert_eq!(got, (2, None));
        let e = first_token(&mut greedy, false, &prefilled(&logits, 1), None).unwrap_err();
        assert_eq!(e.class, ErrorClass::Corrupt);
        assert!(
            e.message
                .contains("sampled token 1 but the transferred logits give 2"),
            "{}",
            e.message
        );
        let scored = first_token(&mut greedy, false, &prefilled(&logits, 2), Some(2)).unwrap();
        assert_eq!(scored.0, 2);
        assert_eq!(scored.1.unwrap().top.len(), 2);
    }

    #[test]
    fn a_first_token_ends_the_request_as_emit_would() {
        let stop = [5, 9];
        assert_eq!(
            first_ends(9, &stop, 16),
            Early::Ends {
                emitted: false,
                reason: FinishReason::Stop
            }
        );
        assert_eq!(
            first_ends(3, &stop, 1),
            Early::Ends {
                emitted: true,
                reason: FinishReason::Length
            }
        );
        // A stop token wins over the budget, as in emit.
        assert_eq!(
            first_ends(5, &stop, 1),
            Early::Ends {
                emitted: false,
                reason: FinishReason::Stop
            }
        );
        assert_eq!(first_ends(3, &stop, 2), Early::Goes);
    }

    #[test]
    fn a_seeded_sampler_advances_only_without_logits_processing() {
        // 64 equally likely tokens: each draw shows where the sampler's stream is.
        let flat = [0.0f32; 64];
        let params = SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..SamplingParams::default()
        };
        let mut reference = Sampler::new(params).unwrap();
        let first = reference.sample(&flat).unwrap();
        let draws = |s: &mut Sampler| (0..8).map(|_| s.sample(&flat).unwrap()).collect::<Vec<_>>();
        let after_first = draws(&mut reference.clone());

        let mut plain = Sampler::new(params).unwrap();
        assert_eq!(
            first_token(&mut plain, false, &prefilled(&flat, first), None)
                .unwrap()
                .0,
            first
        );
        assert_eq!(
            draws(&mut plain),
            after_first,
            "advanced as the prefill server's did"
        );

        let mut processed = Sampler::new(params).unwrap();
        first_token(&mut processed, true, &prefilled(&flat, first), None).unwrap();
        let fresh = draws(&mut Sampler::new(params).unwrap());
        assert_eq!(
            draws(&mut processed),
            fresh,
            "left for the processed logits"
        );
        assert_ne!(fresh, after_first);
    }
}
