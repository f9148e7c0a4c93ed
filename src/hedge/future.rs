//! The response future of [`Hedge`](super::Hedge).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use stormguard_core::classify::{GrpcCodeSet, GRPC_PREVIOUS_RPC_ATTEMPTS};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::{add, HedgeEvent, HedgePolicy, Stop, Verdict};
use crate::body::ReplayHandle;

pin_project! {
    /// The response future of [`Hedge`](super::Hedge): the original request and, once
    /// it is slow, its hedges, racing; the first response that is not a non-fatal
    /// failure.
    ///
    /// A request that is not hedged at all (not idempotent, or the policy has too few
    /// latencies yet) is the inner future and nothing else: no allocation. A hedged
    /// request allocates its state once (the copies in flight, a timer, the copy of the
    /// request); the service is cloned only when a hedge is sent.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        kind: Kind<S, B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<S, B>
    where
        S: Service<Request<B>>,
    {
        // Never hedged: the request is not safe to repeat.
        Once {
            #[pin]
            future: S::Future,
        },
        // Safe to repeat, but the policy has no delay yet: timed for the window.
        Timed {
            #[pin]
            future: S::Future,
            started: Instant,
            policy: HedgePolicy,
            grpc: bool,
        },
        Hedged {
            state: Box<Hedging<S, B>>,
        },
    }
}

/// What [`Hedge::call`](super::Hedge) hands over to make a hedged response future.
pub(crate) struct Hedged<S: Service<Request<B>>, B> {
    /// Copies for this request, the original included.
    pub(crate) max_attempts: u32,
    /// Its gRPC method's non-fatal codes, when it has its own.
    pub(crate) codes: Option<GrpcCodeSet>,
    pub(crate) policy: HedgePolicy,
    pub(crate) grpc: bool,
    pub(crate) delay: Duration,
    pub(crate) first: S::Future,
    pub(crate) started: Instant,
    pub(crate) spare: Arc<Spare<S>>,
    pub(crate) copy: Request<B>,
    pub(crate) replay: Option<ReplayHandle>,
}

/// The service hedges are sent through: one clone of the inner service, made at the
/// first request that could be hedged and kept by the layer and all its clones, cloned
/// again only when a request sends a hedge (as [`Retry`](crate::Retry) keeps its own).
pub(crate) struct Spare<S>(OnceLock<Kept<S>>);

/// The kept service, and how to clone it (known where it was kept: the response future
/// asks nothing more of `S` than tower's `Service`).
struct Kept<S> {
    service: Mutex<S>,
    clone: fn(&S) -> S,
}

impl<S> Spare<S> {
    pub(crate) fn new() -> Self {
        Spare(OnceLock::new())
    }

    /// Keeps a clone of `inner`, unless one is kept already.
    pub(crate) fn fill(&self, inner: &S)
    where
        S: Clone,
    {
        self.0.get_or_init(|| Kept {
            service: Mutex::new(inner.clone()),
            clone: S::clone,
        });
    }

    /// A clone of the kept service (`None` before [`fill`](Self::fill)).
    fn service(&self) -> Option<S> {
        let kept = self.0.get()?;
        let service = kept.service.lock().unwrap_or_else(PoisonError::into_inner);
        Some((kept.clone)(&service))
    }
}

impl<S> fmt::Debug for Spare<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Spare")
            .field("kept", &self.0.get().is_some())
            .finish()
    }
}

struct Attempt<F> {
    future: Pin<Box<F>>,
    started: Instant,
    /// 0 for the original, n for the n-th hedge.
    index: u32,
}

/// What the next hedge needs: dropped as soon as no hedge may be sent any more.
struct Next<S, B> {
    spare: Arc<Spare<S>>,
    /// Cloned from the spare when the first hedge is due.
    service: Option<S>,
    copy: Request<B>,
    sleep: Pin<Box<Sleep>>,
    /// The delay is up (or a copy failed non-fatally): send when the service is ready.
    due: bool,
}

