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
//! - **overload**: the server is healthy, but the offered load jumps to three times its
//!   capacity for the window, then back;
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
//! 5. **stormguard**: the [standard stack](stormguard::stack) with the library's
//!    defaults (the retry policy and the breaker seeded from `--seed`), the storm's
//!    100 ms attempt timeout aside: what a user gets.
//!
//! In `brownout` and `overload` four more rows are the adaptive concurrency limiters a
//! Rust user would pick instead, each with its crate's default settings, under tower's
//! `Retry` as in the `tower` row, one limiter shared by the clients (over the first
//! client's connection pool): `acc-vegas` and `acc-gradient2` (`tower-acc`),
//! `adaptive-aimd` and `adaptive-vegas` (`tower-resilience-adaptive`).
//!
//! Outside `fleet` the clients of a strategy share one policy, budget, load control and
//! breaker; in `fleet` each client builds its own (seeded from `--seed` and its index).
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
//! it. `goodput` is the requests the clients got a 200 for while the window lasted,
//! per second, as a share of what the server served per second in the same window with
//! its workers always busy in `overload` and `brownout` (its capacity, measured); `late
//! p99` is the p99 latency of the requests started 1 s or more into the window (how
//! long a caller is held once the fault is more than a blip); `shed out` counts the
//! requests the load control shed while the server was healthy (before and after the
//! window), `shed win` those it shed in the window. The run prints one table per scenario and draws the outage scenario's attempts
//! per second at the server in an SVG (`target/storm.svg` by default).

mod fleet;
mod report;
mod scenario;
mod server;
mod strategy;

use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use stormguard::BoxError;
use tower::util::BoxCloneService;

use crate::fleet::run_strategy;
use crate::report::{draw_svg, print_table, to_json};
use crate::scenario::{Fault, Options};

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
/// Every strategy's per-attempt timeout.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(100);
/// In an overload, the clients offer this many times the server's capacity.
const OVERLOAD: f64 = 3.0;
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

  --scenario NAME    outage | partial | brownout | overload | fleet | blip |
                     fleet-partial | partial30-long | all [outage]
  --fail-ratio P     share of requests failing in a partial outage [0.3; 0..=1]
  --quick            every scenario (unless --scenario is given), briefly: the CI smoke test
  --json             print every row as one JSON array instead of tables
  --clients N        clients, each with a fixed request rate (65/s; 2.6/s in fleet)
                     [8; fleet 200; 1..=1000]
  --rate R           requests per second per client outside an overload's window
                     [65; fleet 2.6]; 80 with 8 clients is 80% of the capacity
  --outage-secs S    length of the bad window in seconds [5, 0.8 with --quick; 0.1..=30]
  --strategy LIST    the rows to run, comma-separated: none, naive, unlimited, tower,
                     stormguard, acc-vegas, acc-gradient2, adaptive-aimd, adaptive-vegas
                     [the first five; all nine in brownout and overload]
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
        for &kind in &scenario.kinds {
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
