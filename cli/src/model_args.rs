//! Flags shared by every command that loads a model.

use crate::engine_spec::{
    layout_spec, numerics, open_engine, weight_dtype, CudaSpec, Device, EngineSpec, GraphChoice,
};
use anyhow::{Context, Result};
use pdserve_engine::backend::Backend;
use pdserve_engine::kv::sizing::{self, DeviceSize, HostSize};
use pdserve_engine::kv::{KvLayout, KvLayoutSpec};
use pdserve_engine::{CpuBackend, Engine, LoadFormat, PoolSize};
use pdserve_tokenizer::Tokenizer;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model folder (config.json, *.safetensors, optional tokenizer.json). Default: the embedded model.
    #[arg(long, env = "PDSERVE_MODEL")]
    pub model: Option<PathBuf>,
    /// Where the weights come from: `auto` (the folder's safetensors) or `dummy[:SEED]`
    /// (random weights of config.json's shapes and formats, seed 0 by default, as `pdserve
    /// bench` draws them; only config.json is read: load tests of checkpoints one lacks).
    #[arg(long, default_value = "auto")]
    pub load_format: LoadFormat,
    /// Compute device: `cpu`, `cuda:N` (fails if CUDA device N cannot be used), or
    /// `auto` (cuda:0 when its driver, cuBLAS and NVRTC load, else cpu with a warning).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weight storage on a CUDA device: bf16 (router and hyper-connection maps stay fp32)
    /// or f32 (fp32 GEMMs; a reference mode for checking the kernels).
    #[arg(long, default_value = "bf16")]
    pub cuda_weights: String,
    /// Decode steps on a CUDA device: `capture` (one CUDA graph per batch-size bucket,
    /// captured on first use, then replayed), `eager` (the same kernels launched one by
    /// one) or `auto` (capture, as the decode server does).
    #[arg(long, default_value = "capture")]
    pub cuda_graph: String,
    /// Run every CUDA decode step both from its graph and eagerly, and fail it unless the
    /// logits, pages and states are bitwise equal (slow; for checking).
    #[arg(long)]
    pub verify_graphs: bool,
    /// Batch-invariant numerics: a request's logits bitwise independent of what else is in
    /// its batch and of bucket padding (CUDA: a fixed-order GEMM kernel instead of cuBLAS,
    /// routed experts always by the grouped kernels; slower). The CPU backend is
    /// batch-invariant always.
    #[arg(long)]
    pub deterministic: bool,
    /// Storage dtype of the indexer's index-K entries: f32 (exact top-k picks), bf16 (half
    /// the bytes) or fp8 (e4m3 + one fp32 scale per entry: 132 B per 128-dim entry).
    /// Below f32, near-ties in indexer scores can pick different entries.
    #[arg(long, default_value = "f32")]
    pub index_k_dtype: String,
    /// Storage dtype of compressed-KV and sliding-window entries: f32, bf16 or fp8
    /// (FlashMLA's DeepSeek-V4 layout: e4m3 with one power-of-two scale per 64 non-rope
    /// values, rope in bf16; 584 B per V4 entry).
    #[arg(long, default_value = "f32")]
    pub kv_dtype: String,
    /// Numerics: `transformers` (f32 activations, exact against transformers' forward) or
    /// `deepseek` (DeepSeek's reference quantization: FP8 activations per 128 before every
    /// FP8/FP4 linear, fp8 compressed KV, Hadamard + FP4 simulation in the indexer; needs
    /// --kv-dtype fp8; on the GPU a prefill's FP8 linears and routed experts run on the
    /// block-scaled FP8 GEMM).
    #[arg(long, default_value = "transformers")]
    pub numerics: String,
    /// Positions per KV page (a multiple of every compress rate). Default: 256 rounded up to one.
    #[arg(long)]
    pub page_tokens: Option<usize>,
    /// KV pages in the device pool.
    #[arg(long, default_value_t = 1024, conflicts_with = "kv_mem_fraction")]
    pub kv_pages: usize,
    /// Size the device KV pool instead as this fraction (0, 1] of the memory free once the
    /// weights are loaded: the GPU's free memory with --device cuda:N, the host's available
    /// memory with --device cpu (`inspect` estimates it from the host's memory now).
    #[arg(long)]
    pub kv_mem_fraction: Option<f64>,
    /// Host (hierarchical cache) pool = this many times the device pool's pages (>= 1).
    #[arg(long, default_value_t = 2.0, conflicts_with = "hicache_size")]
    pub hicache_ratio: f64,
    /// Host (hierarchical cache) pool size in GB instead of --hicache-ratio.
    #[arg(long)]
    pub hicache_size: Option<f64>,
    /// KV canary at every step: checksums of every page and state slot (computed on the
    /// device) fail requests whose KV changed outside the expected writes. Same as
    /// --kv-audit-every 1.
    #[arg(long, conflicts_with = "kv_audit_every")]
    pub kv_audit: bool,
    /// KV canary checking pages every N steps (state slots every step); 0: off.
    #[arg(long)]
    pub kv_audit_every: Option<u32>,
    /// Prefill chunk size in tokens (0: whole prompt in one forward).
    #[arg(long, default_value_t = 512)]
    pub chunked_prefill_size: usize,
}