struct Hedging<S: Service<Request<B>>, B> {
    max_attempts: u32,
    codes: Option<GrpcCodeSet>,
    policy: HedgePolicy,
    grpc: bool,
    delay: Duration,
    attempts: Vec<Attempt<S::Future>>,
    /// Copies sent so far, the original included.
    sent: u32,
    next: Option<Next<S, B>>,
    replay: Option<ReplayHandle>,
    /// The latest non-fatal failure, returned if no copy does better.
    last: Option<Result<S::Response, S::Error>>,
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn once(future: S::Future) -> Self {
        ResponseFuture {
            kind: Kind::Once { future },
        }
    }

    pub(crate) fn timed(
        future: S::Future,
        started: Instant,
        policy: HedgePolicy,
        grpc: bool,
    ) -> Self {
        ResponseFuture {
            kind: Kind::Timed {
                future,
                started,
                policy,
                grpc,
            },
        }
    }

    pub(crate) fn hedged(h: Hedged<S, B>) -> Self {
        let max = h.max_attempts;
        let next = (max > 1).then(|| Next {
            spare: h.spare,
            service: None,
            copy: h.copy,
            sleep: Box::pin(tokio::time::sleep_until(h.started + h.delay)),
            due: false,
        });
        let mut attempts = Vec::with_capacity(max as usize);
        attempts.push(Attempt {
            future: Box::pin(h.first),
            started: h.started,
            index: 0,
        });
        ResponseFuture {
            kind: Kind::Hedged {
                state: Box::new(Hedging {
                    max_attempts: max,
                    codes: h.codes,
                    policy: h.policy,
                    grpc: h.grpc,
                    delay: h.delay,
                    attempts,
                    sent: 1,
                    next,
                    replay: h.replay,
                    last: None,
                }),
            },
        }
    }
}

impl<S, B, ResB> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: 'static,
    B: Clone,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Once { future } => future.poll(cx),
            KindProj::Timed {
                future,
                started,
                policy,
                grpc,
            } => {
                let result = std::task::ready!(future.poll(cx));
                // Only a response can be a success: an error needs no judging.
                if result.is_ok()
                    && policy.judge(*grpc, None, &result) == (Verdict::Final { success: true })
                {
                    let now = Instant::now();
                    policy.record(now.saturating_duration_since(*started), now);
                }
                Poll::Ready(result)
            }
            KindProj::Hedged { state } => state.poll(cx),
        }
    }
}

