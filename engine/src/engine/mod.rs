//! An engine: one model on one backend with its KV pool. Sequences hold page tables;
//! [`Engine::forward`] runs any mix of prefill chunks and decode steps in one batch.

use crate::backend::{
    Backend, BatchPlan, HostTensor, PickLog, RowArgmax, RowOut, SeqPlan, StepOutput,
};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::kv::audit::{Scribble, ScribbleTarget, StepAudit};
use crate::kv::sizing::{self, DeviceSize};
use crate::kv::{DevicePool, KvAllocator, KvLayout, KvLayoutSpec, PageId, SeqKv};
use crate::model::{Model, ModelWeights};
use std::path::Path;
use std::sync::Arc;

mod cuts;
mod error;
mod pages;

pub use cuts::CutSlots;
pub use error::{EngineError, ErrorClass};

/// Pool sizing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolSize {
    pub pages: usize,
    pub states: usize,
}

/// How [`Engine::load_pool`] sizes the device pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolSpec {
    /// These many pages and state slots.
    Size(PoolSize),
    /// `states` slots, and as many pages as `fraction` (0, 1] of the memory the backend has
    /// free after loading the weights holds, less the slots (`--kv-mem-fraction`).
    FreeFraction { fraction: f64, states: usize },
}

/// Where [`Engine::load_pool`] takes the weights from (vLLM's and SGLang's `--load-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// The folder's safetensors (FP8/FP4 kept as stored where the backend computes on them).
    #[default]
    Auto,
    /// Random weights of the config's shapes and formats, drawn from the counter-based
    /// generator with this seed: the weights `pdserve bench` times (seed 0 by default).
    /// Every process drawing with one seed holds the same weights on every backend (up to
    /// storage rounding), so prefill and decode servers agree. For load tests of
    /// checkpoint shapes one does not have.
    Dummy { seed: u64 },
}

impl std::str::FromStr for LoadFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "safetensors" => Ok(LoadFormat::Auto),
            "dummy" => Ok(LoadFormat::Dummy { seed: 0 }),
            other => other
                .strip_prefix("dummy:")
                .and_then(|seed| seed.parse().ok())
                .map(|seed| LoadFormat::Dummy { seed })
                .ok_or_else(|| {
                    format!("unknown load format `{other}` (expected auto, dummy or dummy:SEED)")
                }),
        }
    }
}

impl Default for PoolSize {
    fn default() -> Self {
        PoolSize {
            pages: 1024,
            states: 64,
        }
    }
}

/// A sequence's KV handle. Create with [`Engine::new_sequence`], give back with [`Engine::release`].
#[derive(Debug)]
pub struct Sequence {
    pub(crate) kv: SeqKv,
}

impl Sequence {
    /// Positions processed so far.
    pub fn len(&self) -> usize {
        self.kv.len
    }

    pub fn is_empty(&self) -> bool {
        self.kv.len == 0
    }

    pub fn kv(&self) -> &SeqKv {
        &self.kv
    }
}

/// A sequence's complete KV state as bytes: what moves between pools and processes.
/// Sizes come from the [`KvLayout`] whose fingerprint it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqSnapshot {
    pub layout_fingerprint: String,
    /// Positions the state covers.
    pub len: usize,
    /// One entry per page of the page table, each `layout.page_bytes` long.
    pub pages: Vec<Vec<u8>>,
    /// The state slot, `layout.state_bytes` long.
    pub state: Vec<u8>,
}

/// Which rows' logits a forward item wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
    /// Only the last row's greedy token ([`crate::sampling::argmax`] of its logits): in a
    /// decode step the backend takes the argmax where the logits are (the CUDA backend on
    /// the device, copying one id back instead of a `vocab`-long row). For requests whose
    /// token is the plain argmax: no temperature, penalties, logprobs or logits
    /// processing.
    Greedy,
}

