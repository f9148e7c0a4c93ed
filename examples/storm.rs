//! Retry storms, five ways, in several scenarios: what stormguard is for, in one command.
//!
//! ```text
//! cargo run --release --example storm                        # the outage, about a minute
//! cargo run --release --example storm -- --scenario all      # every scenario, about 16 minutes
//! cargo run --release --example storm -- --quick             # every scenario briefly, the CI smoke test
//! cargo run --release --example storm -- --json              # the rows as one JSON array on stdout
//! ```
//!
//! A dependency with finite capacity runs on `127.0.0.1`: a few workers, a few
//! milliseconds of work per request, and a bounded queue in front of them (a 503 at once
//! past it). It is healthy, then goes through a bad window, then is healthy again. A
//! fleet of clients calls it over real sockets with hyper's client at a fixed arrival
//! rate, about two thirds of what it can serve, once per retry strategy and against a
//! fresh server each time. The bad window is one of:
//!
//! - **outage**: every request gets a 503;
//! - **partial**: each request gets a 503 with probability `--fail-ratio` (`all` runs 30%
//!   and 60%, named `partial30` and `partial60`);
//! - **brownout**: every request takes 2.5 times as long, so capacity drops to 40% and the
//!   queue fills;
//! - **fleet**: an outage seen by 200 small clients (2.6 requests/s each) that each keep
//!   their own retry budget and circuit breaker, instead of 8 clients sharing one;
//! - **blip**: ten blips of 300 ms, one every 2 s, in which every request gets a fast
//!   503 (success in the window counts the requests started in a blip);
//! - **fleet-partial30**: the partial outage at 30%, seen by the 200 small clients;
//! - **partial30-long**: the partial outage at 30% for 60 s.
//!
//! The strategies (rows), each with the same 100 ms per-attempt timeout, innermost:
//!
//! 1. **none**: the timeout only, no retries;
//! 2. **naive**: five attempts at a fixed interval, no jitter, no budget: the policy
//!    people write by hand;
//! 3. **unlimited**: stormguard's [`RetryLayer`] with 3 attempts of full jitter
//!    200 ms / 20 s and a budget that never refuses, no breaker: what retries can do,
//!    pinned whatever the defaults become (the reference every row is judged against);
//! 4. **tower**: `tower::retry::Retry` with tower's `ExponentialBackoff` and a
//!    `TpsBudget` (20% plus 10 retries a second, linkerd's and Finagle's defaults);
//! 5. **stormguard**: [`RetryLayer`] over a [`CircuitBreakerLayer`], both with the
//!    library's defaults (`RetryPolicy::builder().seed(seed).build()` and
//!    `CircuitBreaker::builder().seed(seed).build()`): what a user gets.
//!
//! Outside `fleet` the clients of a strategy share one policy, budget and breaker; in
//! `fleet` each client builds its own (seeded from `--seed` and its index).
//!
//! # The mechanism
//!
//! The server does not notice that a client gave up on a queued request: the work is
//! done anyway, as in most thread-pool servers. While offered load stays under
//! capacity the queue stays short and nothing times out. When an outage ends, the
//! naive fleet is still sending five attempts for every request. That is several
//! times what the server can serve, so its queue fills, every queued attempt waits
//! longer than the client's timeout, the server spends all its capacity on answers
//! nobody waits for, and the timeouts cause yet more retries: a metastable failure. A
//! budget keeps the attempts close to the original load; a circuit breaker goes further
//! and stops calling a dependency that is down.
//!
//! # What is measured
//!
//! Attempts are counted at the server, per 100 ms. Requests are counted at the clients
//! by the time they were started: in the window, after it, in the first second after
//! it. The run prints one table per scenario and draws the outage scenario's attempts
//! per second at the server in an SVG (`target/storm.svg` by default).

use std::collections::hash_map::DefaultHasher;
use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard::{
    Backoff, BoxError, CircuitBreaker, CircuitBreakerLayer, Jitter, RetryBudget, RetryLayer,
    RetryPolicy,
};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior, Sleep};
use tower::retry::backoff::{
    Backoff as _, ExponentialBackoff, ExponentialBackoffMaker, MakeBackoff,
};
use tower::retry::budget::{Budget as _, TpsBudget};
use tower::retry::{Policy, Retry};
use tower::timeout::TimeoutLayer;
use tower::util::rng::HasherRng;
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt};

