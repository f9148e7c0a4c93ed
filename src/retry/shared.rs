//! What every clone of a policy shares: the settings, and what observes the decisions
//! (the counters, the metrics, the traces, the signals): the one place the retry's
//! decisions are recorded.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response};
use stormguard_core::classify::{grpc_status, Rules};
use stormguard_core::methods::MethodTable;
use stormguard_core::throttle::RetryThrottle;
use stormguard_core::{Backoff, Class, RetryBudget};

use super::policy::Limits;
use super::NoRetry;
use crate::give_up::GiveUp;

/// Counters of what a [`RetryPolicy`](super::RetryPolicy) (and all its clones) did, read with
/// [`RetryPolicy::stats`](super::RetryPolicy::stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RetryStats {
    /// Original requests.
    pub requests: u64,
    /// Retries sent.
    pub retries: u64,
    /// Requests that failed after every attempt allowed.
    pub exhausted: u64,
    /// Retries refused by the budget.
    pub budget_denied: u64,
    /// Failures returned at once as permanent.
    pub permanent: u64,
    /// Retries not made because the body could not be replayed.
    pub not_replayable: u64,
    /// Retries not made because the request was not idempotent.
    pub not_idempotent: u64,
    /// Retries not made because the server asked for too long a wait or for none
    /// (`grpc-retry-pushback-ms`, `x-no-retry`).
    pub server_refused: u64,
    /// Retries not made because their wait would have ended past the request's
    /// deadline.
    pub deadline: u64,
    /// Transparent retries: requests the server refused before its application saw
    /// them, sent again at once without spending an attempt or budget.
    pub transparent_retries: u64,
    /// Requests a rate limiter throttled whose retry the gate of throttled retries did
    /// not let through (no slot at the rate the server accepts within one more of its
    /// wait): the throttling answer was handed back.
    pub throttled: u64,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) requests: AtomicU64,
    pub(super) retries: AtomicU64,
    pub(super) exhausted: AtomicU64,
    pub(super) budget_denied: AtomicU64,
    pub(super) permanent: AtomicU64,
    pub(super) not_replayable: AtomicU64,
    pub(super) not_idempotent: AtomicU64,
    pub(super) server_refused: AtomicU64,
    pub(super) deadline: AtomicU64,
    pub(super) transparent_retries: AtomicU64,
    pub(super) throttled: AtomicU64,
}

pub(super) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

#[derive(Debug)]
pub(super) struct Shared {
    /// The dependency's name, the `service` label of the metrics.
    pub(super) name: String,
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) budget: RetryBudget,
    pub(super) throttle: Option<RetryThrottle>,
    /// The pace of the dependency's throttled retries (429, `RESOURCE_EXHAUSTED`).
    pub(super) pace: stormguard_core::retry::ThrottlePace,
    pub(super) rules: Rules,
    /// The classifiers asked before the rules, and the error types named to the policy.
    pub(super) classifiers: crate::classify::Classifiers,
    /// Whether an error of a type that cannot be looked into was warned of.
    pub(super) warned_opaque: std::sync::atomic::AtomicBool,
    /// Per-method limits of a gRPC service config, looked up by `:path` on failure
    /// (`None`: the method has no retry policy).
    pub(super) methods: Option<MethodTable<Option<Limits>>>,
    /// gRPC per-method timeouts, when the policy has them: a call's deadline.
    pub(super) timeouts: Option<MethodTable<Option<std::time::Duration>>>,
    pub(super) max_retry_after: Duration,
    pub(super) max_replay_bytes: usize,
    pub(super) seed: Option<u64>,
    pub(super) next_stream: AtomicU64,
    pub(super) counters: Counters,
    #[cfg(feature = "metrics")]
    pub(super) metrics: crate::metrics::RetryMetrics,
}

