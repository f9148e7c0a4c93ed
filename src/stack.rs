//! The standard stack: the layers this crate recommends, in their order, in one line.
//!
//! ```text
//!   total timeout (30 s, which the retry layer also knows as its deadline)
//!     └ retry (3 attempts, full jitter 200 ms / 20 s, the budget, Retry-After)
//!         └ load control (an adaptive limit on the calls in flight; 100 ms wait for room)
//!             └ circuit breaker (2 s window, 95% of 20 calls or 50 in a row, 25 ms breaks)
//!                 └ attempt timeout (10 s)
//!                     └ your client: hyper-util's Client, a tonic Channel, any Service
//! ```
//!
//! ```
//! # async fn run() -> Result<(), stormguard::BoxError> {
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::{connect::HttpConnector, Client};
//! use hyper_util::rt::TokioExecutor;
//! use stormguard::connect::TrackedConnector;
//! use stormguard::stack::{HttpStack, StandardStack};
//! use tower::ServiceExt;
//!
//! let connector = TrackedConnector::new(HttpConnector::new());
//! let client = Client::builder(TokioExecutor::new()).build::<_, Full<Bytes>>(connector);
//! let users: HttpStack<_> = StandardStack::new("users").http(client);
//!
//! let request = http::Request::get("http://127.0.0.1:1/users/7").body(Full::default())?;
//! let _ = users.clone().oneshot(request).await; // nothing listens there: an error, in time
//! # Ok(())
//! # }
//! ```
//!
//! Why this order: the total timeout bounds what the caller waits, retries included, and
//! tells the retry layer its deadline (a retry whose wait would end after it is not
//! scheduled: reason `deadline`); the retry layer sits above the breaker so that an open
//! circuit is one more failed attempt it can give up on (or wait out, when the break is
//! shorter than its next backoff); the load control sits below the retry layer, so that
//! a retry takes a place like any call, and above the breaker, so that a call it sheds
//! is never counted as the dependency's failure; the breaker sits above the attempt
//! timeout so that an attempt that hangs counts as the failure it is, and the load
//! control reads that timeout as overload.
//!
//! Build hyper-util's client on a [`TrackedConnector`](crate::connect::TrackedConnector),
//! as above: hyper-util now and then leaves a request unwritten in the queue of a
//! connection a server is draining, and with the connector the retry layer proves it
//! never left and retries it when its attempt times out, a POST included
//! ([`connect`](crate::connect)).
//!
//! # The defaults, and why
//!
//! - **Attempt timeout 10 s.** It must sit above the slowest answer a healthy dependency
//!   gives: an attempt timeout below it turns slowness into retries, which is load on a
//!   dependency that is already slow (the storm's `brownout` scenario). 10 s is above
//!   the tail of most request/response APIs and still frees a caller from a hung
//!   connection. Set it per dependency from its own p99.9.
//! - **Total timeout 30 s.** Three attempts that fail fast take well under a second
//!   (backoff ceilings 200 and 400 ms); the total leaves room for a `Retry-After` of up to
//!   20 s (what the policy honours by default) and for two attempts that time out. What a
//!   user waits for a page is usually less: set it from the caller's own deadline.
//! - The retry policy and the breaker are the crate's defaults
//!   ([`RetryPolicy::default`], [`CircuitBreaker::default`]), named after the dependency
//!   (the `service` label of their metrics); docs/defaults.md in the repository holds
//!   the measurements behind them.
//!
//! Hedging stays out: it trades load for latency, and only a dependency whose requests
//! are safe to send twice, with a latency tail worth cutting, should pay for it; put a
//! [`HedgeLayer`](crate::HedgeLayer) under the retry layer by hand.
//!
//! # What a caller may be held
//!
//! - **Total timeout**: 30 s at most, whatever happens below.
//! - **Retry**: its backoffs (up to 200 and 400 ms for the default three attempts), or a
//!   server's `Retry-After` (up to 20 s), never past the total timeout. A retry of a
//!   throttling answer (429) waits the server's wait spread over one more, then up to
//!   one more for a slot of the gate of throttled retries: three of the server's waits
//!   at most, after which the 429 is handed back. Meanwhile the request holds that
//!   429, body unread (to hand it back): over HTTP/1, its connection with it.
//! - **Load control**: up to 100 ms waiting for room (`max_wait`), then the call fails
//!   with [`Shed`](crate::load::Shed), not retried. While the limit is still a guess (a
//!   new client's, or one that has let go after an incident), up to sixteen of the
//!   dependency's latency floors, or 2 s before its first answer
//!   ([`LoadLimit::wait_for_room`](crate::sans_io::limit::LoadLimit::wait_for_room)):
//!   a new client's burst of a thousand calls to a dependency answering in 50 ms is
//!   served within about six of its round trips. Never longer than the attempt timeout:
//!   a call that would wait longer than an answer may take is shed for the caller to
//!   fall back.
//! - **Circuit breaker**: a refused call waits out a short break (25 ms) for the
//!   probe's verdict (once, and again while it meets a probe still deciding, all within
//!   the first backoff's ceiling, 200 ms); while
//!   the dependency has been failing for less than
//!   [`FAIL_FAST_AFTER`](crate::sans_io::breaker::FAIL_FAST_AFTER) (350 ms from the
//!   first of the failures in a row that opened the circuit: a blip) it is sent again
//!   about four times the circuit's age later (give or take a quarter); past that it fails
//!   at once with [`CircuitOpen`](crate::CircuitOpen), whose `remaining()` says when the
//!   next probe is due, so that the caller can fall back. A half-open probe that is a
//!   gRPC stream is decided by its first message or its trailers: a stream that sends
//!   neither for a while (an idle watch) holds the probe slot, and the calls behind it
//!   are refused, until it does.
//! - **Attempt timeout**: 10 s per attempt.
//!
//! # Naming the type
//!
//! [`HttpStack<S>`] and [`ReplayStack<S>`] (and, with the `tonic` feature, [`GrpcStack<S>`])
//! name the stack's type, so that it can sit in a struct field or an axum `State`
//! without boxing. Its responses' body is the client's, wrapped in a
//! [`breaker::ResponseBody`](crate::breaker::ResponseBody). Its response future is `Send` when the client's is. When a handler
//! must box the call itself (`Pin<Box<dyn Future<Output = _> + Send>>`), box the
//! future that [`oneshot`](tower::ServiceExt::oneshot) returns on an owned clone of the
//! stack, not a future that borrows the stack (`stack.ready().await?.call(r)` inside an
//! `async move` boxed as `Send` can fail with "higher-ranked lifetime error"):
//!
//! ```
//! use std::future::Future;
//! use std::pin::Pin;
//! # use bytes::Bytes;
//! # use http_body_util::Full;
//! use stormguard::stack::HttpStack;
//! use tower::ServiceExt;
//! # type Client = hyper_util::client::legacy::Client<
//! #     hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;
//! // The client's body, through the breaker (which reads a gRPC status in trailers).
//! type Res = http::Response<stormguard::breaker::ResponseBody<hyper::body::Incoming>>;
//!
//! fn call(
//!     stack: &HttpStack<Client>,
//!     request: http::Request<Full<Bytes>>,
//! ) -> Pin<Box<dyn Future<Output = Result<Res, stormguard::BoxError>> + Send>> {
//!     Box::pin(stack.clone().oneshot(request))
//! }
//! ```
//!
//! # Operator control and stats
//!
//! Every part is reachable: [`StandardStack::retry`] for [`RetryStats`](crate::retry::RetryStats)
//! and the budget, [`StandardStack::breaker`] for the circuit's state, its stats and
//! [`isolate`](CircuitBreaker::isolate) / [`reset`](CircuitBreaker::reset). Clones of a
//! stack, and every service one `StandardStack` makes, share one budget and one circuit.

