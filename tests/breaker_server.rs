//! The circuit breaker in front of a real HTTP server on 127.0.0.1 that goes down
//! (503 for everything) and comes back. Real sockets, so real (short) time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard::breaker::{BreakerConfig, CircuitBreakerService, ResponseBody};
use stormguard::BoxError;
use stormguard::{breaker::CircuitState, CircuitBreaker, CircuitBreakerLayer, CircuitOpen};
use tower::{Layer, Service, ServiceExt};

#[derive(Default)]
struct Server {
    down: AtomicBool,
    hits: AtomicU64,
}

impl Server {
    fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

async fn start(server: Arc<Server>) -> String {
    let app = Router::new().route(
        "/",
        get(move || {
            let server = server.clone();
            async move {
                server.hits.fetch_add(1, Ordering::SeqCst);
                if server.down.load(Ordering::SeqCst) {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::OK
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/")
}

type Svc = CircuitBreakerService<Client<HttpConnector, Empty<Bytes>>>;

async fn send(
    svc: &mut Svc,
    uri: &str,
) -> Result<http::Response<ResponseBody<Incoming>>, BoxError> {
    let request = http::Request::get(uri)
        .body(Empty::<Bytes>::new())
        .expect("request");
    svc.ready().await?.call(request).await
}

/// Polls (every 10 ms, for at most 3 s) until the break is over.
async fn wait_for_half_open(breaker: &CircuitBreaker) {
    for _ in 0..300 {
        if breaker.state() == CircuitState::HalfOpen {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the break did not end within 3 s");
}

#[tokio::test]
async fn opens_on_an_outage_spares_the_server_and_recovers() {
    let server = Arc::new(Server::default());
    let uri = start(server.clone()).await;
    let breaker = CircuitBreaker::builder()
        .config(
            BreakerConfig::builder()
                .min_throughput(5)
                .failure_ratio(0.5)
                .window(Duration::from_secs(10))
                .break_duration(Duration::from_millis(200))
                .max_break_duration(Duration::from_secs(1))
                .jitter(0.0),
        )
        .build()
        .expect("config");
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut svc = CircuitBreakerLayer::new(breaker.clone()).layer(client);

    // Healthy.
    for _ in 0..5 {
        assert_eq!(send(&mut svc, &uri).await.expect("response").status(), 200);
    }
    assert_eq!(server.hits(), 5);

    // Down: the breaker opens once half the calls in the window failed.
    server.down.store(true, Ordering::SeqCst);
    let mut failures = 0;
    while breaker.state() == CircuitState::Closed && failures < 20 {
        assert_eq!(send(&mut svc, &uri).await.expect("response").status(), 503);
        failures += 1;
    }
    assert_eq!(breaker.state(), CircuitState::Open);
    assert_eq!(failures, 5);
    let hits = server.hits();

    // While open, nothing reaches the server.
    for _ in 0..50 {
        let error = send(&mut svc, &uri).await.expect_err("fails fast");
        assert!(error.is::<CircuitOpen>(), "{error}");
    }
    assert_eq!(server.hits(), hits);

    // After the break one probe goes through; it fails, and the break doubles.
    wait_for_half_open(&breaker).await;
    assert_eq!(send(&mut svc, &uri).await.expect("probe").status(), 503);
    assert_eq!(server.hits(), hits + 1);
    let open = send(&mut svc, &uri).await.expect_err("open again");
    let open = open.downcast_ref::<CircuitOpen>().expect("CircuitOpen");
    // Longer than the whole first break: it doubled (to 400 ms).
    assert!(open.remaining() > Duration::from_millis(200), "{open:?}");
    assert_eq!(server.hits(), hits + 1);

    // The server recovers; after the longer break the probe succeeds and traffic resumes.
    server.down.store(false, Ordering::SeqCst);
    wait_for_half_open(&breaker).await;
    assert_eq!(send(&mut svc, &uri).await.expect("probe").status(), 200);
    assert_eq!(breaker.state(), CircuitState::Closed);
    for _ in 0..10 {
        assert_eq!(send(&mut svc, &uri).await.expect("response").status(), 200);
    }
    assert_eq!(server.hits(), hits + 12);
    let stats = breaker.stats();
    assert_eq!(stats.rejected, 51);
    assert_eq!(stats.transitions, 5); // open, half-open, open, half-open, closed
}
