//! Side streams ("lanes") for independent GEMMs of one prefill op: the routed experts'
//! per-expert GEMMs (block-scaled FP8 or bf16), each too small to fill the device alone
//! (~770 rows of an 8K prefill's 64 experts: fewer output tiles than SMs, or a partial
//! last wave). Each lane is a stream with its own cuBLASLt workspace and cuBLAS handle;
//! [`Lanes::spread`] makes every lane wait for the work queued on the device's stream so
//! far, queues the items round-robin, and makes the device's stream wait for every lane's
//! work. Between them, GEMMs queued on different lanes share
//! the SMs; each runs the same algorithm on the same operands as it would on the device's
//! stream, so the results are the same bits.
//!
//! Outside decode steps only (a captured step stays on one stream). Buffers the lanes
//! read or write are allocated on the device's stream before the fork and freed on it
//! after the join, so the stream-ordered allocator never hands them out while a lane may
//! still touch them.

use crate::blas::{Blas, WORKSPACE};
use crate::devmem::DevMem;
use crate::launch::dev_err;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use pdserve_engine::backend::BResult;
use std::sync::Arc;

/// The lanes the routed experts' GEMMs use unless told otherwise
/// ([`crate::CudaBackend::set_expert_lanes`]); each lane holds a [`WORKSPACE`].
pub const DEFAULT_LANES: usize = 4;

/// One side stream, its cuBLASLt workspace, a cuBLAS handle on it (with its own
/// workspace) and the event [`Lanes::join`] records on it.
pub(crate) struct Lane {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) workspace: DevMem<u8>,
    pub(crate) blas: Blas,
    done: CudaEvent,
}

/// A fixed set of lanes and the event that forks them from the device's stream.
pub(crate) struct Lanes {
    lanes: Vec<Lane>,
    forked: CudaEvent,
}

impl Lanes {
    /// `count` lanes (at least one), their workspaces allocated (zeroed) on `main`.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        main: &Arc<CudaStream>,
        count: usize,
    ) -> BResult<Self> {
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| dev_err(format!("creating a lane event: {e:?}")))
        };
        let mut lanes = Vec::with_capacity(count.max(1));
        for _ in 0..count.max(1) {
            let stream = ctx
                .new_stream()
                .map_err(|e| dev_err(format!("creating a lane stream: {e:?}")))?;
            let ws = main.alloc_zeros::<u8>(WORKSPACE).map_err(dev_err)?;
            let blas = Blas::new(&stream).map_err(dev_err)?;
            lanes.push(Lane {
                stream,
                workspace: DevMem::owned(ws, main, WORKSPACE),
                blas,
                done: event()?,
            });
        }
        // The cuBLASLt workspaces' zeroing is queued on `main`: every later fork waits for
        // it (each cuBLAS workspace is zeroed on its own lane's stream).
        Ok(Lanes {
            lanes,
            forked: event()?,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.lanes.len()
    }

    /// Lane `i` modulo the count: work item `i` of a round-robin.
    fn lane(&self, i: usize) -> &Lane {
        &self.lanes[i % self.lanes.len()]
    }

    /// Every lane waits for what `main` has queued so far.
    fn fork(&self, main: &CudaStream) -> BResult<()> {
        self.forked
            .record(main)
            .map_err(|e| dev_err(format!("recording the lanes' fork: {e:?}")))?;
        for lane in &self.lanes {
            lane.stream
                .wait(&self.forked)
                .map_err(|e| dev_err(format!("a lane waiting for its fork: {e:?}")))?;
        }
        Ok(())
    }

    /// Queue `items` independent pieces of work round-robin: `queue(lane, slot, i)`
    /// queues item `i` on lane `slot`, between a fork from `main` and a join back to it.
    /// The join is queued even when an item fails, so `main` never frees a buffer a lane
    /// may still use; the first failure is returned.
    pub(crate) fn spread(
        &self,
        main: &CudaStream,
        items: usize,
        mut queue: impl FnMut(Option<&Lane>, usize, usize) -> BResult<()>,
    ) -> BResult<()> {
        self.fork(main)?;
        let queued = (0..items).try_for_each(|i| queue(Some(self.lane(i)), i % self.len(), i));
        self.join(main)?;
        queued
    }

    /// `main` waits for what every lane has queued so far.
    fn join(&self, main: &CudaStream) -> BResult<()> {
        for lane in &self.lanes {
            lane.done
                .record(&lane.stream)
                .map_err(|e| dev_err(format!("recording a lane's join: {e:?}")))?;
            main.wait(&lane.done)
                .map_err(|e| dev_err(format!("waiting for a lane: {e:?}")))?;
        }
        Ok(())
    }
}
