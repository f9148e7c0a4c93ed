//! The load control as a caller sees it, on paused time: a call past the limit waits
//! for room, and is shed (never sent, a `Shed` error, not retried) when none comes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use stormguard::load::{LoadControl, LoadControlLayer, Shed};
use stormguard::{BoxError, GiveUp, RetryBudget, RetryLayer, RetryPolicy};
use tokio::sync::Semaphore;
use tower::{service_fn, ServiceBuilder, ServiceExt};

/// A dependency that counts the calls it gets and answers each once `gate` lets it.
fn gated(
    calls: Arc<AtomicU32>,
    gate: Arc<Semaphore>,
) -> impl tower::Service<
    Request<String>,
    Response = Response<String>,
    Error = BoxError,
    Future = impl Send,
> + Clone {
    service_fn(move |_: Request<String>| {
        let (calls, gate) = (calls.clone(), gate.clone());
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let _pass = gate.acquire().await?;
            Ok::<_, BoxError>(Response::new(String::new()))
        }
    })
}

fn control(max_wait: Duration) -> LoadControl {
    LoadControl::builder()
        .min(1)
        .initial(1)
        .max(1)
        .max_wait(max_wait)
        .build()
        .expect("valid")
}

#[tokio::test(start_paused = true)]
async fn a_shed_call_is_never_sent_fails_with_shed_and_is_not_retried() {
    let (calls, gate) = (Arc::new(AtomicU32::new(0)), Arc::new(Semaphore::new(0)));
    let control = control(Duration::from_millis(50));
    let budget = RetryBudget::builder()
        .allowance(100)
        .build()
        .expect("budget");
    let policy = RetryPolicy::builder()
        .budget(budget)
        .build()
        .expect("policy");
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .layer(LoadControlLayer::new(control.clone()))
        .service(gated(calls.clone(), gate.clone()));
    // The first call takes the only place and is held.
    let first = tokio::spawn(client.clone().oneshot(Request::new(String::new())));
    tokio::task::yield_now().await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // The second waits for room for 50 ms, then fails with `Shed`, unsent, unretried.
    let started = tokio::time::Instant::now();
    let err = client
        .clone()
        .oneshot(Request::new(String::new()))
        .await
        .expect_err("shed");
    let shed = err.downcast_ref::<Shed>().expect("a Shed");
    assert_eq!((shed.limit(), shed.in_flight()), (1, 1));
    assert_eq!(started.elapsed(), Duration::from_millis(50));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the shed call was never sent"
    );
    let stats = control.stats();
    assert_eq!((stats.shed, stats.waited), (1, 1));
    assert_eq!(policy.stats().retries, 0);
    assert_eq!(GiveUp::Shed.as_str(), "shed");
    // The held call completes normally.
    gate.add_permits(1);
    let response = first.await.expect("joined").expect("served");
    assert_eq!(response.status(), 200);
    assert_eq!(control.stats().in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn a_call_waiting_for_room_is_sent_when_a_place_is_given_back() {
    let (calls, gate) = (Arc::new(AtomicU32::new(0)), Arc::new(Semaphore::new(0)));
    let control = control(Duration::from_millis(100));
    let client = ServiceBuilder::new()
        .layer(LoadControlLayer::new(control.clone()))
        .service(gated(calls.clone(), gate.clone()));
    let first = tokio::spawn(client.clone().oneshot(Request::new(String::new())));
    let second = tokio::spawn(client.clone().oneshot(Request::new(String::new())));
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one place: the second waits"
    );
    // The first is answered at 30 ms; the second takes its place and is sent.
    gate.add_permits(2);
    assert_eq!(first.await.expect("joined").expect("served").status(), 200);
    assert_eq!(second.await.expect("joined").expect("served").status(), 200);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let stats = control.stats();
    assert_eq!((stats.shed, stats.waited, stats.in_flight), (0, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_gives_up_gives_its_place_back() {
    let (calls, gate) = (Arc::new(AtomicU32::new(0)), Arc::new(Semaphore::new(0)));
    let control = control(Duration::ZERO);
    let client = ServiceBuilder::new()
        .layer(LoadControlLayer::new(control.clone()))
        .service(gated(calls.clone(), gate.clone()));
    // A caller's own timeout drops the call while it is held: its place comes back.
    let dropped = tokio::time::timeout(
        Duration::from_millis(10),
        client.clone().oneshot(Request::new(String::new())),
    )
    .await;
    assert!(dropped.is_err());
    assert_eq!(control.stats().in_flight, 0);
    gate.add_permits(1);
    let response = client
        .oneshot(Request::new(String::new()))
        .await
        .expect("room again");
    assert_eq!(response.status(), 200);
}

const MS: Duration = Duration::from_millis(1);

/// A dependency answering every call with `status` after `latency`, counting the calls
/// it gets.
fn answering(
    calls: Arc<AtomicU32>,
    latency: Duration,
    status: http::StatusCode,
) -> impl tower::Service<
    Request<String>,
    Response = Response<String>,
    Error = BoxError,
    Future = impl Send,
> + Clone {
    service_fn(move |_: Request<String>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(latency).await;
            let mut response = Response::new(String::new());
            *response.status_mut() = status;
            Ok::<_, BoxError>(response)
        }
    })
}

/// Sends `n` calls at once through `stack`, and counts those served.
async fn burst<S>(stack: S, n: u32) -> u32
where
    S: tower::Service<Request<String>, Response = Response<String>, Error = BoxError>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..n {
        calls.spawn(stack.clone().oneshot(Request::new(String::new())));
    }
    let mut served = 0;
    while let Some(call) = calls.join_next().await {
        served += u32::from(call.expect("joined").is_ok());
    }
    served
}

