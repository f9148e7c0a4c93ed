//! The circuit-breaker layer over a `tower_test` mock, on paused time.

use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use stormguard::breaker::{
    BreakerConfig, BreakerConfigBuilder, CircuitBreakerBuilder, CircuitBreakerService,
    ResponseBody, Transition,
};
use stormguard::BoxError;
use stormguard::{breaker::CircuitState, CircuitBreaker, CircuitBreakerLayer, CircuitOpen};
use tokio::time::{advance, Instant};
use tower::{Layer, Service, ServiceExt};
use tower_test::mock::{self, Handle, Mock};

type Req = Request<()>;
type Res = Response<()>;
type Svc = CircuitBreakerService<Mock<Req, Res>>;

const BREAK: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// Ten calls, half failing, open it; one-second breaks without jitter.
fn state_machine() -> BreakerConfigBuilder {
    BreakerConfig::builder()
        .min_throughput(10)
        .failure_ratio(0.5)
        .window(Duration::from_secs(10))
        .break_duration(BREAK)
        .max_break_duration(Duration::from_secs(8))
        .jitter(0.0)
}

/// A breaker of [`state_machine`]'s settings, its jitter seeded.
fn builder() -> CircuitBreakerBuilder {
    seeded(state_machine())
}

/// A breaker of `settings` (most tests: [`state_machine`]'s with one changed), its
/// jitter seeded.
fn seeded(settings: BreakerConfigBuilder) -> CircuitBreakerBuilder {
    CircuitBreaker::builder().config(settings).seed(1)
}

fn service(breaker: &CircuitBreaker) -> (Svc, Handle<Req, Res>) {
    let (mock, handle) = mock::pair();
    (
        CircuitBreakerLayer::new(breaker.clone()).layer(mock),
        handle,
    )
}

fn response(status: u16) -> Res {
    let mut response = Response::new(());
    *response.status_mut() = StatusCode::from_u16(status).expect("status");
    response
}

/// One call that reaches the inner service, which answers `status`.
async fn exchange(svc: &mut Svc, handle: &mut Handle<Req, Res>, status: u16) -> Res {
    let future = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, send) = next_request(handle).await;
    send.send_response(response(status));
    future
        .await
        .expect("a response")
        .map(ResponseBody::into_inner)
}

/// The next request to reach the inner service; fails (rather than hangs) if none does.
async fn next_request(handle: &mut Handle<Req, Res>) -> (Req, mock::SendResponse<Res>) {
    tokio::time::timeout(Duration::from_secs(3600), handle.next_request())
        .await
        .expect("no request reached the service")
        .expect("mock alive")
}

/// One call that the breaker refuses; the inner service must not see it.
async fn refused(svc: &mut Svc, handle: &mut Handle<Req, Res>) -> CircuitOpen {
    let error = svc
        .ready()
        .await
        .expect("ready")
        .call(Request::new(()))
        .await
        .expect_err("refused");
    assert!(
        handle.poll_request().is_pending(),
        "no request may reach the service while the circuit refuses calls"
    );
    error
        .downcast_ref::<CircuitOpen>()
        .expect("a CircuitOpen")
        .clone()
}

/// Fails calls until the circuit opens (at most ten calls).
async fn trip(svc: &mut Svc, handle: &mut Handle<Req, Res>, breaker: &CircuitBreaker) {
    for _ in 0..10 {
        if breaker.state() != CircuitState::Closed {
            break;
        }
        exchange(svc, handle, 503).await;
    }
    assert_eq!(breaker.state(), CircuitState::Open);
}

#[tokio::test(start_paused = true)]
async fn opens_once_the_failure_ratio_is_reached_with_min_throughput() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    for _ in 0..5 {
        exchange(&mut svc, &mut handle, 200).await;
    }
    for _ in 0..4 {
        exchange(&mut svc, &mut handle, 500).await;
    }
    assert_eq!(breaker.state(), CircuitState::Closed);
    exchange(&mut svc, &mut handle, 502).await;
    assert_eq!(breaker.state(), CircuitState::Open);
    let stats = breaker.stats();
    assert_eq!((stats.calls, stats.failures, stats.transitions), (10, 5, 1));
}

#[tokio::test(start_paused = true)]
async fn stays_closed_below_min_throughput() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    for _ in 0..9 {
        exchange(&mut svc, &mut handle, 503).await;
    }
    assert_eq!(breaker.state(), CircuitState::Closed);
    // Once the failures have left the window, nine more do not open it either.
    advance(Duration::from_secs(10)).await;
    for _ in 0..9 {
        exchange(&mut svc, &mut handle, 503).await;
    }
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn while_open_the_inner_service_is_never_called() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    for i in 0..20u32 {
        let open = refused(&mut svc, &mut handle).await;
        assert_eq!(open.state(), CircuitState::Open);
        assert_eq!(open.remaining(), BREAK - MS * 10 * i);
        advance(MS * 10).await;
    }
    let stats = breaker.stats();
    assert_eq!((stats.calls, stats.rejected), (10, 20));
}

