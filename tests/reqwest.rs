//! The reqwest middleware against a hyper server on 127.0.0.1, on paused tokio time: the
//! tower layers' decisions through `reqwest_middleware`.

#![cfg(feature = "reqwest")]

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use stormguard::breaker::BreakerConfig;
use stormguard::reqwest::StormguardMiddleware;
use stormguard::{
    Attempts, CircuitBreaker, CircuitOpen, LoadControl, RetryBudget, RetryPolicy, Shed,
};
use tokio::sync::{mpsc, Semaphore};

#[path = "support/server.rs"]
mod server;

/// What the server answers its `n`-th request (from 0): a status, a `Retry-After` if
/// any, and how long it takes.
type Script = fn(u32) -> (u16, Option<&'static str>, Duration);

/// A server on 127.0.0.1:0 answering by `script`; the requests it took.
async fn serve(script: Script) -> (String, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let addr = server::serve(move || {
        let calls = calls.clone();
        hyper::service::service_fn(move |_req: http::Request<Incoming>| {
            let (status, retry_after, delay) = script(calls.fetch_add(1, Ordering::SeqCst));
            async move {
                tokio::time::sleep(delay).await;
                let mut res = http::Response::builder().status(status);
                if let Some(after) = retry_after {
                    res = res.header("retry-after", after);
                }
                Ok::<_, Infallible>(
                    res.body(Full::new(Bytes::from_static(b"ok")))
                        .expect("response"),
                )
            }
        })
    })
    .await;
    (format!("http://{addr}/items"), seen)
}

/// A client with `middleware`, reqwest's own retries off.
fn client(
    middleware: StormguardMiddleware,
    timeout: Option<Duration>,
) -> reqwest_middleware::ClientWithMiddleware {
    let mut builder = reqwest::Client::builder().retry(reqwest::retry::never());
    if let Some(timeout) = timeout {
        builder = builder.timeout(timeout);
    }
    reqwest_middleware::ClientBuilder::new(builder.build().expect("client"))
        .with(middleware)
        .build()
}

/// The default policy, seeded, with a budget that has room (the tests are about the
/// decisions, `an_exhausted_budget_is_shared_by_clones` about the budget).
fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .budget(
            RetryBudget::builder()
                .allowance(100)
                .build()
                .expect("budget"),
        )
        .seed(1)
        .build()
        .expect("policy")
}

const NOW: Duration = Duration::ZERO;

