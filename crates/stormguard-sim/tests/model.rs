//! What a user of the simulator relies on: every request gets one outcome, runs repeat
//! per seed, the numbers match probability where probability has an answer, and the
//! decisions are stormguard-core's own.

use std::time::Duration;

use stormguard_core::breaker::BreakerConfig;
use stormguard_sim::model::{run, FleetConfig, FleetReport, Scenario, Timeline};
use stormguard_sim::strategy::{BreakerMode, BudgetKind, Strategy, ALL};

fn fleet(clients: usize, seconds: f64, scenario: Scenario) -> FleetConfig {
    let mut cfg = FleetConfig::new(clients, seconds, 42);
    cfg.timeline = Timeline {
        scenario,
        start: seconds / 3.0,
        duration: seconds / 3.0,
    };
    cfg
}

fn strategy(name: &str) -> Strategy {
    Strategy::named(name, 3).expect("known strategy")
}

fn must(r: Result<FleetReport, String>) -> FleetReport {
    r.expect("valid configuration")
}

#[test]
fn every_request_gets_exactly_one_outcome() {
    let scenarios = [
        Scenario::Outage,
        Scenario::Partial(0.6),
        Scenario::Brownout(0.3),
        Scenario::LatencySpike(Duration::from_millis(1500)),
        Scenario::Overload(3.0),
    ];
    for scenario in scenarios {
        for name in ALL {
            for shared in [false, true] {
                let mut cfg = fleet(50, 12.0, scenario);
                cfg.shared = shared;
                let r = must(run(&cfg, &strategy(name)));
                assert!(r.offered > 500, "{name}: {}", r.offered);
                assert_eq!(r.offered, r.succeeded + r.failed, "{name} {scenario:?}");
                assert_eq!(r.offered, r.offered_per_s.iter().sum::<u64>());
                assert_eq!(r.succeeded, r.ok_by_arrival.iter().sum::<u64>());
                assert_eq!(r.succeeded, r.goodput_per_s.iter().sum::<u64>());
                assert_eq!(r.attempts, r.attempts_per_s.iter().sum::<u64>());
                // Every request made at least one attempt unless a breaker refused it or
                // the load control shed it.
                assert!(r.attempts + r.rejected + r.shed >= r.offered, "{name}");
                assert!(r.attempts <= 3 * r.offered, "{name}");
            }
        }
    }
}

#[test]
fn a_seed_determines_the_run() {
    // 2000 clients: each builds its own RetryBudget, whose clock origin is the real
    // instant it was built at; the run must not depend on it.
    let cfg = fleet(2000, 10.0, Scenario::Partial(0.5));
    for name in ["tower", "stormguard", "stormguard+breaker", "a6"] {
        let a = must(run(&cfg, &strategy(name)));
        let b = must(run(&cfg, &strategy(name)));
        assert_eq!(
            (a.offered, a.attempts, a.succeeded, &a.attempts_per_s),
            (b.offered, b.attempts, b.succeeded, &b.attempts_per_s),
            "{name}"
        );
        let mut other = cfg.clone();
        other.seed = 43;
        let c = must(run(&other, &strategy(name)));
        assert_ne!((a.offered, a.attempts), (c.offered, c.attempts), "{name}");
    }
}

#[test]
fn the_arrivals_are_the_same_for_every_strategy() {
    let cfg = fleet(100, 10.0, Scenario::Outage);
    let offered: Vec<Vec<u64>> = ALL
        .iter()
        .map(|n| must(run(&cfg, &strategy(n))).offered_per_s)
        .collect();
    assert!(offered.windows(2).all(|w| w[0] == w[1]));
}

/// A server of unlimited capacity whose every attempt fails with probability `p`.
fn partial_everywhere(p: f64, name: &str) -> FleetReport {
    let mut cfg = FleetConfig::new(10, 100.0, 9);
    cfg.rate = 400.0;
    cfg.workers = 0;
    cfg.timeline = Timeline {
        scenario: Scenario::Partial(p),
        start: 0.0,
        duration: f64::INFINITY,
    };
    must(run(&cfg, &strategy(name)))
}

/// |observed - expected| within four standard errors of a mean of `n` draws of a
/// variable with variance `var`.
fn close(observed: f64, expected: f64, var: f64, n: u64) -> bool {
    (observed - expected).abs() <= 4.0 * (var / n as f64).sqrt() + 1e-12
}

#[test]
fn without_retries_success_is_one_minus_p() {
    for p in [0.0, 0.1, 0.5, 0.9] {
        let r = partial_everywhere(p, "none");
        let success = r.succeeded as f64 / r.offered as f64;
        assert!(
            close(success, 1.0 - p, p * (1.0 - p), r.offered),
            "p {p}: {success}"
        );
        assert_eq!(r.attempts, r.offered);
    }
}