/// A command body that runs on whichever backend `--device` selects.
pub trait OnEngine {
    fn run<B: Backend>(self, loaded: Loaded<B>) -> Result<()>;
}

pub struct Loaded<B: Backend> {
    pub engine: Engine<B>,
    pub tokenizer: Option<Tokenizer>,
    pub dir: PathBuf,
}

/// The backend `--device` selects (see [`ModelArgs::backend_choice`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Cpu,
    /// CUDA device N; failing to open it is an error.
    Cuda(usize),
    /// `--device auto`: cuda:0 if it opens, else the CPU.
    CudaElseCpu,
}

/// What [`ModelArgs::load`] builds, before anything is loaded (see [`ModelArgs::plan`]).
pub struct EnginePlan {
    /// What `open_engine` gets: folder, layout spec, pool sizes, canary.
    pub spec: EngineSpec,
    pub cfg: pdserve_engine::config::ModelConfig,
    /// The layout of `spec.layout` for `cfg`: page and state slot bytes.
    pub layout: KvLayout,
    /// Host pool pages from --hicache-ratio / --hicache-size.
    pub host_pages: usize,
}

/// Per-request state slots of the device pool.
const STATE_SLOTS: usize = 64;

impl ModelArgs {
    /// Device and host pool pages from the flags; sizes that cannot work are errors here,
    /// at startup. `device_in_host`: the device pool lives in host memory too (`--device
    /// cpu`), so the host pool gets what it leaves. With `--kv-mem-fraction` the device
    /// pages are an estimate from the host's memory now: the engine sizes the pool at load
    /// from the backend's free memory ([`EngineSpec::pool_fraction`]).
    pub fn pool_pages(
        &self,
        layout: &KvLayout,
        states: usize,
        device_in_host: bool,
    ) -> Result<(usize, usize)> {
        let available = sizing::host_memory_available();
        let device = match self.kv_mem_fraction {
            Some(fraction) => DeviceSize::MemFraction {
                fraction,
                memory_bytes: available
                    .context("--kv-mem-fraction: cannot read the available memory")?,
            },
            None => DeviceSize::Pages(self.kv_pages),
        };
        let device_pages = sizing::device_pages(layout, device, states)?;
        let host = match self.hicache_size {
            Some(gb) => HostSize::Gb(gb),
            None => HostSize::Ratio(self.hicache_ratio),
        };
        let device_bytes = (device_pages * layout.page_bytes + states * layout.state_bytes) as u64;
        let left = available.map(|a| {
            if device_in_host {
                a.saturating_sub(device_bytes)
            } else {
                a
            }
        });
        let host_pages = sizing::host_pages(layout, device_pages, host, left)?;
        Ok((device_pages, host_pages))
    }

