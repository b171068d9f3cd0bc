//! What the bench needs from a backend beyond [`Backend`]: weight storage sizes, a way to
//! wait for queued work, the two ceilings measured in the same run, and graph mode.

use super::stats::median;
use anyhow::{anyhow, Result};
use pdserve_engine::backend::{counter_rng, BResult, Backend, TensorOps, WeightInit, WeightUse};
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
    /// Bytes per value of a weight the model uses as `usage`, as this backend stores it.
    fn weight_elem_bytes(&self, usage: WeightUse) -> usize;
    /// Wait until every queued operation has finished.
    fn sync(&self) -> BResult<()>;
    /// Memory bandwidth (bytes/s) measured now: the decode floor's denominator.
    fn memory_bandwidth(&self) -> Result<Ceiling>;
    /// Dense GEMM rate (FLOP/s) measured now: the prefill ceiling.
    fn gemm_rate(&self) -> Result<Ceiling>;
    /// Run decode steps in `mode`; returns the label the table shows for it.
    fn apply_graph_mode(&mut self, mode: GraphMode) -> String;
}

impl BenchBackend for CpuBackend {
    fn weight_elem_bytes(&self, _: WeightUse) -> usize {
        4
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

    fn apply_graph_mode(&mut self, mode: GraphMode) -> String {
        match mode {
            GraphMode::Eager => "eager".into(),
            GraphMode::Capture => "eager (cpu has no graphs)".into(),
        }
    }
}

/// THE one place the bench switches the CUDA backend's decode graph mode; returns the
/// label of rows run in `mode`.
pub fn set_graph_mode(backend: &mut CudaBackend, mode: GraphMode) -> String {
    backend.set_graph_mode(mode);
    mode.to_string()
}

impl BenchBackend for CudaBackend {
    fn weight_elem_bytes(&self, usage: WeightUse) -> usize {
        if self.weight_is_bf16(usage) {
            2
        } else {
            4
        }
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

    fn apply_graph_mode(&mut self, mode: GraphMode) -> String {
        set_graph_mode(self, mode)
    }
}