/// Requests the clients send: a GET with no body.
type Req = Request<Empty<Bytes>>;
/// Responses the clients see: the body read to the end, so connections go back to the pool.
type Res = Response<Bytes>;
/// One client's stack, whatever the strategy.
type Stack = BoxCloneService<Req, Res, BoxError>;
type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// The server counts attempts in buckets this long.
const BUCKET: Duration = Duration::from_millis(100);
/// The peak amplification is the busiest bucket in this much of the window's start.
const PEAK_SPAN: Duration = Duration::from_secs(1);
/// Recovery is measured over windows of request start times this long.
const RECOVERY_WINDOW: Duration = Duration::from_millis(250);
/// A strategy has recovered once every window from then on succeeds this often.
const RECOVERED_RATIO: f64 = 0.99;
/// In a brownout, the work per request is multiplied by this (capacity to 40%).
const BROWNOUT_SLOWDOWN: f64 = 2.5;
/// The blip scenario: a blip of this length...
const BLIP_LENGTH: Duration = Duration::from_millis(300);
/// ...at the start of every this long...
const BLIP_EVERY: Duration = Duration::from_secs(2);
/// ...this many times.
const BLIPS: f64 = 10.0;
/// The long partial outage's window, seconds.
const PARTIAL_LONG_SECS: f64 = 60.0;

const USAGE: &str = "\
usage: cargo run --release --example storm -- [OPTIONS]

  --scenario NAME    outage | partial | brownout | fleet | blip | fleet-partial |
                     partial30-long | all [outage]
  --fail-ratio P     share of requests failing in a partial outage [0.3; 0..=1]
  --quick            every scenario (unless --scenario is given), briefly: the CI smoke test
  --json             print every row as one JSON array instead of tables
  --clients N        clients, each with a fixed request rate (65/s; 2.6/s in fleet)
                     [8; fleet 200; 1..=1000]
  --outage-secs S    length of the bad window in seconds [5, 0.8 with --quick; 0.1..=30]
  --seed N           seed for the retry jitter and the partial outage's failures [1]
  --svg PATH         where to write the outage chart [target/storm.svg]
  --series           also print each row's attempts and successes per 100 ms (stderr)
  -h, --help         this text";

fn main() -> ExitCode {
    let options = match Options::from_args(std::env::args().skip(1)) {
        Ok(Some(options)) => options,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("storm: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("storm: cannot start the tokio runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("storm: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run(options: &Options) -> Result<(), BoxError> {
    let mut all = Vec::new();
    let mut outage = None;
    for scenario in options.scenarios() {
        if !options.json {
            println!("{}\n", scenario.describe());
        }
        let mut reports = Vec::new();
        for kind in Kind::ALL {
            eprintln!("running {} / {} ...", scenario.name, kind.name());
            let report = run_strategy(kind, &scenario).await?;
            if options.series {
                report.print_series(&scenario);
            }
            reports.push(report);
        }
        if !options.json {
            print_table(&reports);
            println!();
        }
        if matches!(scenario.fault, Fault::Outage) && !scenario.own_state && outage.is_none() {
            outage = Some((scenario.clone(), reports.clone()));
        }
        all.extend(reports);
    }
    if let Some((scenario, reports)) = &outage {
        draw_svg(&options.svg, scenario, reports)?;
        if options.json {
            eprintln!("chart: {}", options.svg.display());
        } else {
            println!("chart of the outage: {}", options.svg.display());
        }
    }
    if options.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&all))?);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The flags and the scenarios
// ---------------------------------------------------------------------------------------

/// Which scenarios `--scenario` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Selection {
    Outage,
    Partial,
    Brownout,
    Fleet,
    Blip,
    FleetPartial,
    PartialLong,
    All,
}

/// The flags.
#[derive(Debug, Clone)]
struct Options {
    selection: Selection,
    fail_ratio: f64,
    quick: bool,
    json: bool,
    clients: Option<u32>,
    window_secs: Option<f64>,
    seed: u64,
    svg: PathBuf,
    series: bool,
}

