//! RetryLayer behaviour on a mock service, with paused time.

use std::io;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use stormguard::{
    Attempts, Backoff, CircuitOpen, Idempotent, Jitter, NoRetry, RetryBudget, RetryLayer,
    RetryPolicy, Unprocessed,
};
use tokio::task::JoinHandle;
use tokio::time::{advance, Instant};
use tower::{BoxError, Layer, ServiceBuilder, ServiceExt};
use tower_test::mock::{self, Handle};

#[path = "support/budget.rs"]
mod budget;

use budget::roomy;

type Mock = Handle<Request<String>, Response<String>>;
type Outcome = Result<Response<String>, BoxError>;

const MS: Duration = Duration::from_millis(1);

/// 200 ms, 400 ms, 800 ms ... exactly, so tests can check the waits to the millisecond.
fn fixed_backoff() -> Backoff {
    Backoff::new(200 * MS, 20_000 * MS, Jitter::None).expect("valid backoff")
}

fn policy() -> stormguard::retry::RetryPolicyBuilder {
    RetryPolicy::builder()
        .backoff(fixed_backoff())
        .budget(roomy())
        .seed(7)
}

fn start(policy: RetryPolicy, req: Request<String>) -> (JoinHandle<Outcome>, Mock) {
    let (service, handle) = mock::pair::<Request<String>, Response<String>>();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(service);
    (tokio::spawn(client.oneshot(req)), handle)
}

fn get() -> Request<String> {
    Request::get("http://upstream/")
        .body(String::new())
        .expect("request")
}

fn post() -> Request<String> {
    Request::post("http://upstream/orders")
        .body("{}".into())
        .expect("request")
}

fn status(code: u16) -> Response<String> {
    Response::builder()
        .status(code)
        .body(String::new())
        .expect("response")
}

fn with_header(code: u16, name: &'static str, value: &'static str) -> Response<String> {
    Response::builder()
        .status(code)
        .header(name, value)
        .body(String::new())
        .expect("response")
}

/// The outcome of a call. A call still waiting an hour of paused time later (say, for
/// an answer to an attempt it should not have made) fails the test instead of hanging it.
async fn finished(call: JoinHandle<Outcome>) -> Outcome {
    tokio::time::timeout(Duration::from_secs(3600), call)
        .await
        .expect("the call did not finish")
        .expect("task")
}

/// The status of a call that must end with a response.
async fn status_of(call: JoinHandle<Outcome>) -> StatusCode {
    finished(call).await.expect("response").status()
}

/// Lets spawned tasks run without moving the paused clock.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

/// Answers the next request, which must arrive without the clock moving.
async fn answer_now(handle: &mut Mock, response: Response<String>) -> Request<String> {
    settle().await;
    let Some((req, send)) = take(handle) else {
        panic!("no request arrived");
    };
    send.send_response(response);
    // Let the retry layer see the response (and start its wait) at this instant.
    settle().await;
    req
}

fn take(
    handle: &mut Mock,
) -> Option<(
    Request<String>,
    tower_test::mock::SendResponse<Response<String>>,
)> {
    match handle.poll_request() {
        std::task::Poll::Ready(Some(pair)) => Some(pair),
        _ => None,
    }
}

async fn assert_nothing_sent(handle: &mut Mock) {
    settle().await;
    assert!(take(handle).is_none(), "a request was sent too early");
}

/// Moves the clock by `by` and answers the request that must then be waiting.
async fn answer_after(
    handle: &mut Mock,
    by: Duration,
    response: Response<String>,
) -> Request<String> {
    advance(by).await;
    answer_now(handle, response).await
}

#[tokio::test(start_paused = true)]
async fn a_503_is_tried_three_times_then_returned() {
    let policy = policy().build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), get());

    answer_now(&mut upstream, status(503)).await;
    // The first retry waits exactly 200 ms: nothing is sent a millisecond before.
    advance(199 * MS).await;
    assert_nothing_sent(&mut upstream).await;
    answer_after(&mut upstream, MS, status(503)).await;
    advance(399 * MS).await;
    assert_nothing_sent(&mut upstream).await;
    answer_after(&mut upstream, MS, status(503)).await;

    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(Attempts::of(&response), 3);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    let stats = policy.stats();
    assert_eq!((stats.requests, stats.retries, stats.exhausted), (1, 2, 1));
}

