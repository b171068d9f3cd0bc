//! A decode step's state: the recorder (mode, signature, staged data) and the arena its
//! buffers come from, behind one lock because the signature interleaves allocations,
//! uploads and launches in program order. Every decision that depends on the step mode is
//! made here; [`crate::device::Gpu`] only carries it out.

use crate::alloc::StepArena;
use crate::launch::Arg;
use crate::recorder::{Recorder, StepMode, StepRecord};
use cudarc::driver::CudaStream;
use pdserve_engine::backend::{BResult, BatchPlan, SeqPlan};
use std::ops::Range;
use std::sync::Arc;

/// Where a new temporary lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Temp {
    /// Its own allocation: no step is being recorded.
    Own,
    /// At `ptr` in the step arena; `fill_now`: a zero-filled temporary is cleared on the
    /// stream now (every pass but a dry one).
    Arena { ptr: u64, fill_now: bool },
}

/// Where uploaded host data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Upload {
    /// Its own allocation, copied now: no step is being recorded.
    Own,
    /// At `ptr` in the staging buffer; `copy_now`: the range of [`StepState::staged`] to
    /// copy there now (an eager pass; a graph replay copies all staged data before it
    /// launches).
    Staged {
        ptr: u64,
        copy_now: Option<Range<usize>>,
    },
}

#[derive(Debug, Default)]
pub(crate) struct StepState {
    recorder: Recorder,
    arena: StepArena,
    /// The address of the pass's own batch plan (0: none), which the caller of
    /// [`StepState::begin`] keeps borrowed, hence alive and unchanged, until
    /// [`StepState::end`]: while the pass runs no other object can be at that address.
    pass_plan: usize,
    /// Where this pass staged its own plan: every paged op of every layer uploads it (at
    /// 256 sequences of 32K tokens, 256 KB of page tables each time), so later uploads of
    /// the same object reuse the staged copy, found by address (no copy, no compare).
    pass_staged: Option<(u64, [(u64, usize); 4])>,
    /// Another plan staged last in this pass, kept by value: later uploads of an equal
    /// plan (compared in full) reuse its staged copy.
    other: Option<StagedPlan>,
}

/// What a staged plan holds (the fields its upload reads) and where its four arrays are.
#[derive(Debug)]
struct StagedPlan {
    pool: u64,
    seqs: Vec<SeqPlan>,
    row_seq: Vec<usize>,
    positions: Vec<usize>,
    at: [(u64, usize); 4],
}

/// A plan's address, the key of the pass's own plan.
fn address(plan: &BatchPlan) -> usize {
    std::ptr::from_ref(plan) as usize
}

impl StagedPlan {
    fn holds(&self, pool: u64, plan: &BatchPlan) -> bool {
        self.pool == pool
            && self.seqs == plan.seqs
            && self.row_seq == plan.row_seq
            && self.positions == plan.positions
    }
}

impl StepState {
    /// Start a pass in `mode` over `pass_plan`, which the caller keeps borrowed until
    /// [`StepState::end`] (`graphs::pass` does: the forward runs inside the borrow).
    pub fn begin(&mut self, mode: StepMode, pass_plan: &BatchPlan) {
        self.recorder.begin(mode);
        self.arena.reset();
        self.pass_plan = address(pass_plan);
        self.pass_staged = None;
        self.other = None;
    }

    pub fn end(&mut self) -> StepRecord {
        self.pass_plan = 0;
        self.pass_staged = None;
        self.other = None;
        self.recorder.end(self.arena.arena_used())
    }

    fn is_pass_plan(&self, plan: &BatchPlan) -> bool {
        self.in_step() && self.pass_plan == address(plan)
    }

    /// Where this pass staged a plan equal to `plan` over the pool at `pool` (its
    /// sequences, rows and positions), if it did: `(pointer, values)` of each array.
    pub fn staged_plan(&self, pool: u64, plan: &BatchPlan) -> Option<[(u64, usize); 4]> {
        if !self.in_step() {
            return None;
        }
        if let Some((_, at)) = self
            .pass_staged
            .filter(|&(p, _)| p == pool && self.is_pass_plan(plan))
        {
            return Some(at);
        }
        self.other
            .as_ref()
            .filter(|p| p.holds(pool, plan))
            .map(|p| p.at)
    }

