use tower_layer::Layer;

use super::{Hedge, HedgePolicy};

/// Hedges requests by a [`HedgePolicy`]: `.layer(HedgeLayer::new(policy))`.
///
/// Put it below the [`RetryLayer`](crate::RetryLayer) and above the circuit breaker and
/// the per-attempt timeout; the [module docs](crate::hedge) say why.
///
/// ```
/// use stormguard::{HedgeLayer, HedgePolicy};
/// use tower::ServiceBuilder;
///
/// let svc = ServiceBuilder::new()
///     .layer(HedgeLayer::new(HedgePolicy::default()))
///     .service(tower::service_fn(|_req: http::Request<String>| async {
///         Ok::<_, stormguard::BoxError>(http::Response::new(()))
///     }));
/// # drop(svc);
/// ```
#[derive(Debug, Clone)]
pub struct HedgeLayer {
    policy: HedgePolicy,
}

impl HedgeLayer {
    /// A layer hedging by `policy`.
    pub const fn new(policy: HedgePolicy) -> Self {
        HedgeLayer { policy }
    }

    /// The policy the layer's services hedge by.
    pub fn policy(&self) -> &HedgePolicy {
        &self.policy
    }
}

impl<S> Layer<S> for HedgeLayer {
    type Service = Hedge<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Hedge::new(inner, self.policy.clone())
    }
}
