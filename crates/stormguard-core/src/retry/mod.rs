//! One request's retries, decided: the state machine every driver of a retry runs.
//!
//! A [`RequestRetry`] is made for each request and told the outcome of each of its calls
//! ([`Attempt`]): what the server answered, as classified, or what is known of a failure
//! (never sent, refused unprocessed, maybe processed, refused by a circuit breaker). It
//! answers with a [`Decision`]: hand the outcome back (and why, if the request gave
//! up), or send the request again, at once or after a wait. It keeps the request's
//! attempts, its free calls (the one transparent retry, the waits for a probe's
//! verdict), the refusals of its retries it waited out and the retries the budget
//! admitted, and it settles them with the [`RetryBudget`] when the request ends. It
//! never reads a clock: each call is given `now` ([`Env`]).
//!
//! stormguard's retry layer, its reqwest middleware and the fleet simulator drive this one
//! machine; the drivers classify outcomes and send requests, and decide nothing.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use stormguard_core::retry::{Attempt, Decision, Env, Request, RequestRetry};
//! use stormguard_core::{Backoff, Class, Jitter, RetryBudget};
//!
//! let budget = RetryBudget::default();
//! let now = Instant::now();
//! budget.deposit(now);
//! let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1), Jitter::Full)?;
//! let request = Request::new(3, backoff);
//! let mut retry = RequestRetry::new();
//! let mut env = Env::new(now, &budget);
//! // A 503: retried after a backoff, on the budget's allowance.
//! let decided = retry.decide(&mut env, &request, Attempt::Answered {
//!     throttled: false,
//!     class: Class::Retryable { after: None },
//!     any_method: false,
//! });
//! assert!(matches!(decided.decision, Decision::Retry { attempts: 1, .. }));
//! // Then a success: handed back, after two attempts.
//! let decided = retry.decide(&mut env, &request, Attempt::Answered {
//!     throttled: false,
//!     class: Class::Success,
//!     any_method: false,
//! });
//! assert_eq!(decided.decision, Decision::Done { attempts: 2, give_up: None });
//! # Ok::<(), stormguard_core::ConfigError>(())
//! ```

mod give_up;
mod throttled;

use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use crate::breaker::{self, CircuitState};
use crate::deadline::Deadline;
use crate::methods::MAX_ATTEMPTS as GRPC_MAX_ATTEMPTS;
use crate::throttle::RetryThrottle;
use crate::{Backoff, Class, RetryBudget, Schedule};

pub use give_up::GiveUp;
pub use throttled::{Gate, ThrottlePace, ARMED_FOR, GATE_CUT, GATE_START, KNOWN, THROTTLE_BASE};

/// What is known of one call of a request, as its driver classified it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attempt {
    /// The server answered. `any_method`: the answer says the request may be sent again
    /// whatever its method (a gRPC code the configuration calls retryable, gRFC A6).
    Answered {
        /// Whether the answer was a rate limiter's (429, `RESOURCE_EXHAUSTED`): its
        /// retry waits from [`THROTTLE_BASE`] and is then let through by the
        /// [`ThrottlePace`] ([`RequestRetry::release`]).
        throttled: bool,
        /// The answer, classified.
        class: Class,
        /// Whether a retryable answer allows a retry whatever the request's method.
        any_method: bool,
    },
    /// The call failed, and it is proved that the request never reached the server's
    /// application (refused unprocessed, never written): worth one free, immediate
    /// retry (a transparent retry, gRFC A6), then taken as [`Attempt::NotSent`].
    Unprocessed,
    /// The call failed before reaching the application, but the dependency may be down
    /// (the connection was refused): an ordinary retry, whatever the method.
    NotSent,
    /// The call failed after which the request may have been processed (a reset, a
    /// timeout): an ordinary retry if the request may be repeated. `timed_out`: the
    /// server may have worked on it for nobody all the while, and it is charged more.
    MaybeProcessed {
        /// Whether the call timed out.
        timed_out: bool,
    },
    /// The call failed for a reason a retry will not change (the caller's own doing, or
    /// nothing recognised).
    Permanent,
    /// A circuit breaker refused the call: it never left the client. `None` for an
    /// isolated circuit, which stays open until reset.
    Refused(Option<Refusal>),
    /// The load control shed the call: it was never sent, and it is not retried.
    Shed,
}

/// What a circuit breaker's refusal says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// How long until the circuit lets a probe through.
    pub remaining: Duration,
    /// How long the circuit has been away from Closed.
    pub open_for: Duration,
    /// How long the dependency has been failing, as the breaker saw it
    /// ([`breaker::Rejected::failing_for`]).
    pub failing_for: Duration,
    /// The break the circuit is in.
    pub break_duration: Duration,
    /// The circuit's state when it refused.
    pub state: CircuitState,
}

/// What one request allows, as its driver knows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// Calls at most, the first included.
    pub max_attempts: u32,
    /// The waits between them.
    pub backoff: Backoff,
    /// Whether the request may be sent again whatever the failure: an idempotent
    /// method, an `Idempotency-Key`, or the caller's say-so.
    pub may_repeat: bool,
    /// Whether its body can be sent again.
    pub replayable: bool,
    /// Whether it is a gRPC call: at most five attempts (gRFC A6), and a server's
    /// pushback is waited exactly, with the backoff started over.
    pub grpc: bool,
    /// Whether the request must be sent once only (an upstream asked so).
    pub once: bool,
}

impl Request {
    /// A request with these limits that may be repeated, whose body can be sent again.
    pub fn new(max_attempts: u32, backoff: Backoff) -> Self {
        Request {
            max_attempts,
            backoff,
            may_repeat: true,
            replayable: true,
            grpc: false,
            once: false,
        }
    }
}

