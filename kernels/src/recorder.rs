//! The decode-step recorder: what a step does. Every launch and GEMM of a step is appended
//! to a signature (kernel, grid, arguments, sizes; not the staged data), and every host
//! upload to the staged data. Two steps with equal signatures run exactly the same work on
//! different staged data, which is what makes replaying a captured graph correct: the
//! backend replays a graph only for the signature it was captured with.

use crate::launch::Arg;

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

/// Everything one step recorded.
#[derive(Debug, Default)]
pub(crate) struct StepRecord {
    pub signature: Vec<u8>,
    /// Bytes to copy to the start of the staging buffer before the step runs.
    pub staged: Vec<u8>,
    pub arena_bytes: usize,
}

/// The current step's mode and record.
#[derive(Debug)]
pub(crate) struct Recorder {
    mode: StepMode,
    rec: StepRecord,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            mode: StepMode::Off,
            rec: StepRecord::default(),
        }
    }
}

impl Recorder {
    pub fn begin(&mut self, mode: StepMode) {
        self.mode = mode;
        self.rec = StepRecord::default();
    }

    /// Stop recording; the record of a step whose arena use reached `arena_bytes`.
    pub fn end(&mut self, arena_bytes: usize) -> StepRecord {
        self.mode = StepMode::Off;
        let mut rec = std::mem::take(&mut self.rec);
        rec.arena_bytes = arena_bytes;
        rec
    }

    pub fn mode(&self) -> StepMode {
        self.mode
    }

    /// Whether a step is being recorded.
    pub fn active(&self) -> bool {
        self.mode != StepMode::Off
    }

    /// Record a kernel launch (inside a step); returns whether to submit it now: always,
    /// except in a dry pass.
    pub fn launch(&mut self, name: &str, grid: (u32, u32, u32), shared: u32, args: &[Arg]) -> bool {
        if self.active() {
            self.sign_launch(name, grid, shared, args);
        }
        self.mode != StepMode::Dry
    }

    /// Record a GEMM by its `words` (inside a step); returns whether to submit it now.
    pub fn gemm(&mut self, words: &[u64]) -> bool {
        if self.active() {
            self.sign(b'G', words);
        }
        self.mode != StepMode::Dry
    }

    fn sign_launch(&mut self, name: &str, grid: (u32, u32, u32), shared: u32, args: &[Arg]) {
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

    /// Append `tag` and `words` to the signature.
    pub fn sign(&mut self, tag: u8, words: &[u64]) {
        self.rec.signature.push(tag);
        for w in words {
            self.rec.signature.extend_from_slice(&w.to_le_bytes());
        }
    }

    /// Put `bytes` at offset `off` of the staged data (the gap before it zero-filled).
    pub fn stage(&mut self, off: usize, bytes: &[u8]) {
        self.rec.staged.resize(off, 0);
        self.rec.staged.extend_from_slice(bytes);
    }

    pub fn staged(&self) -> &[u8] {
        &self.rec.staged
    }
}
