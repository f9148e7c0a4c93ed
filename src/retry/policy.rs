//! The per-request retry decision, and tower's `Policy` over it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use stormguard_core::limit::Load;

use http::{HeaderValue, Request, Response};
use stormguard_core::classify::{GrpcCodeSet, Rules, GRPC_PREVIOUS_RPC_ATTEMPTS, X_ATTEMPT_COUNT};
use stormguard_core::retry::{self, Attempt, Decision, Refusal, RequestRetry};
use stormguard_core::{Backoff, RetryBudget};

use crate::error_class::ErrorClass;
use crate::give_up::GiveUp;

use super::builder::RetryPolicyBuilder;
use super::deadline::RequestDeadline;
use super::request::{body_replayable, is_grpc, proved, safe_to_repeat};
use super::shared::{RetryStats, Shared};
use super::wait::Wait;
use super::{Attempts, GRPC_TRANSPARENT_RETRY_ATTEMPTS};

/// The retry decisions for HTTP and gRPC requests, as a [`tower::retry::Policy`].
///
/// `RetryPolicy::default()`: 3 attempts, full-jitter backoff from 200 ms to 20 s, a
/// fresh [`RetryBudget`] (wasted retries within 10% of the requests over 10 s, plus an allowance of 1 carried over), 408/429/500/502/503/504 and gRPC
/// UNAVAILABLE retried, Retry-After honoured up to 20 s, bodies replayed up to 64 KiB.
///
/// # Clone
///
/// Clones share the configuration, the budget and the counters (an `Arc`); each
/// request's attempt count and random stream are its own. tower's own `Retry` clones
/// the policy for every request; stormguard's [`Retry`](super::Retry) makes a request its copy only
/// when its first attempt is not a plain success.
///
/// ```
/// use std::time::Duration;
/// use stormguard::{Backoff, Jitter, RetryBudget, RetryPolicy};
///
/// let budget = RetryBudget::builder().ratio(0.1).window(Duration::from_secs(10)).build()?;
/// let policy = RetryPolicy::builder()
///     .max_attempts(3)
///     .backoff(Backoff::new(Duration::from_millis(200), Duration::from_secs(20), Jitter::Full)?)
///     .budget(budget.clone())
///     .build()?;
/// assert_eq!(policy.stats().requests, 0);
/// # Ok::<(), stormguard::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct RetryPolicy {
    pub(super) shared: Arc<Shared>,
    /// The request's retries, decided (0 attempts on the layer's own copy).
    pub(super) retry: RequestRetry,
    /// The attempt about to be decided provably left its request unprocessed
    /// (`crate::connect`); read and cleared by the decision on it.
    pub(super) unprocessed: bool,
    /// When the caller stops waiting: the request's [`Deadline`] or its `grpc-timeout`
    /// counted from its first send, read from the request at its first failure (a
    /// success never needs it).
    pub(super) deadline: RequestDeadline,
    /// When the retry waiting for the gate of throttled retries was decided.
    pub(super) gated_since: Option<Instant>,
}

/// What bounds one request's retries: the policy's settings, or its gRPC method's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) retryable_grpc_codes: GrpcCodeSet,
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("name", &self.shared.name)
            .field("max_attempts", &self.shared.max_attempts)
            .field("backoff", &self.shared.backoff)
            .field("budget", &self.shared.budget)
            .field("rules", &self.shared.rules)
            .field("max_retry_after", &self.shared.max_retry_after)
            .field("max_replay_bytes", &self.shared.max_replay_bytes)
            .field("attempts", &self.retry.attempts())
            .finish()
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicyBuilder::default().make()
    }
}

/// A request dropped before its end (its caller stopped waiting, mid-backoff or
/// mid-retry) was not served: its retries are charged as wasted.
impl Drop for RetryPolicy {
    fn drop(&mut self) {
        self.retry.leave_gate(&self.shared.pace);
        if self.retry.has_unsettled() {
            let now = tokio::time::Instant::now().into_std();
            self.retry.abandon(now, Some(&self.shared.budget));
        }
    }
}

impl RetryPolicy {
    /// A builder starting from the defaults.
    pub fn builder() -> RetryPolicyBuilder {
        RetryPolicyBuilder::default()
    }