/// What a decision is made with: the time, the shared budget and throttle, and the
/// request's deadline and random stream.
#[allow(missing_debug_implementations)]
pub struct Env<'a> {
    /// The time of the decision.
    pub now: Instant,
    /// The retry budget shared by the dependency's requests (`None`: retries are bounded
    /// by each request's attempts alone).
    pub budget: Option<&'a RetryBudget>,
    /// gRPC's retry throttle, when the service config has one.
    pub throttle: Option<&'a RetryThrottle>,
    /// The gate of the dependency's throttled retries (`None`: each waits its own
    /// `Retry-After` or [`THROTTLE_BASE`] alone, and goes).
    pub pace: Option<&'a ThrottlePace>,
    /// The longest server hint waited for; a longer one gives up.
    pub max_retry_after: Duration,
    /// When the caller stops waiting, if it does.
    pub deadline: Option<Deadline>,
    /// Gives the seed of the request's random stream, asked at its first draw; without
    /// it, or when it gives `None`, the stream is seeded from the thread's generator.
    pub seed: Option<&'a mut (dyn FnMut() -> Option<u64> + 'a)>,
}

impl<'a> Env<'a> {
    /// An environment at `now` with `budget`, no throttle, no deadline, server hints
    /// waited up to 20 s, and an unseeded random stream.
    pub fn new(now: Instant, budget: &'a RetryBudget) -> Self {
        Env {
            now,
            budget: Some(budget),
            throttle: None,
            pace: None,
            max_retry_after: Duration::from_secs(20),
            deadline: None,
            seed: None,
        }
    }

    /// Whether a call sent `delay` from now would start past the deadline.
    fn outlasts_deadline(&self, delay: Duration) -> bool {
        self.deadline.is_some_and(|d| !d.allows(self.now, delay))
    }

    /// How long from now a call may still start, if there is a deadline: strictly
    /// before it.
    fn left_to_start(&self) -> Option<Duration> {
        self.deadline.map(|deadline| {
            deadline
                .remaining(self.now)
                .saturating_sub(Duration::from_nanos(1))
        })
    }
}

/// How a request is sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Hand the outcome back: the request took `attempts` calls, and gave up for
    /// `give_up` (`None`: it was served, or the outcome is final by its nature).
    Done {
        /// Calls made, the last included.
        attempts: u32,
        /// Why the request stopped short of success, if it did.
        give_up: Option<GiveUp>,
    },
    /// Send it again at once, free: the server refused it unprocessed. Not an attempt,
    /// nothing asked of the budget.
    Transparent {
        /// Attempts made so far.
        attempts: u32,
    },
    /// Ask the circuit again after `delay`: the call never left the client, so it is no
    /// attempt. `probe`: a first call waiting for the probe's verdict.
    Refused {
        /// The wait.
        delay: Duration,
        /// Attempts made so far.
        attempts: u32,
        /// Whether it is a first call's one wait for the probe.
        probe: bool,
    },
    /// Retry after `delay`, admitted by the budget.
    Retry {
        /// The wait.
        delay: Duration,
        /// Attempts made so far.
        attempts: u32,
    },
}

/// A [`Decision`], and the attempt it counted, if any (with the class its outcome was
/// taken as), for the driver's statistics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decided {
    /// What to do.
    pub decision: Decision,
    /// The call counted as an attempt, and its class; `None` for a call that was not
    /// one (refused by the circuit, or by the server unprocessed).
    pub counted: Option<Class>,
}

/// One request's retries: see the [module docs](self).
#[derive(Debug, Clone, Default)]
pub struct RequestRetry {
    attempts: u32,
    /// The one transparent retry was made.
    transparent: bool,
    /// How long the first call waited for a probe's verdict, in microseconds, rounded
    /// up (a wait of none counts 1: zero is no wait yet): one wait at a break's end, and
    /// more while it then meets a probe still deciding (see `refused`), together no
    /// longer than the first backoff's ceiling, and none after about 71 minutes, where
    /// the count saturates. Four bytes, where the fields above leave room.
    probe_waited_us: u32,
    /// Refusals of this request's retries waited out: at most as many as its retries.
    refusals: u8,
    /// Retries admitted by the budget and not yet settled (attempts are capped at 100).
    admitted: u8,
    /// A call timed out and is not yet charged for it: charged once its own retry is
    /// decided.
    expensive_pending: bool,
    /// A retry of a throttling answer waits for the gate: it may go until then.
    gated_until: Option<Instant>,
    /// The call in flight went through the gate: its answer teaches it.
    gated_sent: bool,
    /// The retry is counted in the gate's queue.
    gate_queued: bool,
    streams: Option<Box<Streams>>,
}

/// One request's random draws: its backoff schedule and the jitter on server hints.
#[derive(Debug, Clone)]
struct Streams {
    schedule: Schedule,
    rng: SmallRng,
}

impl RequestRetry {
    /// A request not yet sent.
    pub fn new() -> Self {
        RequestRetry::default()
    }

    /// Attempts made so far (a transparent retry, or a call the circuit refused, is not
    /// one).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the request has made no call yet.
    pub fn is_unsent(&self) -> bool {
        self.attempts == 0 && !self.transparent && self.probe_waited_us == 0 && self.refusals == 0
    }

    /// Counts a call that succeeded, and settles the request with the budget: its last
    /// retry, which succeeded, costs nothing. Returns the attempts made.
    pub fn served(
        &mut self,
        now: Instant,
        budget: Option<&RetryBudget>,
        throttle: Option<&RetryThrottle>,
    ) -> u32 {
        self.attempts += 1;
        self.gated_until = None;
        if let Some(throttle) = throttle {
            throttle.record_success();
        }
        self.charge_expensive(now, budget);
        self.settle(now, budget, true);
        self.attempts
    }

