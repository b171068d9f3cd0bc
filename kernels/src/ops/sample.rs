//! Sampling on the device: the greedy token of each logits row (`k_argmax_rows`), so a
//! decode step copies ids back instead of its logits.

use crate::buf::f32_buf;
use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::kernels::{self, DevPtr};
use crate::tensor::GpuTensor;
use pdserve_engine::backend::{BResult, RowArgmax};

/// Launch the argmax of every row of `logits`; the result (`2 * rows` values: ids, then
/// all-finite flags) is read back with [`row_argmaxes`]. Inside a decode step the buffer
/// is a step temporary, so a captured graph writes it on every replay.
pub(crate) fn argmax_rows(g: &Gpu, logits: &GpuTensor) -> BResult<DevMem<i32>> {
    let rows = logits.rows;
    let out = g.uninit::<i32>(2 * rows)?;
    g.launch(
        (rows as u32, 1, 1),
        0,
        &kernels::ArgmaxRows {
            logits: DevPtr::of(f32_buf(logits, "argmax_rows")?),
            cols: logits.cols as i32,
            out: DevPtr::of(&out),
        },
    )?;
    Ok(out)
}

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
