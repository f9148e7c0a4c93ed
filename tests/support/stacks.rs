//! The success-path setup shared by `benches/overhead.rs` and `tests/allocations.rs`:
//! one request type, an always-200 upstream, and tower's least retry policy.

use std::future::{ready, Ready};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tower::retry::Policy;
use tower::{service_fn, BoxError, Service};

/// The request every stack is sent.
pub(crate) type Req = Request<Full<Bytes>>;
/// The response every stack returns.
pub(crate) type Res = Response<Full<Bytes>>;

/// A `GET` with a small body, built afresh for each call.
pub(crate) fn request() -> Req {
    Request::get("http://upstream/items/7")
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request")
}

/// An upstream that answers 200 at once.
pub(crate) fn upstream(
) -> impl Service<Req, Response = Res, Error = BoxError, Future = Ready<Result<Res, BoxError>>> + Clone
{
    service_fn(|_req: Req| ready(Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))))
}

/// The least a tower retry policy can do: clone the request, never retry.
#[derive(Clone)]
pub(crate) struct NeverRetry;

impl<E> Policy<Req, Res, E> for NeverRetry {
    type Future = Ready<()>;

    fn retry(&mut self, _: &mut Req, _: &mut Result<Res, E>) -> Option<Self::Future> {
        None
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}
