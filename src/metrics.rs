//! Feature `metrics`: the series operators alert on, through the [`metrics`] facade.
//!
//! Every [`RetryPolicy`](crate::RetryPolicy), [`HedgePolicy`](crate::HedgePolicy),
//! [`CircuitBreaker`](crate::CircuitBreaker) and [`LoadControl`](crate::LoadControl)
//! reports under its dependency name (`.name("payments")` on the builders, `"default"`
//! otherwise) to whatever recorder the application installs
//! (`metrics-exporter-prometheus`, say):
//!
//! | series | kind | labels | what |
//! |---|---|---|---|
//! | `retry_attempts_total` | counter | `service`, `attempt_number` | attempts sent: 1 for first tries, 2, 3... for retries; a rise above 1 is dependency trouble |
//! | `retry_exhausted_total` | counter | `service` | requests that failed after every attempt allowed |
//! | `retry_give_ups_total` | counter | `service`, `reason` | every give-up, by [`GiveUp`] reason (`budget`, `circuit_open`, `deadline`...) |
//! | `retry_transparent_total` | counter | `service` | transparent retries (refused streams, drained connections) |
//! | `retry_budget_remaining` | gauge | `service` | whole retries of room in the budget (a request's first retry needs more than one, a later one any), as of the last failure (labelled with the budget's own name, `RetryBudget::builder().name("payments")`, if it has one, else the policy's) |
//! | `retry_budget_allowance` | gauge | `service` | whole retries of the allowance left (savings carried over; 0 while an overdraft is repaid), as of the last failure (labelled as above) |
//! | `retry_ratio` | gauge | `service` | wasted retries (retries that failed, and timeouts) per original request over the budget's window, what the budget bounds, as of the last failure (labelled as above) |
//! | `retry_delay_seconds` | histogram | `service` | the wait before each retry |
//! | `retry_retries_per_call` | histogram | `service` | retries each call took (gRFC A45's per-call view) |
//! | `hedge_sent_total` | counter | `service` | hedges sent (the hedge policy's name, `HedgePolicy::builder().name(..)`, or the retry policy's it shares a budget with) |
//! | `hedge_won_total` | counter | `service` | hedged requests a hedge's response won |
//! | `hedge_cancelled_total` | counter | `service` | copies dropped once another copy won (the losers' load, wasted) |
//! | `hedge_budget_refused_total` | counter | `service` | hedges the budget refused |
//! | `circuit_breaker_state` | gauge | `dependency` | 0 closed, 1 half-open, 2 open, 3 isolated |
//! | `circuit_breaker_transitions_total` | counter | `dependency`, `from`, `to` | every state change |
//! | `load_control_shed_total` | counter | `service` | calls a [`LoadControl`](crate::LoadControl) shed: never sent, failed with [`Shed`](crate::Shed) |
//!
//! Handles are registered with the recorder the first time a policy or breaker is used
//! (a hedge policy's, at its first hedge event, all four together), so install the
//! recorder before the first request: handles bind to the recorder installed then.
//! A series therefore appears with its first event, not at 0: Prometheus's first sample
//! of it is already above 0, and `increase()` counts from that sample (what came before
//! it shows in the counter itself). `tests/prometheus.rs` in the repository runs a real
//! Prometheus against the metrics example and checks both. Without a recorder every update is
//! a call into `metrics`' no-op recorder; without the feature nothing of this is compiled.
//! The budget gauges are refreshed on the failure path (each retry and give-up) and at
//! each of the budget's roll-overs (once per tenth of its window at most, on whichever
//! call moves its clock, successes included): after a recovery they are current within
//! a tenth of the window, and the calls between roll-overs read nothing for them.
//!
//! Cardinality, per dependency name: `retry_attempts_total` one series per attempt
//! number, bounded by the attempt cap (the policy's `max_attempts`, at most 100, or a
//! gRPC method's, at most 5); `retry_give_ups_total` one per reason (11); the breaker's
//! state one series and its transitions at most 12 (the ordered pairs of its four states);
//! every other series one. Nothing is labelled by request, path or status.
//!
//! # What it costs
//!
//! With no recorder installed the feature's cost is below what benchmark runs resolve: the
//! retry path updates one counter and one histogram per call, and the breaker records
//! nothing on the success path. The measured figures are in the performance page of the
//! guide (docs/performance.md in the repository).
//!
//! # A scrape
//!
//! `cargo run --example metrics --features metrics` installs
//! `metrics-exporter-prometheus`, sends requests to a dependency on 127.0.0.1 that fails
//! its first ones, scrapes its own `/metrics` over HTTP and prints the stormguard series;
//! `tests/metrics.rs` in the repository scrapes the same way and checks the series.
//!
//! # Alert rules
//!
//! `contrib/prometheus/stormguard-rules.yml` in the repository holds recording rules (the
//! retry ratio, the budget's use, give-ups per reason) and four alerts over these
//! series: requests giving up faster than one a second (`exhausted` or `budget`),
//! wasted retries above the budget's 10% for ten minutes (a retry ratio above 10% is
//! legitimate while the retries succeed: the alert is on `retry_ratio`, the waste), a
//! budget spent and refusing, and a circuit refusing calls for a minute. CI runs
//! `promtool check rules` on them and `promtool test rules` on their unit tests
//! (`stormguard-rules.test.yml`), whose input series `tests/metrics.rs` checks against
//! the metrics example's own scrape, so that renaming a series or a label fails a test.
//! `contrib/grafana/stormguard.json` is a Grafana dashboard over the same series (attempts
//! by number, retries per first try, give-ups by reason, the budget's gauges, waits, the
//! breaker's state and transitions); the same test checks that every series it queries,
//! and every label its selectors name, is in that scrape.