#[tokio::test(start_paused = true)]
async fn a_400_is_sent_once() {
    let policy = policy().build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), get());
    answer_now(&mut upstream, status(400)).await;
    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(Attempts::of(&response), 1);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().permanent, 1);
}

#[tokio::test(start_paused = true)]
async fn success_after_a_retry_reports_two_attempts() {
    let (call, mut upstream) = start(policy().build().expect("policy"), get());
    answer_now(&mut upstream, status(502)).await;
    answer_after(&mut upstream, 200 * MS, status(200)).await;
    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.extensions().get::<Attempts>(), Some(&Attempts(2)));
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_waited_for_at_least() {
    let (call, mut upstream) = start(policy().build().expect("policy"), get());
    // A 503's hint (a 429's is spread over up to one more: tests/throttling.rs).
    answer_now(&mut upstream, with_header(503, "retry-after", "2")).await;
    let sent = Instant::now();
    advance(1999 * MS).await;
    assert_nothing_sent(&mut upstream).await;
    // At most 10% upward jitter on the hint.
    let mut waited = 1999 * MS;
    while take_and_answer(&mut upstream).is_none() {
        assert!(waited <= 2200 * MS, "retry not sent within 2.2 s");
        advance(MS).await;
        waited += MS;
        settle().await;
    }
    assert!(Instant::now() - sent >= 2000 * MS);
    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::OK);
}

fn take_and_answer(upstream: &mut Mock) -> Option<()> {
    let (_, send) = take(upstream)?;
    send.send_response(status(200));
    Some(())
}

#[tokio::test(start_paused = true)]
async fn retry_after_beyond_the_maximum_returns_the_response() {
    let policy = policy()
        .max_retry_after(Duration::from_secs(60))
        .build()
        .expect("policy");
    let (call, mut upstream) = start(policy.clone(), get());
    answer_now(&mut upstream, with_header(429, "retry-after", "3600")).await;
    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "3600");
    advance(Duration::from_secs(3600)).await;
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().server_refused, 1);
}

#[tokio::test(start_paused = true)]
async fn post_without_a_key_is_not_retried_on_503() {
    let policy = policy().build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), post());
    answer_now(&mut upstream, status(503)).await;
    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().not_idempotent, 1);
}

#[tokio::test(start_paused = true)]
async fn post_with_an_idempotency_key_is_retried() {
    let mut req = post();
    req.headers_mut()
        .insert("idempotency-key", "order-42".parse().expect("header"));
    let (call, mut upstream) = start(policy().build().expect("policy"), req);
    answer_now(&mut upstream, status(503)).await;
    let retried = answer_after(&mut upstream, 200 * MS, status(201)).await;
    assert_eq!(retried.method(), Method::POST);
    assert_eq!(retried.headers()["idempotency-key"], "order-42");
    assert_eq!(retried.body(), "{}");
    assert_eq!(status_of(call).await, StatusCode::CREATED);
}

