//! A hyper-util client with the whole stormguard stack, over HTTP/1.1 and HTTP/2.
//!
//! Starts a flaky server on 127.0.0.1 (every request's first two attempts get 503, the
//! first of them with `Retry-After: 1`), then calls it through retry, circuit breaker
//! and per-attempt timeout, and prints what happened.
//!
//! `cargo run --example hyper_client`

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard::{Attempts, CircuitBreaker, CircuitBreakerLayer, RetryLayer, RetryPolicy};
use tokio::net::TcpListener;
use tower::{BoxError, ServiceBuilder, ServiceExt};

/// A server that fails the first two attempts at each path.
async fn flaky_server() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let seen: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = seen.clone();
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let path = req.uri().path().to_owned();
                let n = {
                    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                    let n = seen.entry(path.clone()).or_default();
                    *n += 1;
                    *n
                };
                async move {
                    let res = match n {
                        1 => Response::builder().status(503).header("retry-after", "1"),
                        2 => Response::builder().status(503),
                        _ => Response::builder().status(200),
                    };
                    Ok::<_, Infallible>(
                        res.body(Full::new(Bytes::from(format!("{path}: attempt {n}"))))
                            .unwrap_or_default(),
                    )
                }
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let addr = flaky_server().await?;
    let policy = RetryPolicy::builder().build()?;
    let breaker = CircuitBreaker::builder().build()?;

    for http2 in [false, true] {
        let client = Client::builder(TokioExecutor::new())
            .http2_only(http2)
            .build_http::<Full<Bytes>>();
        // The layers by hand, to show each; `StandardStack::new("flaky").http(client)`
        // is the same order with a total timeout on top (see examples/axum_proxy.rs).
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new(policy.clone()))
            .layer(CircuitBreakerLayer::new(breaker.clone()))
            .timeout(Duration::from_secs(2))
            .service(client);
        let path = if http2 { "/h2" } else { "/h1" };
        let started = tokio::time::Instant::now();
        let res = svc
            .oneshot(Request::get(format!("http://{addr}{path}")).body(Full::default())?)
            .await?;
        let attempts = Attempts::of(&res);
        let status = res.status();
        let body = res.into_body().collect().await?.to_bytes();
        println!(
            "{}: {status} after {attempts} attempts in {:.2?} ({})",
            if http2 { "HTTP/2  " } else { "HTTP/1.1" },
            started.elapsed(),
            String::from_utf8_lossy(&body),
        );
    }
    let stats = policy.stats();
    println!(
        "retry stats: {} requests, {} retries, {} exhausted; breaker {:?}",
        stats.requests,
        stats.retries,
        stats.exhausted,
        breaker.state()
    );
    Ok(())
}