use std::fmt;
use std::time::Duration;

#[cfg(feature = "tonic")]
use http::Request;
use stormguard_core::ConfigError;
use tower::timeout::Timeout;

use crate::breaker::CircuitBreakerService;
use crate::load::{LoadControl, LoadControlService};
use crate::retry::ReplayRetry;
use crate::{CircuitBreaker, Retry, RetryPolicy};

/// The default total timeout: what a caller waits, retries included.
pub const DEFAULT_TOTAL_TIMEOUT: Duration = Duration::from_secs(30);

/// The default timeout of each attempt.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// The standard stack over a service whose request bodies are `Clone` (hyper-util's
/// `Client` with `Full<Bytes>` or `String` bodies), from [`StandardStack::http`].
pub type HttpStack<S> = Timeout<Retry<Below<S>>>;

/// The layers of the standard stack below the retry layer: the load control over the
/// breaker over the attempt timeout.
pub type Below<S> = LoadControlService<CircuitBreakerService<Timeout<S>>>;

/// The standard stack over a service whose request bodies stream, kept as they are
/// sent so that a retry can send them again ([`ReplayBody`](crate::ReplayBody), up to the
/// policy's `max_replay_bytes`), from [`StandardStack::replay`]. The inner service takes
/// `Request<ReplayBody<B>>`.
pub type ReplayStack<S> = Timeout<ReplayRetry<Below<S>>>;

/// The standard stack over a tonic [`Channel`](tonic::transport::Channel) (or any
/// service of tonic's body type), from [`StandardStack::grpc`]: a
/// `tonic::client::Grpc<GrpcStack>` is what tonic-build's generated clients wrap.
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub type GrpcStack<S = tonic::transport::Channel> = ReplayStack<ToTonicBody<S>>;

