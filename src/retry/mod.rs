//! The retry middleware: [`RetryLayer`] and its [`RetryPolicy`].
//!
//! [`RetryLayer`] sends a failed request again when the failure is transient, sending it
//! again is safe, and a [`RetryBudget`](crate::RetryBudget) shared by every client of the
//! dependency can afford it, after a jittered exponential [`Backoff`](crate::Backoff) or
//! the server's `Retry-After`. Put it outermost, the one retry point, above a per-attempt
//! timeout:
//!
//! ```rust
//! use std::time::Duration;
//!
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use stormguard::{Backoff, Jitter, RetryBudget, RetryLayer, RetryPolicy};
//! use tower::{BoxError, ServiceBuilder, ServiceExt};
//!
//! async fn fetch(url: &str) -> Result<http::StatusCode, BoxError> {
//!     // One budget per dependency, shared by every client of it (clones share state).
//!     // Every setting shown is the default (`RetryBudget::default()`, `RetryPolicy::default()`).
//!     let budget = RetryBudget::builder()
//!         // Wasted retries (the ones that fail) within 10% of requests.
//!         // More buys success in a heavy partial outage and load in a total one: leave it
//!         // unless the dependency has that much headroom to spare.
//!         .ratio(0.1)
//!         // The span the 10% is counted over; a longer one lets an incident spend more of
//!         // the healthy stretch's savings before it.
//!         .window(Duration::from_secs(10))
//!         .build()?;
//!     let policy = RetryPolicy::builder()
//!         // The first attempt included. Three attempts of full jitter wait at most 200 ms
//!         // then 400 ms; to ride out longer blips give more attempts (or a larger base,
//!         // below): the budget then decides how many of them are spent.
//!         .max_attempts(3)
//!         // Keep `Jitter::Full`: of the jitter strategies in Brooker's 2015 model it does
//!         // the least work. The cap is also the longest `Retry-After` waited out (`max_retry_after`).
//!         .backoff(Backoff::new(Duration::from_millis(200), Duration::from_secs(20), Jitter::Full)?)
//!         .budget(budget.clone())
//!         .build()?;
//!
//!     let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//!     let svc = ServiceBuilder::new()
//!         .layer(RetryLayer::new(policy))   // outermost: the one retry point
//!         // Per attempt, inside the retry: set it above the dependency's slowest healthy
//!         // answer; a timed-out attempt is charged two wasted retries.
//!         .timeout(Duration::from_secs(2))
//!         .service(client);
//!
//!     let response = svc.oneshot(http::Request::get(url).body(Full::default())?).await?;
//!     Ok(response.status())
//! }
//! ```
//!
//! # Why classify, full jitter and a budget
//!
//! A retry helps only a failure that may not happen again (a 404 fails the same way every
//! time, and a POST the server may have processed must not be sent twice), so every
//! outcome is classified first. Clients that failed together and wait the same backoff
//! come back together, in waves that land while the dependency recovers; full jitter
//! draws each wait uniformly under the exponential ceiling, spreading a fleet's retries
//! out. Backoff does not bound how many retries an outage draws; the budget does: retries
//! that fail are held to 10% of the original requests over 10 s by default (a timed-out
//! attempt counts as two), so a dependency that is down sees about a tenth more than its
//! normal load instead of three attempts per request, while a blip's retries, which
//! succeed, go through.
//!
//! # What is retried
//!
//! One failed attempt is retried only when all of these hold, checked in this order:
//!
//! 1. the outcome is transient ([`classify`](stormguard_core::classify)): a 408, 429,
//!    500, 502, 503 or 504, gRPC UNAVAILABLE, a timeout or a connection failure;
//! 2. sending it again is safe: an idempotent method, an `Idempotency-Key`, a gRPC call
//!    with a retryable code, or a failure that proves the server never saw the request;
//! 3. attempts are left (3 by default, including the first; gRPC calls at most 5, gRFC A6);
//! 4. the body can be sent again (see [`ReplayBody`](crate::ReplayBody));
//! 5. the server's `Retry-After` or `grpc-retry-pushback-ms` is not longer than
//!    `max_retry_after` (by default the backoff's cap);
//! 6. the wait ends before the request's deadline (see *Deadlines* below);
//! 7. the shared [`RetryBudget`](crate::RetryBudget) grants a retry (and the gRPC
//!    throttle, when the policy has one).
//!
//! What is transient is the built-in rules' call unless a classifier of yours says
//! otherwise ([`crate::classify`]: [`RetryPolicyBuilder::classify`],
//! [`retry_on_response`](RetryPolicyBuilder::retry_on_response),
//! [`retry_on_error`](RetryPolicyBuilder::retry_on_error)). An error of your own type is
//! looked into once named to the policy ([`RetryPolicyBuilder::error_type`]); otherwise
//! it is not retried, and the policy warns once.
//!
//! Every other outcome goes straight back to the caller. The wait is the backoff's delay,
//! or the server's hint when longer (plus up to 10% upward jitter), on tokio's clock.
//! Insert [`NoRetry`] in a request's extensions to send it once whatever happens, or
//! [`Idempotent`] to declare a POST safe to repeat.
//!
//! # Transparent retries
//!
//! A request that failed with proof that the server never processed it (a drain's
//! `REFUSED_STREAM` or GOAWAY below its stream, hyper handing it back unwritten, or
//! [`Unprocessed`](crate::Unprocessed)) is retried **at once and once**, as gRFC A6's
//! transparent retry: no backoff, no attempt, no budget, whatever its method. A
//! [`TrackedConnector`](crate::connect::TrackedConnector) extends that proof to requests
//! stranded unwritten on a drained connection.
//!
//! # An open circuit below
//!
//! A call a [`CircuitBreaker`](crate::CircuitBreaker) below refuses never left the client.
//! While the dependency has been failing for less than
//! [`FAIL_FAST_AFTER`](crate::sans_io::breaker::FAIL_FAST_AFTER) (a blip; counted from
//! the first of the failures in a row that opened the circuit), the request
//! waits and asks again, spread so that the refused calls do not all return as it closes;
//! past that, or while isolated, it ends at once with [`CircuitOpen`](crate::CircuitOpen).
//!
//! # Deadlines
//!
//! A retry whose wait would end after the caller stops waiting is not scheduled: the last
//! outcome comes back at once with reason `deadline`, and nothing is withdrawn from the
//! budget. The deadline is a [`Deadline`](crate::Deadline) in the request's extensions
//! (put one beside an outer `tower::timeout`) or, for gRPC, the call's `grpc-timeout`,
//! which each retry rewrites to the time that remains. Across a chain of services retries
//! multiply; the [`signals`](crate::signals) module stops that.
//!
//! The retry layer reads tokio's clock: a deadline on that clock is
//! [`deadline_in`]`(total)`, which a test on paused time can use too.
//!
//! # Testing your service with paused time
//!
//! On paused time (`#[tokio::test(start_paused = true)]`) the layers' backoffs, waits and
//! timeouts pass at once and to the nanosecond. Seed the policy for the same jitter on
//! every run; and mind that the default budget is a new client's (an allowance of one
//! retry's worth of savings): a test whose subject is not the budget gives it room.
//!
//! ```rust
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use stormguard::{RetryBudget, RetryLayer, RetryPolicy};
//! use tower::{Layer, ServiceExt};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = tokio::runtime::Builder::new_current_thread()
//!     .enable_time()
//!     .start_paused(true)
//!     .build()?;
//! runtime.block_on(async {
//!     // A service that fails twice with a 503, then answers.
//!     let calls = Arc::new(AtomicU32::new(0));
//!     let counted = calls.clone();
//!     let flaky = tower::service_fn(move |_req: http::Request<String>| {
//!         let n = counted.fetch_add(1, Ordering::SeqCst);
//!         async move {
//!             let status = if n < 2 { 503 } else { 200 };
//!             http::Response::builder().status(status).body(String::new())
//!         }
//!     });
//!     let policy = RetryPolicy::builder()
//!         .seed(7)
//!         .budget(RetryBudget::builder().allowance(100).build()?)
//!         .build()?;
//!     let started = tokio::time::Instant::now();
//!     let mut request = http::Request::new(String::new());
//!     request
//!         .extensions_mut()
//!         .insert(stormguard::retry::deadline_in(Duration::from_secs(5)));
//!     let response = RetryLayer::new(policy).layer(flaky).oneshot(request).await?;
//!     assert_eq!(response.status(), 200);
//!     assert_eq!(calls.load(Ordering::SeqCst), 3);
//!     // Two full-jitter backoffs (up to 200 ms, then 400 ms), on paused time.
//!     assert!(started.elapsed() <= Duration::from_millis(600));
//!     Ok::<_, Box<dyn std::error::Error>>(())
//! })?;
//! # Ok(())
//! # }
//! ```
//!
//! # gRPC and tonic
//!
//! The policy honours `grpc-retry-pushback-ms` and sends `grpc-previous-rpc-attempts`;
//! [`RetryPolicyBuilder::throttle`] adds gRFC A6's `retryThrottling` on top of the budget.
//! A response that has started streaming is committed (gRFC A6) and never retried. tonic's
//! bodies stream and are not `Clone`: [`replay_bodies()`](RetryLayer::replay_bodies) keeps
//! each body's frames as the first attempt sends them ([`body`](crate::body)):
//!
//! ```rust
//! use std::time::Duration;
//!
//! use stormguard::{ReplayBody, RetryLayer, RetryPolicy};
//! use tonic::body::Body;
//! use tonic::transport::Channel;
//! use tower::ServiceBuilder;
//!
//! fn stack(channel: Channel, policy: RetryPolicy) -> impl tonic::client::GrpcService<Body> {
//!     ServiceBuilder::new()
//!         .layer(RetryLayer::new(policy).replay_bodies())
//!         .map_request(|r: http::Request<ReplayBody<Body>>| r.map(Body::new))
//!         // Per attempt: set it above the dependency's slowest healthy answer; a timed-out
//!         // attempt is charged two wasted retries.
//!         .timeout(Duration::from_secs(2))
//!         .service(channel)
//! }
//! ```
//!
//! # Errors, and observability
//!
//! An error is looked into when it is a [`BoxError`](crate::BoxError) or one of hyper's,
//! hyper-util's, h2's, tonic's, `std::io`'s or tower's `Elapsed` (then its `source()`
//! chain is walked), or of a type named with
//! [`RetryPolicyBuilder::error_type`]; one of another type is not retried, and a `warn`
//! event says so once per policy: name it, or `.map_err(BoxError::from)` (see
//! [`crate::classify`]).
//! Retries and give-ups are `tracing` events on target `stormguard::retry` (with the
//! [`GiveUp`] reason), counted in [`RetryStats`] ([`RetryPolicy::stats`]); a response that
//! took more than one attempt carries [`Attempts`].