/// A new client's burst of 1000 calls at once (ten times the limit it starts at) to a
/// healthy dependency answering in 50 ms, half the wait for room: the limit is a
/// guess still learning, so the calls past it wait for it to grow, and not one is
/// shed. Once an overload answer has taught the limit, a call past it is shed at
/// `max_wait` again.
#[tokio::test(start_paused = true)]
async fn a_new_clients_burst_to_a_healthy_dependency_is_not_shed() {
    let calls = Arc::new(AtomicU32::new(0));
    let control = LoadControl::builder().build().expect("the defaults");
    assert!(control.limit().learning());
    let client = ServiceBuilder::new()
        .layer(LoadControlLayer::new(control.clone()))
        .service(answering(calls.clone(), 50 * MS, http::StatusCode::OK));
    let started = tokio::time::Instant::now();
    assert_eq!(burst(client, 1000).await, 1000);
    assert_eq!(calls.load(Ordering::SeqCst), 1000);
    let stats = control.stats();
    assert_eq!((stats.shed, stats.in_flight), (0, 0));
    assert!(stats.waited >= 900, "{stats:?}");
    // The limit doubled while the calls waited: six round trips, not one per call.
    assert!(started.elapsed() <= 500 * MS, "{:?}", started.elapsed());
    assert!(control.limit().learning());

    // Overload answers, every call of a window: the limit is cut, and learnt.
    let overloaded = ServiceBuilder::new()
        .layer(LoadControlLayer::new(control.clone()))
        .service(answering(
            calls.clone(),
            50 * MS,
            http::StatusCode::TOO_MANY_REQUESTS,
        ));
    let limit = control.stats().limit;
    // Bursts a window apart (four latency floors): the first ends the burst's window,
    // the next have windows of their own, all overload answers.
    for _ in 0..3 {
        tokio::time::sleep(250 * MS).await;
        burst(overloaded.clone(), 8).await;
    }
    assert!(!control.limit().learning());
    assert!(control.stats().limit < limit, "{:?}", control.stats());
    // The same burst now meets a limit that binds: what waits past `max_wait` is shed.
    let client = ServiceBuilder::new()
        .layer(LoadControlLayer::new(control.clone()))
        .service(answering(calls.clone(), 200 * MS, http::StatusCode::OK));
    let served = burst(client, 1000).await;
    assert!(served < 1000, "{served}");
    assert_eq!(control.stats().shed, u64::from(1000 - served));
}

