//! The `Prefill` gRPC service.

use crate::engine_thread::Job;
use crate::PrefillSettings;
use pdserve_engine::kv::KvLayout;
use pdserve_kv_transfer::{
    check_peer, first_token_message, prefill_messages, progress_message, EarlyToken, HEARTBEAT,
};
use pdserve_proto::pb;
use pdserve_worker::WorkerStatus;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub struct PrefillService {
    pub jobs: mpsc::Sender<Job>,
    pub layout: Arc<KvLayout>,
    pub settings: PrefillSettings,
    pub status: Arc<WorkerStatus>,
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    type PrefillStream = ReceiverStream<Result<pb::PrefillMessage, Status>>;

    async fn prefill(
        &self,
        req: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let called = std::time::Instant::now();
        let request_id = pdserve_proto::request_id(&req);
        let r = req.into_inner();
        let theirs = r.receiver_layout.ok_or_else(|| {
            Status::failed_precondition("prefill request without the receiver's KV layout")
        })?;
        if let Err(e) = check_peer(&self.layout, &theirs) {
            tracing::warn!(%request_id, error = %e, "refusing a decode server with a different KV layout");
            return Err(Status::failed_precondition(e.to_string()));
        }
        let inflight = self
            .status
            .life
            .enter()
            .map_err(pdserve_worker::not_taking_status)?;
        let (reply, done) = oneshot::channel();
        let (first_tx, mut early) = EarlyToken::channel(r.early_first_token);
        let job = Job {
            queued: std::time::Instant::now(),
            prompt: r.prompt,
            sampling: pdserve_worker::sampling_from_pb(r.sampling),
            request_id: request_id.clone(),
            first_token: first_tx,
            reply,
        };
        let timeout = self.settings.request_timeout;
        let load = self.status.load.clone();
        load.waiting.fetch_add(1, Ordering::Relaxed);
        let sent = tokio::time::timeout(timeout, self.jobs.send(job)).await;
        if !matches!(sent, Ok(Ok(()))) {
            load.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        sent.map_err(|_| Status::resource_exhausted("prefill queue full"))?
            .map_err(|_| Status::unavailable("prefill engine stopped"))?;
        let (tx, rx) = mpsc::channel(8);
        let layout = self.layout.clone();
        let chunk_bytes = self.settings.transfer_chunk_bytes;
        let span = tracing::info_span!("prefill", request_id = %request_id);
        let life = self.status.life.clone();
        tokio::spawn(async move {
            let _inflight = inflight;
            // While queued and computing, a heartbeat every HEARTBEAT: the receiver's
            // progress deadline then measures a live peer, not the prompt's length.
            let mut finished = std::pin::pin!(tokio::time::timeout(timeout, done));
            let mut beat = tokio::time::interval_at(
                tokio::time::Instant::now() + HEARTBEAT,
                HEARTBEAT,
            );
            // The first token, when the receiver asked for it ahead of the header: sent as
            // soon as the engine has sampled it (the pages are exported after that).
            let res = loop {
                tokio::select! {
                    // The token first: the engine answers ~the export's time after it, and
                    // a token not sent before the answer would wait for the header.
                    biased;
                    t = early.recv(), if early.pending() => {
                        // Dropped unsent: the prefill failed, which its reply says.
                        let Some(token) = t else { continue };
                        tracing::debug!(
                            since_call_ms = called.elapsed().as_secs_f64() * 1e3,
                            "first token sent ahead of the KV"
                        );
                        if tx.send(Ok(first_token_message(token))).await.is_err() {
                            tracing::info!(%request_id, "decode server went away; cancelling the prefill");
                            return;
                        }
                    }
                    r = &mut finished => break r,
                    _ = beat.tick() => {
                        if tx.send(Ok(progress_message())).await.is_err() {
                            tracing::info!(%request_id, "decode server went away; cancelling the prefill");
                            return;
                        }
                    }
                    _ = tx.closed() => {
                        tracing::info!(%request_id, "decode server went away; cancelling the prefill");
                        return;
                    }
                    _ = life.aborted() => {
                        let _ = tx.send(Err(Status::unavailable("prefill server shutting down"))).await;
                        return;
                    }
                }
            };
            let prefilled = match res {
                Ok(Ok(Ok(p))) => p,
                Ok(Ok(Err(failure))) => {
                    let _ = tx.send(Err(failure.to_status())).await;
                    return;
                }
                Ok(Err(_)) => {
                    let _ = tx
                        .send(Err(Status::internal("prefill engine dropped the request")))
                        .await;
                    return;
                }
                Err(_) => {
                    let _ = tx
                        .send(Err(Status::deadline_exceeded(format!(
                            "prefill did not finish within {timeout:?}"
                        ))))
                        .await;
                    return;
                }
            };
            tracing::debug!(
                since_call_ms = called.elapsed().as_secs_f64() * 1e3,
                "prefill answered by the engine"
            );
            let t0 = std::time::Instant::now();
            let bytes = prefilled.payload_bytes();
            // Each message built as the connection takes the last: the header (and the
            // decode server's checks of it) does not wait for every chunk's copy.
            let mut header_out = None;
            for m in prefill_messages(&layout, &prefilled, chunk_bytes) {
                if tx.send(Ok(m)).await.is_err() {
                    tracing::info!(%request_id, "decode server went away during the transfer");
                    return;
                }
                header_out.get_or_insert_with(|| t0.elapsed());
            }
            load.add_transfer(bytes as u64, t0.elapsed());
            tracing::debug!(
                bytes,
                header_ms = header_out.unwrap_or_default().as_secs_f64() * 1e3,
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "KV sent (the last message handed to the connection)"
            );
        }.instrument(span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
