//! The retry middleware: [`RetryLayer`] and its [`RetryPolicy`].
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
//!         // Keep `Jitter::Full` (0.43x the calls of plain exponential in Brooker 2015's
//!         // model). The cap is also the longest `Retry-After` waited out (`max_retry_after`).
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
//! One failed attempt is retried only when all of these hold, checked in this order:
//!
//! 1. the outcome is transient ([`classify`](stormguard_core::classify)): a 408, 429,
//!    500, 502, 503 or 504, gRPC UNAVAILABLE, a timeout or a connection failure;
//! 2. sending the request again is safe: the method is idempotent, the request has an
//!    `Idempotency-Key`, the call is gRPC with a retryable code (whatever its method: the
//!    gRPC retry design leaves that judgement to which codes you declare retryable), or
//!    the failure proves the server never saw the request (connection refused, h2
//!    `REFUSED_STREAM`, GOAWAY);
//! 3. attempts are left (3 by default, including the first; gRPC calls at most 5, gRFC A6);
//! 4. the body can be sent again (see [`ReplayBody`](crate::ReplayBody));
//! 5. the server's `Retry-After` or `grpc-retry-pushback-ms` is not longer than
//!    `max_retry_after` (by default the backoff's cap);
//! 6. the wait ends before the request's deadline (see *Deadlines* below);
//! 7. the shared [`RetryBudget`](crate::RetryBudget) grants a retry (and the gRPC
//!    throttle, when the policy has one: see *gRPC and tonic* below).
//!
//! Every other outcome goes straight back to the caller, who may dead-letter it.
//!
//! The wait is the request's own jittered [`Backoff`](crate::Backoff) delay, or the
//! server's hint when that is longer (plus up to 10% upward jitter, so clients told "30"
//! do not all come back in the same millisecond; gRPC pushback is honoured exactly). The
//! wait runs on tokio's clock, so `tokio::time::pause()` makes tests exact.
//!
//! # Transparent retries: graceful drains
//!
//! Some failures prove the request reached the server but not its application: an
//! HTTP/2 `REFUSED_STREAM`, or a GOAWAY that names a last stream below the request's
//! (a server draining its connection, as nginx does every `keepalive_requests` and any
//! server does on a graceful restart; the requests it had not started fail with
//! "connection error received: not a result of an error"), or hyper or hyper-util handing
//! the request back unwritten ("canceled": it waited for a connection that closed or was
//! not ready, as tonic's requests queued on a connection do when the server drains it).
//! These are recognised with the `h2`, `hyper` and `hyper-util` features, on by default;
//! a transport of your own can return [`Unprocessed`](crate::Unprocessed).
//! Such a request is retried **at once and once**, as gRFC A6's transparent retry:
//! without a backoff wait, without spending an attempt, without a withdrawal from the
//! budget, whatever its method, and the breaker does not count the failure. A second
//! such failure for the same request goes through the checks above like any other.
//! A refused connection is not one of these: it says the dependency may be down, and is
//! an ordinary, counted retry with backoff.
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
//! `cargo test --all-features --test drain -- --nocapture` runs 2,000 requests (half
//! POST, 32 at a time) against a hyper server on 127.0.0.1 that drains every connection
//! after 10 or 20 requests (a harsh `keepalive_requests`; the server reads each body
//! before acting on it, as an application does, and closes a drained connection with a
//! lingering close, as nginx does). One run of the every-20 tests, at the commit that gave
//! the test server that close (the library's code unchanged since 8322fc5), printed (the
//! breaker's figures and the failed ids left out):
//!
//! ```text
//! Http1, 2000 requests (half POST), 32 at a time, server drains every 20, Lingering close:
//!   no retries: 0 errors at the caller
//!   stormguard defaults: 0 errors (0 of requests the server never processed, 0 timed out), 0 transparent retries, 0 retries, 0 budget denials, POSTs processed twice 0, GETs twice 0
//! Http2, 2000 requests (half POST), 32 at a time, server drains every 20, Lingering close:
//!   no retries: 13 errors at the caller
//!   stormguard defaults: 0 errors (0 of requests the server never processed, 0 timed out), 18 transparent retries, 0 retries, 0 budget denials, POSTs processed twice 0, GETs twice 0
//! ```
//!
//! (HTTP/1.1 drains are clean either way: the last response says `connection: close`.)
//! docs/checking.md has a hundred runs of each test. Three things they show. A server
//! that closes a drained connection at once, without the lingering close, resets it
//! under the client: the reset discards responses the server had sent, so a POST it
//! processed fails with a broken pipe, and a POST it never saw may too (the reset can
//! reach the client before the GOAWAY that would have named it refused); a POST is not
//! sent again on a broken pipe, so such a server loses a few POSTs per drain burst, which
//! only an `Idempotency-Key` (or the `Idempotent` extension) saves. Now and then
//! hyper-util's HTTP/2 client leaves the requests it hands one connection around a drain
//! in that connection's dispatch queue, never written and never answered, until the
//! per-attempt timeout (1 to 4 runs in 100; reqwest's open issue 1323 is the same hang):
//! a timed-out POST may have been processed for all the layer can tell, so it is not sent
//! again, unless the client is built on a
//! [`TrackedConnector`](crate::connect::TrackedConnector), which lets the layer prove
//! the request was never written and retry it at once ([`crate::connect`]). And against
//! a server that acts on a request's head before reading its body, a POST is now and
//! then processed twice: when a GOAWAY arrives just after hyper 1's
//! HTTP/2 client opened a request's stream, hyper cancels the stream and hands the
//! request the GOAWAY's error, which reads exactly as a refusal, though the stream's head
//! may have reached the server (`tests/drain.rs` and docs/checking.md show it, 61 POSTs in
//! 100 runs, each cancelled by the client first); an application that acts before
//! reading its body, behind hyper's client, should take an `Idempotency-Key`.
//!
//! # An open circuit below
//!
//! A call that a [`CircuitBreaker`](crate::CircuitBreaker) below refuses never left the
//! client. When the break ends before the request's next backoff would, the call is
//! sent again after that backoff (the circuit admits its probe meanwhile), or, if later,
//! at a random point between the end of the break and four times as long after it as
//! the circuit has been open ([`sans_io::retry`](crate::sans_io::retry);
//! that span is cut to end at the backoff's cap, or at the request's deadline if sooner,
//! so the spread never ends a request that its backoff alone would not). The calls a
//! circuit refused are a backlog that wants to be sent the moment it closes: sent after
//! their backoffs alone, a 300 ms blip's came back within 200 ms of the close, at 94–102
//! attempts per 100 ms against a healthy 52 and a capacity of 80, and their timeouts
//! opened the circuit again and spent the budget of the next blip (the storm's `blip`:
//! 29–39% of the requests sent in a blip served). Spread over four times its age, a
//! backlog comes back at about a quarter of the rate it built up at (93% served):
//!
//! - a **retry** refused is moved, not spent: it is sent again without counting as an
//!   attempt or asking the budget again (its admission stands, charged as wasted if it
//!   fails), up to as many refusals as the request has retries. So a blip that opens
//!   the circuit while a request is retrying costs it a wait, not its remaining
//!   attempts;
//! - a **first call** refused is retried as any failure is: an attempt, admitted by the
//!   budget. A circuit that stays open (an outage) then fails new requests fast once the
//!   budget's room is spent, instead of deferring every one of them to the moment it
//!   closes, where together they would be a surge the recovering dependency pays for;
//! - but first, a **first call refused at the end of a break** (or while the probe
//!   decides) asks again once, for free, after the rest of the break plus a random share
//!   of one more ([`sans_io::retry`](crate::sans_io::retry)), when that wait
//!   cannot outlast the request's first backoff (always, with the default 25 ms breaks
//!   and 200 ms backoff; never behind breaks of a second or more). The last break of
//!   an incident ends after the dependency is back, and the requests made during it are
//!   the recovery's first: refused at once, they met a budget the incident had spent and
//!   failed (1–2% of the first second after the storm's 5 s outage, 4–10% after its
//!   brownout). A wait of about a break costs the dependency nothing and brings back at
//!   most a break's calls together.
//!
//! A longer break, or an isolated circuit, ends the request at once with
//! [`CircuitOpen`](crate::CircuitOpen) (reason `circuit_open`). The request's deadline
//! bounds every wait. Without one, a request refused by a circuit open for seconds can
//! wait up to the backoff's cap (20 s) at each refusal it waits out (its first call's and
//! one per retry), and then end with `CircuitOpen` if the circuit is still open: give
//! requests a deadline (the [standard stack](crate::stack) does, 30 s by default) where a
//! caller must not wait that long.
//!
//! # Deadlines
//!
//! A retry whose wait would end after the caller stops waiting is not scheduled: the last
//! outcome comes back at once with reason `deadline`, and nothing is withdrawn from the
//! budget. The deadline is a [`Deadline`](crate::Deadline) in the request's extensions
//! or, for gRPC, the call's `grpc-timeout` (the earlier of the two when it has both),
//! which each retry rewrites to the time that remains. An outer `tower::timeout` still
//! bounds the whole call; put a `Deadline` beside it so the retry layer knows about it:
//!
//! ```rust
//! use std::time::Duration;
//! use stormguard::Deadline;
//!
//! let now = tokio::time::Instant::now().into_std(); // the retry layer's clock
//! let mut request = http::Request::get("http://upstream/").body(()).unwrap();
//! // What the caller will wait, the outer timeout's duration: no retry is scheduled past it.
//! request.extensions_mut().insert(Deadline::after(now, Duration::from_secs(2)));
//! ```
//!
//! # Across layers
//!
//! A budget bounds the retries of one hop; across a chain of services they multiply. The
//! server-side [`SignalsLayer`](crate::signals::SignalsLayer) stops that: the
//! [`signals`](crate::signals) module says how it and this layer work together ("do not
//! retry" travels up, attempt numbers travel down), with measurements on a chain of
//! three hops.
//!
//! # gRPC and tonic
//!
//! For gRPC the policy honours `grpc-retry-pushback-ms` exactly: a negative value, or two
//! values, stop retrying, and after a pushback the backoff starts over from its first
//! ceiling, as gRFC A6 says. Each retry carries `grpc-previous-rpc-attempts`.
//! [`RetryPolicyBuilder::throttle`] with a
//! [`RetryThrottle`](crate::sans_io::throttle::RetryThrottle) adds gRFC A6's `retryThrottling`
//! exactly ([`throttle`](crate::sans_io::throttle): a failure takes a token, a success gives
//! `tokenRatio` back, no retry at or below half of `maxTokens`), on top of the budget. An
//! HTTP status without `grpc-status`, say a proxy's 503, is read as gRPC's HTTP-to-gRPC
//! mapping says (429, 502, 503, 504: UNAVAILABLE).
//!
//! A call is decided on its response's head: a trailers-only error (how a server
//! answers a call that fails before its first message) can be retried; a response that
//! has started (a `200` whose status will come in the trailers) is *committed*, as gRFC
//! A6 says, and handed to the caller, never retried, whatever its trailers then say. A
//! server stream that fails after its messages is the caller's to see; the breaker
//! below still counts it (see the [`breaker`](crate::breaker) module's *gRPC: the status
//! in the trailers*).
//!
//! tonic's request bodies stream and are not `Clone`.
//! [`replay_bodies()`](RetryLayer::replay_bodies) keeps each body's frames as the first
//! attempt sends them ([`body`](crate::body) says how, and the cap past which a request
//! is simply not retried), and one line hands tonic's `Channel` the body type it takes:
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
//! Without default features (`default-features = false`) the dependencies are
//! stormguard-core, tower (with tower-layer and tower-service), http, http-body, bytes,
//! rand, pin-project-lite, tracing and tokio (`time` and `sync`, and `rt` for the
//! task-local scope of [`signals`](crate::signals); no runtime is started). Boxed errors
//! are then still walked through their `source()` chain, and `std::io::Error` kinds
//! (refused, reset, aborted, timed out), tower's `Elapsed`,
//! [`Unprocessed`](crate::Unprocessed) and [`CircuitOpen`](crate::CircuitOpen) are
//! recognised wherever they sit in it: a hyper error that wraps a reset connection is
//! still a reset connection. What is lost is what only those crates' types say (h2's
//! `REFUSED_STREAM` and GOAWAY, hyper-util's connect and unwritten-request errors, hyper's
//! closed or incomplete connections), and a service whose error type is one of them, not
//! boxed, is not looked into at all.
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
//!
//! # Observability
//!
//! Each retry is a `tracing` event on target `stormguard::retry` (attempt, delay,
//! reason); each give-up is one with its [`GiveUp`] reason (`exhausted`, `permanent`,
//! `budget`, `not_idempotent`, `retry_after_too_long`, `body_not_replayable`, `pushback`,
//! `circuit_open`, `deadline`, `dont_retry`). [`RetryPolicy::stats`] returns
//! [`RetryStats`], counters shared by all clones: requests, retries, exhausted,
//! budget_denied, permanent, not_replayable, not_idempotent, server_refused, deadline,
//! transparent_retries. A response that took more than one attempt carries an
//! [`Attempts`] extension ([`Attempts::of`] reads 1 when it is absent). With the
//! `metrics` feature the same go to a `metrics` recorder: `stormguard::metrics` lists the
//! series.

mod builder;
pub mod future;
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
pub use layer::{CloneBodies, ReplayBodies, ReplayRetry, RetryLayer};
pub use policy::RetryPolicy;
pub(crate) use request::{is_grpc, safe_to_repeat};
pub use service::Retry;
pub use shared::RetryStats;
pub use wait::Wait;

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
