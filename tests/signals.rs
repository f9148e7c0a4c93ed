//! Signals across layers, in process on paused time: a caller, a server with
//! `SignalsLayer` whose handler calls a dependency through stormguard's retry layer,
//! and the dependency.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use stormguard::signals::{InboundAttempt, ResponseBody, SignalsLayer};
use stormguard::{Backoff, Jitter, RetryBudget, RetryLayer, RetryPolicy};
use tower::util::BoxCloneService;
use tower::{service_fn, BoxError, ServiceBuilder, ServiceExt};

type Svc = BoxCloneService<Request<String>, Response<String>, BoxError>;

fn policy(budget: RetryBudget) -> RetryPolicy {
    RetryPolicy::builder()
        .backoff(
            Backoff::new(
                Duration::from_millis(10),
                Duration::from_millis(100),
                Jitter::None,
            )
            .expect("backoff"),
        )
        .budget(budget)
        .seed(3)
        .build()
        .expect("policy")
}

fn plenty() -> RetryBudget {
    RetryBudget::builder()
        .ratio(1.0)
        .allowance(1_000)
        .build()
        .expect("budget")
}

/// The bottom dependency: answers `status` (with `grpc`, as a trailers-only gRPC
/// error) and counts what it sees.
fn bottom(status: u16, grpc: bool, seen: Arc<AtomicU32>) -> Svc {
    BoxCloneService::new(service_fn(move |_req: Request<String>| {
        seen.fetch_add(1, Ordering::SeqCst);
        let mut res = Response::builder().status(status);
        if grpc {
            res = res.header("grpc-status", "14");
        }
        async move { Ok::<_, BoxError>(res.body(String::new()).expect("response")) }
    }))
}

/// A server with the signals layer whose handler calls `dependency` through a retry
/// layer with `outbound`, answering 503 (or the dependency's gRPC error) when that
/// call fails and `fallback` is false, 200 when it is true.
fn middle(dependency: Svc, outbound: RetryPolicy, layer: SignalsLayer, fallback: bool) -> Svc {
    // Boxed, as an application holds its clients (the handler's future then names no
    // retry types).
    let client: Svc = BoxCloneService::new(
        ServiceBuilder::new()
            .layer(RetryLayer::new(outbound))
            .service(dependency),
    );
    let handler = service_fn(move |req: Request<String>| {
        let client = client.clone();
        async move {
            let mut outbound = Request::new(String::new());
            *outbound.uri_mut() = req.uri().clone();
            if let Some(ct) = req.headers().get("content-type") {
                outbound.headers_mut().insert("content-type", ct.clone());
            }
            let res = client.oneshot(outbound).await?;
            let status = if res.status().is_success() || fallback {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let mut answer = Response::builder().status(status);
            if let Some(grpc) = res.headers().get("grpc-status") {
                answer = answer.header("grpc-status", grpc);
            }
            Ok::<_, BoxError>(answer.body(String::new()).expect("response"))
        }
    });
    BoxCloneService::new(
        ServiceBuilder::new()
            .map_response(|r: Response<ResponseBody<String>>| r.map(ResponseBody::into_inner))
            .layer(layer)
            .service(handler),
    )
}

fn request() -> Request<String> {
    Request::get("http://middle/")
        .body(String::new())
        .expect("request")
}

#[tokio::test(start_paused = true)]
async fn a_failure_after_the_outbound_policy_gave_up_is_not_retried_upstream() {
    let seen = Arc::new(AtomicU32::new(0));
    let server = middle(
        bottom(503, false, seen.clone()),
        policy(plenty()),
        SignalsLayer::new(),
        false,
    );
    let caller_policy = policy(plenty());
    let caller = ServiceBuilder::new()
        .layer(RetryLayer::new(caller_policy.clone()))
        .service(server);
    let res = caller.oneshot(request()).await.expect("response");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["x-no-retry"], "exhausted");
    // Three attempts at the bottom, not nine: the caller did not retry.
    assert_eq!(seen.load(Ordering::SeqCst), 3);
    let stats = caller_policy.stats();
    assert_eq!((stats.retries, stats.server_refused), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_spent_budget_says_budget_and_grpc_errors_get_pushback() {
    let empty = RetryBudget::builder()
        .ratio(0.0)
        .allowance(0)
        .build()
        .expect("budget");
    let seen = Arc::new(AtomicU32::new(0));
    let server = middle(
        bottom(503, false, seen.clone()),
        policy(empty.clone()),
        SignalsLayer::new(),
        false,
    );
    let res = server.oneshot(request()).await.expect("response");
    assert_eq!(res.headers()["x-no-retry"], "budget");

    let grpc = middle(
        bottom(200, true, seen.clone()),
        policy(empty),
        SignalsLayer::new(),
        false,
    );
    let mut req = request();
    req.headers_mut()
        .insert("content-type", "application/grpc".parse().expect("header"));
    let res = grpc.oneshot(req).await.expect("response");
    assert_eq!(res.headers()["grpc-retry-pushback-ms"], "-1");
    assert!(res.headers().get("x-no-retry").is_none());
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_recovers_is_not_marked() {
    let seen = Arc::new(AtomicU32::new(0));
    let server = middle(
        bottom(503, false, seen),
        policy(plenty()),
        SignalsLayer::new(),
        true,
    );
    let res = server.oneshot(request()).await.expect("response");
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers().get("x-no-retry").is_none());
}

#[tokio::test(start_paused = true)]
async fn without_the_layer_nothing_is_marked() {
    let seen = Arc::new(AtomicU32::new(0));
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy(plenty())))
        .service(bottom(503, false, seen));
    let res = client.oneshot(request()).await.expect("response");
    assert!(res.headers().get("x-no-retry").is_none());
}

