//! What `bench decode`'s steps send back: the greedy token of every row (`--sample
//! device`, the default: on CUDA the argmax runs inside the step and only ids come back,
//! as the decode server does for greedy requests) or every row's logits (`--sample host`,
//! what a server sampling on the host copies). The first warmup step of every row asks for
//! both and requires the device's argmax to equal the host's of the same logits.

use anyhow::{bail, Result};
use pdserve_engine::backend::{RowArgmax, RowOut, StepOutput};

/// Where the bench's decode steps sample.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sample {
    /// The greedy token of each row, computed by the backend (device argmax on CUDA).
    Device,
    /// Each row's logits copied back to the host.
    Host,
}

/// Per row of a `batch`-row step, what it sends back; `check`: both, for
/// [`finite_checked`] to compare.
pub fn row_outs(sample: Sample, batch: usize, check: bool) -> Vec<RowOut> {
    let out = match (sample, check) {
        (Sample::Device, true) => RowOut::BOTH,
        (Sample::Device, false) => RowOut::ARGMAX,
        (Sample::Host, _) => RowOut::LOGITS,
    };
    vec![out; batch]
}

/// Whether every logit of the step was finite (for argmax-only rows, as the backend saw
/// them); fails where a row that returned both differs: its argmax against the host's
/// argmax of its logits.
pub fn finite_checked(outs: &[RowOut], out: &StepOutput) -> Result<bool> {
    if out.argmax.len() != outs.len() {
        bail!(
            "a decode step returned {} rows for {}",
            out.argmax.len(),
            outs.len()
        );
    }
    let mut rows = out.logits.data.chunks(out.logits.cols.max(1));
    let mut finite = true;
    for (r, (o, device)) in outs.iter().zip(&out.argmax).enumerate() {
        let row = if o.logits { rows.next() } else { None };
        match (row, device) {
            (Some(row), Some(device)) => {
                let host = RowArgmax::of(row);
                if host != *device {
                    bail!("row {r}: the device argmax is {device:?}, the host's of the same logits {host:?}");
                }
                finite &= host.finite;
            }
            (Some(row), None) => finite &= row.iter().all(|v| v.is_finite()),
            (None, Some(device)) => finite &= device.finite,
            (None, None) => {}
        }
    }
    Ok(finite)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use pdserve_engine::backend::HostTensor;

    fn out(logits: Vec<f32>, argmax: Vec<Option<RowArgmax>>) -> StepOutput {
        StepOutput {
            logits: HostTensor {
                rows: logits.len() / 2,
                cols: 2,
                data: logits,
            },
            argmax,
        }
    }

    #[test]
    fn a_device_argmax_must_match_the_host_argmax_of_its_row() {
        let ok = |t| {
            Some(RowArgmax {
                token: Some(t),
                finite: true,
            })
        };
        let outs = row_outs(Sample::Device, 2, true);
        assert!(finite_checked(&outs, &out(vec![1.0, 2.0, 3.0, 3.0], vec![ok(1), ok(0)])).unwrap());
        let err = finite_checked(&outs, &out(vec![1.0, 2.0, 3.0, 3.0], vec![ok(1), ok(1)]));
        assert!(err.unwrap_err().to_string().contains("row 1"));
        // Argmax-only rows report the backend's finiteness; logits-only rows their own.
        let inf = Some(RowArgmax {
            token: Some(0),
            finite: false,
        });
        assert!(
            !finite_checked(&row_outs(Sample::Device, 1, false), &out(vec![], vec![inf])).unwrap()
        );
        let host = row_outs(Sample::Host, 1, true);
        assert!(!finite_checked(&host, &out(vec![f32::NAN, 0.0], vec![None])).unwrap());
        assert!(finite_checked(&host, &out(vec![], vec![])).is_err());
    }
}