#[tokio::test(start_paused = true)]
async fn post_declared_idempotent_is_retried() {
    let mut req = post();
    req.extensions_mut().insert(Idempotent);
    let (call, mut upstream) = start(policy().build().expect("policy"), req);
    answer_now(&mut upstream, status(500)).await;
    answer_after(&mut upstream, 200 * MS, status(200)).await;
    assert_eq!(status_of(call).await, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn no_retry_extension_sends_once() {
    let mut req = get();
    req.extensions_mut().insert(NoRetry);
    let (call, mut upstream) = start(policy().build().expect("policy"), req);
    answer_now(&mut upstream, status(503)).await;
    assert_eq!(status_of(call).await, StatusCode::SERVICE_UNAVAILABLE);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
}

#[tokio::test(start_paused = true)]
async fn post_is_retried_when_the_connection_was_refused() {
    let (call, mut upstream) = start(policy().build().expect("policy"), post());
    settle().await;
    let (_, send) = take(&mut upstream).expect("first attempt");
    send.send_error(io::Error::from(io::ErrorKind::ConnectionRefused));
    settle().await;
    answer_after(&mut upstream, 200 * MS, status(201)).await;
    assert_eq!(status_of(call).await, StatusCode::CREATED);
}

#[tokio::test(start_paused = true)]
async fn post_is_not_retried_after_a_reset() {
    let (call, mut upstream) = start(policy().build().expect("policy"), post());
    settle().await;
    let (_, send) = take(&mut upstream).expect("first attempt");
    send.send_error(io::Error::from(io::ErrorKind::ConnectionReset));
    let err = finished(call).await.expect_err("the reset comes back");
    assert!(err.to_string().contains("reset"), "{err}");
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
}

#[tokio::test(start_paused = true)]
async fn unknown_errors_are_not_retried_but_timeouts_are() {
    let (call, mut upstream) = start(policy().build().expect("policy"), get());
    settle().await;
    let (_, send) = take(&mut upstream).expect("first attempt");
    send.send_error("something odd");
    assert!(finished(call).await.is_err());
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;

    let (call, mut upstream) = start(policy().build().expect("policy"), get());
    settle().await;
    let (_, send) = take(&mut upstream).expect("first attempt");
    send.send_error(tower::timeout::error::Elapsed::new());
    settle().await;
    answer_after(&mut upstream, 200 * MS, status(200)).await;
    assert_eq!(status_of(call).await, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn an_open_circuit_is_never_retried() {
    let policy = policy().build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), get());
    settle().await;
    let (_, send) = take(&mut upstream).expect("first attempt");
    send.send_error(CircuitOpen::new(Duration::from_secs(5)));
    let err = finished(call).await.expect_err("fails fast");
    assert!(err.downcast_ref::<CircuitOpen>().is_some());
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().retries, 0);
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_budget_means_one_attempt_per_request() {
    let policy = policy().budget(empty_budget()).build().expect("policy");
    for _ in 0..5 {
        let (call, mut upstream) = start(policy.clone(), get());
        answer_now(&mut upstream, status(503)).await;
        assert_eq!(status_of(call).await, StatusCode::SERVICE_UNAVAILABLE);
        advance(Duration::from_secs(60)).await;
        assert_nothing_sent(&mut upstream).await;
    }
    let stats = policy.stats();
    assert_eq!(
        (stats.requests, stats.retries, stats.budget_denied),
        (5, 0, 5)
    );
}

#[tokio::test(start_paused = true)]
async fn a_burst_is_retried_whole_and_its_waste_paid_for_by_the_requests_after_it() {
    // 10% of the requests, and no allowance.
    let budget = RetryBudget::builder()
        .ratio(0.1)
        .allowance(0)
        .build()
        .expect("budget");
    let policy = RetryPolicy::builder()
        .backoff(fixed_backoff())
        .max_attempts(2)
        .budget(budget)
        .build()
        .expect("policy");
    let (service, mut upstream) = mock::pair::<Request<String>, Response<String>>();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .service(service);
    let wave = |n: usize| {
        let calls: Vec<_> = (0..n)
            .map(|_| tokio::spawn(client.clone().oneshot(get())))
            .collect();
        calls
    };
    let mut answer_all = async |calls: Vec<tokio::task::JoinHandle<_>>| {
        let mut attempts = 0;
        for _ in 0..50 {
            settle().await;
            while let Some((_, send)) = take(&mut upstream) {
                attempts += 1;
                send.send_response(status(503));
            }
            advance(50 * MS).await;
        }
        for call in calls {
            assert_eq!(status_of(call).await, StatusCode::SERVICE_UNAVAILABLE);
        }
        attempts
    };
    // 100 requests fail at one instant: none has ended unserved yet, so every one is
    // retried (a blip would have been ridden out whole).
    let calls = wave(100);
    assert_eq!(answer_all(calls).await, 200);
    assert_eq!(policy.stats().budget_denied, 0);
    // Those 100 retries were wasted, against 10 the requests earned: the next 100
    // requests, in the same window, are not retried.
    let calls = wave(100);
    assert_eq!(answer_all(calls).await, 100);
    assert_eq!(policy.stats().budget_denied, 100);
}

fn grpc_call() -> Request<String> {
    Request::post("http://upstream/pkg.Service/Method")
        .header("content-type", "application/grpc")
        .body(String::from("frame"))
        .expect("request")
}

/// A gRPC call whose caller gives it `timeout` (a `grpc-timeout` value).
fn grpc_call_within(timeout: &'static str) -> Request<String> {
    let mut req = grpc_call();
    req.headers_mut()
        .insert("grpc-timeout", http::HeaderValue::from_static(timeout));
    req
}

fn grpc_status(code: &'static str, pushback: Option<&'static str>) -> Response<String> {
    let mut res = with_header(200, "grpc-status", code);
    if let Some(ms) = pushback {
        res.headers_mut()
            .insert("grpc-retry-pushback-ms", ms.parse().expect("header"));
    }
    res
}

#[tokio::test(start_paused = true)]
async fn grpc_unavailable_is_retried_with_previous_attempts_and_capped_at_five() {
    let policy = policy().max_attempts(10).build().expect("policy");
    let (call, mut upstream) = start(policy, grpc_call());
    let first = answer_now(&mut upstream, grpc_status("14", None)).await;
    assert!(first.headers().get("grpc-previous-rpc-attempts").is_none());
    let mut wait = 200 * MS;
    for previous in 1..5 {
        let req = answer_after(&mut upstream, wait, grpc_status("14", None)).await;
        assert_eq!(
            req.headers()["grpc-previous-rpc-attempts"],
            previous.to_string().as_str()
        );
        wait *= 2;
    }
    let response = finished(call).await.expect("response");
    assert_eq!(Attempts::of(&response), 5);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
}

#[tokio::test(start_paused = true)]
async fn grpc_pushback_is_exact_and_negative_pushback_stops() {
    let (call, mut upstream) = start(policy().build().expect("policy"), grpc_call());
    answer_now(&mut upstream, grpc_status("14", Some("1000"))).await;
    advance(999 * MS).await;
    assert_nothing_sent(&mut upstream).await;
    answer_after(&mut upstream, MS, grpc_status("14", Some("-1"))).await;
    let response = finished(call).await.expect("response");
    assert_eq!(response.headers()["grpc-status"], "14");
    assert_eq!(Attempts::of(&response), 2);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
}

#[tokio::test(start_paused = true)]
async fn grpc_codes_other_than_unavailable_are_permanent() {
    let (call, mut upstream) = start(policy().build().expect("policy"), grpc_call());
    answer_now(&mut upstream, grpc_status("3", None)).await;
    let response = finished(call).await.expect("response");
    assert_eq!(Attempts::of(&response), 1);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
}

/// The waits between attempts of one seeded run, in milliseconds.
async fn seeded_waits(seed: u64) -> Vec<u128> {
    let policy = RetryPolicy::builder()
        .budget(roomy())
        .seed(seed)
        .max_attempts(4)
        .build()
        .expect("policy");
    let (call, mut upstream) = start(policy, get());
    let mut waits = Vec::new();
    answer_now(&mut upstream, status(503)).await;
    let mut last = Instant::now();
    // Bounded: the three waits are under 200 + 400 + 800 ms of 1 ms steps.
    for _ in 0..2000 {
        if waits.len() == 3 {
            break;
        }
        advance(MS).await;
        settle().await;
        if let Some((_, send)) = take(&mut upstream) {
            waits.push((Instant::now() - last).as_millis());
            last = Instant::now();
            send.send_response(status(503));
        }
    }
    assert_eq!(waits.len(), 3, "three retries within 2 s");
    finished(call).await.expect("response");
    waits
}

#[tokio::test(start_paused = true)]
async fn full_jitter_waits_are_seeded_and_under_the_ceiling() {
    let a = seeded_waits(11).await;
    assert_eq!(a, seeded_waits(11).await);
    assert_ne!(a, seeded_waits(12).await);
    for (wait, ceiling) in a.iter().zip([200, 400, 800]) {
        // Sleeps are rounded up to tokio's millisecond timer.
        assert!(*wait <= ceiling + 1, "{a:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_proxy_503_to_a_grpc_call_is_unavailable_and_retried() {
    let (call, mut upstream) = start(policy().build().expect("policy"), grpc_call());
    answer_now(&mut upstream, with_header(503, "retry-after", "30")).await;
    // Read as UNAVAILABLE (gRPC's HTTP mapping); HTTP's Retry-After is not gRPC's to honour.
    let retried = answer_after(&mut upstream, 200 * MS, grpc_status("0", None)).await;
    assert_eq!(retried.headers()["grpc-previous-rpc-attempts"], "1");
    let response = finished(call).await.expect("response");
    assert_eq!(Attempts::of(&response), 2);
}

/// A budget that grants nothing.
fn empty_budget() -> RetryBudget {
    RetryBudget::builder()
        .ratio(0.0)
        .allowance(0)
        .build()
        .expect("budget")
}

/// Fails the next request, which must arrive without the clock moving, with `err`.
async fn fail_now(handle: &mut Mock, err: impl Into<BoxError>) -> Request<String> {
    settle().await;
    let Some((req, send)) = take(handle) else {
        panic!("no request arrived");
    };
    send.send_error(err);
    settle().await;
    req
}

const REFUSED: Unprocessed = Unprocessed::new("refused stream");

#[tokio::test(start_paused = true)]
async fn a_refused_post_is_retried_at_once_without_an_attempt_or_budget() {
    // No budget at all, and a POST without a key: neither matters for a request the
    // server's application never saw.
    let policy = policy().budget(empty_budget()).build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), post());
    fail_now(&mut upstream, REFUSED).await;
    let again = answer_now(&mut upstream, status(201)).await;
    assert_eq!(again.method(), Method::POST);
    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        Attempts::of(&response),
        1,
        "a transparent retry is no attempt"
    );
    let stats = policy.stats();
    assert_eq!(
        (
            stats.transparent_retries,
            stats.retries,
            stats.budget_denied
        ),
        (1, 0, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_transparent_retry_leaves_every_attempt_to_the_policy() {
    let policy = policy().build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), get());
    fail_now(&mut upstream, REFUSED).await;
    // Three counted attempts follow, with the usual waits.
    answer_now(&mut upstream, status(503)).await;
    answer_after(&mut upstream, 200 * MS, status(503)).await;
    answer_after(&mut upstream, 400 * MS, status(503)).await;
    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(Attempts::of(&response), 3);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    let stats = policy.stats();
    assert_eq!((stats.transparent_retries, stats.retries), (1, 2));
}

#[tokio::test(start_paused = true)]
async fn a_second_refusal_goes_through_the_normal_policy() {
    let policy = policy().build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), post());
    fail_now(&mut upstream, REFUSED).await;
    fail_now(&mut upstream, REFUSED).await;
    // Now an ordinary retry (safe for a POST: unprocessed), after the backoff.
    advance(199 * MS).await;
    assert_nothing_sent(&mut upstream).await;
    answer_after(&mut upstream, MS, status(201)).await;
    assert_eq!(status_of(call).await, StatusCode::CREATED);
    let stats = policy.stats();
    assert_eq!((stats.transparent_retries, stats.retries), (1, 1));

    // With the budget spent, the second refusal comes back to the caller.
    let policy = policy_with_budget(empty_budget());
    let (call, mut upstream) = start(policy.clone(), post());
    fail_now(&mut upstream, REFUSED).await;
    fail_now(&mut upstream, REFUSED).await;
    let err = finished(call).await.expect_err("refused twice, no budget");
    assert!(err.downcast_ref::<Unprocessed>().is_some(), "{err}");
    assert_eq!(policy.stats().budget_denied, 1);
}

