//! The standard stack as users hold it: over hyper-util's client against a server on
//! 127.0.0.1, in an axum handler's `State` (and boxed as `Send` there), and its timeouts
//! and validation on paused time.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::routing::get;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard::breaker::ResponseBody;
use stormguard::stack::{HttpStack, StandardStack};
use stormguard::{breaker::CircuitState, BoxError, Deadline};
use tower::{service_fn, ServiceExt};

#[path = "support/budget.rs"]
mod budget;
#[path = "support/server.rs"]
mod server;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Serves `GET /` on 127.0.0.1:0: the first `failures` calls answer 503, the others 200
/// "hello"; counts calls.
async fn upstream(failures: usize) -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let addr = server::serve(move || {
        let calls = calls.clone();
        hyper::service::service_fn(move |_req: Request<Incoming>| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                let status = if n < failures { 503 } else { 200 };
                let body = if n < failures { "busy" } else { "hello" };
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(status)
                        .body(Full::new(Bytes::from_static(body.as_bytes())))
                        .expect("response"),
                )
            }
        })
    })
    .await;
    (format!("http://{addr}/"), seen)
}

fn get_request(uri: &str) -> Request<Full<Bytes>> {
    Request::get(uri).body(Full::default()).expect("request")
}

#[tokio::test]
async fn the_standard_stack_retries_a_blip_over_hyper_util() {
    let (uri, calls) = upstream(2).await;
    let stack = StandardStack::new("upstream");
    let svc: HttpStack<HttpClient> = stack.http(client());
    let res = tokio::time::timeout(Duration::from_secs(10), svc.oneshot(get_request(&uri)))
        .await
        .expect("in time")
        .expect("the third attempt succeeds");
    assert_eq!(res.status(), 200);
    let body = res.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(body, "hello");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let stats = stack.retry().stats();
    assert_eq!((stats.retries, stats.budget_denied), (2, 0), "{stats:?}");
    assert_eq!(stack.breaker().state(), CircuitState::Closed);
}

/// What an application keeps in its axum `State`: the stack, named, not boxed.
#[derive(Clone)]
struct App {
    upstream: HttpStack<HttpClient>,
    uri: String,
}

