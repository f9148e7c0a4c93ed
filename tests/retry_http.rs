//! RetryLayer against real hyper servers on 127.0.0.1, over HTTP/1.1 and HTTP/2.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard::{Attempts, ReplayBody, RetryLayer};
use tower::{BoxError, ServiceBuilder, ServiceExt};

#[path = "support/budget.rs"]
mod budget;
#[path = "support/policy.rs"]
mod policy;
#[path = "support/server.rs"]
mod server;

use policy::fast_policy;

type Handler = Arc<
    dyn Fn(usize, Bytes) -> Pin<Box<dyn Future<Output = Response<Full<Bytes>>> + Send>>
        + Send
        + Sync,
>;

/// A server on 127.0.0.1:0 that hands each request (its 0-based number and whole body)
/// to `handler`, and counts the requests it saw.
async fn serve(handler: Handler) -> (SocketAddr, Arc<AtomicUsize>) {
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    let addr = server::serve(move || {
        let (handler, counter) = (handler.clone(), counter.clone());
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let handler = handler.clone();
            let n = counter.fetch_add(1, Ordering::SeqCst);
            async move {
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                Ok::<_, Infallible>(handler(n, body).await)
            }
        })
    })
    .await;
    (addr, seen)
}

fn reply(status: u16, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .body(Full::new(body.into()))
        .expect("response")
}

/// Fails the first `failures` requests with 503, then answers 200 with what it received.
fn failing_first(failures: usize) -> Handler {
    Arc::new(move |n, body| {
        Box::pin(async move {
            if n < failures {
                reply(503, "busy")
            } else {
                reply(200, body)
            }
        })
    })
}

fn client<B>(http2: bool) -> Client<HttpConnector, B>
where
    B: Body + Send + 'static,
    B::Data: Send,
{
    Client::builder(TokioExecutor::new())
        .http2_only(http2)
        .build_http()
}

async fn body_text(res: Response<Incoming>) -> String {
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[tokio::test]
async fn retries_through_hyper_util_over_http1_and_http2() {
    for http2 in [false, true] {
        let (addr, seen) = serve(failing_first(2)).await;
        let policy = fast_policy(1).build().expect("policy");
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new(policy.clone()))
            .service(client::<Full<Bytes>>(http2));
        let req = Request::put(format!("http://{addr}/item"))
            .body(Full::new(Bytes::from_static(b"payload")))
            .expect("request");
        let res = tokio::time::timeout(Duration::from_secs(5), svc.oneshot(req))
            .await
            .expect("in time")
            .expect("response");
        assert_eq!(res.status(), StatusCode::OK, "http2 = {http2}");
        assert_eq!(Attempts::of(&res), 3);
        assert_eq!(body_text(res).await, "payload");
        assert_eq!(seen.load(Ordering::SeqCst), 3);
        assert_eq!(policy.stats().retries, 2);
    }
}

/// A streaming, non-`Clone` body that yields its chunks one frame at a time.
struct Chunks(VecDeque<Bytes>);

impl Chunks {
    fn new(chunks: usize, size: usize) -> Self {
        Chunks(
            (0..chunks)
                .map(|i| Bytes::from(vec![b'a' + (i % 26) as u8; size]))
                .collect(),
        )
    }

    fn concat(chunks: usize, size: usize) -> Bytes {
        Chunks::new(chunks, size).0.into_iter().flatten().collect()
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

#[tokio::test]
async fn a_streaming_body_is_replayed_whole() {
    for http2 in [false, true] {
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let log = bodies.clone();
        let handler: Handler = Arc::new(move |n, body| {
            log.lock().expect("lock").push(body.clone());
            Box::pin(async move {
                if n == 0 {
                    reply(503, "")
                } else {
                    reply(200, "")
                }
            })
        });
        let (addr, seen) = serve(handler).await;
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new(fast_policy(1).build().expect("policy")).replay_bodies())
            .service(client::<ReplayBody<Chunks>>(http2));
        let req = Request::put(format!("http://{addr}/upload"))
            .body(Chunks::new(8, 1000))
            .expect("request");
        let res = svc.oneshot(req).await.expect("response");
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(seen.load(Ordering::SeqCst), 2);
        let expected = Chunks::concat(8, 1000);
        assert_eq!(
            *bodies.lock().expect("lock"),
            vec![expected.clone(), expected]
        );
    }
}

/// A streaming body of known length (an exact size hint, so hyper sends
/// `content-length`) that never says it has ended, like a file read in chunks.
struct KnownLength(VecDeque<Bytes>, u64);

impl Body for KnownLength {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let chunk = self.0.pop_front();
        self.1 -= chunk.as_ref().map_or(0, |c| c.len() as u64);
        Poll::Ready(chunk.map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.1)
    }
}