    /// Remember that `plan` is staged at `at` in this pass (nothing outside a step): the
    /// pass's own plan by address, another by value.
    pub fn keep_plan(&mut self, pool: u64, plan: &BatchPlan, at: [(u64, usize); 4]) {
        if !self.in_step() {
            return;
        }
        if self.is_pass_plan(plan) {
            self.pass_staged = Some((pool, at));
        } else {
            self.other = Some(StagedPlan {
                pool,
                seqs: plan.seqs.clone(),
                row_seq: plan.row_seq.clone(),
                positions: plan.positions.clone(),
                at,
            });
        }
    }

    /// Whether a step is being recorded.
    pub fn in_step(&self) -> bool {
        self.recorder.active()
    }

    fn dry(&self) -> bool {
        self.recorder.mode() == StepMode::Dry
    }

    /// A new temporary of `bytes` bytes.
    pub fn temp(&mut self, bytes: usize) -> BResult<Temp> {
        if !self.in_step() {
            return Ok(Temp::Own);
        }
        let ptr = self.arena.temp(bytes, self.dry())?;
        self.recorder.sign(b'Z', &[ptr, bytes as u64]);
        Ok(Temp::Arena {
            ptr,
            fill_now: !self.dry(),
        })
    }

    /// Host data `bytes` to upload.
    pub fn upload(&mut self, bytes: &[u8]) -> BResult<Upload> {
        if !self.in_step() {
            return Ok(Upload::Own);
        }
        let (ptr, off) = self.arena.stage(bytes.len(), self.dry())?;
        self.recorder.stage(off, bytes);
        self.recorder.sign(b'U', &[ptr, bytes.len() as u64]);
        let eager = self.recorder.mode() == StepMode::Eager && !bytes.is_empty();
        Ok(Upload::Staged {
            ptr,
            copy_now: eager.then_some(off..off + bytes.len()),
        })
    }

    /// The staged data so far.
    pub fn staged(&self) -> &[u8] {
        self.recorder.staged()
    }

    /// Record a kernel launch; whether to submit it now.
    pub fn launch(&mut self, name: &str, grid: (u32, u32, u32), shared: u32, args: &[Arg]) -> bool {
        self.recorder.launch(name, grid, shared, args)
    }

    /// Record a GEMM by its parameters; whether to submit it now.
    pub fn gemm(&mut self, words: &[u64]) -> bool {
        self.recorder.gemm(words)
    }

    /// Size the arena and staging buffer for `rec`; true when they moved.
    pub fn ensure(&mut self, stream: &Arc<CudaStream>, rec: &StepRecord) -> BResult<bool> {
        self.arena.ensure(stream, rec)
    }

