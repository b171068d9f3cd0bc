//! What the bench needs from a backend beyond [`Backend`]: weight storage sizes, a way to
//! wait for queued work, the two ceilings measured in the same run, and graph mode.

use super::stats::median;
use super::traffic::{weight_bytes, WeightBytes};
use anyhow::{anyhow, Result};
use pdserve_engine::backend::{counter_rng, BResult, Backend, TensorOps, WeightInit};
use pdserve_engine::checkpoint::{weight_format, StoredWeight, WeightFormat};
use pdserve_engine::config::ModelConfig;
use pdserve_engine::model::random_weights::stored_group_rows;
use pdserve_engine::model::weights::weight_use;
use pdserve_engine::CpuBackend;
use pdserve_kernels::{CudaBackend, GraphMode};
use rayon::prelude::*;
use std::time::Instant;

/// A measured ceiling and how it was measured.
#[derive(Debug, Clone)]
pub struct Ceiling {
    /// Bytes/s or FLOP/s.
    pub rate: f64,
    pub how: String,
}

pub trait BenchBackend: Backend + Sized {
    /// Bytes a `rows x cols` weight of `cfg` named `name` occupies on this backend.
    fn weight_tensor_bytes(&self, cfg: &ModelConfig, name: &str, rows: usize, cols: usize) -> u64;
    /// Wait until every queued operation has finished.
    fn sync(&self) -> BResult<()>;
    /// Memory bandwidth (bytes/s) measured now: the decode floor's denominator.
    fn memory_bandwidth(&self) -> Result<Ceiling>;
    /// Dense GEMM rate (FLOP/s) measured now: the prefill ceiling.
    fn gemm_rate(&self) -> Result<Ceiling>;
    /// The FP8 GEMM rate (FLOP/s) measured now, block-scaled as the checkpoints' FP8
    /// weights: the ceiling of the stored formats' prefill. None where there is no FP8
    /// GEMM (the CPU, which computes every format in fp32).
    fn fp8_gemm_rate(&self) -> Result<Option<Ceiling>>;
    /// Run decode steps in `mode`; returns the label the table shows for it.
    fn apply_graph_mode(&mut self, mode: GraphMode) -> String;
    /// Seconds decode steps have spent so far in each phase the backend times.
    fn step_phases(&self) -> StepSeconds;
}

/// Cumulative seconds of decode steps by phase (`StepPhases` of the CUDA backend; the CPU
/// times none, all of its step is host time).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepSeconds {
    /// The dry pass: the forward's host code recording launches and staging inputs.
    pub dry: f64,
    /// Eager launches, or the staged-input copy and the graph launch.
    pub submit: f64,
    /// Blocked on the device (the rest of a step's wall time is host time).
    pub wait: f64,
}

impl std::ops::Sub for StepSeconds {
    type Output = StepSeconds;
    fn sub(self, o: StepSeconds) -> StepSeconds {
        StepSeconds {
            dry: self.dry - o.dry,
            submit: self.submit - o.submit,
            wait: self.wait - o.wait,
        }
    }
}

impl BenchBackend for CpuBackend {
    /// The CPU holds every weight in fp32 (stored formats dequantized).
    fn weight_tensor_bytes(&self, _: &ModelConfig, _: &str, rows: usize, cols: usize) -> u64 {
        (4 * rows * cols) as u64
    }

    fn sync(&self) -> BResult<()> {
        Ok(())
    }

