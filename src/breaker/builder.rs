//! The circuit breaker's builder: the state machine's settings plus what counts as a failure.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use stormguard_core::breaker::{Breaker, BreakerConfig, BreakerConfigBuilder};
use tokio::sync::{watch, Notify};

use stormguard_core::classify::{GrpcCodeSet, StatusSet};
use stormguard_core::ConfigError;

use super::{Callback, CircuitBreaker, CircuitState, Shared, Transition};
use crate::classify::{Classifiers, Classify};

/// Builds a [`CircuitBreaker`]: the state-machine settings of
/// [`stormguard_core::breaker::BreakerConfigBuilder`], which
/// outcomes are failures, and what an open circuit does to `poll_ready`.
///
/// ```
/// use std::time::Duration;
/// use http::StatusCode;
/// use stormguard::sans_io::classify::StatusSet;
/// use stormguard::CircuitBreaker;
///
/// // Every knob at its default but the last two; docs/defaults.md in the repository has
/// // the measurements behind each.
/// let breaker = CircuitBreaker::builder()
///     // Longer only for a client too quiet to finish `min_throughput` calls in it.
///     .window(Duration::from_secs(2))
///     .min_throughput(20)
///     // Lower trips on partial outages whose retries would have served, and serves
///     // less than no retries.
///     .failure_ratio(0.95)
///     // Lower trips on heavy partial outages, and serves less than no retries.
///     .consecutive_failures(50)
///     // Longer only where a probe is expensive: the client is blind for the break.
///     .break_duration(Duration::from_millis(25))
///     .max_break_duration(Duration::from_millis(25))
///     // More probes close sooner behind a load balancer of several replicas.
///     .probes(3)
///     // A 501 says the caller asked for what does not exist, not that the dependency
///     // is unwell.
///     .failure_statuses(StatusSet::breaker_default().without(StatusCode::NOT_IMPLEMENTED))
///     .build()?;
/// assert_eq!(breaker.config().probes(), 3);
///
/// let err = CircuitBreaker::builder().probes(0).build().unwrap_err();
/// assert_eq!(err.field(), "probes");
/// # Ok::<(), stormguard::ConfigError>(())
/// ```
#[must_use]
pub struct CircuitBreakerBuilder {
    pub(super) name: String,
    pub(super) config: BreakerConfigBuilder,
    pub(super) failure_statuses: StatusSet,
    pub(super) failure_grpc_codes: GrpcCodeSet,
    pub(super) wait_when_open: bool,
    pub(super) on_transition: Option<Callback>,
    pub(super) seed: Option<u64>,
    pub(super) classifiers: Classifiers,
}

impl fmt::Debug for CircuitBreakerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreakerBuilder")
            .field("name", &self.name)
            .field("config", &self.config)
            .field("failure_statuses", &self.failure_statuses)
            .field("failure_grpc_codes", &self.failure_grpc_codes)
            .field("wait_when_open", &self.wait_when_open)
            .field("on_transition", &self.on_transition.is_some())
            .field("seed", &self.seed)
            .field("classifiers", &self.classifiers)
            .finish()
    }
}

impl CircuitBreakerBuilder {
    /// The dependency's name: the `dependency` label of the `metrics` feature's series
    /// \["default"\].
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The span of the sliding window over which failures are counted (default 2 s),
    /// from 10 ms to 365 days.
    pub fn window(mut self, window: Duration) -> Self {
        self.config = self.config.window(window);
        self
    }

    /// How many calls (not counting ignored ones) the window must hold before the
    /// failure ratio can open the circuit (default 20), at least 1.
    pub fn min_throughput(mut self, calls: u32) -> Self {
        self.config = self.config.min_throughput(calls);
        self
    }

    /// The share of failures over the window that opens the circuit (default 0.95),
    /// greater than 0 and at most 1.
    pub fn failure_ratio(mut self, ratio: f64) -> Self {
        self.config = self.config.failure_ratio(ratio);
        self
    }

    /// Also open after this many failures in a row (default 50); a `u32` or an
    /// `Option<u32>` (`None` turns it off), at least 1.
    pub fn consecutive_failures(mut self, failures: impl Into<Option<u32>>) -> Self {
        self.config = self.config.consecutive_failures(failures);
        self
    }

    /// The first break (default 25 ms), more than zero.
    pub fn break_duration(mut self, duration: Duration) -> Self {
        self.config = self.config.break_duration(duration);
        self
    }

    /// The longest break (default: `break_duration`, so no doubling), at least
    /// `break_duration`; each failed probe doubles the break up to this.
    pub fn max_break_duration(mut self, duration: Duration) -> Self {
        self.config = self.config.max_break_duration(duration);
        self
    }

