//! Signals across layers: "do not retry" travels up, attempt numbers travel down.
//!
//! Retries multiply across a chain of services: three attempts at each of three hops
//! is 27 requests at the bottom for one user action. A retry budget bounds each hop
//! alone; these signals stop the product.
//!
//! - **Up.** When this server fails *because its own outbound calls gave up* (their
//!   budget was spent, a breaker refused, the attempts ran out, a deadline left no room,
//!   or the dependency itself said not to retry), retrying this server cannot help: its
//!   dependency is already getting all the retries it should. [`SignalsLayer`], on the
//!   server, marks such a failed response so its callers do not retry it: HTTP gets
//!   `x-no-retry: <reason>` ([`X_NO_RETRY`]), a gRPC error `grpc-retry-pushback-ms: -1`
//!   (gRFC A6's "do not retry"). stormguard's retry layer honours both (reason
//!   `dont_retry`, or `pushback` for gRPC), and Finagle's `finagle-http-nonretryable-nack`
//!   too, and Envoy's `x-envoy-overloaded` and `x-envoy-ratelimited`, which Envoy sets on a
//!   request it shed and does not retry itself. The handler does nothing special: the
//!   retry layer of its outbound client reports its give-ups to the inbound request's
//!   layer through a tokio task-local, so the outbound call must be awaited in the
//!   handler's task (not a task it spawns).
//! - **Down.** stormguard's HTTP retries carry `x-attempt-count: N` ([`X_ATTEMPT_COUNT`],
//!   like Envoy's `x-envoy-attempt-count`; gRPC retries carry
//!   `grpc-previous-rpc-attempts`). The layer reads it into an [`InboundAttempt`]
//!   request extension for handlers, and with
//!   [`retries_call_once`](SignalsLayer::retries_call_once) an inbound request that is
//!   itself a retry makes its outbound calls with one attempt only (Google SRE: retry at
//!   the layer directly above the failure, not at every layer).
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response, StatusCode};
//! use stormguard::signals::{InboundAttempt, SignalsLayer};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Infallible> {
//! let server = ServiceBuilder::new()
//!     .layer(SignalsLayer::new().retries_call_once(true))
//!     .service(service_fn(|req: Request<()>| async move {
//!         let attempt = InboundAttempt::of(&req);
//!         Ok::<_, Infallible>(Response::new(format!("attempt {attempt}")))
//!     }));
//! let req = Request::get("/").header("x-attempt-count", "2").body(()).unwrap();
//! let res = server.oneshot(req).await?;
//! assert_eq!(res.into_body().into_inner(), "attempt 2");
//! # Ok(())
//! # }
//! ```
//!
//! With axum: `Router::new().route(...).layer(SignalsLayer::new())`; with tonic:
//! `Server::builder().layer(SignalsLayer::new())`. A gRPC error is marked where its
//! status is: in the head of a trailers-only response (how tonic answers a unary call
//! that returns an error), or in the trailers after a streamed body, where the
//! response's [`ResponseBody`] adds the pushback (and polls the stream in the inbound
//! request's scope, so that outbound calls the stream makes count as the handler's).
//!
//! # Why a budget is not enough
//!
//! Each hop's budget bounds that hop alone. It charges the retries of requests that end
//! unserved, so the retries still in flight below when a hop decides are not yet charged,
//! and every hop of a chain spends its own 10% plus its allowance. The signals stop the
//! product: a hop whose dependency gave up says so, and its callers do not retry it.
//! `cargo run --release --example layers` in the repository compares naive retries,
//! budgets alone and budgets with the signals on a chain of three hops whose last fails.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response};
use stormguard_core::classify::{grpc_status, GRPC_PREVIOUS_RPC_ATTEMPTS, GRPC_RETRY_PUSHBACK_MS};
pub use stormguard_core::classify::{X_ATTEMPT_COUNT, X_NO_RETRY};
use tower_service::Service;

use crate::give_up::GiveUp;

mod body;
pub mod future;
mod layer;

pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use layer::SignalsLayer;

tokio::task_local! {
    /// The inbound request being handled in this task, if a [`SignalsLayer`] serves it.
    static INBOUND: Arc<Inbound>;
}

