//! The per-request retry decision, and tower's `Policy` over it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderValue, Request, Response};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use stormguard_core::breaker::CircuitState;
use stormguard_core::classify::{GrpcCodeSet, Rules, GRPC_PREVIOUS_RPC_ATTEMPTS, X_ATTEMPT_COUNT};
use stormguard_core::deadline::{grpc_timeout_value, Deadline};
use stormguard_core::methods::MAX_ATTEMPTS as GRPC_MAX_ATTEMPTS;
use stormguard_core::{breaker, Backoff, Class, RetryBudget, Schedule};

use crate::error_class::{classify_error, ErrorClass};
use crate::give_up::GiveUp;

use super::builder::RetryPolicyBuilder;
use super::request::{body_replayable, deadline_of, is_grpc, safe_to_repeat};
use super::shared::{bump, plain_success, RetryStats, Shared};
use super::wait::Wait;
use super::{Attempts, GRPC_TIMEOUT, GRPC_TRANSPARENT_RETRY_ATTEMPTS};

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
    /// Attempts made for this request so far (0 on the layer's own copy); a transparent
    /// retry is not one.
    pub(super) attempts: u32,
    /// The request's free calls taken: its one transparent retry
    /// ([`Free::TRANSPARENT`]), its first call's one wait for a probe ([`Free::PROBE`]).
    pub(super) free: Free,
    /// Refusals of this request's retries by an open circuit waited out: a refused
    /// call never left the client, so it is not an attempt; at most `max_attempts - 1`
    /// (as many as its retries) are waited out.
    pub(super) refusals: u8,
    /// Retries this request was admitted to make and not yet settled with the budget
    /// (attempts are capped at 100, so they fit): the ones that failed are charged as
    /// wasted when it ends (every one if it ends unserved, its caller gone included).
    pub(super) admitted: u8,
    /// An attempt of this request timed out and is not yet charged for
    /// it: charged once its own retry is decided (see `charge_expensive`).
    pub(super) expensive_pending: bool,
    /// When the caller stops waiting: the request's [`Deadline`] or its `grpc-timeout`
    /// counted from its first send, read from the request at its first failure (a
    /// success never needs it).
    pub(super) deadline: RequestDeadline,
    /// The request's random streams, made at its first retry. Boxed so that the policy,
    /// which tower moves around with every request, stays small (seven words, 56 bytes
    /// on 64-bit targets) on the success path.
    pub(super) streams: Option<Box<Streams>>,
}

/// What bounds one request's retries: the policy's settings, or its gRPC method's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) retryable_grpc_codes: GrpcCodeSet,
}

/// Where a request's deadline stands: tower keeps the request as first sent until its
/// first outcome, so the deadline is read then, from that copy and the instant of the
/// first send, to the same value it would have had at the send.
#[derive(Debug, Clone, Copy)]
pub(super) enum RequestDeadline {
    /// Not sent yet (the layer's own copy of the policy).
    Unsent,
    /// First sent at this instant, with this long at most to finish if a total timeout
    /// above says so; not read yet.
    SentAt(Instant, Option<Duration>),
    /// Read at the first failure: the [`Deadline`], if the request has one.
    Read(Option<Deadline>),
}

/// The free calls a request has taken, one bit each, so that the policy tower moves
/// with every request stays as small as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Free(u8);

impl Free {
    pub(super) const NONE: Free = Free(0);
    /// Its one transparent retry: a call the server refused unprocessed.
    const TRANSPARENT: Free = Free(1);
    /// Its first call's one wait for a probe's verdict (`probe_wait`).
    const PROBE: Free = Free(2);
    /// Not a free call but a note, carried in the same byte: the attempt that just ended
    /// provably left its request unprocessed (`crate::connect`); read and cleared by the
    /// decision on it.
    const UNPROCESSED: Free = Free(4);

    fn has(self, what: Free) -> bool {
        self.0 & what.0 != 0
    }

    fn take(&mut self, what: Free) {
        self.0 |= what.0;
    }

    /// Whether `what` was set, clearing it.
    fn clear(&mut self, what: Free) -> bool {
        let had = self.has(what);
        self.0 &= !what.0;
        had
    }
}

