//! Device storage of a KV pool (pages and state slots as two byte buffers, addressed
//! through the layout) and the device copy of a batch plan.

use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::launch::dev_err;
use crate::ops::numerics::rotation_scale_bits;
use pdserve_engine::backend::{check_state_ranges, BResult, BackendError, BatchPlan};
use pdserve_engine::kv::checksum::sections;
use pdserve_engine::kv::{EntryDtype, KvLayout, PageId, StateSlot};
use pdserve_engine::numerics::Numerics;

/// All pages and state slots of one pool on the device, plus one dummy page and one dummy
/// state slot past the pool's ids that the padded rows of a decode graph write to.
#[derive(Debug)]
pub struct GpuKv {
    pub(crate) pages: DevMem<u8>,
    pub(crate) states: DevMem<u8>,
    pub(crate) page_bytes: usize,
    pub(crate) state_bytes: usize,
    pub(crate) n_pages: usize,
    pub(crate) n_states: usize,
    pub(crate) page_tokens: usize,
}

fn kv_err(msg: String) -> BackendError {
    BackendError::Kv(msg)
}

impl GpuKv {
    pub(crate) fn new(gpu: &Gpu, layout: &KvLayout, pages: usize, states: usize) -> BResult<Self> {
        // Refuse layouts the kernels cannot compute before any memory is taken: `deepseek`
        // numerics rotate the indexer's heads, which takes a power of two of whole FP4 blocks.
        if layout.numerics == Numerics::Deepseek {
            rotation_scale_bits(layout.index_head_dim, "deepseek numerics")?;
        }
        kv_dt_code(layout)?;
        dt_code(layout.index_k_dtype)?;
        Ok(GpuKv {
            pages: gpu.zeros_owned::<u8>((pages + 1) * layout.page_bytes)?,
            states: gpu.zeros_owned::<u8>((states + 1) * layout.state_bytes)?,
            page_bytes: layout.page_bytes,
            state_bytes: layout.state_bytes,
            n_pages: pages,
            n_states: states,
            page_tokens: layout.page_tokens,
        })
    }

    fn page_range(&self, page: PageId) -> BResult<std::ops::Range<usize>> {
        let p = page as usize;
        if p >= self.n_pages {
            return Err(kv_err(format!(
                "Page({page}) out of range ({} pages)",
                self.n_pages
            )));
        }
        Ok(p * self.page_bytes..(p + 1) * self.page_bytes)
    }

    fn state_range(&self, slot: StateSlot) -> BResult<std::ops::Range<usize>> {
        let s = slot as usize;
        if s >= self.n_states {
            return Err(kv_err(format!(
                "State({slot}) out of range ({} slots)",
                self.n_states
            )));
        }
        Ok(s * self.state_bytes..(s + 1) * self.state_bytes)
    }

    /// The byte range of `page` in the page buffer.
    pub(crate) fn page_range_of(&self, page: PageId) -> BResult<std::ops::Range<usize>> {
        self.page_range(page)
    }

    /// The page padded decode rows point at (never handed to the engine).
    pub(crate) fn dummy_page(&self) -> PageId {
        self.n_pages as PageId
    }

    /// The state slot padded decode rows use (never handed to the engine).
    pub(crate) fn dummy_state(&self) -> StateSlot {
        self.n_states as StateSlot
    }

