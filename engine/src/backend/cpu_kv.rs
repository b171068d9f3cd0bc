//! Host-memory storage of a KV pool for the CPU backend, addressed through the layout.

use super::{check_state_ranges, BResult, BackendError};
use crate::kv::checksum::section_checksums;
use crate::kv::fp8;
use crate::kv::fp8_kv::Fp8KvFormat;
use crate::kv::{EntryDtype, KvLayout, PageId, StateSlot};
use half::bf16;

/// All pages and state slots of one pool, as 32-bit words (every region is 16-byte aligned).
#[derive(Debug)]
pub struct CpuKv {
    pages: Vec<u32>,
    states: Vec<u32>,
    page_words: usize,
    state_words: usize,
}

/// Where in the pool a byte offset lives.
#[derive(Debug, Clone, Copy)]
pub enum Region {
    Page(PageId),
    State(StateSlot),
}

impl CpuKv {
    pub fn new(layout: &KvLayout, pages: usize, states: usize) -> Self {
        let page_words = layout.page_bytes / 4;
        let state_words = layout.state_bytes / 4;
        CpuKv {
            pages: vec![0; pages * page_words],
            states: vec![0; states * state_words],
            page_words,
            state_words,
        }
    }

    fn base(&self, r: Region) -> BResult<usize> {
        let (i, words, have) = match r {
            Region::Page(p) => (p as usize, self.page_words, self.pages.len()),
            Region::State(s) => (s as usize, self.state_words, self.states.len()),
        };
        let b = i * words;
        if b + words > have {
            return Err(BackendError::Kv(format!("{r:?} out of range")));
        }
        Ok(b)
    }

    fn words(&self, r: Region) -> BResult<&[u32]> {
        let b = self.base(r)?;
        Ok(match r {
            Region::Page(_) => &self.pages[b..b + self.page_words],
            Region::State(_) => &self.states[b..b + self.state_words],
        })
    }

    fn words_mut(&mut self, r: Region) -> BResult<&mut [u32]> {
        let b = self.base(r)?;
        Ok(match r {
            Region::Page(_) => &mut self.pages[b..b + self.page_words],
            Region::State(_) => &mut self.states[b..b + self.state_words],
        })
    }

    /// The canary's section checksums of every page / state slot ([`section_checksums`]),
    /// without copying the pool.
    pub fn page_checksums(&self) -> Vec<u64> {
        checksums_of(&self.pages, self.page_words)
    }

    pub fn state_checksums(&self) -> Vec<u64> {
        checksums_of(&self.states, self.state_words)
    }

    pub fn bytes(&self, r: Region) -> BResult<Vec<u8>> {
        Ok(bytemuck::cast_slice::<u32, u8>(self.words(r)?).to_vec())
    }

    /// The bytes `ranges` of each of `slots`, one vector per slot.
    pub fn ranges_of(
        &self,
        slots: &[StateSlot],
        ranges: &[std::ops::Range<usize>],
    ) -> BResult<Vec<Vec<u8>>> {
        let per = check_state_ranges(ranges, self.state_words * 4)?;
        slots
            .iter()
            .map(|&s| {
                let slot: &[u8] = bytemuck::cast_slice(self.words(Region::State(s))?);
                let mut out = Vec::with_capacity(per);
                for r in ranges {
                    out.extend_from_slice(&slot[r.clone()]);
                }
                Ok(out)
            })
            .collect()
    }

    /// Overwrite the whole region with `bytes` (exactly its size).
    pub fn write_bytes(&mut self, r: Region, bytes: &[u8]) -> BResult<()> {
        let w = self.words_mut(r)?;
        let dst: &mut [u8] = bytemuck::cast_slice_mut(w);
        if dst.len() != bytes.len() {
            return Err(BackendError::Kv(format!(
                "{r:?} holds {} bytes, got {}",
                dst.len(),
                bytes.len()
            )));
        }
        dst.copy_from_slice(bytes);
        Ok(())
    }

    pub fn zero(&mut self, r: Region) -> BResult<()> {
        self.words_mut(r)?.fill(0);
        Ok(())
    }