    /// Parallel copy of a 256 MiB random buffer (read + write bytes), median of 5.
    fn memory_bandwidth(&self) -> Result<Ceiling> {
        let n = 64 << 20;
        let init = WeightInit::Uniform { lo: -1.0, hi: 1.0 };
        let src = counter_rng::host_tensor(1, n, init, 11).data;
        let mut dst = vec![0f32; n];
        let mut runs = Vec::new();
        for _ in 0..6 {
            let t = Instant::now();
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s));
            runs.push(t.elapsed().as_secs_f64());
        }
        runs.remove(0);
        if dst[n - 1] != src[n - 1] {
            return Err(anyhow!("bandwidth probe copy did not complete"));
        }
        Ok(Ceiling {
            rate: 2.0 * (n * 4) as f64 / median(runs),
            how: format!("host copy of {} MiB, read+write", (n * 4) >> 20),
        })
    }

    /// The backend's own fp32 matmul, 512^3, median of 5.
    fn gemm_rate(&self) -> Result<Ceiling> {
        let n = 512;
        let init = WeightInit::Uniform { lo: -1.0, hi: 1.0 };
        let x = self.upload(counter_rng::host_tensor(n, n, init, 12))?;
        let w = self.upload(counter_rng::host_tensor(n, n, init, 13))?;
        let mut runs = Vec::new();
        for _ in 0..6 {
            let t = Instant::now();
            let y = self.matmul(&x, &w)?;
            runs.push(t.elapsed().as_secs_f64());
            if !y.data.iter().all(|v| v.is_finite()) {
                return Err(anyhow!("GEMM probe gave non-finite values"));
            }
        }
        runs.remove(0);
        Ok(Ceiling {
            rate: 2.0 * (n as f64).powi(3) / median(runs),
            how: format!("cpu fp32 matmul {n}^3"),
        })
    }

    fn fp8_gemm_rate(&self) -> Result<Option<Ceiling>> {
        Ok(None)
    }

    fn apply_graph_mode(&mut self, mode: GraphMode) -> String {
        match mode {
            GraphMode::Eager => "eager".into(),
            GraphMode::Capture => "eager (cpu has no graphs)".into(),
        }
    }

    /// The CPU computes on the host: all of a step is host time.
    fn step_phases(&self) -> StepSeconds {
        StepSeconds::default()
    }
}

/// Bytes of one weight on the CUDA backend: `reduced` (a matrix under bf16 weights) keeps a
/// stored FP8/FP4 weight as stored and any other in bf16; otherwise fp32.
fn cuda_tensor_bytes(
    cfg: &ModelConfig,
    name: &str,
    (rows, cols): (usize, usize),
    reduced: bool,
) -> u64 {
    match weight_format(cfg, name) {
        format @ (WeightFormat::Fp8Block | WeightFormat::Fp4Packed) if reduced => {
            let group = stored_group_rows(cfg, name, rows);
            StoredWeight::stored_bytes(format, rows, cols, group)
        }
        _ if reduced => (2 * rows * cols) as u64,
        _ => (4 * rows * cols) as u64,
    }
}

/// Weight bytes of `cfg` as `backend` stores them: the decode floor's weight term.
pub fn weight_bytes_on<B: BenchBackend>(cfg: &ModelConfig, backend: &B) -> WeightBytes {
    weight_bytes(cfg, |n, r, c| backend.weight_tensor_bytes(cfg, n, r, c))
}

/// THE one place the bench switches the CUDA backend's decode graph mode; returns the
/// label of rows run in `mode`.
pub fn set_graph_mode(backend: &mut CudaBackend, mode: GraphMode) -> String {
    backend.set_graph_mode(mode);
    mode.to_string()
}

impl BenchBackend for CudaBackend {
    /// Stored FP8/FP4 matrices as stored (under bf16 weights), other matrices bf16,
    /// the rest fp32 — what `upload_stored` / `upload_weight` keep.
    fn weight_tensor_bytes(&self, cfg: &ModelConfig, name: &str, rows: usize, cols: usize) -> u64 {
        let reduced = self.weight_is_bf16(weight_use(name, rows, cols));
        cuda_tensor_bytes(cfg, name, (rows, cols), reduced)
    }

    fn sync(&self) -> BResult<()> {
        self.synchronize()
    }

