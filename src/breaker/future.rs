//! The response future of [`CircuitBreakerService`](super::CircuitBreakerService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use stormguard_core::breaker::Permit;

use super::{BoxError, CircuitBreaker, CircuitOpen};

pin_project! {
    /// The response of a call through the circuit breaker: the inner service's response,
    /// whose outcome is reported to the breaker when it completes, or [`CircuitOpen`]
    /// at once when the breaker refused the call.
    ///
    /// Dropping it before it completes gives its permit back unused, so a cancelled
    /// half-open probe frees its slot for the next caller.
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F> {
        Called {
            #[pin]
            future: F,
            guard: Guard,
        },
        Rejected {
            error: CircuitOpen,
        },
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn called(future: F, guard: Guard) -> Self {
        ResponseFuture {
            kind: Kind::Called { future, guard },
        }
    }

    pub(super) fn rejected(error: CircuitOpen) -> Self {
        ResponseFuture {
            kind: Kind::Rejected { error },
        }
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Called { guard, .. } => f
                .debug_struct("ResponseFuture")
                .field("pending", &guard.permit.is_some())
                .finish_non_exhaustive(),
            Kind::Rejected { error } => f
                .debug_struct("ResponseFuture")
                .field("rejected", error)
                .finish(),
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<B>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Called { future, guard } => {
                let result = ready!(future.poll(cx));
                Poll::Ready(match result {
                    Ok(response) => {
                        let outcome = guard.breaker.classify_response(&response);
                        guard.finish(outcome);
                        Ok(response)
                    }
                    Err(error) => {
                        let error = error.into();
                        guard.finish(CircuitBreaker::classify_error(&*error));
                        Err(error)
                    }
                })
            }
            KindProj::Rejected { error } => Poll::Ready(Err(Box::new(error.clone()))),
        }
    }
}

/// Holds the permit of a call in flight; gives it back unused if dropped first,
/// including while a panic in the inner service's `call` or future unwinds.
pub(super) struct Guard {
    breaker: CircuitBreaker,
    permit: Option<Permit>,
}

impl Guard {
    pub(super) fn new(breaker: CircuitBreaker, permit: Permit) -> Self {
        Guard {
            breaker,
            permit: Some(permit),
        }
    }

    fn finish(&mut self, outcome: stormguard_core::breaker::Outcome) {
        if let Some(permit) = self.permit.take() {
            self.breaker.record(permit, outcome);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            self.breaker.release(permit);
        }
    }
}