    /// How many probe calls a half-open circuit lets through (default 1), from 1 to
    /// 65535; all must succeed to close it.
    pub fn probes(mut self, probes: u32) -> Self {
        self.config = self.config.probes(probes);
        self
    }

    /// How much each break is stretched at random, as a fraction (default 0.2), from 0
    /// to 1: a break `d` lasts `d × U[1, 1 + jitter]`.
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.config = self.config.jitter(jitter);
        self
    }

    /// Takes every state-machine setting from `config`, replacing those set so far.
    pub fn config(mut self, config: BreakerConfig) -> Self {
        self.config = BreakerConfig::builder()
            .window(config.window())
            .min_throughput(config.min_throughput())
            .failure_ratio(config.failure_ratio())
            .consecutive_failures(config.consecutive_failures())
            .break_duration(config.break_duration())
            .max_break_duration(config.max_break_duration())
            .probes(config.probes())
            .jitter(config.jitter());
        self
    }

    /// The HTTP statuses that count as failures (default
    /// [`StatusSet::breaker_default()`]: 408, 429 and 5xx). Other 4xx and 5xx are
    /// ignored; 1xx to 3xx are successes.
    pub fn failure_statuses(mut self, statuses: StatusSet) -> Self {
        self.failure_statuses = statuses;
        self
    }

    /// The gRPC codes, read from a `grpc-status` response header, that count as
    /// failures (default [`GrpcCodeSet::breaker_default()`]). Code 0 is a success,
    /// other codes are ignored.
    pub fn failure_grpc_codes(mut self, codes: GrpcCodeSet) -> Self {
        self.failure_grpc_codes = codes;
        self
    }

    /// A classifier asked before the failure sets (see [`crate::classify`]): an answer it
    /// calls [`Retryable`](crate::sans_io::Class::Retryable) or
    /// [`DontRetry`](crate::sans_io::Class::DontRetry) is a failure,
    /// [`Success`](crate::sans_io::Class::Success) a success,
    /// [`Permanent`](crate::sans_io::Class::Permanent) not counted; an error it calls
    /// [`Permanent`](crate::classify::Failure::Permanent) is not counted. A response whose
    /// gRPC status comes in its trailers, and the errors the built-in rules settle (a
    /// nested breaker's refusal, a drain, the caller's own failure), are not asked of it.
    /// Several are asked in the order given, the first answer decides.
    pub fn classify(mut self, classify: impl Classify) -> Self {
        self.classifiers.push(classify);
        self
    }

    /// Whether `poll_ready` waits (returns `Pending`) while the circuit refuses calls,
    /// instead of letting `call` fail fast with [`CircuitOpen`](super::CircuitOpen) (default `false`).
    pub fn wait_when_open(mut self, wait: bool) -> Self {
        self.wait_when_open = wait;
        self
    }

    /// Calls `callback` with every transition, on the thread that caused it, after it
    /// happened. It must be quick and must not block; it may read the breaker's state.
    pub fn on_transition(mut self, callback: impl Fn(Transition) + Send + Sync + 'static) -> Self {
        self.on_transition = Some(Arc::new(callback));
        self
    }

    /// Draws the break jitter from `seed` instead of the thread RNG, for reproducible
    /// tests.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Checks the settings and builds the breaker, or returns an error naming the
    /// first setting out of range.
    pub fn build(self) -> Result<CircuitBreaker, ConfigError> {
        let config = self.config.clone().build()?;
        Ok(self.assemble(config))
    }

    /// The breaker from these settings and an already checked state-machine `config`.
    pub(super) fn assemble(self, config: BreakerConfig) -> CircuitBreaker {
        let breaker = match self.seed {
            Some(seed) => Breaker::with_seed(config, seed),
            None => Breaker::new(config),
        };
        let (state_tx, _) = watch::channel(CircuitState::Closed);
        CircuitBreaker {
            shared: Arc::new(Shared {
                name: self.name,
                breaker,
                failure_statuses: self.failure_statuses,
                failure_grpc_codes: self.failure_grpc_codes,
                wait_when_open: self.wait_when_open,
                on_transition: self.on_transition,
                classifiers: self.classifiers,
                state_tx,
                changed: Arc::new(Notify::new()),
                calls: AtomicU64::new(0),
                failures: AtomicU64::new(0),
                rejected: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                transitions: AtomicU64::new(0),
                #[cfg(feature = "metrics")]
                metrics: crate::metrics::BreakerMetrics::default(),
            }),
        }
    }
}
