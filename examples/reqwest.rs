//! stormguard for a reqwest client, beside reqwest's own retries, on one local server.
//!
//! ```text
//! cargo run --example reqwest --features reqwest
//! ```
//!
//! A server on 127.0.0.1 answers a share of requests with a fast 503 (which ones is
//! fixed by a hash of their arrival order, the same for every row): 30% (a partial
//! failure), then all of them (an outage). 400 GETs, 16 at a time, go through three
//! clients:
//!
//! - `reqwest`: reqwest 0.13's defaults (its retries cover protocol refusals only);
//! - `reqwest retry`: reqwest's own retry policy told to retry a 503 (`classify_fn`),
//!   with its default budget (20% extra load) and no backoff;
//! - `stormguard`: [`StormguardMiddleware`] with the default policy, load control and
//!   breaker, and reqwest's retries off.
//!
//! It prints one row per client and failure: the requests served, and the attempts the
//! server saw.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard::reqwest::StormguardMiddleware;
use stormguard::{BoxError, CircuitBreaker, LoadControl, RetryPolicy};
use tokio::net::TcpListener;

const REQUESTS: u64 = 400;
const CONCURRENCY: u64 = 16;
/// A server on 127.0.0.1:0 failing `fail_percent`% of what it receives; its count.
async fn serve(fail_percent: u64) -> Result<(String, Arc<AtomicU64>), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let seen = Arc::new(AtomicU64::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let count = count.clone();
            let service = hyper::service::service_fn(move |_req: http::Request<Incoming>| {
                let n = count.fetch_add(1, Ordering::SeqCst);
                let status = if mix(n) % 100 < fail_percent {
                    503
                } else {
                    200
                };
                async move {
                    let mut res = http::Response::new(Full::new(Bytes::from_static(b"ok")));
                    *res.status_mut() = http::StatusCode::from_u16(status).unwrap_or_default();
                    Ok::<_, Infallible>(res)
                }
            });
            tokio::spawn(async move {
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let _ = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((format!("http://{addr}/items"), seen))
}

/// A fixed scramble of `n` (splitmix64's finaliser).
fn mix(n: u64) -> u64 {
    let mut z = n.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Sends `REQUESTS` GETs through `client`; the ones served.
async fn run(client: reqwest_middleware::ClientWithMiddleware, url: &str) -> u64 {
    let next = Arc::new(AtomicU64::new(0));
    let served = Arc::new(AtomicU64::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..CONCURRENCY {
        let (client, next, served, url) =
            (client.clone(), next.clone(), served.clone(), url.to_owned());
        workers.spawn(async move {
            while next.fetch_add(1, Ordering::SeqCst) < REQUESTS {
                if let Ok(response) = client.get(&url).send().await {
                    if response.status().is_success() {
                        served.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    served.load(Ordering::SeqCst)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    println!("| failing | client | served | attempts at the server | per request |");
    println!("|---:|---|---:|---:|---:|");
    for (fail_percent, row) in [30, 100]
        .into_iter()
        .flat_map(|f| ["reqwest", "reqwest retry", "stormguard"].map(|row| (f, row)))
    {
        let (url, seen) = serve(fail_percent).await?;
        let client = match row {
            "reqwest" => reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).build(),
            "reqwest retry" => {
                let retry = reqwest::retry::for_host("127.0.0.1").classify_fn(|rr| {
                    if rr.status() == Some(http::StatusCode::SERVICE_UNAVAILABLE) {
                        rr.retryable()
                    } else {
                        rr.success()
                    }
                });
                reqwest_middleware::ClientBuilder::new(
                    reqwest::Client::builder().retry(retry).build()?,
                )
                .build()
            }
            _ => {
                let middleware = StormguardMiddleware::new(RetryPolicy::builder().seed(1).build()?)
                    .with_load_control(LoadControl::default())
                    .with_breaker(CircuitBreaker::builder().seed(1).build()?);
                let plain = reqwest::Client::builder()
                    .retry(reqwest::retry::never())
                    .build()?;
                reqwest_middleware::ClientBuilder::new(plain)
                    .with(middleware)
                    .build()
            }
        };
        let served = run(client, &url).await;
        let attempts = seen.load(Ordering::SeqCst);
        println!(
            "| {fail_percent}% | {row} | {:.1}% | {attempts} | {:.2} |",
            100.0 * served as f64 / REQUESTS as f64,
            attempts as f64 / REQUESTS as f64
        );
    }
    Ok(())
}