/// Hands tonic's `Channel` the body type it takes: a [`ReplayBody`](crate::ReplayBody)
/// boxed back into tonic's `Body`, by a function pointer.
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub type ToTonicBody<S> = tower::util::MapRequest<
    S,
    fn(Request<crate::ReplayBody<tonic::body::Body>>) -> Request<tonic::body::Body>,
>;

/// The recommended stack's parts and settings for one dependency; it makes the stack
/// over a client with [`http`](Self::http), [`replay`](Self::replay) or
/// [`grpc`](Self::grpc). See the [module docs](self) for the layers and their defaults.
#[derive(Clone)]
pub struct StandardStack {
    retry: RetryPolicy,
    load: LoadControl,
    breaker: CircuitBreaker,
    total_timeout: Duration,
    attempt_timeout: Duration,
}

impl fmt::Debug for StandardStack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StandardStack")
            .field("name", &self.retry.name())
            .field("total_timeout", &self.total_timeout)
            .field("attempt_timeout", &self.attempt_timeout)
            .finish_non_exhaustive()
    }
}

impl StandardStack {
    /// The defaults, the retry policy and the breaker named `name`.
    pub fn new(name: &str) -> Self {
        StandardStack {
            retry: RetryPolicy::builder()
                .name(name)
                .build()
                .unwrap_or_default(),
            load: LoadControl::builder()
                .name(name)
                .build()
                .unwrap_or_default(),
            breaker: CircuitBreaker::builder()
                .name(name)
                .build()
                .unwrap_or_default(),
            total_timeout: DEFAULT_TOTAL_TIMEOUT,
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
        }
    }

    /// A builder starting from [`new(name)`](Self::new)'s defaults.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard::stack::StandardStack;
    ///
    /// let stack = StandardStack::builder("search")
    ///     // Search answers in 300 ms at its p99.9; a user waits 2 s at most.
    ///     .attempt_timeout(Duration::from_millis(800))
    ///     .total_timeout(Duration::from_secs(2))
    ///     .build()?;
    /// assert_eq!(stack.attempt_timeout(), Duration::from_millis(800));
    ///
    /// let err = StandardStack::builder("search")
    ///     .attempt_timeout(Duration::from_secs(5))
    ///     .total_timeout(Duration::from_secs(2))
    ///     .build()
    ///     .unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "invalid attempt_timeout: 5s (allowed: below the total_timeout, 2s)"
    /// );
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
    pub fn builder(name: &str) -> StandardStackBuilder {
        StandardStackBuilder {
            name: name.to_owned(),
            retry: None,
            load: None,
            breaker: None,
            total_timeout: DEFAULT_TOTAL_TIMEOUT,
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
        }
    }

    /// The dependency `name` of a [`Config`](crate::Config): its retry policy and
    /// budget, its load control, its breaker, and the default timeouts. A dependency
    /// whose load control the file turns off gets one that never limits; whose breaker
    /// the file turns off, one that never opens by itself (an operator can still
    /// [`isolate`](CircuitBreaker::isolate) it). For other timeouts, start from
    /// [`builder`](Self::builder) and pass the parts.
    ///
    /// ```
    /// let config = stormguard::Config::from_toml("[dependencies.payments.retry]\nmax_attempts = 2")?;
    /// let stack = stormguard::stack::StandardStack::from_config(&config, "payments")?;
    /// assert_eq!(stack.retry().name(), "payments");
    /// # Ok::<(), stormguard::ConfigError>(())
    /// ```
    #[cfg(feature = "serde")]
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    pub fn from_config(config: &crate::Config, name: &str) -> Result<Self, ConfigError> {
        let dependency = config.dependency(name)?;
        let breaker = dependency.breaker_or_off()?;
        let load = dependency.load_or_off()?;
        StandardStack::builder(name)
            .retry(dependency.retry)
            .load_control(load)
            .breaker(breaker)
            .build()
    }

