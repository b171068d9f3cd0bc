//! Device storage of a KV pool (pages and state slots as two byte buffers, addressed
//! through the layout) and the device copy of a batch plan.

use crate::device::{dev_err, Gpu};
use cudarc::driver::CudaSlice;
use pdserve_engine::backend::{BResult, BackendError, BatchPlan};
use pdserve_engine::kv::{EntryDtype, KvLayout, PageId, StateSlot};

/// All pages and state slots of one pool on the device.
#[derive(Debug)]
pub struct GpuKv {
    pub(crate) pages: CudaSlice<u8>,
    pub(crate) states: CudaSlice<u8>,
    pub(crate) page_bytes: usize,
    pub(crate) state_bytes: usize,
    pub(crate) n_pages: usize,
    pub(crate) n_states: usize,
}

fn kv_err(msg: String) -> BackendError {
    BackendError::Kv(msg)
}

impl GpuKv {
    pub(crate) fn new(gpu: &Gpu, layout: &KvLayout, pages: usize, states: usize) -> BResult<Self> {
        // Refuse layouts the kernels cannot address before any memory is taken.
        dt_code(layout.kv_dtype)?;
        dt_code(layout.index_k_dtype)?;
        Ok(GpuKv {
            pages: gpu.zeros::<u8>(pages * layout.page_bytes)?,
            states: gpu.zeros::<u8>(states * layout.state_bytes)?,
            page_bytes: layout.page_bytes,
            state_bytes: layout.state_bytes,
            n_pages: pages,
            n_states: states,
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

    pub(crate) fn zero_state(&mut self, gpu: &Gpu, slot: StateSlot) -> BResult<()> {
        let r = self.state_range(slot)?;
        let mut v = self.states.slice_mut(r);
        gpu.stream.memset_zeros(&mut v).map_err(dev_err)
    }

    pub(crate) fn read_page(&self, gpu: &Gpu, page: PageId) -> BResult<Vec<u8>> {
        let r = self.page_range(page)?;
        gpu.stream.clone_dtoh(&self.pages.slice(r)).map_err(dev_err)
    }

    pub(crate) fn read_state(&self, gpu: &Gpu, slot: StateSlot) -> BResult<Vec<u8>> {
        let r = self.state_range(slot)?;
        gpu.stream
            .clone_dtoh(&self.states.slice(r))
            .map_err(dev_err)
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
        let mut v = self.pages.slice_mut(r);
        gpu.stream.memcpy_htod(bytes, &mut v).map_err(dev_err)
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
        let mut v = self.states.slice_mut(r);
        gpu.stream.memcpy_htod(bytes, &mut v).map_err(dev_err)
    }
}

/// Kernel code of an entry dtype (`dt` in common.cuh).
pub(crate) fn dt_code(d: EntryDtype) -> BResult<i32> {
    match d {
        EntryDtype::F32 => Ok(0),
        EntryDtype::Bf16 => Ok(1),
        EntryDtype::Fp8E4m3 => Err(kv_err(
            "fp8 index-K is not implemented by the CUDA backend yet: use --index-k-dtype \
             f32 or bf16"
                .into(),
        )),
    }
}

/// A batch plan on the device (see `SEQ_*` in common.cuh).
pub(crate) struct DevPlan {
    pub seq: CudaSlice<i32>,
    pub pt: CudaSlice<u32>,
    pub row_seq: CudaSlice<i32>,
    pub positions: CudaSlice<i32>,
}

fn to_i32(v: usize, what: &str) -> BResult<i32> {
    i32::try_from(v).map_err(|_| kv_err(format!("{what} {v} does not fit the kernels' i32")))
}

impl DevPlan {
    /// Validate every state slot and page id against the pool, then upload.
    pub(crate) fn upload(gpu: &Gpu, kv: &GpuKv, plan: &BatchPlan) -> BResult<Self> {
        let mut seq = Vec::with_capacity(plan.seqs.len() * 6);
        let mut pt = Vec::new();
        for s in &plan.seqs {
            if s.state as usize >= kv.n_states {
                return Err(kv_err(format!("State({}) out of range", s.state)));
            }
            if let Some(p) = s.pages.iter().find(|&&p| p as usize >= kv.n_pages) {
                return Err(kv_err(format!(
                    "Page({p}) out of range ({} pages)",
                    kv.n_pages
                )));
            }
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
