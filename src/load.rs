//! Load control: keep the calls in flight to a dependency near what it serves in time,
//! and shed the rest before they are sent.
//!
//! When a dependency is saturated, every call past its capacity waits in its queue, and
//! once that wait outlasts the callers' timeouts it spends its capacity on answers
//! nobody waits for, while the callers hold their requests until they time out.
//! [`LoadControlLayer`] keeps the calls in flight near what the dependency
//! serves without a queue (Little's law), adapting the limit from each call's latency,
//! timeouts and overload answers ([`sans_io::limit`](crate::sans_io::limit) has the
//! rules and why); a call past the limit waits for room, up to
//! [`max_wait`](LoadControlBuilder::max_wait) (100 ms), and is then **shed**: never
//! sent, failed with [`Shed`], which the retry layer does not retry. While the limit is
//! still a guess (a new client's, or one that has let go after an incident), doubling
//! while calls wait at it, a call past it waits longer, up to sixteen of the
//! dependency's latency floors, so that a burst to a healthy dependency is not shed:
//! see [`LoadLimit::wait_for_room`](crate::sans_io::limit::LoadLimit::wait_for_room).
//! In the [standard stack](crate::stack), no call waits for room longer than the
//! attempt timeout.
//!
//! It reads these signals:
//!
//! | the call ended with | reads as |
//! |---|---|
//! | an answer (2xx, 3xx, 4xx but 429) | a latency sample |
//! | 429, gRPC `RESOURCE_EXHAUSTED`, `x-envoy-overloaded`, a Finagle nack | overload: the limit is cut |
//! | a timeout anywhere in the error's sources (tower's `Elapsed`, a reqwest or hyper timeout, an `io::Error` of kind `TimedOut`) | overload: the limit is cut |
//! | any other 5xx, any other error, an open circuit | nothing (not a load signal) |
//!
//! A bare 5xx says nothing of load: a dependency that is down, or failing some of its
//! calls, answers with the same 503 as one whose queue is full, and a limit cut by those
//! would turn a partial outage into lost calls. In a healthy system the limit stays
//! about twice what the calls in flight need and nothing waits.
//!
//! The [standard stack](crate::stack) puts it between the retry layer and the breaker,
//! so that a shed call is never counted by the breaker as the dependency's failure, and
//! the attempt timeout below it is what it reads as a timeout (the reqwest middleware
//! does the same with `StormguardMiddleware::with_load_control`, feature `reqwest`):
//!
//! ```
//! # async fn run() -> Result<(), stormguard::BoxError> {
//! use std::time::Duration;
//! use stormguard::load::{LoadControl, LoadControlLayer, Shed};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! let control = LoadControl::builder().name("search").build()?;
//! let service = ServiceBuilder::new()
//!     .layer(LoadControlLayer::new(control.clone()))
//!     .timeout(Duration::from_secs(2))
//!     .service(service_fn(|_req: http::Request<String>| async {
//!         Ok::<_, stormguard::BoxError>(http::Response::new(String::new()))
//!     }));
//! let response = service.oneshot(http::Request::new(String::new())).await?;
//! assert_eq!(response.status(), 200);
//! assert_eq!(control.stats().shed, 0);
//! # let _: Option<&Shed> = None;
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{HeaderMap, Request, Response, StatusCode};
use pin_project_lite::pin_project;
use stormguard_core::limit::{self, LimitPermit, Load, LoadLimitBuilder};
use stormguard_core::ConfigError;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;
use tokio::time::Sleep;
use tower_layer::Layer;
use tower_service::Service;

use crate::error_class::is_timeout;
pub use crate::shed::Shed;
use crate::BoxError;

fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// One dependency's load control, shared by `Clone`: the adaptive limit, the calls
/// waiting for room, and the counters.
#[derive(Clone)]
pub struct LoadControl {
    limit: limit::LoadLimit,
    shared: Arc<Shared>,
}

struct Shared {
    name: String,
    /// Woken when a place is given back.
    room: Arc<Notify>,
    /// The calls waiting for room now: a place given back wakes one only when there
    /// is one.
    waiting: AtomicUsize,
    shed: AtomicU64,
    waited: AtomicU64,
}

/// What a [`LoadControl`] has done, from [`LoadControl::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadStats {
    /// The limit now.
    pub limit: u32,
    /// The calls in flight now.
    pub in_flight: u32,
    /// Calls shed: never sent.
    pub shed: u64,
    /// Calls that waited for room (and were sent, or shed).
    pub waited: u64,
    /// The latency floor, once a call has been served.
    pub floor: Option<Duration>,
}

