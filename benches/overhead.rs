//! What stormguard costs per call on the success path, next to a bare service and the
//! peers a tower user would pick, all in one criterion run.
//!
//! - `overhead`: the same small `GET` (`http::Request<Full<Bytes>>`) to the same
//!   always-200 `service_fn`, awaiting readiness and the response on a current-thread
//!   runtime: the layers' own cost, with as little else as possible.
//! - `realistic`: the same, with a request as a real client sends one (ten headers, a
//!   1 KiB body), which the retry layers clone.
//! - `h2_loopback`: that request through hyper-util's client, over one HTTP/2
//!   connection to a hyper server on 127.0.0.1 run by the bench on the same runtime, the
//!   response body read to its end: the layers' cost as a share of a real call.
//!
//! `cargo bench -p stormguard-bench --bench overhead` (or `-- --quick` for a short run).
//! The bench crate builds tokio without `test-util`, as a user's build does. The ratios
//! to tower are measured more steadily by `--bench ratio`, which interleaves the stacks
//! and measures in several processes.

use std::convert::Infallible;
use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::runtime::Runtime;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

mod peers;
#[path = "../tests/support/stacks.rs"]
mod stacks;

use stacks::{realistic_request, request, upstream, Req, UPSTREAM};

type Group<'a> = BenchmarkGroup<'a, criterion::measurement::WallTime>;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// How a bench builds its requests and what it does with the responses.
#[derive(Clone, Copy)]
struct Calls<'a> {
    /// A fresh request.
    make: &'a dyn Fn() -> Req,
    /// Whether to read the response body to its end (over a real connection it is
    /// what frees the stream); in memory the response is only dropped.
    read_body: bool,
}

/// Benches one call through `svc` (a clone of it, as tower makes per request): a fresh
/// request, readiness, the call, and the response.
fn bench<S, B>(group: &mut Group<'_>, rt: &Runtime, id: &str, calls: Calls<'_>, svc: S)
where
    S: Service<Req, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: hyper::body::Body,
    B::Error: std::fmt::Debug,
{
    group.bench_function(id, |b| {
        b.to_async(rt).iter(|| {
            let mut svc = svc.clone();
            let req = (calls.make)();
            async move {
                let res = svc.ready().await.expect("ready").call(req).await;
                let res = res.expect("200");
                if calls.read_body {
                    black_box(res.into_body().collect().await.expect("body"));
                } else {
                    black_box(res);
                }
            }
        })
    });
}

/// Benches each of [`peers::each`]'s stacks in one group.
struct Benches<'g, 'a, 'c> {
    group: &'g mut Group<'a>,
    rt: &'g Runtime,
    calls: Calls<'c>,
}

impl peers::Visit for Benches<'_, '_, '_> {
    fn visit<S, B>(&mut self, name: &'static str, svc: S)
    where
        S: Service<Req, Response = Response<B>> + Clone + 'static,
        S::Error: std::fmt::Debug,
        B: hyper::body::Body + 'static,
        B::Error: std::fmt::Debug,
    {
        bench(self.group, self.rt, name, self.calls, svc);
    }
}

/// The stacks compared on every upstream ([`peers::each`]).
fn peers<S, B>(group: &mut Group<'_>, rt: &Runtime, calls: Calls<'_>, upstream: &dyn Fn() -> S)
where
    S: Service<Req, Response = Response<B>> + Clone + 'static,
    S::Error: Into<BoxError> + std::fmt::Debug + 'static,
    B: hyper::body::Body + 'static,
    B::Error: std::fmt::Debug,
{
    peers::each(&mut Benches { group, rt, calls }, upstream);
}

fn overhead(c: &mut Criterion) {
    let rt = runtime();
    let calls = Calls {
        make: &request,
        read_body: false,
    };
    let mut group = c.benchmark_group("overhead");
    peers(&mut group, &rt, calls, &upstream);
    let retry = tower_resilience::retry::RetryLayer::<
        Req,
        stacks::Res,
        tower_resilience::circuitbreaker::CircuitBreakerError<BoxError>,
    >::builder()
    .max_attempts(3)
    .exponential_backoff(Duration::from_millis(200))
    .build();
    let breaker = tower_resilience::circuitbreaker::CircuitBreakerLayer::builder()
        .failure_rate_threshold(0.5)
        .sliding_window_size(100)
        .minimum_number_of_calls(20)
        .wait_duration_in_open(Duration::from_secs(5))
        .build()
        .expect("breaker");
    bench(
        &mut group,
        &rt,
        "tower_resilience_retry_breaker",
        calls,
        ServiceBuilder::new()
            .layer(retry)
            .layer(breaker)
            .service(upstream()),
    );
    group.finish();
}

fn realistic(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("realistic");
    let calls = Calls {
        make: &|| realistic_request(UPSTREAM),
        read_body: false,
    };
    peers(&mut group, &rt, calls, &upstream);
    group.finish();
}

/// A hyper HTTP/2 server on 127.0.0.1 that reads each request's body and answers 200
/// "ok", spawned on `rt`; returns its address.
fn h2_server(rt: &Runtime) -> std::net::SocketAddr {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    rt.spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn h2_loopback(c: &mut Criterion) {
    let rt = runtime();
    let addr = h2_server(&rt);
    let client = || {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build::<_, Full<Bytes>>(connector)
    };
    let uri = format!("http://{addr}/items/7");
    let mut group = c.benchmark_group("h2_loopback");
    let calls = Calls {
        make: &|| realistic_request(&uri),
        read_body: true,
    };
    peers(&mut group, &rt, calls, &client);
    group.finish();
}

criterion_group!(benches, overhead, realistic, h2_loopback);
criterion_main!(benches);
