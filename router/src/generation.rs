//! One generation through a prefill/decode pair: pick, call, wait for the first token
//! (retrying on another pair when a worker is down), then read tokens with deadlines; a
//! decode worker lost mid-stream hands the rest to another pair (see [`crate::migration`]).

use crate::error::ApiError;
use crate::migration::{prefill_failed, StreamFault};
use crate::policy::RouteRequest;
use crate::workers::{compare, InFlight, Worker};
use crate::AppState;
use pdserve_proto::pb;
use pdserve_proto::pb::token_event::Kind;
use std::sync::Arc;
use tonic::Streaming;

#[derive(Debug, Clone)]
pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: pb::SamplingParams,
    pub max_new_tokens: u32,
    pub stop_tokens: Vec<u32>,
    /// Some(n): every token with its log-probability and the n best alternatives.
    pub top_logprobs: Option<u32>,
    /// The decode server's logits processing (structured output, min_tokens,
    /// logit_bias, repetition_penalty).
    pub processing: Processing,
}

/// What the decode server does to a request's logits before its sampler sees them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Processing {
    /// An llguidance grammar in its wire form ([`pdserve_grammar::Grammar::to_wire`]).
    pub grammar: Option<String>,
    pub min_tokens: u32,
    pub logit_bias: std::collections::HashMap<u32, f32>,
    /// 1 disables.
    pub repetition_penalty: f32,
}

impl Job {
    /// The job of choice `i` of a request with `n > 1`: its own request id and seed (the
    /// prompt, and so the prefix cache entry, is shared).
    pub fn choice(&self, i: usize) -> Job {
        let mut j = self.clone();
        if i > 0 {
            j.request_id = format!("{}-{i}", self.request_id);
            j.sampling.seed = self.sampling.seed.wrapping_add(i as u64);
        }
        j
    }

    /// The job that continues this one after `generated` (its tokens so far): the prompt
    /// grows by them, the token budget shrinks by them, sampling resumes after them.
    /// None when the budget is spent (only the finish event was lost).
    pub fn resumed(&self, generated: &[u32]) -> Option<Job> {
        let k = u32::try_from(generated.len()).ok()?;
        let left = self.max_new_tokens.checked_sub(k).filter(|&l| l > 0)?;
        let mut j = self.clone();
        j.prompt.extend_from_slice(generated);
        j.max_new_tokens = left;
        j.sampling.resumed_tokens = self.sampling.resumed_tokens.saturating_add(k);
        // Tokens already out count towards min_tokens; the repetition penalty sees them in
        // the prompt, as it did in the output.
        j.processing.min_tokens = self.processing.min_tokens.saturating_sub(k);
        Some(j)
    }
}

/// What a started generation yields next.
pub enum Next {
    /// A token, with its log-probabilities when the request asked.
    Token(u32, Option<pb::ScoredToken>),
    Finished(pb::Finished),
}

pub struct Started {
    pub decode_addr: String,
    pub first: Next,
    stream: Streaming<pb::TokenEvent>,
    state: Arc<AppState>,
    decode: Arc<Worker>,
    /// The prefill worker whose KV the decode worker pulls (it may fail after the first
    /// token: see [`crate::migration::StreamFault::prefill_failed`]).
    prefill: Arc<Worker>,
    /// The decode worker counts this request in flight until the stream is dropped.
    _in_flight: InFlight,
    /// The job as the client asked it, and every token yielded for it so far (across
    /// migrations): what a migration re-issues.
    origin: Job,
    generated: Vec<u32>,
    migrations: u32,
}

fn event(e: pb::TokenEvent) -> Result<Next, tonic::Status> {
    match e.kind {
        Some(Kind::Token(t)) => Ok(Next::Token(t, None)),
        Some(Kind::Scored(s)) => Ok(Next::Token(s.token, Some(s))),
        Some(Kind::Finished(f)) => Ok(Next::Finished(f)),
        None => Err(tonic::Status::data_loss("empty token event")),
    }
}