/// What one forward item gets back.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemOutput {
    /// The logits rows the item asked for, `[rows, vocab]` (none for [`Logits::None`] and
    /// [`Logits::Greedy`]).
    pub logits: HostTensor,
    /// [`Logits::Greedy`]: the last row's greedy token.
    pub greedy: Option<RowArgmax>,
}

/// One sequence's part of a batched forward.
pub struct ForwardItem<'a> {
    pub seq: &'a mut Sequence,
    pub tokens: &'a [u32],
    pub logits: Logits,
}

pub struct Engine<B: Backend> {
    backend: B,
    model: Model<B>,
    device: DevicePool<B>,
    audit: StepAudit,
}

impl<B: Backend> Engine<B> {
    /// Load `dir` (config.json + safetensors) onto `backend`.
    pub fn load(
        dir: &Path,
        backend: B,
        spec: Option<KvLayoutSpec>,
        size: PoolSize,
    ) -> Result<Self, EngineError> {
        Self::load_pool(dir, backend, spec, PoolSpec::Size(size))
    }

    /// [`Engine::load`] with the device pool sized as `pool` says: a fixed size, or a
    /// fraction of the memory the backend has free once the weights are in
    /// ([`crate::backend::TensorOps::memory_free`]: the device's memory on CUDA).
    pub fn load_pool(
        dir: &Path,
        backend: B,
        spec: Option<KvLayoutSpec>,
        pool: PoolSpec,
    ) -> Result<Self, EngineError> {
        Self::load_format(dir, backend, spec, pool, LoadFormat::Auto)
    }

    /// [`Engine::load_pool`] with the weights from `format`: the folder's checkpoint, or
    /// random weights of its config (only config.json is read).
    pub fn load_format(
        dir: &Path,
        backend: B,
        spec: Option<KvLayoutSpec>,
        pool: PoolSpec,
        format: LoadFormat,
    ) -> Result<Self, EngineError> {
        let cfg = ModelConfig::from_model_dir(dir)?;
        let weights = match format {
            LoadFormat::Auto => ModelWeights::load(&Checkpoint::open(dir)?, &cfg, &backend)?,
            LoadFormat::Dummy { seed } => ModelWeights::random(&cfg, &backend, seed)?,
        };
        let size = match pool {
            PoolSpec::Size(size) => size,
            PoolSpec::FreeFraction { fraction, states } => {
                let spec = spec.unwrap_or_else(|| KvLayoutSpec::default_for(&cfg));
                let layout = KvLayout::new(&cfg, spec)?;
                let free = backend.memory_free().ok_or_else(|| {
                    EngineError::Internal(format!(
                        "{} cannot tell how much memory is free to size the KV pool",
                        backend.name()
                    ))
                })?;
                let size = DeviceSize::MemFraction {
                    fraction,
                    memory_bytes: free,
                };
                let pages = sizing::device_pages(&layout, size, states)?;
                tracing::info!(
                    fraction,
                    free_bytes = free,
                    pages,
                    "device KV pool sized from the memory free after loading the weights"
                );
                PoolSize { pages, states }
            }
        };
        Self::new(cfg, weights, backend, spec, size)
    }

