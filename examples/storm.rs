//! A retry storm, three ways: what stormguard is for, in one command.
//!
//! ```text
//! cargo run --release --example storm                  # about 45 s
//! cargo run --release --example storm -- --quick       # about 15 s, the CI smoke test
//! cargo run --release --example storm -- --json        # the table as JSON on stdout
//! ```
//!
//! A dependency with finite capacity runs on `127.0.0.1`: a few workers, a few
//! milliseconds of work per request, and a bounded queue in front of them. It is healthy,
//! then has an outage (every request gets a 503), then recovers. A fleet of clients
//! calls it over real sockets with hyper's client at a fixed arrival rate, about two
//! thirds of what it can serve, once per retry strategy and against a fresh server:
//!
//! 1. **naive**: five attempts at a fixed interval, no jitter, no budget: the policy
//!    people write by hand;
//! 2. **tower**: `tower::retry::Retry` with tower's `ExponentialBackoff` and a
//!    `TpsBudget` (20% plus 10 retries a second, linkerd's and Finagle's defaults);
//! 3. **stormguard**: [`RetryLayer`] with full jitter and a shared [`RetryBudget`],
//!    over a [`CircuitBreaker`] that fails fast while the dependency is down.
//!
//! Every strategy has the same per-attempt timeout, innermost.
//!
//! # The mechanism
//!
//! The server does not notice that a client gave up on a queued request: the work is
//! done anyway, as in most thread-pool servers. While offered load stays under
//! capacity the queue stays short and nothing times out. When the outage ends, the
//! naive fleet is still sending five attempts for every request. That is several
//! times what the server can serve, so its queue fills, every queued attempt waits
//! longer than the client's timeout, the server spends all its capacity on answers
//! nobody waits for, and the timeouts cause yet more retries. The outage is over but
//! the dependency stays down, held there by its own clients: a metastable failure. A
//! budget keeps the attempts close to the original load, so the queue never fills; a
//! circuit breaker goes further and stops calling a dependency that is down, sending
//! one probe now and then to find out when it is back.
//!
//! The run prints one row per strategy and draws attempts per second at the server
//! over time in an SVG (`target/storm.svg` by default).

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
/// Recovery is measured over windows of request start times this long.
const RECOVERY_WINDOW: Duration = Duration::from_millis(250);
/// A strategy has recovered once every window from then on succeeds this often.
const RECOVERED_RATIO: f64 = 0.99;

const USAGE: &str = "\
usage: cargo run --release --example storm -- [OPTIONS]

  --quick            a short run (under 20 s), the CI smoke test
  --json             print the results as a JSON array instead of a table
  --clients N        clients in the fleet, each sending 65 requests/s [8; 1..=64]
  --outage-secs S    length of the outage in seconds [5, 2 with --quick; 0.1..=30]
  --seed N           seed for the retry jitter [1]
  --svg PATH         where to write the chart [target/storm.svg]
  -h, --help         this text";