#[tokio::test(start_paused = true)]
async fn after_the_break_one_probe_passes_and_its_success_closes() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    advance(BREAK - MS).await;
    refused(&mut svc, &mut handle).await;
    advance(MS).await;
    assert_eq!(breaker.state(), CircuitState::HalfOpen);

    let probe = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, send) = next_request(&mut handle).await;
    // While the probe is in flight, other calls are refused.
    let open = refused(&mut svc, &mut handle).await;
    assert_eq!(open.state(), CircuitState::HalfOpen);
    send.send_response(response(200));
    probe.await.expect("probe response");
    assert_eq!(breaker.state(), CircuitState::Closed);
    exchange(&mut svc, &mut handle, 200).await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_probe_reopens_for_a_doubled_break() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    advance(BREAK).await;
    let mut length = BREAK;
    for _ in 0..3 {
        // Half-open: the probe fails.
        exchange(&mut svc, &mut handle, 503).await;
        assert_eq!(breaker.state(), CircuitState::Open);
        length *= 2;
        assert_eq!(refused(&mut svc, &mut handle).await.remaining(), length);
        advance(length - MS).await;
        assert_eq!(breaker.state(), CircuitState::Open);
        refused(&mut svc, &mut handle).await;
        advance(MS).await;
        assert_eq!(breaker.state(), CircuitState::HalfOpen);
    }
    // A successful probe closes and brings the break back to its base.
    exchange(&mut svc, &mut handle, 200).await;
    assert_eq!(breaker.state(), CircuitState::Closed);
    trip(&mut svc, &mut handle, &breaker).await;
    assert_eq!(refused(&mut svc, &mut handle).await.remaining(), BREAK);
}

#[tokio::test(start_paused = true)]
async fn exactly_probes_of_a_hundred_concurrent_callers_reach_the_service() {
    let breaker = seeded(state_machine().probes(3)).build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    advance(BREAK).await;

    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let mut svc = svc.clone();
            tokio::spawn(async move { svc.ready().await?.call(Request::new(())).await })
        })
        .collect();
    let mut probes = Vec::new();
    while probes.len() < 3 {
        probes.push(next_request(&mut handle).await);
    }
    // Let every task run to its verdict; none other may reach the service.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(
        handle.poll_request().is_pending(),
        "a fourth call got through"
    );
    for (_, send) in probes {
        send.send_response(response(200));
    }
    let (mut passed, mut refused) = (0, 0);
    for task in tasks {
        match task.await.expect("task") {
            Ok(_) => passed += 1,
            Err(error) => {
                assert!(error.is::<CircuitOpen>(), "{error}");
                refused += 1;
            }
        }
    }
    assert_eq!((passed, refused), (3, 97));
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_probe_frees_its_slot() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    advance(BREAK).await;

    let probe = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, _abandoned) = next_request(&mut handle).await;
    refused(&mut svc, &mut handle).await;
    drop(probe);
    assert_eq!(breaker.state(), CircuitState::HalfOpen);
    // The slot is free again: the next call is the probe, and closes the circuit.
    exchange(&mut svc, &mut handle, 200).await;
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn isolate_and_reset() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    assert_eq!(
        breaker.isolate(),
        Some(Transition {
            from: CircuitState::Closed,
            to: CircuitState::Isolated
        })
    );
    let open = refused(&mut svc, &mut handle).await;
    assert_eq!(
        (open.state(), open.remaining()),
        (CircuitState::Isolated, Duration::ZERO)
    );
    advance(Duration::from_secs(3600)).await;
    assert_eq!(breaker.state(), CircuitState::Isolated);
    refused(&mut svc, &mut handle).await;

    assert!(breaker.reset().is_some());
    assert_eq!(breaker.reset(), None);
    exchange(&mut svc, &mut handle, 200).await;

    // Reset also closes an open circuit at once.
    trip(&mut svc, &mut handle, &breaker).await;
    breaker.reset();
    exchange(&mut svc, &mut handle, 200).await;
    assert_eq!(breaker.stats().transitions, 4);
}

#[tokio::test(start_paused = true)]
async fn transitions_reach_the_callback_and_a_watch_it_feeds_in_order() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (tx, mut states) = tokio::sync::watch::channel(CircuitState::Closed);
    let breaker = builder()
        .on_transition({
            let seen = seen.clone();
            move |t| {
                seen.lock().expect("lock").push((t.from, t.to));
                tx.send_replace(t.to);
            }
        })
        .build()
        .expect("config");
    let (mut svc, mut handle) = service(&breaker);

    trip(&mut svc, &mut handle, &breaker).await;
    assert!(states.has_changed().expect("sender alive"));
    assert_eq!(*states.borrow_and_update(), CircuitState::Open);
    advance(BREAK).await;
    exchange(&mut svc, &mut handle, 200).await;
    assert_eq!(*states.borrow_and_update(), CircuitState::Closed);

    use CircuitState::{Closed, HalfOpen, Open};
    assert_eq!(
        *seen.lock().expect("lock"),
        [(Closed, Open), (Open, HalfOpen), (HalfOpen, Closed)]
    );
}