    /// Whether retries admitted by the budget are still to be settled: a request dropped
    /// now is to be [`abandon`](RequestRetry::abandon)ed.
    pub fn has_unsettled(&self) -> bool {
        self.admitted > 0
    }
    /// Decides on the outcome of the request's last call.
    pub fn decide(&mut self, env: &mut Env<'_>, req: &Request, attempt: Attempt) -> Decided {
        // A driver that cannot hold a retry back after its wait sent it anyway.
        self.gated_until = None;
        if std::mem::take(&mut self.gated_sent) {
            if let (Some(pace), Attempt::Answered { throttled, .. }) = (env.pace, attempt) {
                pace.answered(env.now, throttled);
            }
        }
        let (class, any_method, expensive, after_break) = match attempt {
            Attempt::Answered {
                class, any_method, ..
            } => (class, any_method, false, None),
            Attempt::Unprocessed if !self.transparent => {
                return self.transparently(env, req);
            }
            Attempt::Unprocessed | Attempt::NotSent => {
                (Class::Retryable { after: None }, true, false, None)
            }
            Attempt::MaybeProcessed { timed_out } => {
                (Class::Retryable { after: None }, false, timed_out, None)
            }
            Attempt::Permanent => (Class::Permanent, false, false, None),
            Attempt::Refused(None) => {
                return self.done(env, self.attempts + 1, Some(GiveUp::CircuitOpen), None)
            }
            // The load control found no room: the call never left, and sending it again
            // is more of the load the dependency has no room for.
            Attempt::Shed => return self.done(env, self.attempts + 1, Some(GiveUp::Shed), None),
            Attempt::Refused(Some(refusal)) => match self.refused(env, req, refusal) {
                Ok(wait) => (Class::Retryable { after: None }, true, false, Some(wait)),
                Err(decided) => return decided,
            },
        };
        self.attempts += 1;
        let counted = Some(class);
        if let (
            Some(pace),
            Attempt::Answered {
                throttled: false, ..
            },
        ) = (env.pace, attempt)
        {
            // An answer past the server's rate limiter: the rate it accepts.
            pace.accepted(env.now);
        }
        if let (Some(throttle), Attempt::Answered { .. }) = (env.throttle, attempt) {
            // gRFC A6: every answer of the server moves the throttle's token count (a
            // transport error is not the server's answer, and does not).
            match class {
                Class::Success => throttle.record_success(),
                Class::Retryable { .. } | Class::DontRetry => throttle.record_failure(),
                Class::Permanent => {}
            }
        }
        self.expensive_pending = expensive;
        let attempts = self.attempts;
        let after = match class {
            Class::Success => return self.done(env, attempts, None, counted),
            Class::Permanent => Err(GiveUp::Permanent),
            Class::DontRetry if req.grpc => Err(GiveUp::Pushback),
            Class::DontRetry => Err(GiveUp::DontRetry),
            Class::Retryable { after } => self.may_retry(env, req, any_method, after),
        };
        let after = match after {
            Ok(after) => after,
            Err(why) => return self.done(env, attempts, Some(why), counted),
        };
        let backoff = req.backoff;
        let throttled = matches!(
            attempt,
            Attempt::Answered {
                throttled: true,
                ..
            }
        );
        let delay = match (after_break, after) {
            (Some(wait), _) => wait,
            (None, Some(exact)) if req.grpc => {
                // gRFC A6: after the server's own wait, the backoff starts over.
                self.streams(env, backoff).schedule.restart();
                exact
            }
            (None, Some(hint)) => {
                let delay = self.next_backoff(env, backoff);
                delay.max(self.stretch(env, backoff, hint))
            }
            (None, None) if throttled => {
                // A throttling answer without a hint: from a longer base than a 5xx's,
                // doubling, with up to as much again of jitter.
                let base = throttle_base(attempts);
                let draw: f64 = self.streams(env, backoff).rng.random();
                base + base.mul_f64(draw)
            }
            (None, None) => self.next_backoff(env, backoff),
        };
        let gated = throttled && after_break.is_none();
        let delay = if gated {
            // A throttled burst is not sent back at once: spread over one more of the
            // server's wait (without one, the throttling backoff is spread already),
            // then let through by the gate, or not at all past one more of it.
            let span = after.unwrap_or(Duration::ZERO);
            let draw: f64 = self.streams(env, backoff).rng.random();
            let delay = delay.saturating_add(span.mul_f64(draw));
            if let Some(pace) = env.pace {
                pace.arm(env.now);
                let waited = after.unwrap_or_else(|| throttle_base(attempts));
                self.gated_until = Some(env.now + delay.saturating_add(waited));
            }
            delay
        } else {
            delay
        };
        if let Err(why) = self.may_wait(env, delay) {
            return self.done(env, attempts, Some(why), counted);
        }
        self.admitted = self.admitted.saturating_add(1);
        Decided {
            decision: Decision::Retry { delay, attempts },
            counted,
        }
    }

    /// Settles a request its caller gave up on (dropped before its end): every retry
    /// admitted is charged as wasted.
    pub fn abandon(&mut self, now: Instant, budget: Option<&RetryBudget>) {
        self.settle(now, budget, false);
    }

    /// Whether the retry just decided waits for the gate of throttled retries when its
    /// wait is over: the driver then asks [`release`](Self::release) before sending it,
    /// and keeps the outcome it would hand back if the retry is not let through.
    pub fn is_gated(&self) -> bool {
        self.gated_until.is_some()
    }

