use tower_layer::Layer;

use super::{CircuitBreaker, CircuitBreakerService};

/// Wraps a service in a circuit breaker; see the [module docs](super) for where it goes
/// in a stack and what it counts.
///
/// ```
/// use stormguard::{CircuitBreaker, CircuitBreakerLayer};
/// use tower::ServiceBuilder;
///
/// let breaker = CircuitBreaker::default();
/// let builder = ServiceBuilder::new().layer(CircuitBreakerLayer::new(breaker.clone()));
/// # let _ = builder;
/// ```
///
/// # Clone
///
/// Clones, and every service the layer makes, share the one [`CircuitBreaker`].
#[derive(Debug, Clone)]
pub struct CircuitBreakerLayer {
    breaker: CircuitBreaker,
}

impl CircuitBreakerLayer {
    /// A layer reporting to `breaker`.
    pub const fn new(breaker: CircuitBreaker) -> Self {
        CircuitBreakerLayer { breaker }
    }
}

impl<S> Layer<S> for CircuitBreakerLayer {
    type Service = CircuitBreakerService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CircuitBreakerService::new(inner, self.breaker.clone())
    }
}
