//! The retrying service, [`Retry`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::Handoff;
use super::RetryPolicy;

/// Retries requests by a [`RetryPolicy`]; made by [`RetryLayer::new`](super::RetryLayer).
///
/// It asks the policy what tower's [`tower::retry::Retry`] would (the policy is a
/// [`tower::retry::Policy`], usable there too): a copy of each request is kept before it
/// is sent, and each outcome that is not a plain success is handed to the policy, which
/// answers with the wait before the next attempt or hands the outcome back. Unlike
/// tower's, it does not clone the inner service for every call in case the call is
/// retried: the retries of a request go through a clone made at its first retry. With
/// hyper-util's client below, that clone costs more than the rest of the success path
/// together (about 60 ns here, against 15 ns for an `Arc`).
///
/// # Clone
///
/// Clones share the policy's configuration, budget and counters, and the copy of the
/// inner service that retries are sent through (all behind one `Arc`); each clone has
/// its own inner service for first attempts. The copy is the service as the layer
/// wrapped it; every clone of a service from tower, hyper, hyper-util or tonic shares
/// its connections, so a retry goes where a first attempt would.
pub struct Retry<S> {
    core: Arc<Core<S>>,
    inner: S,
}

/// What every clone of a [`Retry`] and every response future of theirs share.
pub(super) struct Core<S> {
    pub(super) policy: RetryPolicy,
    /// What the caller waits at most, from the first send, when a total timeout above
    /// says so (the standard stack's): the request's deadline, unless it has an
    /// earlier one. Read at a request's first failure, so a success pays nothing.
    pub(super) total: Option<Duration>,
    /// The inner service as the layer wrapped it, cloned for each request that retries.
    /// The lock is held only while cloning.
    retries: Mutex<S>,
    /// Whether the client below tracks its connections ([`crate::connect`]).
    #[cfg(feature = "hyper-util")]
    pub(super) tracking: super::handoff::Tracking,
}

impl<S> Core<S> {
    /// Tracks an attempt of `request` that may be retried ([`crate::connect`]).
    pub(super) fn track<B>(&self, request: &mut Request<B>) -> Option<Box<Handoff>> {
        #[cfg(feature = "hyper-util")]
        return self.tracking.attach(request);
        #[cfg(not(feature = "hyper-util"))]
        {
            let _ = request;
            None
        }
    }

    /// What a tracked attempt that ended with `result` proves of its request
    /// ([`Handoff::unprocessed`]); a response teaches the layer whether the client tracks
    /// connections. Kept out of line: the success path's poll stays as it was without
    /// tracking.
    #[cold]
    #[inline(never)]
    pub(super) fn proved_unprocessed<R, E: 'static>(
        &self,
        handoff: &Handoff,
        result: &Result<Response<R>, E>,
    ) -> Proved {
        #[cfg(feature = "hyper-util")]
        return match result {
            Ok(res) => {
                self.tracking.learn(res);
                Proved::No
            }
            Err(err) => handoff.unprocessed(
                // The built-in rules' reading (a proof is theirs), through an error type
                // named to the policy too.
                (self.policy.shared.classifiers)
                    .as_error(err)
                    .map_or(crate::error_class::ErrorClass::Unknown, |err| {
                        crate::error_class::classify_chain(err)
                    }),
                &self.tracking,
                // Waited for at most as long as the first retry's backoff could be.
                self.policy.shared.backoff.ceiling(0),
            ),
        };
        #[cfg(not(feature = "hyper-util"))]
        {
            let _ = result;
            match *handoff {}
        }
    }
}

/// What a failed attempt proved of its request ([`Core::proved_unprocessed`]).
pub(super) enum Proved {
    /// It was not processed.
    #[cfg_attr(not(feature = "hyper-util"), allow(dead_code))]
    Yes,
    /// Nothing.
    No,
    /// Whether it was not processed, once the connection it used has settled.
    #[cfg_attr(not(feature = "hyper-util"), allow(dead_code))]
    Later(Pin<Box<dyn Future<Output = bool> + Send>>),
}

impl<S: Clone> Core<S> {
    /// A service to send a request's retries through.
    pub(super) fn service(&self) -> S {
        self.retries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl<S: Clone> Retry<S> {
    /// A service retrying calls to `inner` by `policy`.
    pub fn new(policy: RetryPolicy, inner: S) -> Self {
        Retry::within(policy, inner, None)
    }

    /// A service retrying calls to `inner` by `policy`, no retry scheduled past `total`
    /// after a request's first send (the total timeout above it).
    pub(crate) fn within(policy: RetryPolicy, inner: S, total: Option<Duration>) -> Self {
        Retry {
            core: Arc::new(Core {
                policy,
                total,
                retries: Mutex::new(inner.clone()),
                #[cfg(feature = "hyper-util")]
                tracking: super::handoff::Tracking::default(),
            }),
            inner,
        }
    }
}

impl<S> Retry<S> {
    /// The policy the service retries by.
    pub fn policy(&self) -> &RetryPolicy {
        &self.core.policy
    }

    /// The inner service first attempts go to.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service first attempts go to, mutably. Retries go through a clone of
    /// the service as the layer wrapped it, which changes made here do not reach.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service first attempts go to, consuming the retry.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone> Clone for Retry<S> {
    fn clone(&self) -> Self {
        Retry {
            core: Arc::clone(&self.core),
            inner: self.inner.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Retry<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("policy", &self.core.policy)
            .field("inner", &self.inner)
            .finish()
    }
}

impl<S, B, ResB> Service<Request<B>> for Retry<S>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    S::Error: 'static,
    B: Clone,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let sent = tokio::time::Instant::now().into_std();
        let copy = self
            .core
            .policy
            .shared
            .first_send(&request, sent)
            .then(|| request.clone());
        let handoff = copy.as_ref().and_then(|_| self.core.track(&mut request));
        let future = self.inner.call(request);
        ResponseFuture::new(Arc::clone(&self.core), copy, sent, future, handoff)
    }
}
