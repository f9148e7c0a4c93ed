//! Tower middleware that retries without making things worse: full-jitter backoff,
//! classification before any retry, `Retry-After` and gRPC pushback, a budget that bounds
//! the *wasted* retries, a circuit breaker, and request bodies kept so they can be resent.
//!
//! # Set up
//!
//! ```sh
//! cargo add stormguard
//! # in a clone of the repository:
//! cargo run --release --example storm     # the main job: an outage, five retry strategies
//! cargo test --workspace --all-features   # the tests
//! ```
//!
//! # The recommended stack, in one line
//!
//! [`StandardStack`]: a total timeout (30 s, the retry layer's deadline), retry, circuit
//! breaker and attempt timeout (10 s), over hyper-util's `Client`, a tonic `Channel`
//! ([`grpc`](StandardStack::grpc)) or any service; its type has a name:
//!
//! ```
//! use hyper_util::client::legacy::{connect::HttpConnector, Client};
//! use hyper_util::rt::TokioExecutor;
//! use stormguard::connect::TrackedConnector;
//! use stormguard::{StandardStack, stack::HttpStack};
//!
//! struct Upstreams {
//!     users: HttpStack<Client<TrackedConnector<HttpConnector>, String>>,
//! }
//!
//! // Tracked connections: a timed-out POST that never left is retried (`connect`).
//! let connector = TrackedConnector::new(HttpConnector::new());
//! let client = Client::builder(TokioExecutor::new()).build(connector);
//! let upstreams = Upstreams { users: StandardStack::new("users").http(client) };
//! # let _ = upstreams.users;
//! ```
//!
//! The [`stack`] module says why each layer sits where it does and why the defaults are
//! what they are; each layer is usable on its own in a `ServiceBuilder`.
//!
//! # What is in it
//!
//! - [`retry`]: [`RetryLayer`] and [`RetryPolicy`]: what is retried and when, the budget,
//!   deadlines, graceful drains (transparent retries), tonic, tracing.
//! - [`breaker`]: [`CircuitBreakerLayer`] and [`CircuitBreaker`].
//! - [`hedge`]: [`HedgeLayer`] and [`HedgePolicy`]: a second copy of a slow idempotent
//!   request, paid from the same budget.
//! - [`signals`]: retries across layers of services (`x-no-retry`, the attempt count).
//! - [`body`]: [`ReplayBody`], request bodies kept as they are sent.
//! - `connect` (feature `hyper-util`, on by default): `TrackedConnector`, with which a
//!   request hyper-util leaves unwritten on a drained connection is retried, a POST
//!   included.
//! - `config` (feature `serde`): per-dependency settings from TOML, JSON or a gRPC
//!   service config; `metrics` (feature `metrics`): the series, through the `metrics`
//!   facade.
//! - The decisions themselves are pure functions of an explicit `now` in
//!   [`stormguard_core`], re-exported in [`sans_io`]: the backoff, the budget, the
//!   retry's and the breaker's state machines, classification, deadlines, the
//!   redelivery decisions of queue consumers, and `Retry-After`'s parsers
//!   ([`sans_io::retry_after`]).
//!
//! # What it does under failure
//!
//! In the main job (`examples/storm`), a dependency answers every request 503 for a few
//! seconds while a fleet keeps offering it less than its capacity, once per retry
//! strategy; the chart shows the attempts per second at the server:
//!
#![doc = include_str!("../docs/storm.svg")]
//!
//! The naive and unlimited fleets hold the dependency down after the outage; behind
//! stormguard's budget and breaker the outage costs the dependency a small fraction of
//! an attempt per request, and it recovers shortly after the outage ends. The measured
//! figures, for every scenario, are in the main-job page of the guide (docs/main-job.md
//! in the repository), and those behind the defaults in its defaults page
//! (docs/defaults.md).
//!
//! # Cargo features
//!
//! `hyper`, `hyper-util` and `h2` (on by default) teach the layers those crates' error
//! types (closed connections, connect errors, `REFUSED_STREAM` and GOAWAY), and
//! `hyper-util` adds the `connect` module; `tonic`
//! teaches tonic's and enables [`StandardStack::grpc`]; `metrics` and `serde` add the
//! modules of their names. With `default-features = false` the middleware needs only
//! tower, http and tokio's timer.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod body;
pub mod breaker;
mod circuit_open;
pub mod classify;
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub mod config;
#[cfg(feature = "hyper-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "hyper-util")))]
pub mod connect;
mod error_class;
mod give_up;
pub mod hedge;
pub mod load;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod reqwest;
pub mod retry;
mod shed;
pub mod signals;
pub mod stack;
mod tower_budget;

pub use body::{NotReplayable, ReplayBody};
pub use breaker::{CircuitBreaker, CircuitBreakerLayer, CircuitOpen};
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub use config::Config;
pub use error_class::Unprocessed;
pub use hedge::{HedgeLayer, HedgePolicy};
pub use load::{LoadControl, LoadControlLayer, Shed};
pub use retry::{Attempts, GiveUp, Idempotent, NoRetry, Retry, RetryLayer, RetryPolicy};
pub use stack::StandardStack;
pub use stormguard_core::{deadline::Deadline, Backoff, ConfigError, Jitter, RetryBudget};

/// The sans-IO decisions the layers drive (the `stormguard-core` crate): the budget and
/// the backoff in full, the breaker's and the retry's state machines, classification,
/// deadlines, gRPC method tables, and the redelivery decisions of a queue consumer, each
/// with an explicit `now`, for drivers of your own.
pub mod sans_io {
    pub use stormguard_core::{
        backoff, breaker, budget, classify, deadline, hedge, limit, methods, redelivery, retry,
        retry_after, throttle, Class,
    };
}

// The README's examples are compiled as doc tests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The error type of the services stormguard's layers make: any error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