fn main() -> ExitCode {
    let scenario = match Scenario::from_args(std::env::args().skip(1)) {
        Ok(Some(scenario)) => scenario,
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
    match runtime.block_on(run(&scenario)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("storm: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run(scenario: &Scenario) -> Result<(), BoxError> {
    if !scenario.json {
        println!("{}\n", scenario.describe());
    }
    let mut reports = Vec::new();
    for kind in [Kind::Naive, Kind::Tower, Kind::Stormguard] {
        eprintln!("running {} ...", kind.name());
        reports.push(run_strategy(kind, scenario).await?);
    }
    draw_svg(&scenario.svg, scenario, &reports)?;
    if scenario.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&reports))?);
        eprintln!("chart: {}", scenario.svg.display());
    } else {
        print_table(&reports);
        println!("\nchart: {}", scenario.svg.display());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The scenario
// ---------------------------------------------------------------------------------------

/// Everything one run depends on: the flags and the model derived from them.
#[derive(Debug, Clone)]
struct Scenario {
    clients: u32,
    /// Requests each client starts per second, whatever happens to earlier ones.
    rate_per_client: f64,
    phases: Phases,
    /// Requests the server processes at once.
    workers: usize,
    /// Time the server spends on each request it accepts.
    service_time: Duration,
    /// Requests that may wait for a worker; beyond that the server answers 503 at once.
    queue: usize,
    /// Every strategy's per-attempt timeout.
    attempt_timeout: Duration,
    /// The caller's deadline for a whole request, retries included.
    request_deadline: Duration,
    seed: u64,
    svg: PathBuf,
    json: bool,
}

impl Scenario {
    /// Parses the flags; `Ok(None)` means help was asked for.
    fn from_args(args: impl Iterator<Item = String>) -> Result<Option<Self>, String> {
        let mut quick = false;
        let mut json = false;
        let mut clients = 8;
        let mut outage = None;
        let mut seed = 1;
        let mut svg = PathBuf::from("target/storm.svg");
        let mut args = args;
        while let Some(flag) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            match flag.as_str() {
                "--quick" => quick = true,
                "--json" => json = true,
                "--clients" => clients = parse_in("--clients", &value("--clients")?, 1..=64)?,
                "--outage-secs" => {
                    let secs: f64 =
                        parse_in("--outage-secs", &value("--outage-secs")?, 0.1..=30.0)?;
                    outage = Some(secs);
                }
                "--seed" => seed = parse_in("--seed", &value("--seed")?, 0..=u64::MAX)?,
                "--svg" => svg = PathBuf::from(value("--svg")?),
                "-h" | "--help" => return Ok(None),
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        let phases = if quick {
            Phases::new(1.0, outage.unwrap_or(2.0), 1.5)
        } else {
            Phases::new(3.0, outage.unwrap_or(5.0), 5.0)
        };
        Ok(Some(Scenario {
            clients,
            rate_per_client: 65.0,
            phases,
            workers: 8,
            service_time: Duration::from_millis(10),
            queue: 160,
            attempt_timeout: Duration::from_millis(100),
            request_deadline: Duration::from_secs(2),
            seed,
            svg,
            json,
        }))
    }

    fn offered_rate(&self) -> f64 {
        self.rate_per_client * f64::from(self.clients)
    }

    fn capacity(&self) -> f64 {
        self.workers as f64 / self.service_time.as_secs_f64()
    }

    fn describe(&self) -> String {
        let full_queue_wait = self
            .service_time
            .mul_f64(self.queue as f64 / self.workers as f64);
        format!(
            "stormguard storm: a dependency of capacity {cap:.0} req/s ({w} workers x {s} ms, \
             queue {q}, {qw} ms wait when full)\n\
             {c} clients x {r:.0} req/s = {o:.0} req/s offered ({pct:.0}% of capacity), \
             per-attempt timeout {t} ms, seed {seed}\n\
             healthy 0-{o0:.1} s, outage {o0:.1}-{o1:.1} s (every request 503), recovery until {end:.1} s",
            cap = self.capacity(),
            w = self.workers,
            s = self.service_time.as_millis(),
            q = self.queue,
            qw = full_queue_wait.as_millis(),
            c = self.clients,
            r = self.rate_per_client,
            o = self.offered_rate(),
            pct = 100.0 * self.offered_rate() / self.capacity(),
            t = self.attempt_timeout.as_millis(),
            seed = self.seed,
            o0 = self.phases.outage_start.as_secs_f64(),
            o1 = self.phases.outage_end.as_secs_f64(),
            end = self.phases.end.as_secs_f64(),
        )
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

/// When the dependency is healthy and when it is out, from the start of a run.
#[derive(Debug, Clone, Copy)]
struct Phases {
    outage_start: Duration,
    outage_end: Duration,
    /// Clients start no request after this.
    end: Duration,
}

impl Phases {
    /// Lengths in seconds, rounded to whole buckets.
    fn new(healthy: f64, outage: f64, recovery: f64) -> Self {
        let round = |secs: f64| Duration::from_millis(((secs * 10.0).round() as u64).max(1) * 100);
        let outage_start = round(healthy);
        let outage_end = outage_start + round(outage);
        Phases {
            outage_start,
            outage_end,
            end: outage_end + round(recovery),
        }
    }

    fn in_outage(&self, at: Duration) -> bool {
        (self.outage_start..self.outage_end).contains(&at)
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
    service_time: Duration,
    /// Requests in the building: waiting for a worker or being served.
    admitted: AtomicUsize,
    max_admitted: usize,
    workers: Arc<Semaphore>,
    /// Attempts that reached the server, per [`BUCKET`] since `start`.
    attempts: Vec<AtomicU64>,
}

impl Dependency {
    fn new(scenario: &Scenario, start: Instant) -> Self {
        // Room for the drain after the last request starts.
        let span = scenario.phases.end + scenario.request_deadline + Duration::from_secs(1);
        let buckets = (span.as_millis() / BUCKET.as_millis()) as usize;
        Dependency {
            start,
            phases: scenario.phases,
            service_time: scenario.service_time,
            admitted: AtomicUsize::new(0),
            max_admitted: scenario.workers + scenario.queue,
            workers: Arc::new(Semaphore::new(scenario.workers)),
            attempts: (0..buckets).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Answers one request: 503 during the outage or when the queue is full, otherwise
    /// 200 after waiting for a worker and doing the work.
    async fn serve(self: Arc<Self>) -> StatusCode {
        let now = self.start.elapsed();
        let bucket = (now.as_millis() / BUCKET.as_millis()) as usize;
        // Attempts after the last bucket (a straggler of the drain) count in the last.
        if let Some(count) = self.attempts.get(bucket).or(self.attempts.last()) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        if self.phases.in_outage(now) {
            return StatusCode::SERVICE_UNAVAILABLE;
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
                    tokio::time::sleep(self.service_time).await;
                    true
                }
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

    fn attempts_between(&self, from: Duration, to: Duration) -> u64 {
        let first = (from.as_millis() / BUCKET.as_millis()) as usize;
        let last = (to.as_millis() / BUCKET.as_millis()) as usize;
        self.attempts
            .iter()
            .take(last)
            .skip(first)
            .map(|n| n.load(Ordering::Relaxed))
            .sum()
    }

    fn total_attempts(&self) -> u64 {
        self.attempts
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .sum()
    }

    /// Attempts per second at the server, one point per bucket.
    fn attempt_rate(&self) -> Vec<(f64, f64)> {
        let per_sec = 1.0 / BUCKET.as_secs_f64();
        self.attempts
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let at = (i as f64 + 0.5) * BUCKET.as_secs_f64();
                (at, n.load(Ordering::Relaxed) as f64 * per_sec)
            })
            .collect()
    }
}

/// Starts the server on an ephemeral port of 127.0.0.1; aborting the task stops it
/// accepting.
async fn start_server(
    dependency: Arc<Dependency>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let accept = tokio::spawn(async move {
        loop {
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
            tokio::spawn(async move {
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
    Naive,
    Tower,
    Stormguard,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Naive => "naive",
            Kind::Tower => "tower",
            Kind::Stormguard => "stormguard",
        }
    }
}

/// A strategy's state shared by the whole fleet: budgets, breakers, counters.
#[derive(Debug)]
enum Strategy {
    Naive,
    Tower {
        budget: Arc<TpsBudget>,
        backoff: ExponentialBackoffMaker<HasherRng<SeededHasher>>,
    },
    Stormguard {
        policy: RetryPolicy,
        breaker: CircuitBreaker,
    },
}

impl Strategy {
    fn new(kind: Kind, scenario: &Scenario) -> Result<Self, BoxError> {
        Ok(match kind {
            Kind::Naive => Strategy::Naive,
            Kind::Tower => Strategy::Tower {
                // linkerd's and Finagle's defaults: 20% of requests plus 10 a second.
                budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
                backoff: ExponentialBackoffMaker::new(
                    Duration::from_millis(100),
                    Duration::from_secs(2),
                    0.99,
                    HasherRng::with_hasher(SeededHasher(scenario.seed)),
                )?,
            },
            Kind::Stormguard => {
                let budget = RetryBudget::builder()
                    .ratio(0.1)
                    .window(Duration::from_secs(10))
                    .build()?;
                let policy = RetryPolicy::builder()
                    .max_attempts(3)
                    .backoff(Backoff::new(
                        Duration::from_millis(100),
                        Duration::from_secs(2),
                        Jitter::Full,
                    )?)
                    .budget(budget)
                    .seed(scenario.seed)
                    .build()?;
                // Scaled to a demo whose outage lasts seconds: short breaks, so that a
                // probe finds the dependency soon after it is back.
                let breaker = CircuitBreaker::builder()
                    .failure_ratio(0.5)
                    .window(Duration::from_secs(2))
                    .min_throughput(20)
                    .break_duration(Duration::from_millis(100))
                    .max_break_duration(Duration::from_millis(500))
                    .seed(scenario.seed)
                    .build()?;
                Strategy::Stormguard { policy, breaker }
            }
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
            Strategy::Naive => BoxCloneService::new(Retry::new(
                NaivePolicy::new(5, Duration::from_millis(50)),
                ServiceBuilder::new().layer(timeout).service(http),
            )),
            Strategy::Tower { budget, backoff } => BoxCloneService::new(Retry::new(
                TowerPolicy::new(3, budget.clone(), backoff.clone().make_backoff()),
                ServiceBuilder::new().layer(timeout).service(http),
            )),
            Strategy::Stormguard { policy, breaker } => BoxCloneService::new(
                ServiceBuilder::new()
                    .layer(RetryLayer::new(policy.clone()))
                    .layer(CircuitBreakerLayer::new(breaker.clone()))
                    .layer(timeout)
                    .service(http),
            ),
        }
    }

    /// Circuit breaker transitions, for the strategies that have a breaker.
    fn transitions(&self) -> Option<u64> {
        match self {
            Strategy::Stormguard { breaker, .. } => Some(breaker.stats().transitions),
            Strategy::Naive | Strategy::Tower { .. } => None,
        }
    }
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

/// Runs one strategy against a fresh server and reports.
async fn run_strategy(kind: Kind, scenario: &Scenario) -> Result<Report, BoxError> {
    let strategy = Strategy::new(kind, scenario)?;
    // A little lead so every client and the server share one start.
    let start = Instant::now() + Duration::from_millis(50);
    let dependency = Arc::new(Dependency::new(scenario, start));
    let (addr, server) = start_server(dependency.clone()).await?;
    let uri: Uri = format!("http://{addr}/").parse()?;

    let mut fleet = JoinSet::new();
    for index in 0..scenario.clients {
        let client = Client::builder(TokioExecutor::new()).build_http();
        let stack = strategy.stack(client, scenario);
        fleet.spawn(run_client(
            index,
            stack,
            uri.clone(),
            scenario.clone(),
            start,
        ));
    }
    let mut outcomes = Vec::new();
    while let Some(client) = fleet.join_next().await {
        outcomes.extend(client?);
    }
    server.abort();
    Ok(Report::new(
        kind,
        &outcomes,
        &dependency,
        scenario,
        strategy.transitions(),
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
    // Every request gives up at its deadline, so this ends; the timeout is a backstop.
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

/// One strategy's results.
#[derive(Debug, Clone)]
struct Report {
    strategy: &'static str,
    offered: usize,
    attempts: u64,
    amplification_outage: f64,
    amplification_total: f64,
    success_ratio: f64,
    /// Success ratio of requests started after the outage ended.
    success_after: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// From the end of the outage until requests succeed again; `None` if they never did.
    recovery_s: Option<f64>,
    transitions: Option<u64>,
    /// Attempts per second at the server over time.
    rate: Vec<(f64, f64)>,
}

impl Report {
    fn new(
        kind: Kind,
        outcomes: &[Outcome],
        dependency: &Dependency,
        scenario: &Scenario,
        transitions: Option<u64>,
    ) -> Self {
        let phases = scenario.phases;
        let outage_offered = outcomes
            .iter()
            .filter(|o| phases.in_outage(o.started))
            .count();
        let outage_attempts = dependency.attempts_between(phases.outage_start, phases.outage_end);
        let attempts = dependency.total_attempts();
        let after: Vec<Outcome> = outcomes
            .iter()
            .filter(|o| o.started >= phases.outage_end)
            .copied()
            .collect();
        let mut latencies: Vec<Duration> = outcomes.iter().map(|o| o.latency).collect();
        latencies.sort_unstable();
        Report {
            strategy: kind.name(),
            offered: outcomes.len(),
            attempts,
            amplification_outage: ratio(outage_attempts as f64, outage_offered as f64),
            amplification_total: ratio(attempts as f64, outcomes.len() as f64),
            success_ratio: success_ratio(outcomes),
            success_after: success_ratio(&after),
            p50_ms: percentile_ms(&latencies, 0.50),
            p99_ms: percentile_ms(&latencies, 0.99),
            recovery_s: recovery(&after, phases),
            transitions,
            rate: dependency.attempt_rate(),
        }
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

/// The nearest-rank percentile of sorted latencies, in milliseconds.
fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1000.0
}

/// Seconds from the end of the outage to the start of the first [`RECOVERY_WINDOW`]
/// from which on every window's requests succeed at least [`RECOVERED_RATIO`] of the
/// time; `None` if the last window does not.
fn recovery(after: &[Outcome], phases: Phases) -> Option<f64> {
    let span = phases.end.saturating_sub(phases.outage_end);
    let windows = span.as_millis().div_ceil(RECOVERY_WINDOW.as_millis()) as usize;
    let mut counts = vec![(0usize, 0usize); windows];
    for outcome in after {
        let index = ((outcome.started - phases.outage_end).as_millis()
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
        "{:<11} {:>8} {:>9} {:>11} {:>10} {:>8} {:>9} {:>8} {:>8} {:>9} {:>11}",
        "strategy",
        "offered",
        "attempts",
        "amp outage",
        "amp total",
        "success",
        "ok after",
        "p50 ms",
        "p99 ms",
        "recovery",
        "transitions"
    );
    for r in reports {
        let recovery = r
            .recovery_s
            .map_or_else(|| "never".to_owned(), |s| format!("{s:.2} s"));
        let transitions = r
            .transitions
            .map_or_else(|| "-".to_owned(), |n| n.to_string());
        println!(
            "{:<11} {:>8} {:>9} {:>11.2} {:>10.2} {:>7.1}% {:>8.1}% {:>8.1} {:>8.1} {:>9} {:>11}",
            r.strategy,
            r.offered,
            r.attempts,
            r.amplification_outage,
            r.amplification_total,
            100.0 * r.success_ratio,
            100.0 * r.success_after,
            r.p50_ms,
            r.p99_ms,
            recovery,
            transitions
        );
    }
}

fn to_json(reports: &[Report]) -> serde_json::Value {
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    reports
        .iter()
        .map(|r| {
            serde_json::json!({
                "strategy": r.strategy,
                "offered": r.offered,
                "attempts": r.attempts,
                "amplification_outage": round(r.amplification_outage),
                "amplification_total": round(r.amplification_total),
                "success_ratio": round(r.success_ratio),
                "p50_ms": round(r.p50_ms),
                "p99_ms": round(r.p99_ms),
                "recovery_s": r.recovery_s.map(round),
            })
        })
        .collect()
}

fn draw_svg(path: &Path, scenario: &Scenario, reports: &[Report]) -> Result<(), BoxError> {
    use plotters::prelude::*;

    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let phases = scenario.phases;
    let x_end = (phases.end + Duration::from_secs(1)).as_secs_f64();
    let y_max = reports
        .iter()
        .flat_map(|r| r.rate.iter().map(|&(_, y)| y))
        .fold(scenario.capacity(), f64::max)
        * 1.1;

    let root = SVGBackend::new(path, (1000, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("attempts per second at the server", ("sans-serif", 22))
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
    let (o0, o1) = (
        phases.outage_start.as_secs_f64(),
        phases.outage_end.as_secs_f64(),
    );
    chart
        .draw_series([Rectangle::new(
            [(o0, 0.0), (o1, y_max)],
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
    for (report, colour) in reports.iter().zip([RED, BLUE, RGBColor(0, 150, 60)]) {
        let points = report.rate.iter().copied().filter(|&(x, _)| x <= x_end);
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
