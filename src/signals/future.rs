//! The response future of [`Signals`](super::Signals).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use tokio::task::futures::TaskLocalFuture;

use super::{give_up_of, mark, Inbound, ResponseBody};

pin_project! {
    /// The response future of [`Signals`](super::Signals): the inner response, marked "do not retry"
    /// when it failed after an outbound call gave up.
    pub struct ResponseFuture<F> {
        #[pin]
        future: TaskLocalFuture<Arc<Inbound>, F>,
        inbound: Arc<Inbound>,
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn new(future: TaskLocalFuture<Arc<Inbound>, F>, inbound: Arc<Inbound>) -> Self {
        ResponseFuture { future, inbound }
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, ResB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<ResB>, E>>,
{
    type Output = Result<Response<ResponseBody<ResB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut result = std::task::ready!(this.future.poll(cx));
        let gave_up = this.inbound.gave_up.load(Ordering::Relaxed);
        if let (Ok(res), Some(why)) = (&mut result, give_up_of(gave_up)) {
            mark(res, why);
        }
        Poll::Ready(result.map(|res| {
            if stormguard_core::classify::status_in_trailers(res.status(), res.headers()) {
                let inbound = Arc::clone(this.inbound);
                res.map(|body| ResponseBody::watched(body, inbound))
            } else {
                res.map(ResponseBody::plain)
            }
        }))
    }
}
