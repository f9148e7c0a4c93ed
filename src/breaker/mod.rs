//! A circuit breaker: stop calling a dependency that is failing, and find out when it
//! has recovered.
//!
//! [`CircuitBreakerLayer`] counts the outcomes of the calls to one dependency in a
//! [`CircuitBreaker`] that every clone shares. Once too many fail, the circuit *opens*:
//! for a break, calls fail at once with [`CircuitOpen`] without reaching the dependency.
//! When the break is over the circuit is *half-open*: `probes` calls (1 by default) go
//! through, however many callers race for them; if they succeed the circuit *closes*, if
//! one fails it opens again. By default it opens after `consecutive_failures` (50)
//! failures in a row, or when, over its window (2 s), at least `min_throughput` (20) calls
//! were made and at least `failure_ratio` (0.95) of them failed; a break lasts 25 ms plus
//! up to 20% jitter, so that a fleet's breakers do not probe in lockstep. The rules live in
//! [`stormguard_core::breaker`], a state machine with time passed in; this module drives
//! it from a Tower service with tokio's clock (so paused time in tests works).
//!
//! # Why fail fast
//!
//! Retries help with blips. When a dependency is down or overloaded, every call and every
//! retry adds to its load while each caller waits out its timeout for nothing. Failing
//! fast spares both: the dependency gets room to recover, and the caller hears at once and
//! can fall back ([`remaining`](CircuitOpen::remaining) says when the next probe is due)
//! instead of holding its requests, memory and connections for as long as the outage
//! lasts. The defaults trip on a dependency that is down, not on one that fails some
//! requests (shedding those would lose the ones that succeed), and keep breaks short,
//! because a break is how long the client stays blind to the dependency's return.
//!
//! # Where it goes in the stack
//!
//! ```rust
//! use std::time::Duration;
//!
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use stormguard::breaker::BreakerConfig;
//! use stormguard::{CircuitBreaker, CircuitBreakerLayer, CircuitOpen, RetryLayer, RetryPolicy};
//! use tower::{BoxError, ServiceBuilder, ServiceExt};
//!
//! async fn fetch(url: &str, breaker: &CircuitBreaker) -> Result<http::StatusCode, BoxError> {
//!     let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//!     let svc = ServiceBuilder::new()
//!         // Total, for the caller: what the caller can wait. Put a `Deadline` of the same
//!         // length in the request so that no retry is scheduled past it.
//!         .timeout(Duration::from_secs(10))
//!         .layer(RetryLayer::new(RetryPolicy::default()))     // one retry point
//!         .layer(CircuitBreakerLayer::new(breaker.clone()))   // fails fast while open
//!         // Per attempt: set it above the dependency's slowest healthy answer; a hung call
//!         // then ends as a timeout, which the breaker counts as a failure.
//!         .timeout(Duration::from_secs(2))
//!         .service(client);
//!
//!     match svc.oneshot(http::Request::get(url).body(Full::default())?).await {
//!         Ok(response) => Ok(response.status()),
//!         // Shed at once while the dependency is down: never retried, never queued.
//!         Err(err) if err.is::<CircuitOpen>() => Ok(http::StatusCode::SERVICE_UNAVAILABLE),
//!         Err(err) => Err(err),
//!     }
//! }
//!
//! fn breaker() -> Result<CircuitBreaker, stormguard::ConfigError> {
//!     // The defaults, the same breaker as `CircuitBreaker::default()`; the guide's defaults
//!     // page (docs/defaults.md in the repository) has the measurements behind each.
//!     let state_machine = BreakerConfig::builder()
//!         // Failures in a row: a total outage (or a blip) makes the run at once, random
//!         // failures seldom do, even when most calls fail. Do not lower it: a shorter
//!         // run trips on heavy partial outages, whose requests still succeed now and then.
//!         .consecutive_failures(50)
//!         // The backstop for clients too slow to see 50 failures in a row; keep it high:
//!         // a lower ratio sheds the first tries of a partial outage, which would often
//!         // have succeeded, and serves less than not retrying.
//!         .failure_ratio(0.95)
//!         // Keep it short: a long window full of healthy calls needs seconds of
//!         // failures to reach the ratio.
//!         .window(Duration::from_secs(2))
//!         // Calls the window needs before the ratio counts. A client slower than that
//!         // never trips on the ratio, and need not: its retry budget alone bounds its load.
//!         .min_throughput(20)
//!         // How long the client stays blind to the dependency's return (plus up to 20%
//!         // jitter), for one fast-failing probe per break during an outage. Raise it (and
//!         // `max_break_duration`) only where probes are expensive: long breaks outlast
//!         // the outage they were meant to ride out.
//!         .break_duration(Duration::from_millis(25));
//!     CircuitBreaker::builder()
//!         .config(state_machine)
//!         .build()
//! }
//! ```
//!
//! - **Below the retry layer**, so that a request has one retry point and every attempt
//!   passes through the breaker: a failing dependency trips it sooner, and while the
//!   circuit is open each attempt fails at once. The retry layer waits out a short break
//!   and fails fast past [`FAIL_FAST_AFTER`](crate::sans_io::breaker::FAIL_FAST_AFTER)
//!   (see the [`retry` module](crate::retry#an-open-circuit-below)).
//! - **Above the per-attempt timeout**, so that a hung call ends as a timeout, which counts
//!   as a failure; a call dropped from above counts as nothing.
//! - **Inside the total timeout**, which bounds what the caller waits in all (with a
//!   [`Deadline`](crate::Deadline) beside it: [`retry`](crate::retry#deadlines)).
//!
//! # What counts as a failure
//!
//! - Responses whose status is in [`StatusSet::breaker_default()`] (408, 429 and every
//!   5xx), or whose `grpc-status` is in [`GrpcCodeSet::breaker_default()`]; both sets can
//!   be replaced on the builder.
//! - Every error from the inner service (connection refused, reset, timeout...), except a
//!   [`CircuitOpen`] in its `source()` chain: a breaker nested below already counted it.
//! - A call the dependency turned away unprocessed (an HTTP/2 `REFUSED_STREAM`, a GOAWAY
//!   the call's stream was above, a request its closing connection never wrote) counts
//!   only toward the failures in a row, which a success ends: a graceful drain does not
//!   trip the circuit, while a dependency that refuses every stream does (after 50 by
//!   default). Drains back to back on one connection can turn away 50 calls before one
//!   succeeds: a server draining every 10 calls, with 32 in flight on a tonic `Channel`'s
//!   one connection, opened the circuit for a break once in 150 runs.
//!
//! Other 4xx responses (and gRPC codes outside the set, such as `INVALID_ARGUMENT`) are the
//! caller's fault and say nothing of the dependency's health: they are *ignored*, neither
//! failures nor successes, so a client sending bad requests neither trips the breaker nor
//! dilutes the failure ratio. Everything else (1xx to 3xx, `grpc-status: 0`) is a success.
//!
//! # gRPC: the status in the trailers
//!
//! For a `200` gRPC response with no `grpc-status` in its head, the breaker reads the
//! status in the trailers as the body goes by ([`ResponseBody`], which buffers nothing)
//! and counts it by the same rules; a body dropped before its end is neither a success nor
//! a failure. A half-open probe is decided at its first message or its end, whichever
//! comes first. Every other response is decided at its head.
//!
//! # Failing fast, or waiting
//!
//! While the circuit refuses calls, `poll_ready` is ready at once and `call` fails with
//! [`CircuitOpen`] (tower's `LoadShed` pattern), so callers never queue for a dependency
//! already considered down. With
//! [`wait_when_open(true)`](CircuitBreakerBuilder::wait_when_open), `poll_ready` returns
//! `Pending` instead until a call may go through: for a worker pulling from a queue, which
//! would rather pause than burn through its messages.
//!
//! # Observing it
//!
//! Every transition is a `tracing` event on target `stormguard::breaker` and a call of
//! the [`on_transition`](CircuitBreakerBuilder::on_transition) callback (which can feed a
//! `tokio::sync::watch` channel for tasks that wait on the state), and, under the
//! `metrics` feature, a series. [`stats`](CircuitBreaker::stats)
//! counts calls, failures, rejections and transitions; an operator can force the circuit
//! open with [`isolate`](CircuitBreaker::isolate) or closed with
//! [`reset`](CircuitBreaker::reset). The Open to HalfOpen transition is lazy:
//! [`state`](CircuitBreaker::state) reads `HalfOpen` once the break is over, and the event
//! comes with the next call.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Response;
use stormguard_core::breaker::{Breaker, Outcome, Permit};
use stormguard_core::classify::grpc_status;
use stormguard_core::Class;
use tokio::sync::Notify;

