//! The retry middleware: [`RetryLayer`] and its [`RetryPolicy`].
//!
//! One failed attempt is retried only when all of these hold, checked in this order:
//!
//! 1. the outcome is transient ([`classify`](stormguard_core::classify)): a 408, 429,
//!    500, 502, 503 or 504, gRPC UNAVAILABLE, a timeout or a connection failure;
//! 2. sending the request again is safe: the method is idempotent, the request has an
//!    `Idempotency-Key`, the call is gRPC with a retryable code, or the failure proves
//!    the server never saw the request (connection refused, h2 `REFUSED_STREAM`,
//!    GOAWAY);
//! 3. attempts are left (3 by default, including the first; gRPC calls at most 5, gRFC A6);
//! 4. the body can be sent again (see [`ReplayBody`](crate::ReplayBody));
//! 5. the server's `Retry-After` or `grpc-retry-pushback-ms` is not longer than
//!    `max_retry_after` [the backoff cap];
//! 6. the shared [`RetryBudget`] grants a retry.
//!
//! The wait is the request's own jittered [`Backoff`] delay, or the server's hint when
//! that is longer (plus up to 10% upward jitter, so clients told "30" do not all come
//! back in the same millisecond); gRPC pushback is honoured exactly, and the backoff
//! starts again from its first ceiling after it (gRFC A6). The wait runs on tokio's
//! clock, so `tokio::time::pause()` makes tests exact.
//!
//! # Transparent retries
//!
//! Some failures prove the request reached the server but not its application: an
//! HTTP/2 `REFUSED_STREAM`, or a GOAWAY that names a last stream below the request's
//! (a server draining its connection, as nginx does every `keepalive_requests` and any
//! server does on a graceful restart), or hyper or hyper-util handing the request back
//! unwritten ("canceled": it waited for a connection that closed or was not ready, as
//! tonic's requests queued on a connection do when the server drains it).
//! Such a request is retried **at once and once**, as gRFC A6's transparent retry:
//! without a backoff wait, without spending an attempt, without a withdrawal from the
//! budget, whatever its method, and the breaker does not count the failure. A second
//! such failure for the same request goes through the checks below like any other.
//! A refused connection is not one of these: it says the dependency may be down, and is
//! an ordinary retry with backoff.
//!
//! Which GOAWAYs prove that much: h2 reports a server's GOAWAY only to the streams above
//! the last stream id the server names (which it promises it never processed) and to
//! requests made on the connection after it. A stream at or below that id which the
//! connection's close then cuts short, its body still being sent say, ends with a
//! broken pipe or a reset instead: the request may have been processed, and it is
//! retried only if it is safe to repeat. Transparent retries are counted apart
//! ([`RetryStats::transparent_retries`]), traced with reason `transparent`, and a
//! gRPC call carries `grpc-transparent-retry-attempts: 1` on its second try.
//!
//! Every give-up is reported with its reason (a `tracing` event on target
//! `stormguard::retry` and a [`RetryStats`] counter), and every response that took more
//! than one attempt carries an [`Attempts`] extension.
//!
//! # Which errors are recognised
//!
//! An error is inspected when it is a [`BoxError`](crate::BoxError) (what tower's
//! timeout, stormguard's breaker and most middleware return) or one of hyper's,
//! hyper-util's, h2's (each with the feature of its name, on by default), tonic's
//! `transport::Error` (with the `tonic` feature), `std::io`'s or tower's `Elapsed`; its
//! `source()` chain is then walked for the causes listed in the crate's error
//! classification (connect errors, refused connections, h2 `REFUSED_STREAM` and GOAWAY,
//! resets, timeouts). An error of another concrete type cannot be looked into and is
//! not retried: put a layer that boxes errors below the retry (the per-attempt timeout
//! does), or `.map_err(BoxError::from)`.
//!
//! # Per-request control
//!
//! Insert [`NoRetry`] in a request's extensions to send it once whatever happens, or
//! [`Idempotent`] to declare a POST safe to repeat without an `Idempotency-Key`.
//!
//! # What happens to a retried attempt's response
//!
//! The failed response is dropped before the next attempt. With hyper an unread
//! HTTP/1.1 body means its connection cannot carry another request, so hyper closes it
//! rather than returning it to the pool; over HTTP/2 only that stream is reset and the
//! connection stays. Nothing leaks either way.

pub mod future;
mod layer;
mod service;

pub use layer::{CloneBodies, ReplayBodies, ReplayRetry, RetryLayer};
pub use service::Retry;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderValue, Request, Response};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use stormguard_core::classify::{
    grpc_status, is_idempotent, GrpcCodeSet, Rules, StatusSet, GRPC_PREVIOUS_RPC_ATTEMPTS,
    X_ATTEMPT_COUNT,
};
use stormguard_core::deadline::{grpc_timeout_value, parse_grpc_timeout, Deadline};
use stormguard_core::methods::{MethodPolicy, MethodTable};
use stormguard_core::throttle::RetryThrottle;
use stormguard_core::{Backoff, Class, ConfigError, RetryBudget, Schedule};
use tokio::time::Sleep;