impl Options {
    /// Parses the flags; `Ok(None)` means help was asked for.
    fn from_args(args: impl Iterator<Item = String>) -> Result<Option<Self>, String> {
        let mut selection = None;
        let mut options = Options {
            selection: Selection::Outage,
            fail_ratio: 0.3,
            quick: false,
            json: false,
            clients: None,
            window_secs: None,
            seed: 1,
            svg: PathBuf::from("target/storm.svg"),
            series: false,
        };
        let mut args = args;
        while let Some(flag) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            match flag.as_str() {
                "--scenario" => {
                    selection = Some(match value("--scenario")?.as_str() {
                        "outage" => Selection::Outage,
                        "partial" => Selection::Partial,
                        "brownout" => Selection::Brownout,
                        "fleet" => Selection::Fleet,
                        "blip" => Selection::Blip,
                        "fleet-partial" => Selection::FleetPartial,
                        "partial30-long" => Selection::PartialLong,
                        "all" => Selection::All,
                        other => {
                            return Err(format!(
                                "--scenario: `{other}` is not one of outage, partial, \
                                 brownout, fleet, blip, fleet-partial, partial30-long, all"
                            ))
                        }
                    });
                }
                "--fail-ratio" => {
                    options.fail_ratio =
                        parse_in("--fail-ratio", &value("--fail-ratio")?, 0.0..=1.0)?;
                }
                "--quick" => options.quick = true,
                "--json" => options.json = true,
                "--series" => options.series = true,
                "--clients" => {
                    options.clients = Some(parse_in("--clients", &value("--clients")?, 1..=1000)?);
                }
                "--outage-secs" => {
                    options.window_secs = Some(parse_in(
                        "--outage-secs",
                        &value("--outage-secs")?,
                        0.1..=30.0,
                    )?);
                }
                "--seed" => options.seed = parse_in("--seed", &value("--seed")?, 0..=u64::MAX)?,
                "--svg" => options.svg = PathBuf::from(value("--svg")?),
                "-h" | "--help" => return Ok(None),
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        // `--quick` alone is the CI smoke test: every scenario, briefly.
        options.selection = selection.unwrap_or(if options.quick {
            Selection::All
        } else {
            Selection::Outage
        });
        Ok(Some(options))
    }

    /// The scenarios to run, in order.
    fn scenarios(&self) -> Vec<Scenario> {
        let partial = |ratio: f64| Fault::Partial(ratio);
        let outage = || self.scenario(Fault::Outage, false, None);
        let partial_long = || self.scenario(partial(0.3), false, Some(PARTIAL_LONG_SECS));
        let fleet_partial = || self.scenario(partial(0.3), true, None);
        match self.selection {
            Selection::Outage => vec![outage()],
            Selection::Partial => vec![self.scenario(partial(self.fail_ratio), false, None)],
            Selection::Brownout => vec![self.scenario(Fault::Brownout, false, None)],
            Selection::Fleet => vec![self.scenario(Fault::Outage, true, None)],
            Selection::Blip => vec![self.blips()],
            Selection::FleetPartial => vec![fleet_partial()],
            Selection::PartialLong => vec![partial_long()],
            Selection::All => vec![
                outage(),
                self.blips(),
                self.scenario(partial(0.3), false, None),
                self.scenario(partial(0.6), false, None),
                partial_long(),
                self.scenario(Fault::Brownout, false, None),
                self.scenario(Fault::Outage, true, None),
                fleet_partial(),
            ],
        }
    }

    /// Ten blips (fewer with `--quick`), one every [`BLIP_EVERY`].
    fn blips(&self) -> Scenario {
        let blips = if self.quick { 1.0 } else { BLIPS };
        let secs = blips * BLIP_EVERY.as_secs_f64();
        self.scenario(Fault::Blip, false, Some(secs))
    }

    /// A scenario of `fault`, seen by 200 small clients with their own state
    /// (`own_state`) or 8 sharing one, with a window of `window_secs` (else
    /// `--outage-secs`, else 5 s).
    fn scenario(&self, fault: Fault, own_state: bool, window_secs: Option<f64>) -> Scenario {
        let long = window_secs.is_some_and(|w| w > 20.0);
        let name = match (fault, own_state) {
            (Fault::Partial(ratio), true) => format!("fleet-partial{:.0}", ratio * 100.0),
            (_, true) => "fleet".to_owned(),
            (Fault::Outage, false) => "outage".to_owned(),
            (Fault::Partial(ratio), false) if long => {
                format!("partial{:.0}-long", ratio * 100.0)
            }
            (Fault::Partial(ratio), false) => format!("partial{:.0}", ratio * 100.0),
            (Fault::Brownout, false) => "brownout".to_owned(),
            (Fault::Blip, false) => "blip".to_owned(),
        };
        // 520 requests/s offered by default either way: 8 x 65 or 200 x 2.6.
        let (default_clients, rate_per_client) = if own_state { (200, 2.6) } else { (8, 65.0) };
        let (phases, request_deadline) = if self.quick {
            let window = match fault {
                Fault::Blip => BLIP_EVERY.as_secs_f64(),
                _ => self.window_secs.unwrap_or(0.8),
            };
            (Phases::new(0.4, window, 0.6), Duration::from_secs(1))
        } else {
            let window = window_secs.or(self.window_secs).unwrap_or(5.0);
            (Phases::new(3.0, window, 5.0), Duration::from_secs(2))
        };
        Scenario {
            name,
            fault,
            own_state,
            clients: self.clients.unwrap_or(default_clients),
            rate_per_client,
            phases,
            workers: 8,
            service_time: Duration::from_millis(10),
            queue: 160,
            attempt_timeout: Duration::from_millis(100),
            request_deadline,
            seed: self.seed,
        }
    }
}

fn parse_in<T>(flag: &str, text: &str, range: std::ops::RangeInclusive<T>) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
{
    let value: T = text
        .parse()
        .map_err(|_| format!("{flag}: `{text}` is not a number"))?;
    if !range.contains(&value) {
        return Err(format!(
            "{flag}: {text} is out of range ({}..={})",
            range.start(),
            range.end()
        ));
    }
    Ok(value)
}

/// What goes wrong in the bad window.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// Every request gets a 503 at once.
    Outage,
    /// Each request gets a 503 at once with this probability.
    Partial(f64),
    /// Every request takes [`BROWNOUT_SLOWDOWN`] times as long to serve.
    Brownout,
    /// Every request gets a 503 at once during the first [`BLIP_LENGTH`] of every
    /// [`BLIP_EVERY`] of the window.
    Blip,
}