mod body;
mod builder;
pub mod future;
mod layer;
mod service;

pub use crate::circuit_open::CircuitOpen;
pub use body::ResponseBody;
pub use builder::CircuitBreakerBuilder;
pub use layer::CircuitBreakerLayer;
pub use service::CircuitBreakerService;
pub use stormguard_core::breaker::{BreakerConfig, BreakerConfigBuilder, CircuitState, Transition};

use crate::error_class::ErrorClass;
use crate::BoxError;
use stormguard_core::classify::{GrpcCodeSet, StatusSet};

type Callback = Arc<dyn Fn(Transition) + Send + Sync>;

/// When a response's outcome is known.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// From its head.
    Now(Outcome),
    /// At the end of its body: a gRPC response whose status is in its trailers.
    AtEnd,
}

/// The time now, by tokio's clock (which tests may pause), as a std `Instant`.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Counters of a [`CircuitBreaker`], from [`CircuitBreaker::stats`], since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BreakerStats {
    /// Calls let through to the inner service (probes included).
    pub calls: u64,
    /// Calls whose outcome was classified as a failure (counted by the window or not:
    /// outcomes of calls that outlived the closed period they started in are not).
    pub failures: u64,
    /// Calls refused with [`CircuitOpen`].
    pub rejected: u64,
    /// Calls the dependency turned away unprocessed (an HTTP/2 `REFUSED_STREAM`, a
    /// GOAWAY the call was above), which count only in a run of failures in a row (see
    /// [`Outcome::Refused`]).
    pub refused: u64,
    /// State transitions.
    pub transitions: u64,
}

