//! placeholder until the breaker branch lands
use std::time::Duration;
/// A circuit breaker refused the call.
#[derive(Debug, Clone)]
pub struct CircuitOpen {
    /// Time left.
    pub remaining: Duration,
}
impl CircuitOpen {
    /// new
    pub fn new(remaining: Duration) -> Self {
        CircuitOpen { remaining }
    }
}
impl std::fmt::Display for CircuitOpen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "circuit open")
    }
}
impl std::error::Error for CircuitOpen {}