fn candidates(ws: Vec<Arc<Worker>>, tried: &[String]) -> Vec<Arc<Worker>> {
    ws.into_iter()
        .filter(|w| w.is_healthy() && !tried.contains(&w.addr))
        .collect()
}

/// Decode candidates whose model and KV layout match prefill worker `p` (workers not yet
/// reported are kept: the transfer itself compares layouts). When none matches, the
/// mismatch naming the differing field.
fn compatible(p: &Worker, ds: Vec<Arc<Worker>>) -> Result<Vec<Arc<Worker>>, ApiError> {
    let Some(pi) = p.info() else { return Ok(ds) };
    let mut first_mismatch = None;
    let ok: Vec<_> = ds
        .into_iter()
        .filter(|d| match d.info() {
            None => true,
            Some(di) => match compare(p, &pi, d, &di) {
                None => true,
                Some(m) => {
                    first_mismatch.get_or_insert(m);
                    false
                }
            },
        })
        .collect();
    match (ok.is_empty(), first_mismatch) {
        (true, Some(m)) => Err(ApiError {
            status: axum::http::StatusCode::BAD_GATEWAY,
            kind: "worker_mismatch",
            message: format!("refusing to pair prefill and decode workers: {m}"),
            param: None,
            code: Some("worker_mismatch"),
        }),
        _ => Ok(ok),
    }
}

/// Whether a failed attempt's status says the worker itself is at fault.
fn worker_fault(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(code, Internal | DataLoss | Unknown | DeadlineExceeded)
}

/// Start `job` and wait for its first event.
pub async fn start(state: Arc<AppState>, job: &Job) -> Result<Started, ApiError> {
    let mut s = start_avoiding(state, job, Vec::new()).await?;
    if let Next::Token(t, _) = &s.first {
        s.generated.push(*t);
    }
    Ok(s)
}

