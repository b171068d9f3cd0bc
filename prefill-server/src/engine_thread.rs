//! The engine's own thread: one prefill at a time through the prefix cache (device pool
//! plus the host tier), checked for cancellation between chunks.

use pdserve_engine::backend::Backend;
use pdserve_engine::kv::{HostPool, KvLayout, PrefixCache};
use pdserve_engine::sampling::{Sampler, SamplingParams};
use pdserve_engine::{Engine, EngineError, Logits};
use pdserve_kv_transfer::Prefilled;
use pdserve_worker::{Failure, Load};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

pub struct Job {
    /// When the service queued it (for the queue-time histogram).
    pub queued: std::time::Instant,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub request_id: String,
    /// Told the sampled token as soon as it is known, before the pages are exported
    /// (when the receiver asked for it early).
    pub first_token: Option<oneshot::Sender<u32>>,
    pub reply: oneshot::Sender<Result<Prefilled, Failure>>,
}

pub struct Ready {
    pub layout: KvLayout,
    pub total_pages: usize,
}

type ReadyRx = oneshot::Receiver<Result<Ready, EngineError>>;

pub fn spawn<B, F>(
    make_engine: F,
    chunk: usize,
    host_pages: usize,
    load: Arc<Load>,
) -> std::io::Result<(mpsc::Sender<Job>, ReadyRx)>
where
    B: Backend + 'static,
    F: FnOnce() -> Result<Engine<B>, EngineError> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(1024);
    let (ready_tx, ready_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("prefill-engine".into())
        .spawn(move || {
            let built = make_engine().and_then(|engine| {
                let host = HostPool::new(engine.layout(), host_pages);
                let mut cache = PrefixCache::new(&engine, host)?;
                // The last forward's cut points are cached after the answer has gone.
                cache.set_defer_final_cuts(true);
                Ok((engine, cache))
            });
            let (engine, cache) = match built {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(Ready {
                layout: engine.layout().clone(),
                total_pages: engine.allocator().total_pages(),
            }));
            let mut w = Worker {
                engine,
                cache,
                load,
                chunk,
            };
            w.publish();
            w.run(rx);
        })?;
    Ok((tx, ready_rx))
}

struct Worker<B: Backend> {
    engine: Engine<B>,
    cache: PrefixCache,
    load: Arc<Load>,
    chunk: usize,
}

impl<B: Backend> Worker<B> {
    fn run(&mut self, mut rx: mpsc::Receiver<Job>) {
        while let Some(mut job) = rx.blocking_recv() {
            self.load.waiting.fetch_sub(1, Ordering::Relaxed);
            let _span = tracing::info_span!("prefill", request_id = %job.request_id).entered();
            if job.reply.is_closed() {
                tracing::info!("cancelled before it started");
                continue;
            }
            self.load.running.store(1, Ordering::Relaxed);
            pdserve_worker::metrics::queue_time(job.queued.elapsed());
            let t0 = std::time::Instant::now();
            match self.prefill_one(&mut job) {
                Ok(Some((p, hit, host_hit))) => {
                    pdserve_worker::metrics::prefill_time(t0.elapsed());
                    tracing::info!(
                        prompt_tokens = job.prompt.len(),
                        cached_tokens = hit,
                        host_tokens = host_hit,
                        pages = p.snapshot.pages.len(),
                        ms = t0.elapsed().as_millis() as u64,
                        "prefilled"
                    );
                    let _ = job.reply.send(Ok(p));
                }
                Ok(None) => tracing::info!("cancelled by the decode server; pages freed"),
                Err(e) => {
                    tracing::warn!(error = %e, "prefill failed");
                    let _ = job.reply.send(Err(Failure::from_engine(&e, None)));
                }
            }
            self.cache_pending();
            self.load.running.store(0, Ordering::Relaxed);
            self.publish();
        }
    }

    /// Cache the answered prefill's last cut points (their states read back now, off its
    /// time to first token). A failure costs only those cache entries.
    fn cache_pending(&mut self) {
        if !self.cache.has_pending() {
            return;
        }
        let t0 = std::time::Instant::now();
        match self.cache.finish_pending(&mut self.engine) {
            Ok(()) => tracing::debug!(
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "cut points cached after the answer"
            ),
            Err(e) => tracing::warn!(error = %e, "caching the prefill's cut points failed"),
        }
    }

    /// Page and cache figures for the info RPC.
    fn publish(&self) {
        let l = &self.load;
        let stats = self.cache.stats();
        l.free_pages.store(
            self.engine.allocator().free_page_count() as u64,
            Ordering::Relaxed,
        );
        l.cached_pages
            .store(stats.device_pages as u64, Ordering::Relaxed);
        l.host_used_pages
            .store(self.cache.host().used_pages() as u64, Ordering::Relaxed);
        l.host_total_pages
            .store(self.cache.host().total_pages() as u64, Ordering::Relaxed);
        self.publish_prefix_totals();
    }

    /// The prefix cache's token totals (counted once, by the cache) into the load report.
    fn publish_prefix_totals(&self) {
        let (l, t) = (&self.load, self.cache.totals());
        l.prefix_hit_device_tokens
            .store(t.device_hit_tokens, Ordering::Relaxed);
        l.prefix_hit_host_tokens
            .store(t.host_hit_tokens, Ordering::Relaxed);
        l.prefix_miss_tokens.store(t.miss_tokens, Ordering::Relaxed);
    }

    /// `Ok(None)`: the requester went away; the sequence is released either way.
    /// Otherwise the prefill and its cached and host-tier token counts.
    fn prefill_one(
        &mut self,
        job: &mut Job,
    ) -> Result<Option<(Prefilled, usize, usize)>, EngineError> {
        let started = std::time::Instant::now();
        let mut sampler = Sampler::for_prompt(job.sampling, &job.prompt)
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        if job.prompt.is_empty() {
            return Err(EngineError::InvalidInput("empty prompt".into()));
        }
        let cancelled = || job.reply.is_closed();
        let Some(done) = self.cache.prefill_cancellable(
            &mut self.engine,
            &job.prompt,
            self.chunk,
            Logits::Last,
            &cancelled,
        )?
        else {
            return Ok(None);
        };
        self.publish_prefix_totals();
        let (hit, host_hit) = (done.hit_tokens, done.host_hit_tokens);
        let seq = done.seq;
        let result = (|| {
            let last = done.logits.last().cloned().unwrap_or_default();
            let first_token = sampler
                .sample(&last)
                .map_err(|e| EngineError::Internal(format!("sampling: {e}")))?;
            pdserve_worker::metrics::prefill_first_token(started.elapsed());
            if let Some(tx) = job.first_token.take() {
                // The service sends it on while the pages are exported; a receiver gone
                // meanwhile is seen by the reply.
                let _ = tx.send(first_token);
            }
            let t0 = std::time::Instant::now();
            let snapshot = self.engine.export_sequence(&seq)?;
            tracing::debug!(
                pages = snapshot.pages.len(),
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "sequence exported"
            );
            Ok(Some((
                Prefilled {
                    snapshot,
                    last_logits: last,
                    first_token,
                },
                hit,
                host_hit,
            )))
        })();
        self.engine.release(seq)?;
        result
    }
}
