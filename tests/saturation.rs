//! A real server under saturation: HAProxy in front of a backend of four workers (at
//! most four requests at a time, 20 ms each: 200 a second), the requests past them in
//! HAProxy's queue, offered three times what it serves. With an attempt timeout of ten
//! service times, the stack whose load control never binds keeps the queue full: every
//! queued request outlives its caller, and the backend spends its time on answers
//! nobody waits for. The standard stack keeps the calls in flight near what the backend
//! serves, and its callers get the backend's capacity.
//!
//! Needs HAProxy (`apt-get install haproxy`; `.ci/run` installs it), so it is
//! `#[ignore]`d in `cargo test`; CI runs it
//! (`cargo test --all-features --test saturation -- --ignored --nocapture`).

#[path = "support/haproxy.rs"]
mod haproxy;
#[path = "support/server.rs"]
mod server;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use haproxy::Haproxy;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use stormguard::connect::TrackedConnector;
use stormguard::stack::StandardStack;
use stormguard::{BoxError, LoadControl};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

/// The backend's workers (HAProxy's `maxconn` for it) and each call's service time.
const WORKERS: u32 = 4;
const SERVICE: Duration = Duration::from_millis(20);
/// Offered: three times the backend's nominal capacity (200 a second).
const OFFERED: u32 = 600;
/// Long enough that a cold client's start (its first second: see `refused`) is not what
/// the goodput measures.
const WINDOW: Duration = Duration::from_secs(10);
/// Ten service times per attempt.
const ATTEMPT: Duration = Duration::from_millis(200);
const TOTAL: Duration = Duration::from_secs(1);

struct Run {
    /// Requests served to their caller.
    served: u32,
    /// Of them, started in the run's first second: a cold client's start.
    served_first_second: u32,
    /// Answers the backend gave, per second: its capacity while its workers are busy.
    backend_rate: f64,
    /// Shed by the load control.
    shed: u32,
    /// Refused by an open circuit (`CircuitOpen`): a cold client's first calls time out
    /// in a row and open it for a moment.
    refused: u32,
    latencies: Vec<Duration>,
}

/// How a request ended.
enum Ending {
    Served(Duration),
    Shed,
    Refused,
    Failed,
}

async fn run(stack: StandardStack) -> Result<Run, BoxError> {
    let answered = Arc::new(AtomicU32::new(0));
    let counter = answered.clone();
    let backend = server::serve(move || {
        let counter = counter.clone();
        hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
            let counter = counter.clone();
            async move {
                tokio::time::sleep(SERVICE).await;
                counter.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        })
    })
    .await;
    let proxy = Haproxy::start(backend, WORKERS).await?;
    let client = Client::builder(TokioExecutor::new())
        .build::<_, Full<Bytes>>(TrackedConnector::new(HttpConnector::new()));
    let service = stack.http(client);
    let uri = format!("http://{}/", proxy.addr);
    let period = Duration::from_secs(1) / OFFERED;
    let total = (WINDOW.as_secs_f64() * f64::from(OFFERED)) as u32;
    let start = Instant::now() + Duration::from_millis(50);
    let mut requests = JoinSet::new();
    let mut answered_at_start = 0;
    for i in 0..total {
        tokio::time::sleep_until(start + period * i).await;
        if i == 0 {
            answered_at_start = answered.load(Ordering::SeqCst);
        }
        let (service, uri) = (service.clone(), uri.clone());
        requests.spawn(async move {
            let began = Instant::now();
            let first_second = began < start + Duration::from_secs(1);
            let request = Request::get(uri).body(Full::default()).expect("request");
            let ending = match service.oneshot(request).await {
                Ok(response) if response.status() == StatusCode::OK => {
                    match response.into_body().collect().await {
                        Ok(_) => Ending::Served(began.elapsed()),
                        Err(_) => Ending::Failed,
                    }
                }
                Ok(_) => Ending::Failed,
                Err(err) if err.downcast_ref::<stormguard::Shed>().is_some() => Ending::Shed,
                Err(err) if err.downcast_ref::<stormguard::CircuitOpen>().is_some() => {
                    Ending::Refused
                }
                Err(_) => Ending::Failed,
            };
            (first_second, ending)
        });
    }
    let backend_rate = f64::from(answered.load(Ordering::SeqCst) - answered_at_start)
        / start.elapsed().as_secs_f64();
    let (mut served, mut served_first_second, mut shed, mut refused, mut latencies) =
        (0, 0, 0, 0, Vec::new());
    while let Some(done) = requests.join_next().await {
        let (first_second, ending) = done?;
        match ending {
            Ending::Served(took) => {
                served += 1;
                served_first_second += u32::from(first_second);
                latencies.push(took);
            }
            Ending::Shed => shed += 1,
            Ending::Refused => refused += 1,
            Ending::Failed => {}
        }
    }
    latencies.sort_unstable();
    Ok(Run {
        served,
        served_first_second,
        backend_rate,
        shed,
        refused,
        latencies,
    })
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let rank = (sorted.len() * p).div_ceil(100).max(1);
    sorted.get(rank - 1).copied().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs HAProxy; CI runs it"]
async fn a_saturated_server_serves_its_capacity_through_the_standard_stack() -> Result<(), BoxError>
{
    let stack = |load: Option<LoadControl>| {
        let builder = StandardStack::builder("saturated")
            .attempt_timeout(ATTEMPT)
            .total_timeout(TOTAL);
        match load {
            Some(load) => builder.load_control(load),
            None => builder,
        }
        .build()
    };
    // A control whose limit never goes below a thousand calls: no load control.
    let never_binds = LoadControl::builder()
        .name("saturated")
        .min(1000)
        .max(1000)
        .build()?;
    let without = run(stack(Some(never_binds))?).await?;
    let standard = stack(None)?;
    let with = run(standard.clone()).await?;
    // The backend's workers are always busy without the control (its queue is full):
    // what it answers a second then is its capacity.
    let capacity = without.backend_rate;
    let window = WINDOW.as_secs_f64();
    let goodput = |run: &Run| f64::from(run.served) / window / capacity;
    for (name, run) in [("no load control", &without), ("standard stack", &with)] {
        println!(
            "{name:16} served {:5} of {} ({:.1}% of capacity {capacity:.0}/s; in the first second \
             {}), shed {:5}, refused {:4}, backend {:.0} answers/s, served p50 {:?} p99 {:?}",
            run.served,
            (window * f64::from(OFFERED)) as u32,
            100.0 * goodput(run),
            run.served_first_second,
            run.shed,
            run.refused,
            run.backend_rate,
            percentile(&run.latencies, 50),
            percentile(&run.latencies, 99),
        );
    }
    println!(
        "standard stack's load control: {:?}",
        standard.load().stats()
    );
    println!("standard stack's breaker: {:?}", standard.breaker().stats());
    assert!(goodput(&without) < 0.5, "{}", goodput(&without));
    assert!(goodput(&with) >= 0.8, "{}", goodput(&with));
    Ok(())
}