#[tokio::test(start_paused = true)]
async fn client_errors_do_not_open_the_circuit() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    for status in [400, 401, 403, 404, 409, 422].repeat(5) {
        exchange(&mut svc, &mut handle, status).await;
    }
    assert_eq!(breaker.state(), CircuitState::Closed);
    assert_eq!(breaker.stats().failures, 0);
    // Nor do they dilute the failures of a dependency that is failing: ten 503s among
    // thirty 404s still open it.
    for _ in 0..10 {
        exchange(&mut svc, &mut handle, 503).await;
    }
    assert_eq!(breaker.state(), CircuitState::Open);
}

#[tokio::test(start_paused = true)]
async fn inner_errors_count_but_a_nested_circuit_open_does_not() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    for _ in 0..20 {
        let future = svc.ready().await.expect("ready").call(Request::new(()));
        let (_, send) = next_request(&mut handle).await;
        send.send_error(CircuitOpen::new(BREAK));
        let error: BoxError = future.await.expect_err("error passed through");
        assert!(error.is::<CircuitOpen>());
    }
    assert_eq!(breaker.state(), CircuitState::Closed);
    for _ in 0..10 {
        let future = svc.ready().await.expect("ready").call(Request::new(()));
        let (_, send) = next_request(&mut handle).await;
        send.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        future.await.expect_err("error passed through");
    }
    assert_eq!(breaker.state(), CircuitState::Open);
}

#[tokio::test(start_paused = true)]
async fn wait_when_open_holds_poll_ready_until_the_break_is_over() {
    let breaker = builder().wait_when_open(true).build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    let ready = poll_fn(|cx| Poll::Ready(svc.poll_ready(cx))).await;
    assert!(ready.is_pending());

    let start = Instant::now();
    let waiter = tokio::spawn(async move {
        svc.ready().await.expect("ready");
        (svc, Instant::now())
    });
    tokio::time::sleep(BREAK - MS).await;
    assert!(!waiter.is_finished());
    let (mut svc, woke) = waiter.await.expect("waiter");
    assert_eq!(woke - start, BREAK);
    exchange(&mut svc, &mut handle, 200).await;
    assert_eq!(breaker.state(), CircuitState::Closed);

    // Isolated: waits until reset.
    breaker.isolate();
    let waiter = tokio::spawn(async move {
        svc.ready().await.expect("ready");
    });
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert!(!waiter.is_finished());
    breaker.reset();
    waiter.await.expect("woken by reset");
}

#[tokio::test(start_paused = true)]
async fn wait_when_open_lets_one_waiter_probe_and_holds_the_others_until_it_decides() {
    // Three callers (workers that get ready before they have a message to send) wait
    // out the break together. At its end one is ready, with the probe slot; the others
    // stay waiting (not refused), and go through once the probe closes the circuit.
    let breaker = builder().wait_when_open(true).build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    let rejected = breaker.stats().rejected;
    let callers: Vec<_> = (0..3)
        .map(|_| {
            let mut svc = svc.clone();
            tokio::spawn(async move {
                svc.ready().await.expect("ready");
                tokio::time::sleep(MS).await;
                let future = svc.call(Request::new(()));
                future.await.map(|res| res.map(ResponseBody::into_inner))
            })
        })
        .collect();
    advance(BREAK).await;
    let (_, probe) = next_request(&mut handle).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        callers.iter().all(|caller| !caller.is_finished()),
        "the others wait for the probe's verdict"
    );
    probe.send_response(response(200));
    for _ in 0..2 {
        let (_, send) = next_request(&mut handle).await;
        send.send_response(response(200));
    }
    for caller in callers {
        let res = caller.await.expect("joined").expect("served");
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(breaker.state(), CircuitState::Closed);
    assert_eq!(breaker.stats().rejected, rejected, "no caller was refused");
}

#[tokio::test(start_paused = true)]
async fn wait_when_open_wakes_when_a_probe_slot_frees() {
    let breaker = builder().wait_when_open(true).build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    advance(BREAK).await;
    let probe = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, _send) = next_request(&mut handle).await;

    let mut other = svc.clone();
    let waiter = tokio::spawn(async move {
        other.ready().await.expect("ready");
    });
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!waiter.is_finished(), "the only probe slot is taken");
    drop(probe);
    waiter.await.expect("woken when the probe was dropped");
}

