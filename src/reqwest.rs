//! Feature `reqwest`: the retry policy, the load control and the circuit breaker for a
//! [`reqwest`] client, as a [`reqwest_middleware`] middleware.
//!
//! reqwest's `Client` serves `reqwest::Request`, not `http::Request`, so the tower
//! layers cannot wrap it; [`StormguardMiddleware`] makes the same decisions in
//! `reqwest_middleware`'s chain, with the same [`RetryPolicy`] (its budget, its stats,
//! its metrics names), the same [`LoadControl`] and the same [`CircuitBreaker`], in the
//! standard stack's order (retry, then load control, then breaker, for each attempt):
//! one implementation, which the
//! middleware drives with a copy of each request's head (method, URL, headers, and the
//! [`Idempotent`], [`NoRetry`] and [`Deadline`] extensions given with
//! `RequestBuilder::with_extension`).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use stormguard::reqwest::StormguardMiddleware;
//! use stormguard::{CircuitBreaker, LoadControl, RetryPolicy};
//!
//! let client = reqwest_middleware::ClientBuilder::new(
//!     // stormguard retries the protocol's refusals itself (transparently, once): turn
//!     // reqwest's own retries off so that they do not retry them a second time.
//!     reqwest::Client::builder()
//!         .retry(reqwest::retry::never())
//!         .build()?,
//! )
//! .with(
//!     StormguardMiddleware::new(RetryPolicy::builder().name("payments").build()?)
//!         .with_load_control(LoadControl::builder().name("payments").build()?)
//!         .with_breaker(CircuitBreaker::builder().name("payments").build()?),
//! )
//! .build();
//! let response = client.get("http://127.0.0.1:8080/charge").send().await?;
//! # let _ = response;
//! # Ok(())
//! # }
//! ```
//!
//! What it does, as the tower layers do:
//!
//! - every decision of [`retry`](crate::retry): classification, idempotency (a `POST`
//!   is retried only when the failure proves it was never processed, or with an
//!   `Idempotency-Key` or the [`Idempotent`] extension), `Retry-After`, the deadline,
//!   the budget, and transparent retries of requests reqwest reports as never sent;
//! - the load control, when given, keeps the attempts in flight within its adaptive
//!   limit: an attempt past it waits for room up to its `max_wait` (longer while the
//!   limit is still a guess: `LoadLimit::wait_for_room`; never longer than the
//!   request's own timeout, `RequestBuilder::timeout`, where it has one: a
//!   `ClientBuilder::timeout` is not seen by middleware), then fails unsent and is
//!   not retried (the caller's error is a `reqwest_middleware::Error::Middleware`
//!   holding a [`Shed`]);
//! - the breaker, when given, counts every attempt and refuses while open (the
//!   caller's error is then a `reqwest_middleware::Error::Middleware` holding a
//!   [`CircuitOpen`]);
//! - a body reqwest can copy (`Request::try_clone`: bytes, a string, a form) is sent
//!   again; a streaming one is sent once and not retried, with give-up reason
//!   `body_not_replayable`, never an error it would not have had without the
//!   middleware;
//! - a reqwest timeout (`ClientBuilder::timeout`) is a timeout, retried as an attempt
//!   timeout is; a connection that could not be made is retried whatever the method.
//!
//! Hedging is not offered here: reqwest-middleware runs the chain for one request at
//! a time.
//!
//! # Through a server's drain
//!
//! No request is sent twice that the server may have processed. But reqwest's
//! connections are its own, so the proof a [`TrackedConnector`](crate::connect) gives
//! hyper-util's client cannot reach them: over HTTP/2, a POST that meets a draining
//! server's GOAWAY fails at the caller even when its stream was above the GOAWAY's last
//! one (unprocessed), and one stranded unwritten waits out its timeout and fails. The
//! repository's drain test counts up to 68 such POSTs in 1,000 (200 runs) against a
//! server draining every 10 or 20 requests, and 141 to 179 through nginx draining every
//! 50 (`keepalive_requests 50`), none over HTTP/1.1. Give a POST that may be
//! repeated an `Idempotency-Key` (which the server deduplicates on), or the
//! [`Idempotent`] extension, and it is retried through a drain as a GET is.
//!
//! Why a middleware and not a tower `Service` over `reqwest::Client`: reqwest users
//! compose their clients with reqwest-middleware (tracing, auth, caching), and a
//! tower user already has hyper-util's client under the tower layers. A tower
//! service would have to convert each `http::Request` to a `reqwest::Request` and
//! back, on the user's side or ours, for nothing the middleware does not do.
//!
//! # reqwest's own retries
//!
//! reqwest 0.13 retries by default, inside `Client::execute`: requests refused at the
//! protocol level (an HTTP/2 `REFUSED_STREAM` or GOAWAY), under a budget of 20%. Under
//! stormguard, which retries those once transparently and everything else under its own
//! budget, leave them on and a refused request may be sent three times (reqwest's
//! retry, then stormguard's transparent one) from two budgets that do not know of
//! each other; turn them off with `ClientBuilder::retry(reqwest::retry::never())`.
//!
//! # Drains
//!
//! A request that fails with an HTTP/2 server's GOAWAY may or may not have been
//! processed: hyper, under reqwest, hands the GOAWAY to the request whose stream it
//! opened as the GOAWAY arrived, which the server may have taken
//! ([`connect`](crate::connect) has the details). stormguard cannot track reqwest's
//! connections, so such a request is sent again only when it may be repeated anyway (an
//! idempotent method, an `Idempotency-Key`, [`Idempotent`]): a POST caught by a drain
//! fails at the caller rather than risk being processed twice. Give POSTs that must
//! survive drains an `Idempotency-Key` the server deduplicates on.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use http::Extensions;
use reqwest_middleware::{Error, Next, Result};
use tower::retry::Policy as _;

