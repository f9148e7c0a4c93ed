//! The price of a retry budget: one deposit and one withdrawal, for stormguard's
//! `RetryBudget` and tower's `TpsBudget`, on one thread and with two threads contending
//! for the same budget.
//!
//! `cargo bench -p stormguard-bench --bench budget`

use std::hint::black_box;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use stormguard::RetryBudget;
use tower::retry::budget::{Budget, TpsBudget};

/// Both budgets at 10% over 10 s: ours with its default allowance, tower's with a floor
/// of 1 retry/s (its reserve).
fn budgets() -> (RetryBudget, TpsBudget) {
    let ours = RetryBudget::builder()
        .ratio(0.1)
        .window(Duration::from_secs(10))
        .build()
        .expect("valid budget");
    let tower = TpsBudget::new(Duration::from_secs(10), 1, 0.1);
    (ours, tower)
}

/// Runs `op` `iters` times split over `threads` threads and returns the wall time.
fn contended(threads: u64, iters: u64, op: Arc<dyn Fn() + Send + Sync>) -> Duration {
    let start = Instant::now();
    thread::scope(|s| {
        for _ in 0..threads {
            let op = op.clone();
            s.spawn(move || {
                for _ in 0..iters / threads {
                    op();
                }
            });
        }
    });
    start.elapsed()
}

fn budget(c: &mut Criterion) {
    let mut group = c.benchmark_group("budget");
    let (ours, tower) = budgets();

    group.bench_function("stormguard_deposit_withdraw", |b| {
        b.iter(|| {
            let now = Instant::now();
            ours.deposit(now);
            black_box(ours.try_withdraw(now))
        })
    });
    group.bench_function("tower_tps_deposit_withdraw", |b| {
        b.iter(|| {
            tower.deposit();
            black_box(tower.withdraw())
        })
    });

    let (ours, tower) = budgets();
    let ours: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        let now = Instant::now();
        ours.deposit(now);
        black_box(ours.try_withdraw(now));
    });
    let tower = Arc::new(tower);
    let tower: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        tower.deposit();
        black_box(tower.withdraw());
    });
    group.bench_function("stormguard_two_threads", |b| {
        b.iter_custom(|iters| contended(2, iters, ours.clone()))
    });
    group.bench_function("tower_tps_two_threads", |b| {
        b.iter_custom(|iters| contended(2, iters, tower.clone()))
    });
    group.finish();
}

criterion_group!(benches, budget);
criterion_main!(benches);
