//! The engine's own thread: one prefill at a time, checked for cancellation between chunks.

use pdserve_engine::backend::Backend;
use pdserve_engine::generate::prefill;
use pdserve_engine::kv::KvLayout;
use pdserve_engine::sampling::{Sampler, SamplingParams};
use pdserve_engine::{Engine, EngineError, Logits};
use pdserve_kv_transfer::Prefilled;
use tokio::sync::{mpsc, oneshot};

pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub request_id: String,
    pub reply: oneshot::Sender<Result<Prefilled, tonic::Status>>,
}

pub struct Ready {
    pub layout: KvLayout,
    pub total_pages: usize,
}

type ReadyRx = oneshot::Receiver<Result<Ready, EngineError>>;

pub fn spawn<B, F>(make_engine: F, chunk: usize) -> std::io::Result<(mpsc::Sender<Job>, ReadyRx)>
where
    B: Backend + 'static,
    F: FnOnce() -> Result<Engine<B>, EngineError> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(1024);
    let (ready_tx, ready_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("prefill-engine".into())
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
                total_pages: engine.pool().total_pages(),
            }));
            run(engine, rx, chunk);
        })?;
    Ok((tx, ready_rx))
}

fn run<B: Backend>(mut engine: Engine<B>, mut rx: mpsc::Receiver<Job>, chunk: usize) {
    while let Some(job) = rx.blocking_recv() {
        let _span = tracing::info_span!("prefill", request_id = %job.request_id).entered();
        if job.reply.is_closed() {
            tracing::info!("cancelled before it started");
            continue;
        }
        let t0 = std::time::Instant::now();
        match prefill_one(&mut engine, &job, chunk) {
            Ok(Some(p)) => {
                tracing::info!(
                    prompt_tokens = job.prompt.len(),
                    pages = p.snapshot.pages.len(),
                    ms = t0.elapsed().as_millis() as u64,
                    "prefilled"
                );
                let _ = job.reply.send(Ok(p));
            }
            Ok(None) => tracing::info!("cancelled by the decode server; pages freed"),
            Err(e) => {
                tracing::warn!(error = %e, "prefill failed");
                let _ = job.reply.send(Err(engine_status(e)));
            }
        }
    }
}

pub fn engine_status(e: EngineError) -> tonic::Status {
    match e {
        EngineError::Request(m) => tonic::Status::invalid_argument(m),
        EngineError::Pool(p) => tonic::Status::resource_exhausted(p.to_string()),
        other => tonic::Status::internal(other.to_string()),
    }
}

/// `Ok(None)`: the requester went away; the sequence is released either way.
fn prefill_one<B: Backend>(
    engine: &mut Engine<B>,
    job: &Job,
    chunk: usize,
) -> Result<Option<Prefilled>, EngineError> {
    let mut sampler =
        Sampler::new(job.sampling).map_err(|e| EngineError::Request(e.to_string()))?;
    if job.prompt.is_empty() {
        return Err(EngineError::Request("empty prompt".into()));
    }
    let chunk = if chunk == 0 { job.prompt.len() } else { chunk };
    let mut seq = engine.new_sequence()?;
    let result = (|| {
        let n = job.prompt.len().div_ceil(chunk);
        let mut last = Vec::new();
        for (i, part) in job.prompt.chunks(chunk).enumerate() {
            if job.reply.is_closed() {
                return Ok(None);
            }
            let want = if i + 1 == n {
                Logits::Last
            } else {
                Logits::None
            };
            last = prefill(engine, &mut seq, part, 0, want)?
                .pop()
                .unwrap_or_default();
        }
        let first_token = sampler
            .sample(&last)
            .map_err(|e| EngineError::Request(e.to_string()))?;
        Ok(Some(Prefilled {
            snapshot: engine.export_sequence(&seq)?,
            last_logits: last,
            first_token,
        }))
    })();
    engine.release(seq)?;
    result
}