/// Over HTTP/1.1 hyper stops polling a `content-length` body after its last byte, and
/// over HTTP/2 it polls on to the end: either way the body is replayed whole.
#[tokio::test]
async fn a_known_length_body_is_replayed_whole_over_both_protocols() {
    for http2 in [false, true] {
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let log = bodies.clone();
        let handler: Handler = Arc::new(move |n, body| {
            log.lock().expect("lock").push(body);
            Box::pin(async move { reply(if n == 0 { 503 } else { 200 }, "") })
        });
        let (addr, seen) = serve(handler).await;
        let policy = fast_policy(1).build().expect("policy");
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new(policy.clone()).replay_bodies())
            .service(client::<ReplayBody<KnownLength>>(http2));
        let chunks = Chunks::new(4, 1000).0;
        let req = Request::put(format!("http://{addr}/upload"))
            .body(KnownLength(chunks, 4000))
            .expect("request");
        let res = svc.oneshot(req).await.expect("response");
        assert_eq!(res.status(), StatusCode::OK, "http2 = {http2}");
        assert_eq!(seen.load(Ordering::SeqCst), 2);
        let expected = Chunks::concat(4, 1000);
        assert_eq!(
            *bodies.lock().expect("lock"),
            vec![expected.clone(), expected]
        );
        assert_eq!(policy.stats().not_replayable, 0);
    }
}

#[tokio::test]
async fn a_body_over_the_cap_is_sent_once_and_intact() {
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let log = bodies.clone();
    let handler: Handler = Arc::new(move |_, body| {
        log.lock().expect("lock").push(body);
        Box::pin(async { reply(503, "") })
    });
    let (addr, seen) = serve(handler).await;
    let policy = fast_policy(1)
        .max_replay_bytes(4096)
        .build()
        .expect("policy");
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()).replay_bodies())
        .service(client::<ReplayBody<Chunks>>(false));
    let req = Request::put(format!("http://{addr}/upload"))
        .body(Chunks::new(10, 1000))
        .expect("request");
    let res = svc.oneshot(req).await.expect("response");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    assert_eq!(
        *bodies.lock().expect("lock"),
        vec![Chunks::concat(10, 1000)]
    );
    assert_eq!(policy.stats().not_replayable, 1);
}

// hyper-util's client error is read only with the feature (see README, "Cargo features").
#[cfg(feature = "hyper-util")]
#[tokio::test]
async fn a_post_to_a_refused_port_is_retried_until_the_server_is_up() {
    // Find a free port, leave it closed, and open it only after the first attempt failed.
    let port = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let policy = fast_policy(1)
        .backoff(
            stormguard::Backoff::new(
                Duration::from_millis(300),
                Duration::from_secs(1),
                stormguard::Jitter::None,
            )
            .expect("backoff"),
        )
        .build()
        .expect("policy");
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .service(client::<Full<Bytes>>(false));
    let req = Request::post(format!("http://127.0.0.1:{port}/orders"))
        .body(Full::new(Bytes::from_static(b"order")))
        .expect("request");
    let call = tokio::spawn(svc.oneshot(req));
    // Open the port only once the first attempt has been refused and a retry scheduled
    // (bounded: 5 s of 10 ms polls).
    for _ in 0..500 {
        if policy.stats().retries > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        policy.stats().retries,
        1,
        "the refused attempt was not retried"
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("rebind the port");
    let (stream, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
        .await
        .expect("retry in time")
        .expect("accept");
    tokio::spawn(async move {
        let service = hyper::service::service_fn(|_req: Request<Incoming>| async {
            Ok::<_, Infallible>(reply(201, "created"))
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
            .await;
    });
    let res = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("in time")
        .expect("task")
        .expect("response");
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(Attempts::of(&res), 2);
}

/// Stalls the first request far beyond any timeout, answers the rest at once.
fn stalling_first() -> Handler {
    Arc::new(|n, _| {
        Box::pin(async move {
            if n == 0 {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            reply(200, "ok")
        })
    })
}

#[tokio::test]
async fn a_per_attempt_timeout_inside_turns_a_stall_into_a_retry() {
    let (addr, seen) = serve(stalling_first()).await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast_policy(1).build().expect("policy")))
        .timeout(Duration::from_millis(200))
        .service(client::<Full<Bytes>>(false));
    // Within 5 s, far below the server's 30 s stall: the timeout cut it.
    let call = svc.oneshot(
        Request::get(format!("http://{addr}/"))
            .body(Full::default())
            .expect("request"),
    );
    let res = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("the stall was cut short")
        .expect("second attempt succeeds");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(Attempts::of(&res), 2);
    assert_eq!(seen.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_total_timeout_outside_bounds_the_whole_call() {
    let always_stall: Handler = Arc::new(|_, _| {
        Box::pin(async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            reply(200, "late")
        })
    });
    let (addr, seen) = serve(always_stall).await;
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_millis(700))
        .layer(RetryLayer::new(
            fast_policy(1).max_attempts(100).build().expect("policy"),
        ))
        .timeout(Duration::from_millis(200))
        .service(client::<Full<Bytes>>(false));
    let started = tokio::time::Instant::now();
    let err: BoxError = svc
        .oneshot(
            Request::get(format!("http://{addr}/"))
                .body(Full::default())
                .expect("request"),
        )
        .await
        .expect_err("the total timeout fires");
    let elapsed = started.elapsed();
    assert!(err.is::<tower::timeout::error::Elapsed>(), "{err}");
    assert!(
        elapsed >= Duration::from_millis(700) && elapsed < Duration::from_secs(3),
        "{elapsed:?}"
    );
    // 700 ms of 200 ms attempts with short backoffs: three or four attempts (fewer on a
    // loaded machine), never the hundred the policy would allow.
    let attempts = seen.load(Ordering::SeqCst);
    assert!((2..=4).contains(&attempts), "{attempts} attempts");
}
