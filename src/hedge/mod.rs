//! Hedged requests: [`HedgeLayer`] and its [`HedgePolicy`].
//!
//! Most of a service's tail latency is a few unlucky requests: a GC pause, a cold
//! cache, a slow replica. A retry does not help there, because nothing failed; the
//! caller just waits. A *hedge* is a second copy of the request, sent when the first
//! has taken longer than most requests do; whichever answers first is used and the
//! other is cancelled. With the default delay, the 95th percentile of recent latencies,
//! about one eligible request in twenty gets a hedge, and the slow tail shrinks toward
//! the latency of the copies that were not unlucky.
//!
//! # What is hedged, and when
//!
//! - **Only requests that are safe to send twice**, by the retry layer's rules: an
//!   idempotent method (GET, HEAD, OPTIONS, TRACE, PUT, DELETE), an `Idempotency-Key`
//!   header, or the [`Idempotent`](crate::Idempotent) extension. A POST without a key is
//!   never hedged, nor is a request carrying [`NoRetry`]. gRPC calls
//!   are POSTs: a method that is safe to hedge (gRFC A6 leaves that to its owner) says
//!   so with the `Idempotent` extension, or by a `hedgingPolicy` in the service config
//!   ([`HedgePolicyBuilder::grpc_methods`]).
//! - **After a delay**: fixed ([`HedgePolicyBuilder::delay`]), or by default the 95th
//!   percentile of recent successful latencies over a rolling 10 s window, never below
//!   1 ms, and only once the window holds 50 latencies (before that nothing is hedged).
//!   The estimator is [`stormguard_core::hedge::LatencyEstimator`]; the latency recorded
//!   is that of the attempt that succeeded, from when it was sent.
//! - **Up to `max_attempts` copies** (2 by default, the original included; at most 5,
//!   as gRFC A6 caps it), each a delay after the previous one.
//! - **Every hedge is paid from a [`RetryBudget`]**, the retry layer's with
//!   [`HedgePolicyBuilder::share_retry_budget`]: each hedged request deposits once,
//!   each hedge withdraws (charged when it is sent, whether it wins or not:
//!   [`RetryBudget::try_withdraw`]). When the budget is spent (the dependency is failing
//!   or slow for many requests at once) hedging stops, so hedging can add at most the
//!   budget's ratio (10%) plus its allowance to the load, whatever happens.
//!
//! # Who wins
//!
//! The first response that is not a *non-fatal failure* wins and the other copies are
//! dropped: their futures are dropped, which with hyper over HTTP/2 resets their streams
//! (over HTTP/1.1 hyper closes their connections). Non-fatal failures are the retryable
//! statuses (408, 429, 500, 502, 503, 504), gRPC `UNAVAILABLE` (A6
//! `nonFatalStatusCodes`; both sets can be replaced), and errors that are transient by
//! the retry layer's classification (timeouts, resets, refused connections). When one
//! arrives the next hedge, if any is left, is sent at once (A6). Anything else, a 404
//! or an unrecognised error, is final and returned as it is. If every copy fails
//! non-fatally, the last failure is returned.
//!
//! Further hedges stop, while the copies in flight go on, when:
//!
//! - any attempt's response carries `grpc-retry-pushback-ms` (gRFC A6), or a
//!   `Retry-After` on a 429 or 503: the server asked clients to slow down;
//! - an attempt failed with [`CircuitOpen`](crate::CircuitOpen) from a breaker below;
//! - the budget refuses a hedge;
//! - the request body cannot be replayed (see *Bodies*).
//!
//! # Bodies
//!
//! Request bodies are cloned, so they must be `Clone`; streaming bodies go through
//! [`ReplayBody`](crate::ReplayBody) ([`RetryLayer::replay_bodies`](crate::RetryLayer::replay_bodies)
//! above). A hedge replays the original's body from memory, so a request whose body is
//! still streaming when the delay is up, or went over the replay cap, is not hedged.
//!
//! # Readiness
//!
//! The service must be `Clone` (as with `tower::hedge`): the response future keeps a clone
//! for the hedges, and a hedge that is due waits for that clone's `poll_ready`, while the
//! original may still win.
//!
//! # Composition
//!
//! ```text
//! RetryLayer           one retry point, outermost: retries what every copy failed
//!   HedgeLayer         copies slow requests; each copy is an attempt below
//!     CircuitBreaker   counts every copy, fails fast while open (which stops hedging)
//!       timeout        per copy, so a hung copy is a non-fatal failure, not a hang
//!         client
//! ```
//!
//! - **Hedge below retry.** Hedging deals with slowness and retry with failure; a retry
//!   then starts a new hedged request, with its own delay. With the hedge layer above the
//!   retry layer, each hedge would carry its own retries and the copies would multiply.
//! - **Hedge above the breaker.** Every copy is a call the breaker counts, so hedges
//!   cannot hide a failing dependency from it, and an open breaker fails a hedge at once
//!   with `CircuitOpen`, which stops further hedges. A cancelled loser counts as nothing
//!   (the breaker gives its slot back).
//! - **Per-copy timeout at the bottom.** A copy that hangs becomes a timeout error, a
//!   non-fatal failure, so the other copies and then the retry layer carry on.
//! - **One budget.** Build the hedge policy with
//!   [`share_retry_budget(&retry)`](HedgePolicyBuilder::share_retry_budget): hedges and
//!   retries then draw from the retry policy's budget, 10% between them, paid in once per
//!   request by the retry layer.
//!
//! ```
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use stormguard::{CircuitBreaker, CircuitBreakerLayer, HedgeLayer, HedgePolicy, RetryBudget,
//!                  RetryLayer, RetryPolicy};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), stormguard::BoxError> {
//! let retry = RetryPolicy::builder().budget(RetryBudget::default()).build()?;
//! let hedge = HedgePolicy::builder()
//!     // The default (or a fixed `.delay(Duration::from_millis(20))`); a lower percentile
//!     // hedges more requests, at more load.
//!     .percentile(0.95)
//!     // The default, the original included. More copies (up to 5) shorten the p99.9 (a
//!     // request whose hedge is also slow), at more load.
//!     .max_attempts(2)
//!     .share_retry_budget(&retry)
//!     .build()?;
//! let breaker = CircuitBreaker::default();
//!
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new(retry))
//!     .layer(HedgeLayer::new(hedge.clone()))
//!     .layer(CircuitBreakerLayer::new(breaker))
//!     // Per copy: set it above the dependency's slowest healthy answer; a hung copy is
//!     // then a non-fatal failure that sends the next one.
//!     .timeout(Duration::from_secs(2))
//!     // A real client here: hyper's, say, with `http2_only(true)` (see "Who wins").
//!     .service(service_fn(|_req: http::Request<Full<Bytes>>| async {
//!         Ok::<_, stormguard::BoxError>(http::Response::new(String::from("hello")))
//!     }));
//!
//! let response = client.oneshot(http::Request::new(Full::from("hi"))).await?;
//! // The body through the breaker, unwrapped.
//! assert_eq!(response.into_body().into_inner(), "hello");
//! assert_eq!(hedge.stats().requests, 1);
//! # Ok(())
//! # }
//! ```
//!
//! # Observability
//!
//! [`HedgePolicy::stats`] counts hedged requests, hedges sent, hedges won, copies
//! cancelled, hedges the budget refused and hedges not sent because the server, a
//! breaker or the body said not to. Each hedge sent, won or refused is a `tracing`
//! event at debug level on target `stormguard::hedge`.
//!
//! # Compared with `tower::hedge`
//!
//! `tower::hedge` cuts a healthy server's tail as well; the difference is around it.
//! stormguard hedges only requests that are safe to repeat, never beyond its budget; a fast
//! failure does not beat a slower success (tower's first completion wins, errors
//! included); and it stops hedging when a server pushes back or a breaker opens. With one
//! hedge, a request whose hedge is also slow still waits: more copies (`max_attempts`, up
//! to 5) address that, at more load. `cargo run --release --example hedging` in the
//! repository measures both against a server with a slow share of requests, and against
//! one that fails everything.

