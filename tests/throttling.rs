//! A 429 is throttling, not a transient error: on paused time, its retry waits from a
//! longer base, and a throttled burst goes back through the gate of throttled retries,
//! at the rate the server accepts.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use stormguard::sans_io::retry::THROTTLE_BASE;
use stormguard::{Attempts, BoxError, RetryBudget, RetryLayer, RetryPolicy};
use tokio::time::Instant;
use tower::{service_fn, ServiceBuilder, ServiceExt};

fn answer(status: u16, retry_after: Option<&str>) -> Response<String> {
    let mut response = Response::builder().status(status);
    if let Some(after) = retry_after {
        response = response.header("retry-after", after);
    }
    response.body(String::new()).expect("response")
}

#[tokio::test(start_paused = true)]
async fn a_429_without_retry_after_waits_at_least_the_throttling_base() {
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .service(service_fn(move |_: Request<String>| {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, BoxError>(answer(if n == 0 { 429 } else { 200 }, None)) }
        }));
    let started = Instant::now();
    let response = client
        .oneshot(Request::new(String::new()))
        .await
        .expect("served");
    assert_eq!(response.status(), 200);
    assert_eq!(Attempts::of(&response), 2);
    assert!(
        started.elapsed() >= THROTTLE_BASE,
        "{:?}",
        started.elapsed()
    );
    // A 503's retry (200 ms base) would have gone within 200 ms.
    assert!(
        started.elapsed() <= 2 * THROTTLE_BASE,
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_throttled_burst_goes_back_at_the_rate_the_server_accepts() {
    // A rate limiter admitting one call per 95 ms, no burst; the others get a 429 with
    // `Retry-After: 1`.
    let next_free = Arc::new(Mutex::new(Instant::now()));
    let (attempts, refused) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (a, r) = (attempts.clone(), refused.clone());
    let limiter = service_fn(move |_: Request<String>| {
        a.fetch_add(1, Ordering::SeqCst);
        let now = Instant::now();
        let mut free = next_free.lock().unwrap_or_else(|e| e.into_inner());
        let response = if now >= *free {
            *free = now + Duration::from_millis(95);
            answer(200, None)
        } else {
            r.fetch_add(1, Ordering::SeqCst);
            answer(429, Some("1"))
        };
        async move { Ok::<_, BoxError>(response) }
    });
    // A roomy budget: this is about when the retries go, not how many may.
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
        .service(limiter);
    // A first burst: the server's rate is not known yet, its retries are spread over
    // one more `Retry-After`; every call ends.
    let first: Vec<_> = (0..10)
        .map(|_| tokio::spawn(client.clone().oneshot(Request::new(String::new()))))
        .collect();
    for call in first {
        call.await.expect("joined").expect("answered");
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (attempts_before, refused_before) = (
        attempts.load(Ordering::SeqCst),
        refused.load(Ordering::SeqCst),
    );
    // Ten calls a second for a second, each accepted: the server's rate is known.
    for _ in 0..10 {
        let response = client
            .clone()
            .oneshot(Request::new(String::new()))
            .await
            .expect("answered");
        assert_eq!(response.status(), 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let burst: Vec<_> = (0..10)
        .map(|_| tokio::spawn(client.clone().oneshot(Request::new(String::new()))))
        .collect();
    let mut served = 0;
    for call in burst {
        let response = call.await.expect("joined").expect("answered");
        if response.status() == 200 {
            served += 1;
        }
    }
    // One of the burst served at once; nine refused, each sent again, no earlier than
    // the server asked, through the gate at the rate the server accepted lately (about
    // one every 100 ms): every retry served. The gate probes above that rate by a
    // tenth per retry accepted; one probe may be refused, and its own retry served.
    assert_eq!(served, 10);
    let refused = refused.load(Ordering::SeqCst) - refused_before;
    assert!((9..=10).contains(&refused), "{refused}");
    // Ten calls a second, the burst's ten, and one retry per refusal.
    assert_eq!(
        attempts.load(Ordering::SeqCst) - attempts_before,
        10 + 10 + refused
    );
}