fn policy_with_budget(budget: RetryBudget) -> RetryPolicy {
    policy().budget(budget).build().expect("policy")
}

#[tokio::test(start_paused = true)]
async fn a_refused_connection_is_an_ordinary_counted_retry() {
    let policy = policy_with_budget(empty_budget());
    let (call, mut upstream) = start(policy.clone(), get());
    fail_now(
        &mut upstream,
        io::Error::from(io::ErrorKind::ConnectionRefused),
    )
    .await;
    let err = finished(call).await.expect_err("no budget for it");
    assert!(err.to_string().contains("refused"), "{err}");
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    let stats = policy.stats();
    assert_eq!((stats.transparent_retries, stats.budget_denied), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_grpc_transparent_retry_says_so_in_its_headers() {
    let (call, mut upstream) = start(policy().build().expect("policy"), grpc_call());
    fail_now(&mut upstream, REFUSED).await;
    let again = answer_now(&mut upstream, grpc_status("0", None)).await;
    assert_eq!(again.headers()["grpc-transparent-retry-attempts"], "1");
    assert!(again.headers().get("grpc-previous-rpc-attempts").is_none());
    finished(call).await.expect("response");
}

/// gRPC's most attempts, waits of exactly 100 ms, 200 ms, 400 ms...
fn five_attempts_from_100ms() -> RetryPolicy {
    policy()
        .max_attempts(5)
        .backoff(Backoff::new(100 * MS, 20_000 * MS, Jitter::None).expect("backoff"))
        .build()
        .expect("policy")
}

#[tokio::test(start_paused = true)]
async fn grpc_backoff_starts_over_after_a_pushback() {
    let policy = five_attempts_from_100ms();
    let (call, mut upstream) = start(policy, grpc_call());
    answer_now(&mut upstream, grpc_status("14", None)).await;
    answer_after(&mut upstream, 100 * MS, grpc_status("14", Some("300"))).await;
    answer_after(&mut upstream, 300 * MS, grpc_status("14", None)).await;
    // gRFC A6: "retry delay will reset to initial backoff": 100 ms, then 200 ms
    // (not 400 ms, then 800 ms).
    advance(99 * MS).await;
    assert_nothing_sent(&mut upstream).await;
    answer_after(&mut upstream, MS, grpc_status("14", None)).await;
    advance(199 * MS).await;
    assert_nothing_sent(&mut upstream).await;
    answer_after(&mut upstream, MS, grpc_status("0", None)).await;
    let response = finished(call).await.expect("response");
    assert_eq!(Attempts::of(&response), 5);
}

#[tokio::test(start_paused = true)]
async fn two_grpc_pushback_values_mean_do_not_retry() {
    let policy = policy().build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), grpc_call());
    let mut res = grpc_status("14", Some("10"));
    res.headers_mut()
        .append("grpc-retry-pushback-ms", "10".parse().expect("header"));
    answer_now(&mut upstream, res).await;
    let response = finished(call).await.expect("response");
    assert_eq!(response.headers()["grpc-status"], "14");
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().server_refused, 1);
}

