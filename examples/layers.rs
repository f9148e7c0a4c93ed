//! Amplification across layers: user -> A -> B -> C, C failing with 503, every hop
//! retrying with 3 attempts.
//!
//! Three axum services on 127.0.0.1. For each strategy the example sends the same user
//! requests to A and counts the requests that reach C per user request:
//!
//! - `naive`: every hop retries any 5xx up to 3 attempts, 5 ms apart: 3^3 = 27.
//! - `stormguard`: every hop uses stormguard's retry layer (3 attempts, full jitter
//!   10-100 ms, a default retry budget per hop), no signals.
//! - `stormguard_signals`: the same, with `SignalsLayer` on A and B: B's give-up
//!   reaches A as `x-no-retry`, and A's reaches the user.
//!
//! `cargo run --release --example layers [-- --requests N] [--json]`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard::signals::SignalsLayer;
use stormguard::{Backoff, Jitter, RetryLayer, RetryPolicy};
use tokio::net::TcpListener;
use tower::retry::{Policy, RetryLayer as TowerRetryLayer};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, ServiceBuilder, ServiceExt};

type Upstream = BoxCloneSyncService<Request<Full<Bytes>>, Response<Incoming>, BoxError>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Strategy {
    Naive,
    Stormguard,
    StormguardSignals,
}

impl Strategy {
    fn name(self) -> &'static str {
        match self {
            Strategy::Naive => "naive",
            Strategy::Stormguard => "stormguard",
            Strategy::StormguardSignals => "stormguard_signals",
        }
    }
}

/// The naive policy: any error or 5xx, up to 3 attempts, 5 ms apart.
#[derive(Clone)]
struct Naive {
    attempts: u32,
}

impl<B: Clone, E> Policy<Request<B>, Response<Incoming>, E> for Naive {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _: &mut Request<B>,
        result: &mut Result<Response<Incoming>, E>,
    ) -> Option<Self::Future> {
        self.attempts += 1;
        let failed = result
            .as_ref()
            .map_or(true, |r| r.status().is_server_error());
        (failed && self.attempts < 3).then(|| tokio::time::sleep(Duration::from_millis(5)))
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        Some(req.clone())
    }
}

/// A client to `base` that retries by `strategy`; each call makes a fresh policy
/// state, and stormguard's budget is one per hop.
fn client(strategy: Strategy) -> Result<Upstream, BoxError> {
    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let http = ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .service(http);
    Ok(match strategy {
        Strategy::Naive => BoxCloneSyncService::new(
            ServiceBuilder::new()
                .layer(TowerRetryLayer::new(Naive { attempts: 0 }))
                .service(http),
        ),
        Strategy::Stormguard | Strategy::StormguardSignals => {
            let backoff = Backoff::new(
                Duration::from_millis(10),
                Duration::from_millis(100),
                Jitter::Full,
            )?;
            let policy = RetryPolicy::builder()
                .max_attempts(3)
                .backoff(backoff)
                .build()?;
            BoxCloneSyncService::new(
                ServiceBuilder::new()
                    .layer(RetryLayer::new(policy))
                    .service(http),
            )
        }
    })
}

#[derive(Clone)]
struct Hop {
    next: Upstream,
    url: String,
}

/// A middle hop: calls the next one, answers with its status.
async fn relay(State(hop): State<Hop>) -> StatusCode {
    let Ok(req) = Request::get(&hop.url).body(Full::default()) else {
        return StatusCode::INTERNAL_SERVER_ERROR;
    };
    match hop.next.oneshot(req).await {
        Ok(res) => StatusCode::from_u16(res.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

async fn serve(app: Router) -> Result<String, BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}/"))
}

/// Starts C, B and A for `strategy`; returns A's address and C's request counter.
async fn chain(strategy: Strategy) -> Result<(String, Arc<AtomicU64>), BoxError> {
    let bottom = Arc::new(AtomicU64::new(0));
    let seen = bottom.clone();
    let c = Router::new().route(
        "/",
        get(move || {
            seen.fetch_add(1, Ordering::Relaxed);
            async { StatusCode::SERVICE_UNAVAILABLE }
        }),
    );
    let mut url = serve(c).await?;
    for _hop in ["B", "A"] {
        let hop = Hop {
            next: client(strategy)?,
            url,
        };
        let app = Router::new().route("/", get(relay)).with_state(hop);
        let app = if strategy == Strategy::StormguardSignals {
            app.layer(SignalsLayer::new())
        } else {
            app
        };
        url = serve(app).await?;
    }
    Ok((url, bottom))
}

struct Row {
    strategy: Strategy,
    requests: u64,
    bottom: u64,
}

async fn run(strategy: Strategy, requests: u64) -> Result<Row, BoxError> {
    let (a, bottom) = chain(strategy).await?;
    let user = client(strategy)?;
    let mut calls = tokio::task::JoinSet::new();
    // Eight users at a time; every call is bounded by the per-attempt timeouts.
    let next = Arc::new(AtomicU64::new(0));
    for _ in 0..8 {
        let (user, a, next) = (user.clone(), a.clone(), next.clone());
        calls.spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < requests {
                let Ok(req) = Request::get(&a).body(Full::default()) else {
                    break;
                };
                let _ = user.clone().oneshot(req).await;
            }
        });
    }
    while calls.join_next().await.is_some() {}
    Ok(Row {
        strategy,
        requests,
        bottom: bottom.load(Ordering::Relaxed),
    })
}

fn usage() -> ! {
    eprintln!("usage: layers [--requests N (1..=10000)] [--json]");
    std::process::exit(2)
}

fn parse() -> (u64, bool) {
    let mut requests = 200;
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--requests" => {
                requests = match args.next().and_then(|n| n.parse().ok()) {
                    Some(n @ 1..=10_000) => n,
                    _ => usage(),
                }
            }
            _ => usage(),
        }
    }
    (requests, json)
}

fn main() -> Result<(), BoxError> {
    let (requests, json) = parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let rows = runtime.block_on(async {
        let mut rows = Vec::new();
        for strategy in [
            Strategy::Naive,
            Strategy::Stormguard,
            Strategy::StormguardSignals,
        ] {
            rows.push(run(strategy, requests).await?);
        }
        Ok::<_, BoxError>(rows)
    })?;
    if json {
        let rows: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"strategy\":\"{}\",\"user_requests\":{},\"bottom_requests\":{},\"bottom_per_request\":{:.2}}}",
                    r.strategy.name(),
                    r.requests,
                    r.bottom,
                    r.bottom as f64 / r.requests as f64
                )
            })
            .collect();
        println!("[{}]", rows.join(","));
        return Ok(());
    }
    println!(
        "user -> A -> B -> C, C answers 503; 3 attempts at every hop; {requests} user requests"
    );
    println!();
    println!("| strategy | requests at C | per user request |");
    println!("|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} |",
            r.strategy.name(),
            r.bottom,
            r.bottom as f64 / r.requests as f64
        );
    }
    Ok(())
}
