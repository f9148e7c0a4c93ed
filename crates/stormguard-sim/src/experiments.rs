//! The reproductions and the fleet comparison: configurations, tables and JSON.

use std::fmt::Write as _;
use std::time::Duration;

use crate::model::{self, FleetConfig, FleetReport, Scenario, Timeline};
use crate::strategy::Strategy;

/// The strategies of the Brooker 2022 retry curves.
pub const CURVE_STRATEGIES: &[&str] = &[
    "none",
    "unlimited",
    "bucket",
    "breaker",
    "breaker-retries",
    "a6",
    "stormguard",
];

/// The two fleet shapes of the retry curves: (label, clients), same total rate.
pub const CURVE_SHAPES: [(&str, usize); 2] = [
    ("few large (10 clients)", 10),
    ("many small (1000 clients)", 1000),
];

/// One point of a retry curve.
#[derive(Debug, Clone)]
pub struct CurvePoint {
    /// Fleet shape label.
    pub shape: &'static str,
    /// Strategy name.
    pub strategy: String,
    /// Downstream failure probability per attempt.
    pub failure: f64,
    /// Share of requests that succeeded.
    pub success: f64,
    /// Attempts per request (server load relative to no retries).
    pub load: f64,
    /// Events processed.
    pub events: u64,
}

/// Brooker 2022: success and load against the failure rate, for each shape and strategy.
/// A server of unlimited capacity fails each attempt independently with probability `p`
/// for the whole run; 1000 requests/s for `seconds`.
pub fn retry_curves(
    seconds: f64,
    seed: u64,
    attempts: u32,
    steps: u32,
    clients_override: Option<usize>,
) -> Result<Vec<CurvePoint>, String> {
    let mut out = Vec::new();
    for (shape, clients) in CURVE_SHAPES {
        let clients = match clients_override {
            Some(c) if clients > 10 => c,
            _ => clients,
        };
        for name in CURVE_STRATEGIES {
            let strategy = Strategy::named(name, attempts).ok_or("unknown strategy")?;
            for step in 0..=steps {
                let p = f64::from(step) / f64::from(steps.max(1));
                let mut cfg = FleetConfig::new(clients, seconds, seed);
                cfg.rate = 1000.0;
                cfg.workers = 0;
                cfg.timeline = Timeline {
                    scenario: Scenario::Partial(p),
                    start: 0.0,
                    duration: f64::INFINITY,
                };
                let r = model::run(&cfg, &strategy)?;
                out.push(CurvePoint {
                    shape,
                    strategy: name.to_string(),
                    failure: p,
                    success: ratio(r.succeeded, r.offered),
                    load: ratio(r.attempts, r.offered),
                    events: r.events,
                });
            }
        }
    }
    Ok(out)
}

/// The retry-curve tables, one per shape: success % and attempts per request at a few
/// failure rates.
pub fn curves_table(points: &[CurvePoint]) -> String {
    let mut s = String::new();
    for (shape, _) in CURVE_SHAPES {
        let _ = writeln!(s, "{shape}: success % / attempts per request");
        let _ = write!(s, "{:<16}", "failure rate");
        let rates: Vec<f64> = [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0].to_vec();
        for p in &rates {
            let _ = write!(s, "{:>13}", format!("{:.0}%", p * 100.0));
        }
        s.push('\n');
        for name in CURVE_STRATEGIES {
            let _ = write!(s, "{name:<16}");
            for p in &rates {
                let cell = points
                    .iter()
                    .find(|c| {
                        c.shape == shape && c.strategy == *name && (c.failure - p).abs() < 1e-9
                    })
                    .map(|c| format!("{:.1}/{:.2}", c.success * 100.0, c.load))
                    .unwrap_or_else(|| "-".into());
                let _ = write!(s, "{cell:>13}");
            }
            s.push('\n');
        }
        s.push('\n');
    }
    s
}

/// One row of a fleet comparison.
#[derive(Debug, Clone)]
pub struct FleetRow {
    /// The run.
    pub report: FleetReport,
    /// Attempts per request in the incident window.
    pub amp_window: f64,
    /// Attempts per request over the run.
    pub amp_total: f64,
    /// Success of requests arriving in the window.
    pub success_window: f64,
    /// Success of requests arriving after it.
    pub success_after: f64,
    /// Seconds after the window until success is back to 95% of before and stays.
    pub recovery: Option<f64>,
    /// The successes completed in the window, as a share of what the server's capacity
    /// could serve in it (the window's capacity under a brownout).
    pub goodput_window: f64,
}

