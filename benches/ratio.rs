//! The success-path overhead of each stack as a ratio to tower's `Retry` with a
//! `TpsBudget`, measured interleaved: every round runs a batch of calls through each
//! stack, in an order that rotates from round to round, so that no stack is always
//! measured first, last, or after the same neighbour (criterion measures one stack after
//! another, and each then meets a different heap and cache state).
//!
//! `cargo bench -p stormguard-bench --bench ratio` (`-- --processes P --rounds N`, 5 and
//! 200 by default, of 2000 calls per stack). Each process measures every stack; for each
//! stack the bench prints the median time per call and the median, over the processes, of
//! the ratio of its median overhead over `bare` (each round against the same round's
//! `bare`) to tower with its budget's, with each process's ratio beside it. Built, like the criterion benches of this crate,
//! without tokio's `test-util`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use stormguard::{RetryLayer, RetryPolicy};
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

mod peers;
#[path = "../tests/support/stacks.rs"]
mod stacks;

use stacks::{grpc_request, realistic_request, request, Req, TpsPolicy, UPSTREAM};

/// Calls per stack per round.
const BATCH: u32 = 2000;

/// The least a layer with state shared between its clones can do: its service holds an
/// `Arc`, and each call's response future holds a clone of it until the call ends. It
/// measures what any such layer costs under a retry layer before doing any work.
///
/// `dated`: the least a circuit breaker with a time window can do besides: when the
/// call ends, read the clock to date its outcome and count it with one atomic add (the
/// breaker floor).
#[derive(Clone, Default)]
struct SharedStateLayer {
    shared: Arc<AtomicU64>,
    dated: bool,
}

impl<S> Layer<S> for SharedStateLayer {
    type Service = SharedState<S>;

    fn layer(&self, inner: S) -> SharedState<S> {
        SharedState {
            shared: self.shared.clone(),
            dated: self.dated,
            inner,
        }
    }
}

#[derive(Clone)]
struct SharedState<S> {
    shared: Arc<AtomicU64>,
    dated: bool,
    inner: S,
}

impl<S> Service<Req> for SharedState<S>
where
    S: Service<Req>,
    S::Future: Unpin,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Holding<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        Holding {
            shared: self.shared.clone(),
            dated: self.dated,
            future: self.inner.call(req),
        }
    }
}

struct Holding<F> {
    shared: Arc<AtomicU64>,
    dated: bool,
    future: F,
}

impl<F: Future + Unpin> Future for Holding<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let output = std::task::ready!(Pin::new(&mut self.future).poll(cx));
        if self.dated {
            // The outcome's date (a bucket of a time window) and its count.
            let at = EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64;
            self.shared
                .fetch_add(at | 1, std::sync::atomic::Ordering::Relaxed);
        }
        Poll::Ready(output)
    }
}

/// The floors' clock origin.
static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Runs `BATCH` calls through a clone of the stack each (as tower makes per request),
/// returning the mean time per call in nanoseconds.
type Batch = Box<dyn Fn() -> Pin<Box<dyn Future<Output = f64>>>>;

fn batch<S, B>(svc: S, make: MakeRequest, drain: bool) -> Batch
where
    S: Service<Req, Response = http::Response<B>> + Clone + 'static,
    S::Error: std::fmt::Debug,
    B: hyper::body::Body + 'static,
    B::Error: std::fmt::Debug,
{
    Box::new(move || {
        let svc = svc.clone();
        Box::pin(async move {
            let start = Instant::now();
            for _ in 0..BATCH {
                let response = svc.clone().oneshot(make()).await.expect("200");
                if drain {
                    // Read to the end, trailers included, as a gRPC client does.
                    let body = http_body_util::BodyExt::collect(response.into_body()).await;
                    std::hint::black_box(body.expect("a body"));
                } else {
                    std::hint::black_box(response);
                }
            }
            start.elapsed().as_nanos() as f64 / f64::from(BATCH)
        })
    })
}