use crate::body::{ReplayHandle, DEFAULT_MAX_REPLAY_BYTES};
use crate::error_class::{classify_error, ErrorClass};

/// gRFC A6 caps any gRPC retry policy at five attempts.
use stormguard_core::methods::MAX_ATTEMPTS as GRPC_MAX_ATTEMPTS;

/// A gRPC call's timeout, rewritten on each retry to the time that remains.
const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// Set on a gRPC call's transparent retry (gRFC A6).
const GRPC_TRANSPARENT_RETRY_ATTEMPTS: http::HeaderName =
    http::HeaderName::from_static("grpc-transparent-retry-attempts");

/// Request extension: never retry this request.
///
/// ```
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(stormguard::NoRetry);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NoRetry;

/// Request extension: this request is safe to send more than once, whatever its method.
///
/// ```
/// let mut request = http::Request::post("/charge").body(()).unwrap();
/// request.extensions_mut().insert(stormguard::Idempotent);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Idempotent;

/// Response extension: how many attempts the request took, the first included.
///
/// It is added to every response that took more than one attempt; a response from the
/// first attempt carries none, so that the success path allocates nothing.
/// [`Attempts::of`] reads it either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempts(pub u32);

impl Attempts {
    /// The attempts `response` took: its extension, or 1 when it has none.
    pub fn of<B>(response: &Response<B>) -> u32 {
        response.extensions().get::<Attempts>().map_or(1, |a| a.0)
    }
}

/// Why the retry layer stopped and returned what it had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUp {
    /// Every attempt allowed was made.
    Exhausted,
    /// The outcome will not change on retry (4xx, an unknown error, a non-retryable
    /// gRPC code).
    Permanent,
    /// The shared retry budget is spent.
    Budget,
    /// The request is not idempotent and the failure does not prove it unseen.
    NotIdempotent,
    /// The server asked for a longer wait than `max_retry_after`.
    RetryAfterTooLong,
    /// The body went over the replay cap, or was not completely sent.
    BodyNotReplayable,
    /// A gRPC response said not to retry: a negative or unparseable pushback, or one of
    /// the headers [`DontRetry`](GiveUp::DontRetry) names.
    Pushback,
    /// A circuit breaker is open, for longer than the next backoff would wait (a
    /// shorter break is waited out).
    CircuitOpen,
    /// The wait would end after the request's [`Deadline`].
    Deadline,
    /// The server said its own dependencies gave up: `x-no-retry` (or Finagle's
    /// `finagle-http-nonretryable-nack`; see [`signals`](crate::signals)), or a proxy
    /// said it shed the request (Envoy's `x-envoy-overloaded`, `x-envoy-ratelimited`).
    /// On a gRPC response the reason is [`Pushback`](GiveUp::Pushback).
    DontRetry,
}

impl GiveUp {
    /// A short name for logs and metrics labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            GiveUp::Exhausted => "exhausted",
            GiveUp::Permanent => "permanent",
            GiveUp::Budget => "budget",
            GiveUp::NotIdempotent => "not_idempotent",
            GiveUp::RetryAfterTooLong => "retry_after_too_long",
            GiveUp::BodyNotReplayable => "body_not_replayable",
            GiveUp::Pushback => "pushback",
            GiveUp::CircuitOpen => "circuit_open",
            GiveUp::Deadline => "deadline",
            GiveUp::DontRetry => "dont_retry",
        }
    }
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counters of what a [`RetryPolicy`] (and all its clones) did, read with
/// [`RetryPolicy::stats`].
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
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    retries: AtomicU64,
    exhausted: AtomicU64,
    budget_denied: AtomicU64,
    permanent: AtomicU64,
    not_replayable: AtomicU64,
    not_idempotent: AtomicU64,
    server_refused: AtomicU64,
    deadline: AtomicU64,
    transparent_retries: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

#[derive(Debug)]
struct Shared {
    /// The dependency's name, the `service` label of the metrics.
    name: String,
    max_attempts: u32,
    backoff: Backoff,
    budget: RetryBudget,
    throttle: Option<RetryThrottle>,
    rules: Rules,
    /// Per-method limits of a gRPC service config, looked up by `:path` on failure
    /// (`None`: the method has no retry policy).
    methods: Option<MethodTable<Option<Limits>>>,
    max_retry_after: Duration,
    max_replay_bytes: usize,
    seed: Option<u64>,
    next_stream: AtomicU64,
    counters: Counters,
    #[cfg(feature = "metrics")]
    metrics: crate::metrics::RetryMetrics,
}

