use std::fmt;
use std::marker::PhantomData;
use std::task::{Context, Poll};

use http::Request;
use tower_layer::Layer;
use tower_service::Service;

use super::{Retry, RetryPolicy};
use crate::body::ReplayBody;

/// Marker for a [`RetryLayer`] that clones request bodies (they must be `Clone`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CloneBodies;

/// Marker for a [`RetryLayer`] that wraps request bodies in [`ReplayBody`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplayBodies;

/// Retries requests by a [`RetryPolicy`]: `.layer(RetryLayer::new(policy))`.
///
/// Put it outermost in a client stack, so that there is one retry point: above the
/// circuit breaker (whose fail-fast errors it retries only when the break ends before its
/// next backoff wait would anyway) and above the per-attempt
/// timeout (so a stalled attempt becomes a retry).
///
/// `RetryLayer::new` makes [`Retry`] services, which clone each request
/// body: right for `String`, `Full<Bytes>`, `Empty` and other `Clone` bodies, at no
/// buffering cost. For streaming bodies (tonic's, hyper's `Incoming`) use
/// [`replay_bodies`](RetryLayer::replay_bodies): the inner service then receives
/// `Request<ReplayBody<B>>`.
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use stormguard::{RetryLayer, RetryPolicy};
/// use tower::{service_fn, ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower::BoxError> {
/// let upstream = service_fn(|_req: http::Request<Full<Bytes>>| async {
///     Ok::<_, tower::BoxError>(http::Response::new(String::from("hello")))
/// });
/// let client = ServiceBuilder::new()
///     .layer(RetryLayer::new(RetryPolicy::default()))
///     .timeout(Duration::from_secs(2))
///     .service(upstream);
/// let response = client.oneshot(http::Request::new(Full::from("hi"))).await?;
/// assert_eq!(response.into_body(), "hello");
/// # Ok(())
/// # }
/// ```
pub struct RetryLayer<M = CloneBodies> {
    policy: RetryPolicy,
    total: Option<std::time::Duration>,
    _mode: PhantomData<fn() -> M>,
}

impl RetryLayer {
    /// A layer retrying by `policy`, cloning request bodies.
    pub const fn new(policy: RetryPolicy) -> Self {
        RetryLayer {
            policy,
            total: None,
            _mode: PhantomData,
        }
    }

    /// The same layer, wrapping every request body in a [`ReplayBody`] capped at the
    /// policy's `max_replay_bytes`, so that streaming bodies can be retried.
    ///
    /// With tonic, whose `Channel` takes `tonic::body::Body`, add one line below it:
    /// `.map_request(|r: http::Request<ReplayBody<Body>>| r.map(Body::new))`.
    pub fn replay_bodies(self) -> RetryLayer<ReplayBodies> {
        RetryLayer {
            policy: self.policy,
            total: self.total,
            _mode: PhantomData,
        }
    }
}

impl<M> RetryLayer<M> {
    /// The policy the layer's services retry by.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Tells the layer the total timeout above it (what its caller waits at most, from
    /// a request's first send): no retry is scheduled that would start past it, and a
    /// gRPC call's `grpc-timeout` says what is left of it. A request's own [`Deadline`]
    /// (or `grpc-timeout`), if earlier, still wins. [`StandardStack`] does this for its
    /// own total timeout.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stormguard::{RetryLayer, RetryPolicy};
    /// use tower::ServiceBuilder;
    /// # let upstream = tower::service_fn(|_: http::Request<String>| async {
    /// #     Ok::<_, tower::BoxError>(http::Response::new(String::new()))
    /// # });
    /// let total = Duration::from_secs(5);
    /// let client = ServiceBuilder::new()
    ///     .timeout(total)
    ///     .layer(RetryLayer::new(RetryPolicy::default()).total_timeout(total))
    ///     .timeout(Duration::from_secs(1))
    ///     .service(upstream);
    /// # let _ = client;
    /// ```
    ///
    /// [`Deadline`]: crate::Deadline
    /// [`StandardStack`]: crate::StandardStack
    pub fn total_timeout(mut self, total: std::time::Duration) -> Self {
        self.total = Some(total);
        self
    }
}

impl<M> Clone for RetryLayer<M> {
    fn clone(&self) -> Self {
        RetryLayer {
            policy: self.policy.clone(),
            total: self.total,
            _mode: PhantomData,
        }
    }
}

impl<M> fmt::Debug for RetryLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("policy", &self.policy)
            .field("total", &self.total)
            .field("mode", &std::any::type_name::<M>())
            .finish()
    }
}

impl<S: Clone> Layer<S> for RetryLayer<CloneBodies> {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry::within(self.policy.clone(), inner, self.total)
    }
}

impl<S: Clone> Layer<S> for RetryLayer<ReplayBodies> {
    type Service = ReplayRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReplayRetry::within(self.policy.clone(), inner, self.total)
    }
}

/// A retrying service that makes request bodies replayable first; made by
/// [`RetryLayer::replay_bodies`].
#[derive(Clone, Debug)]
pub struct ReplayRetry<S> {
    max_bytes: usize,
    retry: Retry<S>,
}

impl<S: Clone> ReplayRetry<S> {
    /// Replays bodies for `policy`'s retries of calls to `inner`, no retry scheduled past
    /// `total` after a request's first send.
    pub(crate) fn within(
        policy: RetryPolicy,
        inner: S,
        total: Option<std::time::Duration>,
    ) -> Self {
        ReplayRetry {
            max_bytes: policy.max_replay_bytes(),
            retry: Retry::within(policy, inner, total),
        }
    }
}

impl<S, B> Service<Request<B>> for ReplayRetry<S>
where
    Retry<S>: Service<Request<ReplayBody<B>>>,
    B: Send + 'static,
{
    type Response = <Retry<S> as Service<Request<ReplayBody<B>>>>::Response;
    type Error = <Retry<S> as Service<Request<ReplayBody<B>>>>::Error;
    type Future = <Retry<S> as Service<Request<ReplayBody<B>>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.retry.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let body = ReplayBody::new(body, self.max_bytes);
        parts.extensions.insert(body.handle());
        self.retry.call(Request::from_parts(parts, body))
    }
}
