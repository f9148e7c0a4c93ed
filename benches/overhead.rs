//! What stormguard costs per call on the success path, next to a bare service and the
//! peers a tower user would pick, all in one criterion run.
//!
//! Every bench sends the same `http::Request<Full<Bytes>>` to the same always-200
//! `service_fn`, awaiting readiness and the response on a current-thread runtime.
//!
//! `cargo bench --bench overhead` (or `-- --quick` for a short run)

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use stormguard::{CircuitBreaker, CircuitBreakerLayer, RetryLayer, RetryPolicy};
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::Policy;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

#[path = "../tests/support/stacks.rs"]
mod stacks;

use stacks::{request, upstream, NeverRetry, Req, Res};

/// A tower policy as users write one with `TpsBudget`: deposit for every request that
/// succeeded, withdraw for every retry.
#[derive(Clone)]
struct TpsPolicy {
    budget: std::sync::Arc<TpsBudget>,
    attempts: u32,
}

impl<E> Policy<Req, Res, E> for TpsPolicy {
    type Future = tokio::time::Sleep;

    fn retry(&mut self, _: &mut Req, result: &mut Result<Res, E>) -> Option<Self::Future> {
        match result {
            Ok(res) if !res.status().is_server_error() => {
                self.budget.deposit();
                None
            }
            _ if self.attempts >= 2 || !self.budget.withdraw() => None,
            _ => {
                self.attempts += 1;
                Some(tokio::time::sleep(Duration::from_millis(200)))
            }
        }
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

fn bench<S>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    id: &str,
    svc: S,
) where
    S: Service<Req, Response = Res> + Clone,
    S::Error: std::fmt::Debug,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    c.bench_function(id, |b| {
        b.to_async(&rt).iter(|| {
            let mut svc = svc.clone();
            async move {
                let res = svc.ready().await.expect("ready").call(request()).await;
                black_box(res.expect("200"))
            }
        })
    });
}

fn overhead(c: &mut Criterion) {
    let mut group = c.benchmark_group("overhead");

    bench(&mut group, "bare", upstream());

    bench(
        &mut group,
        "tower_retry",
        ServiceBuilder::new()
            .layer(tower::retry::RetryLayer::new(NeverRetry))
            .service(upstream()),
    );

    let tps = TpsPolicy {
        budget: std::sync::Arc::new(TpsBudget::new(Duration::from_secs(10), 1, 0.1)),
        attempts: 0,
    };
    bench(
        &mut group,
        "tower_retry_tps_budget",
        ServiceBuilder::new()
            .layer(tower::retry::RetryLayer::new(tps))
            .service(upstream()),
    );

    bench(
        &mut group,
        "stormguard_retry",
        ServiceBuilder::new()
            .layer(RetryLayer::new(RetryPolicy::default()))
            .service(upstream()),
    );

    let breaker = CircuitBreaker::builder().build().expect("breaker");
    bench(
        &mut group,
        "stormguard_retry_breaker",
        ServiceBuilder::new()
            .layer(RetryLayer::new(RetryPolicy::default()))
            .layer(CircuitBreakerLayer::new(breaker))
            .service(upstream()),
    );

    let retry = tower_resilience::retry::RetryLayer::<
        Req,
        Res,
        tower_resilience::circuitbreaker::CircuitBreakerError<BoxError>,
    >::builder()
    .max_attempts(3)
    .exponential_backoff(Duration::from_millis(200))
    .build();
    let breaker = tower_resilience::circuitbreaker::CircuitBreakerLayer::builder()
        .failure_rate_threshold(0.5)
        .sliding_window_size(100)
        .minimum_number_of_calls(20)
        .wait_duration_in_open(Duration::from_secs(5))
        .build()
        .expect("breaker");
    bench(
        &mut group,
        "tower_resilience_retry_breaker",
        ServiceBuilder::new()
            .layer(retry)
            .layer(breaker)
            .service(upstream()),
    );

    group.finish();
}

criterion_group!(benches, overhead);
criterion_main!(benches);
