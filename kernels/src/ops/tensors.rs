//! Device tensors in and out: host uploads and downloads, fp32 outputs, fp32 views of
//! parameters and the bf16 rounding of GEMM inputs.

use crate::buf::{f32_buf, shape_err};
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::launch::grid_1d;
use crate::ops::stored;
use crate::tensor::{Buf, GpuTensor};
use pdserve_engine::backend::{BResult, HostTensor};

/// `t` on the device, stored bf16 when `bf16` (else fp32).
pub(crate) fn upload(g: &Gpu, t: HostTensor, bf16: bool) -> BResult<GpuTensor> {
    if t.data.len() != t.rows * t.cols {
        return Err(shape_err(
            "upload",
            format!("{}x{} with {} values", t.rows, t.cols, t.data.len()),
        ));
    }
    let buf = if bf16 {
        let bits: Vec<u16> = t
            .data
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        Buf::Bf16(g.upload(&bits)?)
    } else {
        Buf::F32(g.upload(&t.data)?)
    };
    Ok(GpuTensor::new(t.rows, t.cols, buf))
}

/// `t` copied to the host as fp32 values.
pub(crate) fn to_host(g: &Gpu, t: &GpuTensor) -> BResult<HostTensor> {
    let data = match &t.buf {
        Buf::F32(s) => g.download(s, t.len())?,
        Buf::Bf16(s) => widen(g.download(s, t.len())?),
        Buf::Stored(w) => widen(g.download(&stored::dequant(g, t, w)?, t.len())?),
    };
    Ok(HostTensor {
        rows: t.rows,
        cols: t.cols,
        data,
    })
}

fn widen(bits: Vec<u16>) -> Vec<f32> {
    bits.into_iter()
        .map(|b| half::bf16::from_bits(b).to_f32())
        .collect()
}

/// Widens `n` bf16 values at device address `x` into fp32 values at `y`.
pub(crate) fn bf16_to_f32(g: &Gpu, x: u64, y: u64, n: usize) -> BResult<()> {
    g.launch(
        grid_1d(n),
        0,
        &kernels::Bf16ToF32 {
            x: DevPtr(x),
            y: DevPtr(y),
            n: n as i64,
        },
    )
}

/// An fp32 output tensor; every caller's kernel writes all of it.
pub(crate) fn new_f32(g: &Gpu, rows: usize, cols: usize) -> BResult<GpuTensor> {
    let buf = Buf::F32(g.uninit::<f32>(rows * cols)?);
    Ok(GpuTensor::new(rows, cols, buf))
}

/// An fp32 view of a parameter (bf16 parameters are widened into a new buffer).
pub(crate) fn param_f32(g: &Gpu, t: &GpuTensor) -> BResult<DevMem<f32>> {
    match &t.buf {
        Buf::F32(s) => Ok(DevMem::view(s.ptr(), s.len())),
        Buf::Bf16(s) => {
            let out = g.uninit::<f32>(t.len())?;
            bf16_to_f32(g, s.ptr(), out.ptr(), t.len())?;
            Ok(out)
        }
        Buf::Stored(_) => Err(shape_err(
            "param_f32",
            format!(
                "a stored FP8/FP4 [{}x{}] weight is not a vector parameter",
                t.rows, t.cols
            ),
        )),
    }
}

/// The activation `t` as a bf16 GEMM input: itself if bf16 (the attention's output), else
/// its fp32 values rounded, made once per tensor and kept with it for the GEMMs that read
/// it next.
pub(crate) fn bf16_of<'a>(g: &Gpu, t: &'a GpuTensor, op: &'static str) -> BResult<&'a DevMem<u16>> {
    if let Buf::Bf16(b) = &t.buf {
        return Ok(b);
    }
    if let Some(copy) = t.bf16_copy() {
        return Ok(copy);
    }
    let copy = to_bf16(g, f32_buf(t, op)?)?;
    Ok(t.keep_bf16_copy(copy))
}

/// `src` rounded to bf16 (a GEMM input next to bf16 weights).
pub(crate) fn to_bf16(g: &Gpu, src: &DevMem<f32>) -> BResult<DevMem<u16>> {
    let out = g.uninit::<u16>(src.len())?;
    g.launch(
        grid_1d(src.len()),
        0,
        &kernels::F32ToBf16 {
            x: DevPtr::of(src),
            y: DevPtr::of(&out),
            n: src.len() as i64,
        },
    )?;
    Ok(out)
}
