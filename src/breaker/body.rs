//! The body of a response through the breaker: for a gRPC response whose status comes in
//! its trailers, the end of the stream is where the breaker learns the outcome.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use stormguard_core::breaker::Outcome;
use stormguard_core::classify::grpc_status;

use super::future::Guard;

pin_project! {
    /// The body of a response through [`CircuitBreakerService`](super::CircuitBreakerService):
    /// the inner service's body, unchanged.
    ///
    /// Most responses tell the breaker their outcome in their head (an HTTP status, a
    /// trailers-only gRPC status), and their body is passed through with nothing to do
    /// but one check of a field per frame. A gRPC response that starts with `200` and
    /// no `grpc-status` (every streaming response, and a unary one from a server that
    /// sends its headers before its trailers) says how it ended only in its trailers:
    /// this body reads the `grpc-status` there, as frames go by, without buffering
    /// anything, and reports it to the breaker as the call's outcome:
    ///
    /// - a status the breaker counts as a failure
    ///   ([`failure_grpc_codes`](super::CircuitBreakerBuilder::failure_grpc_codes)) is a
    ///   failure, `0` a success, any other code neither;
    /// - a stream that ends without trailers, or with trailers that carry no status, is
    ///   a failure (INTERNAL, as gRPC clients read it), and so is an error of the body
    ///   itself (a reset stream, a lost connection);
    /// - a body dropped before its end (the caller cancelled, or lost interest) is
    ///   neither: it gives its permit back unused.
    ///
    /// A half-open probe is decided at the first message or the end of the stream,
    /// whichever comes first: a message is the dependency doing its job, and a probe
    /// answered with a long stream must not hold the probe slot (and keep every other
    /// call refused) for the stream's life. A stream that fails after its first message
    /// is then counted by the calls after it, in the closed circuit.
    pub struct ResponseBody<B> {
        #[pin]
        inner: B,
        // The call's guard, while its outcome is still to come.
        watch: Option<Guard>,
    }
}

impl<B> ResponseBody<B> {
    /// A body whose outcome was known from the response's head.
    pub(super) fn plain(inner: B) -> Self {
        ResponseBody { inner, watch: None }
    }

    /// A body whose outcome is in its trailers.
    pub(super) fn watched(inner: B, guard: Guard) -> Self {
        ResponseBody {
            inner,
            watch: Some(guard),
        }
    }

    /// The inner body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// The inner body, mutably.
    pub fn get_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    /// The inner body, unwrapped. A body still watched for its trailers stops being
    /// watched: the call counts as neither success nor failure.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B: Body> Body for ResponseBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        let Some(guard) = this.watch.as_ref() else {
            return polled;
        };
        let outcome = match &polled {
            Poll::Pending => return polled,
            Poll::Ready(Some(Ok(frame))) => match frame.trailers_ref() {
                Some(trailers) => guard.grpc_outcome(grpc_status(trailers)),
                // A message: it decides a probe, and nothing else yet.
                None if guard.is_probe() => Outcome::Success,
                None => return polled,
            },
            Poll::Ready(Some(Err(_))) => Outcome::Failure,
            Poll::Ready(None) => guard.grpc_outcome(None),
        };
        if let Some(mut guard) = this.watch.take() {
            guard.finish(outcome);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B: fmt::Debug> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("inner", &self.inner)
            .field("watching_trailers", &self.watch.is_some())
            .finish()
    }
}
