//! Flags shared by every command that loads a model.

use anyhow::{bail, Context, Result};
use pdserve_engine::backend::Backend;
use pdserve_engine::kv::sizing::{self, DeviceSize, HostSize};
use pdserve_engine::kv::{EntryDtype, KvLayout, KvLayoutSpec};
use pdserve_engine::tokenizer::Tokenizer;
use pdserve_engine::{CpuBackend, Engine, PoolSize};
use pdserve_kernels::{CudaBackend, GraphMode, WeightDtype};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model folder (config.json, *.safetensors, optional tokenizer.json). Default: the embedded model.
    #[arg(long, env = "PDSERVE_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute device: `cpu`, `cuda:N` (fails if CUDA device N cannot be used), or
    /// `auto` (cuda:0 when its driver, cuBLAS and NVRTC load, else cpu with a warning).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weight storage on a CUDA device: bf16 (router and hyper-connection maps stay fp32)
    /// or f32 (fp32 GEMMs; a reference mode for checking the kernels).
    #[arg(long, default_value = "bf16")]
    pub cuda_weights: String,
    /// Decode steps on a CUDA device: `capture` (one CUDA graph per batch-size bucket,
    /// captured on first use, then replayed) or `eager` (the same kernels launched one by
    /// one).
    #[arg(long, default_value = "capture")]
    pub cuda_graph: String,
    /// Run every CUDA decode step both from its graph and eagerly, and fail it unless the
    /// logits, pages and states are bitwise equal (slow; for checking).
    #[arg(long)]
    pub verify_graphs: bool,
    /// Storage dtype of the indexer's index-K entries: f32 (exact top-k picks), bf16 (half
    /// the bytes) or fp8 (e4m3 + one fp32 scale per entry: 132 B per 128-dim entry).
    /// Below f32, near-ties in indexer scores can pick different entries.
    #[arg(long, default_value = "f32")]
    pub index_k_dtype: String,
    /// Storage dtype of compressed-KV and sliding-window entries: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub kv_dtype: String,
    /// Positions per KV page (a multiple of every compress rate). Default: 256 rounded up to one.
    #[arg(long)]
    pub page_tokens: Option<usize>,
    /// KV pages in the device pool.
    #[arg(long, default_value_t = 1024, conflicts_with = "kv_mem_fraction")]
    pub kv_pages: usize,
    /// Size the device KV pool as this fraction (0, 1] of the device's memory instead
    /// (host memory available now, with --device cpu).
    #[arg(long)]
    pub kv_mem_fraction: Option<f64>,
    /// Host (hierarchical cache) pool = this many times the device pool's pages (>= 1).
    #[arg(long, default_value_t = 2.0, conflicts_with = "hicache_size")]
    pub hicache_ratio: f64,
    /// Host (hierarchical cache) pool size in GB instead of --hicache-ratio.
    #[arg(long)]
    pub hicache_size: Option<f64>,
    /// Checksum every KV page and state slot around each step and fail requests whose
    /// pages changed outside the step's expected writes (costly; for debugging).
    #[arg(long)]
    pub kv_audit: bool,
    /// Prefill chunk size in tokens (0: whole prompt in one forward).
    #[arg(long, default_value_t = 512)]
    pub chunked_prefill_size: usize,
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
    Auto,
}

impl std::str::FromStr for Device {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "auto" => Ok(Device::Auto),
            "cuda" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => bail!("unknown device `{other}` (expected cpu, cuda:N or auto)"),
            },
        }
    }
}

/// A command body that runs on whichever backend `--device` selects.
pub trait OnEngine {
    fn run<B: Backend>(self, loaded: Loaded<B>) -> Result<()>;
}

pub struct Loaded<B: Backend> {
    pub engine: Engine<B>,
    /// Host pool pages from --hicache-ratio / --hicache-size (checked at startup), for
    /// a `kv::HostPool` behind the engine's prefix cache.
    pub host_pages: usize,
    pub tokenizer: Option<Tokenizer>,
    pub dir: PathBuf,
}