impl Shared {
    /// Records a request's first send at `now` (counted, paid into the budget), and
    /// says whether a copy is worth keeping: not for a request marked [`NoRetry`],
    /// which is sent once whatever happens.
    fn first_send<B>(&self, req: &Request<B>, now: Instant) -> bool {
        bump(&self.counters.requests);
        #[cfg(feature = "metrics")]
        self.metrics.attempt(&self.name, 1);
        self.budget.deposit(now);
        req.extensions().get::<NoRetry>().is_none()
    }

    /// gRFC A6: every answer of the server moves the throttle's token count (a
    /// transport error is not the server's answer, and does not).
    fn record_outcome(&self, class: Class, answered: bool) {
        if let Some(throttle) = &self.throttle {
            match class {
                Class::Success => throttle.record_success(),
                Class::Retryable { .. } | Class::DontRetry if answered => throttle.record_failure(),
                _ => {}
            }
        }
    }

    /// A request's outcome handed back after `attempts` attempts, for the metrics.
    fn call_ended(&self, attempts: u32) {
        #[cfg(feature = "metrics")]
        self.metrics
            .call_ended(&self.name, attempts.saturating_sub(1));
        #[cfg(not(feature = "metrics"))]
        let _ = attempts;
    }
}

/// Whether `res` is a success whatever the request: a 2xx without `grpc-status` is one
/// to the gRPC rules and the HTTP rules alike.
fn plain_success<B>(res: &Response<B>) -> bool {
    res.status().is_success() && grpc_status(res.headers()).is_none()
}

/// The retry decisions for HTTP and gRPC requests, as a [`tower::retry::Policy`].
///
/// `RetryPolicy::default()`: 3 attempts, full-jitter backoff from 200 ms to 20 s, a
/// fresh [`RetryBudget`] (wasted retries within 10% of the requests over 10 s, plus an allowance of 1 carried over), 408/429/500/502/503/504 and gRPC
/// UNAVAILABLE retried, Retry-After honoured up to 20 s, bodies replayed up to 64 KiB.
///
/// # Clone
///
/// Clones share the configuration, the budget and the counters (an `Arc`); each
/// request's attempt count and random stream are its own. tower's own `Retry` clones
/// the policy for every request; stormguard's [`Retry`] makes a request its copy only
/// when its first attempt is not a plain success.
///
/// ```
/// use std::time::Duration;
/// use stormguard::{Backoff, Jitter, RetryBudget, RetryPolicy};
///
/// let budget = RetryBudget::builder().ratio(0.1).window(Duration::from_secs(10)).build()?;
/// let policy = RetryPolicy::builder()
///     .max_attempts(3)
///     .backoff(Backoff::new(Duration::from_millis(200), Duration::from_secs(20), Jitter::Full)?)
///     .budget(budget.clone())
///     .build()?;
/// assert_eq!(policy.stats().requests, 0);
/// # Ok::<(), stormguard::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct RetryPolicy {
    shared: Arc<Shared>,
    /// Attempts made for this request so far (0 on the layer's own copy); a transparent
    /// retry is not one.
    attempts: u32,
    /// Whether this request has had its one transparent retry.
    transparent_used: bool,
    /// Retries this request was admitted to make and not yet settled with the budget
    /// (attempts are capped at 100, so they fit): charged as wasted if it ends
    /// unserved, its caller gone included.
    admitted: u8,
    /// When the caller stops waiting: the request's [`Deadline`] or its `grpc-timeout`
    /// counted from its first send, read from the request at its first failure (a
    /// success never needs it).
    deadline: RequestDeadline,
    /// The request's random streams, made at its first retry. Boxed so that the policy,
    /// which tower moves around with every request, stays small (six words) on the
    /// success path.
    streams: Option<Box<Streams>>,
}

/// What bounds one request's retries: the policy's settings, or its gRPC method's.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_attempts: u32,
    backoff: Backoff,
    retryable_grpc_codes: GrpcCodeSet,
}

/// Where a request's deadline stands: tower keeps the request as first sent until its
/// first outcome, so the deadline is read then, from that copy and the instant of the
/// first send, to the same value it would have had at the send.
#[derive(Debug, Clone, Copy)]
enum RequestDeadline {
    /// Not sent yet (the layer's own copy of the policy).
    Unsent,
    /// First sent at this instant; not read yet.
    SentAt(Instant),
    /// Read at the first failure: the [`Deadline`], if the request has one.
    Read(Option<Deadline>),
}

/// One request's random draws: its backoff schedule and the jitter on server hints.
#[derive(Debug, Clone)]
struct Streams {
    schedule: Schedule,
    rng: SmallRng,
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("name", &self.shared.name)
            .field("max_attempts", &self.shared.max_attempts)
            .field("backoff", &self.shared.backoff)
            .field("budget", &self.shared.budget)
            .field("rules", &self.shared.rules)
            .field("max_retry_after", &self.shared.max_retry_after)
            .field("max_replay_bytes", &self.shared.max_replay_bytes)
            .field("attempts", &self.attempts)
            .finish()
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicyBuilder::default().make()
    }
}

