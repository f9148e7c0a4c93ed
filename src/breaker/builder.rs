//! The circuit breaker's builder: the state machine's settings plus what counts as a failure.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use stormguard_core::breaker::{Breaker, BreakerConfig, BreakerConfigBuilder};
use tokio::sync::Notify;

use stormguard_core::classify::{GrpcCodeSet, StatusSet};
use stormguard_core::ConfigError;

use super::{Callback, CircuitBreaker, Shared, Transition};
use crate::classify::{Classifiers, Classify};

/// Builds a [`CircuitBreaker`]: the state machine's settings (a
/// [`BreakerConfig`], given to [`config`](Self::config)), which outcomes are failures,
/// and what an open circuit does to `poll_ready`.
///
/// ```
/// use std::time::Duration;
/// use http::StatusCode;
/// use stormguard::breaker::BreakerConfig;
/// use stormguard::sans_io::classify::StatusSet;
/// use stormguard::CircuitBreaker;
///
/// // Every knob at its default but the last two; docs/defaults.md in the repository has
/// // the measurements behind each.
/// let breaker = CircuitBreaker::builder()
///     .config(
///         BreakerConfig::builder()
///             // Longer only for a client too quiet to finish `min_throughput` calls in it.
///             .window(Duration::from_secs(2))
///             .min_throughput(20)
///             // Lower trips on partial outages whose retries would have served, and
///             // serves less than no retries.
///             .failure_ratio(0.95)
///             // Lower trips on heavy partial outages, and serves less than no retries.
///             .consecutive_failures(50)
///             // Longer only where a probe is expensive: the client is blind for the break.
///             .break_duration(Duration::from_millis(25))
///             .max_break_duration(Duration::from_millis(25))
///             // More probes close sooner behind a load balancer of several replicas.
///             .probes(3),
///     )
///     // A 501 says the caller asked for what does not exist, not that the dependency
///     // is unwell.
///     .failure_statuses(StatusSet::breaker_default().without(StatusCode::NOT_IMPLEMENTED))
///     .build()?;
/// assert_eq!(breaker.config().probes(), 3);
///
/// let err = CircuitBreaker::builder()
///     .config(BreakerConfig::builder().probes(0))
///     .build()
///     .unwrap_err();
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

    /// The state machine's settings: when the circuit opens, how long it stays open,
    /// how many probes close it ([`BreakerConfig::builder`], whose setters document
    /// each and its default), replacing all of them. Out-of-range values are reported
    /// by [`build`](Self::build). A [`BreakerConfig`] already built (one from
    /// [`CircuitBreaker::config`], or a [`Config`](crate::Config)'s) is taken as well.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard::breaker::{BreakerConfig, BreakerConfigBuilder};
    /// use stormguard::CircuitBreaker;
    ///
    /// let breaker = CircuitBreaker::builder()
    ///     .config(BreakerConfig::builder().probes(3).window(Duration::from_secs(5)))
    ///     .build()?;
    /// assert_eq!(breaker.config().probes(), 3);
    /// // Another breaker like it, but for its break.
    /// let slower = CircuitBreaker::builder()
    ///     .config(BreakerConfigBuilder::from(breaker.config().clone())
    ///         .break_duration(Duration::from_millis(100))
    ///         .max_break_duration(Duration::from_millis(100)))
    ///     .build()?;
    /// assert_eq!(slower.config().probes(), 3);
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
    pub fn config(mut self, config: impl Into<BreakerConfigBuilder>) -> Self {
        self.config = config.into();
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
    ///
    /// For tasks that wait on the state, send it into a `tokio::sync::watch` channel:
    ///
    /// ```
    /// use stormguard::breaker::CircuitState;
    /// use stormguard::CircuitBreaker;
    ///
    /// let (tx, states) = tokio::sync::watch::channel(CircuitState::Closed);
    /// let breaker = CircuitBreaker::builder()
    ///     .on_transition(move |t| {
    ///         tx.send_replace(t.to);
    ///     })
    ///     .build()?;
    /// breaker.isolate();
    /// assert_eq!(*states.borrow(), CircuitState::Isolated);
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
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
        CircuitBreaker {
            shared: Arc::new(Shared {
                name: self.name,
                breaker,
                failure_statuses: self.failure_statuses,
                failure_grpc_codes: self.failure_grpc_codes,
                wait_when_open: self.wait_when_open,
                on_transition: self.on_transition,
                classifiers: self.classifiers,
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
