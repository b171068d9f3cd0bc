//! Sampling on the device: the greedy token of each logits row (`k_argmax_rows`), so a
//! decode step copies ids back instead of its logits.

use crate::buf::f32_buf;
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::launch::BLOCK;
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{BResult, RowArgmax};

/// Launch the argmax of every row of `logits`; the result (`2 * rows` values: ids, then
/// all-finite flags) is read back with [`row_argmax`]. Each row is scanned in `parts`
/// slices by separate blocks (enough blocks to fill the device at batch 1: one block per
/// 129280-wide row took 0.18 ms), then the slices are merged in order, which gives the
/// sequential scan's id for any split. Inside a decode step the buffers are step
/// temporaries, so a captured graph writes them on every replay.
pub(crate) fn argmax_rows(g: &Gpu, logits: &GpuTensor) -> BResult<DevMem<i32>> {
    let (rows, cols) = (logits.rows, logits.cols);
    let parts = (2 * g.sms)
        .div_ceil(rows.max(1))
        .clamp(1, cols.div_ceil(MIN_SPAN).max(1));
    let span = cols.div_ceil(parts);
    let part_v = g.uninit::<f32>(rows * parts)?;
    let part_i = g.uninit::<i32>(rows * parts)?;
    let part_f = g.uninit::<i32>(rows * parts)?;
    g.launch(
        (rows as u32, parts as u32, 1),
        0,
        &kernels::ArgmaxParts {
            logits: DevPtr::of(f32_buf(logits, "argmax_rows")?),
            cols: cols as i32,
            span: span as i32,
            part_v: DevPtr::of(&part_v),
            part_i: DevPtr::of(&part_i),
            part_f: DevPtr::of(&part_f),
        },
    )?;
    let out = g.uninit::<i32>(2 * rows)?;
    g.launch(
        (rows.div_ceil(BLOCK as usize) as u32, 1, 1),
        0,
        &kernels::ArgmaxRows {
            part_v: DevPtr::of(&part_v),
            part_i: DevPtr::of(&part_i),
            part_f: DevPtr::of(&part_f),
            parts: parts as i32,
            rows: rows as i32,
            out: DevPtr::of(&out),
        },
    )?;
    Ok(out)
}

/// The narrowest slice of a row one block scans.
const MIN_SPAN: usize = 2048;

/// Row `r`'s argmax from [`argmax_rows`]'s values `raw` over `rows` rows.
pub(crate) fn row_argmax(raw: &[i32], rows: usize, r: usize) -> RowArgmax {
    RowArgmax {
        token: u32::try_from(raw[r]).ok(),
        finite: raw[rows + r] != 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_then_flags_and_minus_one_for_no_token() {
        let raw = [7, -1, 1, 0];
        assert_eq!(
            row_argmax(&raw, 2, 0),
            RowArgmax {
                token: Some(7),
                finite: true
            }
        );
        assert_eq!(
            row_argmax(&raw, 2, 1),
            RowArgmax {
                token: None,
                finite: false
            }
        );
    }
}