impl Shared {
    /// What the policy's decisions at `now` are made with: the shared budget,
    /// throttle and gate, the request's `deadline`; no seed for the request's random
    /// stream (the decision that first draws sets one).
    pub(super) fn env(
        &self,
        now: Instant,
        deadline: Option<stormguard_core::deadline::Deadline>,
    ) -> stormguard_core::retry::Env<'_> {
        stormguard_core::retry::Env {
            now,
            budget: Some(&self.budget),
            throttle: self.throttle.as_ref(),
            pace: Some(&self.pace),
            max_retry_after: self.max_retry_after,
            deadline,
            seed: None,
        }
    }

    /// Records a request's first send at `now` (counted, paid into the budget), and
    /// says whether a copy is worth keeping: not for a request marked [`NoRetry`],
    /// which is sent once whatever happens.
    pub(super) fn first_send<B>(&self, req: &Request<B>, now: Instant) -> bool {
        bump(&self.counters.requests);
        #[cfg(feature = "metrics")]
        self.metrics.attempt(&self.name, 1);
        self.budget.deposit(now);
        req.extensions().get::<NoRetry>().is_none()
    }

    /// Says, once per policy, that an error of the type `E` cannot be looked into and is
    /// not retried (see [`crate::classify`]).
    #[cold]
    pub(super) fn opaque_error<E>(&self) {
        if !self.warned_opaque.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                dependency = %self.name,
                error_type = std::any::type_name::<E>(),
                "an error of this type cannot be looked into and is not retried: box it, or \
                 name it with RetryPolicyBuilder::error_type, or classify it"
            );
        }
    }

    /// gRFC A6: every answer of the server moves the throttle's token count (a
    /// transport error is not the server's answer, and does not).
    pub(super) fn record_outcome(&self, class: Class, answered: bool) {
        if let Some(throttle) = &self.throttle {
            match class {
                Class::Success => throttle.record_success(),
                Class::Retryable { .. } | Class::DontRetry if answered => throttle.record_failure(),
                _ => {}
            }
        }
    }

    /// A transparent retry of a request that made `attempts` attempts: counted,
    /// measured and traced.
    pub(super) fn retried_transparently(&self, attempts: u32) {
        bump(&self.counters.transparent_retries);
        #[cfg(feature = "metrics")]
        self.metrics.transparent(&self.name);
        tracing::debug!(
            target: "stormguard::retry",
            attempt = attempts + 1,
            delay_ms = 0u64,
            reason = "transparent",
            "retrying"
        );
    }

    /// A call the circuit refused, asked again after `delay` (`probe`: a first call's
    /// wait for the probe's verdict): traced.
    pub(super) fn waits_for_circuit(&self, attempts: u32, delay: Duration, probe: bool) {
        tracing::debug!(
            target: "stormguard::retry",
            attempt = attempts + 1,
            delay_ms = millis(delay),
            reason = "circuit_open",
            "{}",
            if probe { "waiting for the probe" } else { "waiting out the break" }
        );
    }

    /// A retry after `attempts` attempts, in `delay`, of a call that failed with an
    /// answer (`status`) or an error: counted, measured and traced.
    pub(super) fn retried(&self, attempts: u32, delay: Duration, status: Option<u16>) {
        bump(&self.counters.retries);
        #[cfg(feature = "metrics")]
        {
            self.metrics.attempt(&self.name, attempts + 1);
            self.metrics.retry(&self.name, delay, self.budget_view());
        }
        tracing::info!(
            target: "stormguard::retry",
            attempt = attempts + 1,
            delay_ms = millis(delay),
            reason = if status.is_some() { "status" } else { "error" },
            status,
            "retrying"
        );
    }

    /// A request that gave up after `attempts` attempts: counted, measured, traced and
    /// told to the signals.
    pub(super) fn gave_up(&self, why: GiveUp, attempts: u32) {
        #[cfg(feature = "metrics")]
        self.metrics.give_up(&self.name, why, self.budget_view());
        let c = &self.counters;
        match why {
            GiveUp::Exhausted => bump(&c.exhausted),
            GiveUp::Permanent => bump(&c.permanent),
            GiveUp::Budget => bump(&c.budget_denied),
            GiveUp::NotIdempotent => bump(&c.not_idempotent),
            GiveUp::BodyNotReplayable => bump(&c.not_replayable),
            GiveUp::RetryAfterTooLong | GiveUp::Pushback | GiveUp::DontRetry => {
                bump(&c.server_refused)
            }
            GiveUp::Deadline => bump(&c.deadline),
            GiveUp::Throttled => bump(&c.throttled),
            // A circuit's refusal is counted by the breaker, a shed call by the load
            // limit; a reason added later, by none of the counters above.
            _ => {}
        }
        crate::signals::record_give_up(why);
        match why {
            GiveUp::Permanent => {
                tracing::debug!(target: "stormguard::retry", attempts, reason = why.as_str(), "giving up")
            }
            _ => {
                tracing::info!(target: "stormguard::retry", attempts, reason = why.as_str(), "giving up")
            }
        }
    }

    /// The budget as the metrics show it.
    #[cfg(feature = "metrics")]
    fn budget_view(&self) -> crate::metrics::BudgetView {
        let now = tokio::time::Instant::now().into_std();
        let budget = &self.budget;
        let (requests, wasted) = budget.usage(now);
        let ratio = if requests == 0 {
            0.0
        } else {
            wasted as f64 / requests as f64
        };
        crate::metrics::BudgetView {
            remaining: budget.available(now),
            allowance: budget.allowance_left(),
            ratio,
        }
    }

    /// Whether `res` is a success whatever the request, and the user's classifiers keep
    /// it: nothing else about the request or the response matters.
    pub(super) fn is_plain_success<B>(&self, res: &Response<B>) -> bool {
        plain_success(res) && self.classifiers.keeps_success(res.status(), res.headers())
    }

    /// A request served by its first attempt before the layer made it a policy of its
    /// own: what the policy records of a success at attempt 1 (the budget has nothing to
    /// settle, nothing was withdrawn), with no clock read unless throttled retries are
    /// being paced.
    pub(super) fn served_first_time(&self) {
        self.record_outcome(Class::Success, true);
        self.pace
            .accepted_with(|| tokio::time::Instant::now().into_std());
        self.call_ended(1);
    }

    /// A request's outcome handed back after `attempts` attempts, for the metrics.
    pub(super) fn call_ended(&self, attempts: u32) {
        #[cfg(feature = "metrics")]
        self.metrics
            .call_ended(&self.name, attempts.saturating_sub(1));
        #[cfg(not(feature = "metrics"))]
        let _ = attempts;
    }
}

/// `delay` in whole milliseconds, for the traces.
fn millis(delay: Duration) -> u64 {
    u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)
}

/// Whether `res` is a success whatever the request: a 2xx without `grpc-status` is one
/// to the gRPC rules and the HTTP rules alike.
fn plain_success<B>(res: &Response<B>) -> bool {
    res.status().is_success() && grpc_status(res.headers()).is_none()
}
