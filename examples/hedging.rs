//! Hedged requests on a real server, side by side with `tower::hedge`.
//!
//! ```text
//! cargo run --release --example hedging               # about 40 s
//! cargo run --release --example hedging -- --quick    # about 10 s
//! cargo run --release --example hedging -- --json     # the rows as JSON on stdout
//! ```
//!
//! A hyper server on `127.0.0.1` (HTTP/2) answers most requests in 2 to 5 ms, but a
//! seeded 5% of them take 300 ms: a slow replica, a GC pause. A client sends GETs at a
//! steady rate (open loop: each request is sent at its scheduled time, whether or not
//! the earlier ones have answered, up to a bound on requests in flight) through one of
//! three stacks, each against a fresh server:
//!
//! 1. **none**: hyper's client alone;
//! 2. **tower_hedge**: `tower::hedge::Hedge`, hedging after its 95th latency percentile
//!    (histograms rotated every second, 50 data points first), behind a `Buffer`
//!    because it is not `Clone`;
//! 3. **stormguard**: [`HedgeLayer`] with `HedgePolicy::default()`: the 95th percentile
//!    of successful latencies over 10 s (50 first), one hedge, paid from a 10% budget.
//!
//! It prints p50, p99 and p99.9 of the latency the caller saw (from each request's
//! scheduled time), the number of responses slower than 200 ms, and `extra_load`: the
//! requests the server received beyond one per request, per request (0.05 = 5% more
//! load). A second scenario has the server answer 503 to everything, fast: hedging
//! must then add no more than the budget allows (10% plus 1 a second). There
//! stormguard hedges after a fixed 10 ms: with nothing succeeding, the percentile delay
//! would never start, and nothing would be hedged at all.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use stormguard::{BoxError, HedgeLayer, HedgePolicy};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt};

type Req = Request<Empty<Bytes>>;
type Res = Response<Bytes>;
type Stack = BoxCloneService<Req, Res, BoxError>;

const USAGE: &str = "\
usage: hedging [--quick] [--json] [--requests N] [--rate R] [--seed S]
  --quick         a short run: 2000 requests (1000 in the 503 scenario)
  --json          print the rows as a JSON array instead of a table
  --requests N    GETs per strategy in the slow-server scenario [10000; 100..=100000]
  --rate R        requests per second [1000; 10..=5000]
  --seed S        the server's random seed [1]";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    /// 5% of requests take 300 ms, the rest 2-5 ms.
    SlowTail,
    /// Every request gets a 503 after 2-5 ms.
    AllFail,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    None,
    TowerHedge,
    Stormguard,
}

impl Strategy {
    fn name(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::TowerHedge => "tower_hedge",
            Strategy::Stormguard => "stormguard",
        }
    }
}

struct Args {
    requests: usize,
    fail_requests: usize,
    rate: f64,
    seed: u64,
    json: bool,
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut args = std::env::args().skip(1);
    let mut quick = false;
    let mut json = false;
    let mut requests = None;
    let mut rate = 1000.0;
    let mut seed = 1;
    while let Some(flag) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--quick" => quick = true,
            "--json" => json = true,
            "--requests" => {
                let n: usize = parse(&value("--requests")?, "--requests")?;
                if !(100..=100_000).contains(&n) {
                    return Err(format!("--requests {n}: allowed 100..=100000"));
                }
                requests = Some(n);
            }
            "--rate" => {
                let r: f64 = parse(&value("--rate")?, "--rate")?;
                if !(10.0..=5000.0).contains(&r) {
                    return Err(format!("--rate {r}: allowed 10..=5000"));
                }
                rate = r;
            }
            "--seed" => seed = parse(&value("--seed")?, "--seed")?,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let requests = requests.unwrap_or(if quick { 2000 } else { 10_000 });
    Ok(Some(Args {
        requests,
        fail_requests: if quick { 1000 } else { requests / 2 },
        rate,
        seed,
        json,
    }))
}

