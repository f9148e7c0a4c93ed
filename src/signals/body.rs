//! The body of a response through [`Signals`](super::Signals): a gRPC status in the
//! trailers is marked "do not retry" as a status in the head is.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::{give_up_of, mark_grpc, Inbound, INBOUND};

pin_project! {
    /// The body of a response through [`Signals`](super::Signals): the handler's body.
    ///
    /// A gRPC response whose status comes in its trailers (a server stream, a unary
    /// call answered headers first) is failed there, after its head has gone out. For
    /// such a response this body is polled in the scope of the inbound request, so that
    /// an outbound call made while the stream is produced reports its give-up as one
    /// made by the handler does, and, if an outbound call gave up, a failed status in
    /// the trailers gets `grpc-retry-pushback-ms: -1`. Every other body is passed
    /// through.
    pub struct ResponseBody<B> {
        #[pin]
        inner: B,
        inbound: Option<Arc<Inbound>>,
    }
}

impl<B> ResponseBody<B> {
    /// A body with nothing to mark.
    pub(super) fn plain(inner: B) -> Self {
        ResponseBody {
            inner,
            inbound: None,
        }
    }

    /// A body whose trailers carry the status.
    pub(super) fn watched(inner: B, inbound: Arc<Inbound>) -> Self {
        ResponseBody {
            inner,
            inbound: Some(inbound),
        }
    }

    /// The inner body, unwrapped: its trailers will not be marked.
    pub fn into_inner(self) -> B {
        self.inner
    }

    /// The inner body.
    pub fn get_ref(&self) -> &B {
        &self.inner
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
        let Some(inbound) = this.inbound.as_ref() else {
            return this.inner.poll_frame(cx);
        };
        let inner = this.inner;
        let mut polled = INBOUND.sync_scope(Arc::clone(inbound), || inner.poll_frame(cx));
        if let Poll::Ready(Some(Ok(frame))) = &mut polled {
            if let Some(trailers) = frame.trailers_mut() {
                if give_up_of(inbound.gave_up.load(Ordering::Relaxed)).is_some() {
                    mark_grpc(trailers);
                }
                *this.inbound = None;
            }
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
            .field("watching_trailers", &self.inbound.is_some())
            .finish()
    }
}
