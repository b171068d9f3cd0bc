//! The `Decode` gRPC service: validate, admit (backpressure), pull the prompt's KV from
//! the prefill server the router granted, hand it to the batch loop, stream tokens back.

use crate::admission::Admission;
use crate::batch::{first_ends, first_token, Admit, Early};
use crate::events::{send_now, Event};
use crate::logits::{Processing, Spec};
use crate::DecodeSettings;
use pdserve_engine::kv::KvLayout;
use pdserve_engine::sampling::Sampler;
use pdserve_grammar::Grammar;
use pdserve_kv_transfer::{
    pull_prefill, EarlyToken, Expected, PullOptions, PullRequest, TransferError,
};
use pdserve_proto::{pb, MAX_TOP_LOGPROBS};
use pdserve_worker::WorkerStatus;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub struct DecodeService {
    pub admits: mpsc::Sender<Admit>,
    pub layout: Arc<KvLayout>,
    pub max_positions: usize,
    pub vocab_size: usize,
    pub admission: Arc<Admission>,
    pub settings: DecodeSettings,
    pub status: Arc<WorkerStatus>,
}

/// Decrements the waiting counter when dropped.
struct Waiting(Arc<WorkerStatus>);

impl Waiting {
    fn new(s: &Arc<WorkerStatus>) -> Self {
        s.load.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(s.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.load.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a request still in flight gets when the drain deadline passes.
fn shutting_down() -> Status {
    Status::unavailable("decode server shutting down")
}

/// The prefill server, not this one, could not take the request (down, loading or
/// draining, or silent past the progress deadline: stopped or hung): the router retries
/// with another prefill server.
fn prefill_unavailable(e: &TransferError) -> bool {
    match e {
        TransferError::Unreachable { .. } | TransferError::Timeout { .. } => true,
        TransferError::Peer { status, .. } => status.code() == tonic::Code::Unavailable,
        _ => false,
    }
}

impl DecodeService {
    /// The request's logits processing, validated (None: it has none). Its grammar is
    /// compiled here, once.
    fn processing(&self, r: &pb::GenerateRequest) -> Result<Option<Processing>, Status> {
        let vocab = self.vocab_size;
        if let Some((t, b)) = r
            .logit_bias
            .iter()
            .find(|(&t, b)| t as usize >= vocab || !(-100.0..=100.0).contains(*b))
        {
            return Err(Status::invalid_argument(format!(
                "logit_bias {t}: {b} needs a token id in 0..{vocab} and a bias in [-100, 100]"
            )));
        }
        let penalty = match r.repetition_penalty {
            0.0 => 1.0,
            p if p.is_finite() && p > 0.0 => p,
            p => {
                return Err(Status::invalid_argument(format!(
                    "repetition_penalty must be > 0, got {p}"
                )))
            }
        };
        if r.min_tokens > r.max_new_tokens {
            return Err(Status::invalid_argument(format!(
                "min_tokens ({}) exceeds max_new_tokens ({})",
                r.min_tokens, r.max_new_tokens
            )));
        }
        let grammar = match (r.grammar.as_str(), &self.settings.grammar) {
            ("", _) => None,
            (_, None) => {
                return Err(Status::invalid_argument(
                    "structured output needs the model's tokenizer.json, which this decode server's model folder lacks",
                ))
            }
            (g, Some(env)) => Some(
                Grammar::from_wire(g)
                    .and_then(|g| env.constraint(&g))
                    .map_err(|e| Status::invalid_argument(e.to_string()))?,
            ),
        };
        let spec = Spec {
            grammar,
            min_tokens: r.min_tokens,
            logit_bias: r.logit_bias.clone(),
            repetition_penalty: penalty,
        };
        Ok((!spec.is_empty()).then(|| Processing::new(spec, &r.prompt, &r.stop_tokens)))
    }
}

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeService {
    type GenerateStream = UnboundedReceiverStream<Result<pb::TokenEvent, Status>>;

    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let request_id = pdserve_proto::request_id(&req);
        // Before anything else: the router must have named this prefill server for this
        // request, so no caller can make this server connect to an address of its choosing.
        if let Some(t) = &self.settings.cluster_token {
            t.check_grant(&req, &req.get_ref().prefill_addr)?;
        }
        let r = req.into_inner();
        if r.prompt.is_empty() {
            return Err(Status::invalid_argument("empty prompt"));
        }
        if r.max_new_tokens == 0 {
            return Err(Status::invalid_argument(
                "max_new_tokens must be at least 1",
            ));
        }
        if r.prefill_addr.is_empty() {
            return Err(Status::invalid_argument("no prefill server given"));
        }
        if let Some(n) = r.top_logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(Status::invalid_argument(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {n}"
            )));
        }
        let processing = self.processing(&r)?;
        let params = pdserve_worker::sampling_from_pb(r.sampling);
        let sampler = Sampler::for_prompt(params, &r.prompt)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let total = r.prompt.len() + r.max_new_tokens as usize;
        if total > self.max_positions {
            return Err(Status::invalid_argument(format!(
                "prompt ({} tokens) + max_new_tokens ({}) exceeds the model's {} positions",
                r.prompt.len(),
                r.max_new_tokens,
                self.max_positions
            )));
        }
        let inflight = self
            .status
            .life
            .enter()
            .map_err(pdserve_worker::not_taking_status)?;
        let need = self.layout.pages_for(total);
        let queued = std::time::Instant::now();
        let permit = {
            let _w = Waiting::new(&self.status);
            tokio::select! {
                p = self.admission.admit(need, self.settings.admit_timeout) => p,
                _ = self.status.life.aborted() => return Err(shutting_down()),
            }
            .map_err(|e| Status::resource_exhausted(e.to_string()))?
        };
        pdserve_worker::metrics::queue_time(queued.elapsed());
        let (tx, rx) = mpsc::unbounded_channel();
        let admits = self.admits.clone();
        let layout = self.layout.clone();
        let opts = PullOptions {
            connect_timeout: self.settings.connect_timeout,
            prefill_timeout: self.settings.transfer_timeout,
            progress_timeout: self.settings.transfer_progress_timeout,
            cluster_token: self.settings.cluster_token.clone(),
            tls: self.settings.tls.clone(),
        };
        let expected = Expected {
            positions: r.prompt.len(),
            reserved_pages: need,
            vocab_size: self.vocab_size,
        };
        let prompt_tokens = r.prompt.len() as u32;
        let wire_sampling = pdserve_worker::sampling_to_pb(&params);
        let status = self.status.clone();
        let span = tracing::info_span!("decode", request_id = %request_id);
        // A plain request (no logits processing, no log-probabilities) streams the prefill
        // server's token as soon as it arrives, ahead of its KV: the token is the prefill
        // server's own sample, which the transferred logits are checked against later.
        let early = processing.is_none() && r.top_logprobs.is_none();
        tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            let (first_tx, mut first) = EarlyToken::channel(early);
            let pull = PullRequest {
                prompt: r.prompt,
                sampling: wire_sampling,
                request_id: request_id.clone(),
                first_token: first_tx,
            };
            let pull = pull_prefill(&r.prefill_addr, &layout, expected, pull, opts);
            tokio::pin!(pull);
            let mut streamed = None;
            let pulled = loop {
                tokio::select! {
                    // The token as soon as it is in, before the pull's end is looked at.
                    biased;
                    t = first.recv(), if first.pending() => {
                        // Unsent: the pull failed, which it returns.
                        let Some(t) = t else { continue };
                        pdserve_worker::metrics::first_token(t0.elapsed());
                        match first_ends(t, &r.stop_tokens, r.max_new_tokens) {
                            Early::Goes => {
                                let _ = send_now(&tx, Event::Token(t));
                                streamed = Some(t);
                            }
                            Early::Ends { emitted, reason } => {
                                // Nothing to decode: the KV is not needed (dropping the pull
                                // ends the transfer).
                                if emitted {
                                    let _ = send_now(&tx, Event::Token(t));
                                }
                                let _ = send_now(&tx, Event::Finished {
                                    reason,
                                    prompt_tokens,
                                    completion_tokens: u32::from(emitted),
                                });
                                tracing::info!(%request_id, "finished at the prefill server's token");
                                return;
                            }
                        }
                    }
                    p = &mut pull => break p,
                    _ = tx.closed() => {
                        tracing::info!(%request_id, "client went away during prefill; cancelled");
                        return;
                    }
                    _ = status.life.aborted() => {
                        let _ = tx.send(Err(shutting_down()));
                        return;
                    }
                }
            };
            let prefilled = match pulled {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(%request_id, prefill = %r.prefill_addr, error = %e, tokens_out = streamed.is_some() as u8, "KV transfer failed");
                    let mut status = e.to_status();
                    if prefill_unavailable(&e) {
                        status.metadata_mut().insert(
                            pdserve_proto::FAILED_WORKER,
                            tonic::metadata::MetadataValue::from_static("prefill"),
                        );
                    }
                    let _ = tx.send(Err(status));
                    return;
                }
            };
            status
                .load
                .add_transfer(prefilled.payload_bytes() as u64, t0.elapsed());
            tracing::info!(%request_id, prefill = %r.prefill_addr, pages = prefilled.snapshot.pages.len(), ms = t0.elapsed().as_millis() as u64, "KV received");
            let mut sampler = sampler;
            let first = match first_token(&mut sampler, processing.is_some(), &prefilled, r.top_logprobs) {
                Ok(f) => f,
                Err(f) => {
                    tracing::warn!(%request_id, error = %f.message, "request failed at admission");
                    let _ = tx.send(Err(f.to_status()));
                    return;
                }
            };
            let admit = Admit {
                request_id,
                prefilled,
                sampler,
                first,
                first_streamed: streamed.is_some(),
                pull_started: t0,
                max_new_tokens: r.max_new_tokens,
                stop_tokens: r.stop_tokens,
                prompt_tokens,
                top_logprobs: r.top_logprobs,
                processing,
                events: tx.clone(),
                permit,
                inflight,
            };
            if admits.send(admit).await.is_err() {
                let _ = tx.send(Err(Status::unavailable("decode engine stopped")));
            }
        }.instrument(span));
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}