async fn proxy(State(app): State<App>) -> Result<String, StatusCode> {
    let res = app
        .upstream
        .clone()
        .oneshot(get_request(&app.uri))
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    let body = res.into_body().collect().await;
    let body = body.map_err(|_| StatusCode::BAD_GATEWAY)?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

type Boxed =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<Incoming>>, BoxError>> + Send>>;

/// The idiom the stack's docs show for a handler that must box the call as `Send`.
fn boxed_call(app: &App) -> Boxed {
    Box::pin(app.upstream.clone().oneshot(get_request(&app.uri)))
}

async fn proxy_boxed(State(app): State<App>) -> Result<String, StatusCode> {
    let res = boxed_call(&app)
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    Ok(res.status().as_str().to_owned())
}

#[tokio::test]
async fn an_axum_handler_holds_the_stack_in_its_state() {
    let (uri, calls) = upstream(1).await;
    let stack = StandardStack::new("upstream");
    let app = App {
        upstream: stack.http(client()),
        uri,
    };
    let router = axum::Router::new()
        .route("/", get(proxy))
        .route("/boxed", get(proxy_boxed))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let serving = tokio::spawn(async move { axum::serve(listener, router).await });

    let call = |path: &'static str| client().request(get_request(&format!("http://{addr}{path}")));
    let res = tokio::time::timeout(Duration::from_secs(10), call("/"))
        .await
        .expect("in time")
        .expect("response");
    assert_eq!(res.status(), 200);
    let body = res.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(
        body, "hello",
        "the upstream's 503 was retried inside the handler"
    );
    let res = tokio::time::timeout(Duration::from_secs(10), call("/boxed"))
        .await
        .expect("in time")
        .expect("response");
    let body = res.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(body, "200");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(stack.retry().stats().retries, 1);
    serving.abort();
}

/// A service answering 503 with `Retry-After: 5` on paused time.
fn told_to_wait() -> impl tower::Service<
    Request<String>,
    Response = Response<String>,
    Error = BoxError,
    Future = impl Future<Output = Result<Response<String>, BoxError>> + Send,
> + Clone {
    service_fn(|_req: Request<String>| async {
        Ok::<_, BoxError>(
            Response::builder()
                .status(503)
                .header("retry-after", "5")
                .body(String::new())
                .expect("response"),
        )
    })
}

#[tokio::test(start_paused = true)]
async fn the_total_timeout_is_the_retry_layers_deadline() {
    let stack = StandardStack::builder("upstream")
        .attempt_timeout(Duration::from_millis(500))
        .total_timeout(Duration::from_secs(2))
        .build()
        .expect("valid stack");
    let start = tokio::time::Instant::now();
    let request = Request::get("http://upstream/")
        .body(String::new())
        .expect("request");
    let res = stack
        .http(told_to_wait())
        .oneshot(request)
        .await
        .expect("the 503 comes back");
    // The server asked for 5 s; the caller waits 2 s at most: no retry is scheduled, and
    // the 503 is returned at once instead of a timeout 2 s later.
    assert_eq!(res.status(), 503);
    assert_eq!(start.elapsed(), Duration::ZERO);
    let stats = stack.retry().stats();
    assert_eq!((stats.retries, stats.deadline), (0, 1), "{stats:?}");
}

#[tokio::test(start_paused = true)]
async fn a_callers_earlier_deadline_is_kept() {
    // Total timeout 30 s, the caller's own deadline 1 s: a Retry-After of 5 s is past
    // the earlier one, so the 503 comes back at once.
    let stack = StandardStack::new("upstream");
    let seen = Arc::new(std::sync::Mutex::new(None));
    let record = seen.clone();
    let inner = service_fn(move |req: Request<String>| {
        *record.lock().expect("lock") = req.extensions().get::<Deadline>().copied();
        async {
            Ok::<_, BoxError>(
                Response::builder()
                    .status(503)
                    .header("retry-after", "5")
                    .body(String::new())
                    .expect("response"),
            )
        }
    });
    let now = tokio::time::Instant::now().into_std();
    let mut request = Request::get("http://upstream/")
        .body(String::new())
        .expect("request");
    request
        .extensions_mut()
        .insert(Deadline::after(now, Duration::from_secs(1)));
    let res = stack.http(inner).oneshot(request).await.expect("the 503");
    assert_eq!(res.status(), 503);
    assert_eq!(stack.retry().stats().deadline, 1);
    let deadline = seen
        .lock()
        .expect("lock")
        .expect("a deadline reached the client");
    assert_eq!(deadline.remaining(now), Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_hangs_is_timed_out_and_counted_by_the_breaker() {
    // A budget with room: a brand-new client's default budget retries the first timeout
    // on its allowance and charges it two wasted retries, which leaves no room for a
    // third attempt.
    let retry = stormguard::RetryPolicy::builder()
        .budget(budget::roomy())
        .build()
        .expect("policy");
    let stack = StandardStack::builder("upstream")
        .retry(retry)
        .attempt_timeout(Duration::from_millis(100))
        .total_timeout(Duration::from_secs(5))
        .build()
        .expect("valid stack");
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let hangs = service_fn(move |_req: Request<String>| {
        counted.fetch_add(1, Ordering::SeqCst);
        std::future::pending::<Result<Response<String>, BoxError>>()
    });
    let start = tokio::time::Instant::now();
    let request = Request::get("http://upstream/")
        .body(String::new())
        .expect("request");
    let err = stack
        .http(hangs)
        .oneshot(request)
        .await
        .expect_err("every attempt times out");
    assert!(err.to_string().contains("timed out"), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), 3, "three attempts of 100 ms");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(stack.breaker().stats().failures, 3);
}

#[test]
fn contradictory_settings_are_refused() {
    let err = |builder: stormguard::stack::StandardStackBuilder| {
        builder.build().expect_err("refused").to_string()
    };
    assert_eq!(
        err(StandardStack::builder("a").total_timeout(Duration::ZERO)),
        "invalid total_timeout: 0ns (allowed: more than zero)"
    );
    assert_eq!(
        err(StandardStack::builder("a").attempt_timeout(Duration::ZERO)),
        "invalid attempt_timeout: 0ns (allowed: more than zero)"
    );
    assert_eq!(
        err(StandardStack::builder("a").attempt_timeout(Duration::from_secs(30))),
        "invalid attempt_timeout: 30s (allowed: below the total_timeout, 30s)"
    );
    let stack = StandardStack::new("payments");
    assert_eq!(stack.total_timeout(), Duration::from_secs(30));
    assert_eq!(stack.attempt_timeout(), Duration::from_secs(10));
    assert_eq!(stack.retry().name(), "payments");
}

#[cfg(feature = "serde")]
#[tokio::test(start_paused = true)]
async fn a_config_dependency_makes_the_stack_and_its_breaker_off_never_opens() {
    let config = stormguard::Config::from_toml(
        "[dependencies.legacy]\nbreaker = { enabled = false }\n\
         [dependencies.legacy.retry]\nmax_attempts = 2\n",
    )
    .expect("valid config");
    let stack = StandardStack::from_config(&config, "legacy").expect("stack");
    assert_eq!(stack.retry().name(), "legacy");
    let failing = service_fn(|_req: Request<String>| async {
        Ok::<_, BoxError>(Response::builder().status(500).body(String::new())?)
    });
    let svc = stack.http(failing);
    // Far past what opens the default breaker (50 in a row, or 95% of 20 calls).
    for _ in 0..300 {
        let request = Request::get("http://legacy/")
            .body(String::new())
            .expect("request");
        let res = svc
            .clone()
            .oneshot(request)
            .await
            .expect("a 500, not an open circuit");
        assert_eq!(res.status(), 500);
    }
    assert_eq!(stack.breaker().state(), CircuitState::Closed);
    assert_eq!(stack.breaker().stats().rejected, 0);
    let err = StandardStack::from_config(&config, "missing").expect_err("no such dependency");
    assert!(err.to_string().contains("missing"), "{err}");
}