/// Per-request state slots of the device pool.
const STATE_SLOTS: usize = 64;

impl ModelArgs {
    /// Device and host pool pages from the flags; sizes that cannot work are errors here,
    /// at startup.
    pub fn pool_pages(&self, layout: &KvLayout, states: usize) -> Result<(usize, usize)> {
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
        // With --device cpu the device pool lives in host memory too.
        let left = available.map(|a| {
            a.saturating_sub(
                (device_pages * layout.page_bytes + states * layout.state_bytes) as u64,
            )
        });
        let host_pages = sizing::host_pages(layout, device_pages, host, left)?;
        Ok((device_pages, host_pages))
    }

    pub fn model_dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(d) => Ok(d.clone()),
            None => Ok(pdserve_engine::embedded::model_dir()?),
        }
    }

    /// Load the model on the selected device and run `cmd` with it.
    pub fn run<C: OnEngine>(&self, cmd: C) -> Result<()> {
        let device: Device = self.device.parse().context("--device")?;
        let weights: WeightDtype = self
            .cuda_weights
            .parse()
            .map_err(anyhow::Error::msg)
            .context("--cuda-weights")?;
        let graphs: GraphMode = self
            .cuda_graph
            .parse()
            .map_err(anyhow::Error::msg)
            .context("--cuda-graph")?;
        let open = |n: usize| {
            CudaBackend::with_weights(n, None, weights).map(|mut b| {
                b.set_graph_mode(graphs);
                b.set_verify_graphs(self.verify_graphs);
                b
            })
        };
        match device {
            Device::Cpu => cmd.run(self.load(CpuBackend)?),
            Device::Cuda(n) => {
                let b = open(n)
                    .with_context(|| format!("--device cuda:{n}: CUDA backend unavailable"))?;
                cmd.run(self.load(b)?)
            }
            Device::Auto => match open(0) {
                Ok(b) => cmd.run(self.load(b)?),
                Err(e) => {
                    tracing::warn!(error = %e, "--device auto: CUDA unavailable, running on the CPU");
                    cmd.run(self.load(CpuBackend)?)
                }
            },
        }
    }

    pub fn load<B: Backend>(&self, backend: B) -> Result<Loaded<B>> {
        let dir = self.model_dir()?;
        let t0 = Instant::now();
        let cfg = pdserve_engine::config::ModelConfig::from_model_dir(&dir)?;
        let mut spec = KvLayoutSpec::default_for(&cfg);
        spec.index_k_dtype = EntryDtype::parse(&self.index_k_dtype).context("--index-k-dtype")?;
        spec.kv_dtype = EntryDtype::parse(&self.kv_dtype).context("--kv-dtype")?;
        if let Some(p) = self.page_tokens {
            spec.page_tokens = p;
        }
        let layout = KvLayout::new(&cfg, spec).context("KV layout")?;
        let (device_pages, host_pages) = self.pool_pages(&layout, STATE_SLOTS)?;
        let mut engine = Engine::load(
            &dir,
            backend,
            Some(spec),
            PoolSize {
                pages: device_pages,
                states: STATE_SLOTS,
            },
        )
        .with_context(|| format!("loading model from {}", dir.display()))?;
        engine.set_kv_audit(self.kv_audit);
        let tokenizer = Tokenizer::from_model_dir(&dir)?;
        tracing::info!(
            model = %dir.display(),
            backend = %pdserve_engine::backend::TensorOps::name(engine.backend()),
            layout = %engine.layout().fingerprint(),
            secs = t0.elapsed().as_secs_f32(),
            "model loaded"
        );
        Ok(Loaded {
            engine,
            host_pages,
            tokenizer,
            dir,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::Device;

    #[test]
    fn device_names_parse() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("auto".parse::<Device>().unwrap(), Device::Auto);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        for bad in ["cuda:", "cuda:x", "gpu", "cuda:-1"] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }
}