/// A request dropped before its end (its caller stopped waiting, mid-backoff or
/// mid-retry) was not served: its retries are charged as wasted.
impl Drop for RetryPolicy {
    fn drop(&mut self) {
        if self.admitted > 0 {
            self.settle(false);
        }
    }
}

impl RetryPolicy {
    /// A builder starting from the defaults.
    pub fn builder() -> RetryPolicyBuilder {
        RetryPolicyBuilder::default()
    }

    /// What this policy and all its clones have done so far.
    pub fn stats(&self) -> RetryStats {
        let c = &self.shared.counters;
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        RetryStats {
            requests: load(&c.requests),
            retries: load(&c.retries),
            exhausted: load(&c.exhausted),
            budget_denied: load(&c.budget_denied),
            permanent: load(&c.permanent),
            not_replayable: load(&c.not_replayable),
            not_idempotent: load(&c.not_idempotent),
            server_refused: load(&c.server_refused),
            deadline: load(&c.deadline),
            transparent_retries: load(&c.transparent_retries),
        }
    }

    /// The dependency's name (the metrics' `service` label).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The budget retries are drawn from.
    pub fn budget(&self) -> &RetryBudget {
        &self.shared.budget
    }

    /// The most bytes of a streaming body kept for replay.
    pub fn max_replay_bytes(&self) -> usize {
        self.shared.max_replay_bytes
    }

    /// This policy's copy for a request first sent at `sent`, as
    /// [`clone_request`](tower::retry::Policy::clone_request) leaves it.
    fn sent_at(&self, sent: Instant) -> RetryPolicy {
        RetryPolicy {
            shared: Arc::clone(&self.shared),
            attempts: 0,
            transparent_used: false,
            admitted: 0,
            deadline: RequestDeadline::SentAt(sent),
            streams: None,
        }
    }

    /// The checks after a retryable outcome, in order; `Ok` holds the server's hint.
    fn may_retry<B>(
        &self,
        req: &Request<B>,
        grpc: bool,
        safe_for_any_method: bool,
        after: Option<Duration>,
        max_attempts: u32,
    ) -> Result<Option<Duration>, GiveUp> {
        let shared = &*self.shared;
        if !(safe_for_any_method || safe_to_repeat(req)) {
            return Err(GiveUp::NotIdempotent);
        }
        let max = if grpc {
            max_attempts.min(GRPC_MAX_ATTEMPTS)
        } else {
            max_attempts
        };
        if self.attempts >= max || crate::signals::outbound_call_once() {
            return Err(GiveUp::Exhausted);
        }
        if !body_replayable(req) {
            return Err(GiveUp::BodyNotReplayable);
        }
        if after.is_some_and(|after| after > shared.max_retry_after) {
            return Err(GiveUp::RetryAfterTooLong);
        }
        Ok(after)
    }

    /// The last checks, once the wait is known: the deadline, then the budget (so a
    /// retry that could never finish asks for nothing), which admits the retry on the
    /// waste so far.
    fn may_wait(&self, now: Instant, delay: Duration) -> Result<(), GiveUp> {
        if self.deadline().is_some_and(|d| !d.allows(now, delay)) {
            return Err(GiveUp::Deadline);
        }
        if let Some(throttle) = &self.shared.throttle {
            if !throttle.allows_retry() {
                return Err(GiveUp::Budget);
            }
        }
        if !self.shared.budget.admit(now, u32::from(self.admitted)) {
            return Err(GiveUp::Budget);
        }
        Ok(())
    }

    /// Charges an attempt that may have cost the server work for nobody (a timeout, a
    /// reset) at once, before its own retry is decided: two wasted retries, whatever
    /// comes next (`stormguard_core::budget::EXPENSIVE_FAILURE`). So a timeout is
    /// retried only where the budget has room for its cost too, as the AWS SDKs ask a
    /// timeout's retry for twice the tokens.
    fn charge_expensive(&self, expensive: bool) {
        if expensive {
            let now = tokio::time::Instant::now().into_std();
            let charge = stormguard_core::budget::EXPENSIVE_FAILURE;
            self.shared.budget.charge(now, charge);
        }
    }

    /// Settles this request's retries with the budget at its end, once: nothing for a
    /// request `served`, every retry it was admitted to make for one that was not (the
    /// last may still have been in flight when its caller gave up).
    fn settle(&mut self, served: bool) {
        let admitted = std::mem::take(&mut self.admitted);
        if !served && admitted > 0 {
            let now = tokio::time::Instant::now().into_std();
            self.shared.budget.charge(now, u32::from(admitted));
        }
    }

