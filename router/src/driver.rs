//! A started generation turned into text steps: tokens are detokenized incrementally,
//! stop strings are matched across token boundaries, and the request's latency and token
//! figures are recorded. A stop-string match ends the decode stream at once (dropping it
//! cancels the request on the workers).

use crate::detok::Detok;
use crate::error::ApiError;
use crate::generation::{Next, Started};
use crate::metrics as m;
use crate::stop::StopMatcher;
use pdserve_proto::pb::ScoredToken;
use pdserve_tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::Instant;

pub struct Driver {
    started: Option<Started>,
    first: Option<Next>,
    detok: Detok,
    stop: StopMatcher,
    /// Stop strings are not looked for before this many tokens (vLLM's `min_tokens`).
    min_tokens: usize,
    t0: Instant,
    last_token: Option<Instant>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish: Option<String>,
    _running: m::Running,
}

/// What the client gets next.
pub enum Step {
    /// Text (possibly empty while held back), the token ids that produced it and their
    /// log-probabilities (when asked).
    Delta {
        text: String,
        ids: Vec<u32>,
        logprobs: Vec<ScoredToken>,
    },
    /// The end: last text, ids and log-probabilities, and `stop` or `length`.
    Done {
        text: String,
        ids: Vec<u32>,
        logprobs: Vec<ScoredToken>,
        finish: String,
    },
}

impl Driver {
    pub fn new(
        mut started: Started,
        tokenizer: Option<Arc<Tokenizer>>,
        stops: Vec<String>,
        min_tokens: usize,
        prompt_tokens: usize,
        t0: Instant,
    ) -> Self {
        let first = std::mem::replace(&mut started.first, Next::Token(0, None));
        m::prompt_tokens(prompt_tokens);
        Driver {
            started: Some(started),
            first: Some(first),
            detok: Detok::new(tokenizer),
            stop: StopMatcher::new(stops),
            min_tokens,
            t0,
            last_token: None,
            prompt_tokens,
            completion_tokens: 0,
            finish: None,
            _running: m::Running::new(),
        }
    }

    /// The next step; `Ok(None)` after `Done`.
    pub async fn next(&mut self) -> Result<Option<Step>, ApiError> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let ev = match self.first.take() {
            Some(e) => e,
            None => match self.started.as_mut() {
                Some(s) => match s.next().await? {
                    Some(e) => e,
                    None => {
                        return Err(ApiError::unavailable(
                            "decode stream ended without finishing",
                        ))
                    }
                },
                None => return Ok(None),
            },
        };
        Ok(Some(match ev {
            Next::Token(t, lp) => self.token(t, lp),
            Next::Finished(f) => {
                let tail = self.detok.finish();
                let r = self.stop.push(&tail);
                let (text, finish) = if r.stopped {
                    (r.text, "stop".to_string())
                } else {
                    (r.text + &self.stop.finish(), f.reason)
                };
                self.done(finish.clone());
                Step::Done {
                    text,
                    ids: Vec::new(),
                    logprobs: Vec::new(),
                    finish,
                }
            }
        }))
    }

    fn token(&mut self, t: u32, lp: Option<ScoredToken>) -> Step {
        let now = Instant::now();
        match self.last_token {
            None => m::time_to_first_token(now - self.t0),
            Some(prev) => m::inter_token(now - prev),
        }
        self.last_token = Some(now);
        self.completion_tokens += 1;
        let delta = self.detok.push(t);
        let r = if self.completion_tokens < self.min_tokens {
            crate::stop::Released {
                text: delta,
                stopped: false,
            }
        } else {
            self.stop.push(&delta)
        };
        if r.stopped {
            // Dropping the stream cancels the request on the workers.
            self.started = None;
            self.done("stop".to_string());
            return Step::Done {
                text: r.text,
                ids: vec![t],
                logprobs: lp.into_iter().collect(),
                finish: "stop".into(),
            };
        }
        Step::Delta {
            text: r.text,
            ids: vec![t],
            logprobs: lp.into_iter().collect(),
        }
    }

    fn done(&mut self, finish: String) {
        m::completion_tokens(self.completion_tokens);
        m::end_to_end(self.t0.elapsed());
        tracing::info!(
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.completion_tokens,
            finish = %finish,
            ms = self.t0.elapsed().as_millis() as u64,
            "completed"
        );
        self.finish = Some(finish);
    }
}