#[test]
fn independent_retries_cost_the_sum_of_powers_of_p() {
    for p in [0.1, 0.5, 0.8] {
        let r = partial_everywhere(p, "unlimited");
        let n = r.offered;
        let attempts = r.attempts as f64 / n as f64;
        let expected = 1.0 + p + p * p; // sum of p^k for k < 3
        let second_moment = 1.0 + 3.0 * p + 5.0 * p * p; // E[A^2], A in {1, 2, 3}
        assert!(
            close(attempts, expected, second_moment - expected * expected, n),
            "p {p}: {attempts} vs {expected}"
        );
        let success = r.succeeded as f64 / n as f64;
        let q = 1.0 - p.powi(3);
        assert!(
            close(success, q, q * (1.0 - q), n),
            "p {p}: {success} vs {q}"
        );
    }
}

#[test]
fn the_budget_is_the_cores_and_so_are_its_errors() {
    let mut s = strategy("stormguard");
    s.budget = BudgetKind::Core {
        ratio: 1.5,
        window: Duration::from_secs(10),
        allowance: 0,
    };
    let err = run(&fleet(10, 5.0, Scenario::Outage), &s).unwrap_err();
    assert_eq!(err, "invalid budget ratio: 1.5 (allowed: from 0.0 to 1.0)");
    s.budget = BudgetKind::A6 {
        max_tokens: 2000.0,
        token_ratio: 0.1,
    };
    let err = run(&fleet(10, 5.0, Scenario::Outage), &s).unwrap_err();
    assert!(err.starts_with("invalid max_tokens: 2000.0"), "{err}");

    // A shared core budget of 10% without an allowance, in a total outage from
    // the start: the retries are what RetryBudget admits, a tenth of the requests, and
    // at most one overdraft of the requests then in flight (each may spend its two
    // retries before the first of them is charged, and one more may take the last
    // retry of room), which is repaid.
    s.budget = BudgetKind::Core {
        ratio: 0.1,
        window: Duration::from_secs(10),
        allowance: 0,
    };
    let mut cfg = fleet(20, 30.0, Scenario::Outage);
    cfg.shared = true;
    cfg.timeline.start = 0.0;
    cfg.timeline.duration = 1e9;
    let r = must(run(&cfg, &s));
    let retries = r.attempts - r.offered;
    let overdraft = 2 * r.peak_in_flight as u64 + 2;
    assert!(
        (retries + overdraft) * 10 >= r.offered && retries * 10 <= r.offered + 10 * overdraft,
        "{retries} of {}, {} in flight at most",
        r.offered,
        r.peak_in_flight
    );
}

#[test]
fn a_fleet_of_new_clients_spends_its_allowance_once() {
    // 1000 brand-new clients at one request a second, each with its own default
    // budget, through a 30 s total outage from their very first request: each may
    // waste its allowance once, then 10% of its requests.
    let mut cfg = fleet(1000, 30.0, Scenario::Outage);
    cfg.timeline.start = 0.0;
    cfg.timeline.duration = 30.0;
    let r = must(run(&cfg, &strategy("stormguard")));
    let amp = r.amplification(0.0, 30.0);
    // The allowance (1) and 10% (3 of 30) make 1.13, plus what a request admitted may
    // overdraw (its last retry).
    assert!(amp <= 1.2, "amplification {amp:.3}");
    // ...and each did get to retry its first failures.
    assert!(amp >= 1.08, "amplification {amp:.3}");
}

#[test]
fn the_breaker_is_the_cores() {
    // One shared breaker that opens on the first failure for an hour: in an outage,
    // one attempt fails and every later request is refused without an attempt.
    let config = BreakerConfig::builder()
        .consecutive_failures(1)
        .break_duration(Duration::from_secs(3600))
        .max_break_duration(Duration::from_secs(3600))
        .jitter(0.0)
        .build()
        .expect("valid breaker");
    let mut s = strategy("none");
    s.breaker = BreakerMode::AllCalls(config);
    let mut cfg = fleet(20, 20.0, Scenario::Outage);
    cfg.shared = true;
    let r = must(run(&cfg, &s));
    // The outage starts at 6.67 s: what came before succeeded; then one attempt
    // failed (two at most, if a second went out in the millisecond before the answer).
    let failed_attempts = r.attempts - r.succeeded;
    assert!((1..=2).contains(&failed_attempts), "{failed_attempts}");
    assert_eq!(r.rejected, r.offered - r.attempts);
    assert_eq!(r.success(0.0, 6.0), 1.0);
    // The outage ends at 13.3 s, but the circuit stays open for its hour.
    assert_eq!(r.success(7.0, 20.0), 0.0);
    assert!(r.rejected > 200, "{}", r.rejected);
}

#[test]
fn memory_follows_requests_in_flight() {
    let r = must(run(
        &fleet(100, 30.0, Scenario::Healthy),
        &strategy("stormguard"),
    ));
    assert!(r.offered > 2500);
    assert!(
        r.slots <= 2 * r.peak_in_flight + 2,
        "{} slots, {}",
        r.slots,
        r.peak_in_flight
    );
    assert!(r.peak_in_flight * 20 < r.offered as usize);
}

