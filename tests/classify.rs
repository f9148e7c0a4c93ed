//! The classification seam (`stormguard::classify`): a user's own error type looked
//! into, a closure retrying a 409, a classifier changing what the breaker counts. Paused
//! time.

use std::collections::VecDeque;
use std::error::Error;
use std::sync::{Arc, Mutex};
use std::{fmt, io};

use http::{HeaderMap, Request, Response, StatusCode};
use stormguard::breaker::BreakerConfig;
use stormguard::classify::Classify;
use stormguard::sans_io::Class;
use stormguard::{
    Attempts, CircuitBreaker, CircuitBreakerLayer, CircuitOpen, RetryLayer, RetryPolicy,
};
use tower::{BoxError, Layer, Service, ServiceExt};

#[path = "support/budget.rs"]
mod budget;
#[path = "support/captured.rs"]
mod captured;

/// A user's own error type, as an application defines it: not boxed, not one the crate
/// knows.
#[derive(Debug)]
enum ApiError {
    Transport(io::Error),
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the inventory API failed")
    }
}

impl Error for ApiError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            ApiError::Transport(err) => Some(err),
        }
    }
}

type Script<E> = Arc<Mutex<VecDeque<Result<Response<String>, E>>>>;

/// A service answering each call with the next scripted outcome (a 200 once the script
/// is spent), counting the calls it got.
fn scripted<E: Send + 'static>(
    outcomes: Vec<Result<Response<String>, E>>,
) -> (
    impl Service<Request<String>, Response = Response<String>, Error = E, Future: Send> + Clone + Send,
    Arc<Mutex<u32>>,
) {
    let script: Script<E> = Arc::new(Mutex::new(outcomes.into()));
    let calls = Arc::new(Mutex::new(0));
    let counted = calls.clone();
    let service = tower::service_fn(move |_req: Request<String>| {
        *counted.lock().expect("lock") += 1;
        let next = script.lock().expect("lock").pop_front();
        async move { next.unwrap_or_else(|| Ok(status(200))) }
    });
    (service, calls)
}

/// Sends `request` through `policy`'s retry layer over a service scripted with
/// `outcomes`: what the caller got, and how many calls the service saw.
async fn through<E: Send + 'static>(
    policy: RetryPolicy,
    outcomes: Vec<Result<Response<String>, E>>,
    request: Request<String>,
) -> (Result<Response<String>, E>, u32) {
    let (service, calls) = scripted(outcomes);
    let outcome = RetryLayer::new(policy)
        .layer(service)
        .oneshot(request)
        .await;
    let calls = *calls.lock().expect("lock");
    (outcome, calls)
}

fn status(code: u16) -> Response<String> {
    Response::builder()
        .status(code)
        .body(String::new())
        .expect("response")
}

fn get() -> Request<String> {
    Request::get("http://inventory/items/7")
        .body(String::new())
        .expect("request")
}

fn reset() -> ApiError {
    ApiError::Transport(io::Error::from(io::ErrorKind::ConnectionReset))
}

fn policy() -> stormguard::retry::RetryPolicyBuilder {
    RetryPolicy::builder().budget(budget::roomy()).seed(3)
}

#[tokio::test(start_paused = true)]
async fn a_users_own_error_type_named_to_the_policy_is_looked_into_and_retried() {
    let policy = policy().error_type::<ApiError>().build().expect("policy");
    let (outcome, calls) = through(policy.clone(), vec![Err(reset())], get()).await;
    let response = outcome.expect("served on the retry");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.extensions().get::<Attempts>(), Some(&Attempts(2)));
    assert_eq!(calls, 2);
    assert_eq!(policy.stats().retries, 1);
}

