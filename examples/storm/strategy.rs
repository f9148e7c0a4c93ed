//! The strategies (the rows): each builds one client's stack.

use std::collections::hash_map::DefaultHasher;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use stormguard::breaker::ResponseBody;
use stormguard::{
    Backoff, BoxError, CircuitBreaker, Jitter, RetryBudget, RetryLayer, RetryPolicy, StandardStack,
};
use tokio::time::Sleep;
use tower::retry::backoff::{
    Backoff as _, ExponentialBackoff, ExponentialBackoffMaker, MakeBackoff,
};
use tower::retry::budget::{Budget as _, TpsBudget};
use tower::retry::{Policy, Retry};
use tower::timeout::TimeoutLayer;
use tower::util::rng::HasherRng;
use tower::util::BoxCloneService;
use tower::ServiceBuilder;

use crate::scenario::Scenario;
use crate::server::splitmix64;
use crate::{HttpClient, Req, Res, Stack, ATTEMPT_TIMEOUT};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    None,
    Naive,
    Unlimited,
    Tower,
    Stormguard,
    AccVegas,
    AccGradient2,
    AdaptiveAimd,
    AdaptiveVegas,
}

impl Kind {
    pub(crate) const ALL: [Kind; 9] = [
        Kind::None,
        Kind::Naive,
        Kind::Unlimited,
        Kind::Tower,
        Kind::Stormguard,
        Kind::AccVegas,
        Kind::AccGradient2,
        Kind::AdaptiveAimd,
        Kind::AdaptiveVegas,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::None => "none",
            Kind::Naive => "naive",
            Kind::Unlimited => "unlimited",
            Kind::Tower => "tower",
            Kind::Stormguard => "stormguard",
            Kind::AccVegas => "acc-vegas",
            Kind::AccGradient2 => "acc-gradient2",
            Kind::AdaptiveAimd => "adaptive-aimd",
            Kind::AdaptiveVegas => "adaptive-vegas",
        }
    }

    /// A peer's adaptive limiter, run only where load is the question.
    pub(crate) fn is_peer(self) -> bool {
        matches!(
            self,
            Kind::AccVegas | Kind::AccGradient2 | Kind::AdaptiveAimd | Kind::AdaptiveVegas
        )
    }
}

/// A strategy's state (budgets, breakers, counters), shared by the clients that use it.
#[derive(Debug)]
pub(crate) enum Strategy {
    None,
    Naive,
    Tower {
        budget: Arc<TpsBudget>,
        backoff: ExponentialBackoffMaker<HasherRng<SeededHasher>>,
    },
    Unlimited {
        policy: RetryPolicy,
    },
    Stormguard {
        stack: StandardStack,
    },
    /// A peer's limiter under tower's retry: the limiter is built over the first
    /// client's service and shared (cloned) by every client.
    Peer {
        kind: Kind,
        budget: Arc<TpsBudget>,
        backoff: ExponentialBackoffMaker<HasherRng<SeededHasher>>,
        limited: Mutex<Option<Stack>>,
    },
}

impl Strategy {
    pub(crate) fn new(kind: Kind, seed: u64) -> Result<Self, BoxError> {
        Ok(match kind {
            Kind::None => Strategy::None,
            Kind::Naive => Strategy::Naive,
            Kind::Tower => Strategy::Tower {
                // linkerd's and Finagle's defaults: 20% of requests plus 10 a second.
                budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
                backoff: ExponentialBackoffMaker::new(
                    Duration::from_millis(100),
                    Duration::from_secs(2),
                    0.99,
                    HasherRng::with_hasher(SeededHasher(seed)),
                )?,
            },
            // What retries can do: 3 attempts of full jitter 200 ms / 20 s and nothing
            // else, pinned whatever the defaults become.
            Kind::Unlimited => Strategy::Unlimited {
                policy: RetryPolicy::builder()
                    .max_attempts(3)
                    .backoff(Backoff::new(
                        Duration::from_millis(200),
                        Duration::from_secs(20),
                        Jitter::Full,
                    )?)
                    .budget(
                        RetryBudget::builder()
                            .ratio(1.0)
                            .allowance(u32::MAX)
                            .build()?,
                    )
                    .seed(seed)
                    .build()?,
            },
            // The standard stack with the library's defaults: only the seeds are set,
            // for reproducible jitter, and the storm's attempt timeout.
            Kind::Stormguard => Strategy::Stormguard {
                stack: StandardStack::builder("storm")
                    .retry(RetryPolicy::builder().seed(seed).build()?)
                    .breaker(CircuitBreaker::builder().seed(seed).build()?)
                    .attempt_timeout(ATTEMPT_TIMEOUT)
                    .build()?,
            },
            kind => Strategy::Peer {
                kind,
                budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
                backoff: ExponentialBackoffMaker::new(
                    Duration::from_millis(100),
                    Duration::from_secs(2),
                    0.99,
                    HasherRng::with_hasher(SeededHasher(seed)),
                )?,
                limited: Mutex::new(None),
            },
        })
    }