pub mod future;
mod layer;

pub use future::ResponseFuture;
pub use layer::HedgeLayer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use http::{Request, Response};
use stormguard_core::classify::{GrpcCodeSet, Rules, StatusSet};
use stormguard_core::hedge::{LatencyEstimator, LatencyEstimatorBuilder};
use stormguard_core::methods::{GrpcHedgePolicy, MethodPolicy, MethodTable};
use stormguard_core::{Class, ConfigError, RetryBudget};
use tower_service::Service;

use crate::body::{NotReplayable, ReplayHandle};
use crate::error_class::{as_std_error, sources, ErrorClass};
use crate::retry::{is_grpc, safe_to_repeat};
use crate::{NoRetry, RetryPolicy};

/// gRFC A6 caps hedging at five attempts.
use stormguard_core::methods::MAX_ATTEMPTS;

/// Counters of what a [`HedgePolicy`] (and all its clones) did, read with
/// [`HedgePolicy::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HedgeStats {
    /// Requests that may be hedged (safe to repeat) and went through the layer.
    pub requests: u64,
    /// Hedges sent: copies beyond the first.
    pub hedges_sent: u64,
    /// Requests answered by a hedge rather than the original.
    pub hedges_won: u64,
    /// Copies still in flight when another won, dropped.
    pub cancelled: u64,
    /// Hedges the budget refused.
    pub budget_denied: u64,
    /// Hedges not sent because the server asked to slow down, a breaker was open or
    /// the body could not be replayed.
    pub suppressed: u64,
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    hedges_sent: AtomicU64,
    hedges_won: AtomicU64,
    cancelled: AtomicU64,
    budget_denied: AtomicU64,
    suppressed: AtomicU64,
}

