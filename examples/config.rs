//! One configuration per dependency: reads `examples/stormguard.toml` (or the file given
//! as the first argument) and `examples/grpc_service_config.json`, prints what each
//! dependency gets, then drives the `payments` stack built from the file against a
//! server on 127.0.0.1 that fails its first 30 requests.
//!
//! `cargo run --example config --features serde [-- path/to/stormguard.toml]`

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard::sans_io::methods::MethodPolicy;
use stormguard::{BoxError, CircuitBreakerLayer, Config, HedgeLayer, RetryLayer};
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};

/// Requests the server answers 503 before it recovers.
const FAILING: u32 = 30;
/// Requests the client sends, 10 ms apart.
const REQUESTS: u32 = 200;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let (path, text) = match std::env::args().nth(1) {
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
            (path, text)
        }
        None => (
            "examples/stormguard.toml".to_owned(),
            include_str!("stormguard.toml").to_owned(),
        ),
    };
    let config = Config::from_toml(&text).map_err(|e| format!("{path}: {e}"))?;

    println!("{path}:");
    println!("| dependency | retry budget | breaker | hedging |");
    println!("|---|---|---|---|");
    for name in config.names() {
        let d = config.dependency(name)?;
        let breaker = d.breaker.as_ref().map_or("off".to_owned(), |b| {
            let c = b.config();
            let streak = c
                .consecutive_failures()
                .map_or(String::new(), |n| format!("{n} failures in a row or "));
            format!(
                "opens at {streak}{}% of {:?}, breaks {:?} to {:?}",
                c.failure_ratio() * 100.0,
                c.window(),
                c.break_duration(),
                c.max_break_duration()
            )
        });
        let hedging = d
            .hedge
            .as_ref()
            .map_or("off".to_owned(), |h| format!("{} copies", h.max_attempts()));
        println!(
            "| {name} | {}% of requests over {:?} | {breaker} | {hedging} |",
            d.budget.ratio() * 100.0,
            d.budget.window()
        );
    }

    let grpc = Config::from_grpc_service_config(include_str!("grpc_service_config.json"))?;
    let methods = grpc
        .settings()
        .dependency("default")
        .and_then(|d| d.methods.as_ref());
    println!("\nexamples/grpc_service_config.json, each call's method config:");
    for call in [
        "/grpc.testing.TestService/UnaryCall",
        "/grpc.testing.TestService/StreamingCall",
        "/grpc.testing.TestService/UnaryCallHedged",
        "/other.Service/Call",
    ] {
        let policy = match methods.and_then(|m| m.lookup(call)) {
            Some(MethodPolicy::Retry(r)) => format!(
                "retry: {} attempts, backoff {:?} to {:?} x{}",
                r.max_attempts,
                r.backoff.base(),
                r.backoff.cap(),
                r.backoff.multiplier()
            ),
            Some(MethodPolicy::Hedge(h)) => {
                format!("hedge: {} copies, {:?} apart", h.max_attempts, h.delay)
            }
            _ => "sent once".to_owned(),
        };
        println!("  {call:<42} {policy}");
    }

    // The payments stack, from the file, against a server that fails for a while.
    let seen = Arc::new(AtomicU32::new(0));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = seen.clone();
            let service = hyper::service::service_fn(move |_req: Request<Incoming>| {
                let failing = seen.fetch_add(1, Ordering::Relaxed) < FAILING;
                let mut response = Response::new(Full::new(Bytes::new()));
                if failing {
                    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                }
                async move { Ok::<_, Infallible>(response) }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });

    let payments = config.dependency("payments")?;
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(payments.retry.clone()))
        .option_layer(payments.hedge.clone().map(HedgeLayer::new))
        .layer(CircuitBreakerLayer::new(payments.breaker_or_off()?))
        .timeout(Duration::from_secs(2))
        .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
    let mut ok = 0;
    for _ in 0..REQUESTS {
        let request =
            Request::get(format!("http://{addr}/charge")).body(Full::new(Bytes::new()))?;
        match client.clone().oneshot(request).await {
            Ok(response) if response.status().is_success() => ok += 1,
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.abort();

    let stats = payments.retry.stats();
    println!(
        "\npayments: {REQUESTS} requests, the server failing its first {FAILING}: {ok} ok, \
         {} retries, {} refused by the budget, breaker {} at the end ({} calls refused)",
        stats.retries,
        stats.budget_denied,
        payments
            .breaker
            .as_ref()
            .map_or("off", |b| b.state().as_str()),
        payments.breaker.as_ref().map_or(0, |b| b.stats().rejected),
    );
    Ok(())
}