struct Shared {
    /// The dependency's name, the `dependency` label of the metrics.
    name: String,
    breaker: Breaker,
    failure_statuses: StatusSet,
    failure_grpc_codes: GrpcCodeSet,
    wait_when_open: bool,
    on_transition: Option<Callback>,
    /// The classifiers asked before the failure sets.
    classifiers: crate::classify::Classifiers,
    /// Woken on every transition and whenever a probe slot frees up.
    changed: Arc<Notify>,
    calls: AtomicU64,
    failures: AtomicU64,
    rejected: AtomicU64,
    refused: AtomicU64,
    transitions: AtomicU64,
    #[cfg(feature = "metrics")]
    metrics: crate::metrics::BreakerMetrics,
}

/// A circuit breaker: the shared state behind [`CircuitBreakerLayer`], and the handle to
/// watch and steer it.
///
/// Build it with [`CircuitBreaker::builder`] (or [`CircuitBreaker::default`]), hand a
/// clone to [`CircuitBreakerLayer::new`], and keep one to read [`state`](Self::state) and
/// [`stats`](Self::stats) or to [`isolate`](Self::isolate) and [`reset`](Self::reset)
/// the circuit. See the [module docs](self) for the rules.
///
/// # Clone
///
/// Clones share one state (an `Arc`): every service made from the same breaker, on any
/// thread, counts into the same window and sees the same circuit. Build a separate
/// breaker for each dependency you want to trip separately.
#[derive(Clone)]
pub struct CircuitBreaker {
    shared: Arc<Shared>,
}

impl Default for CircuitBreaker {
    /// A breaker with the default settings of [`CircuitBreakerBuilder`].
    fn default() -> Self {
        CircuitBreaker::builder().assemble(BreakerConfig::default())
    }
}

impl fmt::Debug for CircuitBreaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("name", &self.shared.name)
            .field("state", &self.state())
            .field("stats", &self.stats())
            .field("config", self.shared.breaker.config())
            .field("failure_statuses", &self.shared.failure_statuses)
            .field("failure_grpc_codes", &self.shared.failure_grpc_codes)
            .field("wait_when_open", &self.shared.wait_when_open)
            .finish_non_exhaustive()
    }
}

impl CircuitBreaker {
    /// A builder with the defaults: open after 50 failures in a row, or when at least
    /// 20 calls over a 2 s window saw 95% fail; 25 ms breaks with 20% jitter, one probe; failures
    /// as described in the [module docs](self), failing fast while open.
    pub fn builder() -> CircuitBreakerBuilder {
        CircuitBreakerBuilder {
            name: String::from("default"),
            config: BreakerConfig::builder(),
            failure_statuses: StatusSet::breaker_default(),
            failure_grpc_codes: GrpcCodeSet::breaker_default(),
            wait_when_open: false,
            on_transition: None,
            seed: None,
            classifiers: crate::classify::Classifiers::default(),
        }
    }

