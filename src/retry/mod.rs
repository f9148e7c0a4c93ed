//! The retry middleware: [`RetryLayer`] and its [`RetryPolicy`].
//!
//! One failed attempt is retried only when all of these hold, checked in this order:
//!
//! 1. the outcome is transient ([`classify`](stormguard_core::classify)): a 408, 429,
//!    500, 502, 503 or 504, gRPC UNAVAILABLE, a timeout or a connection failure;
//! 2. sending the request again is safe: the method is idempotent, the request has an
//!    `Idempotency-Key`, the call is gRPC with a retryable code, or the failure proves
//!    the server never saw the request (connection refused, h2 `REFUSED_STREAM`,
//!    GOAWAY);
//! 3. attempts are left (3 by default, including the first; gRPC calls at most 5, gRFC A6);
//! 4. the body can be sent again (see [`ReplayBody`](crate::ReplayBody));
//! 5. the server's `Retry-After` or `grpc-retry-pushback-ms` is not longer than
//!    `max_retry_after` [the backoff cap];
//! 6. the shared [`RetryBudget`] grants a retry.
//!
//! The wait is the request's own jittered [`Backoff`] delay, or the server's hint when
//! that is longer (plus up to 10% upward jitter, so clients told "30" do not all come
//! back in the same millisecond); gRPC pushback is honoured exactly, and the backoff
//! starts again from its first ceiling after it (gRFC A6). The wait runs on tokio's
//! clock, so `tokio::time::pause()` makes tests exact.
//!
//! # Transparent retries
//!
//! Some failures prove the request reached the server but not its application: an
//! HTTP/2 `REFUSED_STREAM`, or a GOAWAY that names a last stream below the request's
//! (a server draining its connection, as nginx does every `keepalive_requests` and any
//! server does on a graceful restart), or hyper or hyper-util handing the request back
//! unwritten ("canceled": it waited for a connection that closed or was not ready, as
//! tonic's requests queued on a connection do when the server drains it).
//! Such a request is retried **at once and once**, as gRFC A6's transparent retry:
//! without a backoff wait, without spending an attempt, without a withdrawal from the
//! budget, whatever its method, and the breaker does not count the failure. A second
//! such failure for the same request goes through the checks below like any other.
//! A refused connection is not one of these: it says the dependency may be down, and is
//! an ordinary retry with backoff.
//!
//! Which GOAWAYs prove that much: h2 reports a server's GOAWAY only to the streams above
//! the last stream id the server names (which it promises it never processed) and to
//! requests made on the connection after it. A stream at or below that id which the
//! connection's close then cuts short, its body still being sent say, ends with a
//! broken pipe or a reset instead: the request may have been processed, and it is
//! retried only if it is safe to repeat. Transparent retries are counted apart
//! ([`RetryStats::transparent_retries`]), traced with reason `transparent`, and a
//! gRPC call carries `grpc-transparent-retry-attempts: 1` on its second try.
//!
//! Every give-up is reported with its reason (a `tracing` event on target
//! `stormguard::retry` and a [`RetryStats`] counter), and every response that took more
//! than one attempt carries an [`Attempts`] extension.
//!
//! # Which errors are recognised
//!
//! An error is inspected when it is a [`BoxError`](crate::BoxError) (what tower's
//! timeout, stormguard's breaker and most middleware return) or one of hyper's,
//! hyper-util's, h2's (each with the feature of its name, on by default), tonic's
//! `transport::Error` (with the `tonic` feature), `std::io`'s or tower's `Elapsed`; its
//! `source()` chain is then walked for the causes listed in the crate's error
//! classification (connect errors, refused connections, h2 `REFUSED_STREAM` and GOAWAY,
//! resets, timeouts). An error of another concrete type cannot be looked into and is
//! not retried: put a layer that boxes errors below the retry (the per-attempt timeout
//! does), or `.map_err(BoxError::from)`.
//!
//! # Per-request control
//!
//! Insert [`NoRetry`] in a request's extensions to send it once whatever happens, or
//! [`Idempotent`] to declare a POST safe to repeat without an `Idempotency-Key`.
//!
//! # What happens to a retried attempt's response
//!
//! The failed response is dropped before the next attempt. With hyper an unread
//! HTTP/1.1 body means its connection cannot carry another request, so hyper closes it
//! rather than returning it to the pool; over HTTP/2 only that stream is reset and the
//! connection stays. Nothing leaks either way.

mod builder;
pub mod future;
mod layer;
mod policy;
mod request;
mod service;
mod shared;
mod wait;

pub use crate::give_up::GiveUp;
pub use builder::RetryPolicyBuilder;
pub use layer::{CloneBodies, ReplayBodies, ReplayRetry, RetryLayer};
pub use policy::RetryPolicy;
pub(crate) use request::{is_grpc, safe_to_repeat};
pub use service::Retry;
pub use shared::RetryStats;
pub use wait::Wait;

use http::Response;

/// A gRPC call's timeout, rewritten on each retry to the time that remains.
const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// Set on a gRPC call's transparent retry (gRFC A6).
const GRPC_TRANSPARENT_RETRY_ATTEMPTS: http::HeaderName =
    http::HeaderName::from_static("grpc-transparent-retry-attempts");

/// Request extension: never retry this request.
///
/// ```
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(stormguard::NoRetry);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NoRetry;

/// Request extension: this request is safe to send more than once, whatever its method.
///
/// ```
/// let mut request = http::Request::post("/charge").body(()).unwrap();
/// request.extensions_mut().insert(stormguard::Idempotent);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Idempotent;

/// Response extension: how many attempts the request took, the first included.
///
/// It is added to every response that took more than one attempt; a response from the
/// first attempt carries none, so that the success path allocates nothing.
/// [`Attempts::of`] reads it either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempts(pub u32);

impl Attempts {
    /// The attempts `response` took: its extension, or 1 when it has none.
    pub fn of<B>(response: &Response<B>) -> u32 {
        response.extensions().get::<Attempts>().map_or(1, |a| a.0)
    }
}
