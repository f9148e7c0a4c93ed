//! A loom model of the lock-free parts: the budget's roll-over, the breaker's half-open
//! probe admission and the load limit's admission. Built only with `--cfg loom`, which swaps their atomics and
//! locks for loom's (see `sync`); run it with
//!
//! ```text
//! LOOM_MAX_PREEMPTIONS=2 RUSTFLAGS="--cfg loom" \
//!     cargo test -p stormguard-core --lib --release --target-dir target/loom loom_model \
//!     -- --test-threads=1 --nocapture
//! ```
//!
//! Loom runs every test closure under every interleaving of the threads' atomic
//! operations (up to the preemption bound), checking the invariants the docs promise:
//! retries granted <= ratio x deposits, with no per-thread slack; a charge is never
//! lost to the roll-over that carries its bucket out of the window; never more probes in flight than `probes`; and a
//! failed probe re-opens the circuit whatever races it; the load limit admits exactly its
//! limit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use loom::thread;

/// Runs `f` under loom and prints how many interleavings it explored.
fn model(name: &str, f: impl Fn() + Sync + Send + 'static) {
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = runs.clone();
    loom::model(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f();
    });
    eprintln!(
        "loom_model::{name}: {} interleavings",
        runs.load(std::sync::atomic::Ordering::Relaxed)
    );
}

use crate::breaker::{Breaker, BreakerConfig, CircuitState, Outcome};
use crate::RetryBudget;

/// A budget whose epochs are one second wide, and an instant at the start of an epoch.
fn budget(ratio: f64) -> (RetryBudget, Instant) {
    let budget = RetryBudget::builder()
        .ratio(ratio)
        .window(Duration::from_secs(10))
        .allowance(0)
        .build()
        .expect("valid budget");
    let t0 = budget.t0();
    (budget, t0)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Runs `withdrawals` concurrently, one thread each, at the given offsets from `t0`;
/// returns how many were granted.
fn race(budget: &RetryBudget, t0: Instant, offsets: &[u64]) -> usize {
    let handles: Vec<_> = offsets
        .iter()
        .map(|&offset| {
            let budget = budget.clone();
            thread::spawn(move || budget.try_withdraw(t0 + secs(offset)))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("no panic"))
        .filter(|granted| *granted)
        .count()
}

/// Runs `take` on `threads` threads at once, each with its own clone of `shared`;
/// returns how many took.
fn racing<T: Clone + Send + 'static>(shared: &T, threads: usize, take: fn(&T) -> bool) -> usize {
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let shared = shared.clone();
            thread::spawn(move || take(&shared))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("no panic"))
        .filter(|took| *took)
        .count()
}

/// The interleaving loom found in the old roll-over: one deposit, and withdrawals racing
/// across two bucket boundaries. One deposit at ratio 1 pays for one retry, whoever
/// moves the clock and in whichever order.
#[test]
fn budget_withdrawals_racing_across_boundaries() {
    model("budget_withdrawals_racing_across_boundaries", || {
        let (budget, t0) = budget(1.0);
        budget.deposit(t0);
        let granted = race(&budget, t0, &[1, 2, 0]);
        assert!(granted <= 1, "{granted} retries granted for one deposit");
        // A grant made by a thread that was overtaken is still seen afterwards.
        assert_eq!(budget.available(t0 + secs(2)), 1 - granted as u64);
    });
}

/// A jump of more than a window (every bucket emptied) racing a withdrawal in the
/// current epoch: whatever wins, the deposit pays for at most one retry, and none after
/// the jump.
#[test]
fn budget_jump_past_the_window_races_a_withdrawal() {
    model("budget_jump_past_the_window_races_a_withdrawal", || {
        let (budget, t0) = budget(1.0);
        budget.deposit(t0);
        let jumper = {
            let budget = budget.clone();
            thread::spawn(move || budget.try_withdraw(t0 + secs(25)))
        };
        let here = budget.try_withdraw(t0 + secs(1));
        let there = jumper.join().expect("no panic");
        assert!(!there || !here, "one deposit paid for two retries");
        assert_eq!(budget.available(t0 + secs(25)), 0);
    });
}

/// Deposits and withdrawals racing across a boundary: the grants never run ahead of the
/// deposits they could have seen (ratio 1, all in one window).
#[test]
fn budget_deposits_racing_withdrawals() {
    model("budget_deposits_racing_withdrawals", || {
        let (budget, t0) = budget(1.0);
        let depositor = {
            let budget = budget.clone();
            thread::spawn(move || {
                budget.deposit(t0 + secs(1));
                budget.try_withdraw(t0 + secs(1))
            })
        };
        let other = {
            let budget = budget.clone();
            thread::spawn(move || budget.try_withdraw(t0 + secs(2)))
        };
        let granted = [depositor, other]
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .filter(|granted| *granted)
            .count();
        assert!(granted <= 1, "{granted} retries granted for one deposit");
    });
}

/// A charge racing a roll-over that moves the window past it: the waste is carried into
/// the allowance whichever comes first, never lost with the bucket it landed in (ratio
/// 1, an allowance of 1: one deposit earns one retry, two were wasted, so the allowance
/// is spent; if the roll-over comes first, the charge counts in the new epoch, after the
/// deposit's earnings were carried, and leaves a debt of one).
#[test]
fn budget_charge_racing_the_carry_over() {
    model("budget_charge_racing_the_carry_over", || {
        let budget = RetryBudget::builder()
            .ratio(1.0)
            .window(Duration::from_secs(10))
            .allowance(1)
            .build()
            .expect("valid budget");
        let t0 = budget.t0();
        budget.deposit(t0);
        let roller = {
            let budget = budget.clone();
            thread::spawn(move || budget.available(t0 + secs(11)))
        };
        budget.charge(t0, 2);
        roller.join().expect("no panic");
        // Long after, the allowance is spent either way (a lost charge would leave it).
        let later = t0 + secs(40);
        assert_eq!(budget.available(later), 0, "the charge was lost");
        assert_eq!(budget.allowance_left(), 0);
    });
}