    /// One client's service stack over `client`; the per-attempt timeout is innermost.
    pub(crate) fn stack(&self, client: HttpClient, scenario: &Scenario) -> Stack {
        let timeout = TimeoutLayer::new(scenario.attempt_timeout);
        let http = tower::service_fn(move |req: Req| {
            let client = client.clone();
            async move {
                let (parts, body) = client.request(req).await?.into_parts();
                let body = body.collect().await?.to_bytes();
                Ok::<_, BoxError>(Response::from_parts(parts, body))
            }
        });
        match self {
            Strategy::None => {
                BoxCloneService::new(ServiceBuilder::new().layer(timeout).service(http))
            }
            Strategy::Naive => BoxCloneService::new(Retry::new(
                NaivePolicy::new(5, Duration::from_millis(50)),
                ServiceBuilder::new().layer(timeout).service(http),
            )),
            Strategy::Tower { budget, backoff } => BoxCloneService::new(Retry::new(
                TowerPolicy::new(3, budget.clone(), backoff.clone().make_backoff()),
                ServiceBuilder::new().layer(timeout).service(http),
            )),
            Strategy::Unlimited { policy } => BoxCloneService::new(
                ServiceBuilder::new()
                    .layer(RetryLayer::new(policy.clone()))
                    .layer(timeout)
                    .service(http),
            ),
            Strategy::Stormguard { stack } => BoxCloneService::new(
                ServiceBuilder::new()
                    // The breaker's body (the bytes here, already read) unwrapped.
                    .map_response(|r: Response<ResponseBody<Bytes>>| {
                        r.map(ResponseBody::into_inner)
                    })
                    .service(stack.http(http)),
            ),
            Strategy::Peer {
                kind,
                budget,
                backoff,
                limited,
            } => {
                let mut shared = limited.lock().unwrap_or_else(|e| e.into_inner());
                let limited = shared
                    .get_or_insert_with(|| peer_limiter(*kind, http, timeout))
                    .clone();
                BoxCloneService::new(Retry::new(
                    TowerPolicy::new(3, budget.clone(), backoff.clone().make_backoff()),
                    limited,
                ))
            }
        }
    }

    /// stormguard's counters, summed into `into`.
    pub(crate) fn add_counters(&self, into: &mut Counters) {
        if let Strategy::Stormguard { stack } = self {
            let retry = stack.retry().stats();
            let breaker = stack.breaker().stats();
            into.retries += retry.retries;
            into.budget_denied += retry.budget_denied;
            into.rejected += breaker.rejected;
            into.transitions += breaker.transitions;
            into.shed += stack.load().stats().shed;
        }
    }
}

/// stormguard's own counters for one row, over every client's state (for `--series`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    pub(crate) retries: u64,
    pub(crate) budget_denied: u64,
    pub(crate) rejected: u64,
    pub(crate) transitions: u64,
    pub(crate) shed: u64,
}

/// A peer's limiter, with its crate's defaults, over the per-attempt timeout.
fn peer_limiter<S>(kind: Kind, http: S, timeout: TimeoutLayer) -> Stack
where
    S: tower::Service<Req, Response = Res, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let timed = ServiceBuilder::new().layer(timeout).service(http);
    match kind {
        Kind::AccVegas => BoxCloneService::new(tower_acc::ConcurrencyLimit::new(
            timed,
            tower_acc::Vegas::default(),
        )),
        Kind::AccGradient2 => BoxCloneService::new(tower_acc::ConcurrencyLimit::new(
            timed,
            tower_acc::Gradient2::default(),
        )),
        Kind::AdaptiveAimd => adaptive(timed, tower_resilience_adaptive::Aimd::builder().build()),
        Kind::AdaptiveVegas => adaptive(timed, tower_resilience_adaptive::Vegas::builder().build()),
        _ => BoxCloneService::new(timed),
    }
}