    /// The dependency's name (the metrics' `dependency` label).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The state of the circuit now, by tokio's clock. An open circuit whose break is
    /// over reads as `HalfOpen`.
    pub fn state(&self) -> CircuitState {
        self.shared.breaker.state(now())
    }

    /// Forces the circuit open: every call is refused with [`CircuitOpen`] until
    /// [`reset`](Self::reset). Returns the transition, or `None` if it was already
    /// isolated.
    pub fn isolate(&self) -> Option<Transition> {
        let transition = self.shared.breaker.isolate();
        self.emit(transition);
        transition
    }

    /// Forces the circuit closed, with an empty window and the break back to its base
    /// length. Returns the transition, or `None` if it was already closed.
    pub fn reset(&self) -> Option<Transition> {
        let transition = self.shared.breaker.reset();
        self.emit(transition);
        transition
    }

    /// The counters so far.
    pub fn stats(&self) -> BreakerStats {
        let s = &self.shared;
        BreakerStats {
            calls: s.calls.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            rejected: s.rejected.load(Ordering::Relaxed),
            refused: s.refused.load(Ordering::Relaxed),
            transitions: s.transitions.load(Ordering::Relaxed),
        }
    }

    /// The state-machine settings.
    pub fn config(&self) -> &BreakerConfig {
        self.shared.breaker.config()
    }

    /// Leave for one call, held by a guard that reports the call's outcome or gives the
    /// permit back; or the circuit's refusal. The transition either caused is told.
    fn acquire(&self) -> Result<future::Guard, stormguard_core::breaker::Rejected> {
        match self.shared.breaker.try_acquire_with(now) {
            Ok(permit) => {
                let transition = permit.transition();
                // Guarded before the transition is told: a callback that panics unwinds
                // through the guard, which gives a half-open probe slot back.
                let guard = future::Guard::new(self.clone(), permit);
                self.shared.calls.fetch_add(1, Ordering::Relaxed);
                self.emit(transition);
                Ok(guard)
            }
            Err(rejected) => {
                self.emit(rejected.transition);
                Err(rejected)
            }
        }
    }

    /// Asks for leave to call the inner service; a refusal is a rejected call.
    fn try_acquire(&self) -> Result<future::Guard, CircuitOpen> {
        self.acquire().map_err(|rejected| {
            self.shared.rejected.fetch_add(1, Ordering::Relaxed);
            self.circuit_open(rejected)
        })
    }

    /// Leave for one call if the circuit gives it now, for a `poll_ready` that waits for
    /// it ([`wait_when_open`](CircuitBreakerBuilder::wait_when_open)): a refusal is not a
    /// rejected call (the caller waits on), and is not counted.
    fn reserve(&self) -> Option<future::Guard> {
        self.acquire().ok()
    }

    /// The refusal of a call `poll_ready` found the circuit refusing, counted as a
    /// rejection.
    fn refusal(&self) -> CircuitOpen {
        self.shared.rejected.fetch_add(1, Ordering::Relaxed);
        match self.shared.breaker.check_with(now) {
            Err(rejected) => self.circuit_open(rejected),
            // The break ended in between: the caller may come again at once.
            Ok(()) => CircuitOpen {
                state: self.state(),
                break_duration: self.config().break_duration(),
                ..CircuitOpen::new(Duration::ZERO)
            },
        }
    }

    /// This breaker's refusal, with its configured break.
    fn circuit_open(&self, rejected: stormguard_core::breaker::Rejected) -> CircuitOpen {
        CircuitOpen {
            remaining: rejected.remaining,
            state: rejected.state,
            open_for: rejected.open_for,
            failing_for: rejected.failing_for,
            break_duration: self.config().break_duration(),
        }
    }

    /// Leave for one call, held by a guard that reports its outcome (or, dropped first,
    /// gives the permit back): for glue that is not a tower service (the reqwest
    /// middleware).
    #[cfg(feature = "reqwest")]
    pub(crate) fn admit(&self) -> Result<future::Guard, CircuitOpen> {
        self.try_acquire()
    }