    /// 2 GiB device buffer: device-to-device copy (read+write bytes) and a read-only
    /// kernel; the larger of the two, median of 10 each.
    fn memory_bandwidth(&self) -> Result<Ceiling> {
        let b = self.measure_bandwidth(2 << 30, 10)?;
        Ok(Ceiling {
            rate: b.copy.max(b.read),
            how: format!(
                "{} MiB: copy {:.0} GB/s (read+write), read kernel {:.0} GB/s",
                b.bytes >> 20,
                b.copy / 1e9,
                b.read / 1e9
            ),
        })
    }

    /// cuBLAS bf16 x bf16 -> fp32 GEMM 8192^3, median of 10.
    fn gemm_rate(&self) -> Result<Ceiling> {
        let n = 8192;
        Ok(Ceiling {
            rate: self.measure_gemm_bf16(n, 10)?,
            how: format!("cuBLAS bf16 GEMM {n}^3, fp32 accumulate"),
        })
    }

    /// cuBLASLt e4m3 x e4m3 -> bf16 GEMM 8192^3, fp32 accumulate, median of 10.
    fn fp8_gemm_rate(&self) -> Result<Option<Ceiling>> {
        let n = 8192;
        let (rate, scaling, refused) = self.measure_gemm_fp8(n, 10)?;
        let scales = match refused {
            Some(why) => format!("{} (refused before it: {why})", scaling.describe()),
            None => scaling.describe().to_string(),
        };
        Ok(Some(Ceiling {
            rate,
            how: format!("cuBLASLt FP8 e4m3 GEMM {n}^3, {scales}, fp32 accumulate"),
        }))
    }

    fn apply_graph_mode(&mut self, mode: GraphMode) -> String {
        set_graph_mode(self, mode)
    }

    fn step_phases(&self) -> StepSeconds {
        let p = self.graph_stats().phases;
        StepSeconds {
            dry: p.dry,
            submit: p.submit,
            wait: p.wait,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::bench::config::ModelFlags;
    use pdserve_engine::model::weights::weight_use;

    fn flash(weights: &str) -> ModelConfig {
        ModelFlags {
            device: "cpu".into(),
            layers: 4,
            experts: 8,
            tiny: false,
            seed: 0,
            kv_dtype: "bf16".into(),
            index_k_dtype: "bf16".into(),
            numerics: "transformers".into(),
            cuda_weights: "bf16".into(),
            weights: vec![weights.into()],
            deterministic: false,
            attention: "auto".into(),
            expert_kernel: "auto".into(),
            dense_kernel: "auto".into(),
            expert_lanes: pdserve_kernels::DEFAULT_LANES,
            no_pdl: false,
            indexer: "auto".into(),
        }
        .config()
        .unwrap()
    }

    fn cuda_bytes(cfg: &ModelConfig) -> WeightBytes {
        weight_bytes(cfg, |n, r, c| {
            let reduced = weight_use(n, r, c) == pdserve_engine::backend::WeightUse::Matrix;
            cuda_tensor_bytes(cfg, n, (r, c), reduced)
        })
    }

    /// The floor counts stored bytes: an FP4 expert (3 x 2048 x 4096 values) is a quarter
    /// of its bf16 size plus one scale byte per 32 values; FP8 experts half plus one per
    /// 128x128 block.
    #[test]
    fn stored_formats_shrink_the_expert_bytes_by_their_width() {
        let bf16 = cuda_bytes(&flash("bf16"));
        let fp8 = cuda_bytes(&flash("fp8"));
        let fp4 = cuda_bytes(&flash("fp8-fp4"));
        let values = 3 * 2048 * 4096u64;
        assert_eq!(bf16.expert_per_layer[3], 2 * values);
        assert_eq!(fp8.expert_per_layer[3], values + values / (128 * 128));
        assert_eq!(fp4.expert_per_layer[3], values / 2 + values / 32);
        // Attention and shared-expert matrices are FP8 in both quantized formats; the
        // embedding and head stay bf16.
        assert_eq!(fp8.dense_per_layer, fp4.dense_per_layer);
        assert!(fp8.dense_per_layer[2] < bf16.dense_per_layer[2] * 6 / 10);
        assert_eq!(fp8.head, bf16.head);
    }
}