#[tokio::test(start_paused = true)]
async fn with_retry_outside_an_open_circuit_comes_back_at_once_not_retried() {
    use stormguard::{Backoff, Jitter, RetryLayer, RetryPolicy};

    // Two failures in two calls open the circuit; the retry layer would try five times.
    let breaker = seeded(state_machine().min_throughput(2))
        .build()
        .expect("breaker");
    let policy = RetryPolicy::builder()
        .max_attempts(5)
        .backoff(Backoff::new(100 * MS, BREAK, Jitter::None).expect("backoff"))
        .budget(
            stormguard::RetryBudget::builder()
                .allowance(10)
                .build()
                .expect("budget"),
        )
        .build()
        .expect("policy");
    let (mock, mut handle) = mock::pair::<Req, Res>();
    let client = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .layer(CircuitBreakerLayer::new(breaker.clone()))
        .service(mock);

    let started = Instant::now();
    let call = tokio::spawn(client.oneshot(Request::new(())));
    for _ in 0..2 {
        let (_, send) = next_request(&mut handle).await;
        send.send_response(response(503));
    }
    // The third attempt meets the open circuit: the caller gets CircuitOpen after the
    // one backoff that preceded it, and the service sees nothing more.
    let error = call
        .await
        .expect("task")
        .expect_err("the open circuit comes back");
    assert!(error.is::<CircuitOpen>(), "{error}");
    assert_eq!(Instant::now() - started, 300 * MS);
    assert!(
        !matches!(handle.poll_request(), Poll::Ready(Some(_))),
        "a third request reached the service"
    );
    assert_eq!(policy.stats().retries, 2);
    assert_eq!(breaker.stats().rejected, 1);

    // While it stays open, new calls fail without any wait at all.
    let (mock, _handle) = mock::pair::<Req, Res>();
    let again = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .layer(CircuitBreakerLayer::new(breaker.clone()))
        .service(mock);
    fails_at_once(again).await;
    assert_eq!(policy.stats().retries, 2);
}

/// A call through `client` (a retry layer over an open circuit) fails with
/// `CircuitOpen` without waiting at all.
async fn fails_at_once<S>(client: S)
where
    S: Service<Req, Error = BoxError>,
    S::Response: std::fmt::Debug,
{
    let started = Instant::now();
    let error = client
        .oneshot(Request::new(()))
        .await
        .expect_err("fails fast");
    assert!(error.is::<CircuitOpen>(), "{error}");
    assert_eq!(Instant::now(), started);
}

/// The retry policy of the blip tests (over `blip_breaker`, a circuit that opens for
/// 25 ms after two failures in a row): the default 3 attempts, waiting 10, 20, 40,
/// 80 ms between calls (no jitter).
fn blip_policy() -> stormguard::RetryPolicy {
    use stormguard::{Backoff, Jitter, RetryPolicy};
    RetryPolicy::builder()
        .backoff(Backoff::new(10 * MS, BREAK, Jitter::None).expect("backoff"))
        .seed(1)
        .build()
        .expect("policy")
}

/// A retry layer with `policy` over `breaker`, over a mock.
fn retry_over(
    breaker: &CircuitBreaker,
    policy: stormguard::RetryPolicy,
) -> (
    impl Service<Req, Response = Response<ResponseBody<()>>, Error = BoxError, Future: Send>
        + Clone
        + Send
        + 'static,
    Handle<Req, Res>,
    stormguard::RetryPolicy,
) {
    let (mock, handle) = mock::pair::<Req, Res>();
    let client = tower::ServiceBuilder::new()
        .layer(stormguard::RetryLayer::new(policy.clone()))
        .layer(CircuitBreakerLayer::new(breaker.clone()))
        .service(mock);
    (client, handle, policy)
}

fn blip_breaker() -> CircuitBreaker {
    seeded(
        BreakerConfig::builder()
            .consecutive_failures(2)
            .break_duration(25 * MS)
            .max_break_duration(25 * MS)
            .jitter(0.0),
    )
    .build()
    .expect("breaker")
}

#[tokio::test(start_paused = true)]
async fn a_blip_that_opens_the_circuit_costs_a_request_none_of_its_attempts() {
    let breaker = blip_breaker();
    let (client, mut handle, policy) = retry_over(&breaker, blip_policy());
    let started = Instant::now();
    let call = tokio::spawn(client.oneshot(Request::new(())));
    // Two 503s (at 0 and 10 ms) open the circuit until 35 ms; the retry at 30 ms meets
    // it 5 ms before its break ends and waits out the next backoff (40 ms), or longer:
    // the break's end plus four times the circuit's age, give or take a quarter
    // (5 + 60 to 100 ms): the call
    // it sends then is the probe, and succeeds. With refusals counted as attempts, the
    // request would have ended at 30 ms, its three attempts spent, in a blip already over.
    for _ in 0..2 {
        let (_, send) = next_request(&mut handle).await;
        send.send_response(response(503));
    }
    let (_, send) = next_request(&mut handle).await;
    let waited = Instant::now() - started - 30 * MS;
    assert!(waited >= 65 * MS && waited <= 105 * MS, "waited {waited:?}");
    send.send_response(response(200));
    let res = call.await.expect("task").expect("served");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(stormguard::Attempts::of(&res), 3);
    assert_eq!(breaker.stats().rejected, 1);
    assert_eq!(breaker.state(), CircuitState::Closed);
    // Its third attempt was a retry like the second; the refusal asked the budget for
    // nothing.
    assert_eq!(policy.stats().retries, 2);
}

