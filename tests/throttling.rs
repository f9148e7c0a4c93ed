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

/// What one seeded run of [`a_throttled_burst_goes_back_at_the_rate_the_server_accepts`]
/// saw of its last burst of ten.
struct Burst {
    served: u32,
    refused: u32,
    attempts: u32,
}

/// A rate limiter admitting one call per 95 ms, no burst (the others get a 429 with
/// `Retry-After: 1`), called by one client whose jitter is drawn from `seed`: a first
/// burst of ten, ten calls a second for a second (each accepted: the server's rate is
/// known), and a second burst of ten, whose figures are returned.
async fn throttled_burst(seed: u64) -> Burst {
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
        .seed(seed)
        .build()
        .expect("policy");
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
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
    Burst {
        served,
        refused: refused.load(Ordering::SeqCst) - refused_before,
        attempts: attempts.load(Ordering::SeqCst) - attempts_before - 10,
    }
}

#[tokio::test(start_paused = true)]
async fn a_throttled_burst_goes_back_at_the_rate_the_server_accepts() {
    // One of the burst is served at once; nine are refused, each sent again no earlier
    // than the server asked, through the gate at the rate the server accepted in the
    // last second (about one every 100 ms). The gate probes above that rate by a tenth
    // per retry accepted, so a probe or two may be refused, and their own retries
    // served; a retry that finds no slot within one more `Retry-After` is not sent at
    // all. Over 32 seeds of jitter:
    let (runs, mut served) = (32u32, 0);
    for seed in 0..runs {
        let burst = throttled_burst(u64::from(seed)).await;
        // At most two probes refused; at most one retry not sent.
        assert!(
            (9..=11).contains(&burst.refused),
            "seed {seed}: {}",
            burst.refused
        );
        assert!(burst.served >= 9, "seed {seed}: {}", burst.served);
        // The burst's ten, and one retry per refusal, but for a request given up on.
        assert_eq!(
            burst.attempts,
            10 + burst.refused - (10 - burst.served),
            "seed {seed}"
        );
        served += burst.served;
    }
    // Sent back together, or at the rate of an estimate taken over the silence before
    // the calls began (half the server's), the retries would be refused again or left
    // unsent: all but one of the bursts' requests are served.
    let requests = 10 * runs;
    assert!(served + 1 >= requests, "{served} of {requests}");
}
