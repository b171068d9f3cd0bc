//! How a backend runs a decode step: once, or padded and replayed from a captured graph.

use super::{BResult, BatchPlan, HostTensor, KvStorage, TensorOps};

/// One step's forward pass as a backend runs it: `(backend, kv, plan)` -> the logits of
/// every row of `plan`, in row order, still on the device.
pub type StepForward<'a, B> = dyn FnMut(&B, &mut <B as KvStorage>::KvStore, &BatchPlan) -> BResult<<B as TensorOps>::Tensor>
    + 'a;

pub trait StepRunner: TensorOps {
    /// Run one decode step: every sequence of `plan` has exactly one new row, and
    /// `forward` returns the logits of every row. A backend may pad the batch and replay a
    /// captured graph (the CUDA backend does); the default runs `forward` once.
    fn decode_step(
        &self,
        kv: &mut Self::KvStore,
        plan: &BatchPlan,
        forward: &mut StepForward<'_, Self>,
    ) -> BResult<HostTensor>
    where
        Self: Sized,
    {
        let logits = forward(self, kv, plan)?;
        self.to_host(&logits)
    }
}