    /// Read one entry at `loc` (dequantising fp8 with its scales).
    pub fn read_entry(&self, loc: &EntryLoc, out: &mut [f32]) -> BResult<()> {
        match loc.codec {
            Codec::Plain(dt) => self.read(loc.region, loc.off, dt, out),
            Codec::Fp8Index { scale_off } => {
                let bytes: &[u8] = bytemuck::cast_slice(self.words(loc.region)?);
                let codes = span(bytes, loc.off, out.len())?;
                let scale = read_f32_le(bytes, scale_off)?;
                fp8::dequantize_entry(codes, scale, out);
                Ok(())
            }
            Codec::Fp8Kv { format, scale_off } => {
                let bytes: &[u8] = bytemuck::cast_slice(self.words(loc.region)?);
                let row = span(bytes, loc.off, format.row_bytes())?;
                let scales = span(bytes, scale_off, format.scale_bytes())?;
                format.decode(row, scales, out);
                Ok(())
            }
        }
    }

    /// Write one entry at `loc` (quantising fp8: index-K with scale amax/448, compressed
    /// KV in FlashMLA's V4 format).
    pub fn write_entry(&mut self, loc: &EntryLoc, vals: &[f32]) -> BResult<()> {
        match loc.codec {
            Codec::Plain(dt) => self.write(loc.region, loc.off, dt, vals),
            Codec::Fp8Index { scale_off } => {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(self.words_mut(loc.region)?);
                let codes = span_mut(bytes, loc.off, vals.len())?;
                let scale = fp8::quantize_entry(vals, codes);
                span_mut(bytes, scale_off, 4)?.copy_from_slice(&scale.to_le_bytes());
                Ok(())
            }
            Codec::Fp8Kv { format, scale_off } => {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(self.words_mut(loc.region)?);
                let mut row = vec![0u8; format.row_bytes()];
                let mut scales = vec![0u8; format.scale_bytes()];
                format.encode(vals, &mut row, &mut scales);
                span_mut(bytes, loc.off, row.len())?.copy_from_slice(&row);
                span_mut(bytes, scale_off, scales.len())?.copy_from_slice(&scales);
                Ok(())
            }
        }
    }

    /// Read `out.len()` values of `dtype` at byte offset `off` of region `r`.
    pub fn read(&self, r: Region, off: usize, dtype: EntryDtype, out: &mut [f32]) -> BResult<()> {
        let w = self.words(r)?;
        match dtype {
            EntryDtype::F32 => {
                let src = slice_f32(w, off, out.len())?;
                out.copy_from_slice(src);
            }
            EntryDtype::Fp8E4m3 => {
                return Err(BackendError::Kv(
                    "fp8 values are read per entry (read_entry)".into(),
                ))
            }
            EntryDtype::Bf16 => {
                let halves: &[u16] = bytemuck::cast_slice(w);
                let s = off / 2;
                let src = halves
                    .get(s..s + out.len())
                    .ok_or_else(|| BackendError::Kv(format!("read past region at byte {off}")))?;
                for (o, &h) in out.iter_mut().zip(src) {
                    *o = bf16::from_bits(h).to_f32();
                }
            }
        }
        Ok(())
    }

    /// Write `vals` as `dtype` at byte offset `off` of region `r`.
    pub fn write(&mut self, r: Region, off: usize, dtype: EntryDtype, vals: &[f32]) -> BResult<()> {
        let w = self.words_mut(r)?;
        match dtype {
            EntryDtype::F32 => {
                let fs: &mut [f32] = bytemuck::cast_slice_mut(w);
                let s = off / 4;
                let dst = fs
                    .get_mut(s..s + vals.len())
                    .ok_or_else(|| BackendError::Kv(format!("write past region at byte {off}")))?;
                dst.copy_from_slice(vals);
            }
            EntryDtype::Fp8E4m3 => {
                return Err(BackendError::Kv(
                    "fp8 values are written per entry (write_entry)".into(),
                ))
            }
            EntryDtype::Bf16 => {
                let halves: &mut [u16] = bytemuck::cast_slice_mut(w);
                let s = off / 2;
                let dst = halves
                    .get_mut(s..s + vals.len())
                    .ok_or_else(|| BackendError::Kv(format!("write past region at byte {off}")))?;
                for (d, &v) in dst.iter_mut().zip(vals) {
                    *d = bf16::from_f32(v).to_bits();
                }
            }
        }
        Ok(())
    }

