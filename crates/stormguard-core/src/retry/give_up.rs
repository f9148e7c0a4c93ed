//! Why a request's retries stopped.

use std::fmt;

/// Why the retry layer stopped and returned what it had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUp {
    /// Every attempt allowed was made.
    Exhausted,
    /// The outcome will not change on retry (4xx, an unknown error, a non-retryable
    /// gRPC code).
    Permanent,
    /// The shared retry budget is spent.
    Budget,
    /// The request is not idempotent and the failure does not prove it unseen.
    NotIdempotent,
    /// The server asked for a longer wait than `max_retry_after`.
    RetryAfterTooLong,
    /// The body went over the replay cap, or was not completely sent.
    BodyNotReplayable,
    /// A gRPC response said not to retry: a negative or unparseable pushback, or one of
    /// the headers [`DontRetry`](GiveUp::DontRetry) names.
    Pushback,
    /// A circuit breaker is open, for longer than the next backoff would wait, or
    /// isolated, or refused the request's retries as many times as it has retries (a
    /// shorter break is waited out; a refused retry is not an attempt).
    CircuitOpen,
    /// The wait would end after the request's [`Deadline`](crate::deadline::Deadline).
    Deadline,
    /// The server said its own dependencies gave up: `x-no-retry` (or Finagle's
    /// `finagle-http-nonretryable-nack`; see stormguard's `signals` module), or a proxy
    /// said it shed the request (Envoy's `x-envoy-overloaded`, `x-envoy-ratelimited`).
    /// On a gRPC response the reason is [`Pushback`](GiveUp::Pushback).
    DontRetry,
    /// The load control shed the call: the dependency had no room for it within the
    /// wait allowed, so it was never sent and is not sent again.
    Shed,
    /// The server throttled the request (429, `RESOURCE_EXHAUSTED`), and the gate of
    /// throttled retries had no slot for its retry within one more of the server's
    /// wait: the retry was not sent.
    Throttled,
}

impl GiveUp {
    /// A short name for logs and metrics labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            GiveUp::Exhausted => "exhausted",
            GiveUp::Permanent => "permanent",
            GiveUp::Budget => "budget",
            GiveUp::NotIdempotent => "not_idempotent",
            GiveUp::RetryAfterTooLong => "retry_after_too_long",
            GiveUp::BodyNotReplayable => "body_not_replayable",
            GiveUp::Pushback => "pushback",
            GiveUp::CircuitOpen => "circuit_open",
            GiveUp::Shed => "shed",
            GiveUp::Throttled => "throttled",
            GiveUp::Deadline => "deadline",
            GiveUp::DontRetry => "dont_retry",
        }
    }
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