    #[allow(unsafe_code)]
    pub(crate) fn zero_state(&mut self, gpu: &Gpu, slot: StateSlot) -> BResult<()> {
        let r = self.state_range(slot)?;
        // SAFETY: `r` lies inside the state buffer (checked by state_range).
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.states.ptr() + r.start as u64,
                0,
                r.len(),
                gpu.stream.cu_stream(),
            )
        }
        .map_err(dev_err)
    }

    /// The canary's section checksums of every page / state slot (the dummy ones left
    /// out), by one kernel; only the checksums come back to the host.
    pub(crate) fn page_checksums(&self, gpu: &Gpu) -> BResult<Vec<u64>> {
        region_checksums(gpu, &self.pages, self.n_pages, self.page_bytes)
    }

    pub(crate) fn state_checksums(&self, gpu: &Gpu) -> BResult<Vec<u64>> {
        region_checksums(gpu, &self.states, self.n_states, self.state_bytes)
    }

    pub(crate) fn read_page(&self, gpu: &Gpu, page: PageId) -> BResult<Vec<u8>> {
        let r = self.page_range(page)?;
        gpu.download(
            &DevMem::<u8>::view(self.pages.ptr() + r.start as u64, r.len()),
            r.len(),
        )
    }

    pub(crate) fn read_state(&self, gpu: &Gpu, slot: StateSlot) -> BResult<Vec<u8>> {
        let r = self.state_range(slot)?;
        gpu.download(
            &DevMem::<u8>::view(self.states.ptr() + r.start as u64, r.len()),
            r.len(),
        )
    }

    /// The bytes `ranges` of each of `slots`, one vector per slot: an asynchronous copy
    /// per range into one page-locked buffer, one wait (a synchronous copy per slot cost
    /// ~1 ms each for an 8K prompt's 31 cuts; a device gather then one copy, 15 ms).
    pub(crate) fn read_state_ranges(
        &self,
        gpu: &Gpu,
        slots: &[StateSlot],
        ranges: &[std::ops::Range<usize>],
    ) -> BResult<Vec<Vec<u8>>> {
        let per = check_state_ranges(ranges, self.state_bytes)?;
        if per == 0 {
            return Ok(vec![Vec::new(); slots.len()]);
        }
        let mut pieces = Vec::with_capacity(slots.len() * ranges.len());
        for &s in slots {
            let base = self.states.ptr() + self.state_range(s)?.start as u64;
            pieces.extend(ranges.iter().map(|r| (base + r.start as u64, r.len())));
        }
        gpu.download_grouped(&pieces, per)
    }

    pub(crate) fn write_page(&mut self, gpu: &Gpu, page: PageId, bytes: &[u8]) -> BResult<()> {
        let r = self.page_range(page)?;
        if bytes.len() != self.page_bytes {
            return Err(kv_err(format!(
                "Page({page}) holds {} bytes, got {}",
                self.page_bytes,
                bytes.len()
            )));
        }
        gpu.copy_to_device(self.pages.ptr() + r.start as u64, bytes)
    }

    pub(crate) fn write_state(&mut self, gpu: &Gpu, slot: StateSlot, bytes: &[u8]) -> BResult<()> {
        let r = self.state_range(slot)?;
        if bytes.len() != self.state_bytes {
            return Err(kv_err(format!(
                "State({slot}) holds {} bytes, got {}",
                self.state_bytes,
                bytes.len()
            )));
        }
        gpu.copy_to_device(self.states.ptr() + r.start as u64, bytes)
    }
}

/// Checksums of the first `items` regions of `bytes` each in `buf`.
/// The canary's section checksums (`kv::checksum::section_checksums`) of `items` regions
/// of `bytes` bytes: one block per section.
fn region_checksums(gpu: &Gpu, buf: &DevMem<u8>, items: usize, bytes: usize) -> BResult<Vec<u64>> {
    let n = items * sections(bytes);
    if n == 0 {
        return Ok(Vec::new());
    }
    let out = gpu.zeros_owned::<u64>(n)?;
    gpu.launch(
        (n as u32, 1, 1),
        0,
        &kernels::RegionChecksums {
            base: DevPtr::of(buf),
            words: (bytes / 8 / sections(bytes)) as i64,
            out: DevPtr::of(&out),
        },
    )?;
    gpu.download(&out, n)
}

/// Kernel dtype codes (`dt` in common.cuh): bf16 entries, and the fp8 KV entry in
/// FlashMLA's V4 layout.
pub(crate) const DT_BF16: i32 = 1;
pub(crate) const DT_FP8_KV: i32 = 3;

/// Kernel code of an index-K entry dtype (`dt` in common.cuh).
pub(crate) fn dt_code(d: EntryDtype) -> BResult<i32> {
    match d {
        EntryDtype::F32 => Ok(0),
        EntryDtype::Bf16 => Ok(DT_BF16),
        EntryDtype::Fp8E4m3 => Ok(2),
    }
}

/// Kernel code of the compressed-KV / window entry dtype: fp8 is FlashMLA's V4 entry
/// (`st_fp8kv` in common.cuh), the others as index-K.
pub(crate) fn kv_dt_code(layout: &KvLayout) -> BResult<i32> {
    match layout.fp8_kv_format() {
        Some(_) => Ok(DT_FP8_KV),
        None => dt_code(layout.kv_dtype),
    }
}

/// Ints per sequence of the device sequence table (`SEQ_INTS` in common.cuh), and the
/// place of its state slot (`SEQ_STATE`).
pub(crate) const SEQ_INTS: usize = 6;
pub(crate) const SEQ_STATE: usize = 3;

/// The sequence table of `plan` (`SEQ_INTS` ints per sequence: start, length, first row,
/// state slot, page-table offset, pages) and its page tables concatenated.
pub(crate) fn seq_table(plan: &BatchPlan) -> BResult<(Vec<i32>, Vec<u32>)> {
    let mut seq = Vec::with_capacity(plan.seqs.len() * SEQ_INTS);
    let mut pt = Vec::new();
    for s in &plan.seqs {
        if s.row0 + s.len > plan.rows() {
            return Err(kv_err(format!(
                "sequence rows {}+{} past the batch",
                s.row0, s.len
            )));
        }
        seq.extend([
            to_i32(s.start, "position")?,
            to_i32(s.len, "length")?,
            to_i32(s.row0, "row")?,
            to_i32(s.state as usize, "state slot")?,
            to_i32(pt.len(), "page table offset")?,
            to_i32(s.pages.len(), "pages")?,
        ]);
        pt.extend_from_slice(&s.pages);
    }
    Ok((seq, pt))
}

