//! Allocations per call on the success path, counted by a global allocator wrapper:
//! stormguard's retry and breaker layers allocate nothing beyond what tower's own
//! `Retry` does to clone the request, for a small request and for a realistic one (ten
//! headers, a 1 KiB body), whose clone allocates more.
//!
//! Its tests count one at a time (`ONE_AT_A_TIME`), so that no other test allocates while
//! one counts.

use std::alloc::System;

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use stormguard::stack::StandardStack;
use stormguard::{CircuitBreaker, CircuitBreakerLayer, RetryLayer, RetryPolicy};
use tower::{Service, ServiceBuilder, ServiceExt};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[path = "support/stacks.rs"]
mod stacks;

use stacks::{realistic_request, request, upstream, NeverRetry, Req, TpsPolicy, UPSTREAM};

/// Builds a fresh request for each call.
type MakeRequest = fn() -> Req;

/// Mean allocations of one call: the request built by `make` and sent, and the response
/// dropped or, with `to_trailers`, its body read to its end (and its trailers there).
fn allocations_per_call<S, B>(
    rt: &tokio::runtime::Runtime,
    make: MakeRequest,
    svc: S,
    to_trailers: bool,
) -> f64
where
    S: Service<Req, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    const CALLS: usize = 1000;
    let call = |svc: S| async move {
        let res = svc.oneshot(make()).await.expect("200");
        if to_trailers {
            let body = http_body_util::BodyExt::collect(res.into_body()).await;
            assert!(body.expect("a body").trailers().is_some());
        }
    };
    rt.block_on(async {
        for _ in 0..100 {
            call(svc.clone()).await;
        }
    });
    let region = Region::new(GLOBAL);
    rt.block_on(async {
        for _ in 0..CALLS {
            call(svc.clone()).await;
        }
    });
    region.change().allocations as f64 / CALLS as f64
}

/// The counting allocator counts every thread: the tests take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn the_success_path_allocates_no_more_than_towers_retry() {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let requests: [(&str, MakeRequest); 2] = [
        ("small", request),
        ("realistic", || realistic_request(UPSTREAM)),
    ];
    for (name, make) in requests {
        let bare = allocations_per_call(&rt, make, upstream(), false);
        let tower_retry = allocations_per_call(
            &rt,
            make,
            ServiceBuilder::new()
                .layer(tower::retry::RetryLayer::new(NeverRetry))
                .service(upstream()),
            false,
        );
        let tower_tps = allocations_per_call(
            &rt,
            make,
            ServiceBuilder::new()
                .layer(tower::retry::RetryLayer::new(TpsPolicy::new()))
                .service(upstream()),
            false,
        );
        let retry = allocations_per_call(
            &rt,
            make,
            ServiceBuilder::new()
                .layer(RetryLayer::new(RetryPolicy::default()))
                .service(upstream()),
            false,
        );
        let breaker = CircuitBreaker::builder().build().expect("breaker");
        let retry_breaker = allocations_per_call(
            &rt,
            make,
            ServiceBuilder::new()
                .layer(RetryLayer::new(RetryPolicy::default()))
                .layer(CircuitBreakerLayer::new(breaker))
                .service(upstream()),
            false,
        );
        let standard = allocations_per_call(
            &rt,
            make,
            StandardStack::new("allocations").http(upstream()),
            false,
        );
        // The same layers without the load control between the retry and the breaker.
        let breaker = CircuitBreaker::builder().build().expect("breaker");
        let without_load_control = allocations_per_call(
            &rt,
            make,
            ServiceBuilder::new()
                .timeout(stormguard::stack::DEFAULT_TOTAL_TIMEOUT)
                .layer(
                    RetryLayer::new(RetryPolicy::default())
                        .total_timeout(stormguard::stack::DEFAULT_TOTAL_TIMEOUT),
                )
                .layer(CircuitBreakerLayer::new(breaker))
                .timeout(stormguard::stack::DEFAULT_ATTEMPT_TIMEOUT)
                .service(upstream()),
            false,
        );
        println!(
            "{name} request, allocations per call: bare {bare}, tower_retry {tower_retry}, \
             tower_retry_tps_budget {tower_tps}, stormguard retry {retry}, \
             stormguard retry+breaker {retry_breaker}, standard stack {standard} \
             ({without_load_control} without its load control)"
        );
        // The load control allocates nothing of its own on the success path.
        assert!(
            standard <= without_load_control,
            "{name}: the standard stack allocates {standard} per call, \
             {without_load_control} without its load control"
        );
        // Building the request allocates: zeros here would mean the allocator counts
        // nothing, and the comparisons below would pass vacuously.
        assert!(
            bare >= 1.0,
            "{name}: the counting allocator saw {bare} allocations per call"
        );
        for (stack, allocations) in [("retry", retry), ("retry+breaker", retry_breaker)] {
            assert!(
                allocations <= tower_retry,
                "{name}: stormguard {stack} allocates {allocations} per call, tower's Retry {tower_retry}"
            );
        }
    }
}

#[test]
fn a_grpc_success_read_to_its_trailers_allocates_nothing_in_the_breaker() {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let grpc = stacks::grpc_request;
    // Another thread of the test process (libtest reporting a test) can allocate while a
    // run counts, which only ever adds: the fewest of three runs is the stack's own.
    let fewest = |runs: [f64; 3]| runs.into_iter().fold(f64::INFINITY, f64::min);
    let bare =
        fewest([(); 3].map(|()| allocations_per_call(&rt, grpc, stacks::grpc_upstream(), true)));
    let breaker = CircuitBreaker::builder().build().expect("breaker");
    let watched = fewest([(); 3].map(|()| {
        allocations_per_call(
            &rt,
            grpc,
            ServiceBuilder::new()
                .layer(CircuitBreakerLayer::new(breaker.clone()))
                .service(stacks::grpc_upstream()),
            true,
        )
    }));
    println!(
        "gRPC call read to its trailers, allocations per call: bare {bare}, breaker {watched}"
    );
    assert!(
        bare >= 1.0,
        "the counting allocator saw {bare} allocations per call"
    );
    assert_eq!(watched, bare);
    // And the breaker saw every call end well.
    let stats = breaker.stats();
    assert_eq!((stats.calls, stats.failures), (3 * 1100, 0), "{stats:?}");
}
