//! The stacks every bench compares, listed once: `bare` (the upstream alone), tower's
//! `Retry` with a `TpsBudget` (the reference), tower's `Retry` with a policy that never
//! retries, stormguard's retry, stormguard's retry over its breaker, the standard
//! stack's two tower timeouts, the standard stack with and without its load control,
//! and stormguard's hedge. `ratio` and `overhead` each hand [`each`] a [`Visit`] that measures a stack
//! its own way, and add the rows only they measure.

use std::fmt::Debug;

use http::Response;
use stormguard::{
    CircuitBreaker, CircuitBreakerLayer, HedgeLayer, HedgePolicy, RetryLayer, RetryPolicy,
    StandardStack,
};
use tower::{BoxError, Service, ServiceBuilder};

use crate::stacks::{NeverRetry, Req, TpsPolicy};

/// What a bench does with each stack.
pub(crate) trait Visit {
    /// Measures `svc`, a stack named `name`.
    fn visit<S, B>(&mut self, name: &'static str, svc: S)
    where
        S: Service<Req, Response = Response<B>> + Clone + 'static,
        S::Error: Debug,
        B: hyper::body::Body + 'static,
        B::Error: Debug;
}

/// Hands `visit` every stack, each over an upstream of its own (over a connection, a
/// connection of its own), in the order the tables print them.
pub(crate) fn each<V, S, B>(visit: &mut V, upstream: &dyn Fn() -> S)
where
    V: Visit,
    S: Service<Req, Response = Response<B>> + Clone + 'static,
    S::Error: Into<BoxError> + Debug + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Debug,
{
    visit.visit("bare", upstream());
    visit.visit(
        "tower_retry_tps_budget",
        ServiceBuilder::new()
            .layer(tower::retry::RetryLayer::new(TpsPolicy::new()))
            .service(upstream()),
    );
    visit.visit(
        "tower_retry",
        ServiceBuilder::new()
            .layer(tower::retry::RetryLayer::new(NeverRetry))
            .service(upstream()),
    );
    visit.visit(
        "stormguard_retry",
        ServiceBuilder::new()
            .layer(RetryLayer::new(RetryPolicy::default()))
            .service(upstream()),
    );
    let breaker = CircuitBreaker::builder().build().expect("breaker");
    visit.visit(
        "stormguard_retry_breaker",
        ServiceBuilder::new()
            .layer(RetryLayer::new(RetryPolicy::default()))
            .layer(CircuitBreakerLayer::new(breaker))
            .service(upstream()),
    );
    // The standard stack's two tower timeouts alone (30 s over 10 s), then the standard
    // stack itself.
    visit.visit(
        "two_tower_timeouts",
        ServiceBuilder::new()
            .timeout(stormguard::stack::DEFAULT_TOTAL_TIMEOUT)
            .timeout(stormguard::stack::DEFAULT_ATTEMPT_TIMEOUT)
            .service(upstream()),
    );
    visit.visit(
        "stormguard_standard_stack",
        StandardStack::new("bench").http(upstream()),
    );
    // The same layers built by hand without the load control between the retry and the
    // breaker: the control's own cost is the difference from the row above.
    let breaker = CircuitBreaker::builder().build().expect("breaker");
    visit.visit(
        "stormguard_standard_stack_without_load_control",
        ServiceBuilder::new()
            .timeout(stormguard::stack::DEFAULT_TOTAL_TIMEOUT)
            .layer(
                RetryLayer::new(RetryPolicy::default())
                    .total_timeout(stormguard::stack::DEFAULT_TOTAL_TIMEOUT),
            )
            .layer(CircuitBreakerLayer::new(breaker))
            .timeout(stormguard::stack::DEFAULT_ATTEMPT_TIMEOUT)
            .service(upstream()),
    );
    // The default policy: once it has its latencies, every call it may hedge is timed
    // and its request copied; no hedge fires on an upstream this fast.
    visit.visit(
        "stormguard_hedge",
        ServiceBuilder::new()
            .layer(HedgeLayer::new(HedgePolicy::default()))
            .service(upstream()),
    );
}