    /// The retry policy: its [`stats`](RetryPolicy::stats) and its
    /// [`budget`](RetryPolicy::budget).
    pub fn retry(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The circuit breaker: its state, its stats, and operator control.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// The load control: its limit and its [`stats`](LoadControl::stats).
    pub fn load(&self) -> &LoadControl {
        &self.load
    }

    /// What a caller waits at most, retries included.
    pub fn total_timeout(&self) -> Duration {
        self.total_timeout
    }

    /// What one attempt may take.
    pub fn attempt_timeout(&self) -> Duration {
        self.attempt_timeout
    }

    /// The stack over `inner`, a service whose request bodies are `Clone`.
    pub fn http<S: Clone>(&self, inner: S) -> HttpStack<S> {
        let retry = Retry::within(
            self.retry.clone(),
            self.below(inner),
            Some(self.total_timeout),
        );
        Timeout::new(retry, self.total_timeout)
    }

    /// The stack over `inner`, a service of [`ReplayBody`](crate::ReplayBody)-wrapped
    /// requests: the caller's bodies may stream, and are kept as the first attempt sends
    /// them so that a retry can send them again.
    pub fn replay<S: Clone>(&self, inner: S) -> ReplayStack<S> {
        let retry = ReplayRetry::within(
            self.retry.clone(),
            self.below(inner),
            Some(self.total_timeout),
        );
        Timeout::new(retry, self.total_timeout)
    }

    /// The stack over a tonic `Channel` (or any service of tonic's body type).
    ///
    /// A call that fails with an HTTP/2 server's GOAWAY (a drain, a rolling restart) may
    /// or may not have been processed, and stormguard cannot track a `Channel`'s
    /// connections ([`connect`](crate::connect) has the details): it is sent again only
    /// when marked [`Idempotent`](crate::Idempotent); otherwise it fails at the caller
    /// rather than risk being processed twice.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use stormguard::stack::{GrpcStack, StandardStack};
    /// use tonic::client::Grpc;
    /// use tonic::transport::Channel;
    ///
    /// let channel = Channel::from_static("http://127.0.0.1:50051").connect().await?;
    /// let stack: GrpcStack = StandardStack::new("greeter").grpc(channel);
    /// let client = Grpc::new(stack); // what a generated client wraps
    /// # let _ = client;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "tonic")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
    pub fn grpc<S: Clone>(&self, inner: S) -> GrpcStack<S> {
        let to_tonic: fn(
            Request<crate::ReplayBody<tonic::body::Body>>,
        ) -> Request<tonic::body::Body> = |request| request.map(tonic::body::Body::new);
        self.replay(tower::util::MapRequest::new(inner, to_tonic))
    }

    fn below<S>(&self, inner: S) -> Below<S> {
        let breaker = CircuitBreakerService::new(
            Timeout::new(inner, self.attempt_timeout),
            self.breaker.clone(),
        );
        LoadControlService::new(breaker, self.load.clone()).waiting_at_most(self.attempt_timeout)
    }
}

/// Builds a [`StandardStack`]; every setting has a default.
#[derive(Debug, Clone)]
#[must_use]
pub struct StandardStackBuilder {
    name: String,
    retry: Option<RetryPolicy>,
    load: Option<LoadControl>,
    breaker: Option<CircuitBreaker>,
    total_timeout: Duration,
    attempt_timeout: Duration,
}

impl StandardStackBuilder {
    /// The load control \[`LoadControl::default()`, named after the dependency\]; its
    /// `max_wait` must be below the attempt timeout.
    pub fn load_control(mut self, control: LoadControl) -> Self {
        self.load = Some(control);
        self
    }

    /// The retry policy \[`RetryPolicy::default()`, named after the dependency\].
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// The circuit breaker \[`CircuitBreaker::default()`, named after the dependency\].
    pub fn breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.breaker = Some(breaker);
        self
    }

    /// What a caller waits at most, retries included \[30 s\]; more than zero.
    pub fn total_timeout(mut self, timeout: Duration) -> Self {
        self.total_timeout = timeout;
        self
    }

    /// What one attempt may take \[10 s\]; more than zero and below the total timeout.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// The stack's parts, or what contradicts: a zero timeout, or an attempt timeout not
    /// below the total one (the retry layer could never make a second attempt).
    pub fn build(self) -> Result<StandardStack, ConfigError> {
        if self.total_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "total_timeout",
                self.total_timeout,
                "more than zero",
            ));
        }
        if self.attempt_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "attempt_timeout",
                self.attempt_timeout,
                "more than zero",
            ));
        }
        if self.attempt_timeout >= self.total_timeout {
            return Err(ConfigError::invalid(
                "attempt_timeout",
                self.attempt_timeout,
                format!("below the total_timeout, {:?}", self.total_timeout),
            ));
        }
        let defaults = StandardStack::new(&self.name);
        let load = match self.load {
            Some(load) => load,
            // The default wait, or half an attempt timeout shorter than it.
            None => LoadControl::builder()
                .name(&self.name)
                .max_wait(stormguard_core::limit::DEFAULT_MAX_WAIT.min(self.attempt_timeout / 2))
                .build()
                .unwrap_or(defaults.load),
        };
        let wait = load.limit().config().max_wait();
        if wait >= self.attempt_timeout {
            return Err(ConfigError::invalid(
                "max_wait",
                wait,
                format!("below the attempt_timeout, {:?}", self.attempt_timeout),
            ));
        }
        Ok(StandardStack {
            retry: self.retry.unwrap_or(defaults.retry),
            load,
            breaker: self.breaker.unwrap_or(defaults.breaker),
            total_timeout: self.total_timeout,
            attempt_timeout: self.attempt_timeout,
        })
    }
}
