//! Hyper-connection ops of [`CudaBackend`].

use crate::buf::{f32_buf, out_ptr, shape_err};
use crate::device::{Gpu, HC_PRE_SHARED};
use crate::kernels::{self, DevPtr};
use crate::ops::dense;
use crate::ops::tensors::{new_f32, param_f32};
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{shapes, BResult, HcParams, HcPre};

/// Largest `hc_mult` the kernels hold in shared memory (`HC_MAX` in hc.cu).
const HC_MAX: usize = 16;

/// The kernels' own limit on top of the shared shape checks.
fn check_hc_max(op: &'static str, hc: usize) -> BResult<()> {
    if hc > HC_MAX {
        return Err(shape_err(
            op,
            format!("hc {hc} exceeds the kernels' limit {HC_MAX}"),
        ));
    }
    Ok(())
}

pub fn hc_pre(
    g: &Gpu,
    streams: &GpuTensor,
    mix: &GpuTensor,
    p: &HcParams<'_, GpuTensor>,
) -> BResult<HcPre<GpuTensor>> {
    launch_hc_pre(g, streams, mix, p, None)
}

/// [`hc_pre`] of the mix `rms_norm(streams) @ fn_^T`: the GEMM on the raw rows, each row's
/// norm (`norm_eps`) computed and applied inside `k_hc_pre` (the values of
/// `rms_norm_matmul` then [`hc_pre`], bit for bit, with one pass over the streams and two
/// launches fewer).
pub fn hc_pre_mixed(
    g: &Gpu,
    streams: &GpuTensor,
    fn_: &GpuTensor,
    norm_eps: f32,
    p: &HcParams<'_, GpuTensor>,
) -> BResult<HcPre<GpuTensor>> {
    let mix = dense::matmul(g, streams, fn_)?;
    launch_hc_pre(g, streams, &mix, p, Some(norm_eps))
}

fn launch_hc_pre(
    g: &Gpu,
    streams: &GpuTensor,
    mix: &GpuTensor,
    p: &HcParams<'_, GpuTensor>,
    norm_eps: Option<f32>,
) -> BResult<HcPre<GpuTensor>> {
    let hc = p.hc;
    shapes::check_hc_pre(
        (streams.rows, streams.cols),
        (mix.rows, mix.cols),
        p.base.len(),
        p.scale.len(),
        hc,
    )?;
    check_hc_max("hc_pre", hc)?;
    let (n, h) = (streams.rows, streams.cols / hc);
    let base = param_f32(g, p.base)?;
    let scale = param_f32(g, p.scale)?;
    let post = new_f32(g, n, hc)?;
    let comb = new_f32(g, n, hc * hc)?;
    let collapsed = new_f32(g, n, h)?;
    // With the norm, the row stays in shared memory between the kernel's two passes where
    // it fits (the kernel falls back to reading it twice where its rows are not 16-byte).
    let row_bytes = streams.cols * std::mem::size_of::<f32>();
    let (norm, shared) = match norm_eps {
        None => (0, 0),
        Some(_) if row_bytes <= HC_PRE_SHARED => (2, row_bytes as u32),
        Some(_) => (1, 0),
    };
    g.launch(
        (n as u32, 1, 1),
        shared,
        &kernels::HcPre {
            streams: DevPtr::of(f32_buf(streams, "hc_pre")?),
            mix: DevPtr::of(f32_buf(mix, "hc_pre")?),
            base: DevPtr::of(&base),
            scale: DevPtr::of(&scale),
            post: out_ptr(&post)?,
            comb: out_ptr(&comb)?,
            collapsed: out_ptr(&collapsed)?,
            h: h as i32,
            hc: hc as i32,
            iters: p.sinkhorn_iters as i32,
            eps: p.eps,
            norm,
            norm_eps: norm_eps.unwrap_or(0.0),
        },
    )?;
    Ok(HcPre {
        post,
        comb,
        collapsed,
    })
}

pub fn hc_post(
    g: &Gpu,
    streams: &GpuTensor,
    out: &GpuTensor,
    pre: &HcPre<GpuTensor>,
    hc: usize,
) -> BResult<GpuTensor> {
    let h = out.cols;
    shapes::check_hc_post(
        (streams.rows, streams.cols),
        (out.rows, out.cols),
        pre.post.len(),
        pre.comb.len(),
        hc,
    )?;
    let res = new_f32(g, streams.rows, streams.cols)?;
    g.launch(
        (streams.rows as u32, 1, 1),
        0,
        &kernels::HcPost {
            streams: DevPtr::of(f32_buf(streams, "hc_post")?),
            out: DevPtr::of(f32_buf(out, "hc_post")?),
            post: DevPtr::of(f32_buf(&pre.post, "hc_post")?),
            comb: DevPtr::of(f32_buf(&pre.comb, "hc_post")?),
            res: out_ptr(&res)?,
            h: h as i32,
            hc: hc as i32,
        },
    )?;
    Ok(res)
}

pub fn hc_head(
    g: &Gpu,
    streams: &GpuTensor,
    mix: &GpuTensor,
    p: &HcParams<'_, GpuTensor>,
) -> BResult<GpuTensor> {
    let hc = p.hc;
    shapes::check_hc_head(
        (streams.rows, streams.cols),
        (mix.rows, mix.cols),
        p.base.len(),
        p.scale.len(),
        hc,
    )?;
    check_hc_max("hc_head", hc)?;
    let h = streams.cols / hc;
    let base = param_f32(g, p.base)?;
    let scale = param_f32(g, p.scale)?;
    let out = new_f32(g, streams.rows, h)?;
    g.launch(
        (streams.rows as u32, 1, 1),
        0,
        &kernels::HcHead {
            streams: DevPtr::of(f32_buf(streams, "hc_head")?),
            mix: DevPtr::of(f32_buf(mix, "hc_head")?),
            base: DevPtr::of(&base),
            scale: DevPtr::of(&scale),
            out: out_ptr(&out)?,
            h: h as i32,
            hc: hc as i32,
            eps: p.eps,
        },
    )?;
    Ok(out)
}