/// Everything one scenario depends on.
#[derive(Debug, Clone)]
struct Scenario {
    name: String,
    fault: Fault,
    /// Each client builds its own policy, budget and breaker (else one per strategy).
    own_state: bool,
    clients: u32,
    /// Requests each client starts per second, whatever happens to earlier ones.
    rate_per_client: f64,
    phases: Phases,
    /// Requests the server processes at once.
    workers: usize,
    /// Time the server spends on each request it accepts, outside a brownout.
    service_time: Duration,
    /// Requests that may wait for a worker; beyond that the server answers 503 at once.
    queue: usize,
    /// Every strategy's per-attempt timeout.
    attempt_timeout: Duration,
    /// The caller's deadline for a whole request, retries included.
    request_deadline: Duration,
    seed: u64,
}

impl Scenario {
    fn offered_rate(&self) -> f64 {
        self.rate_per_client * f64::from(self.clients)
    }

    fn capacity(&self) -> f64 {
        self.workers as f64 / self.service_time.as_secs_f64()
    }

    fn describe(&self) -> String {
        let window = match self.fault {
            Fault::Outage => "every request 503".to_owned(),
            Fault::Partial(ratio) => format!("{:.0}% of requests 503", ratio * 100.0),
            Fault::Brownout => format!(
                "work {BROWNOUT_SLOWDOWN}x longer, capacity {:.0} req/s",
                self.capacity() / BROWNOUT_SLOWDOWN
            ),
            Fault::Blip => format!(
                "every request 503 for {} ms of every {} s; ok win counts the requests \
                 started in a blip",
                BLIP_LENGTH.as_millis(),
                BLIP_EVERY.as_secs()
            ),
        };
        let state = if self.own_state {
            "each client with its own policy, budget and breaker"
        } else {
            "the clients of a strategy share one policy, budget and breaker"
        };
        format!(
            "scenario {name}: a dependency of capacity {cap:.0} req/s ({w} workers x {s} ms, \
             queue {q}), {c} clients x {r} req/s = {o:.0} req/s offered ({pct:.0}% of capacity)\n\
             healthy 0-{o0:.1} s, window {o0:.1}-{o1:.1} s ({window}), healthy until {end:.1} s; \
             per-attempt timeout {t} ms, {state}; seed {seed}",
            name = self.name,
            cap = self.capacity(),
            w = self.workers,
            s = self.service_time.as_millis(),
            q = self.queue,
            c = self.clients,
            r = self.rate_per_client,
            o = self.offered_rate(),
            pct = 100.0 * self.offered_rate() / self.capacity(),
            t = self.attempt_timeout.as_millis(),
            seed = self.seed,
            o0 = self.phases.window_start.as_secs_f64(),
            o1 = self.phases.window_end.as_secs_f64(),
            end = self.phases.end.as_secs_f64(),
        )
    }
}

/// When the dependency is healthy and when it is in its bad window, from the start of a
/// run.
#[derive(Debug, Clone, Copy)]
struct Phases {
    window_start: Duration,
    window_end: Duration,
    /// Clients start no request after this.
    end: Duration,
}

impl Phases {
    /// Lengths in seconds, rounded to whole buckets.
    fn new(healthy: f64, window: f64, after: f64) -> Self {
        let round = |secs: f64| Duration::from_millis(((secs * 10.0).round() as u64).max(1) * 100);
        let window_start = round(healthy);
        let window_end = window_start + round(window);
        Phases {
            window_start,
            window_end,
            end: window_end + round(after),
        }
    }

    fn in_window(&self, at: Duration) -> bool {
        (self.window_start..self.window_end).contains(&at)
    }

    /// Whether `fault` is failing requests at `at`: in the window, and for blips in
    /// one of them.
    fn failing(&self, fault: Fault, at: Duration) -> bool {
        self.in_window(at)
            && (fault != Fault::Blip
                || (at - self.window_start).as_nanos() % BLIP_EVERY.as_nanos()
                    < BLIP_LENGTH.as_nanos())
    }
}

// ---------------------------------------------------------------------------------------
// The dependency: a server with finite capacity
// ---------------------------------------------------------------------------------------

/// The server's model and its counters.
#[derive(Debug)]
struct Dependency {
    start: Instant,
    phases: Phases,
    fault: Fault,
    service_time: Duration,
    /// Requests in the building: waiting for a worker or being served.
    admitted: AtomicUsize,
    max_admitted: usize,
    workers: Semaphore,
    /// Attempts that reached the server, per [`BUCKET`] since `start`.
    attempts: Vec<AtomicU64>,
    /// The partial outage's random draws: a counter through a mixing function.
    draws: AtomicU64,
    seed: u64,
}

