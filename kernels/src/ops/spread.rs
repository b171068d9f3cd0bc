//! The device's side streams ([`crate::lanes`]) as the ops use them: made at first use with
//! [`Gpu::expert_lanes`] lanes, refused inside decode steps, and [`Gpu::spread`] to queue
//! independent pieces of work (a prefill's per-expert GEMMs) over them.

use crate::device::Gpu;
use crate::lanes::{Lane, Lanes};
use crate::launch::dev_err;
use pdserve_engine::backend::BResult;
use std::sync::MutexGuard;

impl Gpu {
    /// The [`Gpu::expert_lanes`] side streams (made now if not yet), outside decode steps.
    fn lanes(&self) -> BResult<MutexGuard<'_, Option<Lanes>>> {
        if self.in_step() {
            return Err(dev_err("side streams asked for inside a decode step"));
        }
        let mut lanes = self
            .lanes
            .lock()
            .map_err(|_| dev_err("side streams poisoned by a panic"))?;
        if lanes.as_ref().map(Lanes::len) != Some(self.expert_lanes.max(1)) {
            // Work queued on lanes about to go may still use their workspaces.
            self.ctx.synchronize().map_err(dev_err)?;
            *lanes = None;
            *lanes = Some(Lanes::new(&self.ctx, &self.stream, self.expert_lanes)?);
        }
        Ok(lanes)
    }

    /// Queue `items` independent pieces of work: `queue(lane, slot, i)` queues item `i`,
    /// on `lane` (round-robin over the side streams, `slot` its index; see
    /// [`Lanes::spread`]) or with `None` (and slot 0) on the device's stream itself where
    /// one lane is asked for or there is one item.
    pub(crate) fn spread(
        &self,
        items: usize,
        mut queue: impl FnMut(Option<&Lane>, usize, usize) -> BResult<()>,
    ) -> BResult<()> {
        if self.expert_lanes <= 1 || items <= 1 {
            return (0..items).try_for_each(|i| queue(None, 0, i));
        }
        let guard = self.lanes()?;
        let Some(lanes) = guard.as_ref() else {
            return Err(dev_err("side streams missing after they were made"));
        };
        lanes.spread(&self.stream, items, queue)
    }
}
