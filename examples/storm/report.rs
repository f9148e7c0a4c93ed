//! Reports: the table, the JSON rows and the chart.

use std::path::Path;
use std::time::Duration;

use stormguard::BoxError;

use crate::fleet::Outcome;
use crate::scenario::{Phases, Scenario};
use crate::server::Dependency;
use crate::strategy::{Counters, Kind};
use crate::{BUCKET, PEAK_SPAN, RECOVERED_RATIO, RECOVERY_WINDOW};

/// One strategy's results in one scenario.
#[derive(Debug, Clone)]
pub(crate) struct Report {
    pub(crate) scenario: String,
    pub(crate) strategy: &'static str,
    pub(crate) offered: usize,
    pub(crate) attempts: u64,
    /// Attempts at the server in the window per request started in it.
    pub(crate) amplification_window: f64,
    pub(crate) amplification_total: f64,
    /// The busiest bucket of the window's first [`PEAK_SPAN`], per request started per
    /// bucket in the window.
    pub(crate) peak_amplification: f64,
    pub(crate) success_ratio: f64,
    /// Success ratio of requests started in the window.
    pub(crate) success_window: f64,
    /// Success ratio of requests started after the window.
    pub(crate) success_after: f64,
    /// Success ratio of requests started in the first second after the window.
    pub(crate) success_first_second_after: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    /// From the end of the window until requests succeed again; `None` if they never did.
    pub(crate) recovery_s: Option<f64>,
    /// 200s the clients got while the window lasted, per second.
    pub(crate) goodput: f64,
    /// 200s the server's workers served while the window lasted, per second.
    pub(crate) served_rate: f64,
    /// The p99 latency of the requests started 1 s or more into the window.
    pub(crate) late_p99_ms: f64,
    /// Requests shed while the server was healthy (outside the window), and in it.
    pub(crate) shed_outside: usize,
    pub(crate) shed_window: usize,
    /// Attempts at the server per bucket, for the chart and `--series`.
    pub(crate) attempts_per_bucket: Vec<u64>,
    /// (requests started, of which succeeded) per bucket of start time, for `--series`.
    pub(crate) requests_per_bucket: Vec<(u64, u64)>,
    pub(crate) counters: Counters,
}

impl Report {
    pub(crate) fn new(
        kind: Kind,
        outcomes: &[Outcome],
        dependency: &Dependency,
        scenario: &Scenario,
        counters: Counters,
    ) -> Self {
        let phases = scenario.phases;
        let started_in = |from: Duration, to: Duration| -> Vec<Outcome> {
            outcomes
                .iter()
                .filter(|o| (from..to).contains(&o.started))
                .copied()
                .collect()
        };
        let window = started_in(phases.window_start, phases.window_end);
        // Success in the window: of the requests started while the fault was failing
        // them (for blips, in a blip; else the whole window).
        let failing: Vec<Outcome> = window
            .iter()
            .filter(|o| phases.failing(scenario.fault, o.started))
            .copied()
            .collect();
        let after = started_in(phases.window_end, Duration::MAX);
        let first_second_after = started_in(
            phases.window_end,
            phases.window_end + Duration::from_secs(1),
        );
        let window_attempts = dependency.attempts_between(phases.window_start, phases.window_end);
        let window_buckets =
            (phases.window_end - phases.window_start).as_secs_f64() / BUCKET.as_secs_f64();
        let offered_per_bucket = window.len() as f64 / window_buckets;
        let peak_end = (phases.window_start + PEAK_SPAN).min(phases.window_end);
        let peak = dependency
            .buckets(phases.window_start, peak_end)
            .into_iter()
            .max()
            .unwrap_or(0);
        let attempts = dependency.total_attempts();
        let window_secs = (phases.window_end - phases.window_start).as_secs_f64();
        let got_in_window = outcomes
            .iter()
            .filter(|o| {
                o.ok && (phases.window_start..phases.window_end).contains(&(o.started + o.latency))
            })
            .count();
        let served = dependency.served_between(phases.window_start, phases.window_end);
        let mut late: Vec<Duration> = window
            .iter()
            .filter(|o| o.started >= phases.window_start + Duration::from_secs(1))
            .map(|o| o.latency)
            .collect();
        late.sort_unstable();
        let shed_window = window.iter().filter(|o| o.shed).count();
        let shed_outside = outcomes.iter().filter(|o| o.shed).count() - shed_window;
        let mut latencies: Vec<Duration> = outcomes.iter().map(|o| o.latency).collect();
        latencies.sort_unstable();
        let attempts_per_bucket = dependency.buckets(Duration::ZERO, Duration::MAX);
        let mut requests_per_bucket = vec![(0, 0); attempts_per_bucket.len()];
        for outcome in outcomes {
            let index = (outcome.started.as_millis() / BUCKET.as_millis()) as usize;
            if let Some((all, ok)) = requests_per_bucket.get_mut(index) {
                *all += 1;
                *ok += u64::from(outcome.ok);
            }
        }
        Report {
            scenario: scenario.name.clone(),
            strategy: kind.name(),
            offered: outcomes.len(),
            attempts,
            amplification_window: ratio(window_attempts as f64, window.len() as f64),
            amplification_total: ratio(attempts as f64, outcomes.len() as f64),
            peak_amplification: ratio(peak as f64, offered_per_bucket),
            success_ratio: success_ratio(outcomes),
            success_window: success_ratio(&failing),
            success_after: success_ratio(&after),
            success_first_second_after: success_ratio(&first_second_after),
            p50_ms: percentile_ms(&latencies, 0.50),
            p99_ms: percentile_ms(&latencies, 0.99),
            recovery_s: recovery(&after, phases),
            goodput: ratio(got_in_window as f64, window_secs),
            served_rate: ratio(served as f64, window_secs),
            late_p99_ms: percentile_ms(&late, 0.99),
            shed_outside,
            shed_window,
            attempts_per_bucket,
            requests_per_bucket,
            counters,
        }
    }