/// Collects each stack's [`Batch`].
struct Batches {
    make: MakeRequest,
    drain: bool,
    stacks: Vec<(&'static str, Batch)>,
}

impl peers::Visit for Batches {
    fn visit<S, B>(&mut self, name: &'static str, svc: S)
    where
        S: Service<Req, Response = http::Response<B>> + Clone + 'static,
        S::Error: std::fmt::Debug,
        B: hyper::body::Body + 'static,
        B::Error: std::fmt::Debug,
    {
        self.stacks.push((name, batch(svc, self.make, self.drain)));
    }
}

/// The stacks of a group: [`peers::each`] (`bare` and tower with its budget, the
/// reference, first), then the shared-state floors only this bench measures.
fn stacks(make: MakeRequest, upstream: Upstream) -> Vec<(&'static str, Batch)> {
    match upstream {
        Upstream::Http => stacks_over(make, false, &stacks::upstream),
        Upstream::Grpc => stacks_over(make, true, &stacks::grpc_upstream),
    }
}

fn stacks_over<S, B>(
    make: MakeRequest,
    drain: bool,
    upstream: &dyn Fn() -> S,
) -> Vec<(&'static str, Batch)>
where
    S: Service<Req, Response = http::Response<B>, Error = tower::BoxError> + Clone + 'static,
    S::Future: Unpin,
    B: hyper::body::Body + 'static,
    B::Error: std::fmt::Debug,
{
    let mut batches = Batches {
        make,
        drain,
        stacks: Vec::new(),
    };
    peers::each(&mut batches, upstream);
    batches.stacks.extend([
        (
            "tower_retry_tps_budget + shared-state floor",
            batch(
                ServiceBuilder::new()
                    .layer(tower::retry::RetryLayer::new(TpsPolicy::new()))
                    .layer(SharedStateLayer::default())
                    .service(upstream()),
                make,
                drain,
            ),
        ),
        (
            "stormguard_retry + shared-state floor",
            batch(
                ServiceBuilder::new()
                    .layer(RetryLayer::new(RetryPolicy::default()))
                    .layer(SharedStateLayer::default())
                    .service(upstream()),
                make,
                drain,
            ),
        ),
        (
            "stormguard_retry + breaker floor",
            batch(
                ServiceBuilder::new()
                    .layer(RetryLayer::new(RetryPolicy::default()))
                    .layer(SharedStateLayer {
                        dated: true,
                        ..SharedStateLayer::default()
                    })
                    .service(upstream()),
                make,
                drain,
            ),
        ),
    ]);
    batches.stacks
}

/// The value at `q` (0 to 1) of `values`, sorted in place.
fn quantile(values: &mut [f64], q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() - 1) as f64 * q).round() as usize;
    values[index]
}

/// One process's measurement of a group: per stack, the median time per call and the
/// ratio of its median overhead over `bare` (per round, against the same round's
/// `bare`) to tower with its budget's.
fn measure(
    rt: &tokio::runtime::Runtime,
    (make, upstream): (MakeRequest, Upstream),
    rounds: usize,
) -> Vec<(f64, f64)> {
    let stacks = stacks(make, upstream);
    let n = stacks.len();
    let mut times = vec![Vec::with_capacity(rounds); n];
    // Warm up: one unmeasured round.
    for (_, run) in &stacks {
        rt.block_on(run());
    }
    for round in 0..rounds {
        for k in 0..n {
            let i = (k + round) % n;
            times[i].push(rt.block_on((stacks[i].1)()));
        }
    }
    let index = |name: &str| {
        stacks
            .iter()
            .position(|(stack, _)| *stack == name)
            .expect("a stack of that name")
    };
    let (bare, reference) = (index("bare"), index("tower_retry_tps_budget"));
    let overhead =
        |i: usize| -> Vec<f64> { (0..rounds).map(|r| times[i][r] - times[bare][r]).collect() };
    let reference = quantile(&mut overhead(reference), 0.5);
    (0..n)
        .map(|i| {
            let median = quantile(&mut overhead(i), 0.5);
            (quantile(&mut times[i].clone(), 0.5), median / reference)
        })
        .collect()
}

/// How each call's request is made.
type MakeRequest = fn() -> Req;

/// What the stacks of a group call.
#[derive(Clone, Copy)]
enum Upstream {
    /// An HTTP server answering `200 ok`.
    Http,
    /// A gRPC server answering a unary call with a message and `grpc-status: 0` in the
    /// trailers; each call's body is read to its end.
    Grpc,
}

/// The groups: a name, how each call's request is made, and what answers it.
const GROUPS: [(&str, (MakeRequest, Upstream)); 3] = [
    ("overhead: a small GET", (request, Upstream::Http)),
    (
        "realistic: a PUT with ten headers and a 1 KiB body",
        (|| realistic_request(UPSTREAM), Upstream::Http),
    ),
    (
        "grpc: a unary call, its response read to the trailers",
        (grpc_request, Upstream::Grpc),
    ),
];

fn main() {
    let mut rounds = 200;
    let mut processes = 5;
    let mut child = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| {
            args.next()
                .and_then(|n| n.parse().ok())
                .filter(|&n| n > 0)
                .unwrap_or_else(|| panic!("{name} takes a positive number"))
        };
        match arg.as_str() {
            "--rounds" => rounds = number("--rounds"),
            "--processes" => processes = number("--processes"),
            "--child" => child = true,
            // Anything else (cargo passes `--bench`) is ignored.
            _ => {}
        }
    }
    if child {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        for (g, (_, make)) in GROUPS.iter().enumerate() {
            for (i, (per_call, ratio)) in measure(&rt, *make, rounds).into_iter().enumerate() {
                println!("{g} {i} {per_call} {ratio}");
            }
        }
        return;
    }
    // Each process lays out its heap and code differently, and that alone moves a stack
    // by several percent: measure in several, and report the median across them.
    let started = Instant::now();
    let exe = std::env::current_exe().expect("own path");
    let mut results: Vec<Vec<Vec<(f64, f64)>>> = Vec::new();
    for _ in 0..processes {
        let out = std::process::Command::new(&exe)
            .args(["--child", "--rounds", &rounds.to_string()])
            .output()
            .expect("run a measuring process");
        assert!(
            out.status.success(),
            "a measuring process failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut groups = vec![Vec::new(); GROUPS.len()];
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let f: Vec<&str> = line.split(' ').collect();
            let (g, per_call, ratio): (usize, f64, f64) = (
                f[0].parse().expect("group"),
                f[2].parse().expect("time"),
                f[3].parse().expect("ratio"),
            );
            groups[g].push((per_call, ratio));
        }
        results.push(groups);
    }
    let names: Vec<&str> = stacks(request, Upstream::Http)
        .iter()
        .map(|(name, _)| *name)
        .collect();
    for (g, (group, _)) in GROUPS.iter().enumerate() {
        println!(
            "\n{group}: {processes} processes, each {rounds} rounds of {BATCH} calls per stack, \
             the order rotated each round\n"
        );
        println!("| stack | per call | ratio of overhead to `tower_retry_tps_budget`'s: median of the processes | each process |");
        println!("|---|---:|---:|---|");
        for (i, name) in names.iter().enumerate() {
            let mut per_call: Vec<f64> = results.iter().map(|r| r[g][i].0).collect();
            let ratios: Vec<f64> = results.iter().map(|r| r[g][i].1).collect();
            let per_call = quantile(&mut per_call, 0.5);
            if *name == "bare" {
                println!("| `{name}` | {per_call:.1} ns | | |");
                continue;
            }
            let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
            let median = quantile(&mut ratios.clone(), 0.5);
            println!(
                "| `{name}` | {per_call:.1} ns | {median:.2} | {} |",
                each.join(" ")
            );
        }
    }
    println!("\n(measured in {:.0} s)", started.elapsed().as_secs_f64());
}