fn add(counter: &AtomicU64, n: u64) {
    if n > 0 {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

#[derive(Debug)]
enum Delay {
    Fixed(Duration),
    Percentile(Box<LatencyEstimator>),
}

#[derive(Debug)]
struct Shared {
    max_attempts: u32,
    delay: Delay,
    budget: RetryBudget,
    /// Whether this layer pays each request into the budget (not when a retry layer
    /// above does).
    deposits: bool,
    rules: Rules,
    /// The classifiers asked before the rules.
    classifiers: crate::classify::Classifiers,
    /// Whether an error of a type that cannot be looked into was warned of.
    warned_opaque: std::sync::atomic::AtomicBool,
    /// Per-method hedging policies of a gRPC service config (`None`: not hedged).
    methods: Option<MethodTable<Option<GrpcHedgePolicy>>>,
    counters: Counters,
    /// The `service` label of the `metrics` feature's series.
    name: String,
    #[cfg(feature = "metrics")]
    metrics: crate::metrics::HedgeMetrics,
}

/// What a hedged request did, for the metrics.
#[derive(Debug, Clone, Copy)]
pub(crate) enum HedgeEvent {
    /// A hedge was sent.
    Sent,
    /// A hedge's response won.
    Won,
    /// Copies dropped once another won.
    Cancelled,
    /// The budget refused a hedge.
    BudgetRefused,
}

/// When and how often to hedge; see the [module docs](self).
///
/// `HedgePolicy::default()`: 2 attempts (one hedge), the delay the 95th percentile of
/// successful latencies over 10 s (at least 1 ms, after 50 latencies), a fresh
/// [`RetryBudget`] (wasted retries within 10% of the requests over 10 s, plus an allowance of 1 carried over), 408/429/500/502/503/504 and gRPC
/// UNAVAILABLE non-fatal.
///
/// # Clone
///
/// Tower clones the policy into every service and response future. Clones share the
/// configuration, the latency window, the budget and the counters (an `Arc`).
#[derive(Debug, Clone)]
pub struct HedgePolicy {
    shared: Arc<Shared>,
}

/// Why further hedges stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    Pushback,
    CircuitOpen,
    NotReplayable,
    Budget,
    Shed,
}

impl Stop {
    fn as_str(self) -> &'static str {
        match self {
            Stop::Pushback => "server pushback",
            Stop::CircuitOpen => "circuit open",
            Stop::NotReplayable => "body not replayable",
            Stop::Budget => "budget",
            Stop::Shed => "load shed",
        }
    }
}

