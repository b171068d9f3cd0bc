//! Where a decode step's buffers live: every temporary in one arena and every host upload
//! in one staging buffer, both at fixed device addresses so that a captured graph can
//! replay them. Outside a step, buffers are allocated one by one (see `Gpu::zeros`).

use crate::launch::dev_err;
use crate::recorder::StepRecord;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use pdserve_engine::backend::{BResult, BackendError};
use std::sync::Arc;

/// Alignment of every arena and staging allocation.
const ALIGN: usize = 256;

/// A fixed device buffer handed out by bumping an offset.
#[derive(Debug, Default)]
struct Region {
    _buf: Option<CudaSlice<u8>>,
    base: u64,
    cap: usize,
    used: usize,
}

impl Region {
    /// Offset of a new `bytes`-byte allocation; past `cap` only in a dry pass, which
    /// measures the size the step needs.
    fn bump(&mut self, bytes: usize, may_overflow: bool) -> BResult<u64> {
        let off = self.used.next_multiple_of(ALIGN);
        let end = off + bytes.max(1);
        if end > self.cap && !may_overflow {
            return Err(BackendError::Device(format!(
                "decode step needs more than the {} bytes sized by its dry pass",
                self.cap
            )));
        }
        self.used = end;
        Ok(self.base + off as u64)
    }

    /// Grow to at least `need` bytes (with headroom); returns whether it moved.
    fn ensure(&mut self, stream: &Arc<CudaStream>, need: usize) -> BResult<bool> {
        if need <= self.cap {
            return Ok(false);
        }
        let cap = (need + need / 4).next_multiple_of(1 << 20);
        self._buf = None;
        let buf = stream.alloc_zeros::<u8>(cap).map_err(dev_err)?;
        self.base = {
            let (base, _sync) = buf.device_ptr(stream);
            base
        };
        self._buf = Some(buf);
        self.cap = cap;
        Ok(true)
    }
}

/// The step arena (temporaries) and staging buffer (uploads).
#[derive(Debug, Default)]
pub(crate) struct StepArena {
    arena: Region,
    staging: Region,
}

impl StepArena {
    /// Start a step: both buffers are handed out from their start again.
    pub fn reset(&mut self) {
        self.arena.used = 0;
        self.staging.used = 0;
    }

    /// Device address of a new `bytes`-byte temporary (`dry`: the pass that measures).
    pub fn temp(&mut self, bytes: usize, dry: bool) -> BResult<u64> {
        self.arena.bump(bytes, dry)
    }

    /// Device address of `len` new staged bytes, and their offset in the staging buffer.
    pub fn stage(&mut self, len: usize, dry: bool) -> BResult<(u64, usize)> {
        let ptr = self.staging.bump(len, dry)?;
        Ok((ptr, (ptr - self.staging.base) as usize))
    }

    /// Bytes of arena the current step used so far.
    pub fn arena_used(&self) -> usize {
        self.arena.used
    }

    /// Make both buffers hold a step that needs `rec`; returns whether either moved (every
    /// graph captured over the old addresses is then stale).
    pub fn ensure(&mut self, stream: &Arc<CudaStream>, rec: &StepRecord) -> BResult<bool> {
        let a = self.arena.ensure(stream, rec.arena_bytes)?;
        let s = self.staging.ensure(stream, rec.staged.len())?;
        Ok(a || s)
    }

    pub fn staging_base(&self) -> u64 {
        self.staging.base
    }
}