    /// The one free retry of a request its server refused before its application saw
    /// it: at once, no attempt spent, nothing withdrawn from the budget.
    fn retry_transparently<B>(&mut self, req: &mut Request<B>, grpc: bool) -> Option<Wait> {
        if !body_replayable(req) {
            self.give_up(GiveUp::BodyNotReplayable, self.attempts + 1);
            return None;
        }
        let now = tokio::time::Instant::now().into_std();
        if self
            .deadline()
            .is_some_and(|d| !d.allows(now, Duration::ZERO))
        {
            self.give_up(GiveUp::Deadline, self.attempts + 1);
            return None;
        }
        self.transparent_used = true;
        if grpc {
            let headers = req.headers_mut();
            headers.insert(GRPC_TRANSPARENT_RETRY_ATTEMPTS, HeaderValue::from(1u32));
            if let Some(deadline) = self.deadline() {
                headers.insert(GRPC_TIMEOUT, grpc_timeout_value(deadline.remaining(now)));
            }
        }
        bump(&self.shared.counters.transparent_retries);
        #[cfg(feature = "metrics")]
        self.shared.metrics.transparent(&self.shared.name);
        tracing::debug!(
            target: "stormguard::retry",
            attempt = self.attempts + 1,
            delay_ms = 0u64,
            reason = "transparent",
            "retrying"
        );
        Some(Wait::now())
    }

    /// Counts an attempt whose outcome was classified `class` (`answered`: the server
    /// answered, with a response rather than a transport error).
    fn count_attempt(&mut self, class: Class, answered: bool) {
        self.attempts += 1;
        self.shared.record_outcome(class, answered);
    }

    /// Hands the outcome back: settles the budget, records why (if it is a give-up)
    /// and the attempt count.
    fn finish<Res, E>(
        &mut self,
        result: &mut Result<Response<Res>, E>,
        attempts: u32,
        why: Option<GiveUp>,
    ) -> Option<Wait> {
        if attempts > 1 {
            if let Ok(res) = result {
                res.extensions_mut().insert(Attempts(attempts));
            }
        }
        self.settle(why.is_none());
        if let Some(why) = why {
            self.give_up(why, attempts);
        }
        self.shared.call_ended(attempts);
        None
    }