/// What an attempt's outcome means for the hedged request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Return it: a success (`true`, its latency is recorded) or a fatal failure.
    Final { success: bool },
    /// A non-fatal failure: wait for the other copies, send the next hedge; `stop` says
    /// why no further hedge may be sent.
    NonFatal { stop: Option<Stop> },
}

impl Default for HedgePolicy {
    fn default() -> Self {
        HedgePolicyBuilder::default().make(Delay::Percentile(Box::default()))
    }
}

impl HedgePolicy {
    /// A builder starting from the defaults.
    pub fn builder() -> HedgePolicyBuilder {
        HedgePolicyBuilder::default()
    }

    /// What this policy and all its clones have done so far.
    pub fn stats(&self) -> HedgeStats {
        let c = &self.shared.counters;
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        HedgeStats {
            requests: load(&c.requests),
            hedges_sent: load(&c.hedges_sent),
            hedges_won: load(&c.hedges_won),
            cancelled: load(&c.cancelled),
            budget_denied: load(&c.budget_denied),
            suppressed: load(&c.suppressed),
        }
    }

    /// The budget hedges are drawn from.
    pub fn budget(&self) -> &RetryBudget {
        &self.shared.budget
    }

    /// Counts a hedge event in the `metrics` feature's series.
    /// Says, once per policy, that an error of the type `E` cannot be looked into: it
    /// ends the request (see [`crate::classify`]).
    #[cold]
    fn opaque_error<E>(&self) {
        let warned = &self.shared.warned_opaque;
        if !warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                dependency = %self.shared.name,
                error_type = std::any::type_name::<E>(),
                "an error of this type cannot be looked into and ends the hedged request: \
                 box it, or name it with HedgePolicyBuilder::error_type, or classify it"
            );
        }
    }

    /// Records `n` of `event` (with the `metrics` feature; nothing without it).
    pub(crate) fn count(&self, event: HedgeEvent, n: u64) {
        #[cfg(feature = "metrics")]
        {
            let (metrics, name) = (&self.shared.metrics, &self.shared.name);
            match event {
                HedgeEvent::Sent => metrics.sent(name, n),
                HedgeEvent::Won => metrics.won(name, n),
                HedgeEvent::Cancelled => metrics.cancelled(name, n),
                HedgeEvent::BudgetRefused => metrics.budget_refused(name, n),
            }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (event, n);
    }

    /// The name its `metrics` series carry as their `service` label.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Copies per request, the original included.
    pub fn max_attempts(&self) -> u32 {
        self.shared.max_attempts
    }

    /// The delay a request sent now would be hedged after, or `None` when it would not
    /// be hedged yet (too few latencies in the window). Reads tokio's clock.
    pub fn current_delay(&self) -> Option<Duration> {
        self.delay(tokio::time::Instant::now())
    }

    fn delay(&self, now: tokio::time::Instant) -> Option<Duration> {
        match &self.shared.delay {
            Delay::Fixed(delay) => Some(*delay),
            Delay::Percentile(estimator) => estimator.delay(now.into_std()),
        }
    }

    /// Whether `req` may be sent more than once.
    fn may_hedge<B>(&self, req: &Request<B>) -> bool {
        self.shared.max_attempts > 1
            && req.extensions().get::<NoRetry>().is_none()
            && safe_to_repeat(req)
    }

    fn record(&self, latency: Duration, now: tokio::time::Instant) {
        if let Delay::Percentile(estimator) = &self.shared.delay {
            estimator.record(latency, now.into_std());
        }
    }

    fn try_withdraw(&self, now: tokio::time::Instant) -> bool {
        self.shared.budget.try_withdraw(now.into_std())
    }

    fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// What `result` means; `codes` replaces the non-fatal gRPC codes (a method's own).
    pub(crate) fn judge<ResB, E: 'static>(
        &self,
        grpc: bool,
        codes: Option<GrpcCodeSet>,
        result: &Result<Response<ResB>, E>,
    ) -> Verdict {
        let rules = &Rules {
            retryable_grpc_codes: codes.unwrap_or(self.shared.rules.retryable_grpc_codes),
            ..self.shared.rules
        };
        let classifiers = &self.shared.classifiers;
        let told = match result {
            Ok(res) if classifiers.any() => classifiers.response(res.status(), res.headers()),
            _ => None,
        };
        let class = match (result, told) {
            (Ok(_), Some(class)) => class,
            (Ok(res), None) if grpc => rules.classify_grpc_response(res.status(), res.headers()),
            (Ok(res), None) => rules.classify_with(res.status(), res.headers(), SystemTime::now),
            (Err(err), _) => {
                let class = classifiers.classify_error(err).unwrap_or_else(|| {
                    self.opaque_error::<E>();
                    ErrorClass::Unknown
                });
                return match class {
                    ErrorClass::CircuitOpen => Verdict::NonFatal {
                        stop: Some(Stop::CircuitOpen),
                    },
                    // No room for a hedge: the attempts already out go on, no more.
                    ErrorClass::Shed => Verdict::NonFatal {
                        stop: Some(Stop::Shed),
                    },
                    ErrorClass::Unprocessed
                    | ErrorClass::Drained
                    | ErrorClass::NotSent
                    | ErrorClass::MaybeProcessed => Verdict::NonFatal { stop: None },
                    ErrorClass::Local if is_not_replayable(err) => Verdict::NonFatal {
                        stop: Some(Stop::NotReplayable),
                    },
                    ErrorClass::Local | ErrorClass::Unknown => Verdict::Final { success: false },
                };
            }
        };
        match class {
            Class::Success => Verdict::Final { success: true },
            Class::Permanent => Verdict::Final { success: false },
            Class::Retryable { after: None } => Verdict::NonFatal { stop: None },
            Class::Retryable { after: Some(_) } | Class::DontRetry => Verdict::NonFatal {
                stop: Some(Stop::Pushback),
            },
        }
    }
}