/// Start `job` on a pair without the workers in `tried`.
async fn start_avoiding(
    state: Arc<AppState>,
    job: &Job,
    mut tried: Vec<String>,
) -> Result<Started, ApiError> {
    let t0 = std::time::Instant::now();
    let budget = state.settings.first_token_timeout;
    let mut last_err: Option<ApiError> = None;
    let route = RouteRequest {
        prompt: &job.prompt,
    };
    for attempt in 0..state.settings.max_attempts.max(1) {
        let p = state
            .prefill_policy
            .pick(&route, &candidates(state.workers.prefill(), &tried));
        let Some(p) = p else {
            return Err(last_err
                .unwrap_or_else(|| ApiError::unavailable("no healthy prefill worker available")));
        };
        let ds = compatible(&p, candidates(state.workers.decode(), &tried))?;
        let Some(d) = state.decode_policy.pick(&route, &ds) else {
            return Err(last_err
                .unwrap_or_else(|| ApiError::unavailable("no healthy decode worker available")));
        };
        state.prefill_policy.routed(&route, &p);
        state.decode_policy.routed(&route, &d);
        let p_flight = p.start_request();
        let d_flight = d.start_request();
        let remaining = budget.saturating_sub(t0.elapsed());
        tracing::info!(request_id = %job.request_id, attempt, prefill = %p.addr, decode = %d.addr, "routing");
        let req = pb::GenerateRequest {
            prompt: job.prompt.clone(),
            sampling: Some(job.sampling),
            max_new_tokens: job.max_new_tokens,
            stop_tokens: job.stop_tokens.clone(),
            prefill_addr: p.addr.clone(),
            top_logprobs: job.top_logprobs,
            grammar: job.processing.grammar.clone().unwrap_or_default(),
            min_tokens: job.processing.min_tokens,
            logit_bias: job.processing.logit_bias.clone(),
            repetition_penalty: job.processing.repetition_penalty,
        };
        let mut client = pb::decode_client::DecodeClient::new(d.channel.clone());
        let first = tokio::time::timeout(remaining, async {
            let mut call = pdserve_proto::with_request_id(req, &job.request_id);
            if let Some(t) = &d.token {
                t.attach(&mut call);
                t.grant_pull(&mut call, &p.addr);
            }
            let mut stream = client.generate(call).await?.into_inner();
            let first = stream.message().await?;
            Ok::<_, tonic::Status>((stream, first))
        })
        .await;
        drop(p_flight);
        let status = match first {
            Err(_) => {
                return Err(ApiError::timeout(format!(
                    "no first token within {budget:?} (decode {}, prefill {})",
                    d.addr, p.addr
                )))
            }
            Ok(Ok((stream, Some(ev)))) => {
                p.request_ok();
                d.request_ok();
                return Ok(Started {
                    decode_addr: d.addr.clone(),
                    first: event(ev).map_err(|s| ApiError::from_status(&s, &d.addr))?,
                    stream,
                    state,
                    decode: d.clone(),
                    prefill: p.clone(),
                    _in_flight: d_flight,
                    origin: job.clone(),
                    generated: Vec::new(),
                    migrations: 0,
                });
            }
            Ok(Ok((_, None))) => tonic::Status::unavailable("decode stream ended before any token"),
            Ok(Err(s)) => s,
        };
        let prefill_failed = prefill_failed(&status);
        let culprit = if prefill_failed { &p } else { &d };
        let err = ApiError::from_status(
            &status,
            &format!("{:?} worker {}", culprit.role, culprit.addr).to_lowercase(),
        );
        // A prefill server that went silent (stopped, hung) is as good as down: nothing
        // reached the client yet, so another pair may take the request.
        let retry = status.code() == tonic::Code::Unavailable
            || (prefill_failed && status.code() == tonic::Code::DeadlineExceeded);
        if !retry {
            if worker_fault(status.code()) {
                culprit.request_failed(status.message());
            }
            return Err(err);
        }
        tracing::warn!(request_id = %job.request_id, worker = %culprit.addr, error = %status.message(), "worker unavailable; trying another pair");
        culprit.fail_hard(status.message());
        crate::metrics::retry();
        tried.push(culprit.addr.clone());
        last_err = Some(err);
    }
    Err(last_err.unwrap_or_else(|| ApiError::unavailable("no worker pair answered")))
}

impl Started {
    /// The next event; `Ok(None)` after the finish event. A lost decode worker's stream
    /// continues on another pair, up to `--migration-limit` times per stream.
    pub async fn next(&mut self) -> Result<Option<Next>, ApiError> {
        let fault = match self.read().await {
            Ok(ev) => return Ok(Some(self.yielded(ev))),
            Err(f) => f,
        };
        // A structured-output stream does not migrate: its grammar state lives on the
        // lost decode worker (a new one would start the grammar over mid-output).
        let constrained = self.origin.processing.grammar.is_some();
        if !fault.migratable
            || constrained
            || self.migrations >= self.state.settings.migration_limit
        {
            return Err(fault.error);
        }
        self.migrate(fault).await.map(Some)
    }

    fn yielded(&mut self, ev: Next) -> Next {
        if let Next::Token(t, _) = &ev {
            self.generated.push(*t);
        }
        ev
    }

