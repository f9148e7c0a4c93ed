//! The [`SignalsLayer`].

use tower_layer::Layer;

use super::Signals;

/// Server-side layer: marks failures caused by outbound give-ups as "do not retry",
/// and exposes the caller's attempt number; see the [module docs](super).
#[derive(Debug, Clone, Copy, Default)]
pub struct SignalsLayer {
    retries_call_once: bool,
}

impl SignalsLayer {
    /// The layer: marks responses, reads attempt numbers; outbound calls keep their
    /// attempts.
    pub const fn new() -> Self {
        SignalsLayer {
            retries_call_once: false,
        }
    }

    /// When `yes`, a request that is itself a retry (attempt 2 or later) makes its
    /// outbound calls through stormguard's retry layer with one attempt only (a
    /// transparent retry is still made) \[false\].
    pub const fn retries_call_once(mut self, yes: bool) -> Self {
        self.retries_call_once = yes;
        self
    }
}

impl<S> Layer<S> for SignalsLayer {
    type Service = Signals<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Signals {
            inner,
            retries_call_once: self.retries_call_once,
        }
    }
}
