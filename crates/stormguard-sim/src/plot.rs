//! SVG charts of the reproductions (plotters, SVG backend only).

use std::error::Error;
use std::path::Path;

use plotters::prelude::*;

use crate::experiments::{CurvePoint, CURVE_SHAPES, CURVE_STRATEGIES};
use crate::jitter::{JitterResult, STRATEGIES};
use crate::model::{FleetReport, Timeline};

type Res = Result<(), Box<dyn Error>>;

const COLOURS: [RGBColor; 11] = [
    RGBColor(0, 0, 0),
    RGBColor(220, 40, 40),
    RGBColor(240, 140, 0),
    RGBColor(0, 150, 60),
    RGBColor(30, 90, 220),
    RGBColor(150, 60, 200),
    RGBColor(0, 170, 190),
    RGBColor(150, 110, 60),
    RGBColor(230, 80, 160),
    RGBColor(110, 110, 110),
    RGBColor(90, 160, 30),
];

fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

/// Brooker 2015: total calls and completion time against the number of clients.
pub fn jitter_svg(path: &Path, results: &[JitterResult]) -> Res {
    let root = SVGBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let max_n = results.iter().map(|r| r.clients).max().unwrap_or(1) as f64;
    for (panel, (title, pick)) in panels.iter().zip([
        (
            "total calls (writes)",
            (|r: &JitterResult| r.calls) as fn(&JitterResult) -> f64,
        ),
        ("completion time, ms", |r: &JitterResult| r.completion_ms),
    ]) {
        let y_max = results.iter().map(pick).fold(1.0, f64::max) * 1.05;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(1.0..max_n, 0.0..y_max)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_desc("clients")
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()?;
        for (i, s) in STRATEGIES.iter().enumerate() {
            let c = colour(i);
            let points = results
                .iter()
                .filter(|r| r.strategy == *s)
                .map(|r| (f64::from(r.clients), pick(r)));
            chart
                .draw_series(LineSeries::new(points, c.stroke_width(2)))?
                .label(*s)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Brooker 2022: success rate and attempts per request against the failure rate, one
/// row of panels per fleet shape.
pub fn curves_svg(path: &Path, points: &[CurvePoint]) -> Res {
    let root = SVGBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 2));
    let load_max = points.iter().map(|p| p.load).fold(1.0, f64::max) * 1.05;
    for (row, (shape, _)) in CURVE_SHAPES.iter().enumerate() {
        for (col, (what, y_max)) in [
            ("client-perceived success", 1.0),
            ("attempts per request (server load)", load_max),
        ]
        .into_iter()
        .enumerate()
        {
            let mut chart = ChartBuilder::on(&panels[row * 2 + col])
                .caption(format!("{what}: {shape}"), ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(50)
                .build_cartesian_2d(0.0..1.0, 0.0..y_max)?;
            chart
                .configure_mesh()
                .light_line_style(WHITE)
                .x_desc("failure rate of each attempt")
                .draw()?;
            for (i, s) in CURVE_STRATEGIES.iter().enumerate() {
                let c = colour(i);
                let series = points
                    .iter()
                    .filter(|p| p.shape == *shape && p.strategy == *s)
                    .map(|p| (p.failure, if col == 0 { p.success } else { p.load }));
                chart
                    .draw_series(LineSeries::new(series, c.stroke_width(2)))?
                    .label(*s)
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(if col == 0 {
                    SeriesLabelPosition::LowerLeft
                } else {
                    SeriesLabelPosition::UpperLeft
                })
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK.mix(0.3))
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

/// Per-second series of several runs: `attempts` (else goodput) per second, with the
/// incident window shaded and the server's capacity drawn.
pub fn timeline_svg(
    path: &Path,
    title: &str,
    reports: &[FleetReport],
    timeline: Timeline,
    seconds: f64,
    capacity: f64,
    attempts: bool,
) -> Res {
    let root = SVGBackend::new(path, (1100, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let series = |r: &FleetReport| -> Vec<(f64, f64)> {
        let v = if attempts {
            &r.attempts_per_s
        } else {
            &r.goodput_per_s
        };
        v.iter()
            .enumerate()
            .take(seconds as usize)
            .map(|(s, n)| (s as f64, *n as f64))
            .collect()
    };
    let mut y_max = reports
        .iter()
        .flat_map(|r| series(r).into_iter().map(|(_, y)| y))
        .fold(1.0, f64::max);
    if capacity.is_finite() {
        y_max = y_max.max(capacity);
    }
    y_max *= 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..seconds, 0.0..y_max)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_desc("seconds of virtual time")
        .y_desc(if attempts {
            "attempts / s at the server"
        } else {
            "successful responses / s"
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    let (a, b) = (timeline.start, timeline.end().min(seconds));
    if b > a {
        chart
            .draw_series([Rectangle::new(
                [(a, 0.0), (b, y_max)],
                RED.mix(0.12).filled(),
            )])?
            .label("incident")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], RED.mix(0.12).filled()));
    }
    if capacity.is_finite() {
        chart
            .draw_series(LineSeries::new(
                [(0.0, capacity), (seconds, capacity)],
                BLACK.mix(0.4),
            ))?
            .label("server capacity")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.mix(0.6)));
    }
    for (i, r) in reports.iter().enumerate() {
        let c = colour(i);
        chart
            .draw_series(LineSeries::new(series(r), c.stroke_width(2)))?
            .label(r.strategy.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    root.present()?;
    Ok(())
}
