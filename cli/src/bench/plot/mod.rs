//! SVG figures of `bench decode` and `bench prefill` rows against their ceilings, drawn
//! from the same record their `--json` file holds, so `bench plot` redraws a recorded run
//! exactly as the run drew it. plotters' SVG backend writes text as `<text>` elements and
//! reads no fonts, so the figures build and render on a machine with none installed.

mod decode;
mod prefill;

pub use decode::decode_svg;
pub use prefill::prefill_svg;

use super::decode::DecodeRecord;
use super::prefill::PrefillRecord;
use anyhow::{bail, Context, Result};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// `bench plot` flags.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// A file written by `bench decode --json` or `bench prefill --json`.
    #[arg(long)]
    pub json: PathBuf,
    /// The SVG file to write.
    #[arg(long)]
    pub out: PathBuf,
}

/// A recorded run, told apart by its ceiling (decode: memory bandwidth; prefill: GEMM rate).
pub enum Recorded {
    Decode(DecodeRecord),
    Prefill(PrefillRecord),
}

impl Recorded {
    pub fn parse(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        if v.get("memory_bandwidth_bytes_per_s").is_some() {
            Ok(Self::Decode(
                serde_json::from_value(v).context("bench decode record")?,
            ))
        } else if v.get("gemm_flops_per_s").is_some() {
            Ok(Self::Prefill(
                serde_json::from_value(v).context("bench prefill record")?,
            ))
        } else {
            bail!("not a `bench decode --json` or `bench prefill --json` file (no memory_bandwidth_bytes_per_s or gemm_flops_per_s)")
        }
    }

    pub fn svg(&self) -> Result<String> {
        match self {
            Self::Decode(r) => decode_svg(r),
            Self::Prefill(r) => prefill_svg(r),
        }
    }
}

pub fn run(a: &PlotArgs) -> Result<()> {
    super::check_output(Some(&a.out), "--out")?;
    let text = std::fs::read_to_string(&a.json)
        .with_context(|| format!("reading {}", a.json.display()))?;
    let svg = Recorded::parse(&text)
        .with_context(|| format!("--json {}", a.json.display()))?
        .svg()?;
    write_svg(&a.out, &svg)?;
    println!("plot: {}", a.out.display());
    Ok(())
}

pub fn write_svg(path: &Path, svg: &str) -> Result<()> {
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))
}

/// The values in ascending order, each once.
fn distinct_sorted(values: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

/// The items in order of first appearance, each once.
fn distinct<T: PartialEq>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for i in items {
        if !out.contains(&i) {
            out.push(i);
        }
    }
    out
}

/// A log axis around the positive finite values, a quarter of a step of margin each side
/// (so one value still spans a range).
fn log_range(values: impl Iterator<Item = f64>, what: &str) -> Result<Range<f64>> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if hi == 0.0 {
        bail!("no positive {what} to plot");
    }
    Ok(lo / 1.25..hi * 1.25)
}

/// Pixels of one panel.
const PANEL: (u32, u32) = (760, 520);
const FONT: &str = "sans-serif";

/// What the figure tests read back from an SVG: its text lines and its circles by radius.
#[cfg(test)]
pub(crate) mod svg_check {
    #![allow(clippy::unwrap_used)]

    /// Every `<text>` element's text, trimmed.
    pub fn texts(svg: &str) -> Vec<String> {
        let doc = roxmltree::Document::parse(svg).unwrap();
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| n.text().unwrap_or("").trim().to_string())
            .collect()
    }

    /// How many `<circle>`s of radius `r`, filled or hollow.
    pub fn circles(svg: &str, r: &str, filled: bool) -> usize {
        let doc = roxmltree::Document::parse(svg).unwrap();
        doc.descendants()
            .filter(|n| n.has_tag_name("circle") && n.attribute("r") == Some(r))
            .filter(|n| (n.attribute("fill") != Some("none")) == filled)
            .count()
    }

    pub fn count(texts: &[String], want: &str) -> usize {
        texts.iter().filter(|t| *t == want).count()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ranges_widen_around_positive_values_and_refuse_none() {
        let r = log_range([4.0, 0.0, f64::NAN, 1.0].into_iter(), "ms").unwrap();
        assert_eq!(r, 0.8..5.0);
        let e = log_range([0.0, -1.0].into_iter(), "ms")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "no positive ms to plot");
        assert_eq!(distinct_sorted([8.0, 1.0, 8.0].into_iter()), vec![1.0, 8.0]);
        assert_eq!(distinct(["b", "a", "b"].into_iter()), vec!["b", "a"]);
    }

    #[test]
    fn a_file_of_neither_bench_is_refused() {
        let e = Recorded::parse(r#"{"rows": []}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a `bench decode --json`"), "{e}");
        let e = Recorded::parse(r#"{"gemm_flops_per_s": 1.0}"#)
            .err()
            .unwrap();
        assert!(format!("{e:#}").contains("missing field"), "{e:#}");
    }
}