impl FleetRow {
    /// Summarises `report` for the incident of `cfg`.
    pub fn new(cfg: &FleetConfig, report: FleetReport) -> Self {
        let tl = cfg.timeline;
        let end = tl.end().min(cfg.seconds);
        FleetRow {
            amp_window: report.amplification(tl.start, end),
            amp_total: ratio(report.attempts, report.offered),
            success_window: report.success(tl.start, end),
            success_after: report.success(end, cfg.seconds),
            recovery: report.recovery(tl.start, end, cfg.seconds, 0.95),
            goodput_window: report.goodput(tl.start, end) / window_capacity(cfg),
            report,
        }
    }
}

/// Requests the server's capacity could serve in the incident window of `cfg` (at the
/// brownout's capacity during one).
fn window_capacity(cfg: &FleetConfig) -> f64 {
    let tl = cfg.timeline;
    let seconds = (tl.end().min(cfg.seconds) - tl.start).max(0.0);
    let factor = match tl.scenario {
        Scenario::Brownout(f) => f,
        _ => 1.0,
    };
    cfg.capacity() * factor * seconds
}

/// The fleet table.
pub fn fleet_table(rows: &[FleetRow]) -> String {
    let mut s = format!(
        "{:<20}{:>10}{:>11}{:>11}{:>10}{:>11}{:>10}{:>10}{:>10}{:>8}{:>13}{:>8}\n",
        "strategy",
        "offered",
        "attempts",
        "amp window",
        "amp total",
        "ok window",
        "ok after",
        "goodput",
        "recovery",
        "shed",
        "events/s",
        "wall s"
    );
    for r in rows {
        let rec = seconds_or(r.recovery, "never");
        let _ = writeln!(
            s,
            "{:<20}{:>10}{:>11}{:>11.2}{:>10.2}{:>10.1}%{:>9.1}%{:>9.1}%{:>10}{:>8}{:>13}{:>8.2}",
            r.report.strategy,
            r.report.offered,
            r.report.attempts,
            r.amp_window,
            r.amp_total,
            r.success_window * 100.0,
            r.success_after * 100.0,
            r.goodput_window * 100.0,
            rec,
            r.report.shed,
            format!("{:.2e}", r.report.events_per_sec()),
            r.report.wall.as_secs_f64(),
        );
    }
    s
}

/// The summary of `fleet --seeds`: `runs[seed][strategy]`, the same strategies in each
/// run. Per strategy, the success of the window's requests over the seeds (mean,
/// standard deviation, lowest, highest), the mean amplification in the window, the
/// lowest success after it, the mean goodput, the slowest recovery, the requests shed
/// in all runs, and in how many runs its success in the window was the highest of all
/// strategies (`best in`; ties count for each).
pub fn fleet_seeds_table(runs: &[Vec<FleetRow>]) -> String {
    let mut s = format!(
        "{:<20}{:>11}{:>7}{:>8}{:>8}{:>11}{:>10}{:>10}{:>10}{:>8}{:>9}\n",
        "strategy",
        "ok window",
        "sd",
        "lowest",
        "highest",
        "amp window",
        "min after",
        "goodput",
        "recovery",
        "shed",
        "best in"
    );
    let Some(first) = runs.first() else {
        return s;
    };
    let n = runs.len() as f64;
    let best: Vec<f64> = runs
        .iter()
        .map(|rows| rows.iter().map(|r| r.success_window).fold(0.0, f64::max))
        .collect();
    for (i, row) in first.iter().enumerate() {
        let rows: Vec<&FleetRow> = runs.iter().filter_map(|rows| rows.get(i)).collect();
        let ok: Vec<f64> = rows.iter().map(|r| r.success_window * 100.0).collect();
        let mean = ok.iter().sum::<f64>() / n;
        let sd = (ok.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt();
        let lowest = ok.iter().copied().fold(f64::INFINITY, f64::min);
        let highest = ok.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let amp = rows.iter().map(|r| r.amp_window).sum::<f64>() / n;
        let after = rows
            .iter()
            .map(|r| r.success_after * 100.0)
            .fold(f64::INFINITY, f64::min);
        let goodput = rows.iter().map(|r| r.goodput_window * 100.0).sum::<f64>() / n;
        // The slowest recovery, or never if any run did not recover.
        let recovery = rows
            .iter()
            .try_fold(0.0_f64, |worst, r| r.recovery.map(|x| worst.max(x)));
        let shed: u64 = rows.iter().map(|r| r.report.shed).sum();
        let wins = rows
            .iter()
            .zip(&best)
            .filter(|(r, best)| r.success_window >= **best)
            .count();
        let _ = writeln!(
            s,
            "{:<20}{:>10.1}%{:>7.1}{:>7.1}%{:>7.1}%{:>11.2}{:>9.1}%{:>9.1}%{:>10}{:>8}{:>9}",
            row.report.strategy,
            mean,
            sd,
            lowest,
            highest,
            amp,
            after,
            goodput,
            seconds_or(recovery, "never"),
            shed,
            wins,
        );
    }
    s
}

/// The fleet rows as a JSON array.
pub fn fleet_json(rows: &[FleetRow]) -> String {
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"strategy\":\"{}\",\"offered\":{},\"attempts\":{},\"succeeded\":{},\"failed\":{},\"timeouts\":{},\"rejected\":{},\"shed\":{},\"amplification_window\":{},\"amplification_total\":{},\"success_window\":{},\"success_after\":{},\"recovery_s\":{},\"events\":{},\"events_per_sec\":{}}}",
                r.report.strategy,
                r.report.offered,
                r.report.attempts,
                r.report.succeeded,
                r.report.failed,
                r.report.timeouts,
                r.report.rejected,
                r.report.shed,
                num(r.amp_window),
                num(r.amp_total),
                num(r.success_window),
                num(r.success_after),
                r.recovery.map(num).unwrap_or_else(|| "null".into()),
                r.report.events,
                num(r.report.events_per_sec().round()),
            )
        })
        .collect();
    format!("[{}]", items.join(","))
}