use std::sync::OnceLock;

use metrics::{Counter, Gauge, Histogram};
use stormguard_core::CircuitState;

use crate::give_up::GiveUp;

/// The reasons in label order; `GiveUp::index` maps into it.
const REASONS: [GiveUp; 11] = [
    GiveUp::Exhausted,
    GiveUp::Permanent,
    GiveUp::Budget,
    GiveUp::NotIdempotent,
    GiveUp::RetryAfterTooLong,
    GiveUp::BodyNotReplayable,
    GiveUp::Pushback,
    GiveUp::CircuitOpen,
    GiveUp::Deadline,
    GiveUp::DontRetry,
    GiveUp::Shed,
];

/// A retry policy's handles, registered on first use.
#[derive(Debug)]
pub(crate) struct RetryMetrics {
    handles: OnceLock<RetryHandles>,
    /// The most attempts any request can make: one counter per attempt number.
    max_attempts: u32,
    /// The budget's own name, when it has one: the label of its gauges.
    budget: Option<String>,
}

#[derive(Debug)]
struct RetryHandles {
    attempts: Vec<Counter>,
    exhausted: Counter,
    give_ups: Vec<Counter>,
    transparent: Counter,
    budget_remaining: Gauge,
    allowance: Gauge,
    ratio: Gauge,
    delay: Histogram,
    retries_per_call: Histogram,
}

impl RetryMetrics {
    /// Handles for a policy drawing from a budget named `budget`, if it is.
    /// Up to `max_attempts` per request (the policy's, or a gRPC method's if larger).
    pub(crate) fn new(max_attempts: u32, budget: Option<&str>) -> Self {
        RetryMetrics {
            handles: OnceLock::new(),
            max_attempts,
            budget: budget.map(str::to_owned),
        }
    }

    fn handles(&self, service: &str) -> &RetryHandles {
        self.handles.get_or_init(|| {
            let service = service.to_owned();
            let budget = self.budget.clone().unwrap_or_else(|| service.clone());
            RetryHandles {
                attempts: (1..=self.max_attempts)
                    .map(|n| {
                        metrics::counter!("retry_attempts_total",
                            "service" => service.clone(), "attempt_number" => n.to_string())
                    })
                    .collect(),
                exhausted: metrics::counter!("retry_exhausted_total", "service" => service.clone()),
                give_ups: REASONS
                    .iter()
                    .map(|why| {
                        metrics::counter!("retry_give_ups_total",
                            "service" => service.clone(), "reason" => why.as_str())
                    })
                    .collect(),
                transparent: metrics::counter!("retry_transparent_total", "service" => service.clone()),
                budget_remaining: metrics::gauge!("retry_budget_remaining", "service" => budget.clone()),
                allowance: metrics::gauge!("retry_budget_allowance", "service" => budget.clone()),
                ratio: metrics::gauge!("retry_ratio", "service" => budget),
                delay: metrics::histogram!("retry_delay_seconds", "service" => service.clone()),
                retries_per_call: metrics::histogram!("retry_retries_per_call", "service" => service),
            }
        })
    }

    /// Attempt number `n` (1 for a first try) was sent.
    pub(crate) fn attempt(&self, service: &str, n: u32) {
        let handles = self.handles(service);
        let index = usize::try_from(n.saturating_sub(1)).unwrap_or(usize::MAX);
        if let Some(counter) = handles.attempts.get(index) {
            counter.increment(1);
        }
    }

    /// A retry was scheduled after `delay`; `budget` is the budget's state.
    pub(crate) fn retry(&self, service: &str, delay: std::time::Duration, budget: BudgetView) {
        let handles = self.handles(service);
        handles.delay.record(delay.as_secs_f64());
        handles.set_budget(budget);
    }

    /// A transparent retry was made.
    pub(crate) fn transparent(&self, service: &str) {
        self.handles(service).transparent.increment(1);
    }

    /// The layer gave up for `why`.
    pub(crate) fn give_up(&self, service: &str, why: GiveUp, budget: BudgetView) {
        let handles = self.handles(service);
        if let Some(i) = REASONS.iter().position(|r| *r == why) {
            if let Some(counter) = handles.give_ups.get(i) {
                counter.increment(1);
            }
        }
        if why == GiveUp::Exhausted {
            handles.exhausted.increment(1);
        }
        handles.set_budget(budget);
    }