impl Default for LoadControl {
    fn default() -> Self {
        LoadControl::new(limit::LoadLimit::default(), "")
    }
}

impl fmt::Debug for LoadControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadControl")
            .field("name", &self.shared.name)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl LoadControl {
    /// A builder with the defaults (see [`LoadControlBuilder`]).
    pub fn builder() -> LoadControlBuilder {
        LoadControlBuilder::default()
    }

    /// A load control named `name` with settings read elsewhere (a
    /// [`Config`](crate::Config)'s `load_control` section).
    pub fn with_config(name: &str, config: limit::LoadLimitConfig) -> Self {
        LoadControl::new(limit::LoadLimit::with_config(config), name)
    }

    fn new(limit: limit::LoadLimit, name: &str) -> Self {
        LoadControl {
            limit,
            shared: Arc::new(Shared {
                // Unnamed, it reports as the retry policy and the breaker do.
                name: if name.is_empty() { "default" } else { name }.to_owned(),
                room: Arc::new(Notify::new()),
                waiting: AtomicUsize::new(0),
                shed: AtomicU64::new(0),
                waited: AtomicU64::new(0),
            }),
        }
    }

    /// The dependency's name (the `service` label of its metrics).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The limit and its settings.
    pub fn limit(&self) -> &limit::LoadLimit {
        &self.limit
    }

    /// The counters and the limit now.
    pub fn stats(&self) -> LoadStats {
        LoadStats {
            limit: self.limit.limit(),
            in_flight: self.limit.in_flight(),
            shed: self.shared.shed.load(Ordering::Relaxed),
            waited: self.shared.waited.load(Ordering::Relaxed),
            floor: self.limit.floor(),
        }
    }

    /// How a call gets in: a place now, a wait for one (of `longest` at most), or shed
    /// at once when the control does not wait.
    fn admit(&self, longest: Duration) -> Admission {
        let full = match self.limit.try_acquire(now()) {
            Ok(permit) => return Admission::Place(self.place(permit)),
            Err(full) => full,
        };
        match self.limit.wait_for_room(Duration::ZERO, longest) {
            Some(first) => Admission::Wait(Waiter::new(self.clone(), first, longest)),
            None => Admission::Shed(self.shed(full)),
        }
    }

    /// A place for one call, after a wait for room (up to `max_wait`, longer while the
    /// limit is still a guess, never longer than `longest`), or the call shed: the
    /// reqwest middleware's way in (the tower service's future drives the same
    /// [`Waiter`]).
    #[cfg(feature = "reqwest")]
    pub(crate) async fn enter(&self, longest: Duration) -> Result<Place, Shed> {
        match self.admit(longest) {
            Admission::Place(place) => Ok(place),
            Admission::Shed(shed) => Err(shed),
            Admission::Wait(mut waiter) => std::future::poll_fn(|cx| waiter.poll_place(cx)).await,
        }
    }

    fn place(&self, permit: LimitPermit) -> Place {
        Place {
            permit: Some(permit),
            shared: self.shared.clone(),
        }
    }

    fn shed(&self, full: limit::Full) -> Shed {
        self.shared.shed.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!("load_control_shed_total", "service" => self.shared.name.clone())
            .increment(1);
        tracing::debug!(
            target: "stormguard::load",
            limit = full.limit,
            in_flight = full.in_flight,
            "load shed"
        );
        Shed::new(full.limit, full.in_flight)
    }
}

/// Builds a [`LoadControl`]; every setting has a default.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct LoadControlBuilder {
    limit: LoadLimitBuilder,
    name: String,
}

impl LoadControlBuilder {
    /// The dependency's name, the `service` label of its metrics \[`"default"`\].
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    /// The limit it starts at \[100\].
    pub fn initial(mut self, calls: u32) -> Self {
        self.limit = self.limit.initial(calls);
        self
    }

    /// The lowest the limit goes \[4\]; at least 1.
    pub fn min(mut self, calls: u32) -> Self {
        self.limit = self.limit.min(calls);
        self
    }

    /// The highest the limit goes \[1000\]: for a dependency that must never see more
    /// calls at once from this client, set it to that.
    pub fn max(mut self, calls: u32) -> Self {
        self.limit = self.limit.max(calls);
        self
    }