fn parse<T: std::str::FromStr>(text: &str, name: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{name}: cannot read `{text}`"))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            eprintln!("{err}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("hedging: {err}");
            ExitCode::FAILURE
        }
    }
}

/// One strategy's results.
struct Row {
    scenario: &'static str,
    strategy: Strategy,
    requests: usize,
    p50: Duration,
    p99: Duration,
    p999: Duration,
    slow: usize,
    extra_load: f64,
    errors: usize,
    hedges: Option<u64>,
}

async fn run(args: &Args) -> Result<(), BoxError> {
    let strategies = [Strategy::None, Strategy::TowerHedge, Strategy::Stormguard];
    let mut rows = Vec::new();
    if !args.json {
        println!(
            "hedging: {} GETs at {:.0}/s per strategy; server: 5% take 300 ms, the rest 2-5 ms (seed {})",
            args.requests, args.rate, args.seed
        );
    }
    for strategy in strategies {
        rows.push(measure("slow_tail", Server::SlowTail, strategy, args.requests, args).await?);
    }
    if !args.json {
        print_table(&rows);
        println!(
            "\nthen {} GETs at {:.0}/s per strategy; server: every request a 503 after 2-5 ms \
             (stormguard: fixed 10 ms delay)",
            args.fail_requests, args.rate
        );
    }
    let first = rows.len();
    for strategy in strategies {
        rows.push(
            measure(
                "all_503",
                Server::AllFail,
                strategy,
                args.fail_requests,
                args,
            )
            .await?,
        );
    }
    if args.json {
        let json: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "scenario": r.scenario,
                    "strategy": r.strategy.name(),
                    "requests": r.requests,
                    "p50_ms": ms(r.p50),
                    "p99_ms": ms(r.p99),
                    "p999_ms": ms(r.p999),
                    "slow_over_200ms": r.slow,
                    "extra_load": r.extra_load,
                    "errors": r.errors,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        print_table(&rows[first..]);
        // A budget grants `ratio` of the requests plus its allowance (one retry, once).
        println!(
            "budget share: 0.1 + 1 / {} requests = {:.3}",
            args.fail_requests,
            0.1 + 1.0 / args.fail_requests as f64
        );
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<12} {:>8} {:>8} {:>8} {:>9} {:>10} {:>11} {:>7} {:>7}",
        "strategy",
        "requests",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        ">200 ms",
        "extra_load",
        "hedges",
        "errors"
    );
    for r in rows {
        let hedges = r.hedges.map_or_else(|| "-".to_string(), |h| h.to_string());
        println!(
            "{:<12} {:>8} {:>8.1} {:>8.1} {:>9.1} {:>10} {:>11.3} {:>7} {:>7}",
            r.strategy.name(),
            r.requests,
            ms(r.p50),
            ms(r.p99),
            ms(r.p999),
            r.slow,
            r.extra_load,
            hedges,
            r.errors
        );
    }
}

