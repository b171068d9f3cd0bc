//! The prefill figure: TFLOP/s against prompt length (log scale), one line per weights
//! format, and the GEMM rates measured in the same run (bf16, and FP8 when a stored FP8
//! format ran) as dashed horizontal lines.

use super::{distinct, distinct_sorted, log_range, FONT, PANEL};
use crate::bench::prefill::PrefillRecord;
use crate::bench::table::num;
use anyhow::Result;
use plotters::prelude::*;

pub fn prefill_svg(rec: &PrefillRecord) -> Result<String> {
    let rows = &rec.rows;
    let formats = distinct(rows.iter().map(|r| r.weights.as_str()));
    let lengths = distinct_sorted(rows.iter().map(|r| r.tokens as f64));
    let x = log_range(lengths.iter().copied(), "prompt lengths")?;
    let gemm = rec.gemm_flops_per_s / 1e12;
    // The legend names each rate's GEMM without its parenthesised details.
    let short = |how: &str| how.split(" (").next().unwrap_or(how).to_string();
    let mut rates = vec![(
        format!("GEMM rate {} TFLOP/s ({})", num(gemm), short(&rec.gemm_how)),
        gemm,
        BLACK,
    )];
    if let Some(f) = rec.fp8_gemm_flops_per_s {
        let how = rec.fp8_gemm_how.as_deref().unwrap_or("FP8");
        let f = f / 1e12;
        rates.push((
            format!("FP8 GEMM rate {} TFLOP/s ({})", num(f), short(how)),
            f,
            RGBColor(110, 110, 110),
        ));
    }
    let top = rows
        .iter()
        .map(|r| r.tflops)
        .chain(rates.iter().map(|r| r.1))
        .fold(0.0, f64::max);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (PANEL.0, PANEL.1 + 40)).into_drawing_area();
        root.fill(&WHITE)?;
        let title = format!(
            "pdserve bench prefill on {}: TFLOP/s against the GEMM rate",
            rec.device
        );
        let root = root.titled(&title, (FONT, 22))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "one sequence per forward, counted FLOPs / seconds",
                (FONT, 16),
            )
            .margin(12)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(
                x.clone().log_scale().with_key_points(lengths.clone()),
                // Room above the highest line for the legend.
                0.0..top * 1.4,
            )?;
        chart
            .configure_mesh()
            .x_desc("prompt tokens")
            .y_desc("TFLOP/s")
            .x_label_formatter(&|t| format!("{t:.0}"))
            .label_style((FONT, 13))
            .light_line_style(TRANSPARENT)
            .draw()?;
        for (fi, &f) in formats.iter().enumerate() {
            let color = Palette99::pick(fi).to_rgba();
            let color = RGBColor(color.0, color.1, color.2);
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.weights == f)
                .map(|r| (r.tokens as f64, r.tflops))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                .label(format!("{f} prefill"))
                .legend(move |(lx, ly)| {
                    EmptyElement::at((lx, ly))
                        + PathElement::new(vec![(0, 0), (20, 0)], color.stroke_width(2))
                        + Circle::new((10, 0), 4, color.filled())
                });
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        for (label, rate, color) in rates {
            let line = vec![(x.start, rate), (x.end, rate)];
            chart
                .draw_series(DashedLineSeries::new(line, 8, 5, color.stroke_width(2)))?
                .label(label)
                .legend(move |(lx, ly)| {
                    EmptyElement::at((lx, ly))
                        + PathElement::new(vec![(0, 0), (8, 0)], color.stroke_width(2))
                        + PathElement::new(vec![(12, 0), (20, 0)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::bench::plot::svg_check::{circles, count, texts};
    use crate::bench::prefill::PrefillRow;

    #[test]
    fn one_line_per_format_and_the_gemm_rate() {
        let rows = ["bf16", "fp8"]
            .iter()
            .flat_map(|w| {
                [1024, 8192, 32768].map(|n| PrefillRow {
                    chunk: n,
                    cut_every: 0,
                    cuts: 0,
                    cut_read_seconds: 0.0,
                    tokens: n,
                    weights: w.to_string(),
                    seconds: 1.0,
                    tokens_per_s: n as f64,
                    flops_per_token: 1e9,
                    tflops: n as f64 / 1e5,
                    gemm_fraction: 0.5,
                    gemm_rate_of: if *w == "fp8" { "fp8" } else { "bf16" }.into(),
                    logits_finite: true,
                })
            })
            .collect();
        let rec = PrefillRecord {
            device: "test gpu".into(),
            gemm_flops_per_s: 650e12,
            gemm_how: "cuBLAS".into(),
            fp8_gemm_flops_per_s: Some(1300e12),
            fp8_gemm_how: Some("cuBLASLt (per-tensor scales)".into()),
            rows,
        };
        let svg = prefill_svg(&rec).unwrap();
        let t = texts(&svg);
        assert_eq!(count(&t, "bf16 prefill"), 1, "{t:?}");
        assert_eq!(count(&t, "fp8 prefill"), 1, "{t:?}");
        assert_eq!(count(&t, "GEMM rate 650 TFLOP/s (cuBLAS)"), 1, "{t:?}");
        assert_eq!(
            count(&t, "FP8 GEMM rate 1300 TFLOP/s (cuBLASLt)"),
            1,
            "{t:?}"
        );
        assert_eq!(count(&t, "prompt tokens"), 1);
        for n in ["1024", "8192", "32768"] {
            assert_eq!(count(&t, n), 1, "{n}: {t:?}");
        }
        // A point per length and format, plus a legend marker per format.
        assert_eq!(circles(&svg, "4", true), 2 * 3 + 2);
    }
}