    /// The budget as the metrics show it.
    #[cfg(feature = "metrics")]
    fn budget_view(&self) -> crate::metrics::BudgetView {
        let now = tokio::time::Instant::now().into_std();
        let budget = &self.shared.budget;
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

    fn give_up(&self, why: GiveUp, attempts: u32) {
        #[cfg(feature = "metrics")]
        self.shared
            .metrics
            .give_up(&self.shared.name, why, self.budget_view());
        let c = &self.shared.counters;
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
            GiveUp::CircuitOpen => {}
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

    /// The limits for `req`: its gRPC method's when the policy has per-method settings
    /// (no retries for a method the service config does not name, as gRFC A6), else
    /// the policy's own.
    fn limits<B>(&self, req: &Request<B>, grpc: bool) -> Limits {
        let shared = &*self.shared;
        let own = Limits {
            max_attempts: shared.max_attempts,
            backoff: shared.backoff,
            retryable_grpc_codes: shared.rules.retryable_grpc_codes,
        };
        match &shared.methods {
            Some(methods) if grpc => match methods.lookup(req.uri().path()) {
                Some(Some(limits)) => *limits,
                // No retry policy: no code is retryable, so a failure neither retries
                // nor counts against A6's throttle (as grpc-go counts only retryable
                // codes).
                _ => Limits {
                    max_attempts: 1,
                    retryable_grpc_codes: GrpcCodeSet::new(),
                    ..own
                },
            },
            _ => own,
        }
    }

    fn streams(&mut self, backoff: Backoff) -> &mut Streams {
        let shared = &self.shared;
        self.streams.get_or_insert_with(|| {
            Box::new(match shared.seed {
                Some(seed) => {
                    let stream = shared.next_stream.fetch_add(1, Ordering::Relaxed);
                    let seed = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    Streams {
                        schedule: backoff.schedule_seeded(seed),
                        rng: SmallRng::seed_from_u64(!seed),
                    }
                }
                None => Streams {
                    schedule: backoff.schedule(),
                    rng: SmallRng::from_rng(&mut rand::rng()),
                },
            })
        })
    }

    fn next_backoff(&mut self, backoff: Backoff) -> Duration {
        self.streams(backoff)
            .schedule
            .next()
            .unwrap_or(backoff.cap())
    }

    /// Reads the request's deadline, once, from the request as first sent: call it at
    /// the first outcome that is not a success, before the request is changed for a
    /// retry.
    fn read_deadline<B>(&mut self, req: &Request<B>) {
        if let RequestDeadline::SentAt(sent) = self.deadline {
            self.deadline = RequestDeadline::Read(deadline_of(req, sent));
        }
    }

    /// The request's deadline, once [`read_deadline`](Self::read_deadline) has run.
    fn deadline(&self) -> Option<Deadline> {
        match self.deadline {
            RequestDeadline::Read(deadline) => deadline,
            RequestDeadline::Unsent | RequestDeadline::SentAt(_) => None,
        }
    }

    /// Up to 10% more than the server asked for, never less.
    fn stretch(&mut self, backoff: Backoff, hint: Duration) -> Duration {
        let spread = u64::try_from((hint / 10).as_nanos()).unwrap_or(u64::MAX);
        if spread == 0 {
            return hint;
        }
        let extra = self.streams(backoff).rng.random_range(0..spread);
        hint.saturating_add(Duration::from_nanos(extra))
    }
}

/// Builds a [`RetryPolicy`]; every setting has a default.
#[derive(Debug, Clone)]
pub struct RetryPolicyBuilder {
    name: String,
    max_attempts: u32,
    backoff: Backoff,
    budget: Option<RetryBudget>,
    throttle: Option<RetryThrottle>,
    rules: Rules,
    methods: Option<MethodTable<Option<Limits>>>,
    max_retry_after: Option<Duration>,
    max_replay_bytes: usize,
    seed: Option<u64>,
}

impl Default for RetryPolicyBuilder {
    fn default() -> Self {
        RetryPolicyBuilder {
            name: String::from("default"),
            max_attempts: 3,
            backoff: Backoff::default(),
            budget: None,
            throttle: None,
            rules: Rules::default(),
            methods: None,
            max_retry_after: None,
            max_replay_bytes: DEFAULT_MAX_REPLAY_BYTES,
            seed: None,
        }
    }
}

impl RetryPolicyBuilder {
    /// The dependency's name: the `service` label of the `metrics` feature's series
    /// \["default"\].
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Attempts per request, the first included, from 1 to 100 \[3\]. gRPC calls are
    /// further capped at 5 (gRFC A6).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The delays between attempts [200 ms to 20 s, full jitter].
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The budget retries are drawn from; share one (by `clone`) across every client of
    /// a dependency [a budget of its own with the defaults].
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Also throttles retries by gRFC A6's `retryThrottling` \[none\]: every
    /// attempt's outcome moves the throttle's token count (a retryable failure takes
    /// one, a success gives `token_ratio` back), and no retry is made while the count
    /// is at or below half of `max_tokens` (reason `budget`). The budget still applies.
    /// Share one throttle (by `clone`) across the clients of a server, as A6 keeps one
    /// per server.
    ///
    /// ```
    /// use stormguard::RetryPolicy;
    /// use stormguard_core::throttle::RetryThrottle;
    ///
    /// let throttle = RetryThrottle::builder().max_tokens(10.0).token_ratio(0.1).build()?;
    /// let policy = RetryPolicy::builder().throttle(throttle).build()?;
    /// # let _ = policy;
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
    pub fn throttle(mut self, throttle: RetryThrottle) -> Self {
        self.throttle = Some(throttle);
        self
    }

    /// The HTTP statuses worth another attempt [408, 429, 500, 502, 503, 504].
    pub fn retryable_statuses(mut self, statuses: StatusSet) -> Self {
        self.rules.retryable_statuses = statuses;
        self
    }

    /// The gRPC codes worth another attempt \[UNAVAILABLE\].
    pub fn retryable_grpc_codes(mut self, codes: stormguard_core::classify::GrpcCodeSet) -> Self {
        self.rules.retryable_grpc_codes = codes;
        self
    }

    /// Per-method retry policies for gRPC calls, as a service config's `methodConfig`
    /// gives them \[none: every call has the policy's own settings\].
    ///
    /// A gRPC call's failure is then judged by its method's entry, found by the
    /// request's `:path` ([`MethodTable::lookup`]): a
    /// [`MethodPolicy::Retry`] gives its attempts (still at most 5), backoff and
    /// retryable codes; a method with any other entry, or none, is not retried, as
    /// gRFC A6 has it: no code is retryable for it (give-up reason `permanent`), and
    /// its transparent retry still applies. Budget, throttle, replay
    /// cap and `max_retry_after` stay the policy's. Requests that are not gRPC keep the
    /// policy's own settings. The lookup happens only when a call fails.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard::RetryPolicy;
    /// use stormguard_core::methods::{GrpcRetryPolicy, MethodPolicy, MethodTable};
    /// use stormguard_core::{classify::GrpcCodeSet, Backoff, Jitter};
    ///
    /// let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1), Jitter::Full)?;
    /// let mut methods = MethodTable::new();
    /// methods.insert_service(
    ///     "echo.Echo",
    ///     MethodPolicy::Retry(GrpcRetryPolicy::new(4, backoff, GrpcCodeSet::retryable_default())?),
    /// );
    /// let policy = RetryPolicy::builder().grpc_methods(&methods).build()?;
    /// # let _ = policy;
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
    pub fn grpc_methods(mut self, methods: &MethodTable<MethodPolicy>) -> Self {
        self.methods = Some(methods.map(|entry| match entry {
            MethodPolicy::Retry(retry) => Some(Limits {
                max_attempts: retry.max_attempts,
                backoff: retry.backoff,
                retryable_grpc_codes: retry.codes,
            }),
            _ => None,
        }));
        self
    }

    /// The longest `Retry-After` or pushback the client will wait for; a longer one
    /// returns the response to the caller at once [the backoff cap].
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = Some(max);
        self
    }

    /// The most bytes of a streaming request body kept for replay [64 KiB]; a larger
    /// body is sent once and not retried.
    pub fn max_replay_bytes(mut self, bytes: usize) -> Self {
        self.max_replay_bytes = bytes;
        self
    }

    /// Draws every request's jitter from streams derived from `seed`, for reproducible
    /// tests and simulations [fresh entropy per request].
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Checks the settings and makes the policy.
    pub fn build(self) -> Result<RetryPolicy, ConfigError> {
        if !(1..=100).contains(&self.max_attempts) {
            return Err(ConfigError::invalid(
                "max_attempts",
                self.max_attempts,
                "from 1 to 100",
            ));
        }
        Ok(self.make())
    }

    fn make(self) -> RetryPolicy {
        let budget = self.budget.unwrap_or_default();
        RetryPolicy {
            shared: Arc::new(Shared {
                name: self.name,
                max_attempts: self.max_attempts,
                max_retry_after: self.max_retry_after.unwrap_or(self.backoff.cap()),
                backoff: self.backoff,
                #[cfg(feature = "metrics")]
                metrics: crate::metrics::RetryMetrics::new(
                    self.methods
                        .iter()
                        .flat_map(|methods| methods.values().flatten())
                        .map(|limits| limits.max_attempts.min(GRPC_MAX_ATTEMPTS))
                        .fold(self.max_attempts, u32::max),
                    budget.name(),
                ),
                budget,
                throttle: self.throttle,
                rules: self.rules,
                methods: self.methods,
                max_replay_bytes: self.max_replay_bytes,
                seed: self.seed,
                next_stream: AtomicU64::new(0),
                counters: Counters::default(),
            }),
            attempts: 0,
            admitted: 0,
            transparent_used: false,
            deadline: RequestDeadline::Unsent,
            streams: None,
        }
    }
}

/// Whether `req` may be sent more than once whatever its outcome: an idempotent method
/// (RFC 9110), an `Idempotency-Key`, or the [`Idempotent`] extension.
pub(crate) fn safe_to_repeat<B>(req: &Request<B>) -> bool {
    is_idempotent(req.method(), req.headers()) || req.extensions().get::<Idempotent>().is_some()
}

/// The request's deadline: the earlier of its [`Deadline`] extension and its
/// `grpc-timeout` counted from `now`, whichever it has.
fn deadline_of<B>(req: &Request<B>, now: Instant) -> Option<Deadline> {
    let given = req.extensions().get::<Deadline>().copied();
    let grpc = req
        .headers()
        .get(GRPC_TIMEOUT)
        .and_then(parse_grpc_timeout)
        .map(|timeout| Deadline::after(now, timeout));
    // With both, the caller stops waiting at the earlier (as gRPC takes the earlier of a
    // call's timeout and the deadline it inherits).
    match (given, grpc) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Whether the request's body can be sent again (always, but for a [`ReplayBody`]
/// that went over its cap or was not sent whole).
///
/// [`ReplayBody`]: crate::ReplayBody
fn body_replayable<B>(req: &Request<B>) -> bool {
    req.extensions()
        .get::<ReplayHandle>()
        .is_none_or(ReplayHandle::is_replayable)
}

/// The wait before a retry: the [`tower::retry::Policy::Future`] of [`RetryPolicy`].
///
/// A backoff or server-requested delay on tokio's clock, or no wait at all for a
/// transparent retry.
#[derive(Debug)]
pub struct Wait {
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Wait {
    fn now() -> Self {
        Wait { sleep: None }
    }

    fn sleep(delay: Duration) -> Self {
        Wait {
            sleep: Some(Box::pin(tokio::time::sleep(delay))),
        }
    }
}

impl Future for Wait {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match &mut self.sleep {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}

/// Whether `req` is a gRPC call, by its content type.
pub(crate) fn is_grpc<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

impl<B, ResB, E> tower::retry::Policy<Request<B>, Response<ResB>, E> for RetryPolicy
where
    B: Clone,
    E: 'static,
{
    type Future = Wait;

    fn retry(
        &mut self,
        req: &mut Request<B>,
        result: &mut Result<Response<ResB>, E>,
    ) -> Option<Wait> {
        if result.as_ref().is_ok_and(plain_success) {
            // Nothing else about the request or the response matters.
            self.count_attempt(Class::Success, true);
            return self.finish(result, self.attempts, None);
        }
        let grpc = is_grpc(req);
        // The policy's attempts, backoff and codes, or the gRPC method's own.
        let limits = self.limits(req, grpc);
        // Whether repeating the request is safe whatever its method: the failure proves
        // the application never saw it, or gRPC declared its code retryable (gRFC A6
        // leaves that judgement to the configured codes).
        // The wait decided by an open circuit's break, if the failure was one.
        let mut after_break = None;
        let (class, safe_for_any_method, expensive) = match result {
            Ok(res) if grpc => {
                let rules = Rules {
                    retryable_grpc_codes: limits.retryable_grpc_codes,
                    ..self.shared.rules
                };
                (
                    rules.classify_grpc_response(res.status(), res.headers()),
                    true,
                    false,
                )
            }
            Ok(res) => {
                let rules = &self.shared.rules;
                let class = rules.classify_with(res.status(), res.headers(), SystemTime::now);
                (class, false, false)
            }
            Err(err) => match classify_error(err) {
                ErrorClass::Unprocessed if !self.transparent_used => {
                    self.read_deadline(req);
                    return self.retry_transparently(req, grpc);
                }
                ErrorClass::Unprocessed | ErrorClass::NotSent => {
                    (Class::Retryable { after: None }, true, false)
                }
                // A timeout or a reset: the server may have done the work for nobody.
                ErrorClass::MaybeProcessed => (Class::Retryable { after: None }, false, true),
                ErrorClass::CircuitOpen => {
                    // A break that ends before the backoff would anyway is waited out:
                    // the circuit admits its probe meanwhile, so the retry adds no
                    // load, and a blip's requests are not lost to it. A longer break
                    // fails fast.
                    let remaining = crate::error_class::circuit_open_remaining(err);
                    let delay = self.next_backoff(limits.backoff);
                    match remaining {
                        Some(remaining) if remaining <= delay => {
                            after_break = Some(delay);
                            (Class::Retryable { after: None }, true, false)
                        }
                        _ => {
                            return self.finish(
                                result,
                                self.attempts + 1,
                                Some(GiveUp::CircuitOpen),
                            )
                        }
                    }
                }
                ErrorClass::Local | ErrorClass::Unknown => (Class::Permanent, false, false),
            },
        };
        self.count_attempt(class, result.is_ok());
        self.charge_expensive(expensive);
        let attempts = self.attempts;
        let decision = match class {
            Class::Success => return self.finish(result, attempts, None),
            Class::Permanent => Err(GiveUp::Permanent),
            Class::DontRetry if grpc => Err(GiveUp::Pushback),
            Class::DontRetry => Err(GiveUp::DontRetry),
            Class::Retryable { after } => {
                self.may_retry(req, grpc, safe_for_any_method, after, limits.max_attempts)
            }
        };
        let after = match decision {
            Ok(after) => after,
            Err(why) => return self.finish(result, attempts, Some(why)),
        };
        // Read once a retry is in view, before any header of the request is rewritten.
        self.read_deadline(req);
        let backoff = limits.backoff;
        let delay = match (after_break, after) {
            (Some(wait), _) => wait,
            (None, Some(exact)) if grpc => {
                // gRFC A6: after the server's own wait, the backoff starts over.
                self.streams(backoff).schedule.restart();
                exact
            }
            (None, Some(hint)) => {
                let delay = self.next_backoff(backoff);
                delay.max(self.stretch(backoff, hint))
            }
            (None, None) => self.next_backoff(backoff),
        };
        let now = tokio::time::Instant::now().into_std();
        if let Err(why) = self.may_wait(now, delay) {
            return self.finish(result, attempts, Some(why));
        }
        let headers = req.headers_mut();
        if grpc {
            headers.insert(GRPC_PREVIOUS_RPC_ATTEMPTS, HeaderValue::from(attempts));
            if let Some(deadline) = self.deadline() {
                let left = deadline.remaining(now + delay);
                headers.insert(GRPC_TIMEOUT, grpc_timeout_value(left));
            }
        } else {
            headers.insert(X_ATTEMPT_COUNT, HeaderValue::from(attempts + 1));
        }
        self.admitted = self.admitted.saturating_add(1);
        bump(&self.shared.counters.retries);
        #[cfg(feature = "metrics")]
        {
            let (shared, view) = (&self.shared, self.budget_view());
            let metrics = &shared.metrics;
            metrics.attempt(&shared.name, attempts + 1);
            metrics.retry(&shared.name, delay, view);
        }
        let status = result.as_ref().ok().map(|res| res.status().as_u16());
        tracing::info!(
            target: "stormguard::retry",
            attempt = attempts + 1,
            delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            reason = if status.is_some() { "status" } else { "error" },
            status,
            "retrying"
        );
        Some(Wait::sleep(delay))
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        if self.attempts == 0 && !self.transparent_used {
            let now = tokio::time::Instant::now().into_std();
            if !self.shared.first_send(req, now) {
                return None;
            }
            self.deadline = RequestDeadline::SentAt(now);
        }
        Some(req.clone())
    }
}
