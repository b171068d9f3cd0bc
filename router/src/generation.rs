//! One generation through a prefill/decode pair: pick, call, wait for the first token
//! (retrying on another pair when a worker is down), then read tokens with deadlines.

use crate::error::ApiError;
use crate::workers::{Role, Worker};
use crate::AppState;
use pdserve_proto::pb;
use pdserve_proto::pb::token_event::Kind;
use std::sync::Arc;
use tonic::Streaming;

use pdserve_proto::FAILED_WORKER;

#[derive(Debug)]
pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: pb::SamplingParams,
    pub max_new_tokens: u32,
    pub stop_tokens: Vec<u32>,
}

/// What a started generation yields next.
pub enum Next {
    Token(u32),
    Finished(pb::Finished),
}

pub struct Started {
    pub decode_addr: String,
    pub first: Next,
    stream: Streaming<pb::TokenEvent>,
    state: Arc<AppState>,
}

fn event(e: pb::TokenEvent) -> Result<Next, tonic::Status> {
    match e.kind {
        Some(Kind::Token(t)) => Ok(Next::Token(t)),
        Some(Kind::Finished(f)) => Ok(Next::Finished(f)),
        None => Err(tonic::Status::data_loss("empty token event")),
    }
}

fn candidates(ws: &[Arc<Worker>], tried: &[String]) -> Vec<Arc<Worker>> {
    ws.iter()
        .filter(|w| w.is_healthy() && !tried.contains(&w.addr))
        .cloned()
        .collect()
}

/// Start `job` and wait for its first event.
pub async fn start(state: Arc<AppState>, job: &Job) -> Result<Started, ApiError> {
    let t0 = std::time::Instant::now();
    let budget = state.settings.first_token_timeout;
    let mut tried: Vec<String> = Vec::new();
    let mut last_err: Option<ApiError> = None;
    for attempt in 0..state.settings.max_attempts.max(1) {
        let p = state
            .policy
            .pick(Role::Prefill, &candidates(&state.workers.prefill, &tried));
        let d = state
            .policy
            .pick(Role::Decode, &candidates(&state.workers.decode, &tried));
        let (p, d) = match (p, d) {
            (Some(p), Some(d)) => (p, d),
            (p, _) => {
                let role = if p.is_none() { "prefill" } else { "decode" };
                return Err(last_err.unwrap_or_else(|| {
                    ApiError::unavailable(format!("no healthy {role} worker available"))
                }));
            }
        };
        let remaining = budget.saturating_sub(t0.elapsed());
        tracing::info!(request_id = %job.request_id, attempt, prefill = %p.addr, decode = %d.addr, "routing");
        let req = pb::GenerateRequest {
            prompt: job.prompt.clone(),
            sampling: Some(job.sampling),
            max_new_tokens: job.max_new_tokens,
            stop_tokens: job.stop_tokens.clone(),
            prefill_addr: p.addr.clone(),
        };
        let mut client = pb::decode_client::DecodeClient::new(d.channel.clone());
        let first = tokio::time::timeout(remaining, async {
            let mut stream = client
                .generate(pdserve_proto::with_request_id(req, &job.request_id))
                .await?
                .into_inner();
            let first = stream.message().await?;
            Ok::<_, tonic::Status>((stream, first))
        })
        .await;
        let status = match first {
            Err(_) => {
                return Err(ApiError::timeout(format!(
                    "no first token within {budget:?} (decode {}, prefill {})",
                    d.addr, p.addr
                )))
            }
            Ok(Ok((stream, Some(ev)))) => {
                return Ok(Started {
                    decode_addr: d.addr.clone(),
                    first: event(ev).map_err(|s| ApiError::from_status(&s, &d.addr))?,
                    stream,
                    state,
                })
            }
            Ok(Ok((_, None))) => tonic::Status::unavailable("decode stream ended before any token"),
            Ok(Err(s)) => s,
        };
        let prefill_failed = status
            .metadata()
            .get(FAILED_WORKER)
            .is_some_and(|v| v.as_bytes() == b"prefill");
        let culprit = if prefill_failed { &p } else { &d };
        let err = ApiError::from_status(
            &status,
            &format!("{:?} worker {}", culprit.role, culprit.addr).to_lowercase(),
        );
        if status.code() != tonic::Code::Unavailable {
            return Err(err);
        }
        tracing::warn!(request_id = %job.request_id, worker = %culprit.addr, error = %status.message(), "worker unavailable; trying another pair");
        culprit.set_healthy(false, status.message());
        crate::metrics::retry();
        tried.push(culprit.addr.clone());
        last_err = Some(err);
    }
    Err(last_err.unwrap_or_else(|| ApiError::unavailable("no worker pair answered")))
}

impl Started {
    /// The next event; `Ok(None)` after the finish event.
    pub async fn next(&mut self) -> Result<Option<Next>, ApiError> {
        let t = self.state.settings.token_timeout;
        match tokio::time::timeout(t, self.stream.message()).await {
            Err(_) => Err(ApiError::timeout(format!(
                "decode worker {} sent no token for {t:?}",
                self.decode_addr
            ))),
            Ok(Err(s)) => Err(ApiError::from_status(
                &s,
                &format!("decode worker {}", self.decode_addr),
            )),
            Ok(Ok(None)) => Err(ApiError::unavailable(format!(
                "decode worker {} ended the stream without finishing",
                self.decode_addr
            ))),
            Ok(Ok(Some(ev))) => event(ev)
                .map(Some)
                .map_err(|s| ApiError::from_status(&s, &self.decode_addr)),
        }
    }
}