    /// What this policy and all its clones have done so far.
    pub fn stats(&self) -> RetryStats {
        let c = &self.shared.counters;
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        RetryStats {
            requests: load(&c.requests),
            retries: load(&c.retries),
            exhausted: load(&c.exhausted),
            budget_denied: load(&c.budget_denied),
            permanent: load(&c.permanent),
            not_replayable: load(&c.not_replayable),
            not_idempotent: load(&c.not_idempotent),
            server_refused: load(&c.server_refused),
            deadline: load(&c.deadline),
            transparent_retries: load(&c.transparent_retries),
            throttled: load(&c.throttled),
        }
    }

    /// The dependency's name (the metrics' `service` label).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The budget retries are drawn from.
    pub fn budget(&self) -> &RetryBudget {
        &self.shared.budget
    }

    /// The most bytes of a streaming body kept for replay.
    pub fn max_replay_bytes(&self) -> usize {
        self.shared.max_replay_bytes
    }

    /// Whether a classifier was given (every answer is then looked at whole).
    #[cfg_attr(not(feature = "reqwest"), allow(dead_code))]
    pub(crate) fn classifies(&self) -> bool {
        self.shared.classifiers.reads_answers()
    }

    /// This policy's copy for a request first sent at `sent` (with `total` to finish in,
    /// under a total timeout), as [`clone_request`](tower::retry::Policy::clone_request)
    /// leaves it.
    pub(crate) fn sent_at(&self, sent: Instant, total: Option<Duration>) -> RetryPolicy {
        RetryPolicy {
            shared: Arc::clone(&self.shared),
            retry: RequestRetry::new(),
            unprocessed: false,
            deadline: RequestDeadline::SentAt(sent, total),
            gated_since: None,
        }
    }

    /// Notes that the attempt about to be decided provably left its request
    /// unprocessed: its failure, a timeout or a GOAWAY most often, is then one the server
    /// never acted on ([`crate::connect`]).
    pub(super) fn attempt_unprocessed(&mut self) {
        self.unprocessed = true;
    }

    /// Hands the outcome back (the budget is settled): records why (if it is a give-up)
    /// and the attempt count.
    pub(super) fn finish<Res, E>(
        &mut self,
        result: &mut Result<Response<Res>, E>,
        attempts: u32,
        why: Option<GiveUp>,
    ) -> Option<Wait> {
        if attempts > 1 {
            if let Ok(res) = result {
                res.extensions_mut().insert(Attempts(attempts));
            }
        }
        if let Some(why) = why {
            self.shared.gave_up(why, attempts);
        }
        self.shared.call_ended(attempts);
        None
    }

    /// The limits for `req`: its gRPC method's when the policy has per-method settings
    /// (no retries for a method the service config does not name, as gRFC A6), else
    /// the policy's own.
    fn limits<B>(&self, req: &Request<B>, grpc: bool) -> Limits {
        let shared = &*self.shared;
        let own = Limits {
            max_attempts: shared.max_attempts,
            backoff: shared.backoff,
            retryable_grpc_codes: shared.rules.retryable_grpc_codes,
        };
        match &shared.methods {
            Some(methods) if grpc => match methods.lookup(req.uri().path()) {
                Some(Some(limits)) => *limits,
                // No retry policy: no code is retryable, so a failure neither retries
                // nor counts against A6's throttle (as grpc-go counts only retryable
                // codes).
                _ => Limits {
                    max_attempts: 1,
                    retryable_grpc_codes: GrpcCodeSet::new(),
                    ..own
                },
            },
            _ => own,
        }
    }
}