/// A breaker tripped by one failure, whose break of 5 s is over at `t0 + 5 s`.
fn tripped(probes: u32) -> (Arc<Breaker>, Instant) {
    let config = BreakerConfig::builder()
        .consecutive_failures(1)
        .break_duration(secs(5))
        .probes(probes)
        .jitter(0.0)
        .build()
        .expect("valid config");
    let breaker = Arc::new(Breaker::with_seed(config, 1));
    let t0 = Instant::now();
    let permit = breaker.try_acquire(t0).expect("closed");
    breaker.record(permit, Outcome::Failure, t0);
    assert_eq!(breaker.state(t0), CircuitState::Open);
    (breaker, t0 + secs(5))
}

/// Three callers find the break over at once: one of them turns the circuit half-open,
/// and exactly one probe is admitted.
#[test]
fn breaker_admits_one_probe_among_racing_callers() {
    model("breaker_admits_one_probe_among_racing_callers", || {
        let admitted = racing(&tripped(1), 3, |(breaker, later)| {
            breaker.try_acquire(*later).is_ok()
        });
        assert_eq!(admitted, 1);
    });
}

/// With two probe slots: one probe succeeds while two more callers race for the slots.
/// A success keeps its slot until the circuit closes, so at most two are ever admitted.
#[test]
fn breaker_probe_slots_with_a_success_racing() {
    model("breaker_probe_slots_with_a_success_racing", || {
        let (breaker, later) = tripped(2);
        let first = {
            let breaker = breaker.clone();
            thread::spawn(move || match breaker.try_acquire(later) {
                Ok(permit) => {
                    breaker.record(permit, Outcome::Success, later);
                    1
                }
                Err(_) => 0,
            })
        };
        let others: Vec<_> = (0..2)
            .map(|_| {
                let breaker = breaker.clone();
                thread::spawn(move || usize::from(breaker.try_acquire(later).is_ok()))
            })
            .collect();
        let admitted: usize = std::iter::once(first)
            .chain(others)
            .map(|h| h.join().expect("no panic"))
            .sum();
        assert!(admitted <= 2, "{admitted} probes for 2 slots");
        assert_ne!(breaker.state(later), CircuitState::Closed);
    });
}

/// A probe given back (its call was cancelled) frees its slot for one more caller, and
/// only one: the two callers that never give theirs back hold one slot between them.
#[test]
fn breaker_released_probe_frees_exactly_one_slot() {
    model("breaker_released_probe_frees_exactly_one_slot", || {
        let (breaker, later) = tripped(1);
        let releaser = {
            let breaker = breaker.clone();
            thread::spawn(move || {
                if let Ok(permit) = breaker.try_acquire(later) {
                    breaker.release(permit);
                }
            })
        };
        let holders: Vec<_> = (0..2)
            .map(|_| {
                let breaker = breaker.clone();
                thread::spawn(move || usize::from(breaker.try_acquire(later).is_ok()))
            })
            .collect();
        releaser.join().expect("no panic");
        let held: usize = holders
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .sum();
        assert!(held <= 1, "{held} probes held at once for 1 slot");
    });
}

/// A failed probe re-opens the circuit even while another caller takes a probe slot:
/// the slot's compare-and-swap may land between the failure's read of the circuit and
/// its own swap, which must then be tried again, not given up.
#[test]
fn breaker_failed_probe_reopens_while_a_slot_is_taken() {
    model("breaker_failed_probe_reopens_while_a_slot_is_taken", || {
        let (breaker, later) = tripped(2);
        let failing = breaker.try_acquire(later).expect("probe");
        let failer = {
            let breaker = breaker.clone();
            thread::spawn(move || {
                breaker.record(failing, Outcome::Failure, later);
            })
        };
        let taker = {
            let breaker = breaker.clone();
            thread::spawn(move || drop(breaker.try_acquire(later)))
        };
        failer.join().expect("no panic");
        taker.join().expect("no panic");
        assert_eq!(breaker.state(later), CircuitState::Open);
    });
}

/// The load limit's admission: three calls racing for the two places a limit of two
/// has get exactly two, whatever the interleaving, and every place comes back when the
/// permits are dropped (a place is never lost or counted twice).
#[test]
fn load_limit_admits_exactly_its_limit_to_racing_calls() {
    use crate::limit::LoadLimit;
    model(
        "load_limit_admits_exactly_its_limit_to_racing_calls",
        || {
            let limit = LoadLimit::builder()
                .min(1)
                .initial(2)
                .build()
                .expect("valid limit");
            let now = Instant::now();
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    let limit = limit.clone();
                    thread::spawn(move || limit.try_acquire(now).ok())
                })
                .collect();
            let mine = limit.try_acquire(now).ok();
            let mut permits: Vec<_> = handles
                .into_iter()
                .filter_map(|h| h.join().expect("no panic"))
                .collect();
            permits.extend(mine);
            assert_eq!(permits.len(), 2);
            assert_eq!(limit.in_flight(), 2);
            drop(permits);
            assert_eq!(limit.in_flight(), 0);
        },
    );
}
