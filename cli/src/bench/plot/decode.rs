//! The decode figure: ms/step against batch (both log scales), one panel per context;
//! in each, one solid line per (weights format, graph mode) and the format's floor as a
//! dashed line of the same colour.

use super::{distinct, distinct_sorted, log_range, FONT, PANEL};
use crate::bench::decode::{DecodeRecord, DecodeRow};
use crate::bench::table::num;
use anyhow::Result;
use plotters::prelude::*;

/// Marker of the i-th graph mode of a run: filled circles, then hollow ones.
fn marker(i: usize, at: (i32, i32), color: RGBColor) -> Circle<(i32, i32), i32> {
    match i % 2 {
        0 => Circle::new(at, 4, color.filled()),
        _ => Circle::new(at, 5, color.stroke_width(2)),
    }
}

pub fn decode_svg(rec: &DecodeRecord) -> Result<String> {
    let rows = &rec.rows;
    let contexts = distinct(rows.iter().map(|r| r.context));
    let formats = distinct(rows.iter().map(|r| r.weights.as_str()));
    let modes = distinct(rows.iter().map(|r| r.mode.as_str()));
    let batches = distinct_sorted(rows.iter().map(|r| r.batch as f64));
    let x = log_range(batches.iter().copied(), "batch sizes")?;
    let ms = rows.iter().flat_map(|r| [r.ms_per_step, r.floor_ms]);
    let y = log_range(ms, "step times")?;
    let cols = contexts.len().min(2);
    let grid = (contexts.len().div_ceil(2), cols);
    let size = (PANEL.0 * cols as u32, PANEL.1 * grid.0 as u32 + 40);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE)?;
        let title = format!(
            "pdserve bench decode on {}: ms/step (solid) against the floor (dashed)",
            rec.device
        );
        let root = root.titled(&title, (FONT, 22))?;
        for (panel, &c) in root.split_evenly(grid).iter().zip(&contexts) {
            let caption = format!(
                "context {c}; floor = (weights + KV bytes) / {:.0} GB/s",
                rec.memory_bandwidth_bytes_per_s / 1e9
            );
            let mut chart = ChartBuilder::on(panel)
                .caption(caption, (FONT, 16))
                .margin(12)
                .x_label_area_size(48)
                .y_label_area_size(64)
                .build_cartesian_2d(
                    x.clone().log_scale().with_key_points(batches.clone()),
                    y.clone().log_scale(),
                )?;
            chart
                .configure_mesh()
                .x_desc("batch (sequences, one token each per step)")
                .y_desc("ms per decode step")
                .x_label_formatter(&|b| format!("{b:.0}"))
                .y_label_formatter(&|v| num(*v))
                .label_style((FONT, 13))
                .light_line_style(TRANSPARENT)
                .draw()?;
            for (fi, &f) in formats.iter().enumerate() {
                let color = Palette99::pick(fi).to_rgba();
                let color = RGBColor(color.0, color.1, color.2);
                let of = |r: &&DecodeRow| r.context == c && r.weights == f;
                for (mi, &m) in modes.iter().enumerate() {
                    let mut pts: Vec<(f64, f64)> = rows
                        .iter()
                        .filter(of)
                        .filter(|r| r.mode == m)
                        .map(|r| (r.batch as f64, r.ms_per_step))
                        .collect();
                    if pts.is_empty() {
                        continue;
                    }
                    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                    chart
                        .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                        .label(format!("{f} {m}"))
                        .legend(move |(lx, ly)| {
                            EmptyElement::at((lx, ly))
                                + PathElement::new(vec![(0, 0), (20, 0)], color.stroke_width(2))
                                + marker(mi, (10, 0), color)
                        });
                    chart.draw_series(
                        pts.iter()
                            .map(|&p| EmptyElement::at(p) + marker(mi, (0, 0), color)),
                    )?;
                }
                // The floor of a batch is the same in every mode (same tokens, same
                // bytes): the first mode's row gives it.
                let floor: Vec<(f64, f64)> = batches
                    .iter()
                    .filter_map(|&b| {
                        let r = rows.iter().filter(of).find(|r| r.batch as f64 == b)?;
                        Some((b, r.floor_ms))
                    })
                    .collect();
                if floor.is_empty() {
                    continue;
                }
                chart
                    .draw_series(DashedLineSeries::new(floor, 8, 5, color.stroke_width(2)))?
                    .label(format!("{f} floor"))
                    .legend(move |(lx, ly)| {
                        EmptyElement::at((lx, ly))
                            + PathElement::new(vec![(0, 0), (8, 0)], color.stroke_width(2))
                            + PathElement::new(vec![(12, 0), (20, 0)], color.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .label_font((FONT, 13))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::bench::decode::CanaryCost;
    use crate::bench::plot::svg_check::{circles, count, texts};

    fn record(rows: Vec<DecodeRow>) -> DecodeRecord {
        DecodeRecord {
            device: "test gpu".into(),
            memory_bandwidth_bytes_per_s: 4.0e12,
            memory_bandwidth_how: "test".into(),
            rows,
            kv_canary: CanaryCost {
                page_bytes: 1.0,
                state_bytes: 1.0,
                pages_ms: 1.0,
                states_ms: 1.0,
                pages_rate: 1.0,
                bandwidth: 1.0,
            },
        }
    }

    fn row(batch: usize, context: usize, weights: &str, mode: &str) -> DecodeRow {
        let ms = 1.0 + batch as f64 / 10.0 + context as f64 / 1e4;
        DecodeRow {
            batch,
            context,
            weights: weights.into(),
            mode: mode.into(),
            ms_per_step: ms,
            host_ms: ms / 20.0,
            dry_ms: ms / 40.0,
            submit_ms: ms / 80.0,
            tokens_per_s: batch as f64 / ms * 1e3,
            experts_per_layer: 6.0,
            weight_bytes: 1e9,
            kv_bytes: 1e6,
            floor_ms: ms / 3.0,
            logits_finite: true,
        }
    }

    /// One panel per context; in each, one line per (format, mode) with a marker per batch
    /// (filled for the first mode, hollow for the second) and one floor per format, each
    /// named in the panel's legend.
    #[test]
    fn one_series_per_context_format_and_mode_and_a_floor_per_format() {
        let mut rows = Vec::new();
        for c in [4096, 32768] {
            for w in ["bf16", "fp8-fp4"] {
                for b in [1, 8, 64] {
                    for m in ["capture", "eager"] {
                        rows.push(row(b, c, w, m));
                    }
                }
            }
        }
        let svg = decode_svg(&record(rows)).unwrap();
        let t = texts(&svg);
        assert_eq!(
            count(
                &t,
                "pdserve bench decode on test gpu: ms/step (solid) against the floor (dashed)"
            ),
            1
        );
        for c in [4096, 32768] {
            let caption = format!("context {c}; floor = (weights + KV bytes) / 4000 GB/s");
            assert_eq!(count(&t, &caption), 1, "{t:?}");
        }
        for w in ["bf16", "fp8-fp4"] {
            for series in ["capture", "eager", "floor"] {
                assert_eq!(
                    count(&t, &format!("{w} {series}")),
                    2,
                    "{w} {series}: {t:?}"
                );
            }
        }
        assert_eq!(count(&t, "batch (sequences, one token each per step)"), 2);
        assert_eq!(count(&t, "ms per decode step"), 2);
        // Tick labels at the batch sizes themselves.
        for b in ["1", "8", "64"] {
            assert_eq!(count(&t, b), 2, "{b}: {t:?}");
        }
        // 2 contexts x 2 formats x 3 batches points per mode, plus one legend marker per
        // panel and format.
        assert_eq!(circles(&svg, "4", true), 2 * 2 * 3 + 2 * 2);
        assert_eq!(circles(&svg, "5", false), 2 * 2 * 3 + 2 * 2);
    }

    #[test]
    fn rows_without_a_positive_time_are_refused() {
        let mut r = row(1, 4096, "bf16", "capture");
        (r.ms_per_step, r.floor_ms) = (0.0, 0.0);
        let e = decode_svg(&record(vec![r])).unwrap_err().to_string();
        assert_eq!(e, "no positive step times to plot");
        let e = decode_svg(&record(vec![])).unwrap_err().to_string();
        assert_eq!(e, "no positive batch sizes to plot");
    }
}