    /// How far above its floor the latency may be before it reads as a queue \[1.25\];
    /// above 1 and at most 10. The control raises it, up to 10, where the dependency's
    /// own spread of latencies read as a queue (a cut that cost as much throughput as it
    /// took calls, and after which the latency was shorter).
    pub fn tolerance(mut self, ratio: f64) -> Self {
        self.limit = self.limit.tolerance(ratio);
        self
    }

    /// How long a call may wait for room before it is shed \[100 ms\]; zero sheds at
    /// once. Keep it below the attempt timeout: a call that waits longer than an
    /// answer takes is better failed for the caller to fall back.
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.limit = self.limit.max_wait(wait);
        self
    }

    /// The load control, or what contradicts.
    pub fn build(self) -> Result<LoadControl, ConfigError> {
        Ok(LoadControl::new(self.limit.build()?, &self.name))
    }
}

/// Applies a [`LoadControl`] to a service: see the [module docs](self).
#[derive(Debug, Clone, Default)]
pub struct LoadControlLayer {
    control: LoadControl,
}

impl LoadControlLayer {
    /// A layer whose services share `control`.
    pub fn new(control: LoadControl) -> Self {
        LoadControlLayer { control }
    }
}

impl<S> Layer<S> for LoadControlLayer {
    type Service = LoadControlService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LoadControlService::new(inner, self.control.clone())
    }
}

/// The service made by [`LoadControlLayer`]: sends a call when the limit has room,
/// waits for room up to the control's `max_wait` (longer while its limit is still a
/// guess), and sheds it otherwise.
///
/// # Clone
///
/// Clones share the load control (and clone the inner service).
#[derive(Clone, Debug)]
pub struct LoadControlService<S> {
    inner: S,
    control: LoadControl,
    /// The longest a call waits for room in all, whatever the limit allows: the
    /// standard stack's attempt timeout.
    longest_wait: Duration,
}

impl<S> LoadControlService<S> {
    /// Wraps `inner` with `control`.
    pub fn new(inner: S, control: LoadControl) -> Self {
        LoadControlService {
            inner,
            control,
            longest_wait: Duration::MAX,
        }
    }

    /// A call waits for room no longer than `wait` in all, even while the limit is
    /// still a guess (the standard stack's attempt timeout).
    pub(crate) fn waiting_at_most(mut self, wait: Duration) -> Self {
        self.longest_wait = wait;
        self
    }

    /// The load control this service reports to.
    pub fn control(&self) -> &LoadControl {
        &self.control
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResB> Service<Request<B>> for LoadControlService<S>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError> + 'static,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S, Request<B>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let state = match self.control.admit(self.longest_wait) {
            // The place exists before the inner call, so a `call` that panics gives it
            // back as it unwinds.
            Admission::Place(place) => State::Called {
                future: self.inner.call(request),
                place: Some(place),
            },
            Admission::Shed(shed) => State::Shed { shed: Some(shed) },
            Admission::Wait(waiter) => {
                // The ready service goes with the call; this one keeps a clone.
                let clone = self.inner.clone();
                let service = std::mem::replace(&mut self.inner, clone);
                State::Waiting {
                    wait: Box::new(Wait {
                        service,
                        request: Some(request),
                        waiter,
                    }),
                }
            }
        };
        ResponseFuture { state }
    }
}

/// A registration for the next place given back, enabled at once so that a place given
/// back before it is polled is not missed.
fn registered(room: &Arc<Notify>) -> Pin<Box<OwnedNotified>> {
    let mut notified = Box::pin(room.clone().notified_owned());
    notified.as_mut().enable();
    notified
}

/// A call's place: gives it back, and wakes a call waiting for room, when dropped.
pub(crate) struct Place {
    permit: Option<LimitPermit>,
    shared: Arc<Shared>,
}