#[tokio::test(start_paused = true)]
async fn a_deadline_cuts_the_backlogs_spread_short_instead_of_ending_the_request() {
    let breaker = blip_breaker();
    let (client, mut handle, policy) = retry_over(&breaker, blip_policy());
    let started = Instant::now();
    let mut request = Request::new(());
    let deadline = stormguard::Deadline::after(started.into_std(), 72 * MS);
    request.extensions_mut().insert(deadline);
    let call = tokio::spawn(client.oneshot(request));
    // As above, the retry at 30 ms is refused 5 ms before the break ends, by a circuit
    // open for 20 ms: its wait would be drawn from 40 to 85 ms (this seed's draw: about
    // 53 ms), past the deadline at 72 ms. Cut to what the deadline leaves, it is drawn
    // from 40 to 42 ms, and the probe it sends succeeds.
    for _ in 0..2 {
        let (_, send) = next_request(&mut handle).await;
        send.send_response(response(503));
    }
    let (_, send) = next_request(&mut handle).await;
    let sent = Instant::now() - started;
    assert!(sent >= 70 * MS && sent < 72 * MS, "sent at {sent:?}");
    send.send_response(response(200));
    let res = call.await.expect("task").expect("served");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(policy.stats().retries, 2);
}

#[tokio::test(start_paused = true)]
async fn a_circuit_that_keeps_refusing_ends_the_request_after_as_many_refusals_as_retries() {
    let breaker = blip_breaker();
    let (client, mut handle, policy) = retry_over(&breaker, blip_policy());
    let started = Instant::now();
    let call = tokio::spawn(client.oneshot(Request::new(())));
    // Two 503s (at 0 and 10 ms) open the circuit until 35 ms.
    for _ in 0..2 {
        let (_, send) = next_request(&mut handle).await;
        send.send_response(response(503));
    }
    // Other traffic takes the probe slot at 40 ms, and its probe hangs.
    tokio::time::sleep_until(started + 40 * MS).await;
    let (mut other, mut other_handle) = service(&breaker);
    let probe = other.ready().await.expect("ready").call(Request::new(()));
    let (_, probe_answer) = next_request(&mut other_handle).await;
    // The retry refused at 30 ms waits 65 to 105 ms (its backoff, or four times the
    // circuit's age of 20 ms after the break, give or take a quarter), is refused again
    // at t1 (the slot is taken), waits 80 ms or up to five times the age then
    // (t1 - 10 ms), and at its
    // third refusal the request has waited out as many as its two retries: it ends,
    // with no call beyond its two at the server.
    let error = call.await.expect("task").expect_err("never let through");
    assert!(error.is::<CircuitOpen>(), "{error}");
    let ended = Instant::now() - started;
    assert!(ended > 150 * MS && ended <= 760 * MS, "ended at {ended:?}");
    assert_eq!(breaker.stats().rejected, 3);
    assert!(
        !matches!(handle.poll_request(), Poll::Ready(Some(_))),
        "a refused call reached the service"
    );
    // Its two retries: the second 503, and the call the circuit kept refusing.
    assert_eq!(policy.stats().retries, 2);

    probe_answer.send_response(response(200));
    probe.await.expect("the probe's answer");
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn an_isolated_circuit_fails_fast_under_a_retry_layer() {
    let breaker = blip_breaker();
    let (client, _handle, _policy) = retry_over(&breaker, blip_policy());
    breaker.isolate();
    fails_at_once(client).await;
    assert_eq!(breaker.stats().rejected, 1);
}

/// A retry policy (the default backoff: full jitter from 200 ms) whose budget refuses
/// every retry: no allowance, and one request's 10% is no retry.
fn spent_budget_policy() -> stormguard::RetryPolicy {
    use stormguard::{RetryBudget, RetryPolicy};
    let budget = RetryBudget::builder().allowance(0).build().expect("budget");
    RetryPolicy::builder()
        .budget(budget)
        .seed(1)
        .build()
        .expect("policy")
}

/// Lets a call just spawned run until the breaker has refused it, without moving time.
async fn refused_meanwhile(breaker: &CircuitBreaker) {
    for _ in 0..100 {
        if breaker.stats().rejected > 0 {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the call was not refused");
}

#[tokio::test(start_paused = true)]
async fn a_first_call_refused_at_a_breaks_end_waits_for_the_probe_not_the_budget() {
    // The last break of an incident: the dependency is back, and a new request meets
    // the circuit 10 ms before its break ends, with a budget the incident has spent.
    let breaker = blip_breaker();
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    let opened = Instant::now();
    advance(15 * MS).await;
    let (client, mut client_handle, policy) = retry_over(&breaker, spent_budget_policy());
    let call = tokio::spawn(client.oneshot(Request::new(())));
    // It waits out the rest of the break and up to one more (25 ms), then asks again:
    // the circuit is half-open, and the call is its probe.
    let (_, send) = next_request(&mut client_handle).await;
    let asked = Instant::now() - opened;
    assert!(
        asked >= 25 * MS && asked <= 50 * MS,
        "asked again at {asked:?}"
    );
    assert_eq!(breaker.state(), CircuitState::HalfOpen);
    send.send_response(response(200));
    let res = call.await.expect("task").expect("served");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(stormguard::Attempts::of(&res), 1);
    assert_eq!(breaker.state(), CircuitState::Closed);
    // The wait was no retry: the budget was asked nothing and refused nothing.
    let stats = policy.stats();
    assert_eq!((stats.retries, stats.budget_denied), (0, 0));
    assert_eq!(breaker.stats().rejected, 1);
}

/// What a request made while a probe decides came to: its task, its service's
/// handle, its policy, and when it was made.
struct WhileTheProbeDecides {
    breaker: CircuitBreaker,
    call: tokio::task::JoinHandle<Result<Response<ResponseBody<()>>, BoxError>>,
    handle: Handle<Req, Res>,
    policy: stormguard::RetryPolicy,
    started: Instant,
}

/// Trips a circuit, lets other traffic's probe out after the break, has a new
/// request (on a spent budget) refused while that probe decides, and then answers the
/// probe `status`.
async fn a_request_while_the_probe_decides(status: u16) -> WhileTheProbeDecides {
    let breaker = blip_breaker();
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    advance(25 * MS).await;
    let probe = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, probe_answer) = next_request(&mut handle).await;
    let (client, client_handle, policy) = retry_over(&breaker, spent_budget_policy());
    let started = Instant::now();
    let call = tokio::spawn(client.oneshot(Request::new(())));
    refused_meanwhile(&breaker).await;
    probe_answer.send_response(response(status));
    probe.await.expect("the probe's answer");
    WhileTheProbeDecides {
        breaker,
        call,
        handle: client_handle,
        policy,
        started,
    }
}

#[tokio::test(start_paused = true)]
async fn a_first_call_refused_while_the_probe_decides_is_sent_once_it_has() {
    // The probe succeeds: the circuit closes, and the waiting call goes through it
    // within a break.
    let mut it = a_request_while_the_probe_decides(200).await;
    assert_eq!(it.breaker.state(), CircuitState::Closed);
    let (_, send) = next_request(&mut it.handle).await;
    assert!(Instant::now() - it.started <= 25 * MS);
    send.send_response(response(200));
    let res = it.call.await.expect("task").expect("served");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(it.policy.stats().retries, 0);
    assert_eq!(it.breaker.stats().rejected, 1);
}

#[tokio::test(start_paused = true)]
async fn a_first_call_still_refused_after_its_wait_is_retried_on_the_budget_as_before() {
    // The dependency is still down: the probe fails, and the circuit opens again. The
    // waiting call is refused a second time and, the budget spent, ends with the
    // refusal within a break of its first, having reached nothing.
    let mut it = a_request_while_the_probe_decides(503).await;
    assert_eq!(it.breaker.state(), CircuitState::Open);
    let error = it.call.await.expect("task").expect_err("refused again");
    assert!(error.is::<CircuitOpen>(), "{error}");
    assert!(Instant::now() - it.started <= 25 * MS);
    assert!(
        !matches!(it.handle.poll_request(), Poll::Ready(Some(_))),
        "a refused call reached the service"
    );
    // Its second refusal was handled as any first call's: retried on the budget if
    // the break ended before its backoff, which the budget refused, or given up.
    assert_eq!(it.policy.stats().retries, 0);
    assert_eq!(it.breaker.stats().rejected, 2);
}

/// A service whose `call` or whose response future panics, for the probe tests.
#[derive(Clone)]
struct Panicking {
    in_call: bool,
}

impl Service<Req> for Panicking {
    type Response = Res;
    type Error = BoxError;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<Res, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Req) -> Self::Future {
        assert!(!self.in_call, "the service panics in call");
        Box::pin(async { panic!("the service panics in its future") })
    }
}

/// Trips `breaker`, waits out its break, and checks that a probe through a panicking
/// service gives its half-open slot back.
async fn a_panicking_probe_gives_its_slot_back(in_call: bool) {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    advance(BREAK).await;

    let mut panicking = CircuitBreakerLayer::new(breaker.clone()).layer(Panicking { in_call });
    let ready = panicking.ready().await.expect("ready");
    let probe = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ready.call(Request::new(()))
    }));
    if let Ok(future) = probe {
        assert!(!in_call, "call was to panic");
        let joined = tokio::spawn(future).await;
        assert!(joined.expect_err("the future panics").is_panic());
    }
    assert_eq!(breaker.state(), CircuitState::HalfOpen);
    // Not wedged: the next caller gets the probe slot, and its success closes.
    exchange(&mut svc, &mut handle, 200).await;
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn a_probe_whose_call_panics_gives_its_slot_back() {
    a_panicking_probe_gives_its_slot_back(true).await;
}

