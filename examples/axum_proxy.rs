//! An axum handler that calls its upstream through the stormguard stack.
//!
//! Two servers on 127.0.0.1: a flaky upstream (every third request gets a 503) and an
//! axum proxy whose `/quote` handler calls it through the standard stack (total timeout,
//! retry, circuit breaker, per-attempt timeout), held by name in the handler's `State`. The example then calls the proxy a few times and prints what its
//! callers saw: every call succeeds, though a third of the upstream attempts failed.
//!
//! `cargo run --example axum_proxy`

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard::stack::{HttpStack, StandardStack};
use stormguard::Attempts;
use tokio::net::TcpListener;
use tower::{BoxError, ServiceExt};

/// The upstream's stack, named: no boxing needed to keep it in the `State`.
type Upstream = HttpStack<Client<HttpConnector, Full<Bytes>>>;

#[derive(Clone)]
struct Proxy {
    upstream: Upstream,
    base: String,
}

async fn quote(State(proxy): State<Proxy>) -> (StatusCode, String) {
    let req = match http::Request::get(format!("{}/price", proxy.base)).body(Full::default()) {
        Ok(req) => req,
        Err(err) => return (StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
    };
    match proxy.upstream.oneshot(req).await {
        Ok(res) => {
            let attempts = Attempts::of(&res);
            let status = res.status();
            let body = res
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let text = format!(
                "{} (upstream {status} after {attempts} attempts)",
                String::from_utf8_lossy(&body)
            );
            (
                StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY),
                text,
            )
        }
        // CircuitOpen, timeouts, connection failures: the proxy answers 503 itself.
        Err(err) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("upstream unavailable: {err}"),
        ),
    }
}

async fn serve(app: Router) -> std::io::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}"))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let calls = Arc::new(AtomicU32::new(0));
    let upstream_app = Router::new().route(
        "/price",
        get(move || {
            let n = calls.fetch_add(1, Ordering::Relaxed);
            async move {
                if n.is_multiple_of(3) {
                    (StatusCode::SERVICE_UNAVAILABLE, String::from("busy"))
                } else {
                    (StatusCode::OK, format!("42.{n:02} EUR"))
                }
            }
        }),
    );
    let upstream_base = serve(upstream_app).await?;

    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    // The defaults but the attempt timeout: this upstream answers in microseconds, so an
    // attempt that takes a second is a hung one.
    let stack = StandardStack::builder("prices")
        .attempt_timeout(Duration::from_secs(1))
        .build()?;
    let proxy = Proxy {
        upstream: stack.http(client),
        base: upstream_base,
    };
    let proxy_base = serve(Router::new().route("/quote", get(quote)).with_state(proxy)).await?;

    let caller: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    for _ in 0..4 {
        let res = caller
            .request(http::Request::get(format!("{proxy_base}/quote")).body(Full::default())?)
            .await?;
        let status = res.status();
        let body = res.into_body().collect().await?.to_bytes();
        println!("GET /quote -> {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(())
}