/// `tower-resilience-adaptive`'s limiter with `algorithm` (its builder's defaults).
fn adaptive<S, A, E>(timed: S, algorithm: Result<A, E>) -> Stack
where
    S: tower::Service<Req, Response = Res, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
    A: tower_resilience_adaptive::ConcurrencyAlgorithm + Send + Sync + 'static,
    E: std::fmt::Debug,
{
    match algorithm {
        Ok(algorithm) => BoxCloneService::new(
            ServiceBuilder::new()
                .map_err(
                    |err: tower_resilience_adaptive::AdaptiveError<BoxError>| match err {
                        tower_resilience_adaptive::AdaptiveError::Service(err) => err,
                        limit @ tower_resilience_adaptive::AdaptiveError::LimitReached => {
                            BoxError::from(limit.to_string())
                        }
                    },
                )
                .service(tower_resilience_adaptive::AdaptiveService::new(
                    timed,
                    Arc::new(algorithm),
                )),
        ),
        // The defaults are valid; were they not, the row would run unlimited.
        Err(_) => BoxCloneService::new(timed),
    }
}

/// The seed of client `index`'s own state in `fleet`: distinct per client, so that 200
/// clients do not draw the same jitter sequence in lockstep.
pub(crate) fn client_seed(seed: u64, index: u32) -> u64 {
    splitmix64(seed ^ (u64::from(index) << 32))
}

/// Copies a bodiless request for another attempt.
pub(crate) fn copy_request(req: &Req) -> Req {
    let mut copy = Request::new(*req.body());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.headers_mut() = req.headers().clone();
    copy
}

/// What the hand-rolled policies retry: any error, any 5xx.
pub(crate) fn failed<E>(result: &Result<Res, E>) -> bool {
    result
        .as_ref()
        .map_or(true, |res| res.status().is_server_error())
}

/// The retry policy people write by hand: a fixed number of attempts at a fixed
/// interval, no jitter, no budget.
#[derive(Debug, Clone)]
pub(crate) struct NaivePolicy {
    pub(crate) attempts_left: u32,
    pub(crate) interval: Duration,
}

impl NaivePolicy {
    pub(crate) fn new(max_attempts: u32, interval: Duration) -> Self {
        NaivePolicy {
            attempts_left: max_attempts - 1,
            interval,
        }
    }
}

impl<E> Policy<Req, Res, E> for NaivePolicy {
    type Future = Sleep;

    fn retry(&mut self, _req: &mut Req, result: &mut Result<Res, E>) -> Option<Sleep> {
        if !failed(result) || self.attempts_left == 0 {
            return None;
        }
        self.attempts_left -= 1;
        Some(tokio::time::sleep(self.interval))
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(copy_request(req))
    }
}

/// tower's own parts: an attempt cap, `ExponentialBackoff`, and a `TpsBudget` used the
/// way Finagle and linkerd use theirs (every original request deposits, every retry
/// withdraws).
///
/// Each request's copy of the policy starts from a clone of one `ExponentialBackoff`,
/// random generator included, so every request draws the same jitter sequence: that is
/// how tower's backoff behaves when shared this way, and part of what is compared.
#[derive(Debug, Clone)]
pub(crate) struct TowerPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) attempts: u32,
    pub(crate) budget: Arc<TpsBudget>,
    pub(crate) backoff: ExponentialBackoff<HasherRng<SeededHasher>>,
}

impl TowerPolicy {
    pub(crate) fn new(
        max_attempts: u32,
        budget: Arc<TpsBudget>,
        backoff: ExponentialBackoff<HasherRng<SeededHasher>>,
    ) -> Self {
        TowerPolicy {
            max_attempts,
            attempts: 0,
            budget,
            backoff,
        }
    }
}

impl<E> Policy<Req, Res, E> for TowerPolicy {
    type Future = Sleep;

    fn retry(&mut self, _req: &mut Req, result: &mut Result<Res, E>) -> Option<Sleep> {
        self.attempts += 1;
        if !failed(result) || self.attempts >= self.max_attempts || !self.budget.withdraw() {
            return None;
        }
        Some(self.backoff.next_backoff())
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        // `Retry::call` asks the service's own copy of the policy, whose count is
        // always 0, once per original request.
        if self.attempts == 0 {
            self.budget.deposit();
        }
        Some(copy_request(req))
    }
}

/// Seeds tower's `HasherRng`, so that `--seed` makes tower's jitter reproducible too.
#[derive(Debug, Clone)]
pub(crate) struct SeededHasher(u64);

impl BuildHasher for SeededHasher {
    type Hasher = DefaultHasher;

    fn build_hasher(&self) -> DefaultHasher {
        let mut hasher = DefaultHasher::new();
        hasher.write_u64(self.0);
        hasher
    }
}