/// The metastable-failure experiment's configuration: a server of 1000 requests/s
/// (10 workers x 10 ms) offered 800/s, a queue of 2 s of capacity, a 1 s per-attempt
/// timeout, work of timed-out callers still served, and a brownout to half capacity
/// from 10 s for `trigger` seconds.
pub fn metastable_config(clients: usize, seconds: f64, seed: u64, trigger: f64) -> FleetConfig {
    let mut cfg = FleetConfig::new(clients, seconds, seed);
    cfg.rate = 800.0;
    cfg.workers = 10;
    cfg.service = Duration::from_millis(10);
    cfg.queue_limit = 2000;
    cfg.timeout = Duration::from_secs(1);
    cfg.timeline = Timeline {
        scenario: Scenario::Brownout(0.5),
        start: 10.0,
        duration: trigger,
    };
    cfg
}

/// The metastable table: goodput before, during and after the trigger, and when (if)
/// the server returned to goodput.
pub fn metastable_table(cfg: &FleetConfig, reports: &[FleetReport]) -> String {
    let tl = cfg.timeline;
    let mut s = format!(
        "{:<20}{:>12}{:>12}{:>14}{:>14}{:>12}{:>12}\n",
        "strategy",
        "ok before",
        "ok trigger",
        "ok last 30 s",
        "amp last 30 s",
        "recovered",
        "after end"
    );
    for r in reports {
        let last = (cfg.seconds - 30.0).max(tl.end());
        let rec = r.recovery(tl.start, tl.end(), cfg.seconds, 0.9);
        let _ = writeln!(
            s,
            "{:<20}{:>11.1}%{:>11.1}%{:>13.1}%{:>14.2}{:>12}{:>12}",
            r.strategy,
            r.success(0.0, tl.start) * 100.0,
            r.success(tl.start, tl.end()) * 100.0,
            r.success(last, cfg.seconds) * 100.0,
            r.amplification(last, cfg.seconds),
            if rec.is_some() { "yes" } else { "no" },
            seconds_or(rec, "-"),
        );
    }
    s
}