/// Starts a server, sends `n` GETs through `strategy` at the set rate, and reports.
async fn measure(
    scenario: &'static str,
    server: Server,
    strategy: Strategy,
    n: usize,
    args: &Args,
) -> Result<Row, BoxError> {
    let served = Arc::new(AtomicU64::new(0));
    let (addr, server_task) = serve(server, args.seed, served.clone()).await?;
    let client: Client<HttpConnector, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let uri: http::Uri = format!("http://{addr}/").parse()?;
    let plain = tower::service_fn(move |req: Req| {
        let client = client.clone();
        async move {
            let res = client.request(req).await?;
            let (parts, body) = res.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<Res, BoxError>(Response::from_parts(parts, body))
        }
    });
    // With every response a 503 nothing succeeds, so the percentile delay would never
    // start and nothing would be hedged; a fixed 10 ms delay shows the budget's bound.
    let policy = match server {
        Server::SlowTail => HedgePolicy::default(),
        Server::AllFail => HedgePolicy::builder()
            .delay(Duration::from_millis(10))
            .build()?,
    };
    let stack: Stack = match strategy {
        Strategy::None => BoxCloneService::new(plain),
        // tower's `Hedge` is not `Clone`: a `Buffer` shares the one instance (and its
        // latency histogram) between the request tasks.
        Strategy::TowerHedge => BoxCloneService::new(tower::buffer::Buffer::new(
            tower::hedge::Hedge::new::<Req>(plain, CloneGets, 50, 0.95, Duration::from_secs(1)),
            4096,
        )),
        Strategy::Stormguard => BoxCloneService::new(
            ServiceBuilder::new()
                .layer(HedgeLayer::new(policy.clone()))
                .service(plain),
        ),
    };

    let in_flight = Arc::new(Semaphore::new(4096));
    let mut tasks = JoinSet::new();
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Burst);
    for _ in 0..n {
        let scheduled = ticker.tick().await;
        let permit = in_flight.clone().acquire_owned().await?;
        let mut stack = stack.clone();
        let req = Request::get(uri.clone()).body(Empty::new())?;
        tasks.spawn(async move {
            let outcome = tokio::time::timeout(Duration::from_secs(10), async {
                stack.ready().await?.call(req).await
            })
            .await;
            drop(permit);
            let ok = matches!(&outcome, Ok(Ok(_)));
            (scheduled.elapsed(), ok)
        });
    }
    let mut latencies = Vec::with_capacity(n);
    let mut errors = 0;
    while let Some(joined) = tasks.join_next().await {
        let (latency, ok) = joined?;
        latencies.push(latency);
        if !ok {
            errors += 1;
        }
    }
    // Let cancelled copies reach (or not) the server before it is counted.
    tokio::time::sleep(Duration::from_millis(50)).await;
    server_task.abort();
    latencies.sort();
    let pick = |q: f64| {
        let i = ((q * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[i]
    };
    let server_requests = served.load(Ordering::Relaxed) as f64;
    Ok(Row {
        scenario,
        strategy,
        requests: n,
        p50: pick(0.5),
        p99: pick(0.99),
        p999: pick(0.999),
        slow: latencies
            .iter()
            .filter(|l| **l > Duration::from_millis(200))
            .count(),
        extra_load: (server_requests - n as f64) / n as f64,
        errors,
        hedges: (strategy == Strategy::Stormguard).then(|| policy.stats().hedges_sent),
    })
}

/// tower's hedge policy: every GET may be hedged (the requests here are all GETs).
#[derive(Debug, Clone, Copy)]
struct CloneGets;

impl tower::hedge::Policy<Req> for CloneGets {
    fn clone_request(&self, req: &Req) -> Option<Req> {
        (req.method() == http::Method::GET).then(|| req.clone())
    }

    fn can_retry(&self, _req: &Req) -> bool {
        true
    }
}

/// The server: counts every request it receives, then answers by `kind`.
async fn serve(
    kind: Server,
    seed: u64,
    served: Arc<AtomicU64>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let rng = Arc::new(Mutex::new(SmallRng::seed_from_u64(seed)));
    let task = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        while let Ok((stream, _)) = listener.accept().await {
            let served = served.clone();
            let rng = rng.clone();
            let service = hyper::service::service_fn(move |_req: Request<Incoming>| {
                served.fetch_add(1, Ordering::Relaxed);
                let (slow, micros) = {
                    let mut rng = rng.lock().unwrap_or_else(|e| e.into_inner());
                    (
                        rng.random_range(0..100u32) < 5,
                        rng.random_range(2000..=5000u64),
                    )
                };
                async move {
                    let (delay, status) = match kind {
                        Server::SlowTail if slow => (Duration::from_millis(300), StatusCode::OK),
                        Server::SlowTail => (Duration::from_micros(micros), StatusCode::OK),
                        Server::AllFail => (
                            Duration::from_micros(micros),
                            StatusCode::SERVICE_UNAVAILABLE,
                        ),
                    };
                    tokio::time::sleep(delay).await;
                    let mut res = Response::new(Full::new(Bytes::from_static(b"ok")));
                    *res.status_mut() = status;
                    Ok::<_, Infallible>(res)
                }
            });
            connections.spawn(async move {
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((addr, task))
}