use crate::body::ReplayHandle;
use crate::breaker::CircuitBreaker;
use crate::load::{load_of, LoadControl};
use crate::retry::{Attempts, Idempotent, NoRetry, Release, RetryPolicy};
use crate::{BoxError, CircuitOpen, Deadline, Shed};

/// A `reqwest_middleware` middleware that retries with a [`RetryPolicy`] and, if given
/// them, limits the attempts in flight with a [`LoadControl`] and counts and refuses
/// them with a [`CircuitBreaker`]; see the [module docs](self).
///
/// # Clone
///
/// Clones share the policy's budget and counters, the load control's limit and the
/// breaker's circuit, as the tower layers' clones do.
#[derive(Debug, Clone)]
pub struct StormguardMiddleware {
    policy: RetryPolicy,
    load: Option<LoadControl>,
    breaker: Option<CircuitBreaker>,
}

impl StormguardMiddleware {
    /// Retries with `policy`; no load control, no breaker.
    pub fn new(policy: RetryPolicy) -> Self {
        StormguardMiddleware {
            policy,
            load: None,
            breaker: None,
        }
    }

    /// Keeps the attempts in flight within `control`'s limit, as the standard stack
    /// does: an attempt past it waits for room, up to the control's `max_wait` (longer
    /// while its limit is still a guess), and is then shed, never sent and not retried.
    /// Share one control (by `Clone`) among the clients of one dependency.
    pub fn with_load_control(mut self, control: LoadControl) -> Self {
        self.load = Some(control);
        self
    }