/// What the outbound retry layer and the inbound signals layer share for one request.
#[derive(Debug)]
struct Inbound {
    /// Whether outbound calls get one attempt only.
    call_once: bool,
    /// The first give-up of an outbound call that signals "do not retry", as
    /// `GIVE_UPS` index + 1; 0 while there is none.
    gave_up: AtomicU8,
}

/// The give-ups that mean this server's failure is its dependencies' overload.
const GIVE_UPS: [GiveUp; 8] = [
    GiveUp::Exhausted,
    GiveUp::Budget,
    GiveUp::CircuitOpen,
    GiveUp::Deadline,
    GiveUp::DontRetry,
    GiveUp::Pushback,
    GiveUp::RetryAfterTooLong,
    GiveUp::Shed,
];

/// Called by the retry layer when an outbound call gives up.
pub(crate) fn record_give_up(why: GiveUp) {
    let Some(index) = GIVE_UPS.iter().position(|g| *g == why) else {
        return;
    };
    let _ = INBOUND.try_with(|inbound| {
        let code = u8::try_from(index + 1).unwrap_or(u8::MAX);
        let _ = inbound
            .gave_up
            .compare_exchange(0, code, Ordering::Relaxed, Ordering::Relaxed);
    });
}

/// Whether the inbound request this task serves allows its outbound calls only one
/// attempt (it is itself a retry, and the layer was told so).
pub(crate) fn outbound_call_once() -> bool {
    INBOUND
        .try_with(|inbound| inbound.call_once)
        .unwrap_or(false)
}

/// Request extension set by [`SignalsLayer`]: which attempt of its caller this request
/// is, from `x-attempt-count` or `grpc-previous-rpc-attempts` (1 when neither is there
/// or readable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundAttempt(pub u32);

impl InboundAttempt {
    /// The attempt number of `req`: its extension, or 1 without one.
    pub fn of<B>(req: &Request<B>) -> u32 {
        req.extensions().get::<InboundAttempt>().map_or(1, |a| a.0)
    }

    /// Reads the attempt number from the request's headers.
    fn read<B>(req: &Request<B>) -> u32 {
        let number = |name| {
            req.headers()
                .get(name)
                .and_then(|v: &HeaderValue| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u32>().ok())
        };
        if let Some(n) = number(X_ATTEMPT_COUNT) {
            return n.max(1);
        }
        number(GRPC_PREVIOUS_RPC_ATTEMPTS).map_or(1, |previous| previous.saturating_add(1))
    }
}

/// The service [`SignalsLayer`] makes.
#[derive(Debug, Clone)]
pub struct Signals<S> {
    inner: S,
    retries_call_once: bool,
}

impl<S, B, ResB> Service<Request<B>> for Signals<S>
where
    S: Service<Request<B>, Response = Response<ResB>>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let attempt = InboundAttempt::read(&req);
        req.extensions_mut().insert(InboundAttempt(attempt));
        let inbound = Arc::new(Inbound {
            call_once: self.retries_call_once && attempt > 1,
            gave_up: AtomicU8::new(0),
        });
        let future = INBOUND.sync_scope(inbound.clone(), || self.inner.call(req));
        ResponseFuture::new(INBOUND.scope(inbound.clone(), future), inbound)
    }
}

fn give_up_of(code: u8) -> Option<GiveUp> {
    GIVE_UPS.get(usize::from(code).checked_sub(1)?).copied()
}

/// Marks a failed response "do not retry"; leaves successes and client errors alone.
fn mark<B>(res: &mut Response<B>, why: GiveUp) {
    if mark_grpc(res.headers_mut()) {
        return;
    }
    if res.status().is_server_error() {
        res.headers_mut()
            .insert(X_NO_RETRY, HeaderValue::from_static(why.as_str()));
    }
}

/// Marks a failed gRPC status in `headers` (a head or trailers) "do not retry" (gRFC
/// A6's negative pushback); `false` when they carry no `grpc-status`.
fn mark_grpc(headers: &mut http::HeaderMap) -> bool {
    match grpc_status(headers) {
        Some(0) => true,
        Some(_) => {
            headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from_static("-1"));
            true
        }
        None => false,
    }
}
