//! Sans-IO retry decisions for [stormguard](https://docs.rs/stormguard).
//!
//! Every decision stormguard makes is a pure function of its inputs and an explicit
//! `now`: how long to wait ([`Backoff`]), what a `Retry-After` or
//! `grpc-retry-pushback-ms` header asks for ([`retry_after`]), whether an outcome is
//! worth another attempt ([`classify`]), whether the client may still afford a retry
//! ([`RetryBudget`]) and whether the dependency is taking calls at all
//! ([`breaker::Breaker`]), when a slow request deserves a hedge
//! ([`hedge::LatencyEstimator`]), how long a retry may still wait ([`deadline`]), and
//! what a queue consumer tells its broker after a delivery ([`redelivery`]). Nothing
//! here reads a clock (every decision takes `now`; a budget counts its epochs from the
//! origin its builder was given, or from an hour before the first `now` it sees; clippy's
//! `disallowed-methods` keeps it so), spawns a task or depends on tokio or tower, so the same rules serve the Tower middleware, a queue consumer
//! that lets its broker hold the backoff, and a simulator running on virtual time.
//!
//! ```
//! use std::time::Duration;
//! use stormguard_core::{Backoff, Jitter};
//!
//! let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10), Jitter::Full)?;
//! for (retry, delay) in backoff.schedule_seeded(7).take(3).enumerate() {
//!     assert!(delay < backoff.ceiling(retry as u32));
//! }
//! # Ok::<(), stormguard_core::ConfigError>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod classify;
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub mod config;
pub mod deadline;
mod error;
pub mod hedge;
pub mod limit;
pub mod methods;
pub mod redelivery;
pub mod retry;
pub mod retry_after;
mod sync;
pub mod throttle;

#[cfg(all(loom, test))]
#[allow(clippy::disallowed_methods)] // the model takes its time zero from the clock
mod loom_model;

pub use backoff::{Backoff, Jitter, Schedule};
pub use breaker::{
    Breaker, BreakerConfig, BreakerConfigBuilder, CircuitState, Outcome, Permit, Rejected,
    Transition,
};
pub use budget::{RetryBudget, RetryBudgetBuilder};
pub use classify::Class;
pub use error::ConfigError;