    /// The outcome of a response, from its head (a status in trailers is read as a
    /// success: only the tower layer watches bodies).
    #[cfg(feature = "reqwest")]
    pub(crate) fn outcome_of_head(
        &self,
        status: http::StatusCode,
        headers: &http::HeaderMap,
    ) -> Outcome {
        match self.classify_head(status, headers) {
            Verdict::Now(outcome) => outcome,
            Verdict::AtEnd => Outcome::Success,
        }
    }

    /// Reports the outcome of a call made with `permit`.
    fn record(&self, permit: Permit, outcome: Outcome) {
        let probe = permit.is_probe();
        match outcome {
            Outcome::Failure => self.shared.failures.fetch_add(1, Ordering::Relaxed),
            Outcome::Refused => self.shared.refused.fetch_add(1, Ordering::Relaxed),
            Outcome::Success | Outcome::Ignored => 0,
        };
        let transition = self.shared.breaker.record(permit, outcome, now());
        if probe && transition.is_none() {
            // A slot may have freed up for a waiting caller.
            self.shared.changed.notify_waiters();
        }
        self.emit(transition);
    }

    /// Gives back the permit of a call that was dropped before it finished.
    fn release(&self, permit: Permit) {
        let probe = permit.is_probe();
        self.shared.breaker.release(permit);
        if probe {
            self.shared.changed.notify_waiters();
        }
    }

    fn classify_response<B>(&self, response: &Response<B>) -> Verdict {
        self.classify_head(response.status(), response.headers())
    }

    fn classify_head(&self, status: http::StatusCode, headers: &http::HeaderMap) -> Verdict {
        if stormguard_core::classify::status_in_trailers(status, headers) {
            // A gRPC status still to come decides, at the end of the stream.
            return Verdict::AtEnd;
        }
        let classifiers = &self.shared.classifiers;
        if classifiers.any() {
            if let Some(class) = classifiers.response(status, headers) {
                return Verdict::Now(match class {
                    Class::Retryable { .. } | Class::DontRetry => Outcome::Failure,
                    Class::Success => Outcome::Success,
                    Class::Permanent => Outcome::Ignored,
                });
            }
        }
        if let Some(code) = grpc_status(headers) {
            return Verdict::Now(self.grpc_outcome(code));
        }
        Verdict::Now(if self.shared.failure_statuses.contains(status) {
            Outcome::Failure
        } else if status.is_client_error() || status.is_server_error() {
            Outcome::Ignored
        } else {
            Outcome::Success
        })
    }

    /// What a `grpc-status` of `code`, in a response's head or its trailers, is.
    fn grpc_outcome(&self, code: i32) -> Outcome {
        if code == 0 {
            Outcome::Success
        } else if self.shared.failure_grpc_codes.contains(code) {
            Outcome::Failure
        } else {
            Outcome::Ignored
        }
    }