    /// A call ended after `retries` retries.
    pub(crate) fn call_ended(&self, service: &str, retries: u32) {
        self.handles(service)
            .retries_per_call
            .record(f64::from(retries));
    }
}

/// The budget as its gauges show it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BudgetView {
    /// Whole retries of room in the budget.
    pub(crate) remaining: u64,
    /// Whole retries of the allowance left.
    pub(crate) allowance: u64,
    /// Wasted retries per original request over the window.
    pub(crate) ratio: f64,
}

/// Keeps `budget`'s gauges current at each of its roll-overs (at most once per tenth of
/// its window, on whatever call moves its clock, successes included), labelled `label`:
/// the budget's own name, else the name of the first policy built over it. Registered
/// at the first roll-over, with the recorder installed then.
pub(crate) fn watch_budget(budget: &stormguard_core::RetryBudget, label: &str) {
    let label = label.to_owned();
    let gauges: OnceLock<(Gauge, Gauge, Gauge)> = OnceLock::new();
    // A budget already watched (shared by several policies) keeps its first label.
    let _ = budget.on_roll_over(move |state: stormguard_core::budget::Snapshot| {
        let (remaining, allowance, ratio) = gauges.get_or_init(|| {
            (
                metrics::gauge!("retry_budget_remaining", "service" => label.clone()),
                metrics::gauge!("retry_budget_allowance", "service" => label.clone()),
                metrics::gauge!("retry_ratio", "service" => label.clone()),
            )
        });
        remaining.set(state.remaining as f64);
        allowance.set(state.allowance as f64);
        ratio.set(if state.requests == 0 {
            0.0
        } else {
            state.wasted as f64 / state.requests as f64
        });
    });
}

impl RetryHandles {
    fn set_budget(&self, budget: BudgetView) {
        self.budget_remaining.set(budget.remaining as f64);
        self.allowance.set(budget.allowance as f64);
        self.ratio.set(budget.ratio);
    }
}

/// A breaker's handles: its state gauge, registered on first use.
/// A hedge policy's series, registered at its first hedge.
#[derive(Debug, Default)]
pub(crate) struct HedgeMetrics {
    handles: OnceLock<HedgeHandles>,
}

#[derive(Debug)]
struct HedgeHandles {
    sent: Counter,
    won: Counter,
    cancelled: Counter,
    budget_refused: Counter,
}

impl HedgeMetrics {
    /// Hedges sent.
    pub(crate) fn sent(&self, service: &str, n: u64) {
        self.add(service, n, |h| &h.sent);
    }

    /// Hedges whose response won.
    pub(crate) fn won(&self, service: &str, n: u64) {
        self.add(service, n, |h| &h.won);
    }

    /// Copies dropped once another won.
    pub(crate) fn cancelled(&self, service: &str, n: u64) {
        self.add(service, n, |h| &h.cancelled);
    }

    /// Hedges the budget refused.
    pub(crate) fn budget_refused(&self, service: &str, n: u64) {
        self.add(service, n, |h| &h.budget_refused);
    }

    fn add(&self, service: &str, n: u64, counter: impl FnOnce(&HedgeHandles) -> &Counter) {
        if n == 0 {
            return;
        }
        let handles = self.handles.get_or_init(|| {
            let service = service.to_owned();
            HedgeHandles {
                sent: metrics::counter!("hedge_sent_total", "service" => service.clone()),
                won: metrics::counter!("hedge_won_total", "service" => service.clone()),
                cancelled: metrics::counter!("hedge_cancelled_total", "service" => service.clone()),
                budget_refused: metrics::counter!("hedge_budget_refused_total", "service" => service),
            }
        });
        counter(handles).increment(n);
    }
}

#[derive(Debug, Default)]
pub(crate) struct BreakerMetrics {
    state: OnceLock<Gauge>,
}

impl BreakerMetrics {
    /// The breaker went `from` -> `to`.
    pub(crate) fn transition(&self, dependency: &str, from: CircuitState, to: CircuitState) {
        self.state
            .get_or_init(
                || metrics::gauge!("circuit_breaker_state", "dependency" => dependency.to_owned()),
            )
            .set(state_value(to));
        // Transitions are rare: the counter is looked up each time.
        metrics::counter!("circuit_breaker_transitions_total",
            "dependency" => dependency.to_owned(),
            "from" => state_label(from),
            "to" => state_label(to))
        .increment(1);
    }
}

fn state_value(state: CircuitState) -> f64 {
    match state {
        CircuitState::Closed => 0.0,
        CircuitState::HalfOpen => 1.0,
        CircuitState::Open => 2.0,
        CircuitState::Isolated => 3.0,
    }
}

fn state_label(state: CircuitState) -> &'static str {
    match state {
        CircuitState::Closed => "closed",
        CircuitState::HalfOpen => "half_open",
        CircuitState::Open => "open",
        CircuitState::Isolated => "isolated",
    }
}