/// A batch plan on the device (see `SEQ_*` in common.cuh).
pub(crate) struct DevPlan {
    pub seq: DevMem<i32>,
    pub pt: DevMem<u32>,
    pub row_seq: DevMem<i32>,
    pub positions: DevMem<i32>,
}

fn to_i32(v: usize, what: &str) -> BResult<i32> {
    i32::try_from(v).map_err(|_| kv_err(format!("{what} {v} does not fit the kernels' i32")))
}

impl DevPlan {
    /// Validate every state slot and page id against the pool, then upload. Inside a
    /// decode step the dummy page and state slot are valid too (the step's padded rows use
    /// them; the engine's own plan was checked without them by [`DevPlan::validate`]).
    /// Inside a decode step an equal plan staged earlier in the same pass is reused.
    pub(crate) fn upload(gpu: &Gpu, kv: &GpuKv, plan: &BatchPlan) -> BResult<Self> {
        let pool = kv.pages.ptr();
        if let Some([seq, pt, row_seq, positions]) = gpu.staged_plan(pool, plan)? {
            return Ok(DevPlan {
                seq: DevMem::view(seq.0, seq.1),
                pt: DevMem::view(pt.0, pt.1),
                row_seq: DevMem::view(row_seq.0, row_seq.1),
                positions: DevMem::view(positions.0, positions.1),
            });
        }
        let dp = Self::upload_new(gpu, kv, plan)?;
        let at = |m: &DevMem<i32>| (m.ptr(), m.len());
        let pt = (dp.pt.ptr(), dp.pt.len());
        gpu.keep_plan(
            pool,
            plan,
            [at(&dp.seq), pt, at(&dp.row_seq), at(&dp.positions)],
        )?;
        Ok(dp)
    }

    fn upload_new(gpu: &Gpu, kv: &GpuKv, plan: &BatchPlan) -> BResult<Self> {
        check_ids(kv, plan, usize::from(gpu.in_step()))?;
        let (seq, pt) = seq_table(plan)?;
        if plan.row_seq.len() != plan.rows() || plan.positions.len() != plan.rows() {
            return Err(kv_err(
                "plan rows, positions and row_seq differ in length".into(),
            ));
        }
        if let Some(s) = plan.row_seq.iter().find(|&&s| s >= plan.seqs.len()) {
            return Err(kv_err(format!(
                "row of sequence {s}, plan has {}",
                plan.seqs.len()
            )));
        }
        let row_seq = plan
            .row_seq
            .iter()
            .map(|&s| to_i32(s, "sequence index"))
            .collect::<BResult<Vec<_>>>()?;
        let positions = plan
            .positions
            .iter()
            .map(|&p| to_i32(p, "position"))
            .collect::<BResult<Vec<_>>>()?;
        Ok(DevPlan {
            seq: gpu.upload(&seq)?,
            pt: gpu.upload(&pt)?,
            row_seq: gpu.upload(&row_seq)?,
            positions: gpu.upload(&positions)?,
        })
    }

    /// Error unless every page and state id of `plan` belongs to the pool.
    pub(crate) fn validate(kv: &GpuKv, plan: &BatchPlan) -> BResult<()> {
        check_ids(kv, plan, 0)
    }
}

/// Page and state ids below the pool's counts plus `extra` (the dummy ids).
fn check_ids(kv: &GpuKv, plan: &BatchPlan, extra: usize) -> BResult<()> {
    for s in &plan.seqs {
        if s.state as usize >= kv.n_states + extra {
            return Err(kv_err(format!("State({}) out of range", s.state)));
        }
        if let Some(p) = s.pages.iter().find(|&&p| p as usize >= kv.n_pages + extra) {
            return Err(kv_err(format!(
                "Page({p}) out of range ({} pages)",
                kv.n_pages
            )));
        }
    }
    Ok(())
}

/// Error unless entry `w` of a rate-`rate` layer lies in one of the sequence's pages.
pub(crate) fn check_entry_page(
    layout: &KvLayout,
    rate: usize,
    pages_held: usize,
    w: usize,
) -> BResult<()> {
    let page_idx = w * rate / layout.page_tokens;
    if page_idx >= pages_held {
        return Err(kv_err(format!(
            "entry {w} needs page {page_idx}, sequence holds {pages_held}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_table_constants_are_the_kernels() {
        let common = include_str!("cu/common.cuh");
        assert!(common.contains(&format!("#define SEQ_INTS {SEQ_INTS}\n")));
        assert!(common.contains(&format!("#define SEQ_STATE {SEQ_STATE}\n")));
    }
}