/// Whether `err` is, or was caused by, a replayed body that had nothing whole to
/// replay: the hedge's body, not the server, failed.
fn is_not_replayable<E: 'static>(err: &E) -> bool {
    // Bounded: error chains are finite, and no real one is this deep.
    as_std_error(err).is_some_and(|err| sources(err).take(64).any(|e| e.is::<NotReplayable>()))
}

/// Builds a [`HedgePolicy`]; every setting has a default.
#[derive(Debug, Clone)]
pub struct HedgePolicyBuilder {
    name: Option<String>,
    max_attempts: u32,
    fixed: Option<Duration>,
    estimator: LatencyEstimatorBuilder,
    budget: Option<RetryBudget>,
    deposits: bool,
    rules: Rules,
    classifiers: crate::classify::Classifiers,
    methods: Option<MethodTable<Option<GrpcHedgePolicy>>>,
}

impl Default for HedgePolicyBuilder {
    fn default() -> Self {
        HedgePolicyBuilder {
            name: None,
            max_attempts: 2,
            fixed: None,
            estimator: LatencyEstimator::builder(),
            budget: None,
            deposits: true,
            rules: Rules::default(),
            classifiers: crate::classify::Classifiers::default(),
            methods: None,
        }
    }
}

impl HedgePolicyBuilder {
    /// Copies per request, the original included, from 1 (no hedging) to 5 \[2\].
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// A fixed delay between copies, from 1 ms to 1 h, instead of the latency
    /// percentile [the percentile].
    pub fn delay(mut self, delay: Duration) -> Self {
        self.fixed = Some(delay);
        self
    }