    /// Re-issue the prompt and the tokens so far to another pair (without the worker that
    /// failed) and adopt its stream; the first event of the new stream.
    async fn migrate(&mut self, fault: StreamFault) -> Result<Next, ApiError> {
        self.migrations += 1;
        let lost = fault.error;
        let from = match fault.prefill_failed {
            // Down as surely as one that fails before the first token (see start_avoiding).
            true => {
                self.prefill.fail_hard(&lost.message);
                tracing::warn!(request_id = %self.origin.request_id, prefill = %self.prefill.addr, tokens = self.generated.len(), error = %lost.message, "prefill worker lost during the KV transfer; migrating");
                self.prefill.addr.clone()
            }
            false => {
                self.decode.request_failed(&lost.message);
                tracing::warn!(request_id = %self.origin.request_id, decode = %self.decode_addr, tokens = self.generated.len(), error = %lost.message, "decode worker lost mid-stream; migrating");
                self.decode_addr.clone()
            }
        };
        let Some(job) = self.origin.resumed(&self.generated) else {
            // Every token arrived; only the finish event was lost.
            crate::metrics::migration("ok");
            return Ok(Next::Finished(pb::Finished {
                reason: "length".into(),
                prompt_tokens: self.origin.prompt.len() as u32,
                completion_tokens: self.generated.len() as u32,
            }));
        };
        match start_avoiding(self.state.clone(), &job, vec![from.clone()]).await {
            Ok(mut next) => {
                crate::metrics::migration("ok");
                tracing::info!(request_id = %job.request_id, from = %from, decode = %next.decode_addr, tokens = self.generated.len(), "stream migrated");
                let first = std::mem::replace(&mut next.first, Next::Token(0, None));
                self.decode_addr = next.decode_addr;
                self.stream = next.stream;
                self.decode = next.decode;
                self.prefill = next.prefill;
                self._in_flight = next._in_flight;
                Ok(self.yielded(first))
            }
            Err(e) => {
                crate::metrics::migration("failed");
                Err(ApiError {
                    message: format!(
                        "{} (after {} tokens); continuing on another worker pair failed: {}",
                        lost.message,
                        self.generated.len(),
                        e.message
                    ),
                    ..lost
                })
            }
        }
    }

    /// The current stream's next event.
    async fn read(&mut self) -> Result<Next, StreamFault> {
        let t = self.state.settings.token_timeout;
        match tokio::time::timeout(t, self.stream.message()).await {
            Err(_) => Err(StreamFault::lost(ApiError::timeout(format!(
                "decode worker {} sent no token for {t:?}",
                self.decode_addr
            )))),
            Ok(Err(s)) => Err(StreamFault::status(
                &s,
                &format!("decode worker {}", self.decode_addr),
            )),
            Ok(Ok(None)) => Err(StreamFault::lost(ApiError::unavailable(format!(
                "decode worker {} ended the stream without finishing",
                self.decode_addr
            )))),
            Ok(Ok(Some(ev))) => event(ev)
                .map_err(|s| StreamFault::fatal(ApiError::from_status(&s, &self.decode_addr))),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn job() -> Job {
        Job {
            request_id: "r".into(),
            prompt: vec![5, 6, 7],
            sampling: pb::SamplingParams {
                temperature: 0.7,
                seed: 9,
                ..Default::default()
            },
            max_new_tokens: 10,
            stop_tokens: vec![1],
            top_logprobs: Some(2),
            processing: Processing {
                min_tokens: 5,
                ..Default::default()
            },
        }
    }

    #[test]
    fn a_resumed_job_carries_the_tokens_so_far_and_the_rest_of_the_budget() {
        let j = job().resumed(&[40, 41, 42]).unwrap();
        assert_eq!(j.prompt, vec![5, 6, 7, 40, 41, 42]);
        assert_eq!(j.max_new_tokens, 7);
        assert_eq!(j.sampling.resumed_tokens, 3);
        assert_eq!((j.sampling.seed, j.sampling.temperature), (9, 0.7));
        assert_eq!((&j.stop_tokens, j.top_logprobs), (&vec![1], Some(2)));
        assert_eq!(j.processing.min_tokens, 2);
        // Resuming a resumed job adds up.
        let j2 = j.resumed(&[43]).unwrap();
        assert_eq!(j2.prompt, vec![5, 6, 7, 40, 41, 42, 43]);
        assert_eq!((j2.max_new_tokens, j2.sampling.resumed_tokens), (6, 4));
        // Every token already out: nothing to resume.
        assert!(job().resumed(&[1; 10]).is_none());
    }
}
