//! The policy's builder, validated when built.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use stormguard_core::classify::{Rules, StatusSet};
use stormguard_core::methods::{MethodPolicy, MethodTable};
use stormguard_core::throttle::RetryThrottle;
use stormguard_core::{Backoff, ConfigError, RetryBudget};

use crate::body::DEFAULT_MAX_REPLAY_BYTES;
use crate::classify::{Classifiers, Classify};

use super::deadline::RequestDeadline;
use super::policy::{Limits, RetryPolicy};
use super::shared::{Counters, Shared};

/// Builds a [`RetryPolicy`]; every setting has a default.
#[derive(Debug, Clone)]
pub struct RetryPolicyBuilder {
    name: String,
    max_attempts: u32,
    backoff: Backoff,
    budget: Option<RetryBudget>,
    throttle: Option<RetryThrottle>,
    rules: Rules,
    classifiers: Classifiers,
    methods: Option<MethodTable<Option<Limits>>>,
    timeouts: Option<MethodTable<Option<Duration>>>,
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
            classifiers: Classifiers::default(),
            methods: None,
            timeouts: None,
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

    /// Per-method timeouts for gRPC calls, found by the request's `:path` as gRPC finds
    /// a method config (a service config's `methodConfig.timeout`; `None` for a method
    /// whose config has none): a call's [`Deadline`](crate::Deadline), counted from its
    /// first send, when it has none of its own (no `Deadline` extension, no
    /// `grpc-timeout`), else the earlier of the two. Like any deadline it is read at
    /// the first failure: no retry is scheduled past it, and each retry's
    /// `grpc-timeout` says what is left of it. The first attempt is sent as the caller
    /// made it (set tonic's `Request::set_timeout` for the server to see the deadline
    /// then too).
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard::RetryPolicy;
    /// use stormguard_core::methods::MethodTable;
    ///
    /// let mut timeouts = MethodTable::new();
    /// timeouts.insert_service("echo.Echo", Some(Duration::from_secs(2)));
    /// let policy = RetryPolicy::builder().grpc_timeouts(&timeouts).build()?;
    /// # let _ = policy;
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
    pub fn grpc_timeouts(mut self, timeouts: &MethodTable<Option<Duration>>) -> Self {
        self.timeouts = Some(timeouts.clone());
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

    /// A classifier asked before the status and code sets and the built-in error rules
    /// (see [`crate::classify`]); several are asked in the order given, the first answer
    /// decides.
    pub fn classify(mut self, classify: impl Classify) -> Self {
        self.classifiers.push(classify);
        self
    }

    /// Also retries the answers the status and code sets call permanent (a 409, a 404...)
    /// for which `retry` is true, as transient failures; it never changes an answer
    /// those sets retry, or one that says not to. The request must still be safe to send
    /// again.
    ///
    /// ```
    /// use http::StatusCode;
    /// use stormguard::RetryPolicy;
    ///
    /// // A 409 from this dependency means a concurrent write won: try again.
    /// let policy = RetryPolicy::builder()
    ///     .retry_on_response(|status, _headers| status == StatusCode::CONFLICT)
    ///     .build()?;
    /// # let _ = policy;
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
    pub fn retry_on_response<F>(mut self, retry: F) -> Self
    where
        F: Fn(http::StatusCode, &http::HeaderMap) -> bool + Send + Sync + 'static,
    {
        self.classifiers.retry_on_response(retry);
        self
    }

    /// Also retries the errors the built-in rules do not recognise for which `retry` is
    /// true of a link of their source chain, as transient failures after which the
    /// request may have been processed (so only a request safe to send again is
    /// retried). It never changes what the built-in rules recognise: a shed call or an
    /// open circuit is still not retried, a refused connection still retried.
    pub fn retry_on_error<F>(mut self, retry: F) -> Self
    where
        F: Fn(&(dyn std::error::Error + 'static)) -> bool + Send + Sync + 'static,
    {
        self.classifiers.retry_on_error(retry);
        self
    }

    /// Looks into errors of the type `E`: its source chain is walked, and handed to the
    /// classifiers, as a boxed error's is. Without it an error of a type the crate does
    /// not know is not retried (see [`crate::classify`]).
    pub fn error_type<E: std::error::Error + 'static>(mut self) -> Self {
        self.classifiers.error_type::<E>();
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

    pub(super) fn make(self) -> RetryPolicy {
        let budget = self.budget.unwrap_or_default();
        #[cfg(feature = "metrics")]
        crate::metrics::watch_budget(&budget, budget.name().unwrap_or(&self.name));
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
                        .map(|limits| {
                            limits
                                .max_attempts
                                .min(stormguard_core::methods::MAX_ATTEMPTS)
                        })
                        .fold(self.max_attempts, u32::max),
                    budget.name(),
                ),
                budget,
                throttle: self.throttle,
                pace: stormguard_core::retry::ThrottlePace::new(),
                rules: self.rules,
                classifiers: self.classifiers,
                warned_opaque: std::sync::atomic::AtomicBool::new(false),
                methods: self.methods,
                timeouts: self.timeouts,
                max_replay_bytes: self.max_replay_bytes,
                seed: self.seed,
                next_stream: AtomicU64::new(0),
                counters: Counters::default(),
            }),
            retry: stormguard_core::retry::RequestRetry::new(),
            unprocessed: false,
            deadline: RequestDeadline::Unsent,
            gated_since: None,
        }
    }
}