    /// Once the wait of a retry of a throttling answer is over (at `env.now`): whether
    /// the gate ([`ThrottlePace`]) lets it through. [`Decision::Retry`] with a zero
    /// delay: send it now; with a delay: wait for a slot and ask again (it is still
    /// [gated](Self::is_gated)); [`Decision::Done`] with [`GiveUp::Throttled`] when no
    /// slot came within one more of the server's wait: the retry is not sent, and the
    /// outcome before it is handed back. A retry that is not gated is sent now.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use stormguard_core::retry::{Attempt, Decision, Env, GiveUp, Request, RequestRetry, ThrottlePace};
    /// use stormguard_core::{Backoff, Class, RetryBudget};
    ///
    /// let (budget, pace) = (RetryBudget::default(), ThrottlePace::new());
    /// let t0 = Instant::now();
    /// budget.deposit(t0);
    /// let request = Request::new(3, Backoff::default());
    /// let throttled = Attempt::Answered {
    ///     throttled: true,
    ///     class: Class::Retryable { after: Some(Duration::from_secs(1)) },
    ///     any_method: false,
    /// };
    /// let mut retry = RequestRetry::new();
    /// let mut env = Env::new(t0, &budget);
    /// env.pace = Some(&pace);
    /// let Decision::Retry { delay, .. } = retry.decide(&mut env, &request, throttled).decision
    /// else { unreachable!() };
    /// assert!(delay >= Duration::from_secs(1) && retry.is_gated());
    /// // The limiter refuses the retries the gate let through: it closes, and other
    /// // retries keep taking its slots.
    /// let woken = t0 + delay;
    /// pace.answered(woken, true);
    /// env.now = woken;
    /// for _ in 0..100 {
    ///     let decided = retry.release(&mut env);
    ///     match decided.decision {
    ///         Decision::Retry { delay, .. } => env.now += delay.max(Duration::from_millis(1)),
    ///         other => {
    ///             assert_eq!(other, Decision::Done { attempts: 1, give_up: Some(GiveUp::Throttled) });
    ///             break;
    ///         }
    ///     }
    ///     // Another retry takes the slot first.
    ///     let _ = pace.release(env.now, env.now, &mut false, 0.0);
    /// }
    /// assert!(!retry.is_gated());
    /// ```
    pub fn release(&mut self, env: &mut Env<'_>) -> Decided {
        let attempts = self.attempts;
        let send = |delay| Decided {
            decision: Decision::Retry { delay, attempts },
            counted: None,
        };
        let (Some(until), Some(pace)) = (self.gated_until, env.pace) else {
            self.gated_until = None;
            return send(Duration::ZERO);
        };
        let until = match env.left_to_start() {
            Some(left) => until.min(env.now + left),
            None => until,
        };
        let draw = self.streams.as_mut().map_or(0.5, |s| s.rng.random());
        match pace.release(env.now, until, &mut self.gate_queued, draw) {
            Gate::Go => {
                self.gated_until = None;
                self.gated_sent = true;
                send(Duration::ZERO)
            }
            Gate::Wait(wait) => send(wait),
            Gate::Closed => {
                // Not sent: the retry the budget admitted is not one.
                self.admitted = self.admitted.saturating_sub(1);
                self.done(env, attempts, Some(GiveUp::Throttled), None)
            }
        }
    }

    /// Takes a request given up on while its retry waited for the gate out of the
    /// gate's queue (with [`abandon`](Self::abandon)).
    pub fn leave_gate(&mut self, pace: &ThrottlePace) {
        pace.leave(&mut self.gate_queued);
    }

    /// Counts an answer the server accepted at `now` with the gate of throttled
    /// retries (the success the driver settled with [`served`](Self::served)).
    pub fn accepted(&mut self, now: Instant, pace: &ThrottlePace) {
        if std::mem::take(&mut self.gated_sent) {
            pace.answered(now, false);
        }
        pace.accepted(now);
    }

    /// The one free retry of a request its server refused before its application saw
    /// it: at once, no attempt spent, nothing withdrawn from the budget.
    fn transparently(&mut self, env: &mut Env<'_>, req: &Request) -> Decided {
        let why = if !req.replayable {
            Some(GiveUp::BodyNotReplayable)
        } else if env.outlasts_deadline(Duration::ZERO) {
            Some(GiveUp::Deadline)
        } else {
            None
        };
        if let Some(why) = why {
            return self.done(env, self.attempts + 1, Some(why), None);
        }
        self.transparent = true;
        Decided {
            decision: Decision::Transparent {
                attempts: self.attempts,
            },
            counted: None,
        }
    }