fn with_deadline(mut req: Request<String>, after: Duration) -> Request<String> {
    let now = Instant::now().into_std();
    req.extensions_mut()
        .insert(stormguard::Deadline::after(now, after));
    req
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_returns_at_once_without_budget() {
    let policy = policy().build().expect("policy");
    let budget_before = policy.budget().clone();
    let req = with_deadline(get(), Duration::from_secs(1));
    let (call, mut upstream) = start(policy.clone(), req);
    answer_now(&mut upstream, with_header(503, "retry-after", "2")).await;
    let started = Instant::now();
    let response = finished(call).await.expect("response");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(Instant::now(), started, "returned at once");
    let stats = policy.stats();
    assert_eq!(
        (stats.deadline, stats.retries, stats.budget_denied),
        (1, 0, 0)
    );
    // Nothing was withdrawn: the floor's one retry a second is still there.
    assert!(budget_before.try_withdraw(Instant::now().into_std()));
}

#[tokio::test(start_paused = true)]
async fn a_backoff_that_fits_the_deadline_is_taken() {
    let policy = policy().build().expect("policy");
    let req = with_deadline(get(), Duration::from_millis(500));
    let (call, mut upstream) = start(policy.clone(), req);
    answer_now(&mut upstream, status(503)).await;
    // 200 ms fits in 500 ms; the next wait (400 ms, at 200 ms) would end at 600 ms.
    let again = answer_after(&mut upstream, 200 * MS, status(503)).await;
    assert_eq!(again.headers()["x-attempt-count"], "2");
    let response = finished(call).await.expect("response");
    assert_eq!(Attempts::of(&response), 2);
    assert_eq!(policy.stats().deadline, 1);
}

#[tokio::test(start_paused = true)]
async fn grpc_timeout_is_the_deadline_and_is_rewritten_on_each_retry() {
    let policy = five_attempts_from_100ms();
    let req = grpc_call_within("1S");
    let (call, mut upstream) = start(policy.clone(), req);
    let first = answer_now(&mut upstream, grpc_status("14", None)).await;
    assert_eq!(first.headers()["grpc-timeout"], "1S");
    // Retries at 100 ms and 300 ms: 900 ms and 700 ms remain.
    let second = answer_after(&mut upstream, 100 * MS, grpc_status("14", None)).await;
    assert_eq!(second.headers()["grpc-timeout"], "900000u");
    let third = answer_after(&mut upstream, 200 * MS, grpc_status("14", None)).await;
    assert_eq!(third.headers()["grpc-timeout"], "700000u");
    // The next wait, 400 ms, would end at 700 ms: fits. The one after (800 ms) would not.
    let fourth = answer_after(&mut upstream, 400 * MS, grpc_status("14", None)).await;
    assert_eq!(fourth.headers()["grpc-timeout"], "300000u");
    let response = finished(call).await.expect("response");
    assert_eq!(Attempts::of(&response), 4);
    assert_eq!(policy.stats().deadline, 1);
}

#[tokio::test(start_paused = true)]
async fn a_no_retry_signal_is_returned_at_once() {
    let policy = policy().build().expect("policy");
    let (call, mut upstream) = start(policy.clone(), get());
    answer_now(&mut upstream, with_header(503, "x-no-retry", "budget")).await;
    let response = finished(call).await.expect("response");
    assert_eq!(response.headers()["x-no-retry"], "budget");
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().server_refused, 1);
}