    pub fn new(
        cfg: ModelConfig,
        weights: ModelWeights<B>,
        backend: B,
        spec: Option<KvLayoutSpec>,
        size: PoolSize,
    ) -> Result<Self, EngineError> {
        let spec = spec.unwrap_or_else(|| KvLayoutSpec::default_for(&cfg));
        let layout = KvLayout::new(&cfg, spec)?;
        let device = DevicePool::new(&backend, layout, size.pages, size.states)?;
        Ok(Engine {
            model: Model::new(cfg, weights),
            device,
            audit: StepAudit::default(),
            backend,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    pub fn layout(&self) -> &KvLayout {
        &self.device.layout
    }

    /// Turn the KV canary on for every step or off (`--kv-audit`).
    /// Record every forward's routing and indexer picks into `log` (`None`: stop). While
    /// recording, decode steps run as plain forwards (unpadded, never a captured graph),
    /// because a backend reads each pick back to the host as it makes it.
    pub fn record_picks(&mut self, log: Option<Arc<PickLog>>) {
        self.model.record_picks(log);
    }

    pub fn set_kv_audit(&mut self, on: bool) {
        self.set_kv_audit_every(u32::from(on));
    }

    /// Audit every `every`-th step (`--kv-audit-every`; 0: off). An audited step reads the
    /// whole pool twice on the device (checksums only come back); see [`crate::kv::audit`].
    pub fn set_kv_audit_every(&mut self, every: u32) {
        self.audit.set_every(every, &mut self.device);
    }

    pub fn kv_audit(&self) -> bool {
        self.audit.every() > 0
    }

    pub fn kv_audit_every(&self) -> u32 {
        self.audit.every()
    }

    /// The canary's finding on `seq`: the corrupt pages and state slot it holds, if any.
    /// A batch driver fails such sequences alone before their next step.
    pub fn kv_fault(&self, seq: &Sequence) -> Option<EngineError> {
        self.audit.fault_of(&seq.kv).map(EngineError::from)
    }

    /// The device pool (pages, state slots and their storage).
    pub fn device_pool(&self) -> &DevicePool<B> {
        &self.device
    }

    /// Test hook: after the next forward's model pass, overwrite `page` with garbage, as a
    /// kernel writing out of bounds would. Only the audit tests use it.
    #[doc(hidden)]
    pub fn debug_scribble_after_next_forward(&mut self, page: PageId) {
        self.debug_scribble(Scribble {
            target: ScribbleTarget::Page(page),
            in_step: true,
        });
    }

    /// Test hook: plant `s` at the next forward (see [`Scribble`]).
    #[doc(hidden)]
    pub fn debug_scribble(&mut self, s: Scribble) {
        self.audit.scribble_at_next_step(s);
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Who holds which device pages and state slots.
    pub fn allocator(&self) -> &KvAllocator {
        self.device.allocator()
    }

    pub fn kv_store(&self) -> &B::KvStore {
        &self.device.store
    }

    pub fn new_sequence(&mut self) -> Result<Sequence, EngineError> {
        let state = self.device.allocator.alloc_state()?;
        if let Err(e) = self.device.reset_state(&self.backend, state) {
            self.device.allocator.release_state(state)?;
            return Err(e.into());
        }
        self.audit.forget_state(state);
        Ok(Sequence {
            kv: SeqKv {
                pages: Vec::new(),
                state,
                len: 0,
            },
        })
    }

    /// Free a sequence's pages and state slot.
    pub fn release(&mut self, seq: Sequence) -> Result<(), EngineError> {
        self.release_pages(&seq.kv.pages)?;
        self.device.allocator.release_state(seq.kv.state)?;
        self.audit.forget_state(seq.kv.state);
        Ok(())
    }

    /// Copy out a sequence's pages and state.
    pub fn export_sequence(&self, seq: &Sequence) -> Result<SeqSnapshot, EngineError> {
        let pages = seq
            .kv
            .pages
            .iter()
            .map(|&p| self.device.read_page(&self.backend, p))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(SeqSnapshot {
            layout_fingerprint: self.device.fingerprint.clone(),
            len: seq.kv.len,
            pages,
            state: self.device.read_state(&self.backend, seq.kv.state)?,
        })
    }

    /// A new sequence holding a snapshot's state (pages and state slot freshly allocated).
    pub fn import_sequence(&mut self, snap: &SeqSnapshot) -> Result<Sequence, EngineError> {
        let fp = self.device.fingerprint.clone();
        if snap.layout_fingerprint != fp {
            return Err(EngineError::Internal(format!(
                "KV snapshot has layout {}, this engine's is {fp}",
                snap.layout_fingerprint
            )));
        }
        let (pb, sb) = (self.layout().page_bytes, self.layout().state_bytes);
        if snap.pages.len() != self.layout().pages_for(snap.len)
            || snap.pages.iter().any(|p| p.len() != pb)
            || snap.state.len() != sb
        {
            return Err(EngineError::Internal(format!(
                "KV snapshot of {} positions has {} pages / state of {} bytes; layout wants {} pages of {pb} bytes and {sb} state bytes",
                snap.len,
                snap.pages.len(),
                snap.state.len(),
                self.layout().pages_for(snap.len)
            )));
        }
        let mut seq = self.new_sequence()?;
        let written = (|| {
            seq.kv.pages = self.device.allocator.alloc_pages(snap.pages.len())?;
            for (&p, bytes) in seq.kv.pages.iter().zip(&snap.pages) {
                self.device.write_page(&self.backend, p, bytes)?;
            }
            self.device
                .write_state(&self.backend, seq.kv.state, &snap.state)?;
            Ok::<(), EngineError>(())
        })();
        match written {
            Ok(()) => {
                seq.kv.len = snap.len;
                Ok(seq)
            }
            Err(e) => {
                self.release(seq)?;
                Err(e)
            }
        }
    }

    /// Grow every sequence's page table to cover its new tokens; all or nothing.
    fn reserve(&mut self, items: &mut [ForwardItem<'_>]) -> Result<(), EngineError> {
        let need: Vec<usize> = items
            .iter()
            .map(|it| {
                self.device
                    .layout
                    .pages_for(it.seq.kv.len + it.tokens.len())
                    .saturating_sub(it.seq.kv.pages.len())
            })
            .collect();
        let total: usize = need.iter().sum();
        let mut fresh = self.device.allocator.alloc_pages(total)?.into_iter();
        for (it, n) in items.iter_mut().zip(need) {
            it.seq.kv.pages.extend(fresh.by_ref().take(n));
        }
        self.device.publish_metrics();
        Ok(())
    }

    /// One batched forward. Returns, per item, its wanted logits rows (`[rows, vocab]`;
    /// none for a [`Logits::Greedy`] item: its token is in [`Engine::forward_each`]'s
    /// output); fails if the KV canary finds any item's KV corrupt.
    pub fn forward(
        &mut self,
        items: &mut [ForwardItem<'_>],
    ) -> Result<Vec<HostTensor>, EngineError> {
        self.forward_each(items)?
            .into_iter()
            .map(|o| o.map(|o| o.logits))
            .collect()
    }

    /// One batched forward whose items fail alone: the outer error fails the whole step,
    /// an inner one (the KV canary found that item's pages or state slot corrupt) only
    /// its item. Every item's KV advanced either way.
    pub fn forward_each(
        &mut self,
        items: &mut [ForwardItem<'_>],
    ) -> Result<Vec<Result<ItemOutput, EngineError>>, EngineError> {
        self.forward_planned(items, &[])
    }

    /// [`Engine::forward_each`], with `cuts` (of the single item) also written: each cut's
    /// state slot gets the rings the item's sequence has at the cut's position.
    fn forward_planned(
        &mut self,
        items: &mut [ForwardItem<'_>],
        cuts: &[crate::backend::Cut],
    ) -> Result<Vec<Result<ItemOutput, EngineError>>, EngineError> {
        let vocab = self.model.cfg.vocab_size;
        for it in items.iter() {
            if it.tokens.is_empty() {
                return Err(EngineError::InvalidInput(
                    "forward item with no tokens".into(),
                ));
            }
            if let Some(&t) = it.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::InvalidInput(format!(
                    "token id {t} outside the vocabulary (size {vocab})"
                )));
            }
            let end = it.seq.kv.len + it.tokens.len();
            if end > self.model.cfg.max_position_embeddings {
                return Err(EngineError::InvalidInput(format!(
                    "sequence would reach {end} positions, model maximum is {}",
                    self.model.cfg.max_position_embeddings
                )));
            }
        }
        self.reserve(items)?;
        let mut plan = BatchPlan::default();
        // Rows the model computes logits for, and what each of them sends back.
        let mut logit_rows = Vec::new();
        let mut outs = Vec::new();
        // Per item: its rows of the step's returned logits, and its entry of the argmaxes.
        let mut returned: Vec<(usize, Option<usize>)> = Vec::with_capacity(items.len());
        for (si, it) in items.iter().enumerate() {
            let row0 = plan.tokens.len();
            let start = it.seq.kv.len;
            plan.seqs.push(SeqPlan {
                start,
                len: it.tokens.len(),
                row0,
                pages: it.seq.kv.pages.clone(),
                state: it.seq.kv.state,
            });
            plan.tokens.extend_from_slice(it.tokens);
            plan.positions.extend(start..start + it.tokens.len());
            plan.row_seq
                .extend(std::iter::repeat_n(si, it.tokens.len()));
            let last = row0 + it.tokens.len() - 1;
            let (rows, out): (Vec<usize>, RowOut) = match it.logits {
                Logits::None => (Vec::new(), RowOut::LOGITS),
                Logits::Last => (vec![last], RowOut::LOGITS),
                Logits::All => ((row0..=last).collect(), RowOut::LOGITS),
                Logits::Greedy => (vec![last], RowOut::ARGMAX),
            };
            returned.push(match out.argmax {
                true => (0, Some(outs.len())),
                false => (rows.len(), None),
            });
            outs.extend(std::iter::repeat_n(out, rows.len()));
            logit_rows.extend(rows);
        }
        plan.cuts = plan.cut_plan(cuts)?;
        let before = self.audit.before_step(&self.backend, &mut self.device)?;
        let decode = plan.cuts.is_none()
            && !self.model.records_picks()
            && items.iter().all(|it| {
                it.tokens.len() == 1 && matches!(it.logits, Logits::Last | Logits::Greedy)
            });
        let step = if decode {
            let (model, layout) = (&self.model, &self.device.layout);
            self.backend.decode_step(
                &mut self.device.store,
                &plan,
                &outs,
                &mut |b: &B, kv: &mut B::KvStore, plan: &BatchPlan| {
                    let rows: Vec<usize> = (0..plan.rows()).collect();
                    model.forward_device(b, kv, layout, plan, &rows)
                },
            )?
        } else {
            let t0 = std::time::Instant::now();
            let logits = self.model.forward(
                &self.backend,
                &mut self.device.store,
                &self.device.layout,
                &plan,
                &logit_rows,
            )?;
            tracing::debug!(
                rows = plan.rows(),
                cuts = plan.cuts.as_ref().map_or(0, |c| c.seqs.len()),
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "model forward"
            );
            StepOutput::from_host(&logits, &outs)?
        };
        self.audit
            .after_step(&self.backend, &mut self.device, before, &plan)?;
        for it in items.iter_mut() {
            it.seq.kv.len += it.tokens.len();
        }
        let mut out = Vec::with_capacity(items.len());
        let mut at = 0;
        for (it, (rows, argmax)) in items.iter().zip(returned) {
            let greedy = match argmax {
                None => None,
                Some(i) => Some(step.argmax.get(i).copied().flatten().ok_or_else(|| {
                    EngineError::Internal(
                        "a decode step returned no argmax for a greedy row".into(),
                    )
                })?),
            };
            out.push(match self.audit.fault_of(&it.seq.kv) {
                Some(fault) => Err(fault.into()),
                None => Ok(ItemOutput {
                    logits: HostTensor {
                        rows,
                        cols: vocab,
                        data: step.logits.data[at * vocab..(at + rows) * vocab].to_vec(),
                    },
                    greedy,
                }),
            });
            at += rows;
        }
        Ok(out)
    }
}
