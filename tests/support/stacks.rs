//! The success-path setup shared by `benches/overhead.rs`,
//! `benches/ratio.rs` and `tests/allocations.rs`: one request type, two requests (a bare one and a realistic
//! one), an always-200 upstream, tower's least retry policy, and a tower policy with
//! tower's `TpsBudget`.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response};
use http_body_util::combinators::WithTrailers;
use http_body_util::{BodyExt, Full};
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::Policy;
use tower::{service_fn, BoxError, Service};

/// The request every stack is sent.
pub(crate) type Req = Request<Full<Bytes>>;
/// The response every stack returns.
pub(crate) type Res = Response<Full<Bytes>>;

/// Where the requests go (the in-memory upstream ignores it).
pub(crate) const UPSTREAM: &str = "http://upstream/items/7";

/// A `GET` with a small body, built afresh for each call.
pub(crate) fn request() -> Req {
    Request::get(UPSTREAM)
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request")
}

/// A 1 KiB JSON-ish body.
static BODY: [u8; 1024] = [b'7'; 1024];

/// A `PUT` to `uri` as a real client sends one, built afresh for each call: ten headers
/// (an `Authorization`, a cookie, a W3C trace context...), their values owned as a
/// client's are, and a 1 KiB body.
pub(crate) fn realistic_request(uri: &str) -> Req {
    const HEADERS: [(&str, &str); 10] = [
        ("host", "upstream"),
        ("user-agent", "stormguard-bench/0.1"),
        ("accept", "application/json"),
        ("accept-encoding", "gzip, br"),
        ("content-type", "application/json"),
        ("content-length", "1024"),
        (
            "authorization",
            "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiI3In0.c2lnbmF0dXJl",
        ),
        ("x-request-id", "7f3c1e2a-5b8d-4c6e-9a1f-2d3b4c5d6e7f"),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        ("cookie", "session=5f2b8c1d9e; theme=dark"),
    ];
    let mut req = Request::new(Full::new(Bytes::from_static(&BODY)));
    *req.method_mut() = Method::PUT;
    *req.uri_mut() = uri.parse().expect("uri");
    let headers = req.headers_mut();
    for (name, value) in HEADERS {
        headers.insert(
            HeaderName::from_static(name),
            HeaderValue::from_str(value).expect("header value"),
        );
    }
    req
}

/// An upstream that answers 200 at once.
pub(crate) fn upstream(
) -> impl Service<Req, Response = Res, Error = BoxError, Future = Ready<Result<Res, BoxError>>> + Clone
{
    service_fn(|_req: Req| ready(Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))))
}

/// A unary gRPC call as tonic sends one, built afresh for each call: `POST`,
/// `application/grpc`, `te: trailers`, a five-byte empty message.
#[allow(dead_code)] // overhead.rs measures plain HTTP only
pub(crate) fn grpc_request() -> Req {
    Request::post("http://upstream/stormguard.bench.Items/Get")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
        .expect("request")
}

/// A gRPC response's body: one message, then trailers.
pub(crate) type GrpcBody = WithTrailers<Full<Bytes>, Ready<Option<Result<HeaderMap, Infallible>>>>;

/// What a gRPC server answers a unary call that succeeds: `200`, `application/grpc`,
/// the message, and `grpc-status: 0` in the trailers (so a layer that watches the end
/// of the stream pays for it here).
#[allow(dead_code)] // overhead.rs measures plain HTTP only
pub(crate) fn grpc_upstream() -> impl Service<
    Req,
    Response = Response<GrpcBody>,
    Error = BoxError,
    Future = Ready<Result<Response<GrpcBody>, BoxError>>,
> + Clone {
    service_fn(|_req: Req| {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let body = Full::new(Bytes::from_static(&[0, 0, 0, 0, 2, 8, 7]))
            .with_trailers(ready(Some(Ok(trailers))));
        let response = Response::builder()
            .header("content-type", "application/grpc")
            .body(body)
            .map_err(BoxError::from);
        ready(response)
    })
}

/// The least a tower retry policy can do: clone the request, never retry.
#[derive(Clone)]
pub(crate) struct NeverRetry;

impl<B, E> Policy<Req, Response<B>, E> for NeverRetry {
    type Future = Ready<()>;

    fn retry(&mut self, _: &mut Req, _: &mut Result<Response<B>, E>) -> Option<Self::Future> {
        None
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

/// A tower policy as users write one with `TpsBudget`: deposit for every request that
/// succeeded, withdraw for every retry.
#[derive(Clone)]
pub(crate) struct TpsPolicy {
    budget: Arc<TpsBudget>,
    attempts: u32,
}

impl TpsPolicy {
    /// 10% over 10 s and a floor of 1 retry/s, as stormguard's default budget (but for
    /// its floor of 1 retry per window).
    pub(crate) fn new() -> Self {
        TpsPolicy {
            budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 1, 0.1)),
            attempts: 0,
        }
    }
}

impl<B, E> Policy<Req, Response<B>, E> for TpsPolicy {
    type Future = tokio::time::Sleep;

    fn retry(&mut self, _: &mut Req, result: &mut Result<Response<B>, E>) -> Option<Self::Future> {
        match result {
            Ok(res) if !res.status().is_server_error() => {
                self.budget.deposit();
                None
            }
            _ if self.attempts >= 2 || !self.budget.withdraw() => None,
            _ => {
                self.attempts += 1;
                Some(tokio::time::sleep(Duration::from_millis(200)))
            }
        }
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}