#[tokio::test(start_paused = true)]
async fn a_probe_whose_future_panics_gives_its_slot_back() {
    a_panicking_probe_gives_its_slot_back(false).await;
}

#[tokio::test(start_paused = true)]
async fn a_transition_callback_that_panics_does_not_wedge_the_circuit() {
    // The user's callback panics once, as the circuit goes half-open: the call that
    // took the probe slot unwinds, and the slot comes back for the next caller.
    let panicked = Arc::new(AtomicBool::new(false));
    let breaker = builder()
        .on_transition({
            let panicked = Arc::clone(&panicked);
            move |t| {
                if t.to == CircuitState::HalfOpen && !panicked.swap(true, Ordering::SeqCst) {
                    panic!("the user's callback panics");
                }
            }
        })
        .build()
        .expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    advance(BREAK).await;

    let ready = svc.ready().await.expect("ready");
    let call = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ready.call(Request::new(()))
    }));
    assert!(call.is_err(), "the callback was to panic");
    assert!(panicked.load(Ordering::SeqCst));
    assert_eq!(breaker.state(), CircuitState::HalfOpen);
    // Not wedged: the next caller gets the probe slot, and its success closes.
    exchange(&mut svc, &mut handle, 200).await;
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn an_open_circuit_fails_fast_even_when_the_inner_service_is_never_ready() {
    let breaker = builder().build().expect("config");
    let (mut svc, mut handle) = service(&breaker);
    trip(&mut svc, &mut handle, &breaker).await;
    // The dependency is out of capacity (a full Buffer, a ConcurrencyLimit held by hung
    // calls): its poll_ready never completes.
    handle.allow(0);
    let started = Instant::now();
    for _ in 0..3 {
        let open = tokio::time::timeout(Duration::from_secs(3600), refused(&mut svc, &mut handle))
            .await
            .expect("refused at once, without waiting for the inner service");
        assert_eq!(open.state(), CircuitState::Open);
    }
    assert_eq!(Instant::now(), started, "no time passed waiting");
    assert_eq!(breaker.stats().rejected, 3);

    // Isolated: the same.
    breaker.isolate();
    let open = refused(&mut svc, &mut handle).await;
    assert_eq!(open.state(), CircuitState::Isolated);

    // Once it admits calls again, readiness is the inner service's.
    breaker.reset();
    let ready = tokio::time::timeout(Duration::from_secs(1), svc.ready()).await;
    assert!(
        ready.is_err(),
        "a closed circuit waits for the inner service"
    );
    handle.allow(1);
    exchange(&mut svc, &mut handle, 200).await;
}

