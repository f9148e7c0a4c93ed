//! The service the layer makes: calls through while the circuit lets it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use tokio::time::Sleep;
use tower_service::Service;

use crate::BoxError;

use super::future::{Guard, ResponseFuture};
use super::ResponseBody;
use super::{now, CircuitBreaker, CircuitState};

/// The service made by [`CircuitBreakerLayer`](super::CircuitBreakerLayer): calls the inner service while the
/// circuit lets it, and fails fast with [`CircuitOpen`](super::CircuitOpen) otherwise.
///
/// # Clone
///
/// Clones share the circuit breaker (and clone the inner service).
pub struct CircuitBreakerService<S> {
    inner: S,
    breaker: CircuitBreaker,
    /// Whether the last `poll_ready` found the inner service ready (and the circuit
    /// admitting); `call` refuses without calling it otherwise.
    inner_ready: bool,
    /// The end of the break, while `poll_ready` waits for it.
    sleep: Option<Pin<Box<Sleep>>>,
    /// A registration for the next change, while `poll_ready` waits for one.
    changed: Option<Pin<Box<tokio::sync::futures::OwnedNotified>>>,
    /// The leave `poll_ready` took for the next call, when it waits for one
    /// ([`wait_when_open`](super::CircuitBreakerBuilder::wait_when_open)): waiters woken
    /// together at a break's end are not all let through to a single probe slot.
    reserved: Option<Guard>,
}

impl<S> CircuitBreakerService<S> {
    /// Wraps `inner` with `breaker`.
    pub fn new(inner: S, breaker: CircuitBreaker) -> Self {
        CircuitBreakerService {
            inner,
            breaker,
            inner_ready: false,
            sleep: None,
            changed: None,
            reserved: None,
        }
    }

    /// The circuit breaker this service reports to.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The circuit's leave for a call, once it gives it; until then registers for the
    /// end of the break or the next change.
    fn poll_admission(&mut self, cx: &mut Context<'_>) -> Poll<Guard> {
        loop {
            // Read only when the state needs it: a closed circuit answers without the
            // clock, which is most of a healthy call's `poll_ready`.
            let mut read = None;
            let rejected = match self
                .breaker
                .shared
                .breaker
                .check_with(|| read.insert(tokio::time::Instant::now()).into_std())
            {
                Ok(()) => match self.breaker.reserve() {
                    Some(guard) => {
                        self.sleep = None;
                        self.changed = None;
                        return Poll::Ready(guard);
                    }
                    // Another caller took the last probe slot in between: wait for the
                    // next change.
                    None => None,
                },
                Err(rejected) => Some(rejected),
            };
            let Some(changed) = &mut self.changed else {
                // Register before looking again, so a change in between is not missed.
                let mut changed = Box::pin(self.breaker.shared.changed.clone().notified_owned());
                changed.as_mut().enable();
                self.changed = Some(changed);
                continue;
            };
            if changed.as_mut().poll(cx).is_ready() {
                self.changed = None;
                continue;
            }
            if let Some(rejected) = rejected.filter(|r| r.state == CircuitState::Open) {
                let now = read.unwrap_or_else(tokio::time::Instant::now);
                let deadline = now + rejected.remaining;
                let sleep = match &mut self.sleep {
                    Some(sleep) => {
                        if sleep.deadline() != deadline {
                            sleep.as_mut().reset(deadline);
                        }
                        sleep
                    }
                    None => self
                        .sleep
                        .insert(Box::pin(tokio::time::sleep_until(deadline))),
                };
                if sleep.as_mut().poll(cx).is_ready() {
                    continue;
                }
            }
            return Poll::Pending;
        }
    }
}

impl<S: Clone> Clone for CircuitBreakerService<S> {
    fn clone(&self) -> Self {
        CircuitBreakerService::new(self.inner.clone(), self.breaker.clone())
    }
}

impl<S: fmt::Debug> fmt::Debug for CircuitBreakerService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreakerService")
            .field("inner", &self.inner)
            .field("breaker", &self.breaker)
            .field("waiting", &(self.sleep.is_some() || self.changed.is_some()))
            .field("reserved", &self.reserved.is_some())
            .finish()
    }
}

impl<S, B, ResB> Service<Request<B>> for CircuitBreakerService<S>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    /// Fail-fast mode (the default): ready at once, without asking the inner service,
    /// while the circuit refuses calls, so that `call` fails with [`CircuitOpen`](super::CircuitOpen)
    /// instead of waiting for the capacity of a dependency already considered down (as
    /// tower's `LoadShed` does). Otherwise, or with
    /// [`wait_when_open`](super::CircuitBreakerBuilder::wait_when_open), the inner service's
    /// readiness. With `wait_when_open`, a `poll_ready` that returns ready holds the
    /// circuit's leave for the next `call` (a half-open probe slot, if it is one), given
    /// back if the service is dropped first: callers waiting out a break together are
    /// not all let through to one probe slot, to be refused at `call`.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner_ready = false;
        if self.breaker.shared.wait_when_open {
            if self.reserved.is_none() {
                self.reserved = Some(ready!(self.poll_admission(cx)));
            }
        } else if self.breaker.shared.breaker.check_with(now).is_err() {
            return Poll::Ready(Ok(()));
        }
        ready!(self.inner.poll_ready(cx)).map_err(Into::into)?;
        self.inner_ready = true;
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        if !std::mem::replace(&mut self.inner_ready, false) {
            // The circuit refused at `poll_ready`: the inner service was never asked to
            // be ready, so the call cannot go to it, even if the circuit admits now.
            return ResponseFuture::rejected(self.breaker.refusal());
        }
        let leave = match self.reserved.take() {
            Some(guard) => Ok(guard),
            None => self.breaker.try_acquire(),
        };
        match leave {
            // The guard exists before the inner call, so a `call` that panics gives
            // the permit (a half-open probe slot) back as it unwinds.
            Ok(guard) => ResponseFuture::called(self.inner.call(request), guard),
            Err(open) => ResponseFuture::rejected(open),
        }
    }
}