#[tokio::test(start_paused = true)]
async fn a_503_then_200_is_served_on_the_second_attempt() {
    let (url, calls) = serve(|n| (if n == 0 { 503 } else { 200 }, None, NOW)).await;
    let middleware = StormguardMiddleware::new(policy());
    let response = client(middleware.clone(), None)
        .get(&url)
        .send()
        .await
        .expect("served");
    assert_eq!(response.status(), 200);
    assert_eq!(response.extensions().get::<Attempts>(), Some(&Attempts(2)));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(middleware.policy().stats().retries, 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_waited_out() {
    // A 503's (a 429's is spread over up to one more: tests/throttling.rs).
    let (url, calls) = serve(|n| {
        if n == 0 {
            (503, Some("2"), NOW)
        } else {
            (200, None, NOW)
        }
    })
    .await;
    let start = tokio::time::Instant::now();
    let response = client(StormguardMiddleware::new(policy()), None)
        .get(&url)
        .send()
        .await
        .expect("served");
    assert_eq!(response.status(), 200);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_millis(2300),
        "{waited:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn a_post_is_not_repeated() {
    let (url, calls) = serve(|_| (503, None, NOW)).await;
    let middleware = StormguardMiddleware::new(policy());
    let response = client(middleware.clone(), None)
        .post(&url)
        .body("order 7")
        .send()
        .await
        .expect("a response");
    assert_eq!(response.status(), 503);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(middleware.policy().stats().not_idempotent, 1);
    // With an `Idempotent` extension (or an Idempotency-Key) it is.
    let response = client(middleware.clone(), None)
        .post(&url)
        .body("order 7")
        .with_extension(stormguard::Idempotent)
        .send()
        .await
        .expect("a response");
    assert_eq!(response.extensions().get::<Attempts>(), Some(&Attempts(3)));
}

#[tokio::test(start_paused = true)]
async fn a_streaming_body_is_sent_once() {
    let (url, calls) = serve(|_| (503, None, NOW)).await;
    let middleware = StormguardMiddleware::new(policy());
    let chunks: Vec<Result<Bytes, Infallible>> = vec![
        Ok(Bytes::from_static(b"part 1")),
        Ok(Bytes::from_static(b"part 2")),
    ];
    let body = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    let response = client(middleware.clone(), None)
        .put(&url)
        .body(body)
        .send()
        .await
        .expect("the server's answer, not an error of the middleware's");
    assert_eq!(response.status(), 503);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(middleware.policy().stats().not_replayable, 1);
}

#[tokio::test(start_paused = true)]
async fn a_reqwest_timeout_is_retried() {
    // The first answer takes 5 s, past the client's 1 s timeout; the second is at once.
    let (url, calls) =
        serve(|n| (200, None, if n == 0 { Duration::from_secs(5) } else { NOW })).await;
    let middleware = StormguardMiddleware::new(policy());
    let response = client(middleware.clone(), Some(Duration::from_secs(1)))
        .get(&url)
        .send()
        .await
        .expect("served by the retry");
    assert_eq!(response.status(), 200);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(middleware.policy().stats().retries, 1);
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_budget_is_shared_by_clones() {
    let (url, _) = serve(|_| (503, None, NOW)).await;
    // The default budget: a new client's allowance pays for one request's retries.
    let middleware =
        StormguardMiddleware::new(RetryPolicy::builder().seed(2).build().expect("policy"));
    let first = client(middleware.clone(), None);
    let second = client(middleware.clone(), None);
    let response = first.get(&url).send().await.expect("a response");
    assert_eq!(response.extensions().get::<Attempts>(), Some(&Attempts(3)));
    // The second client's clone finds the budget spent by the first.
    let response = second.get(&url).send().await.expect("a response");
    assert_eq!(response.status(), 503);
    assert_eq!(response.extensions().get::<Attempts>(), None);
    let stats = middleware.policy().stats();
    assert_eq!(
        (stats.requests, stats.retries, stats.budget_denied),
        (2, 2, 1),
        "{stats:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_breaker_opens_and_fails_fast() {
    let (url, calls) = serve(|_| (500, None, NOW)).await;
    let breaker = CircuitBreaker::builder()
        .config(
            BreakerConfig::builder()
                .consecutive_failures(3)
                .break_duration(Duration::from_secs(60))
                .max_break_duration(Duration::from_secs(60)),
        )
        .build()
        .expect("breaker");
    let middleware = StormguardMiddleware::new(policy()).with_breaker(breaker.clone());
    let client = client(middleware, None);
    for _ in 0..3 {
        // POSTs, so that each call is one attempt.
        let response = client
            .post(&url)
            .body("x")
            .send()
            .await
            .expect("a response");
        assert_eq!(response.status(), 500);
    }
    assert_eq!(breaker.state(), stormguard::breaker::CircuitState::Open);
    let err = client
        .post(&url)
        .body("x")
        .send()
        .await
        .expect_err("refused");
    assert_holds::<CircuitOpen>(&err, "not the breaker's refusal");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// Asserts that `err` is the middleware's own error holding an `E` (`what`: the
/// message if it is not).
fn assert_holds<E: std::fmt::Display + std::fmt::Debug + Send + Sync + 'static>(
    err: &reqwest_middleware::Error,
    what: &str,
) {
    match err {
        reqwest_middleware::Error::Middleware(err) => {
            assert!(err.downcast_ref::<E>().is_some(), "{what}: {err:?}")
        }
        other => panic!("{what}: {other:?}"),
    }
}

/// A server on 127.0.0.1:0 that holds every request until the test adds a permit to
/// `gate`; a message on the receiver as each request arrives.
async fn gated(gate: Arc<Semaphore>) -> (String, mpsc::UnboundedReceiver<()>) {
    let (arrived, arrivals) = mpsc::unbounded_channel();
    let addr = server::serve(move || {
        let (arrived, gate) = (arrived.clone(), gate.clone());
        hyper::service::service_fn(move |_req: http::Request<Incoming>| {
            let _ = arrived.send(());
            let gate = gate.clone();
            async move {
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
                Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        })
    })
    .await;
    (format!("http://{addr}/items"), arrivals)
}

/// Lets the other tasks run (no clock: at most 1,000 turns) until `done` holds.
async fn until(done: impl Fn() -> bool) {
    for _ in 0..1000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("not reached within 1,000 turns");
}

/// A load control with room for one call in flight, waiting up to `max_wait` for room.
fn one_place(max_wait: Duration) -> LoadControl {
    LoadControl::builder()
        .name("items")
        .initial(1)
        .min(1)
        .max(1)
        .max_wait(max_wait)
        .build()
        .expect("load control")
}

// Real time, and no clock read by the tests: the calls wait for each other and for the
// server's arrivals (the one timer, a wait of 30 s for room, is never reached).
#[tokio::test]
async fn a_call_past_the_load_limit_is_shed_unsent_and_not_retried() {
    let gate = Arc::new(Semaphore::new(0));
    let (url, mut arrivals) = gated(gate.clone()).await;
    let load = one_place(Duration::ZERO);
    let client = client(
        StormguardMiddleware::new(policy()).with_load_control(load.clone()),
        None,
    );
    let first = tokio::spawn(client.get(&url).send());
    arrivals.recv().await.expect("the first call arrives");
    // The one place is taken: a GET, which the policy would retry, fails at once.
    let err = client.get(&url).send().await.expect_err("shed");
    assert_holds::<Shed>(&err, "not the load control's refusal");
    assert!(arrivals.try_recv().is_err(), "the shed call was sent");
    gate.add_permits(2);
    let response = first.await.expect("task").expect("a response");
    assert_eq!(response.status(), 200);
    // Room again: the next call goes.
    let response = client.get(&url).send().await.expect("a response");
    assert_eq!(response.status(), 200);
    arrivals.recv().await.expect("the next call arrives");
    assert!(arrivals.try_recv().is_err(), "a call arrived twice");
    let stats = load.stats();
    assert_eq!((stats.shed, stats.in_flight), (1, 0));
}

#[tokio::test]
async fn a_call_past_the_load_limit_waits_for_room() {
    let gate = Arc::new(Semaphore::new(0));
    let (url, mut arrivals) = gated(gate.clone()).await;
    let load = one_place(Duration::from_secs(30));
    let client = client(
        StormguardMiddleware::new(policy()).with_load_control(load.clone()),
        None,
    );
    let first = tokio::spawn(client.post(&url).body("1").send());
    arrivals.recv().await.expect("the first call arrives");
    let second = tokio::spawn(client.post(&url).body("2").send());
    until(|| load.stats().waited == 1).await;
    assert!(arrivals.try_recv().is_err(), "sent past the limit");
    // The first answered, its place goes to the waiting call.
    gate.add_permits(2);
    for call in [first, second] {
        let response = call.await.expect("task").expect("a response");
        assert_eq!(response.status(), 200);
    }
    arrivals.recv().await.expect("the second call arrives");
    assert!(arrivals.try_recv().is_err(), "a call arrived twice");
    let stats = load.stats();
    assert_eq!((stats.shed, stats.in_flight), (0, 0));
}

// Paused time: the one call in flight is held by the server, so the runtime idles and
// the clock moves to the waiting call's deadline.
#[tokio::test(start_paused = true)]
async fn a_call_waits_for_room_no_longer_than_its_own_timeout() {
    let gate = Arc::new(Semaphore::new(0));
    let (url, mut arrivals) = gated(gate.clone()).await;
    let load = one_place(Duration::from_secs(30));
    let client = client(
        StormguardMiddleware::new(policy()).with_load_control(load.clone()),
        None,
    );
    let first = tokio::spawn(client.get(&url).send());
    arrivals.recv().await.expect("the first call arrives");
    let started = tokio::time::Instant::now();
    let err = client
        .get(&url)
        .timeout(Duration::from_millis(200))
        .send()
        .await
        .expect_err("shed");
    assert_holds::<Shed>(&err, "not the load control's refusal");
    // Shed at its timeout, not at the control's `max_wait` of 30 s, and never sent.
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(1),
        "{waited:?}"
    );
    assert!(arrivals.try_recv().is_err(), "the shed call was sent");
    gate.add_permits(1);
    let response = first.await.expect("task").expect("a response");
    assert_eq!(response.status(), 200);
    let stats = load.stats();
    assert_eq!((stats.shed, stats.in_flight), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_limiter_that_keeps_throttling_gets_its_429s_back_through_the_gate() {
    // Every call answered 429 with `Retry-After: 1`: the retries go through the gate of
    // throttled retries, which closes at the first one throttled again; the retries it
    // has no slot for are not sent, and their requests get the 429 back.
    let (url, calls) = serve(|_| (429, Some("1"), NOW)).await;
    let middleware = StormguardMiddleware::new(policy());
    let client = client(middleware.clone(), None);
    let sends: Vec<_> = (0..40)
        .map(|_| {
            let request = client.get(&url);
            tokio::spawn(async move { request.send().await })
        })
        .collect();
    let mut all_three = 0;
    for send in sends {
        let response = send.await.expect("joined").expect("answered");
        assert_eq!(response.status(), 429);
        // The attempts it made (the extension is there from two).
        if response.extensions().get::<Attempts>() == Some(&Attempts(3)) {
            all_three += 1;
        }
    }
    let stats = middleware.policy().stats();
    println!("{all_three} with three attempts, {stats:?}");
    assert_eq!(all_three, stats.exhausted, "{stats:?}");
    assert!(stats.throttled > 0, "{stats:?}");
    assert_eq!(stats.throttled + stats.exhausted, 40, "{stats:?}");
    // Without the gate every request would have made its three attempts.
    let calls = calls.load(Ordering::SeqCst);
    assert!(calls < 2 * 40, "{calls} calls, {stats:?}");
    assert_eq!(u64::from(calls), 40 + stats.retries, "{stats:?}");
}