    /// Counts every attempt with `breaker`, and refuses while its circuit is open.
    pub fn with_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.breaker = Some(breaker);
        self
    }

    /// A dependency's policy and breaker, as a configuration file made them (feature
    /// `serde`).
    #[cfg(feature = "serde")]
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    pub fn from_dependency(dependency: &crate::config::Dependency) -> Self {
        StormguardMiddleware {
            policy: dependency.retry.clone(),
            load: dependency.load.clone(),
            breaker: dependency.breaker.clone(),
        }
    }

    /// The retry policy: its [`stats`](RetryPolicy::stats) and budget.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The load control, if there is one: its limit and its
    /// [`stats`](LoadControl::stats).
    pub fn load_control(&self) -> Option<&LoadControl> {
        self.load.as_ref()
    }

    /// The breaker, if there is one.
    pub fn breaker(&self) -> Option<&CircuitBreaker> {
        self.breaker.as_ref()
    }

    async fn send(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<reqwest::Response> {
        let sent = tokio::time::Instant::now().into_std();
        let mut policy = self.policy.sent_at(sent, None);
        let mut head = head_of(&req, extensions);
        let first =
            <RetryPolicy as tower::retry::Policy<_, http::Response<()>, BoxError>>::clone_request(
                &mut policy,
                &head,
            );
        if first.is_none() {
            // `NoRetry`: one attempt, the breaker still counting it.
            return self.attempt(req, extensions, next).await.map_err(unbox);
        }
        let mut req = req;
        loop {
            // The copy the next attempt would send, made before this one takes the
            // request; `None` for a streaming body, which the policy then gives up on.
            let copy = req.try_clone();
            let outcome = self.attempt(req, extensions, next.clone()).await;
            let (mut seen, response) = match outcome {
                Ok(response) => (
                    Ok(response_head(&response, policy.classifies())),
                    Some(response),
                ),
                Err(err) => (Err(err), None),
            };
            let Some(wait) = policy.retry(&mut head, &mut seen) else {
                return handed_back(seen, response);
            };
            let Some(mut copy) = copy else {
                // The policy retries only what can be sent again; without a copy,
                // what was seen is the outcome.
                return match (seen, response) {
                    (_, Some(response)) => Ok(response),
                    (Err(err), None) => Err(unbox(err)),
                    (Ok(_), None) => Err(Error::middleware(Lost)),
                };
            };
            wait.await;
            // A retry of a throttling answer: let through by the gate, or not sent. Each
            // wait moves on towards the end of the retry's own, where the gate closes.
            while policy.is_gated() {
                match policy.release(&mut head, &mut seen) {
                    Release::Send => break,
                    Release::Wait(wait) => wait.await,
                    Release::GiveUp => return handed_back(seen, response),
                }
            }
            // The policy's headers for the retry (`x-attempt-count`, `grpc-timeout`).
            copy.headers_mut().clone_from(head.headers());
            req = copy;
        }
    }

    /// One attempt through the load control and the breaker, those there are; errors
    /// boxed, as the policy and the breaker read them.
    async fn attempt(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> std::result::Result<reqwest::Response, BoxError> {
        let Some(load) = &self.load else {
            return self.breaker_attempt(req, extensions, next).await;
        };
        // Dropped unfinished (the caller gave up), the place is given back unsampled. A
        // wait for room outlasting the request's own timeout would only hold the caller.
        let longest = req.timeout().copied().unwrap_or(Duration::MAX);
        let place = load
            .enter(longest)
            .await
            .map_err(|shed| Box::new(shed) as BoxError)?;
        let result = self.breaker_attempt(req, extensions, next).await;
        place.complete(load_of(result.as_ref().map(|r| (r.status(), r.headers()))));
        result
    }

    /// One attempt through the breaker, if there is one.
    async fn breaker_attempt(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> std::result::Result<reqwest::Response, BoxError> {
        let Some(breaker) = &self.breaker else {
            return next.run(req, extensions).await.map_err(boxed);
        };
        let mut guard = breaker.admit().map_err(|open| Box::new(open) as BoxError)?;
        match next.run(req, extensions).await.map_err(boxed) {
            Ok(response) => {
                guard.finish(breaker.outcome_of_head(response.status(), response.headers()));
                Ok(response)
            }
            Err(err) => {
                guard.finish(breaker.classify_error(&*err));
                Err(err)
            }
        }
    }
}

impl reqwest_middleware::Middleware for StormguardMiddleware {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        req: reqwest::Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<Box<dyn Future<Output = Result<reqwest::Response>> + Send + 'async_trait>>
    where
        Self: 'async_trait,
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
    {
        Box::pin(self.send(req, extensions, next))
    }
}

/// What the policy reads of a request: its method, URL, headers and the extensions it
/// looks for, and whether its body can be sent again.
fn head_of(req: &reqwest::Request, extensions: &Extensions) -> http::Request<()> {
    let mut head = http::Request::new(());
    *head.method_mut() = req.method().clone();
    if let Ok(uri) = req.url().as_str().parse() {
        *head.uri_mut() = uri;
    }
    head.headers_mut().clone_from(req.headers());
    let ours = head.extensions_mut();
    if let Some(x) = extensions.get::<Idempotent>() {
        ours.insert(*x);
    }
    if let Some(x) = extensions.get::<NoRetry>() {
        ours.insert(*x);
    }
    if let Some(x) = extensions.get::<Deadline>() {
        ours.insert(*x);
    }
    if req.body().is_some_and(|body| body.as_bytes().is_none()) {
        ours.insert(ReplayHandle::never());
    }
    head
}

/// What the policy reads of a response: its status, and its headers unless it is a
/// plain success and the policy has no classifier (which is all the policy needs to
/// know of one).
fn response_head(response: &reqwest::Response, classifies: bool) -> http::Response<()> {
    let mut head = http::Response::new(());
    *head.status_mut() = response.status();
    let plain = !classifies
        && response.status().is_success()
        && !response
            .headers()
            .contains_key(stormguard_core::classify::GRPC_STATUS);
    if !plain {
        head.headers_mut().clone_from(response.headers());
    }
    head
}

/// reqwest-middleware's error, unwrapped: reqwest's own error heads the chain the
/// policy and the breaker read (its `Display` would skip it).
fn boxed(err: Error) -> BoxError {
    match err {
        Error::Reqwest(err) => Box::new(err),
        Error::Middleware(err) => BoxError::from(err),
    }
}

/// The outcome the policy hands back: the response seen, with its attempt count, or
/// the error.
fn handed_back(
    seen: std::result::Result<http::Response<()>, BoxError>,
    response: Option<reqwest::Response>,
) -> Result<reqwest::Response> {
    match (seen, response) {
        (Ok(seen), Some(mut response)) => {
            if let Some(attempts) = seen.extensions().get::<Attempts>() {
                response.extensions_mut().insert(*attempts);
            }
            Ok(response)
        }
        (Err(err), _) => Err(unbox(err)),
        // A response was seen, so it is there.
        (Ok(_), None) => Err(Error::middleware(Lost)),
    }
}

/// The caller's error, from the boxed one the policy saw.
fn unbox(err: BoxError) -> Error {
    let err = match err.downcast::<reqwest::Error>() {
        Ok(err) => return Error::Reqwest(*err),
        Err(err) => err,
    };
    let err = match err.downcast::<CircuitOpen>() {
        Ok(open) => return Error::middleware(*open),
        Err(err) => err,
    };
    match err.downcast::<Shed>() {
        Ok(shed) => Error::middleware(*shed),
        Err(err) => Error::middleware(Other(err)),
    }
}

/// Another middleware's error, handed on.
#[derive(Debug)]
struct Other(BoxError);

impl std::fmt::Display for Other {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Other {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Never made: a response the middleware saw and then could not find.
#[derive(Debug)]
struct Lost;

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stormguard lost a response it had seen (a bug)")
    }
}

impl std::error::Error for Lost {}
