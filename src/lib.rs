#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod body;
pub mod breaker;
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub mod config;
mod error_class;
mod give_up;
pub mod hedge;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
pub mod retry;
pub mod signals;
pub mod stack;
mod tower_budget;

pub use body::{NotReplayable, ReplayBody};
pub use breaker::{BreakerStats, CircuitBreaker, CircuitBreakerLayer, CircuitOpen};
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub use config::{Config, Dependency};
pub use error_class::Unprocessed;
pub use hedge::{Hedge, HedgeLayer, HedgePolicy, HedgePolicyBuilder, HedgeStats};
pub use retry::{
    Attempts, GiveUp, Idempotent, NoRetry, Retry, RetryLayer, RetryPolicy, RetryPolicyBuilder,
    RetryStats,
};
pub use stack::{HttpStack, StandardStack};
pub use stormguard_core::{
    backoff, budget, classify, deadline, deadline::Deadline, methods, redelivery, retry_after,
    throttle, Backoff, CircuitState, Class, ConfigError, Jitter, RetryBudget, RetryBudgetBuilder,
    Transition,
};
pub use tower_budget::TowerBudget;

/// The error type of the services stormguard's layers make: any error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