/// A limit cut to its minimum in an incident lets go once the dependency has room: a
/// client calling once every 50 ms afterwards never needs more than its minimum, yet
/// a burst of 500 calls eight seconds later is not shed.
#[tokio::test(start_paused = true)]
async fn a_limit_learnt_in_an_incident_lets_go_once_it_is_over() {
    let control = LoadControl::builder().build().expect("the defaults");
    let calls = Arc::new(AtomicU32::new(0));
    let through = |status| {
        ServiceBuilder::new()
            .layer(LoadControlLayer::new(control.clone()))
            .service(answering(calls.clone(), 50 * MS, status))
    };
    let overloaded = through(http::StatusCode::TOO_MANY_REQUESTS);
    for _ in 0..10 {
        tokio::time::sleep(250 * MS).await;
        burst(overloaded.clone(), 8).await;
    }
    assert!(control.stats().limit < 100, "{:?}", control.stats());
    assert!(!control.limit().learning());
    let healthy = through(http::StatusCode::OK);
    // 160 calls, 40 windows of four floors: 25 calm ones in a row let go.
    for _ in 0..160 {
        tokio::spawn(healthy.clone().oneshot(Request::new(String::new())));
        tokio::time::sleep(50 * MS).await;
    }
    tokio::time::sleep(100 * MS).await;
    assert!(control.limit().learning(), "{:?}", control.stats());
    assert_eq!(burst(healthy, 500).await, 500);
    assert_eq!(control.stats().shed, 0);
}

/// Through the standard stack, a call waits for room no longer than the attempt
/// timeout, even while the limit is still a guess (which alone would hold it for
/// sixteen latency floors): of a burst of 50 past a limit of one, to a dependency
/// answering in 80 ms, every call is served or shed within the attempt timeout of
/// waiting, and those shed are never sent.
#[tokio::test(start_paused = true)]
async fn through_the_stack_a_call_waits_for_room_no_longer_than_the_attempt_timeout() {
    let calls = Arc::new(AtomicU32::new(0));
    let control = LoadControl::builder()
        .min(1)
        .initial(1)
        .max(1000)
        .max_wait(20 * MS)
        .build()
        .expect("valid");
    let once = RetryPolicy::builder()
        .max_attempts(1)
        .build()
        .expect("policy");
    let stack = stormguard::stack::StandardStack::builder("guess")
        .attempt_timeout(100 * MS)
        .load_control(control.clone())
        .retry(once)
        .build()
        .expect("stack");
    let client = stack.http(answering(calls.clone(), 80 * MS, http::StatusCode::OK));
    let started = tokio::time::Instant::now();
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let client = client.clone();
        requests.spawn(async move {
            let outcome = client.oneshot(Request::new(String::new())).await;
            (outcome.map_err(|e| e.is::<Shed>()), started.elapsed())
        });
    }
    let (mut served, mut shed) = (0, 0);
    while let Some(done) = requests.join_next().await {
        let (outcome, took) = done.expect("joined");
        match outcome {
            Ok(response) => {
                assert_eq!(response.status(), 200);
                assert!(took <= 180 * MS, "served after {took:?}");
                served += 1;
            }
            Err(true) => {
                assert!(took <= 100 * MS, "shed after {took:?}");
                shed += 1;
            }
            Err(false) => panic!("neither served nor shed"),
        }
    }
    assert!(control.limit().learning(), "{:?}", control.stats());
    assert_eq!(served + shed, 50);
    assert!(served >= 2 && shed >= 40, "{served} served, {shed} shed");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        served,
        "a shed call is never sent"
    );
    assert_eq!(control.stats().shed, u64::from(shed));
}
