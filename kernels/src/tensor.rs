//! Device tensors: fp32 activations, bf16 weight matrices, weights kept in DeepSeek's
//! stored FP8/FP4 formats.

use crate::blas_fp8::OperandScales;
use crate::devmem::DevMem;
use pdserve_engine::checkpoint::{StoredWeight, WeightFormat};
use std::sync::OnceLock;

/// Storage of a [`GpuTensor`].
#[derive(Debug)]
pub enum Buf {
    F32(DevMem<f32>),
    /// bf16 bits.
    Bf16(DevMem<u16>),
    /// A weight as the checkpoint stores it (FP8 block-scaled or FP4 group-scaled).
    Stored(StoredBuf),
}

/// The bytes and ue8m0 scales of a stored weight, laid out as [`StoredWeight`] describes.
#[derive(Debug)]
pub struct StoredBuf {
    pub format: WeightFormat,
    /// Rows per scale grid (see [`StoredWeight::group_rows`]).
    pub group_rows: usize,
    pub q: DevMem<u8>,
    pub s: DevMem<u8>,
}

/// The kernels' weight format codes (`WF_*` in cu/common.cuh).
pub(crate) const WF_F32: i32 = 0;
pub(crate) const WF_BF16: i32 = 1;
pub(crate) const WF_FP8: i32 = 2;
pub(crate) const WF_FP4: i32 = 3;

/// A weight as the kernels that take any format read it (`WF_*` in cu/common.cuh).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WeightOperand {
    /// Values (f32, bf16 bits, FP8 bytes or packed FP4).
    pub w: u64,
    /// ue8m0 scales (stored formats; else 0).
    pub s: u64,
    pub fmt: i32,
    pub group_rows: i32,
}

impl Buf {
    /// This storage as a kernel operand (`None`: its scale grids are taller than the
    /// kernels' `int` rows).
    pub(crate) fn operand(&self) -> Option<WeightOperand> {
        let plain = |w, fmt| WeightOperand {
            w,
            s: 0,
            fmt,
            group_rows: 0,
        };
        Some(match self {
            Buf::F32(b) => plain(b.ptr(), WF_F32),
            Buf::Bf16(b) => plain(b.ptr(), WF_BF16),
            Buf::Stored(st) => WeightOperand {
                w: st.q.ptr(),
                s: st.s.ptr(),
                fmt: st.fmt(),
                group_rows: i32::try_from(st.group_rows).ok()?,
            },
        })
    }
}

impl StoredBuf {
    /// The kernels' `fmt` code (`WF_FP8` / `WF_FP4` in cu/common.cuh).
    pub(crate) fn fmt(&self) -> i32 {
        match self.format {
            WeightFormat::Fp8Block => WF_FP8,
            _ => WF_FP4,
        }
    }

    /// Device addresses of the values and scales of the rows from `row0` on (`cols`
    /// columns), with `row0` at the start of a scale grid (an expert's first row).
    pub(crate) fn rows_from(&self, row0: usize, cols: usize) -> Option<(u64, u64)> {
        if !row0.is_multiple_of(self.group_rows.max(1)) {
            return None;
        }
        let (sr, sc) = StoredWeight::scale_grid(self.format, self.group_rows, cols);
        let q = row0 * StoredWeight::row_bytes(self.format, cols);
        let s = (row0 / self.group_rows) * sr * sc;
        Some((self.q.ptr() + q as u64, self.s.ptr() + s as u64))
    }
}

/// A row-major 2-D tensor on the device.
///
/// Kernels write a tensor's buffer only while they make it (an output freshly allocated)
/// or through `&mut` (rope in place, which drops the bf16 copy below): what a shared
/// reference reads never changes, so its bf16 rounding may be kept.
#[derive(Debug)]
pub struct GpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub buf: Buf,
    /// An fp32 activation rounded to bf16, made by the first bf16 GEMM that reads it and
    /// kept for the next ones (q_a, kv and four compressor projections read one normed
    /// hidden state; it was rounded once per GEMM).
    bf16: OnceLock<DevMem<u16>>,
    /// An FP8 weight's block scales as f32 in the layout cuBLASLt's FP8 GEMM reads, made by
    /// the first FP8 linear over it and kept with the weight (`ops::fp8_linear`).
    fp8_scales: OnceLock<(OperandScales, DevMem<f32>)>,
}

impl GpuTensor {
    pub(crate) fn new(rows: usize, cols: usize, buf: Buf) -> Self {
        GpuTensor {
            rows,
            cols,
            buf,
            bf16: OnceLock::new(),
            fp8_scales: OnceLock::new(),
        }
    }

    /// The kept FP8 GEMM scales and their layout, if a linear made them.
    pub(crate) fn fp8_scales(&self) -> Option<&(OperandScales, DevMem<f32>)> {
        self.fp8_scales.get()
    }

    /// Keeps `scales` (in `layout`) as this weight's FP8 GEMM scales (the first kept stay).
    pub(crate) fn keep_fp8_scales(
        &self,
        layout: OperandScales,
        scales: DevMem<f32>,
    ) -> &(OperandScales, DevMem<f32>) {
        self.fp8_scales.get_or_init(|| (layout, scales))
    }

    /// The kept bf16 rounding, if a GEMM made one.
    pub(crate) fn bf16_copy(&self) -> Option<&DevMem<u16>> {
        self.bf16.get()
    }

    /// Keeps `copy` as this tensor's bf16 rounding (the first one kept stays).
    pub(crate) fn keep_bf16_copy(&self, copy: DevMem<u16>) -> &DevMem<u16> {
        self.bf16.get_or_init(|| copy)
    }

    /// Drops the kept bf16 rounding: the caller is about to write the values in place.
    pub(crate) fn written_in_place(&mut self) {
        self.bf16.take();
    }

    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_bf16(&self) -> bool {
        matches!(self.buf, Buf::Bf16(_))
    }

    /// The stored-format weight, if this is one.
    pub fn stored(&self) -> Option<&StoredBuf> {
        match &self.buf {
            Buf::Stored(s) => Some(s),
            _ => None,
        }
    }
}

/// Storage of uploaded weight matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// bf16 matrices (the router and hyper-connection maps stay fp32); bf16 GEMMs with
    /// fp32 accumulation.
    #[default]
    Bf16,
    /// Everything fp32, fp32 GEMMs: a reference mode for checking kernels.
    F32,
}

impl std::str::FromStr for WeightDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" | "bfloat16" => Ok(WeightDtype::Bf16),
            "f32" | "fp32" | "float32" => Ok(WeightDtype::F32),
            other => Err(format!(
                "unknown weight dtype `{other}` (expected bf16 or f32)"
            )),
        }
    }
}

/// Whether an uploaded tensor is stored in bf16: matrices (weights used by GEMMs and the
/// expert kernels) are; vectors (norm weights, sinks, biases, hyper-connection scales)
/// stay fp32.
pub fn stores_bf16(rows: usize, cols: usize) -> bool {
    rows >= 2 && cols >= 2
}
