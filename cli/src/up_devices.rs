//! Which device each server of `pdserve up` runs on: `--device` for all of them, or
//! `--prefill-device` / `--decode-device` per role. `cuda` (and `auto` where a GPU exists)
//! hands the GPUs out in order, the prefill servers first, then the decode servers,
//! wrapping around: one prefill and one decode server on two GPUs get cuda:0 and cuda:1,
//! so each process owns its GPU's pool, which is the point of disaggregation.

use crate::engine_spec::Device;
use anyhow::{bail, Result};

/// One server's device as `up` was asked for it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Choice {
    /// Whatever the server's own flags or config say (nothing is passed).
    Own,
    /// This device, passed as `--device`.
    Fixed(String),
    /// The next GPU in order.
    NextGpu,
}

fn parse(flag: &str, v: &str, gpus: usize) -> Result<Choice> {
    let v = v.trim();
    match v {
        "cuda" => match gpus {
            0 => bail!("{flag} cuda: no CUDA device found (use cpu, or auto to fall back)"),
            _ => Ok(Choice::NextGpu),
        },
        "auto" if gpus > 0 => Ok(Choice::NextGpu),
        "auto" => Ok(Choice::Fixed("cpu".into())),
        _ => match v.parse::<Device>() {
            Ok(Device::Cuda(n)) if n >= gpus => bail!(
                "{flag} {v}: {gpus} CUDA device(s) found (cuda:0 to cuda:{})",
                gpus.max(1) - 1
            ),
            Ok(_) => Ok(Choice::Fixed(v.to_string())),
            Err(e) => bail!("{flag}: {e}"),
        },
    }
}

/// Each role's list: one value per server, or one value for all of them.
fn role_choices(
    flag: &str,
    values: &[String],
    all: Option<&str>,
    servers: usize,
    gpus: usize,
) -> Result<Vec<Choice>> {
    let one = |v: &str| parse(flag, v, gpus);
    match (values.len(), all) {
        (0, None) => Ok(vec![Choice::Own; servers]),
        (0, Some(a)) => Ok(vec![one(a)?; servers]),
        (1, _) => Ok(vec![one(&values[0])?; servers]),
        (n, _) if n == servers => values.iter().map(|v| one(v)).collect(),
        (n, _) => bail!("{flag}: {n} devices for {servers} servers (give one, or one per server)"),
    }
}

/// The `--device` value of every prefill server, then every decode server (`None`: pass
/// nothing). `gpus` is how many CUDA devices this machine has.
#[derive(Debug, PartialEq, Eq)]
pub struct Placement {
    pub prefill: Vec<Option<String>>,
    pub decode: Vec<Option<String>>,
}

pub struct DeviceFlags<'a> {
    pub device: Option<&'a str>,
    pub prefill_device: &'a [String],
    pub decode_device: &'a [String],
    pub prefill: usize,
    pub decode: usize,
}

impl DeviceFlags<'_> {
    /// Whether any device flag was given (only then does `up` need to count GPUs).
    pub fn given(&self) -> bool {
        self.device.is_some() || !self.prefill_device.is_empty() || !self.decode_device.is_empty()
    }

    pub fn place(&self, gpus: usize) -> Result<Placement> {
        let p = role_choices(
            "--prefill-device",
            self.prefill_device,
            self.device,
            self.prefill,
            gpus,
        )?;
        let d = role_choices(
            "--decode-device",
            self.decode_device,
            self.device,
            self.decode,
            gpus,
        )?;
        let mut next = 0usize;
        let mut resolve = |c: Choice| match c {
            Choice::Own => None,
            Choice::Fixed(v) => Some(v),
            Choice::NextGpu => {
                let n = next % gpus.max(1);
                next += 1;
                Some(format!("cuda:{n}"))
            }
        };
        let prefill = p.into_iter().map(&mut resolve).collect();
        let decode = d.into_iter().map(&mut resolve).collect();
        Ok(Placement { prefill, decode })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn place(
        device: Option<&str>,
        pd: &[&str],
        dd: &[&str],
        servers: (usize, usize),
        gpus: usize,
    ) -> Result<Placement> {
        let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (pv, dv) = (owned(pd), owned(dd));
        DeviceFlags {
            device,
            prefill_device: &pv,
            decode_device: &dv,
            prefill: servers.0,
            decode: servers.1,
        }
        .place(gpus)
    }

    fn some(v: &[&str]) -> Vec<Option<String>> {
        v.iter().map(|s| Some(s.to_string())).collect()
    }

    #[test]
    fn cuda_hands_gpus_out_prefill_first() {
        let p = place(Some("cuda"), &[], &[], (1, 1), 2).unwrap();
        assert_eq!(p.prefill, some(&["cuda:0"]));
        assert_eq!(p.decode, some(&["cuda:1"]));
        // One GPU: both share it.
        let p = place(Some("cuda"), &[], &[], (1, 1), 1).unwrap();
        assert_eq!(
            (p.prefill, p.decode),
            (some(&["cuda:0"]), some(&["cuda:0"]))
        );
        // More servers than GPUs wrap around; more GPUs than servers leave the rest idle.
        let p = place(Some("cuda"), &[], &[], (2, 2), 3).unwrap();
        assert_eq!(p.prefill, some(&["cuda:0", "cuda:1"]));
        assert_eq!(p.decode, some(&["cuda:2", "cuda:0"]));
        let p = place(Some("auto"), &[], &[], (1, 1), 8).unwrap();
        assert_eq!(p.decode, some(&["cuda:1"]));
    }

    #[test]
    fn per_role_flags_override_device() {
        let p = place(Some("cuda"), &[], &["cuda:3"], (1, 2), 4).unwrap();
        assert_eq!(p.prefill, some(&["cuda:0"]));
        assert_eq!(p.decode, some(&["cuda:3", "cuda:3"]));
        let p = place(None, &["cpu", "cuda:1"], &[], (2, 1), 2).unwrap();
        assert_eq!(p.prefill, some(&["cpu", "cuda:1"]));
        assert_eq!(
            p.decode,
            vec![None],
            "no flag for the role: the server's own"
        );
        let p = place(None, &[], &[], (1, 1), 0).unwrap();
        assert_eq!((p.prefill, p.decode), (vec![None], vec![None]));
    }

    #[test]
    fn refusals_name_the_flag() {
        let err = |r: Result<Placement>| r.unwrap_err().to_string();
        let e = err(place(Some("cuda"), &[], &[], (1, 1), 0));
        assert!(e.contains("--prefill-device cuda: no CUDA device"), "{e}");
        let e = err(place(None, &[], &["cuda:2"], (1, 1), 2));
        assert!(
            e.contains("--decode-device cuda:2: 2 CUDA device(s)"),
            "{e}"
        );
        let e = err(place(None, &["cpu", "cpu", "cpu"], &[], (2, 1), 0));
        assert!(
            e.contains("--prefill-device: 3 devices for 2 servers"),
            "{e}"
        );
        let e = err(place(Some("tpu"), &[], &[], (1, 1), 0));
        assert!(e.contains("unknown device `tpu`"), "{e}");
        // auto without a GPU is the CPU, as for the servers themselves.
        let p = place(Some("auto"), &[], &[], (1, 1), 0).unwrap();
        assert_eq!(p.prefill, some(&["cpu"]));
    }
}
