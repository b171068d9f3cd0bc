//! What a CUDA decode step sends back: the logits rows that asked for them, and, for the
//! rows that asked for their greedy token, the id from `k_argmax_rows`, launched inside
//! the step (so captured into its graph) right after the LM head. Only the asked rows and
//! ids cross to the host: at batch 128 and V4's vocabulary the full logits are 66 MB.

use crate::backend::CudaBackend;
use crate::buf::f32_buf;
use crate::devmem::DevMem;
use crate::ops::sample::{argmax_rows, row_argmax};
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{BResult, BackendError, HostTensor, RowArgmax, RowOut, StepOutput};
use std::time::Instant;

/// A decode step's outputs on the device: step-arena addresses, the same on every replay
/// of its graph.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceOut {
    logits: u64,
    /// Rows of the padded step.
    rows: usize,
    cols: usize,
    /// `k_argmax_rows`'s output over all `rows`, when some row asked for its argmax.
    argmax: Option<u64>,
}

/// Inside a decode step, after its forward returned `logits`: launch what `outs` needs.
pub(crate) fn launch(b: &CudaBackend, logits: &GpuTensor, outs: &[RowOut]) -> BResult<DeviceOut> {
    let argmax = match outs.iter().any(|o| o.argmax) {
        true => Some(argmax_rows(&b.gpu, logits)?.ptr()),
        false => None,
    };
    Ok(DeviceOut {
        logits: f32_buf(logits, "decode_step")?.ptr(),
        rows: logits.rows,
        cols: logits.cols,
        argmax,
    })
}

/// After the step was submitted: wait for it, then copy back what `outs` (one per real
/// row, the first `outs.len()` rows of the padded step) asks for.
pub(crate) fn fetch(b: &CudaBackend, out: DeviceOut, outs: &[RowOut]) -> BResult<StepOutput> {
    let t0 = Instant::now();
    b.gpu.synchronize()?;
    let t1 = Instant::now();
    let cols = out.cols;
    // Runs of consecutive rows that want logits, one copy each; a single run (every row,
    // the usual case) is returned as copied, without a second pass over tens of MB.
    let mut runs: Vec<Vec<f32>> = Vec::new();
    let mut r = 0;
    while r < outs.len() {
        let first = r;
        while r < outs.len() && outs[r].logits {
            r += 1;
        }
        if r > first {
            let n = (r - first) * cols;
            let at = out.logits + (first * cols * std::mem::size_of::<f32>()) as u64;
            runs.push(b.gpu.download(&DevMem::<f32>::view(at, n), n)?);
        } else {
            r += 1;
        }
    }
    let data = match runs.len() {
        1 => runs.pop().unwrap_or_default(),
        _ => runs.concat(),
    };
    let raw = match out.argmax {
        Some(ptr) => b
            .gpu
            .download(&DevMem::<i32>::view(ptr, 2 * out.rows), 2 * out.rows)?,
        None => Vec::new(),
    };
    if outs.len() > out.rows || (outs.iter().any(|o| o.argmax) && raw.len() != 2 * out.rows) {
        return Err(BackendError::Device(format!(
            "decode step outputs: {} rows asked of a {}-row step, argmax {}",
            outs.len(),
            out.rows,
            if raw.is_empty() {
                "not launched"
            } else {
                "launched"
            }
        )));
    }
    let argmax = outs
        .iter()
        .enumerate()
        .map(|(i, o)| o.argmax.then(|| row_argmax(&raw, out.rows, i)))
        .collect();
    let mut c = b.graph_cache()?;
    c.phases.wait += (t1 - t0).as_secs_f64();
    c.phases.copy += t1.elapsed().as_secs_f64();
    drop(c);
    Ok(StepOutput {
        logits: HostTensor {
            rows: data.len() / cols.max(1),
            cols,
            data,
        },
        argmax,
    })
}

impl CudaBackend {
    /// The device argmax (`k_argmax_rows`, the kernel decode steps run) of every row of
    /// `logits`, uploaded as fp32: for checks against [`RowArgmax::of`] on chosen rows
    /// (ties, NaN, infinities) outside a decode step.
    pub fn argmax_rows(&self, logits: HostTensor) -> BResult<Vec<RowArgmax>> {
        let rows = logits.rows;
        let t = crate::ops::tensors::upload(&self.gpu, logits, false)?;
        let raw = argmax_rows(&self.gpu, &t)?;
        let raw = self.gpu.download(&raw, 2 * rows)?;
        Ok((0..rows).map(|r| row_argmax(&raw, rows, r)).collect())
    }
}
