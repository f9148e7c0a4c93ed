//! `stormguard-sim`: the command line of the fleet simulator.
//!
//! ```text
//! stormguard-sim <jitter|retry-curves|metastable|fleet> [--clients N] [--seed S]
//!                [--seconds T] [--json] [--svg FILE] [more flags: --help]
//! ```

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use stormguard_core::config::Settings;
use stormguard_sim::experiments::{self, FleetRow};
use stormguard_sim::jitter::{self, JitterResult, PUBLISHED_100, STRATEGIES};
use stormguard_sim::model::{self, FleetConfig, Scenario, Timeline};
use stormguard_sim::plot;
use stormguard_sim::strategy::{Strategy, ALL, FLEET};

const USAGE: &str = "\
usage: stormguard-sim <command> [flags]

commands:
  jitter         Brooker 2015: N clients contend for one OCC row (calls, completion time)
  retry-curves   Brooker 2022: success and load against the failure rate
  metastable     a brownout trigger; does the server return to goodput afterwards?
  fleet          N open-loop clients through an incident, one row per strategy
  defaults       candidate breaker/budget settings on an outage and a 60% partial failure

flags:
  --clients N         clients (jitter: 100; metastable: 100; fleet: 1000)
  --seed S            seed of every random draw (12345)
  --seeds N           fleet: N runs, seeds S..S+N-1, summarised per strategy (1)
  --seconds T         virtual seconds of arrivals (fleet: 60; metastable: 120; retry-curves: 30)
  --json              JSON on stdout instead of tables
  --svg FILE          also draw a chart
  --runs R            jitter: runs averaged per point (100)
  --attempts N        attempts per request, the first included (3)
  --strategy A,B      strategies to run (fleet/metastable); names: see below
  --scenario K        fleet: healthy | outage | partial | brownout | spike | overload (outage)
  --fail-ratio P      partial: share of attempts failing (0.6)
  --capacity F        brownout: capacity factor; metastable: brownout factor (0.5)
  --latency-ms L      spike: added latency (2000)
  --demand F          overload: the offered load's factor in the window (3)
  --start S           incident start, seconds (fleet: seconds/3; metastable: 10)
  --duration D        incident length, seconds (fleet: seconds/6; metastable: 10)
  --rate R            fleet: original requests/s of the whole fleet (1 per client)
  --timeout-ms MS     per-attempt timeout (1000)
  --shared            one budget, load control and breaker for the whole fleet (default:
                      one per client)
  --drop-expired      the server drops queued work whose caller timed out
  --config FILE       fleet: also a row per dependency of a stormguard config file
                      (TOML, or JSON when FILE ends in .json), named config:NAME
  --dependency NAME   fleet --config: only that dependency's row
  --no-progress       no progress on stderr