impl<B, ResB, E> tower::retry::Policy<Request<B>, Response<ResB>, E> for RetryPolicy
where
    B: Clone,
    E: 'static,
{
    type Future = Wait;

    fn retry(
        &mut self,
        req: &mut Request<B>,
        result: &mut Result<Response<ResB>, E>,
    ) -> Option<Wait> {
        if result
            .as_ref()
            .is_ok_and(|res| self.shared.is_plain_success(res))
        {
            // Nothing else about the request or the response matters.
            let now = tokio::time::Instant::now().into_std();
            let shared = &*self.shared;
            let attempts = self
                .retry
                .served(now, Some(&shared.budget), shared.throttle.as_ref());
            self.retry.accepted(now, &shared.pace);
            return self.finish(result, attempts, None);
        }
        let unprocessed = std::mem::take(&mut self.unprocessed);
        let grpc = is_grpc(req);
        // The policy's attempts, backoff and codes, or the gRPC method's own.
        let limits = self.limits(req, grpc);
        // Read from the request as first sent, before any header of it is rewritten.
        self.read_deadline(req);
        let classifiers = &self.shared.classifiers;
        let attempt = match &*result {
            Ok(res) => {
                let (status, headers) = (res.status(), res.headers());
                let told = match classifiers.any() {
                    true => classifiers.response(status, headers),
                    false => None,
                };
                let class = told.unwrap_or_else(|| {
                    let class = if grpc {
                        let rules = Rules {
                            retryable_grpc_codes: limits.retryable_grpc_codes,
                            ..self.shared.rules
                        };
                        rules.classify_grpc_response(status, headers)
                    } else {
                        (self.shared.rules).classify_with(status, headers, SystemTime::now)
                    };
                    classifiers.widen(class, status, headers)
                });
                Attempt::Answered {
                    throttled: Load::of_response(status, headers) == Load::Overloaded,
                    class,
                    // gRFC A6 leaves a call's retry to its codes' judgement, not its method.
                    any_method: grpc,
                }
            }
            Err(err) => {
                let class = classifiers.classify_error(err).unwrap_or_else(|| {
                    self.shared.opaque_error::<E>();
                    ErrorClass::Unknown
                });
                match proved(class, unprocessed, req) {
                    ErrorClass::Unprocessed => Attempt::Unprocessed,
                    ErrorClass::NotSent => Attempt::NotSent,
                    ErrorClass::MaybeProcessed | ErrorClass::Drained => Attempt::MaybeProcessed {
                        timed_out: classifiers
                            .as_error(err)
                            .is_some_and(crate::error_class::is_timeout_chain),
                    },
                    ErrorClass::CircuitOpen => Attempt::Refused(
                        crate::error_class::circuit_open_refusal(err).map(|open| Refusal {
                            remaining: open.remaining(),
                            open_for: open.open_for(),
                            failing_for: open.failing_for(),
                            break_duration: open.break_duration(),
                            state: open.state(),
                        }),
                    ),
                    ErrorClass::Shed => Attempt::Shed,
                    ErrorClass::Local | ErrorClass::Unknown => Attempt::Permanent,
                }
            }
        };
        let request = retry::Request {
            max_attempts: limits.max_attempts,
            backoff: limits.backoff,
            may_repeat: safe_to_repeat(req),
            replayable: body_replayable(req),
            grpc,
            once: crate::signals::outbound_call_once(),
        };
        let now = tokio::time::Instant::now().into_std();
        let shared = Arc::clone(&self.shared);
        let mut seed = || {
            shared.seed.map(|seed| {
                let stream = shared.next_stream.fetch_add(1, Ordering::Relaxed);
                seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            })
        };
        let mut env = shared.env(now, self.deadline());
        env.seed = Some(&mut seed);
        match self.retry.decide(&mut env, &request, attempt).decision {
            Decision::Done { attempts, give_up } => self.finish(result, attempts, give_up),
            Decision::Transparent { attempts } => {
                if grpc {
                    let headers = req.headers_mut();
                    headers.insert(GRPC_TRANSPARENT_RETRY_ATTEMPTS, HeaderValue::from(1u32));
                    self.set_grpc_timeout(headers, now);
                }
                shared.retried_transparently(attempts);
                Some(Wait::now())
            }
            Decision::Refused {
                delay,
                attempts,
                probe,
            } => {
                if grpc {
                    self.set_grpc_timeout(req.headers_mut(), now + delay);
                }
                shared.waits_for_circuit(attempts, delay, probe);
                Some(Wait::sleep(delay))
            }
            Decision::Retry { delay, attempts } => {
                let headers = req.headers_mut();
                if grpc {
                    headers.insert(GRPC_PREVIOUS_RPC_ATTEMPTS, HeaderValue::from(attempts));
                    self.set_grpc_timeout(headers, now + delay);
                } else {
                    headers.insert(X_ATTEMPT_COUNT, HeaderValue::from(attempts + 1));
                }
                if self.retry.is_gated() {
                    // Counted as a retry when the gate lets it through.
                    self.gated_since = Some(now);
                } else {
                    let status = result.as_ref().ok().map(|res| res.status().as_u16());
                    shared.retried(attempts, delay, status);
                }
                Some(Wait::sleep(delay))
            }
        }
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        // Not yet sent: no attempt made, none refused by the server or the circuit.
        if self.retry.is_unsent() {
            let now = tokio::time::Instant::now().into_std();
            if !self.shared.first_send(req, now) {
                return None;
            }
            self.deadline = RequestDeadline::SentAt(now, None);
        }
        Some(req.clone())
    }
}