#[tokio::test(start_paused = true)]
async fn an_inbound_retry_calls_once_when_configured() {
    for (layer, attempt, expected) in [
        (SignalsLayer::new(), "2", 3),
        (SignalsLayer::new().retries_call_once(true), "1", 3),
        (SignalsLayer::new().retries_call_once(true), "2", 1),
    ] {
        let seen = Arc::new(AtomicU32::new(0));
        let server = middle(
            bottom(503, false, seen.clone()),
            policy(plenty()),
            layer,
            false,
        );
        let mut req = request();
        req.headers_mut()
            .insert("x-attempt-count", attempt.parse().expect("header"));
        server.oneshot(req).await.expect("response");
        assert_eq!(
            seen.load(Ordering::SeqCst),
            expected,
            "{layer:?}, attempt {attempt}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn handlers_see_the_attempt_number() {
    let server = ServiceBuilder::new()
        .layer(SignalsLayer::new())
        .service(service_fn(|req: Request<()>| async move {
            Ok::<_, Infallible>(Response::new(InboundAttempt::of(&req)))
        }));
    for (name, value, attempt) in [
        ("x-attempt-count", "3", 3),
        ("grpc-previous-rpc-attempts", "1", 2),
        ("x-attempt-count", "garbage", 1),
        ("x-other", "7", 1),
    ] {
        let req = Request::get("/")
            .header(name, value)
            .body(())
            .expect("request");
        let res = server.clone().oneshot(req).await.expect("response");
        assert_eq!(*res.body().get_ref(), attempt, "{name}: {value}");
    }
}

/// A body made of a stream of frames.
type StreamedBody = http_body_util::StreamBody<
    std::pin::Pin<
        Box<
            dyn futures_util::Stream<Item = Result<http_body::Frame<bytes::Bytes>, BoxError>>
                + Send,
        >,
    >,
>;

/// A gRPC server stream's body: one message, then trailers with `grpc-status: code`.
/// With `outbound`, the message is produced by an outbound call made while the body is
/// polled (as a stream that calls a dependency for each item does).
fn stream_body(code: &'static str, outbound: Option<Svc>) -> StreamedBody {
    use futures_util::StreamExt;
    let message = futures_util::stream::once(async move {
        if let Some(client) = outbound {
            // Its failure is the stream's: it ends with the status below.
            let _ = client.oneshot(request()).await;
        }
        Ok(http_body::Frame::data(bytes::Bytes::from_static(
            b"\0\0\0\0\0",
        )))
    });
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static(code));
    let end = futures_util::stream::once(async move { Ok(http_body::Frame::trailers(trailers)) });
    http_body_util::StreamBody::new(message.chain(end).boxed())
}

/// The trailers a server stream through the signals layer ends with: its handler (or,
/// with `in_stream`, its stream) calls a dependency answering `bottom_status` through
/// a retry layer, and the stream ends with `code`.
async fn trailers_of(bottom_status: u16, code: &'static str, in_stream: bool) -> http::HeaderMap {
    use http_body_util::BodyExt;
    let seen = Arc::new(AtomicU32::new(0));
    let client: Svc = BoxCloneService::new(
        ServiceBuilder::new()
            .layer(RetryLayer::new(policy(plenty())))
            .service(bottom(bottom_status, false, seen)),
    );
    let server = ServiceBuilder::new()
        .layer(SignalsLayer::new())
        .service(service_fn(move |_req: Request<String>| {
            let client = client.clone();
            async move {
                let outbound = if in_stream {
                    Some(client)
                } else {
                    let _ = client.oneshot(request()).await;
                    None
                };
                let response = Response::builder()
                    .header("content-type", "application/grpc")
                    .body(stream_body(code, outbound))
                    .expect("response");
                Ok::<_, BoxError>(response)
            }
        }));
    let res = server.oneshot(request()).await.expect("response");
    assert!(
        res.headers().get("grpc-retry-pushback-ms").is_none(),
        "the head is gone"
    );
    let collected = res.into_body().collect().await.expect("body");
    collected.trailers().cloned().expect("trailers")
}

#[tokio::test(start_paused = true)]
async fn a_stream_failing_after_a_give_up_is_marked_in_its_trailers() {
    let trailers = trailers_of(503, "14", false).await;
    assert_eq!(trailers["grpc-retry-pushback-ms"], "-1");
}

#[tokio::test(start_paused = true)]
async fn a_give_up_while_the_stream_is_produced_marks_its_trailers() {
    let trailers = trailers_of(503, "14", true).await;
    assert_eq!(trailers["grpc-retry-pushback-ms"], "-1");
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_succeeds_or_fails_without_a_give_up_is_not_marked() {
    // The outbound call gave up, but the stream ended well.
    assert!(trailers_of(503, "0", false)
        .await
        .get("grpc-retry-pushback-ms")
        .is_none());
    // The stream failed, but no outbound call gave up.
    assert!(trailers_of(200, "14", true)
        .await
        .get("grpc-retry-pushback-ms")
        .is_none());
}