/// One request's random draws: its backoff schedule and the jitter on server hints.
#[derive(Debug, Clone)]
pub(super) struct Streams {
    schedule: Schedule,
    rng: SmallRng,
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
            .field("attempts", &self.attempts)
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
        if self.admitted > 0 {
            self.settle(false);
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

    /// This policy's copy for a request first sent at `sent` (with `total` to finish in,
    /// under a total timeout), as [`clone_request`](tower::retry::Policy::clone_request)
    /// leaves it.
    pub(crate) fn sent_at(&self, sent: Instant, total: Option<Duration>) -> RetryPolicy {
        RetryPolicy {
            shared: Arc::clone(&self.shared),
            attempts: 0,
            free: Free::NONE,
            refusals: 0,
            admitted: 0,
            expensive_pending: false,
            deadline: RequestDeadline::SentAt(sent, total),
            streams: None,
        }
    }

    /// The checks after a retryable outcome, in order; `Ok` holds the server's hint.
    fn may_retry<B>(
        &self,
        req: &Request<B>,
        grpc: bool,
        safe_for_any_method: bool,
        after: Option<Duration>,
        max_attempts: u32,
    ) -> Result<Option<Duration>, GiveUp> {
        let shared = &*self.shared;
        if !(safe_for_any_method || safe_to_repeat(req)) {
            return Err(GiveUp::NotIdempotent);
        }
        let max = if grpc {
            max_attempts.min(GRPC_MAX_ATTEMPTS)
        } else {
            max_attempts
        };
        if self.attempts >= max || crate::signals::outbound_call_once() {
            return Err(GiveUp::Exhausted);
        }
        if !body_replayable(req) {
            return Err(GiveUp::BodyNotReplayable);
        }
        if after.is_some_and(|after| after > shared.max_retry_after) {
            return Err(GiveUp::RetryAfterTooLong);
        }
        Ok(after)
    }

    /// The last checks, once the wait is known: the deadline, then the budget (so a
    /// retry that could never finish asks for nothing), which admits the retry on the
    /// waste so far.
    fn may_wait(&mut self, now: Instant, delay: Duration) -> Result<(), GiveUp> {
        if self.outlasts_deadline(now, delay) {
            return Err(GiveUp::Deadline);
        }
        if let Some(throttle) = &self.shared.throttle {
            if !throttle.allows_retry() {
                return Err(GiveUp::Budget);
            }
        }
        let admitted = self.shared.budget.admit(now, u32::from(self.admitted));
        self.charge_expensive();
        if !admitted {
            return Err(GiveUp::Budget);
        }
        Ok(())
    }

    /// Charges an attempt that timed out (work the server may have done for nobody),
    /// once its own retry is decided, and whatever was decided: two wasted
    /// retries (`stormguard_core::budget::EXPENSIVE_FAILURE`), as the AWS SDKs ask a
    /// timeout's retry for twice the tokens. Its own retry is decided first, on the
    /// room as it was: so a new or quiet client retries an isolated timeout (its
    /// allowance pays for it) instead of spending the allowance on the timeout and
    /// finding nothing left for the retry, while in a brownout, where timeouts come
    /// many at a time, each one charged closes the room to the next ones at once.
    fn charge_expensive(&mut self) {
        if std::mem::take(&mut self.expensive_pending) {
            let now = tokio::time::Instant::now().into_std();
            let charge = stormguard_core::budget::EXPENSIVE_FAILURE;
            self.shared.budget.charge(now, charge);
        }
    }

    /// Settles this request's retries with the budget at its end, once: the retries it
    /// was admitted to make that failed are wasted. For a request `served` that is all
    /// but the last (the one that succeeded costs nothing); for one that was not, every
    /// one (the last may still have been in flight when its caller gave up).
    fn settle(&mut self, served: bool) {
        let admitted = std::mem::take(&mut self.admitted);
        let wasted = if served {
            admitted.saturating_sub(1)
        } else {
            admitted
        };
        if wasted > 0 {
            let now = tokio::time::Instant::now().into_std();
            self.shared.budget.charge(now, u32::from(wasted));
        }
    }

    /// Sends a call the circuit refused again after `delay`, unless its body cannot be
    /// sent again or the wait outlasts its deadline: a retry the circuit moved (its
    /// admission kept, charged as wasted if it fails), or a first call waiting for the
    /// probe. The call never left the client: it is not an attempt and asks the budget
    /// for nothing.
    fn wait_refused<B, Res, E>(
        &mut self,
        req: &mut Request<B>,
        result: &mut Result<Response<Res>, E>,
        delay: Duration,
        what: &'static str,
    ) -> Option<Wait> {
        let attempts = self.attempts + 1;
        if !body_replayable(req) {
            return self.finish(result, attempts, Some(GiveUp::BodyNotReplayable));
        }
        self.read_deadline(req);
        let now = tokio::time::Instant::now().into_std();
        if self.outlasts_deadline(now, delay) {
            return self.finish(result, attempts, Some(GiveUp::Deadline));
        }
        if is_grpc(req) {
            self.set_grpc_timeout(req.headers_mut(), now + delay);
        }
        tracing::debug!(
            target: "stormguard::retry",
            attempt = attempts,
            delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            reason = "circuit_open",
            "{what}"
        );
        Some(Wait::sleep(delay))
    }

    /// Notes that the attempt about to be decided provably left its request
    /// unprocessed: its failure, a timeout or a GOAWAY most often, is then one the server
    /// never acted on ([`crate::connect`]).
    pub(super) fn attempt_unprocessed(&mut self) {
        self.free.take(Free::UNPROCESSED);
    }

    /// The one free retry of a request its server refused before its application saw
    /// it: at once, no attempt spent, nothing withdrawn from the budget.
    fn retry_transparently<B>(&mut self, req: &mut Request<B>, grpc: bool) -> Option<Wait> {
        if !body_replayable(req) {
            self.give_up(GiveUp::BodyNotReplayable, self.attempts + 1);
            return None;
        }
        let now = tokio::time::Instant::now().into_std();
        if self.outlasts_deadline(now, Duration::ZERO) {
            self.give_up(GiveUp::Deadline, self.attempts + 1);
            return None;
        }
        self.free.take(Free::TRANSPARENT);
        if grpc {
            let headers = req.headers_mut();
            headers.insert(GRPC_TRANSPARENT_RETRY_ATTEMPTS, HeaderValue::from(1u32));
            self.set_grpc_timeout(headers, now);
        }
        bump(&self.shared.counters.transparent_retries);
        #[cfg(feature = "metrics")]
        self.shared.metrics.transparent(&self.shared.name);
        tracing::debug!(
            target: "stormguard::retry",
            attempt = self.attempts + 1,
            delay_ms = 0u64,
            reason = "transparent",
            "retrying"
        );
        Some(Wait::now())
    }

    /// Counts an attempt whose outcome was classified `class` (`answered`: the server
    /// answered, with a response rather than a transport error).
    fn count_attempt(&mut self, class: Class, answered: bool) {
        self.attempts += 1;
        self.shared.record_outcome(class, answered);
    }

    /// Hands the outcome back: settles the budget, records why (if it is a give-up)
    /// and the attempt count.
    fn finish<Res, E>(
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
        self.charge_expensive();
        self.settle(why.is_none());
        if let Some(why) = why {
            self.give_up(why, attempts);
        }
        self.shared.call_ended(attempts);
        None
    }

    /// The budget as the metrics show it.
    #[cfg(feature = "metrics")]
    fn budget_view(&self) -> crate::metrics::BudgetView {
        let now = tokio::time::Instant::now().into_std();
        let budget = &self.shared.budget;
        let (requests, wasted) = budget.usage(now);
        let ratio = if requests == 0 {
            0.0
        } else {
            wasted as f64 / requests as f64
        };
        crate::metrics::BudgetView {
            remaining: budget.available(now),
            allowance: budget.allowance_left(),
            ratio,
        }
    }

    fn give_up(&self, why: GiveUp, attempts: u32) {
        #[cfg(feature = "metrics")]
        self.shared
            .metrics
            .give_up(&self.shared.name, why, self.budget_view());
        let c = &self.shared.counters;
        match why {
            GiveUp::Exhausted => bump(&c.exhausted),
            GiveUp::Permanent => bump(&c.permanent),
            GiveUp::Budget => bump(&c.budget_denied),
            GiveUp::NotIdempotent => bump(&c.not_idempotent),
            GiveUp::BodyNotReplayable => bump(&c.not_replayable),
            GiveUp::RetryAfterTooLong | GiveUp::Pushback | GiveUp::DontRetry => {
                bump(&c.server_refused)
            }
            GiveUp::Deadline => bump(&c.deadline),
            GiveUp::CircuitOpen => {}
        }
        crate::signals::record_give_up(why);
        match why {
            GiveUp::Permanent => {
                tracing::debug!(target: "stormguard::retry", attempts, reason = why.as_str(), "giving up")
            }
            _ => {
                tracing::info!(target: "stormguard::retry", attempts, reason = why.as_str(), "giving up")
            }
        }
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

    fn streams(&mut self, backoff: Backoff) -> &mut Streams {
        let shared = &self.shared;
        self.streams.get_or_insert_with(|| {
            Box::new(match shared.seed {
                Some(seed) => {
                    let stream = shared.next_stream.fetch_add(1, Ordering::Relaxed);
                    let seed = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    Streams {
                        schedule: backoff.schedule_seeded(seed),
                        rng: SmallRng::seed_from_u64(!seed),
                    }
                }
                None => Streams {
                    schedule: backoff.schedule(),
                    rng: SmallRng::from_rng(&mut rand::rng()),
                },
            })
        })
    }

    /// The wait of a call an open circuit refused, whose backoff drew `delay`: spread
    /// over the circuit's age up to the backoff's cap, or up to the request's deadline
    /// if sooner (the deadline must have been read).
    fn backlog_wait(
        &mut self,
        backoff: Backoff,
        delay: Duration,
        remaining: Duration,
        open_for: Duration,
    ) -> Duration {
        let now = tokio::time::Instant::now().into_std();
        let limit = match self.deadline() {
            // An attempt must start strictly before the deadline.
            Some(deadline) => backoff.cap().min(
                deadline
                    .remaining(now)
                    .saturating_sub(Duration::from_nanos(1)),
            ),
            None => backoff.cap(),
        };
        let draw: f64 = self.streams(backoff).rng.random();
        breaker::backlog_wait(delay, remaining, open_for, limit, draw)
    }

    fn next_backoff(&mut self, backoff: Backoff) -> Duration {
        self.streams(backoff)
            .schedule
            .next()
            .unwrap_or(backoff.cap())
    }

    /// Reads the request's deadline, once, from the request as first sent: call it at
    /// the first outcome that is not a success, before the request is changed for a
    /// retry.
    fn read_deadline<B>(&mut self, req: &Request<B>) {
        if let RequestDeadline::SentAt(sent, total) = self.deadline {
            let outer = total.map(|total| Deadline::after(sent, total));
            let method = self.method_timeout(req).map(|t| Deadline::after(sent, t));
            let deadline = [deadline_of(req, sent), outer, method]
                .into_iter()
                .flatten()
                .min();
            self.deadline = RequestDeadline::Read(deadline);
        }
    }

    /// The timeout of `req`'s gRPC method, when the policy has per-method timeouts.
    fn method_timeout<B>(&self, req: &Request<B>) -> Option<Duration> {
        let timeouts = self.shared.timeouts.as_ref()?;
        if !is_grpc(req) {
            return None;
        }
        timeouts.lookup(req.uri().path()).copied().flatten()
    }

    /// Whether a call sent `delay` after `now` would start past the request's deadline.
    fn outlasts_deadline(&self, now: Instant, delay: Duration) -> bool {
        self.deadline().is_some_and(|d| !d.allows(now, delay))
    }

    /// Tells the server of a gRPC call sent at `sent` how long its caller still waits.
    fn set_grpc_timeout(&self, headers: &mut http::HeaderMap, sent: Instant) {
        if let Some(deadline) = self.deadline() {
            headers.insert(GRPC_TIMEOUT, grpc_timeout_value(deadline.remaining(sent)));
        }
    }

    /// The request's deadline, once [`read_deadline`](Self::read_deadline) has run.
    fn deadline(&self) -> Option<Deadline> {
        match self.deadline {
            RequestDeadline::Read(deadline) => deadline,
            RequestDeadline::Unsent | RequestDeadline::SentAt(..) => None,
        }
    }

    /// Up to 10% more than the server asked for, never less.
    fn stretch(&mut self, backoff: Backoff, hint: Duration) -> Duration {
        let spread = u64::try_from((hint / 10).as_nanos()).unwrap_or(u64::MAX);
        if spread == 0 {
            return hint;
        }
        let extra = self.streams(backoff).rng.random_range(0..spread);
        hint.saturating_add(Duration::from_nanos(extra))
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
        if result.as_ref().is_ok_and(plain_success) {
            // Nothing else about the request or the response matters.
            self.count_attempt(Class::Success, true);
            return self.finish(result, self.attempts, None);
        }
        let unprocessed_note = self.free.clear(Free::UNPROCESSED);
        let grpc = is_grpc(req);
        // The policy's attempts, backoff and codes, or the gRPC method's own.
        let limits = self.limits(req, grpc);
        // Whether repeating the request is safe whatever its method: the failure proves
        // the application never saw it, or gRPC declared its code retryable (gRFC A6
        // leaves that judgement to the configured codes).
        // The wait decided by an open circuit's break, if the failure was one.
        let mut after_break = None;
        let (class, safe_for_any_method, expensive) = match result {
            Ok(res) if grpc => {
                let rules = Rules {
                    retryable_grpc_codes: limits.retryable_grpc_codes,
                    ..self.shared.rules
                };
                (
                    rules.classify_grpc_response(res.status(), res.headers()),
                    true,
                    false,
                )
            }
            Ok(res) => {
                let rules = &self.shared.rules;
                let class = rules.classify_with(res.status(), res.headers(), SystemTime::now);
                (class, false, false)
            }
            Err(err) => match proved(classify_error(err), unprocessed_note, req) {
                ErrorClass::Unprocessed if !self.free.has(Free::TRANSPARENT) => {
                    self.read_deadline(req);
                    return self.retry_transparently(req, grpc);
                }
                ErrorClass::Unprocessed | ErrorClass::NotSent => {
                    (Class::Retryable { after: None }, true, false)
                }
                // The request may have been processed. A timeout is charged more: the
                // server may have worked on it for nobody all the while.
                ErrorClass::MaybeProcessed | ErrorClass::Drained => (
                    Class::Retryable { after: None },
                    false,
                    crate::error_class::is_timeout(err),
                ),
                ErrorClass::CircuitOpen => {
                    // A break that ends before the backoff would anyway is waited out:
                    // the circuit admits its probe meanwhile, so the call adds no load,
                    // and a blip's requests are not lost to it. A longer break fails
                    // fast. A request already sent (its retry refused) waits out up to
                    // as many refusals as it has retries, then gives up, without
                    // spending an attempt or asking the budget again: its retry was
                    // admitted, and the refusal only moved it. A request refused at its
                    // first call waits as a retry, admitted by the budget and spending
                    // an attempt: so a circuit that stays open fails new requests fast
                    // once the budget is spent, instead of piling them up for the
                    // moment it closes.
                    // The wait spreads the circuit's backlog over a span that grows
                    // with its age, so that the calls it refused do not all come back
                    // the moment it closes (`backlog_wait`).
                    // Before that, a first call refused within a break of the break's
                    // end (or while its probe decides) waits for the probe's verdict,
                    // once and free: the first calls of a recovery are not lost to
                    // the incident's spent budget (`probe_wait`).
                    let Some(open) = crate::error_class::circuit_open_refusal(err) else {
                        return self.finish(result, self.attempts + 1, Some(GiveUp::CircuitOpen));
                    };
                    let (remaining, open_for) = (open.remaining(), open.open_for());
                    let sent = self.attempts > 0;
                    let breaks =
                        matches!(open.state(), CircuitState::Open | CircuitState::HalfOpen);
                    let brk = open.break_duration();
                    if !sent && !self.free.has(Free::PROBE) && breaks {
                        let ceiling = limits.backoff.ceiling(0);
                        let draw = || self.streams(limits.backoff).rng.random();
                        if let Some(wait) = breaker::probe_wait(remaining, brk, ceiling, draw) {
                            self.free.take(Free::PROBE);
                            return self.wait_refused(req, result, wait, "waiting for the probe");
                        }
                    }
                    let delay = self.next_backoff(limits.backoff);
                    let retries = limits.max_attempts.saturating_sub(1);
                    if remaining > delay || (sent && u32::from(self.refusals) >= retries) {
                        return self.finish(result, self.attempts + 1, Some(GiveUp::CircuitOpen));
                    }
                    self.read_deadline(req);
                    let wait = self.backlog_wait(limits.backoff, delay, remaining, open_for);
                    if sent {
                        self.refusals = self.refusals.saturating_add(1);
                        return self.wait_refused(req, result, wait, "waiting out the break");
                    }
                    after_break = Some(wait);
                    (Class::Retryable { after: None }, true, false)
                }
                ErrorClass::Local | ErrorClass::Unknown => (Class::Permanent, false, false),
            },
        };
        self.count_attempt(class, result.is_ok());
        self.expensive_pending = expensive;
        let attempts = self.attempts;
        let decision = match class {
            Class::Success => return self.finish(result, attempts, None),
            Class::Permanent => Err(GiveUp::Permanent),
            Class::DontRetry if grpc => Err(GiveUp::Pushback),
            Class::DontRetry => Err(GiveUp::DontRetry),
            Class::Retryable { after } => {
                self.may_retry(req, grpc, safe_for_any_method, after, limits.max_attempts)
            }
        };
        let after = match decision {
            Ok(after) => after,
            Err(why) => return self.finish(result, attempts, Some(why)),
        };
        // Read once a retry is in view, before any header of the request is rewritten.
        self.read_deadline(req);
        let backoff = limits.backoff;
        let delay = match (after_break, after) {
            (Some(wait), _) => wait,
            (None, Some(exact)) if grpc => {
                // gRFC A6: after the server's own wait, the backoff starts over.
                self.streams(backoff).schedule.restart();
                exact
            }
            (None, Some(hint)) => {
                let delay = self.next_backoff(backoff);
                delay.max(self.stretch(backoff, hint))
            }
            (None, None) => self.next_backoff(backoff),
        };
        let now = tokio::time::Instant::now().into_std();
        if let Err(why) = self.may_wait(now, delay) {
            return self.finish(result, attempts, Some(why));
        }
        let headers = req.headers_mut();
        if grpc {
            headers.insert(GRPC_PREVIOUS_RPC_ATTEMPTS, HeaderValue::from(attempts));
            self.set_grpc_timeout(headers, now + delay);
        } else {
            headers.insert(X_ATTEMPT_COUNT, HeaderValue::from(attempts + 1));
        }
        self.admitted = self.admitted.saturating_add(1);
        bump(&self.shared.counters.retries);
        #[cfg(feature = "metrics")]
        {
            let (shared, view) = (&self.shared, self.budget_view());
            let metrics = &shared.metrics;
            metrics.attempt(&shared.name, attempts + 1);
            metrics.retry(&shared.name, delay, view);
        }
        let status = result.as_ref().ok().map(|res| res.status().as_u16());
        tracing::info!(
            target: "stormguard::retry",
            attempt = attempts + 1,
            delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            reason = if status.is_some() { "status" } else { "error" },
            status,
            "retrying"
        );
        Some(Wait::sleep(delay))
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        // Not yet sent: no attempt made, none refused by the server or the circuit.
        if self.attempts == 0 && self.free == Free::NONE && self.refusals == 0 {
            let now = tokio::time::Instant::now().into_std();
            if !self.shared.first_send(req, now) {
                return None;
            }
            self.deadline = RequestDeadline::SentAt(now, None);
        }
        Some(req.clone())
    }
}

/// How a failure is taken, given whether its attempt provably left the request
/// unprocessed (`unprocessed`, from `crate::connect`): one after which the request may
/// have been processed (a timeout, a reset) is then one the server never saw. A GOAWAY
/// proves nothing on its own (see [`ErrorClass::Drained`]): it is taken as unprocessed
/// with that proof, or for a request that may be repeated anyway, and as a failure after
/// which the request may have been processed otherwise. Any other class stands.
fn proved<B>(class: ErrorClass, unprocessed: bool, req: &Request<B>) -> ErrorClass {
    match class {
        ErrorClass::MaybeProcessed if unprocessed => ErrorClass::Unprocessed,
        ErrorClass::Drained if unprocessed || super::request::safe_to_repeat(req) => {
            ErrorClass::Unprocessed
        }
        ErrorClass::Drained => ErrorClass::MaybeProcessed,
        class => class,
    }
}