strategies: ";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match Opts::parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("stormguard-sim: {e}\n\n{USAGE}{}", ALL.join(", "));
            return ExitCode::from(2);
        }
    };
    if opts.help {
        println!("{USAGE}{}", ALL.join(", "));
        return ExitCode::SUCCESS;
    }
    let result = match opts.command.as_str() {
        "jitter" => cmd_jitter(&opts),
        "retry-curves" => cmd_curves(&opts),
        "metastable" => cmd_metastable(&opts),
        "fleet" => cmd_fleet(&opts),
        "defaults" => cmd_defaults(&opts),
        other => Err(format!("unknown command {other:?}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stormguard-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Debug, Default)]
struct Opts {
    command: String,
    help: bool,
    clients: Option<usize>,
    seed: u64,
    seeds: u64,
    seconds: Option<f64>,
    json: bool,
    svg: Option<PathBuf>,
    runs: u32,
    attempts: u32,
    strategies: Option<Vec<String>>,
    scenario: Option<String>,
    fail_ratio: f64,
    capacity: f64,
    demand: f64,
    latency_ms: u64,
    start: Option<f64>,
    duration: Option<f64>,
    rate: Option<f64>,
    timeout_ms: u64,
    config: Option<PathBuf>,
    dependency: Option<String>,
    shared: bool,
    drop_expired: bool,
    progress: bool,
}

impl Opts {
    fn parse(args: &[String]) -> Result<Opts, String> {
        let mut o = Opts {
            seed: 12345,
            seeds: 1,
            runs: 100,
            attempts: 3,
            fail_ratio: 0.6,
            capacity: 0.5,
            demand: 3.0,
            latency_ms: 2000,
            timeout_ms: 1000,
            progress: true,
            ..Opts::default()
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let mut value = |name: &str| {
                it.next()
                    .cloned()
                    .ok_or_else(|| format!("{name} needs a value"))
            };
            match arg.as_str() {
                "-h" | "--help" => o.help = true,
                "--json" => o.json = true,
                "--shared" => o.shared = true,
                "--drop-expired" => o.drop_expired = true,
                "--no-progress" => o.progress = false,
                "--clients" => o.clients = Some(num(arg, &value(arg)?, 1.0, 1e7)? as usize),
                "--seed" => {
                    let v = value(arg)?;
                    o.seed = v
                        .parse()
                        .map_err(|_| format!("--seed: {v:?} is not an unsigned integer"))?;
                }
                "--seeds" => o.seeds = num(arg, &value(arg)?, 1.0, 1e4)? as u64,
                "--seconds" => o.seconds = Some(num(arg, &value(arg)?, 0.001, 1e6)?),
                "--svg" => o.svg = Some(PathBuf::from(value(arg)?)),
                "--runs" => o.runs = num(arg, &value(arg)?, 1.0, 1e6)? as u32,
                "--attempts" => o.attempts = num(arg, &value(arg)?, 1.0, 100.0)? as u32,
                "--strategy" => {
                    let v = value(arg)?;
                    let names: Vec<String> = v.split(',').map(str::to_string).collect();
                    if let Some(bad) = names.iter().find(|n| !ALL.contains(&n.as_str())) {
                        return Err(format!("--strategy: unknown strategy {bad:?}"));
                    }
                    o.strategies = Some(names);
                }
                "--scenario" => {
                    let v = value(arg)?;
                    let known = [
                        "healthy", "outage", "partial", "brownout", "spike", "overload",
                    ];
                    if !known.contains(&v.as_str()) {
                        return Err(format!("--scenario: unknown scenario {v:?}"));
                    }
                    o.scenario = Some(v);
                }
                "--fail-ratio" => o.fail_ratio = num(arg, &value(arg)?, 0.0, 1.0)?,
                "--capacity" => o.capacity = num(arg, &value(arg)?, 0.001, 1.0)?,
                "--demand" => o.demand = num(arg, &value(arg)?, 1.0, 1000.0)?,
                "--latency-ms" => o.latency_ms = num(arg, &value(arg)?, 0.0, 1e9)? as u64,
                "--start" => o.start = Some(num(arg, &value(arg)?, 0.0, 1e6)?),
                "--duration" => o.duration = Some(num(arg, &value(arg)?, 0.0, 1e6)?),
                "--rate" => o.rate = Some(num(arg, &value(arg)?, 0.001, 1e9)?),
                "--timeout-ms" => o.timeout_ms = num(arg, &value(arg)?, 1.0, 1e9)? as u64,
                "--config" => o.config = Some(PathBuf::from(value(arg)?)),
                "--dependency" => o.dependency = Some(value(arg)?),
                flag if flag.starts_with('-') => return Err(format!("unknown flag {flag}")),
                cmd if o.command.is_empty() => {
                    if !["jitter", "retry-curves", "metastable", "fleet", "defaults"].contains(&cmd)
                    {
                        return Err(format!("unknown command {cmd:?}"));
                    }
                    o.command = cmd.to_string();
                }
                extra => return Err(format!("unexpected argument {extra:?}")),
            }
        }
        if o.command.is_empty() && !o.help {
            return Err("no command given".into());
        }
        Ok(o)
    }

    fn strategies(&self, default: &[&str]) -> Result<Vec<Strategy>, String> {
        let names: Vec<String> = match &self.strategies {
            Some(v) => v.clone(),
            None => default.iter().map(|s| s.to_string()).collect(),
        };
        names
            .iter()
            .map(|n| {
                Strategy::named(n, self.attempts).ok_or_else(|| format!("unknown strategy {n:?}"))
            })
            .collect()
    }
}

fn num(flag: &str, v: &str, min: f64, max: f64) -> Result<f64, String> {
    let x: f64 = v
        .parse()
        .map_err(|_| format!("{flag}: {v:?} is not a number"))?;
    if !(min..=max).contains(&x) {
        return Err(format!("{flag}: {v} is outside [{min}, {max}]"));
    }
    Ok(x)
}

fn svg_done(
    path: &std::path::Path,
    r: Result<(), Box<dyn std::error::Error>>,
) -> Result<(), String> {
    r.map_err(|e| format!("cannot draw {}: {e}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn cmd_jitter(o: &Opts) -> Result<(), String> {
    let n = o.clients.unwrap_or(100).min(100_000) as u32;
    let wall = Instant::now();
    let mut events = 0u64;
    let at = |clients: u32, events: &mut u64| -> Vec<JitterResult> {
        STRATEGIES
            .iter()
            .map(|s| {
                let r = jitter::mean(s, clients, o.runs, o.seed);
                *events += r.events;
                r
            })
            .collect()
    };
    let main = at(n, &mut events);
    if o.json {
        let items: Vec<String> = main
            .iter()
            .map(|r| {
                format!(
                    "{{\"strategy\":\"{}\",\"clients\":{},\"calls\":{},\"completion_ms\":{}}}",
                    r.strategy,
                    r.clients,
                    experiments::num(r.calls),
                    experiments::num(r.completion_ms)
                )
            })
            .collect();
        println!("[{}]", items.join(","));
    } else {
        println!(
            "Brooker 2015 OCC contention: base 5 ms, cap 2 s, network |N(10 ms, 2 ms)| per hop, mean of {} runs (seed {})",
            o.runs, o.seed
        );
        println!(
            "{:>8}  {:<14}{:>10}{:>16}",
            "clients", "strategy", "calls", "completion ms"
        );
        let mut ns: Vec<u32> = [1, 10, 25, 50, 100]
            .into_iter()
            .filter(|k| *k < n)
            .collect();
        ns.push(n);
        for k in ns {
            let rows = if k == n {
                main.clone()
            } else {
                at(k, &mut events)
            };
            for r in rows {
                println!(
                    "{:>8}  {:<14}{:>10.0}{:>16.0}",
                    r.clients, r.strategy, r.calls, r.completion_ms
                );
            }
        }
        let calls = |s: &str| {
            main.iter()
                .find(|r| r.strategy == s)
                .map(|r| r.calls)
                .unwrap_or(0.0)
        };
        println!(
            "full jitter / exponential calls at {n} clients: {:.2}",
            calls("full") / calls("exponential").max(1.0)
        );
        if n == 100 {
            println!("published at 100 clients (public simulator, seed 12345):");
            for (s, c, t) in PUBLISHED_100 {
                let t = t.map(|t| format!("{t:.0}")).unwrap_or_else(|| "-".into());
                println!("{:>8}  {:<14}{:>10}{:>16}", 100, s, c, t);
            }
        }
    }
    if let Some(path) = &o.svg {
        let mut all = Vec::new();
        for k in 1..=n {
            if o.progress && k % 10 == 0 {
                eprint!("\r  sweep {k}/{n} clients ");
            }
            all.extend(at(k, &mut events));
        }
        if o.progress {
            eprintln!();
        }
        svg_done(path, plot::jitter_svg(path, &all))?;
    }
    report_speed(events, wall.elapsed());
    Ok(())
}

fn report_speed(events: u64, wall: Duration) {
    eprintln!(
        "{events} events in {:.2} s wall: {:.3e} events/s",
        wall.as_secs_f64(),
        events as f64 / wall.as_secs_f64().max(1e-9)
    );
}

fn cmd_curves(o: &Opts) -> Result<(), String> {
    let wall = Instant::now();
    let seconds = o.seconds.unwrap_or(30.0);
    let points = experiments::retry_curves(seconds, o.seed, o.attempts, 20, o.clients)?;
    let events = points.iter().map(|p| p.events).sum();
    if o.json {
        let items: Vec<String> = points
            .iter()
            .map(|p| {
                format!(
                    "{{\"shape\":\"{}\",\"strategy\":\"{}\",\"failure\":{},\"success\":{},\"attempts_per_request\":{}}}",
                    p.shape,
                    p.strategy,
                    experiments::num(p.failure),
                    experiments::num(p.success),
                    experiments::num(p.load)
                )
            })
            .collect();
        println!("[{}]", items.join(","));
    } else {
        println!(
            "Brooker 2022 retry curves: 1000 requests/s for {seconds} s, each attempt fails with probability p, {} attempts (seed {})\n",
            o.attempts, o.seed
        );
        print!("{}", experiments::curves_table(&points));
    }
    if let Some(path) = &o.svg {
        svg_done(path, plot::curves_svg(path, &points))?;
    }
    report_speed(events, wall.elapsed());
    Ok(())
}

fn cmd_metastable(o: &Opts) -> Result<(), String> {
    let wall = Instant::now();
    let seconds = o.seconds.unwrap_or(120.0);
    let mut cfg = experiments::metastable_config(
        o.clients.unwrap_or(100),
        seconds,
        o.seed,
        o.duration.unwrap_or(10.0),
    );
    cfg.timeline.scenario = Scenario::Brownout(o.capacity);
    if let Some(s) = o.start {
        cfg.timeline.start = s;
    }
    cfg.timeout = Duration::from_millis(o.timeout_ms);
    cfg.shared = o.shared;
    cfg.drop_expired = o.drop_expired;
    let mut reports = Vec::new();
    for s in o.strategies(FLEET)? {
        reports.push(model::run(&cfg, &s)?);
    }
    let events = reports.iter().map(|r| r.events).sum();
    if o.json {
        let rows: Vec<FleetRow> = reports
            .iter()
            .map(|r| FleetRow::new(&cfg, r.clone()))
            .collect();
        println!("{}", experiments::fleet_json(&rows));
    } else {
        println!(
            "metastable: {} clients offer {} req/s to {} req/s of capacity (queue {}, timeout {:?}); capacity x{} from {} s for {} s\n",
            cfg.clients,
            cfg.rate,
            cfg.capacity(),
            cfg.queue_limit,
            cfg.timeout,
            o.capacity,
            cfg.timeline.start,
            cfg.timeline.duration
        );
        print!("{}", experiments::metastable_table(&cfg, &reports));
    }
    if let Some(path) = &o.svg {
        svg_done(
            path,
            plot::timeline_svg(
                path,
                "metastable failure: goodput per second",
                &reports,
                cfg.timeline,
                seconds,
                cfg.capacity(),
                false,
            ),
        )?;
    }
    report_speed(events, wall.elapsed());
    Ok(())
}

fn cmd_defaults(o: &Opts) -> Result<(), String> {
    let wall = Instant::now();
    let clients = o.clients.unwrap_or(1000);
    let seconds = o.seconds.unwrap_or(60.0);
    let mut events = 0u64;
    let mut json = Vec::new();
    for scenario in [Scenario::Outage, Scenario::Partial(o.fail_ratio)] {
        let mut cfg = FleetConfig::new(clients, seconds, o.seed);
        cfg.timeline = Timeline {
            scenario,
            start: o.start.unwrap_or((seconds / 3.0).floor()),
            duration: o.duration.unwrap_or((seconds / 6.0).floor()),
        };
        cfg.shared = o.shared;
        cfg.timeout = Duration::from_millis(o.timeout_ms);
        let mut rows = Vec::new();
        for (_, s) in experiments::candidates(o.attempts)? {
            let r = model::run(&cfg, &s)?;
            events += r.events;
            rows.push(FleetRow::new(&cfg, r));
        }
        if o.json {
            json.push(experiments::fleet_json(&rows));
        } else {
            println!(
                "{:?} from {} s for {} s; {} clients ({}), {} req/s, capacity {:.0} req/s; breaker = window/break..max break/probes\n",
                cfg.timeline.scenario,
                cfg.timeline.start,
                cfg.timeline.duration,
                clients,
                if cfg.shared { "shared" } else { "per-client" },
                cfg.rate,
                cfg.capacity()
            );
            println!("{}", experiments::candidates_table(&cfg, &rows));
        }
    }
    if o.json {
        println!("[{}]", json.join(","));
    }
    report_speed(events, wall.elapsed());
    Ok(())
}

/// A strategy per dependency of the configuration file at `path` (or only `only`'s).
fn config_strategies(path: &std::path::Path, only: Option<&str>) -> Result<Vec<Strategy>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let settings = if path.extension().is_some_and(|e| e == "json") {
        Settings::from_json(&text)
    } else {
        Settings::from_toml(&text)
    }
    .map_err(|e| format!("{}: {e}", path.display()))?;
    let chosen: Vec<Strategy> = settings
        .dependencies()
        .filter(|(name, _)| only.is_none_or(|only| only == *name))
        .map(|(name, dependency)| Strategy::from_settings(name, dependency))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if chosen.is_empty() {
        let names: Vec<&str> = settings.dependencies().map(|(n, _)| n).collect();
        return Err(format!(
            "{}: no dependency {:?} (it has: {})",
            path.display(),
            only.unwrap_or(""),
            names.join(", ")
        ));
    }
    Ok(chosen)
}

fn cmd_fleet(o: &Opts) -> Result<(), String> {
    let wall = Instant::now();
    let clients = o.clients.unwrap_or(1000);
    let seconds = o.seconds.unwrap_or(60.0);
    let mut cfg = FleetConfig::new(clients, seconds, o.seed);
    if let Some(rate) = o.rate {
        let service = cfg.service.as_secs_f64();
        cfg.rate = rate;
        cfg.workers = ((rate * 1.5 * service).ceil() as u32).max(1);
        cfg.queue_limit = (f64::from(cfg.workers) / service * 0.5) as usize;
    }
    let scenario = match o.scenario.as_deref().unwrap_or("outage") {
        "healthy" => Scenario::Healthy,
        "partial" => Scenario::Partial(o.fail_ratio),
        "brownout" => Scenario::Brownout(o.capacity),
        "overload" => Scenario::Overload(o.demand),
        "spike" => Scenario::LatencySpike(Duration::from_millis(o.latency_ms)),
        _ => Scenario::Outage,
    };
    cfg.timeline = Timeline {
        scenario,
        start: o.start.unwrap_or((seconds / 3.0).floor()),
        duration: o.duration.unwrap_or((seconds / 6.0).floor()),
    };
    cfg.timeout = Duration::from_millis(o.timeout_ms);
    cfg.shared = o.shared;
    cfg.drop_expired = o.drop_expired;
    cfg.progress = o.progress && clients >= 10_000;
    let mut strategies = match (&o.config, &o.strategies) {
        // Beside a file's rows: no retries, and the library's defaults.
        (Some(_), None) => vec![
            Strategy::named("none", o.attempts).ok_or("no strategy \"none\"")?,
            Strategy::named("stormguard+breaker", o.attempts)
                .ok_or("no strategy \"stormguard+breaker\"")?,
        ],
        _ => o.strategies(FLEET)?,
    };
    if let Some(path) = &o.config {
        strategies.extend(config_strategies(path, o.dependency.as_deref())?);
    } else if o.dependency.is_some() {
        return Err("--dependency needs --config".into());
    }
    if o.seeds > 1 {
        return fleet_seeds(o, &cfg, &strategies, wall);
    }
    let rows = fleet_rows(&cfg, &strategies)?;
    let events: u64 = rows.iter().map(|r| r.report.events).sum();
    if o.json {
        println!("{}", experiments::fleet_json(&rows));
    } else {
        println!("{}\n", fleet_header(&cfg));
        print!("{}", experiments::fleet_table(&rows));
        let peak = rows
            .iter()
            .map(|r| r.report.peak_in_flight)
            .max()
            .unwrap_or(0);
        println!("peak requests in flight: {peak}");
    }
    if let Some(path) = &o.svg {
        let reports: Vec<_> = rows.iter().map(|r| r.report.clone()).collect();
        svg_done(
            path,
            plot::timeline_svg(
                path,
                "fleet: attempts per second at the server",
                &reports,
                cfg.timeline,
                seconds,
                cfg.capacity(),
                true,
            ),
        )?;
    }
    report_speed(events, wall.elapsed());
    Ok(())
}

/// One fleet run per strategy, its rows in the strategies' order.
fn fleet_rows(cfg: &FleetConfig, strategies: &[Strategy]) -> Result<Vec<FleetRow>, String> {
    strategies
        .iter()
        .map(|s| Ok(FleetRow::new(cfg, model::run(cfg, s)?)))
        .collect()
}

/// `fleet --seeds N`: every strategy on the seeds `seed..seed + N`, summarised per
/// strategy (or, `--json`, one array of rows per seed).
fn fleet_seeds(
    o: &Opts,
    cfg: &FleetConfig,
    strategies: &[Strategy],
    wall: Instant,
) -> Result<(), String> {
    if o.svg.is_some() {
        return Err("--svg draws one run: it does not go with --seeds".into());
    }
    let last = o
        .seed
        .checked_add(o.seeds - 1)
        .ok_or("--seed plus --seeds overflows")?;
    let mut runs: Vec<Vec<FleetRow>> = Vec::new();
    for seed in o.seed..=last {
        let mut cfg = cfg.clone();
        cfg.seed = seed;
        runs.push(fleet_rows(&cfg, strategies)?);
    }
    let events: u64 = runs.iter().flatten().map(|r| r.report.events).sum();
    if o.json {
        let all: Vec<String> = runs
            .iter()
            .map(|rows| experiments::fleet_json(rows))
            .collect();
        println!("[{}]", all.join(","));
    } else {
        println!("{}; seeds {}..={last}\n", fleet_header(cfg), o.seed);
        print!("{}", experiments::fleet_seeds_table(&runs));
    }
    report_speed(events, wall.elapsed());
    Ok(())
}

/// The first line of a fleet table: the fleet, the server and the incident.
fn fleet_header(cfg: &FleetConfig) -> String {
    format!(
        "fleet: {} clients ({} budgets/breakers), {} req/s for {} s, capacity {:.0} req/s (queue {}), timeout {:?}; {:?} from {} s for {} s",
        cfg.clients,
        if cfg.shared { "one shared" } else { "per-client" },
        cfg.rate,
        cfg.seconds,
        cfg.capacity(),
        cfg.queue_limit,
        cfg.timeout,
        cfg.timeline.scenario,
        cfg.timeline.start,
        cfg.timeline.duration
    )
}