    /// A call the circuit refused. A break that ends before the backoff would anyway is
    /// waited out: the circuit admits its probe meanwhile, so the call adds no load, and
    /// a blip's requests are not lost to it; a longer break fails fast. A retry refused
    /// waits out up to as many refusals as the request has retries, without spending an
    /// attempt or asking the budget again: its retry was admitted, and the refusal only
    /// moved it. A first call refused within a break of the break's end waits for the
    /// probe's verdict, free: once, and again each time it asks while a probe is still
    /// deciding (half-open: it has not had the verdict yet), all its waits together no
    /// longer than its first backoff at its longest; otherwise it waits as a retry,
    /// admitted by the budget and spending an attempt (`Ok`: its wait), so that a circuit that stays
    /// open fails new requests fast once the budget is spent. The wait spreads the
    /// circuit's backlog over a span that grows with its age
    /// ([`breaker::backlog_wait`]). A dependency failing for
    /// [`breaker::FAIL_FAST_AFTER`] or more ([`Refusal::failing_for`]) is down, not
    /// blipping: its circuit's refusals fail at
    /// once (after the wait for a probe's verdict at a break's end), so that an outage does
    /// not pile the caller's requests up behind it.
    fn refused(
        &mut self,
        env: &mut Env<'_>,
        req: &Request,
        refusal: Refusal,
    ) -> Result<Duration, Decided> {
        let sent = self.attempts > 0;
        let breaks = matches!(refusal.state, CircuitState::Open | CircuitState::HalfOpen);
        // A first call waits for the verdict of the probe at a break's end; asking again
        // while a probe is still deciding (half-open), it has not had a verdict yet, and
        // waits again (a probe may take up to an attempt's timeout to decide). A probe
        // that failed (the circuit open again) is a verdict: no more waits.
        let waits_for_probe = if self.probe_waited_us == 0 {
            breaks
        } else {
            refusal.state == CircuitState::HalfOpen
        };
        if !sent && waits_for_probe {
            // All the waits together within the first backoff at its longest (and no
            // more once the count saturates).
            let waited = Duration::from_micros(u64::from(self.probe_waited_us));
            let ceiling = if self.probe_waited_us == u32::MAX {
                Duration::ZERO
            } else {
                req.backoff.ceiling(0).saturating_sub(waited)
            };
            let wait =
                breaker::probe_wait(refusal.remaining, refusal.break_duration, ceiling, || {
                    self.streams(env, req.backoff).rng.random()
                });
            if let Some(wait) = wait {
                // Rounded up, so that the waits never add up past the ceiling.
                let total = waited.saturating_add(wait).as_nanos().div_ceil(1000).max(1);
                self.probe_waited_us = u32::try_from(total).unwrap_or(u32::MAX);
                return Err(self.wait_refused(env, req, wait, true));
            }
        }
        // Past the horizon the circuit is down, not blipping: the caller hears it now.
        let down = refusal.failing_for >= breaker::FAIL_FAST_AFTER
            || refusal.state == CircuitState::Isolated;
        let delay = self.next_backoff(env, req.backoff);
        let retries = req.max_attempts.saturating_sub(1);
        if down || refusal.remaining > delay || (sent && u32::from(self.refusals) >= retries) {
            return Err(self.done(env, self.attempts + 1, Some(GiveUp::CircuitOpen), None));
        }
        let wait = self.backlog_wait(env, req.backoff, delay, refusal);
        if sent {
            self.refusals = self.refusals.saturating_add(1);
            return Err(self.wait_refused(env, req, wait, false));
        }
        Ok(wait)
    }

    /// Asks the circuit again after `delay`, unless the body cannot be sent again or the
    /// wait outlasts the deadline.
    fn wait_refused(
        &mut self,
        env: &mut Env<'_>,
        req: &Request,
        delay: Duration,
        probe: bool,
    ) -> Decided {
        let attempts = self.attempts + 1;
        if !req.replayable {
            return self.done(env, attempts, Some(GiveUp::BodyNotReplayable), None);
        }
        if env.outlasts_deadline(delay) {
            return self.done(env, attempts, Some(GiveUp::Deadline), None);
        }
        Decided {
            decision: Decision::Refused {
                delay,
                attempts: self.attempts,
                probe,
            },
            counted: None,
        }
    }

    /// The checks after a retryable outcome, in order; `Ok` holds the server's hint.
    fn may_retry(
        &self,
        env: &Env<'_>,
        req: &Request,
        any_method: bool,
        after: Option<Duration>,
    ) -> Result<Option<Duration>, GiveUp> {
        if !(any_method || req.may_repeat) {
            return Err(GiveUp::NotIdempotent);
        }
        let max = if req.grpc {
            req.max_attempts.min(GRPC_MAX_ATTEMPTS)
        } else {
            req.max_attempts
        };
        if self.attempts >= max || req.once {
            return Err(GiveUp::Exhausted);
        }
        if !req.replayable {
            return Err(GiveUp::BodyNotReplayable);
        }
        if after.is_some_and(|after| after > env.max_retry_after) {
            return Err(GiveUp::RetryAfterTooLong);
        }
        Ok(after)
    }

    /// The last checks, once the wait is known: the deadline, then the budget (so a
    /// retry that could never finish asks for nothing), which admits the retry on the
    /// waste so far.
    fn may_wait(&mut self, env: &Env<'_>, delay: Duration) -> Result<(), GiveUp> {
        if env.outlasts_deadline(delay) {
            return Err(GiveUp::Deadline);
        }
        if let Some(throttle) = env.throttle {
            if !throttle.allows_retry() {
                return Err(GiveUp::Budget);
            }
        }
        let admitted = env
            .budget
            .is_none_or(|budget| budget.admit(env.now, u32::from(self.admitted)));
        self.charge_expensive(env.now, env.budget);
        if !admitted {
            return Err(GiveUp::Budget);
        }
        Ok(())
    }

    /// Charges a call that timed out (work the server may have done for nobody), once
    /// its own retry is decided, and whatever was decided: two wasted retries
    /// ([`crate::budget::EXPENSIVE_FAILURE`]), as the AWS SDKs ask a timeout's retry for
    /// twice the tokens. Its own retry is decided first, on the room as it was: so a new
    /// or quiet client retries an isolated timeout (its allowance pays for it), while in a
    /// brownout, where timeouts come many at a time, each one charged closes the room to
    /// the next ones at once.
    fn charge_expensive(&mut self, now: Instant, budget: Option<&RetryBudget>) {
        if std::mem::take(&mut self.expensive_pending) {
            if let Some(budget) = budget {
                budget.charge(now, crate::budget::EXPENSIVE_FAILURE);
            }
        }
    }