impl<S, B, ResB> Hedging<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: 'static,
    B: Clone,
{
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Response<ResB>, S::Error>> {
        // Each turn either sends a hedge (at most `max_attempts - 1` of them) or returns.
        loop {
            let mut i = 0;
            while i < self.attempts.len() {
                let Poll::Ready(result) = self.attempts[i].future.as_mut().poll(cx) else {
                    i += 1;
                    continue;
                };
                // The last attempt moves into slot `i`, to be polled next.
                let attempt = self.attempts.swap_remove(i);
                match self.policy.judge(self.grpc, self.codes, &result) {
                    Verdict::Final { success } => {
                        let now = Instant::now();
                        if success {
                            let latency = now.saturating_duration_since(attempt.started);
                            self.policy.record(latency, now);
                        }
                        self.finish(attempt.index);
                        return Poll::Ready(result);
                    }
                    Verdict::NonFatal { stop } => {
                        if let Some(why) = stop {
                            self.stop(why);
                        }
                        // gRFC A6: a non-fatal failure sends the next hedge at once.
                        if let Some(next) = &mut self.next {
                            next.due = true;
                        }
                        self.last = Some(result);
                    }
                }
            }
            if self.poll_hedge(cx) {
                continue;
            }
            if self.attempts.is_empty() && self.next.is_none() {
                // Every copy failed non-fatally and no hedge is left: the last failure.
                // (`last` is set whenever the attempts ran out, by the failure above.)
                if let Some(result) = self.last.take() {
                    return Poll::Ready(result);
                }
            }
            return Poll::Pending;
        }
    }

    /// Sends the next hedge if it is due, the service is ready and the budget pays for
    /// it; `true` when one was sent.
    fn poll_hedge(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(next) = &mut self.next else {
            return false;
        };
        if !next.due {
            if next.sleep.as_mut().poll(cx).is_pending() {
                return false;
            }
            next.due = true;
        }
        // Hedges run side by side, so each needs the kept frames: a body the original
        // left unread could go to one copy only.
        if self.replay.as_ref().is_some_and(|r| !r.is_whole()) {
            self.stop(Stop::NotReplayable);
            return false;
        }
        let service = match &mut next.service {
            Some(service) => service,
            None => match next.spare.service() {
                Some(service) => next.service.insert(service),
                None => {
                    self.next = None;
                    return false;
                }
            },
        };
        match service.poll_ready(cx) {
            Poll::Pending => return false,
            Poll::Ready(Err(err)) => {
                tracing::debug!(target: "stormguard::hedge", "service failed to get ready for a hedge");
                self.next = None;
                if self.last.is_none() {
                    self.last = Some(Err(err));
                }
                return false;
            }
            Poll::Ready(Ok(())) => {}
        }
        let now = Instant::now();
        if !self.policy.try_withdraw(now) {
            self.stop(Stop::Budget);
            return false;
        }
        let stamp = |mut copy: Request<B>| {
            if self.grpc {
                copy.headers_mut()
                    .insert(GRPC_PREVIOUS_RPC_ATTEMPTS, HeaderValue::from(self.sent));
            }
            copy
        };
        let future = if self.sent + 1 >= self.max_attempts {
            // The last hedge takes the kept request itself: no copy to make.
            let Some(Next {
                service: Some(mut service),
                copy,
                ..
            }) = self.next.take()
            else {
                return false;
            };
            service.call(stamp(copy))
        } else {
            next.due = false;
            next.sleep.as_mut().reset(now + self.delay);
            let copy = stamp(next.copy.clone());
            match &mut next.service {
                Some(service) => service.call(copy),
                None => return false,
            }
        };
        self.attempts.push(Attempt {
            future: Box::pin(future),
            started: now,
            index: self.sent,
        });
        self.sent += 1;
        add(&self.policy.counters().hedges_sent, 1);
        self.policy.count(HedgeEvent::Sent, 1);
        tracing::debug!(
            target: "stormguard::hedge",
            attempt = self.sent,
            delay_ms = u64::try_from(self.delay.as_millis()).unwrap_or(u64::MAX),
            "hedge sent"
        );
        true
    }

    /// No further hedges: drops what they needed, counts and reports why.
    fn stop(&mut self, why: Stop) {
        if self.next.take().is_none() {
            return;
        }
        let counters = self.policy.counters();
        match why {
            Stop::Budget => {
                add(&counters.budget_denied, 1);
                self.policy.count(HedgeEvent::BudgetRefused, 1);
            }
            _ => add(&counters.suppressed, 1),
        }
        tracing::debug!(target: "stormguard::hedge", reason = why.as_str(), sent = self.sent, "no further hedges");
    }

    /// A copy won: the others are dropped (cancelled).
    fn finish(&mut self, winner: u32) {
        let counters = self.policy.counters();
        let cancelled = self.attempts.len() as u64;
        add(&counters.cancelled, cancelled);
        self.policy.count(HedgeEvent::Cancelled, cancelled);
        self.attempts.clear();
        self.next = None;
        if winner > 0 {
            add(&counters.hedges_won, 1);
            self.policy.count(HedgeEvent::Won, 1);
            tracing::debug!(target: "stormguard::hedge", attempt = winner + 1, "hedge won");
        }
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("ResponseFuture");
        match &self.kind {
            Kind::Once { .. } => d.field("hedged", &false),
            Kind::Timed { .. } => d.field("hedged", &false).field("timed", &true),
            Kind::Hedged { state } => d
                .field("hedged", &true)
                .field("in_flight", &state.attempts.len())
                .field("sent", &state.sent)
                .field("more", &state.next.is_some()),
        };
        d.finish()
    }
}
