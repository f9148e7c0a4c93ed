//! The metrics demo, shared by `examples/metrics` and `tests/metrics.rs`: a dependency on
//! 127.0.0.1 that fails its first 40 requests, a client stack named "payments", a burst
//! past a load control's limit, and a `/metrics` endpoint rendering the Prometheus
//! recorder, scraped over HTTP.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use stormguard::{
    Backoff, CircuitBreaker, CircuitBreakerLayer, Jitter, LoadControl, LoadControlLayer,
    RetryLayer, RetryPolicy,
};
use tokio::net::TcpListener;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

/// Requests the dependency answers 503 before it recovers: more than the breaker needs
/// to open (20 calls in its window, all failing), whatever the machine's speed.
pub(crate) const OUTAGE_REQUESTS: u32 = 40;
/// Requests the demo sends, one after another, 5 ms apart.
pub(crate) const REQUESTS: u32 = 200;
/// Calls sent at once, at the end, to a "payments" load control that allows one in
/// flight and no wait: all but the first are shed.
pub(crate) const BURST: u32 = 4;

/// Serves every connection accepted on 127.0.0.1:0 with `answer`; returns the address.
async fn serve<F>(answer: F) -> Result<SocketAddr, BoxError>
where
    F: Fn() -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = answer.clone();
            let service = hyper::service::service_fn(move |_req: Request<Incoming>| {
                let response = answer();
                async move { Ok::<_, Infallible>(response) }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// Installs the Prometheus recorder (once per process), serves `/metrics` (rendered at
/// each scrape) on 127.0.0.1, drives the requests, and returns what a scrape printed.
pub(crate) async fn run() -> Result<String, BoxError> {
    let exporter = exporter().await?;
    drive().await?;
    scrape(exporter).await
}

/// Installs the Prometheus recorder (once per process) and serves its rendering on
/// 127.0.0.1:0 at `/metrics` (any path); returns the address.
pub(crate) async fn exporter() -> Result<SocketAddr, BoxError> {
    let handle: PrometheusHandle = PrometheusBuilder::new().install_recorder()?;
    serve(move || Response::new(Full::new(Bytes::from(handle.render())))).await
}

/// Drives `REQUESTS` requests, 5 ms apart, through a "payments" stack against a
/// dependency that fails its first `OUTAGE_REQUESTS` requests.
pub(crate) async fn drive() -> Result<(), BoxError> {
    let seen = Arc::new(AtomicU32::new(0));
    let upstream = serve(move || {
        let status = if seen.fetch_add(1, Ordering::Relaxed) < OUTAGE_REQUESTS {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::OK
        };
        let mut response = Response::new(Full::new(Bytes::new()));
        *response.status_mut() = status;
        response
    })
    .await?;

    let policy = RetryPolicy::builder()
        .name("payments")
        .backoff(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(5),
            Jitter::Full,
        )?)
        .seed(1)
        .build()?;
    let breaker = CircuitBreaker::builder().name("payments").seed(1).build()?;
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let stack = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .layer(CircuitBreakerLayer::new(breaker))
        .timeout(Duration::from_secs(2))
        .service(client);
    for _ in 0..REQUESTS {
        let req = Request::get(format!("http://{upstream}/charge")).body(Full::default())?;
        // Failures are the point of the demo: what they do to the series.
        if let Ok(res) = stack.clone().oneshot(req).await {
            let _ = res.into_body().collect().await;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    burst().await
}

/// `BURST` calls at once through a load control that allows one call in flight and no
/// wait for room: the first holds the place (its call made, its answer not yet awaited),
/// the others are shed (`load_control_shed_total`). No clock: the place is held by
/// the first call's future, not by a slow dependency.
async fn burst() -> Result<(), BoxError> {
    let control = LoadControl::builder()
        .name("payments")
        .initial(1)
        .min(1)
        .max(1)
        .max_wait(Duration::ZERO)
        .build()?;
    let answer = tower::service_fn(|_: Request<()>| async { Ok::<_, BoxError>(Response::new(())) });
    let mut limited = ServiceBuilder::new()
        .layer(LoadControlLayer::new(control))
        .service(answer);
    let first = limited.ready().await?.call(Request::new(()));
    for _ in 1..BURST {
        // Shed calls are the point: what they do to the series.
        let _ = limited.ready().await?.call(Request::new(())).await;
    }
    first.await?;
    Ok(())
}

/// One scrape of the exporter at `exporter`, over HTTP.
pub(crate) async fn scrape(exporter: SocketAddr) -> Result<String, BoxError> {
    let scraper: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let res = scraper
        .request(Request::get(format!("http://{exporter}/metrics")).body(Full::default())?)
        .await?;
    let body = res.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}