    /// Attempts per second at the server over time, one point per bucket.
    pub(crate) fn attempt_rate(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        let per_sec = 1.0 / BUCKET.as_secs_f64();
        self.attempts_per_bucket
            .iter()
            .enumerate()
            .map(move |(i, &n)| {
                let at = (i as f64 + 0.5) * BUCKET.as_secs_f64();
                (at, n as f64 * per_sec)
            })
    }

    /// `--series`: per 100 ms from 1 s before the window to 2 s after it, attempts at
    /// the server and the share of requests started then that succeeded.
    pub(crate) fn print_series(&self, scenario: &Scenario) {
        let phases = scenario.phases;
        let bucket = |at: Duration| (at.as_millis() / BUCKET.as_millis()) as usize;
        let first = bucket(phases.window_start.saturating_sub(Duration::from_secs(1)));
        let last =
            bucket(phases.window_end + Duration::from_secs(2)).min(self.attempts_per_bucket.len());
        let c = self.counters;
        eprintln!(
            "series {} / {}: from {:.1} s per 100 ms (window {:.1}-{:.1} s); stormguard: \
             {} retries, {} budget-denied, {} rejected by the breaker, {} transitions",
            self.scenario,
            self.strategy,
            first as f64 * BUCKET.as_secs_f64(),
            phases.window_start.as_secs_f64(),
            phases.window_end.as_secs_f64(),
            c.retries,
            c.budget_denied,
            c.rejected,
            c.transitions,
        );
        let range = first..last.max(first);
        let attempts: Vec<String> = self.attempts_per_bucket[range.clone()]
            .iter()
            .map(u64::to_string)
            .collect();
        let ok: Vec<String> = self.requests_per_bucket[range]
            .iter()
            .map(|&(all, ok)| format!("{:.0}", 100.0 * ratio(ok as f64, all as f64)))
            .collect();
        eprintln!("  attempts: {}", attempts.join(" "));
        eprintln!("  ok %:     {}", ok.join(" "));
    }
}

pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

pub(crate) fn success_ratio(outcomes: &[Outcome]) -> f64 {
    let ok = outcomes.iter().filter(|o| o.ok).count();
    ratio(ok as f64, outcomes.len() as f64)
}

pub(crate) fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1000.0
}

/// Seconds from the end of the window to the start of the first [`RECOVERY_WINDOW`]
/// from which on every window's requests succeed at least [`RECOVERED_RATIO`] of the
/// time; `None` if the last window does not.
pub(crate) fn recovery(after: &[Outcome], phases: Phases) -> Option<f64> {
    let span = phases.end.saturating_sub(phases.window_end);
    let windows = span.as_millis().div_ceil(RECOVERY_WINDOW.as_millis()) as usize;
    let mut counts = vec![(0usize, 0usize); windows];
    for outcome in after {
        let index = ((outcome.started - phases.window_end).as_millis()
            / RECOVERY_WINDOW.as_millis()) as usize;
        if let Some((ok, all)) = counts.get_mut(index) {
            *all += 1;
            *ok += usize::from(outcome.ok);
        }
    }
    let healthy =
        |&(ok, all): &(usize, usize)| all == 0 || ok as f64 >= RECOVERED_RATIO * all as f64;
    let healthy_tail = counts.iter().rev().take_while(|w| healthy(w)).count();
    (healthy_tail > 0).then(|| {
        let first = windows - healthy_tail;
        (RECOVERY_WINDOW * first as u32).as_secs_f64()
    })
}

