//! Pool sizes from flags: device pool by page count or memory fraction, host pool by
//! ratio to the device pool or by size. All byte figures come from the [`KvLayout`].

use super::KvLayout;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SizingError {
    #[error("--hicache-ratio {0} is below 1: the host pool must hold at least as many pages as the device pool")]
    RatioBelowOne(f64),
    #[error("--hicache-size {gb} GB holds {pages} pages of {page_bytes} B, fewer than the device pool's {device_pages}")]
    HostSmallerThanDevice {
        gb: f64,
        pages: usize,
        page_bytes: usize,
        device_pages: usize,
    },
    #[error("{what} needs {need} bytes but only {available} bytes of memory are available")]
    DoesNotFit {
        what: &'static str,
        need: u128,
        available: u64,
    },
    #[error("--kv-mem-fraction {0} must be in (0, 1]")]
    BadFraction(f64),
    #[error("the {what} would hold no pages ({detail})")]
    Empty { what: &'static str, detail: String },
}

/// How to size the device pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceSize {
    Pages(usize),
    /// This fraction of `memory_bytes` (the device's memory), minus the state slots.
    MemFraction {
        fraction: f64,
        memory_bytes: u64,
    },
}

/// How to size the host pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HostSize {
    /// host pages = ratio x device pages (ratio >= 1).
    Ratio(f64),
    /// This many GB (10^9 bytes).
    Gb(f64),
}

pub fn device_pages(
    layout: &KvLayout,
    size: DeviceSize,
    states: usize,
) -> Result<usize, SizingError> {
    let pages = match size {
        DeviceSize::Pages(n) => n,
        DeviceSize::MemFraction {
            fraction,
            memory_bytes,
        } => {
            if !(fraction > 0.0 && fraction <= 1.0) {
                return Err(SizingError::BadFraction(fraction));
            }
            let budget = (memory_bytes as f64 * fraction) as u128;
            let state = (states * layout.state_bytes) as u128;
            (budget.saturating_sub(state) / layout.page_bytes as u128) as usize
        }
    };
    if pages == 0 {
        return Err(SizingError::Empty {
            what: "device KV pool",
            detail: format!("{size:?}, page of {} B", layout.page_bytes),
        });
    }
    Ok(pages)
}

/// Host pages for `size`; `available` is the host memory left for it, if known.
pub fn host_pages(
    layout: &KvLayout,
    device_pages: usize,
    size: HostSize,
    available: Option<u64>,
) -> Result<usize, SizingError> {
    let pages = match size {
        HostSize::Ratio(r) => {
            if r.is_nan() || r < 1.0 {
                return Err(SizingError::RatioBelowOne(r));
            }
            (device_pages as f64 * r).floor() as usize
        }
        HostSize::Gb(gb) => {
            let pages = (gb * 1e9 / layout.page_bytes as f64).floor() as usize;
            if pages < device_pages || pages == 0 {
                return Err(SizingError::HostSmallerThanDevice {
                    gb,
                    pages,
                    page_bytes: layout.page_bytes,
                    device_pages,
                });
            }
            pages
        }
    };
    let need = pages as u128 * layout.page_bytes as u128;
    if let Some(available) = available {
        if need > available as u128 {
            return Err(SizingError::DoesNotFit {
                what: "the host KV pool",
                need,
                available,
            });
        }
    }
    Ok(pages)
}

/// `MemAvailable` from /proc/meminfo (None where unknown).
pub fn host_memory_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::ModelConfig;
    use crate::kv::KvLayoutSpec;

    fn layout() -> KvLayout {
        let cfg = ModelConfig::from_json_str(r#"{"model_type": "deepseek_v4"}"#).unwrap();
        KvLayout::new(&cfg, KvLayoutSpec::default_for(&cfg)).unwrap()
    }

    #[test]
    fn sizes_come_from_the_layout() {
        let l = layout();
        let (pb, sb) = (l.page_bytes as u64, l.state_bytes as u64);
        let mem = 100 * pb + 4 * sb + pb / 2;
        let size = DeviceSize::MemFraction {
            fraction: 1.0,
            memory_bytes: mem,
        };
        assert_eq!(device_pages(&l, size, 4).unwrap(), 100);
        assert_eq!(device_pages(&l, DeviceSize::Pages(7), 4).unwrap(), 7);
        assert!(matches!(
            device_pages(&l, DeviceSize::Pages(0), 4),
            Err(SizingError::Empty { .. })
        ));
        assert_eq!(host_pages(&l, 10, HostSize::Ratio(1.5), None).unwrap(), 15);
        assert_eq!(
            host_pages(&l, 10, HostSize::Ratio(0.99), None),
            Err(SizingError::RatioBelowOne(0.99))
        );
        let gb = (12 * pb) as f64 / 1e9;
        assert_eq!(host_pages(&l, 10, HostSize::Gb(gb), None).unwrap(), 12);
        assert!(matches!(
            host_pages(&l, 13, HostSize::Gb(gb), None),
            Err(SizingError::HostSmallerThanDevice { pages: 12, .. })
        ));
        assert!(matches!(
            host_pages(&l, 10, HostSize::Ratio(2.0), Some(19 * pb)),
            Err(SizingError::DoesNotFit { .. })
        ));
    }
}
