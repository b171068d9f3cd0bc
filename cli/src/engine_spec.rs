//! What every command that runs the model asks for, typed and parsed once from its flags
//! or config: the device, how a CUDA backend is opened, the KV layout and pool, and ONE
//! [`open_engine`] that loads the model from them. `generate`/`logits` (`model_args.rs`),
//! the prefill and decode servers (`serve.rs`) and `bench` all go through here; `inspect`
//! reports the same [`EngineSpec`] without loading it.

use anyhow::{bail, Context, Result};
use pdserve_engine::backend::{Backend, BackendError};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::kv::{EntryDtype, KvLayoutSpec};
use pdserve_engine::numerics::Numerics;
use pdserve_engine::{Engine, EngineError, LoadFormat, PoolSize, PoolSpec};
use pdserve_kernels::{CudaBackend, GraphMode, WeightDtype};
use std::path::PathBuf;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
    /// cuda:0 when its driver, cuBLAS and NVRTC load, else cpu with a warning.
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

/// Decode steps on a CUDA device as asked: `auto` captures them (graphs exist only for
/// single-token decode steps, so multi-token prefill forwards always run eagerly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphChoice {
    Auto,
    Capture,
    Eager,
}

impl std::str::FromStr for GraphChoice {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(GraphChoice::Auto),
            "capture" => Ok(GraphChoice::Capture),
            "eager" => Ok(GraphChoice::Eager),
            g => bail!("--cuda-graph `{g}`: expected auto, capture or eager"),
        }
    }
}

impl GraphChoice {
    /// The mode of an engine that runs decode steps (`decodes`) or only prefills.
    pub fn mode(self, decodes: bool) -> GraphMode {
        match (self, decodes) {
            (GraphChoice::Auto | GraphChoice::Capture, true) => GraphMode::Capture,
            _ => GraphMode::Eager,
        }
    }
}

/// How a CUDA backend is opened.
#[derive(Debug, Clone, Copy)]
pub struct CudaSpec {
    pub weights: WeightDtype,
    pub graphs: GraphMode,
    /// Run every N-th graphed decode step eagerly too and compare bitwise (0: never).
    pub verify_graphs_every: u32,
    /// Batch-invariant kernels only (`--deterministic`).
    pub deterministic: bool,
}

impl CudaSpec {
    /// Open CUDA device `ordinal` as specified; errors name the `--device` flag.
    pub fn open(&self, ordinal: usize) -> Result<CudaBackend, BackendError> {
        let mut b = CudaBackend::with_weights(ordinal, None, self.weights)
            .map_err(|e| BackendError::Device(format!("--device cuda:{ordinal}: {e}")))?;
        b.set_graph_mode(self.graphs);
        b.set_verify_graphs_every(self.verify_graphs_every);
        b.set_deterministic(self.deterministic);
        Ok(b)
    }
}

/// `--cuda-weights`.
pub fn weight_dtype(s: &str) -> Result<WeightDtype> {
    s.parse()
        .map_err(anyhow::Error::msg)
        .context("--cuda-weights")
}

/// `--numerics`: transformers (f32 activations, exact against transformers) or deepseek
/// (DeepSeek's reference quantization; CPU only, with `--kv-dtype fp8`).
pub fn numerics(s: &str) -> Result<Numerics> {
    Numerics::parse(s)
        .map_err(anyhow::Error::msg)
        .context("--numerics")
}

/// The KV layout spec of `cfg` with the dtype and page flags applied.
pub fn layout_spec(
    cfg: &ModelConfig,
    index_k_dtype: &str,
    kv_dtype: &str,
    page_tokens: Option<usize>,
) -> Result<KvLayoutSpec> {
    let mut spec = KvLayoutSpec::default_for(cfg);
    spec.index_k_dtype = EntryDtype::parse(index_k_dtype).context("--index-k-dtype")?;
    spec.kv_dtype = EntryDtype::parse(kv_dtype).context("--kv-dtype")?;
    if let Some(p) = page_tokens {
        spec.page_tokens = p;
    }
    Ok(spec)
}

/// A model folder and the engine to build around it on some backend.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    pub dir: PathBuf,
    pub layout: KvLayoutSpec,
    pub pool: PoolSize,
    /// KV canary: check pages every N steps, state slots every step (0: off).
    pub kv_audit_every: u32,
    /// `--kv-mem-fraction`: size the device pool once the weights are loaded, as this
    /// fraction of the memory the backend has free then (the device's memory on CUDA, the
    /// host's on the CPU); `pool.pages` is then the estimate `inspect` reports.
    pub pool_fraction: Option<f64>,
    /// `--load-format`: the folder's checkpoint or random weights of its config.
    pub load_format: LoadFormat,
}

/// Load the model of `spec` onto `backend`: THE way every command builds its engine.
/// The engine's own error passes through unboxed: the servers' engine threads classify it.
#[allow(clippy::result_large_err)]
pub fn open_engine<B: Backend>(spec: &EngineSpec, backend: B) -> Result<Engine<B>, EngineError> {
    let t0 = std::time::Instant::now();
    let pool = match spec.pool_fraction {
        None => PoolSpec::Size(spec.pool),
        Some(fraction) => PoolSpec::FreeFraction {
            fraction,
            states: spec.pool.states,
        },
    };
    let mut engine = Engine::load_format(
        &spec.dir,
        backend,
        Some(spec.layout),
        pool,
        spec.load_format,
    )?;
    engine.set_kv_audit_every(spec.kv_audit_every);
    tracing::info!(
        model = %spec.dir.display(),
        load_format = ?spec.load_format,
        backend = %engine.backend().name(),
        layout = %engine.layout().fingerprint(),
        secs = t0.elapsed().as_secs_f32(),
        "model loaded"
    );
    Ok(engine)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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

    #[test]
    fn auto_graphs_capture_decode_steps_only() {
        let auto: GraphChoice = "auto".parse().unwrap();
        assert_eq!(auto.mode(true), GraphMode::Capture);
        assert_eq!(auto.mode(false), GraphMode::Eager);
        assert_eq!(GraphChoice::Capture.mode(false), GraphMode::Eager);
        assert_eq!(GraphChoice::Eager.mode(true), GraphMode::Eager);
        assert!("graphs".parse::<GraphChoice>().is_err());
    }
}
