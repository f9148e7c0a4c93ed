//! The response future of [`Retry`](super::Retry).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::retry::Policy;
use tower_service::Service;

use super::service::{Core, Proved};

use super::gate::Release;
use super::{Handoff, RetryPolicy, Wait};

pin_project! {
    #[project = ResponseFutureProj]
    /// The response of a call through [`Retry`](super::Retry): the first attempt, then
    /// each retry the policy decides on, after its wait, until an outcome is handed
    /// back.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        core: Arc<Core<S>>,
        // The copy of the request to send next, if there may be a next.
        copy: Option<Request<B>>,
        // When the request was first sent.
        sent: Instant,
        // The request's own policy, made at its first outcome that is not a plain
        // success (most requests never need one).
        policy: Option<Box<RetryPolicy>>,
        // The service the request's retries go through, made at its first retry (boxed:
        // a stack's service can be large, and every move of the future copies it).
        retries: Option<Box<S>>,
        // The attempt in flight's tracking, if it is tracked (`crate::connect`).
        handoff: Option<Box<Handoff>>,
        // A failed attempt's outcome, held while its connection settles whether it
        // proves the request unprocessed (`crate::connect`), or while a retry of a
        // throttling answer waits for the gate (handed back if it is not let through).
        held: Option<Box<Result<S::Response, S::Error>>>,
        #[pin]
        state: State<S::Future>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        // An attempt is in flight.
        Called {
            #[pin]
            future: F,
        },
        // The wait before the next attempt.
        Waiting {
            #[pin]
            wait: Wait,
        },
        // Waiting for the service to be ready for the next attempt.
        Retrying,
        // A failed attempt's connection settles whether its request was processed.
        Settling {
            settle: Pin<Box<dyn Future<Output = bool> + Send>>,
        },
        // An attempt has ended and its future is gone: the policy decides.
        Deciding,
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(super) fn new(
        core: Arc<Core<S>>,
        copy: Option<Request<B>>,
        sent: Instant,
        future: S::Future,
        handoff: Option<Box<Handoff>>,
    ) -> Self {
        ResponseFuture {
            core,
            copy,
            sent,
            policy: None,
            retries: None,
            handoff,
            held: None,
            state: State::Called { future },
        }
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Called { .. } => "called",
            State::Waiting { .. } => "waiting",
            State::Retrying => "retrying",
            State::Settling { .. } => "settling",
            State::Deciding => "deciding",
        };
        f.debug_struct("ResponseFuture")
            .field(
                "policy",
                self.policy.as_deref().unwrap_or(&self.core.policy),
            )
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResB> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    S::Error: 'static,
    B: Clone,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Called { future } => {
                    let result = ready!(future.poll(cx));
                    // Read while the attempt still holds its request, wherever it is.
                    let proved = match this.handoff.take() {
                        Some(handoff) => this.core.proved_unprocessed(&handoff, &result),
                        None => Proved::No,
                    };
                    // A first attempt's plain success is handed back from here, not
                    // moved through the decision: a response is large enough that each
                    // move is a copy of its own.
                    let shared = &this.core.policy.shared;
                    if this.policy.is_none()
                        && this.copy.is_some()
                        && matches!(proved, Proved::No)
                        && result
                            .as_ref()
                            .is_ok_and(|res| shared.is_plain_success(res))
                    {
                        shared.served_first_time();
                        this.state.set(State::Deciding);
                        return Poll::Ready(result);
                    }
                    // Drop the attempt (and the request it may still hold) before the
                    // policy looks at the copy: a body the attempt never read is then
                    // handed on to the copy (see `ReplayBody`).
                    this.state.set(State::Deciding);
                    let unprocessed = match proved {
                        Proved::Yes => true,
                        Proved::No => false,
                        Proved::Later(settle) => {
                            *this.held = Some(Box::new(result));
                            this.state.set(State::Settling { settle });
                            continue;
                        }
                    };
                    if let Some(result) = this.decide(result, unprocessed) {
                        return Poll::Ready(result);
                    }
                }
                StateProj::Settling { settle } => {
                    let unprocessed = ready!(settle.as_mut().poll(cx));
                    this.state.set(State::Deciding);
                    let Some(result) = this.held.take() else {
                        unreachable!("settling without the attempt's outcome");
                    };
                    if let Some(result) = this.decide(*result, unprocessed) {
                        return Poll::Ready(result);
                    }
                }
                StateProj::Waiting { wait } => {
                    ready!(wait.poll(cx));
                    if let (Some(held), Some(policy), Some(copy)) =
                        (this.held.as_mut(), this.policy.as_mut(), this.copy.as_mut())
                    {
                        match policy.release(copy, held) {
                            Release::Send => {}
                            Release::Wait(wait) => {
                                this.state.set(State::Waiting { wait });
                                continue;
                            }
                            Release::GiveUp => {
                                let Some(held) = this.held.take() else {
                                    unreachable!("a gated retry without its outcome");
                                };
                                this.state.set(State::Deciding);
                                return Poll::Ready(*held);
                            }
                        }
                        *this.held = None;
                    }
                    this.state.set(State::Retrying);
                }
                StateProj::Deciding => {
                    // Between an attempt's end and the policy's answer, within one poll,
                    // and once an outcome was handed back: a future polled after it
                    // completed stays pending (and sends nothing).
                    return Poll::Pending;
                }
                StateProj::Retrying => {
                    let core = &**this.core;
                    let retries = this.retries.get_or_insert_with(|| Box::new(core.service()));
                    if let Err(error) = ready!(retries.poll_ready(cx)) {
                        this.state.set(State::Deciding);
                        return Poll::Ready(Err(error));
                    }
                    // The policy asked for a retry, which it does only with a copy.
                    let (Some(request), Some(policy)) = (this.copy.take(), this.policy.as_mut())
                    else {
                        unreachable!("a retry without a copy of the request");
                    };
                    *this.copy = Policy::<Request<B>, Response<ResB>, S::Error>::clone_request(
                        &mut **policy,
                        &request,
                    );
                    let mut request = request;
                    if this.copy.is_some() {
                        *this.handoff = core.track(&mut request);
                    }
                    let future = retries.call(request);
                    this.state.set(State::Called { future });
                }
            }
        }
    }
}

impl<S, B, ResB> ResponseFutureProj<'_, S, B>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    S::Error: 'static,
    B: Clone,
{
    /// The policy's decision on an attempt's outcome (`unprocessed`: the attempt proved
    /// its request unprocessed): the outcome to hand back, or `None` with the state set
    /// to the wait before the next attempt.
    fn decide(
        &mut self,
        mut result: Result<Response<ResB>, S::Error>,
        unprocessed: bool,
    ) -> Option<Result<Response<ResB>, S::Error>> {
        let Some(copy) = self.copy.as_mut() else {
            return Some(result);
        };
        // A first attempt's plain success never gets here (`poll` hands it back).
        let policy = match self.policy {
            Some(policy) => policy,
            None => self.policy.insert(Box::new(
                self.core.policy.sent_at(*self.sent, self.core.total),
            )),
        };
        if unprocessed {
            policy.attempt_unprocessed();
        }
        match Policy::<Request<B>, Response<ResB>, S::Error>::retry(
            &mut **policy,
            copy,
            &mut result,
        ) {
            Some(wait) => {
                if policy.is_gated() {
                    // Kept to be handed back if the gate does not let the retry through.
                    *self.held = Some(Box::new(result));
                }
                self.state.set(State::Waiting { wait });
                None
            }
            None => Some(result),
        }
    }
}