    /// Every error is the dependency's failure, but a nested breaker's refusal, which
    /// that breaker has already counted, the caller's own, and a call the dependency
    /// turned away unprocessed, which counts only in a run of failures in a row.
    pub(crate) fn classify_error(&self, error: &(dyn std::error::Error + 'static)) -> Outcome {
        match crate::error_class::classify_chain(error) {
            // A nested breaker counted it already; a request body that failed on the
            // caller's side says nothing about the dependency's health.
            ErrorClass::CircuitOpen | ErrorClass::Local => Outcome::Ignored,
            // A refused stream or a draining connection: one is a graceful drain, an
            // unbroken run is a dependency that refuses everything.
            ErrorClass::Unprocessed | ErrorClass::Drained => Outcome::Refused,
            // Anything else is a failure, unless a classifier of the user's says the
            // error is not the dependency's.
            _ => match self.shared.classifiers.error(error) {
                Some(crate::classify::Failure::Permanent) => Outcome::Ignored,
                _ => Outcome::Failure,
            },
        }
    }

    /// Tells everyone about a transition, if there was one (on nearly every call there
    /// is none: this much is inlined).
    #[inline]
    fn emit(&self, transition: Option<Transition>) {
        if let Some(t) = transition {
            self.announce(t);
        }
    }

    /// Tells everyone about a transition.
    #[cold]
    fn announce(&self, t: Transition) {
        let s = &self.shared;
        s.transitions.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        s.metrics.transition(&s.name, t.from, t.to);
        match t.to {
            CircuitState::Open | CircuitState::Isolated => tracing::warn!(
                target: "stormguard::breaker",
                from = %t.from,
                to = %t.to,
                "circuit breaker state changed"
            ),
            CircuitState::Closed | CircuitState::HalfOpen => tracing::info!(
                target: "stormguard::breaker",
                from = %t.from,
                to = %t.to,
                "circuit breaker state changed"
            ),
        }
        // Waiters hear of it first: the user's callback runs last, so that one that
        // panics leaves nothing of the breaker's undone.
        s.changed.notify_waiters();
        if let Some(callback) = &s.on_transition {
            callback(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn response(status: u16, grpc: Option<&'static str>) -> Response<()> {
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::from_u16(status).expect("status");
        if let Some(code) = grpc {
            response
                .headers_mut()
                .insert("grpc-status", http::HeaderValue::from_static(code));
        }
        response
    }

    #[test]
    fn classifies_responses() {
        let breaker = CircuitBreaker::default();
        let outcome = |status, grpc| match breaker.classify_response(&response(status, grpc)) {
            Verdict::Now(outcome) => outcome,
            Verdict::AtEnd => panic!("no gRPC content type: known from the head"),
        };
        for s in [200, 204, 301, 304] {
            assert_eq!(outcome(s, None), Outcome::Success, "{s}");
        }
        for s in [408, 429, 500, 501, 502, 503, 504, 599] {
            assert_eq!(outcome(s, None), Outcome::Failure, "{s}");
        }
        for s in [400, 401, 403, 404, 409, 422] {
            assert_eq!(outcome(s, None), Outcome::Ignored, "{s}");
        }
        assert_eq!(outcome(200, Some("0")), Outcome::Success);
        assert_eq!(outcome(200, Some("14")), Outcome::Failure);
        assert_eq!(outcome(200, Some("4")), Outcome::Failure);
        assert_eq!(outcome(200, Some("3")), Outcome::Ignored);
        assert_eq!(outcome(200, Some("5")), Outcome::Ignored);
        // grpc-status wins over the HTTP status.
        assert_eq!(outcome(503, Some("0")), Outcome::Success);
    }

    #[test]
    fn a_grpc_response_without_a_status_in_its_head_is_decided_at_its_end() {
        let breaker = CircuitBreaker::default();
        let verdict = |status, content_type: &'static str, grpc| {
            let mut response = response(status, grpc);
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(content_type),
            );
            breaker.classify_response(&response)
        };
        for grpc in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;x=1",
        ] {
            assert_eq!(verdict(200, grpc, None), Verdict::AtEnd, "{grpc}");
            // Trailers-only: the status is in the head.
            assert_eq!(
                verdict(200, grpc, Some("14")),
                Verdict::Now(Outcome::Failure)
            );
            // Not 200: what HTTP says.
            assert_eq!(verdict(503, grpc, None), Verdict::Now(Outcome::Failure));
        }
        for other in [
            "application/grpc-web",
            "application/grpcx",
            "application/json",
        ] {
            assert_eq!(
                verdict(200, other, None),
                Verdict::Now(Outcome::Success),
                "{other}"
            );
        }
    }

    #[test]
    fn classifies_errors() {
        #[derive(Debug)]
        struct Wrapper(CircuitOpen);
        impl fmt::Display for Wrapper {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            CircuitBreaker::default().classify_error(&refused),
            Outcome::Failure
        );
        let nested = Wrapper(CircuitOpen::new(Duration::from_secs(1)));
        assert_eq!(
            CircuitBreaker::default().classify_error(&nested),
            Outcome::Ignored
        );
        let direct = CircuitOpen::new(Duration::ZERO);
        assert_eq!(
            CircuitBreaker::default().classify_error(&direct),
            Outcome::Ignored
        );
    }

    #[test]
    fn circuit_open_messages() {
        let open = |state| CircuitOpen {
            remaining: Duration::from_millis(1500),
            state,
            open_for: Duration::from_secs(3),
            failing_for: Duration::from_secs(3),
            break_duration: Duration::from_millis(25),
        };
        assert_eq!(
            open(CircuitState::Open).to_string(),
            "circuit breaker open: next probe in 1.5s"
        );
        assert_eq!(
            open(CircuitState::HalfOpen).to_string(),
            "circuit breaker half-open: every probe slot is taken"
        );
        assert_eq!(
            open(CircuitState::Isolated).to_string(),
            "circuit breaker isolated"
        );
    }
}