#[tokio::test(start_paused = true)]
async fn a_users_own_error_type_not_named_is_not_retried_and_the_policy_says_so() {
    let (captured, _guard) = captured::Captured::install();
    let (service, calls) = scripted(vec![Err(reset()), Err(reset())]);
    let policy = policy().build().expect("policy");
    let retried = RetryLayer::new(policy.clone()).layer(service.clone());
    let err = retried.oneshot(get()).await.expect_err("not retried");
    assert!(matches!(err, ApiError::Transport(_)));
    assert_eq!(*calls.lock().expect("lock"), 1);
    let text = captured.text();
    assert!(
        text.contains("cannot be looked into and is not retried"),
        "{text}"
    );
    assert!(text.contains("ApiError"), "{text}");
    // Said once per policy, not once per error.
    let again = RetryLayer::new(policy).layer(service);
    let _ = again.oneshot(get()).await;
    assert_eq!(captured.text().matches("cannot be looked into").count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_closure_retries_a_409() {
    let on_409 = policy()
        .retry_on_response(|status, _| status == StatusCode::CONFLICT)
        .build()
        .expect("policy");
    let (outcome, calls) = through::<BoxError>(on_409, vec![Ok(status(409))], get()).await;
    assert_eq!(outcome.expect("served").status(), StatusCode::OK);
    assert_eq!(calls, 2);

    // Without it, a 409 is permanent: handed back after one attempt.
    let plain = policy().build().expect("policy");
    let (outcome, calls) = through::<BoxError>(plain, vec![Ok(status(409))], get()).await;
    assert_eq!(outcome.expect("answered").status(), StatusCode::CONFLICT);
    assert_eq!(calls, 1);
}

#[tokio::test(start_paused = true)]
async fn a_closure_on_errors_retries_what_the_rules_do_not() {
    // A boxed error the built-in rules do not know: not retried, unless the closure says.
    let unknown = || -> BoxError { "the inventory is rebalancing".into() };
    let policy = policy()
        .retry_on_error(|err| err.to_string().contains("rebalancing"))
        .build()
        .expect("policy");
    let (outcome, calls) = through(policy, vec![Err(unknown())], get()).await;
    assert_eq!(outcome.expect("served").status(), StatusCode::OK);
    assert_eq!(calls, 2);
}

/// Counts a 404 as the dependency's failure: a cache in front of it that lost its data
/// answers 404 to everything.
struct NotFoundIsAFailure;

impl Classify for NotFoundIsAFailure {
    fn response(&self, status: StatusCode, _headers: &HeaderMap) -> Option<Class> {
        (status == StatusCode::NOT_FOUND).then_some(Class::Retryable { after: None })
    }
}

/// Five 404s through `breaker`, then one more call: its status, or its error.
async fn breaker_after_404s(breaker: CircuitBreaker) -> Result<StatusCode, BoxError> {
    let (service, _calls) = scripted::<BoxError>((0..5).map(|_| Ok(status(404))).collect());
    let mut guarded = CircuitBreakerLayer::new(breaker).layer(service);
    for _ in 0..5 {
        let response = guarded.ready().await?.call(get()).await?;
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
    }
    let response = guarded.ready().await?.call(get()).await?;
    Ok(response.status())
}

#[tokio::test(start_paused = true)]
async fn a_classifier_changes_what_the_breaker_counts() {
    let builder =
        || CircuitBreaker::builder().config(BreakerConfig::builder().consecutive_failures(5));
    // By default a 404 is the caller's doing: the circuit stays closed.
    let plain = builder().build().expect("breaker");
    let status = breaker_after_404s(plain.clone()).await.expect("closed");
    assert_eq!(status, StatusCode::OK);
    assert_eq!(plain.stats().failures, 0);

    // Counted as failures, five in a row open it.
    let classified = builder()
        .classify(NotFoundIsAFailure)
        .build()
        .expect("breaker");
    let err = breaker_after_404s(classified.clone())
        .await
        .expect_err("open");
    assert!(err.downcast_ref::<CircuitOpen>().is_some(), "{err}");
    assert_eq!(classified.stats().failures, 5);
}

fn with_header(code: u16, name: &'static str, value: &'static str) -> Response<String> {
    Response::builder()
        .status(code)
        .header(name, value)
        .body(String::new())
        .expect("response")
}

#[tokio::test(start_paused = true)]
async fn a_closure_only_adds_retries() {
    // Retry everything, it says; the server's "do not retry" still holds...
    let everything = || {
        policy()
            .retry_on_response(|_, _| true)
            .retry_on_error(|_| true)
            .build()
            .expect("policy")
    };
    let told_not_to = vec![Ok(with_header(503, "x-no-retry", "budget"))];
    let (outcome, calls) = through::<BoxError>(everything(), told_not_to, get()).await;
    let response = outcome.expect("answered");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(calls, 1);
    // ...and so does its `Retry-After`: the retry waits the server's second.
    let started = tokio::time::Instant::now();
    let after_a_second = vec![Ok(with_header(503, "retry-after", "1"))];
    let (outcome, calls) = through::<BoxError>(everything(), after_a_second, get()).await;
    assert_eq!(outcome.expect("served").status(), StatusCode::OK);
    assert_eq!(calls, 2);
    assert!(started.elapsed() >= std::time::Duration::from_secs(1));
    // A request whose body could not be replayed failed on the caller's side: not
    // retried, whatever the closure says.
    let cut_short: Vec<Result<_, BoxError>> = vec![Err(Box::new(stormguard::NotReplayable))];
    let (outcome, calls) = through(everything(), cut_short, get()).await;
    let err = outcome.expect_err("not retried");
    assert!(
        err.downcast_ref::<stormguard::NotReplayable>().is_some(),
        "{err}"
    );
    assert_eq!(calls, 1);
}

/// Retries whatever answer a header marks as a cold cache, a 200 included.
struct ColdCache;

impl Classify for ColdCache {
    fn response(&self, _status: StatusCode, headers: &HeaderMap) -> Option<Class> {
        headers
            .contains_key("x-cache-cold")
            .then_some(Class::Retryable { after: None })
    }
}

#[tokio::test(start_paused = true)]
async fn a_classifier_can_retry_a_200() {
    let policy = policy().classify(ColdCache).build().expect("policy");
    let cold = vec![Ok(with_header(200, "x-cache-cold", "1"))];
    let (outcome, calls) = through::<BoxError>(policy, cold, get()).await;
    assert!(!outcome
        .expect("served")
        .headers()
        .contains_key("x-cache-cold"));
    assert_eq!(calls, 2);
}

/// gRPC's INTERNAL (13) is retried for this service.
struct InternalIsTransient;

impl Classify for InternalIsTransient {
    fn response(&self, _status: StatusCode, headers: &HeaderMap) -> Option<Class> {
        let internal = headers
            .get("grpc-status")
            .is_some_and(|code| code.as_bytes() == b"13");
        internal.then_some(Class::Retryable { after: None })
    }
}

#[tokio::test(start_paused = true)]
async fn a_classifier_retries_a_grpc_call_as_its_codes_would() {
    // A unary call (a POST, not marked idempotent) answered INTERNAL in its headers
    // (trailers-only): retried, as a retryable code is (gRFC A6), whatever its method.
    let grpc_call = || {
        Request::post("http://inventory/inventory.Items/Get")
            .header("content-type", "application/grpc")
            .body(String::new())
            .expect("request")
    };
    let internal = || {
        Response::builder()
            .status(200)
            .header("content-type", "application/grpc")
            .header("grpc-status", "13")
            .body(String::new())
            .expect("response")
    };
    let internal_retried = policy()
        .classify(InternalIsTransient)
        .build()
        .expect("policy");
    let (outcome, calls) =
        through::<BoxError>(internal_retried, vec![Ok(internal())], grpc_call()).await;
    assert_eq!(outcome.expect("served").status(), StatusCode::OK);
    assert_eq!(calls, 2);
    // Without it, INTERNAL is not retried.
    let plain = policy().build().expect("policy");
    let (_, calls) = through::<BoxError>(plain, vec![Ok(internal())], grpc_call()).await;
    assert_eq!(calls, 1);
}