    /// Settles the request's retries with the budget at its end, once: the retries it
    /// was admitted to make that failed are wasted. For a request `served` that is all
    /// but the last; for one that was not, every one.
    fn settle(&mut self, now: Instant, budget: Option<&RetryBudget>, served: bool) {
        let admitted = std::mem::take(&mut self.admitted);
        let wasted = if served {
            admitted.saturating_sub(1)
        } else {
            admitted
        };
        if let (true, Some(budget)) = (wasted > 0, budget) {
            budget.charge(now, u32::from(wasted));
        }
    }

    /// Hands the outcome back after `attempts` calls, settling the budget.
    fn done(
        &mut self,
        env: &Env<'_>,
        attempts: u32,
        give_up: Option<GiveUp>,
        counted: Option<Class>,
    ) -> Decided {
        self.gated_until = None;
        self.charge_expensive(env.now, env.budget);
        self.settle(env.now, env.budget, give_up.is_none());
        Decided {
            decision: Decision::Done { attempts, give_up },
            counted,
        }
    }

    fn streams(&mut self, env: &mut Env<'_>, backoff: Backoff) -> &mut Streams {
        self.streams.get_or_insert_with(|| {
            let seed = env.seed.as_mut().and_then(|seed| seed());
            Box::new(match seed {
                Some(seed) => Streams {
                    schedule: backoff.schedule_seeded(seed),
                    rng: SmallRng::seed_from_u64(!seed),
                },
                None => Streams {
                    schedule: backoff.schedule(),
                    rng: SmallRng::from_rng(&mut rand::rng()),
                },
            })
        })
    }

    /// The wait of a call an open circuit refused, whose backoff drew `delay`: about four
    /// times the circuit's age, within the backoff's cap, or the deadline if sooner.
    fn backlog_wait(
        &mut self,
        env: &mut Env<'_>,
        backoff: Backoff,
        delay: Duration,
        refusal: Refusal,
    ) -> Duration {
        let limit = env
            .left_to_start()
            .map_or(backoff.cap(), |left| backoff.cap().min(left));
        let draw: f64 = self.streams(env, backoff).rng.random();
        breaker::backlog_wait(delay, refusal.remaining, refusal.open_for, limit, draw)
    }

    fn next_backoff(&mut self, env: &mut Env<'_>, backoff: Backoff) -> Duration {
        self.streams(env, backoff)
            .schedule
            .next()
            .unwrap_or(backoff.cap())
    }

    /// Up to 10% more than the server asked for, never less.
    fn stretch(&mut self, env: &mut Env<'_>, backoff: Backoff, hint: Duration) -> Duration {
        let spread = u64::try_from((hint / 10).as_nanos()).unwrap_or(u64::MAX);
        if spread == 0 {
            return hint;
        }
        let extra = self.streams(env, backoff).rng.random_range(0..spread);
        hint.saturating_add(Duration::from_nanos(extra))
    }
}

