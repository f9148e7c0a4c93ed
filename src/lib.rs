//! stormguard: Tower middleware that retries without making things worse.

pub mod breaker;

pub use breaker::{BreakerStats, CircuitBreaker, CircuitBreakerLayer, CircuitOpen};
pub use stormguard_core::CircuitState;
