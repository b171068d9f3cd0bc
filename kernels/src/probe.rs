//! The device ceilings a benchmark compares against, measured on this device in the
//! same run: memory bandwidth (a large device-to-device copy, and a read-only kernel) and
//! the bf16 GEMM rate (cuBLAS, as the backend's matmul calls it) and the FP8 one
//! (cuBLASLt, block-scaled as DeepSeek's FP8 weights are). Inputs are random,
//! never zeros; every figure is the median of several runs timed with CUDA events after
//! a warm-up run.

use crate::backend::CudaBackend;
use crate::blas_fp8::{scale_counts, Fp8Gemm, Fp8Scaling};
use crate::kernels::{self, DevPtr};
use crate::launch::{dev_err, BLOCK};
use crate::ops::random::random_tensor;
use crate::tensor::Buf;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;
use pdserve_engine::backend::{BResult, BackendError, WeightInit};

/// Measured memory bandwidth, bytes per second.
#[derive(Debug, Clone, Copy)]
pub struct Bandwidth {
    /// Device-to-device copy: bytes read plus bytes written over the time.
    pub copy: f64,
    /// Read-only probe kernel: bytes read over the time.
    pub read: f64,
    /// Bytes of the buffer measured.
    pub bytes: usize,
}

fn median(mut v: Vec<f64>) -> BResult<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2)
        .copied()
        .ok_or_else(|| BackendError::Device("no timed runs".into()))
}

const INIT: WeightInit = WeightInit::Uniform { lo: -1.0, hi: 1.0 };

impl CudaBackend {
    fn event(&self) -> BResult<CudaEvent> {
        self.gpu
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(dev_err)
    }

    /// Seconds of each of `iters` runs of `f` (after one warm-up run), timed with events.
    fn time_runs(&self, iters: usize, mut f: impl FnMut() -> BResult<()>) -> BResult<Vec<f64>> {
        f()?;
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters.max(1) {
            let (a, b) = (self.event()?, self.event()?);
            a.record(&self.gpu.stream).map_err(dev_err)?;
            f()?;
            b.record(&self.gpu.stream).map_err(dev_err)?;
            out.push(f64::from(a.elapsed_ms(&b).map_err(dev_err)?) / 1e3);
        }
        Ok(out)
    }

    /// Memory bandwidth over a `bytes`-byte buffer (use one far larger than the L2 cache).
    pub fn measure_bandwidth(&self, bytes: usize, iters: usize) -> BResult<Bandwidth> {
        let n = (bytes / 16).max(1) * 4;
        let src = random_tensor(&self.gpu, 1, n, false, INIT, 1)?;
        let Buf::F32(src) = &src.buf else {
            return Err(dev_err("random f32 buffer"));
        };
        let dst = self.gpu.zeros_owned::<f32>(n)?;
        let (sp, dp) = (src.ptr(), dst.ptr());
        let copy = self.time_runs(iters, || self.gpu.copy_dtod(dp, sp, n * 4))?;
        let blocks = (n / 4).div_ceil(BLOCK as usize).clamp(1, 16 * 1024);
        let sums = self.gpu.zeros_owned::<f32>(blocks)?;
        let read = self.time_runs(iters, || {
            self.gpu.launch(
                (blocks as u32, 1, 1),
                0,
                &kernels::ReadProbe {
                    x: DevPtr::of(src),
                    n4: (n / 4) as i64,
                    out: DevPtr::of(&sums),
                },
            )
        })?;
        let b = (n * 4) as f64;
        Ok(Bandwidth {
            copy: 2.0 * b / median(copy)?,
            read: b / median(read)?,
            bytes: n * 4,
        })
    }

    /// FLOP/s of an `n x n x n` bf16 x bf16 -> fp32 cuBLAS GEMM (fp32 accumulation).
    pub fn measure_gemm_bf16(&self, n: usize, iters: usize) -> BResult<f64> {
        let a = random_tensor(&self.gpu, n, n, true, INIT, 2)?;
        let w = random_tensor(&self.gpu, n, n, true, INIT, 3)?;
        let (Buf::Bf16(a), Buf::Bf16(w)) = (&a.buf, &w.buf) else {
            return Err(dev_err("random bf16 buffers"));
        };
        let c = self.gpu.zeros_owned::<f32>(n * n)?;
        let (ap, wp, cp) = (a.ptr(), w.ptr(), c.ptr());
        let runs = self.time_runs(iters, || {
            self.gpu
                .gemm_nt(ap, wp, cp, (n, n, n), (n, n, n), (0, 0, 0), 1, true)
        })?;
        Ok(2.0 * (n as f64).powi(3) / median(runs)?)
    }

    /// FLOP/s of an `n x n x n` FP8 (e4m3) cuBLASLt GEMM, bf16 out, fp32 accumulation,
    /// with DeepSeek's block scales where the library has them; and which scaling ran.
    /// The operands are random e4m3 values (no NaN), the scales random too.
    /// (Where block scaling was refused, why.)
    pub fn measure_gemm_fp8(
        &self,
        n: usize,
        iters: usize,
    ) -> BResult<(f64, Fp8Scaling, Option<String>)> {
        let n = n.div_ceil(128) * 128;
        let gemm = Fp8Gemm::new(&self.gpu, (n, n, n))?;
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        // e4m3 bytes with the exponent's top bit clear (|v| < 2, never NaN).
        let fp8 = |next: &mut dyn FnMut() -> u64| -> Vec<u8> {
            (0..n * n).map(|_| (next() as u8) & 0xBF).collect()
        };
        let (x, w) = (fp8(&mut next), fp8(&mut next));
        let (ws, xs) = scale_counts((n, n, n), gemm.scaling);
        let scales = |count: usize, next: &mut dyn FnMut() -> u64| -> Vec<f32> {
            (0..count)
                .map(|_| 1e-3 * (1.0 + (next() % 1000) as f32 / 1000.0))
                .collect()
        };
        let (w_s, x_s) = (scales(ws, &mut next), scales(xs, &mut next));
        let (x, w) = (self.gpu.upload(&x)?, self.gpu.upload(&w)?);
        let (x_s, w_s) = (self.gpu.upload(&x_s)?, self.gpu.upload(&w_s)?);
        let out = self.gpu.zeros_owned::<u16>(n * n)?;
        let runs = self.time_runs(iters, || {
            gemm.run(&self.gpu, x.ptr(), x_s.ptr(), w.ptr(), w_s.ptr(), out.ptr())
        })?;
        let rate = 2.0 * (n as f64).powi(3) / median(runs)?;
        Ok((rate, gemm.scaling, gemm.block_refused.clone()))
    }

    /// Wait for all queued work on the backend's stream.
    pub fn synchronize(&self) -> BResult<()> {
        self.gpu.synchronize()
    }
}