pub(crate) fn print_table(reports: &[Report]) {
    // The capacity this run measured: the server's throughput in the window with its
    // workers always busy, the most any row got out of it.
    let capacity = reports.iter().map(|r| r.served_rate).fold(0.0, f64::max);
    println!(
        "{:<10} {:<14} {:>7} {:>8} {:>7} {:>9} {:>8} {:>7} {:>7} {:>8} {:>9} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "scenario",
        "strategy",
        "offered",
        "attempts",
        "amp win",
        "amp total",
        "peak 100",
        "success",
        "ok win",
        "ok after",
        "ok 1st s",
        "p50 ms",
        "p99 ms",
        "recovery",
        "goodput",
        "late p99",
        "shed out",
        "shed win"
    );
    for r in reports {
        let recovery = r
            .recovery_s
            .map_or_else(|| "never".to_owned(), |s| format!("{s:.2} s"));
        // A share of the capacity only where the window saturates the server.
        let saturated = r.scenario == "brownout" || r.scenario == "overload";
        let goodput = if saturated {
            format!("{:.1}%", 100.0 * ratio(r.goodput, capacity))
        } else {
            "-".to_owned()
        };
        println!(
            "{:<10} {:<14} {:>7} {:>8} {:>7.2} {:>9.2} {:>8.2} {:>6.1}% {:>6.1}% {:>7.1}% {:>8.1}% {:>7.1} {:>7.1} {:>8} {:>8} {:>8.1} {:>8} {:>8}",
            r.scenario,
            r.strategy,
            r.offered,
            r.attempts,
            r.amplification_window,
            r.amplification_total,
            r.peak_amplification,
            100.0 * r.success_ratio,
            100.0 * r.success_window,
            100.0 * r.success_after,
            100.0 * r.success_first_second_after,
            r.p50_ms,
            r.p99_ms,
            recovery,
            goodput,
            r.late_p99_ms,
            r.shed_outside,
            r.shed_window,
        );
    }
    if reports
        .iter()
        .any(|r| r.scenario == "brownout" || r.scenario == "overload")
    {
        println!(
            "capacity measured in the window: {capacity:.0} served/s (goodput is a share of it)"
        );
    }
}

pub(crate) fn to_json(reports: &[Report]) -> serde_json::Value {
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    reports
        .iter()
        .map(|r| {
            serde_json::json!({
                "scenario": r.scenario,
                "strategy": r.strategy,
                "offered": r.offered,
                "attempts": r.attempts,
                "amplification_window": round(r.amplification_window),
                "amplification_total": round(r.amplification_total),
                "peak_amplification": round(r.peak_amplification),
                "success_ratio": round(r.success_ratio),
                "success_window": round(r.success_window),
                "success_after": round(r.success_after),
                "success_first_second_after": round(r.success_first_second_after),
                "p50_ms": round(r.p50_ms),
                "p99_ms": round(r.p99_ms),
                "recovery_s": r.recovery_s.map(round),
                "goodput_per_s": round(r.goodput),
                "served_per_s": round(r.served_rate),
                "late_p99_ms": round(r.late_p99_ms),
                "shed_outside": r.shed_outside,
                "shed_window": r.shed_window,
            })
        })
        .collect()
}

/// Draws one scenario's attempts per second at the server over time, one line per row.
pub(crate) fn draw_svg(
    path: &Path,
    scenario: &Scenario,
    reports: &[Report],
) -> Result<(), BoxError> {
    use plotters::prelude::*;

    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let phases = scenario.phases;
    let x_end = (phases.end + Duration::from_secs(1)).as_secs_f64();
    let y_max = reports
        .iter()
        .flat_map(|r| r.attempt_rate().map(|(_, y)| y))
        .fold(scenario.capacity(), f64::max)
        * 1.1;

    let root = SVGBackend::new(path, (1000, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{}: attempts per second at the server", scenario.name),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_end, 0.0..y_max)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_desc("seconds since start")
        .y_desc("attempts / s")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    let (w0, w1) = (
        phases.window_start.as_secs_f64(),
        phases.window_end.as_secs_f64(),
    );
    chart
        .draw_series([Rectangle::new(
            [(w0, 0.0), (w1, y_max)],
            RED.mix(0.12).filled(),
        )])?
        .label("outage")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], RED.mix(0.12).filled()));
    let capacity = scenario.capacity();
    chart
        .draw_series(LineSeries::new(
            [(0.0, capacity), (x_end, capacity)],
            BLACK.mix(0.4),
        ))?
        .label("server capacity")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.mix(0.6)));
    let colours = [
        RGBColor(150, 150, 150),
        RED,
        RGBColor(230, 140, 0),
        BLUE,
        RGBColor(0, 150, 60),
    ];
    for (report, colour) in reports.iter().zip(colours) {
        let points = report.attempt_rate().filter(|&(x, _)| x <= x_end);
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))?
            .label(report.strategy)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}