impl Place {
    /// Gives the place back with what the call's outcome says of the load.
    pub(crate) fn complete(mut self, load: Load) {
        if let Some(permit) = self.permit.take() {
            permit.complete(load, now());
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        drop(self.permit.take());
        // Either this sees the waiter counted, or the waiter, counted before it looks,
        // sees the place given back (the fences order the two sides' store and load).
        fence(Ordering::SeqCst);
        if self.shared.waiting.load(Ordering::SeqCst) > 0 {
            // The newest waiter first (LIFO): in a sustained overload the oldest
            // waiters are the likeliest to be shed anyway, and the newest to still be
            // waited for.
            self.shared.room.notify_last();
        }
    }
}

/// How a call gets in: see [`LoadControl::admit`].
enum Admission {
    Place(Place),
    Wait(Waiter),
    Shed(Shed),
}

/// A call waiting for room, counted in `Shared::waiting` while it lives (before it
/// first looks for room again: see `Place`'s drop).
struct Waiter {
    control: LoadControl,
    room: Pin<Box<OwnedNotified>>,
    deadline: Pin<Box<Sleep>>,
    /// When the call was first refused: its first deadline less its first wait.
    since: tokio::time::Instant,
    /// The longest it waits in all, whatever the limit allows.
    longest: Duration,
}

impl Waiter {
    /// A call that waits `first` (what the limit allows a call that has not waited yet),
    /// then asks the limit again, `longest` at most in all.
    fn new(control: LoadControl, first: Duration, longest: Duration) -> Self {
        control.shared.waited.fetch_add(1, Ordering::Relaxed);
        control.shared.waiting.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let deadline = Box::pin(tokio::time::sleep(first));
        let since = deadline.deadline().checked_sub(first);
        Waiter {
            room: registered(&control.shared.room),
            since: since.unwrap_or_else(|| deadline.deadline()),
            deadline,
            control,
            longest,
        }
    }

    /// A place once one is given back, or the call shed once it has waited as long as
    /// the limit allows ([`LoadLimit::wait_for_room`](limit::LoadLimit::wait_for_room),
    /// asked again at each `max_wait`), and no longer than `longest`.
    fn poll_place(&mut self, cx: &mut Context<'_>) -> Poll<Result<Place, Shed>> {
        loop {
            let full = match self.control.limit.try_acquire(now()) {
                Ok(permit) => return Poll::Ready(Ok(self.control.place(permit))),
                Err(full) => full,
            };
            if self.room.as_mut().poll(cx).is_ready() {
                self.room = registered(&self.control.shared.room);
                continue;
            }
            ready!(self.deadline.as_mut().poll(cx));
            let due = self.deadline.deadline();
            let waited = due.saturating_duration_since(self.since);
            match self.control.limit.wait_for_room(waited, self.longest) {
                // Held back by a limit still learning, not by the dependency.
                Some(more) => self
                    .deadline
                    .as_mut()
                    .reset(due.checked_add(more).unwrap_or(due)),
                None => return Poll::Ready(Err(self.control.shed(full))),
            }
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.control.shared.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A call waiting for room with its service and request (boxed: only calls that wait
/// pay for it).
struct Wait<S, Req> {
    service: S,
    request: Option<Req>,
    waiter: Waiter,
}

pin_project! {
    /// The future of a [`LoadControlService`] call.
    pub struct ResponseFuture<S, Req>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S, Req>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, Req>
    where
        S: Service<Req>,
    {
        Called {
            #[pin]
            future: S::Future,
            place: Option<Place>,
        },
        Waiting {
            wait: Box<Wait<S, Req>>,
        },
        Shed {
            shed: Option<Shed>,
        },
    }
}

impl<S, Req> fmt::Debug for ResponseFuture<S, Req>
where
    S: Service<Req>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, Req, ResB> Future for ResponseFuture<S, Req>
where
    S: Service<Req, Response = Response<ResB>>,
    S::Error: Into<BoxError> + 'static,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Called { future, place } => {
                    let result = ready!(future.poll(cx));
                    if let Some(place) = place.take() {
                        place.complete(load_of(result.as_ref().map(|r| (r.status(), r.headers()))));
                    }
                    return Poll::Ready(result.map_err(Into::into));
                }
                StateProj::Shed { shed } => {
                    let shed = shed.take().unwrap_or_else(|| Shed::new(0, 0));
                    return Poll::Ready(Err(shed.into()));
                }
                StateProj::Waiting { wait } => {
                    let next = match ready!(wait.waiter.poll_place(cx)) {
                        Ok(place) => match wait.request.take() {
                            Some(request) => State::Called {
                                future: wait.service.call(request),
                                place: Some(place),
                            },
                            None => State::Shed { shed: None },
                        },
                        Err(shed) => State::Shed { shed: Some(shed) },
                    };
                    this.state.set(next);
                }
            }
        }
    }
}

/// How a call's outcome (its answer's status and headers, or its error) reads to the
/// load control (the module docs' table); the reqwest middleware's too.
pub(crate) fn load_of<E: 'static>(outcome: Result<(StatusCode, &HeaderMap), &E>) -> Load {
    match outcome {
        Ok((status, headers)) => Load::of_response(status, headers),
        Err(err) if is_timeout(err) => Load::Overloaded,
        // A connection error, an open circuit, a call shed further down: not load.
        Err(_) => Load::Unrelated,
    }
}