/// A number as JSON (non-finite as null).
pub fn num(x: f64) -> String {
    if x.is_finite() {
        let s = format!("{x:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        if s.is_empty() || s == "-" {
            "0".into()
        } else {
            s.to_string()
        }
    } else {
        "null".into()
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// A time in whole seconds for a table, or `missing` when there is none.
fn seconds_or(secs: Option<f64>, missing: &str) -> String {
    secs.map_or_else(|| missing.to_owned(), |x| format!("{x:.0} s"))
}

/// Candidate breaker and budget settings for stormguard's defaults: (label, strategy).
pub fn candidates(attempts: u32) -> Result<Vec<(String, Strategy)>, String> {
    use stormguard_core::breaker::BreakerConfig;

    use crate::strategy::{BreakerMode, BudgetKind};

    let base = Strategy::named("stormguard+breaker", attempts).ok_or("unknown strategy")?;
    // window s / failure ratio / streak / break ms .. max break ms / probes
    let breaker =
        |window: u64, ratio: f64, streak: Option<u32>, brk: u64, max: u64, probes: u32| {
            BreakerConfig::builder()
                .window(Duration::from_secs(window))
                .failure_ratio(ratio)
                .consecutive_failures(streak)
                .break_duration(Duration::from_millis(brk))
                .max_break_duration(Duration::from_millis(max))
                .probes(probes)
                .build()
                .map_err(|e| e.to_string())
        };
    let no_allowance = BudgetKind::Core {
        ratio: 0.1,
        window: Duration::from_secs(10),
        allowance: 0,
    };
    let mut out = Vec::new();
    let mut add = |label: &str, budget: Option<BudgetKind>, mode: Option<BreakerMode>| {
        let mut s = base.clone();
        if let Some(b) = budget {
            s.budget = b;
        }
        if let Some(m) = mode {
            s.breaker = m;
        }
        s.name = label.to_string();
        out.push((label.to_string(), s));
    };
    add("budget only (defaults)", None, Some(BreakerMode::Off));
    add(
        "budget only, no allowance",
        Some(no_allowance),
        Some(BreakerMode::Off),
    );
    add("defaults: 2s/0.95/50 in a row/25ms", None, None);
    add(
        "2s/0.95/100 in a row/25ms",
        None,
        Some(BreakerMode::AllCalls(breaker(
            2,
            0.95,
            Some(100),
            25,
            25,
            1,
        )?)),
    );
    add(
        "2s/0.8/50 in a row/25ms",
        None,
        Some(BreakerMode::AllCalls(breaker(2, 0.8, Some(50), 25, 25, 1)?)),
    );
    add(
        "30s/0.5/5s..60s breaker",
        None,
        Some(BreakerMode::AllCalls(breaker(
            30, 0.5, None, 5000, 60_000, 1,
        )?)),
    );
    add(
        "2s/0.8/no streak/25ms",
        None,
        Some(BreakerMode::AllCalls(breaker(2, 0.8, None, 25, 25, 1)?)),
    );
    add(
        "2s/0.8/50 in a row/1s..10s",
        None,
        Some(BreakerMode::AllCalls(breaker(
            2,
            0.8,
            Some(50),
            1000,
            10_000,
            1,
        )?)),
    );
    add(
        "2s/0.5/50 in a row/25ms",
        None,
        Some(BreakerMode::AllCalls(breaker(2, 0.5, Some(50), 25, 25, 1)?)),
    );
    add(
        "retries-only, defaults",
        None,
        Some(BreakerMode::RetriesOnly(BreakerConfig::default())),
    );
    Ok(out)
}

/// The highest attempts-per-request of any whole second in `[from, to)`: the onset burst.
pub fn peak_amplification(r: &FleetReport, from: f64, to: f64) -> f64 {
    let (a, b) = (from.ceil() as usize, to.floor() as usize);
    (a..b.min(r.offered_per_s.len()))
        .map(|s| ratio(r.attempts_per_s[s], r.offered_per_s[s]))
        .fold(0.0, f64::max)
}

/// The candidates table for one scenario.
pub fn candidates_table(cfg: &FleetConfig, rows: &[FleetRow]) -> String {
    let tl = cfg.timeline;
    let mut s = format!(
        "{:<36}{:>11}{:>10}{:>11}{:>10}{:>10}{:>10}\n",
        "candidate", "amp window", "amp peak", "ok window", "ok after", "recovery", "rejected"
    );
    for r in rows {
        let rec = seconds_or(r.recovery, "never");
        let _ = writeln!(
            s,
            "{:<36}{:>11.2}{:>10.2}{:>10.1}%{:>9.1}%{:>10}{:>10}",
            r.report.strategy,
            r.amp_window,
            peak_amplification(&r.report, tl.start, tl.end()),
            r.success_window * 100.0,
            r.success_after * 100.0,
            rec,
            r.report.rejected,
        );
    }
    s
}
