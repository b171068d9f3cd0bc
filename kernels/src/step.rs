//! The decode-step recorder. Inside a decode step every temporary buffer comes from one
//! arena and every host upload from one staging buffer, both at fixed device addresses;
//! every launch and GEMM is appended to a signature (kernel, grid, arguments, sizes; not
//! the staged data). Two steps with equal signatures run exactly the same work on
//! different staged data, which is what makes replaying a captured graph correct: the
//! backend replays a graph only for the signature it was captured with.

use crate::launch::{dev_err, Arg};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use pdserve_engine::backend::{BResult, BackendError};

/// Alignment of every arena and staging allocation.
const ALIGN: usize = 256;

/// What the launches of the current step do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepMode {
    /// No step: buffers are allocated one by one, uploads are immediate.
    Off,
    /// Host pass only: record the signature and staged data, launch nothing.
    Dry,
    /// Launch each kernel as the host code reaches it.
    Eager,
    /// The stream is capturing: launches become graph nodes, uploads are staged only.
    Capture,
}

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
    fn ensure(&mut self, stream: &std::sync::Arc<CudaStream>, need: usize) -> BResult<bool> {
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

/// Everything one step recorded.
#[derive(Debug, Default)]
pub(crate) struct StepRecord {
    pub signature: Vec<u8>,
    /// Bytes to copy to the start of the staging buffer before the step runs.
    pub staged: Vec<u8>,
    pub arena_bytes: usize,
}

#[derive(Debug)]
pub(crate) struct StepState {
    pub mode: StepMode,
    arena: Region,
    staging: Region,
    rec: StepRecord,
}

impl Default for StepState {
    fn default() -> Self {
        StepState {
            mode: StepMode::Off,
            arena: Region::default(),
            staging: Region::default(),
            rec: StepRecord::default(),
        }
    }
}

impl StepState {
    pub fn begin(&mut self, mode: StepMode) {
        self.mode = mode;
        self.arena.used = 0;
        self.staging.used = 0;
        self.rec = StepRecord::default();
    }

    pub fn end(&mut self) -> StepRecord {
        self.mode = StepMode::Off;
        let mut rec = std::mem::take(&mut self.rec);
        rec.arena_bytes = self.arena.used;
        rec
    }

    /// Make both buffers hold a step that needs `rec`; returns whether either moved (every
    /// graph captured over the old addresses is then stale).
    pub fn ensure(
        &mut self,
        stream: &std::sync::Arc<CudaStream>,
        rec: &StepRecord,
    ) -> BResult<bool> {
        let a = self.arena.ensure(stream, rec.arena_bytes)?;
        let s = self.staging.ensure(stream, rec.staged.len())?;
        Ok(a || s)
    }

    pub fn staging_base(&self) -> u64 {
        self.staging.base
    }

    /// A zero-filled temporary of `bytes` bytes; returns its device address.
    pub fn alloc(&mut self, bytes: usize) -> BResult<u64> {
        let dry = self.mode == StepMode::Dry;
        let ptr = self.arena.bump(bytes, dry)?;
        self.sign(b'Z', &[ptr, bytes as u64]);
        Ok(ptr)
    }

    /// Stage `bytes` for upload; returns the device address they will have and their
    /// offset in the staged data.
    pub fn stage(&mut self, bytes: &[u8]) -> BResult<(u64, usize)> {
        let dry = self.mode == StepMode::Dry;
        let ptr = self.staging.bump(bytes.len(), dry)?;
        let off = (ptr - self.staging.base) as usize;
        self.rec.staged.resize(off, 0);
        self.rec.staged.extend_from_slice(bytes);
        self.sign(b'U', &[ptr, bytes.len() as u64]);
        Ok((ptr, off))
    }

    pub fn staged(&self) -> &[u8] {
        &self.rec.staged
    }

    pub fn sign_launch(&mut self, name: &str, grid: (u32, u32, u32), shared: u32, args: &[Arg]) {
        let sig = &mut self.rec.signature;
        sig.push(b'K');
        sig.extend_from_slice(name.as_bytes());
        sig.push(0);
        for v in [grid.0, grid.1, grid.2, shared] {
            sig.extend_from_slice(&v.to_le_bytes());
        }
        for a in args {
            match a {
                Arg::Ptr(v) => sig.extend_from_slice(&v.to_le_bytes()),
                Arg::I64(v) => sig.extend_from_slice(&v.to_le_bytes()),
                Arg::I32(v) => sig.extend_from_slice(&v.to_le_bytes()),
                Arg::F32(v) => sig.extend_from_slice(&v.to_bits().to_le_bytes()),
            }
        }
    }

    pub fn sign(&mut self, tag: u8, words: &[u64]) {
        self.rec.signature.push(tag);
        for w in words {
            self.rec.signature.extend_from_slice(&w.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn dry_step(values: &[u8], rows: u32) -> StepRecord {
        let mut st = StepState::default();
        st.begin(StepMode::Dry);
        let a = st.alloc(10).unwrap();
        let b = st.alloc(300).unwrap();
        assert_eq!((a, b), (0, 256), "arena allocations are 256-byte aligned");
        let (p1, o1) = st.stage(values).unwrap();
        let (p2, o2) = st.stage(&[9, 9]).unwrap();
        assert_eq!((p1, o1), (0, 0));
        assert_eq!((p2, o2), (256, 256));
        st.sign_launch(
            "k",
            (rows, 1, 1),
            0,
            &[Arg::Ptr(b), Arg::I32(3), Arg::F32(0.5)],
        );
        let rec = st.end();
        assert_eq!(st.mode, StepMode::Off);
        assert_eq!(rec.arena_bytes, 556);
        assert_eq!(&rec.staged[..values.len()], values);
        assert_eq!(&rec.staged[256..], &[9, 9]);
        rec
    }

    #[test]
    fn signature_depends_on_launches_not_on_staged_values() {
        let a = dry_step(&[1, 2, 3], 4);
        let b = dry_step(&[7, 7, 7], 4);
        let c = dry_step(&[1, 2, 3], 5);
        assert_eq!(a.signature, b.signature);
        assert_ne!(a.staged, b.staged);
        assert_ne!(a.signature, c.signature);
    }

    #[test]
    fn only_a_dry_pass_may_outgrow_the_buffers() {
        let mut st = StepState::default();
        st.begin(StepMode::Eager);
        let err = st.alloc(16).unwrap_err().to_string();
        assert!(err.contains("sized by its dry pass"), "{err}");
        st.begin(StepMode::Capture);
        assert!(st.stage(&[1]).is_err());
    }
}
