//! A fleet simulator on virtual time for stormguard.
//!
//! It drives the same decision code the middleware uses (`stormguard-core`'s
//! [`Backoff`](stormguard_core::Backoff) schedules, [`RetryBudget`](stormguard_core::RetryBudget),
//! [`RetryThrottle`](stormguard_core::throttle::RetryThrottle), the
//! [`LoadLimit`](stormguard_core::limit::LoadLimit), the
//! [`Breaker`](stormguard_core::breaker::Breaker) state machine and response
//! [classification](stormguard_core::classify)) for up to 10^5 clients, seconds of fleet
//! time in milliseconds of wall time, with no tokio and no sleeping. Every run is a pure
//! function of its configuration and seed.
//!
//! - [`model`]: the fleet (server, timeline of failures, open-loop clients).
//! - [`strategy`]: the retry strategies compared.
//! - [`jitter`]: Brooker 2015's contention model.
//! - [`experiments`]: the reproductions (retry curves, metastable failure) and the tables.
//!
//! ```
//! use stormguard_sim::model::{run, FleetConfig, Scenario, Timeline};
//! use stormguard_sim::strategy::Strategy;
//!
//! let mut cfg = FleetConfig::new(100, 10.0, 7);
//! cfg.timeline = Timeline { scenario: Scenario::Outage, start: 3.0, duration: 2.0 };
//! let strategy = Strategy::named("stormguard", 3).expect("known strategy");
//! let report = run(&cfg, &strategy)?;
//! assert_eq!(report.offered, report.succeeded + report.failed);
//! # Ok::<(), String>(())
//! ```

#![forbid(unsafe_code)]

pub mod experiments;
pub mod jitter;
pub mod model;
pub mod plot;
pub mod strategy;