#[tokio::test(start_paused = true)]
async fn a6_throttling_stops_retries_at_half_the_tokens() {
    use stormguard::sans_io::throttle::RetryThrottle;
    // gRFC A6 with maxTokens 4, tokenRatio 0.5: retries only while tokens > 2.
    let throttle = RetryThrottle::builder()
        .max_tokens(4.0)
        .token_ratio(0.5)
        .build()
        .expect("throttle");
    let policy = policy().throttle(throttle.clone()).build().expect("policy");

    // 4 -> 3 (retry allowed) -> 2 (no more): two attempts.
    let (call, mut upstream) = start(policy.clone(), get());
    answer_now(&mut upstream, status(503)).await;
    answer_after(&mut upstream, 200 * MS, status(503)).await;
    assert_eq!(status_of(call).await, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(throttle.tokens(), 2.0);
    // 2 -> 1: no retry at all.
    let (call, mut upstream) = start(policy.clone(), get());
    answer_now(&mut upstream, status(503)).await;
    assert_eq!(status_of(call).await, StatusCode::SERVICE_UNAVAILABLE);
    advance(Duration::from_secs(60)).await;
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().budget_denied, 2);

    // Five successes bring it to 3.5: a failure leaves 2.5 (> 2), and it is retried.
    for _ in 0..5 {
        let (call, mut upstream) = start(policy.clone(), get());
        answer_now(&mut upstream, status(200)).await;
        assert_eq!(status_of(call).await, StatusCode::OK);
    }
    assert_eq!(throttle.tokens(), 3.5);
    let (call, mut upstream) = start(policy.clone(), get());
    answer_now(&mut upstream, status(503)).await;
    answer_after(&mut upstream, 200 * MS, status(200)).await;
    assert_eq!(status_of(call).await, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_transparent_retry_honours_the_deadline_and_rewrites_grpc_timeout() {
    let policy = policy().build().expect("policy");
    let req = grpc_call_within("100m");
    // Refused within the deadline: resent at once with what remains.
    let (call, mut upstream) = start(policy.clone(), req.clone());
    settle().await;
    advance(40 * MS).await;
    fail_now(&mut upstream, REFUSED).await;
    let again = answer_now(&mut upstream, grpc_status("0", None)).await;
    assert_eq!(again.headers()["grpc-timeout"], "60000000n");
    finished(call).await.expect("response");

    // Refused after it: the caller has stopped waiting, nothing is resent.
    let (call, mut upstream) = start(policy.clone(), req);
    settle().await;
    advance(150 * MS).await;
    fail_now(&mut upstream, REFUSED).await;
    finished(call).await.expect_err("past the deadline");
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().deadline, 1);
}

#[tokio::test(start_paused = true)]
async fn the_earlier_of_a_deadline_and_a_grpc_timeout_bounds_the_retries() {
    let policy = policy().build().expect("policy");
    // A layer above set a deadline too, a later one: the call's own timeout still binds.
    let req = with_deadline(grpc_call_within("1S"), 10_000 * MS);
    let (call, mut upstream) = start(policy.clone(), req);
    answer_now(&mut upstream, grpc_status("14", None)).await;
    let retry = answer_after(&mut upstream, 200 * MS, grpc_status("0", None)).await;
    assert_eq!(retry.headers()["grpc-timeout"], "800000u");
    finished(call).await.expect("response");

    // An earlier deadline binds the other way round.
    let req = with_deadline(grpc_call_within("10S"), 500 * MS);
    let (call, mut upstream) = start(policy.clone(), req);
    answer_now(&mut upstream, grpc_status("14", None)).await;
    let retry = answer_after(&mut upstream, 200 * MS, grpc_status("14", None)).await;
    assert_eq!(retry.headers()["grpc-timeout"], "300000u");
    // The next wait (400 ms) would end past the deadline: given up at once.
    finished(call).await.expect("response");
    assert_nothing_sent(&mut upstream).await;
    assert_eq!(policy.stats().deadline, 1);
}

/// A service answering from a shared script of statuses, counting its clones.
struct Scripted {
    statuses: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<u16>>>,
    clones: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Clone for Scripted {
    fn clone(&self) -> Self {
        self.clones
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Scripted {
            statuses: self.statuses.clone(),
            clones: self.clones.clone(),
        }
    }
}

impl tower::Service<Request<String>> for Scripted {
    type Response = Response<String>;
    type Error = BoxError;
    type Future = std::future::Ready<Outcome>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<String>) -> Self::Future {
        let code = self.statuses.lock().expect("script").pop_front();
        std::future::ready(Ok(status(code.unwrap_or(200))))
    }
}

#[tokio::test(start_paused = true)]
async fn the_inner_service_is_cloned_only_for_a_request_that_retries() {
    use std::sync::atomic::Ordering::SeqCst;
    use tower::Service;
    let inner = Scripted {
        statuses: Default::default(),
        clones: Default::default(),
    };
    let (statuses, clones) = (inner.statuses.clone(), inner.clones.clone());
    let mut client = RetryLayer::new(policy().build().expect("policy")).layer(inner);
    let made = clones.load(SeqCst);
    for _ in 0..10 {
        let response = client.ready().await.expect("ready").call(get()).await;
        assert_eq!(response.expect("response").status(), StatusCode::OK);
    }
    // tower's `Retry` would have cloned it for each of the ten calls.
    assert_eq!(clones.load(SeqCst), made, "a success clones nothing");

    statuses.lock().expect("script").extend([503, 503]);
    let response = client.ready().await.expect("ready").call(get()).await;
    let response = response.expect("response");
    assert_eq!(Attempts::of(&response), 3);
    assert_eq!(clones.load(SeqCst), made + 1, "one clone for both retries");
}

/// A streaming request body whose connection was refused before any of it was read is
/// sent whole by the retry: the body is handed on, not lost with the first attempt.
#[tokio::test(start_paused = true)]
async fn a_streaming_body_never_read_is_sent_whole_by_the_retry() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, StreamBody};
    use stormguard::ReplayBody;
    type Body = ReplayBody<StreamBody<futures_util::stream::Iter<std::vec::IntoIter<FrameResult>>>>;
    type FrameResult = Result<http_body::Frame<Bytes>, io::Error>;

    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = calls.clone();
    let upstream = tower::service_fn(move |req: Request<Body>| {
        let call = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            if call == 0 {
                // Refused: the request is dropped unread.
                drop(req);
                return Err::<Response<Bytes>, BoxError>(Box::new(io::Error::from(
                    io::ErrorKind::ConnectionRefused,
                )));
            }
            let body = req.into_body().collect().await?.to_bytes();
            Ok(Response::new(body))
        }
    });
    let policy = policy().build().expect("policy");
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()).replay_bodies())
        .service(upstream);
    let frames: Vec<FrameResult> = ["order ", "of ", "three"]
        .into_iter()
        .map(|s| Ok(http_body::Frame::data(Bytes::from_static(s.as_bytes()))))
        .collect();
    let request = Request::post("http://upstream/orders")
        .body(StreamBody::new(futures_util::stream::iter(frames)))
        .expect("request");
    let response = client.oneshot(request).await.expect("retried");
    assert_eq!(response.into_body(), "order of three");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(policy.stats().retries, 1);
}