impl Dependency {
    fn new(scenario: &Scenario, start: Instant) -> Self {
        // Room for the drain after the last request starts.
        let span = scenario.phases.end + scenario.request_deadline + Duration::from_secs(1);
        let buckets = (span.as_millis() / BUCKET.as_millis()) as usize;
        Dependency {
            start,
            phases: scenario.phases,
            fault: scenario.fault,
            service_time: scenario.service_time,
            admitted: AtomicUsize::new(0),
            max_admitted: scenario.workers + scenario.queue,
            workers: Semaphore::new(scenario.workers),
            attempts: (0..buckets).map(|_| AtomicU64::new(0)).collect(),
            draws: AtomicU64::new(0),
            seed: scenario.seed,
        }
    }

    /// A uniform draw in [0, 1) for the partial outage.
    fn draw(&self) -> f64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let x = splitmix64(self.seed ^ 0x5EED_0FFA_1100 ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Answers one request: 503 at once when the window's fault says so or when the
    /// queue is full, otherwise 200 after waiting for a worker and doing the work.
    async fn serve(self: Arc<Self>) -> StatusCode {
        let now = self.start.elapsed();
        let bucket = (now.as_millis() / BUCKET.as_millis()) as usize;
        // Attempts after the last bucket (a straggler of the drain) count in the last.
        if let Some(count) = self.attempts.get(bucket).or(self.attempts.last()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        if self.phases.failing(self.fault, now) {
            match self.fault {
                Fault::Outage | Fault::Blip => return StatusCode::SERVICE_UNAVAILABLE,
                Fault::Partial(ratio) if self.draw() < ratio => {
                    return StatusCode::SERVICE_UNAVAILABLE
                }
                Fault::Partial(_) | Fault::Brownout => {}
            }
        }
        if self.admitted.fetch_add(1, Ordering::AcqRel) >= self.max_admitted {
            self.admitted.fetch_sub(1, Ordering::AcqRel);
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        // The work runs in its own task: a client that times out and hangs up does not
        // cancel it, as in most servers. That wasted work is what keeps a storm going.
        let work = tokio::spawn(async move {
            let served = match self.workers.acquire().await {
                Ok(_worker) => {
                    let brownout = self.fault == Fault::Brownout
                        && self.phases.in_window(self.start.elapsed());
                    let work = if brownout {
                        self.service_time.mul_f64(BROWNOUT_SLOWDOWN)
                    } else {
                        self.service_time
                    };
                    tokio::time::sleep(work).await;
                    true
                }
                // Closed at the end of the run: drop the queued work.
                Err(_closed) => false,
            };
            self.admitted.fetch_sub(1, Ordering::AcqRel);
            served
        });
        match work.await {
            Ok(true) => StatusCode::OK,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Attempts in the buckets that start in `[from, to)`.
    fn attempts_between(&self, from: Duration, to: Duration) -> u64 {
        self.buckets(from, to).iter().sum()
    }

    /// The attempt counts of the buckets that start in `[from, to)`.
    fn buckets(&self, from: Duration, to: Duration) -> Vec<u64> {
        let index = |at: Duration| {
            usize::try_from(at.as_millis() / BUCKET.as_millis()).unwrap_or(usize::MAX)
        };
        let (first, last) = (index(from), index(to));
        self.attempts
            .iter()
            .take(last)
            .skip(first)
            .map(|n| n.load(Ordering::Relaxed))
            .collect()
    }

    fn total_attempts(&self) -> u64 {
        self.attempts
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .sum()
    }
}

/// Steele, Lea and Flood's SplitMix64 finaliser: a well-mixed 64-bit value from any input.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Starts the server on an ephemeral port of 127.0.0.1. Aborting the returned task stops
/// it accepting and drops (aborts) every connection it is serving.
async fn start_server(
    dependency: Arc<Dependency>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let accept = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            // Reap finished connections so the set stays as large as the open ones.
            while connections.try_join_next().is_some() {}
            let Ok((stream, _)) = listener.accept().await else {
                // Out of file descriptors, most likely: let some connections close.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let dependency = dependency.clone();
            let service = hyper::service::service_fn(move |_req: Request<Incoming>| {
                let dependency = dependency.clone();
                async move {
                    let status = dependency.serve().await;
                    let mut response = Response::new(Full::new(Bytes::new()));
                    *response.status_mut() = status;
                    Ok::<_, Infallible>(response)
                }
            });
            connections.spawn(async move {
                // A client hanging up mid-request is part of the scenario, not an error.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((addr, accept))
}

// ---------------------------------------------------------------------------------------
// The strategies
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    None,
    Naive,
    Unlimited,
    Tower,
    Stormguard,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::None,
        Kind::Naive,
        Kind::Unlimited,
        Kind::Tower,
        Kind::Stormguard,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::None => "none",
            Kind::Naive => "naive",
            Kind::Unlimited => "unlimited",
            Kind::Tower => "tower",
            Kind::Stormguard => "stormguard",
        }
    }
}

/// A strategy's state (budgets, breakers, counters), shared by the clients that use it.
#[derive(Debug)]
enum Strategy {
    None,
    Naive,
    Tower {
        budget: Arc<TpsBudget>,
        backoff: ExponentialBackoffMaker<HasherRng<SeededHasher>>,
    },
    Unlimited {
        policy: RetryPolicy,
    },
    Stormguard {
        policy: RetryPolicy,
        breaker: CircuitBreaker,
    },
}

impl Strategy {
    fn new(kind: Kind, seed: u64) -> Result<Self, BoxError> {
        Ok(match kind {
            Kind::None => Strategy::None,
            Kind::Naive => Strategy::Naive,
            Kind::Tower => Strategy::Tower {
                // linkerd's and Finagle's defaults: 20% of requests plus 10 a second.
                budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
                backoff: ExponentialBackoffMaker::new(
                    Duration::from_millis(100),
                    Duration::from_secs(2),
                    0.99,
                    HasherRng::with_hasher(SeededHasher(seed)),
                )?,
            },
            // What retries can do: 3 attempts of full jitter 200 ms / 20 s and nothing
            // else, pinned whatever the defaults become.
            Kind::Unlimited => Strategy::Unlimited {
                policy: RetryPolicy::builder()
                    .max_attempts(3)
                    .backoff(Backoff::new(
                        Duration::from_millis(200),
                        Duration::from_secs(20),
                        Jitter::Full,
                    )?)
                    .budget(
                        RetryBudget::builder()
                            .ratio(1.0)
                            .allowance(u32::MAX)
                            .build()?,
                    )
                    .seed(seed)
                    .build()?,
            },
            // The library's defaults: only the seed is set, for reproducible jitter.
            Kind::Stormguard => Strategy::Stormguard {
                policy: RetryPolicy::builder().seed(seed).build()?,
                breaker: CircuitBreaker::builder().seed(seed).build()?,
            },
        })
    }

    /// One client's service stack over `client`; the per-attempt timeout is innermost.
    fn stack(&self, client: HttpClient, scenario: &Scenario) -> Stack {
        let timeout = TimeoutLayer::new(scenario.attempt_timeout);
        let http = tower::service_fn(move |req: Req| {
            let client = client.clone();
            async move {
                let (parts, body) = client.request(req).await?.into_parts();
                let body = body.collect().await?.to_bytes();
                Ok::<_, BoxError>(Response::from_parts(parts, body))
            }
        });
        match self {
            Strategy::None => {
                BoxCloneService::new(ServiceBuilder::new().layer(timeout).service(http))
            }
            Strategy::Naive => BoxCloneService::new(Retry::new(
                NaivePolicy::new(5, Duration::from_millis(50)),
                ServiceBuilder::new().layer(timeout).service(http),
            )),
            Strategy::Tower { budget, backoff } => BoxCloneService::new(Retry::new(
                TowerPolicy::new(3, budget.clone(), backoff.clone().make_backoff()),
                ServiceBuilder::new().layer(timeout).service(http),
            )),
            Strategy::Unlimited { policy } => BoxCloneService::new(
                ServiceBuilder::new()
                    .layer(RetryLayer::new(policy.clone()))
                    .layer(timeout)
                    .service(http),
            ),
            Strategy::Stormguard { policy, breaker } => BoxCloneService::new(
                ServiceBuilder::new()
                    .layer(RetryLayer::new(policy.clone()))
                    .layer(CircuitBreakerLayer::new(breaker.clone()))
                    .layer(timeout)
                    .service(http),
            ),
        }
    }

    /// stormguard's counters, summed into `into`.
    fn add_counters(&self, into: &mut Counters) {
        if let Strategy::Stormguard { policy, breaker } = self {
            let retry = policy.stats();
            let breaker = breaker.stats();
            into.retries += retry.retries;
            into.budget_denied += retry.budget_denied;
            into.rejected += breaker.rejected;
            into.transitions += breaker.transitions;
        }
    }
}

/// stormguard's own counters for one row, over every client's state (for `--series`).
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    retries: u64,
    budget_denied: u64,
    rejected: u64,
    transitions: u64,
}

/// The seed of client `index`'s own state in `fleet`: distinct per client, so that 200
/// clients do not draw the same jitter sequence in lockstep.
fn client_seed(seed: u64, index: u32) -> u64 {
    splitmix64(seed ^ (u64::from(index) << 32))
}

/// Copies a bodiless request for another attempt.
fn copy_request(req: &Req) -> Req {
    let mut copy = Request::new(*req.body());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.headers_mut() = req.headers().clone();
    copy
}

/// What the hand-rolled policies retry: any error, any 5xx.
fn failed<E>(result: &Result<Res, E>) -> bool {
    result
        .as_ref()
        .map_or(true, |res| res.status().is_server_error())
}

/// The retry policy people write by hand: a fixed number of attempts at a fixed
/// interval, no jitter, no budget.
#[derive(Debug, Clone)]
struct NaivePolicy {
    attempts_left: u32,
    interval: Duration,
}

impl NaivePolicy {
    fn new(max_attempts: u32, interval: Duration) -> Self {
        NaivePolicy {
            attempts_left: max_attempts - 1,
            interval,
        }
    }
}

impl<E> Policy<Req, Res, E> for NaivePolicy {
    type Future = Sleep;

    fn retry(&mut self, _req: &mut Req, result: &mut Result<Res, E>) -> Option<Sleep> {
        if !failed(result) || self.attempts_left == 0 {
            return None;
        }
        self.attempts_left -= 1;
        Some(tokio::time::sleep(self.interval))
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(copy_request(req))
    }
}

/// tower's own parts: an attempt cap, `ExponentialBackoff`, and a `TpsBudget` used the
/// way Finagle and linkerd use theirs (every original request deposits, every retry
/// withdraws).
///
/// Each request's copy of the policy starts from a clone of one `ExponentialBackoff`,
/// random generator included, so every request draws the same jitter sequence: that is
/// how tower's backoff behaves when shared this way, and part of what is compared.
#[derive(Debug, Clone)]
struct TowerPolicy {
    max_attempts: u32,
    attempts: u32,
    budget: Arc<TpsBudget>,
    backoff: ExponentialBackoff<HasherRng<SeededHasher>>,
}

impl TowerPolicy {
    fn new(
        max_attempts: u32,
        budget: Arc<TpsBudget>,
        backoff: ExponentialBackoff<HasherRng<SeededHasher>>,
    ) -> Self {
        TowerPolicy {
            max_attempts,
            attempts: 0,
            budget,
            backoff,
        }
    }
}

impl<E> Policy<Req, Res, E> for TowerPolicy {
    type Future = Sleep;

    fn retry(&mut self, _req: &mut Req, result: &mut Result<Res, E>) -> Option<Sleep> {
        self.attempts += 1;
        if !failed(result) || self.attempts >= self.max_attempts || !self.budget.withdraw() {
            return None;
        }
        Some(self.backoff.next_backoff())
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        // `Retry::call` asks the service's own copy of the policy, whose count is
        // always 0, once per original request.
        if self.attempts == 0 {
            self.budget.deposit();
        }
        Some(copy_request(req))
    }
}

/// Seeds tower's `HasherRng`, so that `--seed` makes tower's jitter reproducible too.
#[derive(Debug, Clone)]
struct SeededHasher(u64);

impl BuildHasher for SeededHasher {
    type Hasher = DefaultHasher;

    fn build_hasher(&self) -> DefaultHasher {
        let mut hasher = DefaultHasher::new();
        hasher.write_u64(self.0);
        hasher
    }
}

// ---------------------------------------------------------------------------------------
// The fleet
// ---------------------------------------------------------------------------------------

/// What happened to one request, as its caller saw it.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    /// When it was started, from the start of the run.
    started: Duration,
    latency: Duration,
    ok: bool,
}

/// Runs one strategy against a fresh server, stops the server, and reports.
async fn run_strategy(kind: Kind, scenario: &Scenario) -> Result<Report, BoxError> {
    // One state for the whole fleet, or one per client.
    let states = if scenario.own_state {
        (0..scenario.clients)
            .map(|index| Strategy::new(kind, client_seed(scenario.seed, index)))
            .collect::<Result<Vec<_>, _>>()?
    } else {
        vec![Strategy::new(kind, scenario.seed)?]
    };
    // A little lead so every client and the server share one start.
    let start = Instant::now() + Duration::from_millis(50);
    let dependency = Arc::new(Dependency::new(scenario, start));
    let (addr, server) = start_server(dependency.clone()).await?;
    let uri: Uri = format!("http://{addr}/").parse()?;

    let mut fleet = JoinSet::new();
    for index in 0..scenario.clients {
        let client = Client::builder(TokioExecutor::new()).build_http();
        let state = &states[index as usize % states.len()];
        fleet.spawn(run_client(
            index,
            state.stack(client, scenario),
            uri.clone(),
            scenario.clone(),
            start,
        ));
    }
    let mut outcomes = Vec::new();
    let mut failure = None;
    while let Some(client) = fleet.join_next().await {
        match client {
            Ok(client) => outcomes.extend(client),
            Err(err) => failure = Some(err),
        }
    }
    // Nothing outlives the run: the accept loop and its connections are aborted, and
    // work still queued at the server is dropped.
    server.abort();
    let _ = server.await;
    dependency.workers.close();
    if let Some(err) = failure {
        return Err(err.into());
    }
    let mut counters = Counters::default();
    for state in &states {
        state.add_counters(&mut counters);
    }
    Ok(Report::new(
        kind,
        &outcomes,
        &dependency,
        scenario,
        counters,
    ))
}

/// One client: starts a request every `1 / rate` seconds until the schedule ends, each
/// in its own task, never waiting for earlier ones (an open loop), then collects them.
async fn run_client(
    index: u32,
    stack: Stack,
    uri: Uri,
    scenario: Scenario,
    start: Instant,
) -> Vec<Outcome> {
    let period = Duration::from_secs_f64(1.0 / scenario.rate_per_client);
    // Clients are spread evenly over one period, not in lockstep.
    let offset = period.mul_f64(f64::from(index) / f64::from(scenario.clients));
    let mut ticks = tokio::time::interval_at(start + offset, period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let stop = start + scenario.phases.end;
    let max_requests = scenario.phases.end.as_secs_f64() * scenario.rate_per_client + 1.0;

    let mut requests = JoinSet::new();
    for _ in 0..max_requests as u64 {
        let at = ticks.tick().await;
        if at >= stop {
            break;
        }
        let request = send(stack.clone(), uri.clone(), scenario.request_deadline);
        let started = at - start;
        requests.spawn(async move {
            let (latency, ok) = request.await;
            Outcome {
                started,
                latency,
                ok,
            }
        });
    }
    // Every request gives up at its deadline, so this ends; the timeout is a backstop
    // (the set aborts whatever is left when it is dropped).
    let mut outcomes = Vec::with_capacity(requests.len());
    let drain = stop + scenario.request_deadline + Duration::from_secs(1);
    while let Ok(Some(done)) = tokio::time::timeout_at(drain, requests.join_next()).await {
        if let Ok(outcome) = done {
            outcomes.push(outcome);
        }
    }
    outcomes
}

/// Sends one request through `stack`; its latency and whether it succeeded.
async fn send(stack: Stack, uri: Uri, deadline: Duration) -> (Duration, bool) {
    let began = Instant::now();
    let mut req = Request::new(Empty::new());
    *req.uri_mut() = uri;
    let ok = matches!(
        tokio::time::timeout(deadline, stack.oneshot(req)).await,
        Ok(Ok(res)) if res.status().is_success()
    );
    (began.elapsed(), ok)
}

// ---------------------------------------------------------------------------------------
// Reports
// ---------------------------------------------------------------------------------------

/// One strategy's results in one scenario.
#[derive(Debug, Clone)]
struct Report {
    scenario: String,
    strategy: &'static str,
    offered: usize,
    attempts: u64,
    /// Attempts at the server in the window per request started in it.
    amplification_window: f64,
    amplification_total: f64,
    /// The busiest bucket of the window's first [`PEAK_SPAN`], per request started per
    /// bucket in the window.
    peak_amplification: f64,
    success_ratio: f64,
    /// Success ratio of requests started in the window.
    success_window: f64,
    /// Success ratio of requests started after the window.
    success_after: f64,
    /// Success ratio of requests started in the first second after the window.
    success_first_second_after: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// From the end of the window until requests succeed again; `None` if they never did.
    recovery_s: Option<f64>,
    /// Attempts at the server per bucket, for the chart and `--series`.
    attempts_per_bucket: Vec<u64>,
    /// (requests started, of which succeeded) per bucket of start time, for `--series`.
    requests_per_bucket: Vec<(u64, u64)>,
    counters: Counters,
}

impl Report {
    fn new(
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
            attempts_per_bucket,
            requests_per_bucket,
            counters,
        }
    }

    /// Attempts per second at the server over time, one point per bucket.
    fn attempt_rate(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
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
    fn print_series(&self, scenario: &Scenario) {
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

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn success_ratio(outcomes: &[Outcome]) -> f64 {
    let ok = outcomes.iter().filter(|o| o.ok).count();
    ratio(ok as f64, outcomes.len() as f64)
}

fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1000.0
}

/// Seconds from the end of the window to the start of the first [`RECOVERY_WINDOW`]
/// from which on every window's requests succeed at least [`RECOVERED_RATIO`] of the
/// time; `None` if the last window does not.
fn recovery(after: &[Outcome], phases: Phases) -> Option<f64> {
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

fn print_table(reports: &[Report]) {
    println!(
        "{:<10} {:<10} {:>7} {:>8} {:>7} {:>9} {:>8} {:>7} {:>7} {:>8} {:>9} {:>7} {:>7} {:>8}",
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
        "recovery"
    );
    for r in reports {
        let recovery = r
            .recovery_s
            .map_or_else(|| "never".to_owned(), |s| format!("{s:.2} s"));
        println!(
            "{:<10} {:<10} {:>7} {:>8} {:>7.2} {:>9.2} {:>8.2} {:>6.1}% {:>6.1}% {:>7.1}% {:>8.1}% {:>7.1} {:>7.1} {:>8}",
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
        );
    }
}

fn to_json(reports: &[Report]) -> serde_json::Value {
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
            })
        })
        .collect()
}

/// Draws one scenario's attempts per second at the server over time, one line per row.
fn draw_svg(path: &Path, scenario: &Scenario, reports: &[Report]) -> Result<(), BoxError> {
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