mod builder;
mod deadline;
pub mod future;
mod gate;
#[cfg(feature = "hyper-util")]
mod handoff;
mod layer;
mod policy;
mod request;
mod service;
mod shared;
mod wait;

pub use crate::give_up::GiveUp;
pub use crate::tower_budget::TowerBudget;
pub use builder::RetryPolicyBuilder;
#[cfg(feature = "reqwest")]
pub(crate) use gate::Release;
pub use layer::{CloneBodies, ReplayBodies, ReplayRetry, RetryLayer};
pub use policy::RetryPolicy;
pub(crate) use request::{is_grpc, safe_to_repeat};
pub use service::Retry;
pub use shared::RetryStats;
pub use wait::Wait;

/// A [`Deadline`](crate::Deadline) `total` from now by tokio's clock, the one the retry
/// layer reads (so it moves with paused time in a test): put it in a request's
/// extensions to tell the layer when its caller stops waiting.
///
/// ```
/// use std::time::Duration;
///
/// let mut request = http::Request::new(());
/// request
///     .extensions_mut()
///     .insert(stormguard::retry::deadline_in(Duration::from_secs(2)));
/// ```
pub fn deadline_in(total: std::time::Duration) -> crate::Deadline {
    crate::Deadline::after(tokio::time::Instant::now().into_std(), total)
}

#[cfg(feature = "hyper-util")]
use handoff::Handoff;
/// Without hyper-util no attempt is tracked ([`crate::connect`]).
#[cfg(not(feature = "hyper-util"))]
enum Handoff {}

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