    /// The KV layout spec the flags give for `cfg`.
    pub fn layout_spec(&self, cfg: &pdserve_engine::config::ModelConfig) -> Result<KvLayoutSpec> {
        let mut spec = layout_spec(cfg, &self.index_k_dtype, &self.kv_dtype, self.page_tokens)?;
        spec.numerics = numerics(&self.numerics)?;
        Ok(spec)
    }

    pub fn model_dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(d) => Ok(d.clone()),
            None => Ok(pdserve_engine::embedded::model_dir()?),
        }
    }

    /// How a CUDA backend would be opened under these flags (parsed even for `--device
    /// cpu`, so a bad flag is an error on every device).
    pub fn cuda_spec(&self) -> Result<CudaSpec> {
        let graphs: GraphChoice = self.cuda_graph.parse()?;
        Ok(CudaSpec {
            weights: weight_dtype(&self.cuda_weights)?,
            graphs: graphs.mode(true),
            verify_graphs_every: u32::from(self.verify_graphs),
            deterministic: self.deterministic,
        })
    }

    /// The backend `--device` selects. Nothing is opened.
    pub fn backend_choice(&self) -> Result<BackendChoice> {
        let device: Device = self.device.parse().context("--device")?;
        Ok(match device {
            Device::Cpu => BackendChoice::Cpu,
            Device::Cuda(n) => BackendChoice::Cuda(n),
            Device::Auto => BackendChoice::CudaElseCpu,
        })
    }

    /// Load the model on the selected device and run `cmd` with it.
    pub fn run<C: OnEngine>(&self, cmd: C) -> Result<()> {
        let cuda = self.cuda_spec()?;
        match self.backend_choice()? {
            BackendChoice::Cpu => cmd.run(self.load(CpuBackend)?),
            BackendChoice::Cuda(n) => {
                let b = cuda.open(n).context("CUDA backend unavailable")?;
                cmd.run(self.load(b)?)
            }
            BackendChoice::CudaElseCpu => match cuda.open(0) {
                Ok(b) => cmd.run(self.load(b)?),
                Err(e) => {
                    tracing::warn!(error = %e, "--device auto: CUDA unavailable, running on the CPU");
                    cmd.run(self.load(CpuBackend)?)
                }
            },
        }
    }

    /// The engine the flags describe (model folder and config, KV layout, pool sizes,
    /// canary), worked out from config.json and the flags alone: no weight is read and no
    /// device is opened. [`ModelArgs::load`] builds exactly this; `inspect` reports it.
    pub fn plan(&self) -> Result<EnginePlan> {
        let dir = self.model_dir()?;
        let cfg = pdserve_engine::config::ModelConfig::from_model_dir(&dir)?;
        let layout_spec = self.layout_spec(&cfg)?;
        let layout = KvLayout::new(&cfg, layout_spec).context("KV layout")?;
        let on_cpu = self.backend_choice()? == BackendChoice::Cpu;
        let (device_pages, host_pages) = self.pool_pages(&layout, STATE_SLOTS, on_cpu)?;
        let spec = EngineSpec {
            dir,
            layout: layout_spec,
            pool: PoolSize {
                pages: device_pages,
                states: STATE_SLOTS,
            },
            kv_audit_every: self.kv_audit_every.unwrap_or(u32::from(self.kv_audit)),
            pool_fraction: self.kv_mem_fraction,
            load_format: self.load_format,
        };
        Ok(EnginePlan {
            spec,
            cfg,
            layout,
            host_pages,
        })
    }

    pub fn load<B: Backend>(&self, backend: B) -> Result<Loaded<B>> {
        // The host pool's size is checked here too (`plan` fails on one that cannot work),
        // though no command behind `run` builds a host pool yet.
        let spec = self.plan()?.spec;
        let engine = open_engine(&spec, backend)
            .with_context(|| format!("loading model from {}", spec.dir.display()))?;
        let tokenizer = Tokenizer::from_model_dir(&spec.dir)?;
        Ok(Loaded {
            engine,
            tokenizer,
            dir: spec.dir,
        })
    }
}

/// Parse `5,17,2` (spaces allowed).
pub fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("token id `{t}` is not a non-negative integer"))
        })
        .collect()
}