/// The wait of a throttling answer without a hint after `attempts` attempts:
/// [`THROTTLE_BASE`], doubling, up to 32 times it.
fn throttle_base(attempts: u32) -> Duration {
    THROTTLE_BASE.saturating_mul(1 << attempts.saturating_sub(1).min(5))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // the tests take their time zero from the clock
mod tests {
    use super::*;
    use crate::Jitter;

    fn backoff() -> Backoff {
        Backoff::new(
            Duration::from_millis(100),
            Duration::from_secs(2),
            Jitter::Full,
        )
        .expect("backoff")
    }

    fn request() -> Request {
        Request::new(3, backoff())
    }

    /// A retryable answer without a hint (a bare 503).
    const A_503: Attempt = Attempt::Answered {
        throttled: false,
        class: Class::Retryable { after: None },
        any_method: false,
    };

    fn env(now: Instant, budget: &RetryBudget) -> Env<'_> {
        Env::new(now, budget)
    }

    fn roomy() -> RetryBudget {
        RetryBudget::builder()
            .allowance(100)
            .build()
            .expect("budget")
    }

    #[test]
    fn a_request_refused_unprocessed_is_sent_again_once_free() {
        let (now, budget) = (Instant::now(), roomy());
        let mut retry = RequestRetry::new();
        let decided = retry.decide(&mut env(now, &budget), &request(), Attempt::Unprocessed);
        assert_eq!(decided.decision, Decision::Transparent { attempts: 0 });
        assert_eq!(decided.counted, None, "a refused call is no attempt");
        // The second refusal is an ordinary retry, counted.
        let decided = retry.decide(&mut env(now, &budget), &request(), Attempt::Unprocessed);
        assert!(matches!(
            decided.decision,
            Decision::Retry { attempts: 1, .. }
        ));
        assert_eq!(decided.counted, Some(Class::Retryable { after: None }));
        // A request that may not be repeated is sent again on that proof too.
        let mut post = RequestRetry::new();
        let req = Request {
            may_repeat: false,
            ..request()
        };
        let decided = post.decide(&mut env(now, &budget), &req, Attempt::Unprocessed);
        assert_eq!(decided.decision, Decision::Transparent { attempts: 0 });
        let decided = post.decide(
            &mut env(now, &budget),
            &req,
            Attempt::MaybeProcessed { timed_out: false },
        );
        assert_eq!(
            decided.decision,
            Decision::Done {
                attempts: 1,
                give_up: Some(GiveUp::NotIdempotent)
            }
        );
    }

    #[test]
    fn a_first_call_refused_at_a_breaks_end_waits_once_for_the_probe() {
        let (now, budget) = (Instant::now(), roomy());
        let refusal = Refusal {
            remaining: Duration::from_millis(10),
            open_for: Duration::from_millis(40),
            failing_for: Duration::from_millis(40),
            break_duration: Duration::from_millis(30),
            state: CircuitState::Open,
        };
        let mut retry = RequestRetry::new();
        let decided = retry.decide(
            &mut env(now, &budget),
            &request(),
            Attempt::Refused(Some(refusal)),
        );
        let Decision::Refused {
            delay,
            attempts: 0,
            probe: true,
        } = decided.decision
        else {
            panic!("{decided:?}");
        };
        // The rest of the break, plus up to one more.
        assert!(delay >= refusal.remaining && delay <= refusal.remaining + refusal.break_duration);
        assert!(!retry.is_unsent());
        // Refused again: now it waits as a retry, an attempt admitted by the budget.
        let decided = retry.decide(
            &mut env(now, &budget),
            &request(),
            Attempt::Refused(Some(refusal)),
        );
        if let Decision::Retry { attempts, .. } = decided.decision {
            assert_eq!(attempts, 1);
        } else {
            // Or the break outlasts its backoff draw: it fails fast.
            assert_eq!(
                decided.decision,
                Decision::Done {
                    attempts: 1,
                    give_up: Some(GiveUp::CircuitOpen)
                }
            );
        }
        // An isolated circuit fails at once.
        let decided =
            RequestRetry::new().decide(&mut env(now, &budget), &request(), Attempt::Refused(None));
        assert_eq!(
            decided.decision,
            Decision::Done {
                attempts: 1,
                give_up: Some(GiveUp::CircuitOpen)
            }
        );
    }

    #[test]
    fn a_first_call_that_meets_the_probe_still_deciding_waits_for_its_verdict() {
        let (now, budget) = (Instant::now(), roomy());
        let breaks = Duration::from_millis(25);
        // Down for 5 s: past the horizon, where a refusal fails fast.
        let refusal = |state, remaining| Refusal {
            remaining,
            open_for: Duration::from_secs(5),
            failing_for: Duration::from_secs(5),
            break_duration: breaks,
            state,
        };
        let open = refusal(CircuitState::Open, Duration::from_millis(10));
        let deciding = refusal(CircuitState::HalfOpen, Duration::ZERO);
        let mut retry = RequestRetry::new();
        let mut ask = |refusal| {
            retry
                .decide(
                    &mut env(now, &budget),
                    &request(),
                    Attempt::Refused(Some(refusal)),
                )
                .decision
        };
        let Decision::Refused { delay: first, .. } = ask(open) else {
            panic!("a first call at a break's end fails before the probe's verdict");
        };
        // Back while the break's probe is in flight: it has not had the verdict yet.
        let Decision::Refused {
            delay,
            attempts: 0,
            probe: true,
        } = ask(deciding)
        else {
            panic!("a call meeting the probe deciding fails before its verdict");
        };
        assert!(delay <= breaks, "{delay:?}");
        // A probe still deciding (a slow one, or the next one) is waited for again, all
        // the waits together within the first backoff at its longest; then the call
        // fails.
        let give_up = Decision::Done {
            attempts: 1,
            give_up: Some(GiveUp::CircuitOpen),
        };
        let (mut waited, mut waits) = (first + delay, 2);
        loop {
            match ask(deciding) {
                Decision::Refused {
                    delay,
                    attempts: 0,
                    probe: true,
                } => {
                    assert!(delay <= breaks, "{delay:?}");
                    waited += delay;
                    waits += 1;
                    assert!(waits < 1000, "the waits end");
                }
                decision => {
                    assert_eq!(decision, give_up);
                    break;
                }
            }
        }
        assert!(
            waits > 2,
            "a probe still deciding after two waits is waited for"
        );
        let ceiling = request().backoff.ceiling(0);
        assert!(waited <= ceiling, "{waited:?}");
        assert!(
            waited + breaks > ceiling,
            "it waits as long as it may: {waited:?}"
        );
        // A call whose probe has failed (the circuit open again) fails at once.
        let mut retry = RequestRetry::new();
        let mut ask = |refusal| {
            retry
                .decide(
                    &mut env(now, &budget),
                    &request(),
                    Attempt::Refused(Some(refusal)),
                )
                .decision
        };
        assert!(matches!(ask(open), Decision::Refused { probe: true, .. }));
        assert_eq!(ask(open), give_up);
    }

    #[test]
    fn a_first_call_s_waits_for_probes_end_whatever_its_backoff() {
        let (now, budget) = (Instant::now(), roomy());
        // A first backoff of three hours, 40-minute breaks: past what the waits' count
        // holds (about 71 minutes), the call stops waiting rather than wait for good.
        let hours = Duration::from_secs(3 * 3600);
        let backoff = Backoff::new(hours, hours, Jitter::Full).expect("backoff");
        let request = Request::new(3, backoff);
        let deciding = Refusal {
            remaining: Duration::ZERO,
            open_for: Duration::from_secs(5),
            failing_for: Duration::from_secs(5),
            break_duration: Duration::from_secs(40 * 60),
            state: CircuitState::HalfOpen,
        };
        let mut retry = RequestRetry::new();
        let mut waited = Duration::ZERO;
        for _ in 0..10_000 {
            let decided = retry.decide(
                &mut env(now, &budget),
                &request,
                Attempt::Refused(Some(deciding)),
            );
            match decided.decision {
                Decision::Refused { delay, .. } => waited += delay,
                Decision::Done { .. } | Decision::Retry { .. } => {
                    assert!(waited <= hours, "{waited:?}");
                    return;
                }
                other => panic!("{other:?}"),
            }
        }
        panic!("a first call kept waiting for probes: {waited:?}");
    }

    #[test]
    fn a_circuit_down_past_the_horizon_fails_calls_within_a_break() {
        let (now, budget) = (Instant::now(), roomy());
        let breaks = Duration::from_millis(25);
        let refusal = |open_for| Refusal {
            remaining: Duration::from_millis(10),
            open_for,
            failing_for: open_for,
            break_duration: breaks,
            state: CircuitState::Open,
        };
        // Open for 5 s: a new call waits once for the break's probe, at most the rest of
        // the break and one more, then fails; its wait does not grow with the outage.
        let down = refusal(Duration::from_secs(5));
        let mut retry = RequestRetry::new();
        let first = retry.decide(
            &mut env(now, &budget),
            &request(),
            Attempt::Refused(Some(down)),
        );
        let Decision::Refused {
            delay, probe: true, ..
        } = first.decision
        else {
            panic!("{first:?}");
        };
        assert!(delay <= down.remaining + breaks, "{delay:?}");
        let then = retry.decide(
            &mut env(now, &budget),
            &request(),
            Attempt::Refused(Some(down)),
        );
        assert_eq!(
            then.decision,
            Decision::Done {
                attempts: 1,
                give_up: Some(GiveUp::CircuitOpen)
            }
        );
        // A retry refused past the horizon fails at once too; the horizon counts the
        // failures before the opening: a circuit open for 100 ms after 300 ms of
        // failures in a row is down, not blipping.
        let late_to_open = Refusal {
            failing_for: Duration::from_millis(400),
            ..refusal(Duration::from_millis(100))
        };
        for refused_by in [down, late_to_open] {
            let mut retry = RequestRetry::new();
            retry.decide(&mut env(now, &budget), &request(), A_503);
            let refused = retry.decide(
                &mut env(now, &budget),
                &request(),
                Attempt::Refused(Some(refused_by)),
            );
            assert!(
                matches!(
                    refused.decision,
                    Decision::Done {
                        give_up: Some(GiveUp::CircuitOpen),
                        ..
                    }
                ),
                "{refused_by:?}: {refused:?}"
            );
        }
        // A blip's refusal (200 ms old) is still ridden out: every seed waits for the
        // break to end, as a retry.
        for seed in 0..50 {
            let mut retry = RequestRetry::new();
            let mut draw = Some(seed);
            let mut seeds = || draw.take();
            let mut env = env(now, &budget);
            env.seed = Some(&mut seeds);
            let young = Refusal {
                remaining: Duration::ZERO,
                ..refusal(Duration::from_millis(200))
            };
            retry.decide(&mut env, &request(), Attempt::Refused(Some(young)));
            let decided = retry.decide(&mut env, &request(), Attempt::Refused(Some(young)));
            match decided.decision {
                Decision::Retry { delay, .. } => assert!(delay >= young.remaining),
                other => panic!("seed {seed}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_refused_retry_is_waited_out_as_often_as_the_request_has_retries() {
        let (now, budget) = (Instant::now(), roomy());
        let refusal = Refusal {
            remaining: Duration::ZERO,
            open_for: Duration::ZERO,
            failing_for: Duration::ZERO,
            break_duration: Duration::from_secs(1),
            state: CircuitState::HalfOpen,
        };
        let mut retry = RequestRetry::new();
        assert!(matches!(
            retry
                .decide(&mut env(now, &budget), &request(), A_503)
                .decision,
            Decision::Retry { .. }
        ));
        for _ in 0..2 {
            let decided = retry.decide(
                &mut env(now, &budget),
                &request(),
                Attempt::Refused(Some(refusal)),
            );
            assert!(
                matches!(
                    decided.decision,
                    Decision::Refused {
                        attempts: 1,
                        probe: false,
                        ..
                    }
                ),
                "{decided:?}"
            );
        }
        let decided = retry.decide(
            &mut env(now, &budget),
            &request(),
            Attempt::Refused(Some(refusal)),
        );
        assert_eq!(
            decided.decision,
            Decision::Done {
                attempts: 2,
                give_up: Some(GiveUp::CircuitOpen)
            }
        );
    }

    #[test]
    fn failed_retries_are_charged_when_the_request_ends() {
        let now = Instant::now();
        let budget = roomy();
        budget.deposit(now);
        let timed_out = Attempt::MaybeProcessed { timed_out: true };
        let mut retry = RequestRetry::new();
        assert!(matches!(
            retry
                .decide(&mut env(now, &budget), &request(), timed_out)
                .decision,
            Decision::Retry { attempts: 1, .. }
        ));
        // The timeout is charged as two wasted retries once its retry is decided.
        assert_eq!(
            budget.usage(now).1,
            u64::from(crate::budget::EXPENSIVE_FAILURE)
        );
        assert!(retry.has_unsettled());
        // Served on the retry: the retry that succeeded costs nothing.
        assert_eq!(retry.served(now, Some(&budget), None), 2);
        assert!(!retry.has_unsettled());
        assert_eq!(
            budget.usage(now).1,
            u64::from(crate::budget::EXPENSIVE_FAILURE)
        );
        // Abandoned after a retry: that retry is wasted.
        let mut retry = RequestRetry::new();
        let failed = Attempt::NotSent;
        assert!(matches!(
            retry
                .decide(&mut env(now, &budget), &request(), failed)
                .decision,
            Decision::Retry { .. }
        ));
        retry.abandon(now, Some(&budget));
        assert_eq!(
            budget.usage(now).1,
            u64::from(crate::budget::EXPENSIVE_FAILURE) + 1
        );
    }
}
