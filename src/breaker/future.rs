//! The response future of [`CircuitBreakerService`](super::CircuitBreakerService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use stormguard_core::breaker::Permit;

use super::body::ResponseBody;
use super::{BoxError, CircuitBreaker, CircuitOpen, Verdict};

pin_project! {
    /// The response of a call through the circuit breaker: the inner service's response,
    /// whose outcome is reported to the breaker when it completes (or, for a gRPC
    /// response whose status is in its trailers, when its [`ResponseBody`] ends), or
    /// [`CircuitOpen`] at once when the breaker refused the call.
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
            // Taken when the response comes: reported then, or handed to its body.
            guard: Option<Guard>,
        },
        Rejected {
            error: CircuitOpen,
        },
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn called(future: F, guard: Guard) -> Self {
        ResponseFuture {
            kind: Kind::Called {
                future,
                guard: Some(guard),
            },
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
                .field(
                    "pending",
                    &guard.as_ref().is_some_and(|guard| guard.permit.is_some()),
                )
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
    type Output = Result<Response<ResponseBody<B>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Called { future, guard } => {
                let result = ready!(future.poll(cx));
                let Some(mut guard) = guard.take() else {
                    // Polled again after it completed: a contract violation of the caller.
                    return Poll::Ready(Err("polled after completion".into()));
                };
                let response = match result {
                    Ok(response) => response,
                    Err(error) => {
                        let error = error.into();
                        guard.finish(guard.breaker.classify_error(&*error));
                        return Poll::Ready(Err(error));
                    }
                };
                let verdict = guard.breaker.classify_response(&response);
                // One place the response is rebuilt around its watched body: each
                // rebuilding is a copy of the response's head.
                let (head, body) = response.into_parts();
                let body = match verdict {
                    Verdict::Now(outcome) => {
                        guard.finish(outcome);
                        ResponseBody::plain(body)
                    }
                    Verdict::AtEnd => ResponseBody::watched(body, guard),
                };
                Poll::Ready(Ok(Response::from_parts(head, body)))
            }
            KindProj::Rejected { error } => Poll::Ready(Err(Box::new(error.clone()))),
        }
    }
}

/// Holds the permit of a call in flight; gives it back unused if dropped first,
/// including while a panic in the inner service's `call` or future unwinds.
pub(crate) struct Guard {
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

    /// Whether this call is a half-open probe (and not yet reported).
    pub(super) fn is_probe(&self) -> bool {
        self.permit.as_ref().is_some_and(Permit::is_probe)
    }

    /// What a `grpc-status` of `code` (`None`: a stream that ended without one, which
    /// gRPC clients read as INTERNAL) is for this call's breaker.
    pub(super) fn grpc_outcome(&self, code: Option<i32>) -> stormguard_core::breaker::Outcome {
        self.breaker
            .grpc_outcome(code.unwrap_or(stormguard_core::classify::GrpcCodeSet::INTERNAL))
    }

    /// Reports the call's outcome, once.
    pub(crate) fn finish(&mut self, outcome: stormguard_core::breaker::Outcome) {
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