    /// Every setting of the delay estimate at once (configuration files).
    #[cfg(feature = "serde")]
    pub(crate) fn estimator(mut self, estimator: LatencyEstimatorBuilder) -> Self {
        self.estimator = estimator;
        self
    }

    /// The latency percentile the delay is taken at, as a fraction strictly between 0
    /// and 1 \[0.95\].
    pub fn percentile(mut self, percentile: f64) -> Self {
        self.estimator = self.estimator.percentile(percentile);
        self
    }

    /// How long latencies are remembered, from 10 ms to 1 h \[10 s\].
    pub fn window(mut self, window: Duration) -> Self {
        self.estimator = self.estimator.window(window);
        self
    }

    /// Latencies needed in the window before anything is hedged \[50\].
    pub fn min_samples(mut self, samples: u32) -> Self {
        self.estimator = self.estimator.min_samples(samples);
        self
    }

    /// The shortest percentile delay \[1 ms\].
    pub fn floor(mut self, floor: Duration) -> Self {
        self.estimator = self.estimator.floor(floor);
        self
    }

    /// The budget hedges are drawn from, into which the hedge layer pays each request
    /// it may hedge [a budget of its own with the defaults]. Under a
    /// [`RetryLayer`](crate::RetryLayer), use
    /// [`share_retry_budget`](Self::share_retry_budget) instead.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self.deposits = true;
        self
    }

    /// The dependency's name: the `service` label of the `metrics` feature's hedge
    /// series \[the retry policy's, with [`share_retry_budget`](Self::share_retry_budget);
    /// else the budget's name, else `default`\].
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Draws hedges from `retry`'s budget, which the [`RetryLayer`](crate::RetryLayer)
    /// above pays into once per request (and takes `retry`'s name, unless it has one);
    /// the hedge layer then pays in nothing, so that hedges and retries share one ratio
    /// (10% by default) of the original requests. Use it only with that retry layer
    /// above the hedge layer: without it, nothing is paid in and hedges get only the
    /// budget's allowance.
    pub fn share_retry_budget(mut self, retry: &RetryPolicy) -> Self {
        if self.name.is_none() {
            self.name = Some(retry.name().to_owned());
        }
        self.budget = Some(retry.budget().clone());
        self.deposits = false;
        self
    }

    /// HTTP statuses that do not end a hedged request while other copies may still
    /// succeed [408, 429, 500, 502, 503, 504].
    pub fn non_fatal_statuses(mut self, statuses: StatusSet) -> Self {
        self.rules.retryable_statuses = statuses;
        self
    }

    /// gRPC codes that do not end a hedged request (A6 `nonFatalStatusCodes`)
    /// \[UNAVAILABLE\].
    pub fn non_fatal_grpc_codes(mut self, codes: GrpcCodeSet) -> Self {
        self.rules.retryable_grpc_codes = codes;
        self
    }

    /// Per-method hedging policies for gRPC calls, as a service config's `methodConfig`
    /// gives them \[none\].
    ///
    /// A gRPC call whose method's entry ([`MethodTable::lookup`] by `:path`) is a
    /// [`MethodPolicy::Hedge`] is hedged by it: its copies, its fixed delay (0 sends every
    /// copy at once) and its non-fatal codes, whatever its method (gRFC A6 leaves the
    /// judgement that a method is safe to send twice to the service config); a call
    /// with any other entry, or none, is sent once. The budget and the stop rules stay
    /// the policy's. Requests that are not gRPC keep the policy's own settings.
    pub fn grpc_methods(mut self, methods: &MethodTable<MethodPolicy>) -> Self {
        self.methods = Some(methods.map(|entry| match entry {
            MethodPolicy::Hedge(hedge) => Some(*hedge),
            _ => None,
        }));
        self
    }

    /// A classifier asked before the non-fatal sets and the built-in error rules (see
    /// [`crate::classify`]): an answer it calls [`Success`](crate::sans_io::Class::Success)
    /// or [`Permanent`](crate::sans_io::Class::Permanent), or an error it calls
    /// [`Permanent`](crate::classify::Failure::Permanent), ends the request; anything
    /// else lets the other attempts go on. Several are asked in the order given.
    pub fn classify(mut self, classify: impl crate::classify::Classify) -> Self {
        self.classifiers.push(classify);
        self
    }

    /// Looks into errors of the type `E`, as
    /// [`RetryPolicyBuilder::error_type`](crate::retry::RetryPolicyBuilder::error_type)
    /// does.
    pub fn error_type<E: std::error::Error + 'static>(mut self) -> Self {
        self.classifiers.error_type::<E>();
        self
    }

    /// Checks the settings and makes the policy.
    pub fn build(self) -> Result<HedgePolicy, ConfigError> {
        if !(1..=MAX_ATTEMPTS).contains(&self.max_attempts) {
            return Err(ConfigError::invalid(
                "hedge max_attempts",
                self.max_attempts,
                "from 1 to 5 (gRFC A6)",
            ));
        }
        let delay = match self.fixed {
            Some(fixed) => {
                if fixed < Duration::from_millis(1) || fixed > Duration::from_secs(3600) {
                    return Err(ConfigError::invalid("hedge delay", fixed, "from 1ms to 1h"));
                }
                Delay::Fixed(fixed)
            }
            None => Delay::Percentile(Box::new(self.estimator.clone().build()?)),
        };
        Ok(self.make(delay))
    }

    fn make(self, delay: Delay) -> HedgePolicy {
        let budget: RetryBudget = self.budget.unwrap_or_default();
        let name = self
            .name
            .or_else(|| budget.name().map(str::to_owned))
            .unwrap_or_else(|| String::from("default"));
        HedgePolicy {
            shared: Arc::new(Shared {
                max_attempts: self.max_attempts,
                delay,
                budget,
                deposits: self.deposits,
                rules: self.rules,
                classifiers: self.classifiers,
                warned_opaque: std::sync::atomic::AtomicBool::new(false),
                methods: self.methods,
                counters: Counters::default(),
                name,
                #[cfg(feature = "metrics")]
                metrics: crate::metrics::HedgeMetrics::default(),
            }),
        }
    }
}

