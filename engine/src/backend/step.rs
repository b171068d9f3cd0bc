//! How a backend runs a decode step: once, or padded and replayed from a captured graph;
//! and what the step sends back per row: logits, the greedy token, or both.

use super::{BResult, BackendError, BatchPlan, HostTensor, KvStorage, TensorOps};
use crate::sampling;

/// One step's forward pass as a backend runs it: `(backend, kv, plan)` -> the logits of
/// every row of `plan`, in row order, still on the device.
pub type StepForward<'a, B> = dyn FnMut(&B, &mut <B as KvStorage>::KvStore, &BatchPlan) -> BResult<<B as TensorOps>::Tensor>
    + 'a;

/// What one row of a decode step sends back to the host. A row that only needs its
/// greedy token asks for `argmax` alone: a device backend then copies one id back instead
/// of a `vocab`-long logits row (66 MB per step at batch 128 and V4's vocabulary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowOut {
    /// The row's logits.
    pub logits: bool,
    /// The row's [`RowArgmax`].
    pub argmax: bool,
}

impl RowOut {
    /// Logits only: the host samples (temperature, penalties, logprobs, grammars).
    pub const LOGITS: RowOut = RowOut {
        logits: true,
        argmax: false,
    };
    /// The greedy token only.
    pub const ARGMAX: RowOut = RowOut {
        logits: false,
        argmax: true,
    };
    /// Both, from the same step (checks of the device argmax against the host's).
    pub const BOTH: RowOut = RowOut {
        logits: true,
        argmax: true,
    };
}

/// A row's greedy token, computed where its logits are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowArgmax {
    /// [`sampling::argmax`] of the row, bit for bit the same rule on every backend: the
    /// highest logit, ties to the lowest id, NaN and -inf never win; `None` when no logit
    /// can be sampled.
    pub token: Option<u32>,
    /// Every logit of the row is finite (no NaN, no +-inf).
    pub finite: bool,
}

impl RowArgmax {
    /// The reference: what a device kernel must return for `row`.
    pub fn of(row: &[f32]) -> RowArgmax {
        RowArgmax {
            token: sampling::argmax(row),
            finite: row.iter().all(|v| v.is_finite()),
        }
    }
}

/// What a decode step returns: the rows that asked for logits, and the greedy tokens of
/// the rows that asked for them.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// `[rows asking for logits, vocab]`, in row order.
    pub logits: HostTensor,
    /// One entry per row of the plan: `Some` where the row asked for its argmax.
    pub argmax: Vec<Option<RowArgmax>>,
}

impl StepOutput {
    /// The output `outs` asks for, from every row's logits on the host (`all`: `[rows,
    /// vocab]`): what a backend without device sampling returns.
    pub fn from_host(all: &HostTensor, outs: &[RowOut]) -> BResult<StepOutput> {
        check_outs(all.rows, outs)?;
        let cols = all.cols;
        let row = |r: usize| &all.data[r * cols..(r + 1) * cols];
        let mut data = Vec::with_capacity(outs.iter().filter(|o| o.logits).count() * cols);
        for (r, o) in outs.iter().enumerate() {
            if o.logits {
                data.extend_from_slice(row(r));
            }
        }
        Ok(StepOutput {
            logits: HostTensor {
                rows: data.len() / cols.max(1),
                cols,
                data,
            },
            argmax: outs
                .iter()
                .enumerate()
                .map(|(r, o)| o.argmax.then(|| RowArgmax::of(row(r))))
                .collect(),
        })
    }
}

/// `outs` must name one output per row of the step.
pub fn check_outs(rows: usize, outs: &[RowOut]) -> BResult<()> {
    if outs.len() != rows {
        return Err(BackendError::Shape {
            op: "decode_step",
            detail: format!("{} row outputs for {rows} rows", outs.len()),
        });
    }
    Ok(())
}

pub trait StepRunner: TensorOps {
    /// Run one decode step: every sequence of `plan` has exactly one new row, `forward`
    /// returns the logits of every row, and row `r` sends back what `outs[r]` asks for. A
    /// backend may pad the batch and replay a captured graph, and compute the argmax on
    /// the device (the CUDA backend does both); the default runs `forward` once and takes
    /// the argmax on the host.
    fn decode_step(
        &self,
        kv: &mut Self::KvStore,
        plan: &BatchPlan,
        outs: &[RowOut],
        forward: &mut StepForward<'_, Self>,
    ) -> BResult<StepOutput>
    where
        Self: Sized,
    {
        check_outs(plan.rows(), outs)?;
        let logits = forward(self, kv, plan)?;
        StepOutput::from_host(&self.to_host(&logits)?, outs)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn host_output_keeps_the_asked_rows_and_argmaxes() {
        let nan = f32::NAN;
        let all = HostTensor {
            rows: 3,
            cols: 3,
            data: vec![
                1.0,
                5.0,
                5.0,
                nan,
                f32::NEG_INFINITY,
                nan,
                -1.0,
                f32::INFINITY,
                2.0,
            ],
        };
        let outs = [RowOut::BOTH, RowOut::ARGMAX, RowOut::LOGITS];
        let o = StepOutput::from_host(&all, &outs).unwrap();
        assert_eq!((o.logits.rows, o.logits.cols), (2, 3));
        assert_eq!(o.logits.data[..3], [1.0, 5.0, 5.0]);
        assert_eq!(o.logits.data[4], f32::INFINITY);
        assert_eq!(
            o.argmax,
            vec![
                Some(RowArgmax {
                    token: Some(1),
                    finite: true
                }),
                Some(RowArgmax {
                    token: None,
                    finite: false
                }),
                None,
            ]
        );
        assert!(StepOutput::from_host(&all, &outs[..2]).is_err());
    }
}