    pub fn staging_base(&self) -> u64 {
        self.arena.staging_base()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn arena_ptr(t: Temp) -> u64 {
        match t {
            Temp::Arena { ptr, fill_now } => {
                assert!(!fill_now, "a dry pass fills nothing");
                ptr
            }
            Temp::Own => panic!("own allocation inside a step"),
        }
    }

    fn staged_ptr(u: Upload) -> u64 {
        match u {
            Upload::Staged { ptr, copy_now } => {
                assert_eq!(copy_now, None, "a dry pass copies nothing");
                ptr
            }
            Upload::Own => panic!("own allocation inside a step"),
        }
    }

    fn dry_step(values: &[u8], rows: u32) -> StepRecord {
        let mut st = StepState::default();
        st.begin(StepMode::Dry, &BatchPlan::default());
        let a = arena_ptr(st.temp(10).unwrap());
        let b = arena_ptr(st.temp(300).unwrap());
        assert_eq!((a, b), (0, 256), "arena allocations are 256-byte aligned");
        let p1 = staged_ptr(st.upload(values).unwrap());
        let p2 = staged_ptr(st.upload(&[9, 9]).unwrap());
        assert_eq!((p1, p2), (0, 256));
        let submit = st.launch(
            "k",
            (rows, 1, 1),
            0,
            &[Arg::Ptr(b), Arg::I32(3), Arg::F32(0.5)],
        );
        assert!(!submit, "a dry pass launches nothing");
        let rec = st.end();
        assert!(!st.in_step());
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
        let none = BatchPlan::default();
        st.begin(StepMode::Eager, &none);
        let err = st.temp(16).unwrap_err().to_string();
        assert!(err.contains("sized by its dry pass"), "{err}");
        st.begin(StepMode::Capture, &none);
        assert!(st.upload(&[1]).is_err());
    }

    #[test]
    fn outside_a_step_buffers_are_owned_and_launches_submitted_unrecorded() {
        let mut st = StepState::default();
        assert_eq!(st.temp(16).unwrap(), Temp::Own);
        assert_eq!(st.upload(&[1, 2]).unwrap(), Upload::Own);
        assert!(st.launch("k", (1, 1, 1), 0, &[Arg::I32(1)]));
        assert!(st.gemm(&[1, 2]));
        assert!(st.end().signature.is_empty());
    }

    fn plan(pages: Vec<u32>) -> BatchPlan {
        BatchPlan {
            seqs: vec![SeqPlan {
                start: 7,
                len: 1,
                row0: 0,
                pages,
                state: 2,
            }],
            tokens: vec![5],
            positions: vec![7],
            row_seq: vec![0],
            cuts: None,
        }
    }

    #[test]
    fn a_pass_reuses_the_plan_it_staged_only_while_it_is_equal() {
        let at = [(0, 6), (256, 2), (512, 1), (768, 1)];
        let mut st = StepState::default();
        st.keep_plan(1, &plan(vec![3, 4]), at);
        assert_eq!(
            st.staged_plan(1, &plan(vec![3, 4])),
            None,
            "outside a step: nothing kept"
        );
        let own = plan(vec![1]);
        st.begin(StepMode::Dry, &own);
        st.keep_plan(1, &plan(vec![3, 4]), at);
        let mut other_tokens = plan(vec![3, 4]);
        other_tokens.tokens = vec![9];
        assert_eq!(
            st.staged_plan(1, &other_tokens),
            Some(at),
            "tokens are not uploaded"
        );
        assert_eq!(st.staged_plan(1, &plan(vec![3, 5])), None, "another page");
        assert_eq!(st.staged_plan(2, &plan(vec![3, 4])), None, "another pool");
        let mut moved = plan(vec![3, 4]);
        moved.positions = vec![8];
        assert_eq!(st.staged_plan(1, &moved), None, "another position");
        st.end();
        st.begin(StepMode::Dry, &own);
        assert_eq!(
            st.staged_plan(1, &plan(vec![3, 4])),
            None,
            "a new pass stages anew"
        );
    }

    #[test]
    fn the_pass_plan_is_found_by_address_beside_another_kept_by_value() {
        let own_at = [(0, 6), (256, 2), (512, 1), (768, 1)];
        let other_at = [(1024, 6), (1280, 2), (1536, 1), (1792, 1)];
        let own = plan(vec![3, 4]);
        let equal_copy = own.clone();
        let other = plan(vec![8, 9]);
        let mut st = StepState::default();
        st.begin(StepMode::Dry, &own);
        assert_eq!(st.staged_plan(1, &own), None, "nothing staged yet");
        st.keep_plan(1, &own, own_at);
        assert_eq!(st.staged_plan(1, &own), Some(own_at));
        assert_eq!(st.staged_plan(2, &own), None, "another pool");
        assert_eq!(
            st.staged_plan(1, &equal_copy),
            None,
            "the pass plan is kept by address: an equal plan elsewhere stages its own copy"
        );
        st.keep_plan(1, &other, other_at);
        assert_eq!(st.staged_plan(1, &own), Some(own_at), "both are kept");
        assert_eq!(st.staged_plan(1, &plan(vec![8, 9])), Some(other_at));
        st.end();
        assert_eq!(st.staged_plan(1, &own), None, "outside a step");
        st.begin(StepMode::Eager, &other);
        assert_eq!(st.staged_plan(1, &own), None, "a new pass stages anew");
        st.keep_plan(1, &own, own_at);
        assert_eq!(
            st.staged_plan(1, &own),
            Some(own_at),
            "no longer the pass plan: kept by value"
        );
        assert_eq!(st.staged_plan(1, &equal_copy), Some(own_at));
    }
}