/// A response body fed by the test, frame by frame.
#[derive(Debug)]
struct Fed(tokio::sync::mpsc::UnboundedReceiver<http_body::Frame<bytes::Bytes>>);

impl http_body::Body for Fed {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|frame| frame.map(Ok))
    }
}

type GrpcRes = Response<Fed>;

/// A gRPC response whose status will come in trailers, and the sender of its frames.
fn grpc_stream() -> (
    GrpcRes,
    tokio::sync::mpsc::UnboundedSender<http_body::Frame<bytes::Bytes>>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let response = Response::builder()
        .header("content-type", "application/grpc")
        .body(Fed(rx))
        .expect("response");
    (response, tx)
}

fn grpc_trailers(code: &'static str) -> http_body::Frame<bytes::Bytes> {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static(code));
    http_body::Frame::trailers(trailers)
}

/// Opens a one-failure breaker over a mock of gRPC streams, waits out its break, and
/// starts the half-open probe: the probe's body, and the sender of its frames.
async fn grpc_probe(
    breaker: &CircuitBreaker,
    svc: &mut CircuitBreakerService<Mock<Req, GrpcRes>>,
    handle: &mut Handle<Req, GrpcRes>,
) -> (
    ResponseBody<Fed>,
    tokio::sync::mpsc::UnboundedSender<http_body::Frame<bytes::Bytes>>,
) {
    let future = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, send) = handle.next_request().await.expect("a request");
    let (response, tx) = grpc_stream();
    send.send_response(response);
    let mut body = future.await.expect("a response").into_body();
    tx.send(grpc_trailers("14")).expect("open body");
    let _ = http_body_util::BodyExt::frame(&mut body).await;
    assert_eq!(breaker.state(), CircuitState::Open);
    advance(BREAK + MS).await;
    let future = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, send) = handle.next_request().await.expect("the probe");
    let (response, tx) = grpc_stream();
    send.send_response(response);
    let body = future.await.expect("a response").into_body();
    (body, tx)
}

#[tokio::test(start_paused = true)]
async fn a_probe_answered_with_a_long_stream_is_decided_at_its_first_message() {
    let breaker = seeded(state_machine().consecutive_failures(1))
        .build()
        .expect("breaker");
    let (mock, mut handle) = mock::pair::<Req, GrpcRes>();
    let mut svc = CircuitBreakerLayer::new(breaker.clone()).layer(mock);
    let (mut body, tx) = grpc_probe(&breaker, &mut svc, &mut handle).await;
    // The probe's head came, with no status: undecided, and its slot still taken.
    assert_eq!(breaker.state(), CircuitState::HalfOpen);
    let refused = svc
        .ready()
        .await
        .expect("ready")
        .call(Request::new(()))
        .await;
    let refused = refused.expect_err("the probe slot is taken");
    assert!(refused.is::<CircuitOpen>(), "{refused}");
    // Its first message closes the circuit, while the stream goes on.
    tx.send(http_body::Frame::data(bytes::Bytes::from_static(
        b"\0\0\0\0\0",
    )))
    .expect("open body");
    let frame = http_body_util::BodyExt::frame(&mut body).await;
    assert!(frame.is_some_and(|frame| frame.is_ok_and(|frame| frame.is_data())));
    assert_eq!(breaker.state(), CircuitState::Closed);
    let future = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, send) = handle.next_request().await.expect("a call goes through");
    send.send_response(grpc_stream().0);
    future.await.expect("a response");
    // The probe's stream failing later does not reopen the circuit by itself.
    tx.send(grpc_trailers("14")).expect("open body");
    let _ = http_body_util::BodyExt::frame(&mut body).await;
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn a_probe_whose_stream_fails_before_any_message_reopens_the_circuit() {
    let breaker = seeded(state_machine().consecutive_failures(1))
        .build()
        .expect("breaker");
    let (mock, mut handle) = mock::pair::<Req, GrpcRes>();
    let mut svc = CircuitBreakerLayer::new(breaker.clone()).layer(mock);
    let (mut body, tx) = grpc_probe(&breaker, &mut svc, &mut handle).await;
    tx.send(grpc_trailers("14")).expect("open body");
    let _ = http_body_util::BodyExt::frame(&mut body).await;
    assert_eq!(breaker.state(), CircuitState::Open);
    assert_eq!(breaker.stats().failures, 2);
}