/// A service that hedges slow requests by a [`HedgePolicy`]; made by [`HedgeLayer`].
///
/// # Clone
///
/// Clones share the policy (its window, budget and counters); the inner service is
/// cloned.
#[derive(Debug, Clone)]
pub struct Hedge<S> {
    inner: S,
    policy: HedgePolicy,
    spare: Arc<future::Spare<S>>,
}

impl<S> Hedge<S> {
    /// Hedges requests to `inner` by `policy`.
    pub fn new(inner: S, policy: HedgePolicy) -> Self {
        Hedge {
            inner,
            policy,
            spare: Arc::new(future::Spare::new()),
        }
    }

    /// The policy requests are hedged by.
    pub fn policy(&self) -> &HedgePolicy {
        &self.policy
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, consuming the layer.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResB> Service<Request<B>> for Hedge<S>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    S::Error: 'static,
    B: Clone,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Read once: the method table, the verdict and the timing all need it.
        let grpc = is_grpc(&req);
        // A gRPC call of a policy with per-method settings is hedged by its method's
        // (gRFC A6: the service config declares the method safe to send twice).
        let method = match &self.policy.shared.methods {
            Some(methods) if grpc => match methods.lookup(req.uri().path()) {
                Some(Some(hedge)) if req.extensions().get::<NoRetry>().is_none() => Some(*hedge),
                _ => return ResponseFuture::once(self.inner.call(req)),
            },
            _ => None,
        };
        if method.is_none() && !self.policy.may_hedge(&req) {
            return ResponseFuture::once(self.inner.call(req));
        }
        let now = tokio::time::Instant::now();
        if self.policy.shared.deposits {
            self.policy.shared.budget.deposit(now.into_std());
        }
        add(&self.policy.counters().requests, 1);
        let delay = match method {
            Some(hedge) => Some(hedge.delay),
            None => self.policy.delay(now),
        };
        match delay {
            None => ResponseFuture::timed(self.inner.call(req), now, self.policy.clone(), grpc),
            Some(delay) => {
                // The request is copied now, as the first call takes it; the service is
                // cloned from the spare only when a hedge is sent.
                self.spare.fill(&self.inner);
                let spare = Arc::clone(&self.spare);
                let copy = req.clone();
                let replay = req.extensions().get::<ReplayHandle>().cloned();
                let first = self.inner.call(req);
                ResponseFuture::hedged(future::Hedged {
                    max_attempts: method
                        .map_or(self.policy.shared.max_attempts, |h| h.max_attempts),
                    codes: method.map(|h| h.non_fatal_codes),
                    policy: self.policy.clone(),
                    grpc,
                    delay,
                    first,
                    started: now,
                    spare,
                    copy,
                    replay,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BoxError;

    #[test]
    fn bad_settings_are_errors() {
        let b = HedgePolicy::builder;
        assert_eq!(
            b().max_attempts(6).build().unwrap_err().to_string(),
            "invalid hedge max_attempts: 6 (allowed: from 1 to 5 (gRFC A6))"
        );
        assert_eq!(
            b().max_attempts(0).build().unwrap_err().field(),
            "hedge max_attempts"
        );
        assert_eq!(
            b().delay(Duration::ZERO).build().unwrap_err().field(),
            "hedge delay"
        );
        assert_eq!(
            b().percentile(1.5).build().unwrap_err().field(),
            "hedge percentile"
        );
    }

    #[test]
    fn verdicts() {
        let policy = HedgePolicy::default();
        let res = |status: u16, headers: &[(&'static str, &'static str)]| {
            let mut res = Response::new(());
            *res.status_mut() = http::StatusCode::from_u16(status).expect("status");
            for (k, v) in headers {
                res.headers_mut()
                    .insert(*k, http::HeaderValue::from_static(v));
            }
            Ok::<_, BoxError>(res)
        };
        let http = |r| policy.judge(false, None, &r);
        assert_eq!(http(res(200, &[])), Verdict::Final { success: true });
        assert_eq!(http(res(404, &[])), Verdict::Final { success: false });
        assert_eq!(http(res(503, &[])), Verdict::NonFatal { stop: None });
        assert_eq!(
            http(res(503, &[("retry-after", "3")])),
            Verdict::NonFatal {
                stop: Some(Stop::Pushback)
            }
        );
        let grpc = |r| policy.judge(true, None, &r);
        assert_eq!(
            grpc(res(200, &[("grpc-status", "14")])),
            Verdict::NonFatal { stop: None }
        );
        assert_eq!(
            grpc(res(
                200,
                &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "-1")]
            )),
            Verdict::NonFatal {
                stop: Some(Stop::Pushback)
            }
        );
        assert_eq!(
            grpc(res(200, &[("grpc-status", "3")])),
            Verdict::Final { success: false }
        );
        let err = |e: BoxError| policy.judge::<(), _>(false, None, &Err(e));
        assert_eq!(
            err(Box::new(crate::CircuitOpen::new(Duration::from_secs(1)))),
            Verdict::NonFatal {
                stop: Some(Stop::CircuitOpen)
            }
        );
        assert_eq!(
            err(Box::new(tower::timeout::error::Elapsed::new())),
            Verdict::NonFatal { stop: None }
        );
        assert_eq!(
            err(Box::new(NotReplayable)),
            Verdict::NonFatal {
                stop: Some(Stop::NotReplayable)
            }
        );
        assert_eq!(err("boom".into()), Verdict::Final { success: false });
    }
}