#[test]
fn an_outage_is_seen_in_its_window_and_recovered_from() {
    let cfg = fleet(100, 30.0, Scenario::Outage);
    let none = must(run(&cfg, &strategy("none")));
    assert!(none.success(11.0, 19.0) == 0.0);
    assert!(none.success(21.0, 30.0) > 0.99);
    assert_eq!(none.recovery(10.0, 20.0, 30.0, 0.95), Some(0.0));
    let naive = must(run(&cfg, &strategy("naive")));
    assert!(naive.amplification(11.0, 19.0) > 2.9);
}

/// A fleet at `load` of its capacity, `scenario` from a third of `seconds` for a
/// sixth, every client's state shared or its own.
fn loaded(
    clients: usize,
    seconds: f64,
    load: f64,
    shared: bool,
    scenario: Scenario,
) -> FleetConfig {
    let mut cfg = FleetConfig::new(clients, seconds, 7);
    cfg.rate = cfg.capacity() * load;
    cfg.shared = shared;
    cfg.timeline = Timeline {
        scenario,
        start: (seconds / 3.0).floor(),
        duration: (seconds / 6.0).floor(),
    };
    cfg
}

#[test]
fn the_load_control_sheds_nothing_in_a_healthy_fleet() {
    // 10^5 requests at 80% of the capacity, one load control for the fleet (where its
    // limit binds first) or one a client.
    for shared in [true, false] {
        let cfg = loaded(1000, 84.0, 0.8, shared, Scenario::Healthy);
        let r = must(run(&cfg, &strategy("standard")));
        assert!(r.offered >= 100_000, "{}", r.offered);
        assert_eq!(r.shed, 0, "shared {shared}");
        assert_eq!(r.succeeded, r.offered, "shared {shared}");
    }
}

#[test]
fn a_small_client_s_load_control_never_binds() {
    // 1000 clients of 1 request a second each keep a call or two in flight: under the
    // limit's minimum (4), whatever the dependency does. Their rows are the standard
    // stack's without its load control.
    for scenario in [
        Scenario::Brownout(0.5),
        Scenario::Overload(3.0),
        Scenario::Outage,
    ] {
        let cfg = loaded(1000, 30.0, 0.67, false, scenario);
        let standard = must(run(&cfg, &strategy("standard")));
        let without = must(run(&cfg, &strategy("stormguard+breaker")));
        assert_eq!(standard.shed, 0, "{scenario:?}");
        assert_eq!(
            (standard.attempts, standard.succeeded),
            (without.attempts, without.succeeded),
            "{scenario:?}"
        );
    }
}

#[test]
fn a_load_control_whose_minimum_is_the_healthy_need_serves_a_brownout() {
    // The model's service times are exponential: no latency floor, so a window's
    // shortest latency is noise against the shortest ever seen (the docs' simulator
    // page). At the minimum examples/wide-latency.toml sets, no cut takes the limit
    // below what the fleet needs, the brownout's capacity goes to answers that are
    // waited for, and the limit lets go after it.
    let text = include_str!("../../../examples/wide-latency.toml");
    let settings = stormguard_core::config::Settings::from_toml(text).expect("the file parses");
    let (name, dependency) = settings.dependencies().next().expect("a dependency");
    let tuned = Strategy::from_settings(name, dependency).expect("valid settings");
    let cfg = loaded(1000, 60.0, 0.67, true, Scenario::Brownout(0.5));
    let window = (cfg.timeline.start, cfg.timeline.end());
    let r = must(run(&cfg, &tuned));
    let none = must(run(&cfg, &strategy("none")));
    assert!(
        r.success(window.0, window.1) > none.success(window.0, window.1) + 0.2,
        "{:.3} against {:.3}",
        r.success(window.0, window.1),
        none.success(window.0, window.1)
    );
    assert!(r.success(window.1, window.1 + 1.0) >= 0.99);
    assert!(r.success(window.1, cfg.seconds) >= 0.999);
}

#[test]
fn a_shared_load_control_at_the_defaults_serves_an_overload_at_capacity() {
    // The model's service times are exponential: no latency floor, so a window's
    // shortest latency reads above the floor by chance. The control undoes the cuts
    // that cost as much throughput as they took calls and learns that spread, so that
    // at the defaults it does not hold the fleet below what the dependency serves.
    let cfg = loaded(1000, 60.0, 0.67, true, Scenario::Overload(3.0));
    let (start, end) = (cfg.timeline.start, cfg.timeline.end());
    let capacity = cfg.capacity() * (end - start);
    let r = must(run(&cfg, &strategy("standard")));
    let goodput = r.goodput(start, end) / capacity;
    assert!(goodput >= 0.85, "goodput {goodput:.3} of the capacity");
    assert!(r.success(end, end + 1.0) >= 0.99);
    // Its brownout likewise: the capacity goes to answers that are waited for.
    let cfg = loaded(1000, 60.0, 0.67, true, Scenario::Brownout(0.5));
    let r = must(run(&cfg, &strategy("standard")));
    let none = must(run(&cfg, &strategy("none")));
    assert!(
        r.success(start, end) > none.success(start, end) + 0.2,
        "{:.3} against {:.3}",
        r.success(start, end),
        none.success(start, end)
    );
    assert!(r.success(end, end + 1.0) >= 0.99);
}