/// A service whose first call answers 503 and which fails to be ready after it.
#[derive(Clone)]
struct BreaksAfterOneCall {
    calls: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl tower::Service<Request<String>> for BreaksAfterOneCall {
    type Response = Response<String>;
    type Error = BoxError;
    type Future = std::future::Ready<Outcome>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        if self.calls.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            std::task::Poll::Ready(Err("the service broke".into()))
        } else {
            std::task::Poll::Ready(Ok(()))
        }
    }

    fn call(&mut self, _: Request<String>) -> Self::Future {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::future::ready(Ok(status(503)))
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_whose_service_fails_to_be_ready_ends_with_its_error_and_sends_nothing_more() {
    use std::future::Future;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tower::Service;

    let calls = std::sync::Arc::new(AtomicU32::new(0));
    let mut svc = RetryLayer::new(policy().build().expect("policy")).layer(BreaksAfterOneCall {
        calls: std::sync::Arc::clone(&calls),
    });
    let mut future = Box::pin(svc.ready().await.expect("ready").call(get()));
    let error = (&mut future).await.expect_err("the retry's service failed");
    assert_eq!(error.to_string(), "the service broke");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Polled again after it completed (the caller breaks the contract): it stays
    // pending, and nothing more is sent.
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(future.as_mut().poll(&mut cx).is_pending());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