#[tokio::test(start_paused = true)]
async fn a_probe_stream_dropped_unread_frees_its_slot() {
    let breaker = seeded(state_machine().consecutive_failures(1))
        .build()
        .expect("breaker");
    let (mock, mut handle) = mock::pair::<Req, GrpcRes>();
    let mut svc = CircuitBreakerLayer::new(breaker.clone()).layer(mock);
    let (body, _tx) = grpc_probe(&breaker, &mut svc, &mut handle).await;
    drop(body);
    // Neither success nor failure: still half-open, and the next call is the probe.
    assert_eq!(breaker.state(), CircuitState::HalfOpen);
    let future = svc.ready().await.expect("ready").call(Request::new(()));
    let (_, send) = handle.next_request().await.expect("the next probe");
    send.send_response(grpc_stream().0);
    future.await.expect("a response");
    assert_eq!(breaker.stats().failures, 1);
}

/// The attempts of `n` requests, one every millisecond from 0, through the library's retry
/// layer (3 attempts, full jitter from 200 ms, a budget that never refuses) over a
/// breaker that opens at 2 failures in a row with 25 ms breaks, to a dependency that
/// answers 503 until `blip` and 200 after: each attempt's time at the dependency, and
/// how many requests were served.
async fn backlog_through_a_blip(n: u32, blip: Duration) -> (Vec<Duration>, usize) {
    use stormguard::{RetryBudget, RetryLayer, RetryPolicy};
    let start = Instant::now();
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let seen = arrivals.clone();
    let dependency = tower::service_fn(move |_: Req| {
        let at = Instant::now() - start;
        seen.lock().expect("arrivals").push(at);
        let status = if at < blip { 503 } else { 200 };
        std::future::ready(Ok::<_, BoxError>(response(status)))
    });
    let policy = RetryPolicy::builder()
        .budget(
            RetryBudget::builder()
                .ratio(1.0)
                .allowance(u32::MAX)
                .build()
                .expect("budget"),
        )
        .seed(3)
        .build()
        .expect("policy");
    let client = tower::ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .layer(CircuitBreakerLayer::new(blip_breaker()))
        .service(dependency);
    let mut requests = tokio::task::JoinSet::new();
    for i in 0..n {
        tokio::time::sleep_until(start + MS * i).await;
        requests.spawn(client.clone().oneshot(Request::new(())));
    }
    let mut served = 0;
    while let Some(done) = requests.join_next().await {
        if matches!(done, Ok(Ok(res)) if res.status() == StatusCode::OK) {
            served += 1;
        }
    }
    let arrivals = arrivals.lock().expect("arrivals").clone();
    (arrivals, served)
}

#[tokio::test(start_paused = true)]
async fn a_breaks_backlog_comes_back_spread_over_four_times_its_age() {
    // A 300 ms blip that 100 requests per 100 ms run into: the circuit opens at once and
    // refuses their retries and their first calls until it ends.
    let blip = 300 * MS;
    let (arrivals, served) = backlog_through_a_blip(300, blip).await;
    let mut per_100ms = [0u32; 20];
    for at in arrivals.iter().filter(|at| **at >= blip) {
        let bucket = ((*at - blip).as_millis() / 100) as usize;
        per_100ms[bucket.min(per_100ms.len() - 1)] += 1;
    }
    let after: u32 = per_100ms.iter().sum();
    // Sent after their backoffs alone, the refused calls came back at 122 in the first
    // 100 ms after the close (more than the rate they built up at) and 76% of them
    // within 200 ms; spread over the circuit's age, they come back over a second.
    assert!(
        per_100ms.iter().all(|&n| n <= 75),
        "attempts per 100 ms after the blip: {per_100ms:?}"
    );
    assert!(
        2 * (per_100ms[0] + per_100ms[1]) <= after,
        "attempts per 100 ms after the blip: {per_100ms:?}"
    );
    // And they do come back, and are served.
    assert!(after >= 250, "attempts after the blip: {per_100ms:?}");
    assert!(
        served >= 250,
        "{served} of 300 served; after the blip: {per_100ms:?}"
    );
}