    /// f32 view of `len` values at byte offset `off` (state rings are always f32).
    pub fn f32s(&self, r: Region, off: usize, len: usize) -> BResult<&[f32]> {
        slice_f32(self.words(r)?, off, len)
    }
}

/// Where one compressed-KV, window or index-K entry lives.
#[derive(Debug, Clone, Copy)]
pub struct EntryLoc {
    pub region: Region,
    /// Byte offset of the entry's values (fp8: its codes / row).
    pub off: usize,
    pub codec: Codec,
    pub dim: usize,
}

/// How an entry's bytes encode its values.
#[derive(Debug, Clone, Copy)]
pub enum Codec {
    /// f32 or bf16 values (fp8 needs one of the scaled forms).
    Plain(EntryDtype),
    /// fp8 index-K: e4m3 codes and one fp32 scale at `scale_off`.
    Fp8Index { scale_off: usize },
    /// fp8 compressed KV / window: a FlashMLA V4 row and its scale bytes at `scale_off`.
    Fp8Kv {
        format: Fp8KvFormat,
        scale_off: usize,
    },
}

impl Codec {
    /// The codec of an entry of `dtype` whose scales (fp8) sit at `scale_off`, in the
    /// index-K form or the compressed-KV form (`kv_format`).
    pub fn of(
        dtype: EntryDtype,
        scale_off: Option<usize>,
        kv_format: Option<Fp8KvFormat>,
    ) -> BResult<Self> {
        match (dtype, scale_off, kv_format) {
            (EntryDtype::Fp8E4m3, Some(scale_off), Some(format)) => {
                Ok(Codec::Fp8Kv { format, scale_off })
            }
            (EntryDtype::Fp8E4m3, Some(scale_off), None) => Ok(Codec::Fp8Index { scale_off }),
            (EntryDtype::Fp8E4m3, None, _) => {
                Err(BackendError::Kv("fp8 entry without scales".into()))
            }
            (dt, _, _) => Ok(Codec::Plain(dt)),
        }
    }
}

fn span(bytes: &[u8], at: usize, len: usize) -> BResult<&[u8]> {
    bytes
        .get(at..at + len)
        .ok_or_else(|| BackendError::Kv(format!("read past region at byte {at}")))
}

fn span_mut(bytes: &mut [u8], at: usize, len: usize) -> BResult<&mut [u8]> {
    bytes
        .get_mut(at..at + len)
        .ok_or_else(|| BackendError::Kv(format!("write past region at byte {at}")))
}

fn read_f32_le(bytes: &[u8], at: usize) -> BResult<f32> {
    let b: [u8; 4] = bytes
        .get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| BackendError::Kv(format!("scale past region at byte {at}")))?;
    Ok(f32::from_le_bytes(b))
}

fn slice_f32(w: &[u32], off: usize, len: usize) -> BResult<&[f32]> {
    let fs: &[f32] = bytemuck::cast_slice(w);
    fs.get(off / 4..off / 4 + len)
        .ok_or_else(|| BackendError::Kv(format!("read past region at byte {off}")))
}

/// Round compressed-KV / window entries (`vals`, whole entries of `layout.head_dim`)
/// through the layout's storage: what a store then load would give.
pub fn round_through_kv(layout: &KvLayout, vals: &mut [f32]) {
    match (layout.kv_dtype, layout.fp8_kv_format()) {
        (_, Some(format)) => {
            for entry in vals.chunks_mut(layout.head_dim) {
                format.round_trip(entry);
            }
        }
        (EntryDtype::Bf16, None) => {
            for v in vals {
                *v = bf16::from_f32(*v).to_f32();
            }
        }
        (EntryDtype::F32 | EntryDtype::Fp8E4m3, None) => {}
    }
}

/// The canary's section checksums of every region of `per` words, region after region.
fn checksums_of(words: &[u32], per: usize) -> Vec<u64> {
    words
        .chunks(per.max(1))
        .flat_map(|c| section_checksums(bytemuck::cast_slice::<u32, u8>(c)))
        .collect()
}
