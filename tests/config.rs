//! Configuration files (feature `serde`): the repository's example TOML and gRFC A6's
//! service configs build stacks that behave as the files say, and bad files are
//! refused with the path and the rule.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use stormguard::{Attempts, BoxError, CircuitBreakerLayer, Config, HedgeLayer, RetryLayer};
use tower::{service_fn, ServiceBuilder, ServiceExt};

const MS: Duration = Duration::from_millis(1);

/// An upstream that answers `answer(attempt)`, a delay and a response, and logs the
/// paths it was sent.
#[derive(Clone)]
struct Upstream {
    calls: Arc<AtomicU32>,
    paths: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    fn new() -> Self {
        Upstream {
            calls: Arc::new(AtomicU32::new(0)),
            paths: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn service(
        &self,
        answer: fn(u32) -> (Duration, Response<String>),
    ) -> impl tower::Service<
        Request<String>,
        Response = Response<String>,
        Error = BoxError,
        Future = impl Send,
    > + Clone {
        let this = self.clone();
        service_fn(move |req: Request<String>| {
            let attempt = this.calls.fetch_add(1, Ordering::SeqCst) + 1;
            if let Ok(mut paths) = this.paths.lock() {
                paths.push(req.uri().path().to_owned());
            }
            let (delay, response) = answer(attempt);
            async move {
                tokio::time::sleep(delay).await;
                Ok::<_, BoxError>(response)
            }
        })
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    fn take_paths(&self) -> Vec<String> {
        self.calls.store(0, Ordering::SeqCst);
        self.paths
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default()
    }
}

fn status(code: u16) -> Response<String> {
    let mut res = Response::new(String::new());
    *res.status_mut() = StatusCode::from_u16(code).expect("status");
    res
}

fn grpc(code: &'static str) -> Response<String> {
    let mut res = Response::new(String::new());
    res.headers_mut()
        .insert("grpc-status", code.parse().expect("header"));
    res
}

fn get(path: &str) -> Request<String> {
    Request::get(format!("http://upstream{path}"))
        .body(String::new())
        .expect("request")
}

fn grpc_call(path: &str) -> Request<String> {
    Request::post(format!("http://upstream{path}"))
        .header("content-type", "application/grpc")
        .body(String::from("frame"))
        .expect("request")
}

/// A second of successful gRPC calls to `path`, 100 of them, through `retry`: they pay
/// 10 retries into its budget (and keep an A6 throttle full) before a test's failures.
async fn fill_budget(retry: &stormguard::RetryPolicy, path: &str) -> Result<(), BoxError> {
    let upstream = Upstream::new();
    let ok = ServiceBuilder::new()
        .layer(RetryLayer::new(retry.clone()))
        .service(upstream.service(|_| (MS, grpc("0"))));
    for _ in 0..100 {
        ok.clone().oneshot(grpc_call(path)).await?;
        tokio::time::sleep(10 * MS).await;
    }
    Ok(())
}

fn example_toml() -> Config {
    Config::from_toml(include_str!("../examples/stormguard.toml")).expect("the example is valid")
}

#[tokio::test(start_paused = true)]
async fn example_file_builds_each_dependency_as_written() -> Result<(), BoxError> {
    let config = example_toml();
    let names: Vec<&str> = config.names().collect();
    assert_eq!(names, ["cache", "inventory", "payments", "search", "users"]);

    let payments = config.dependency("payments")?;
    assert_eq!(payments.retry.name(), "payments");
    assert_eq!(payments.budget.name(), Some("payments"));
    let breaker = payments.breaker.clone().expect("payments has a breaker");
    assert_eq!(breaker.name(), "payments");
    assert_eq!(breaker.config().consecutive_failures(), Some(50));
    assert_eq!(breaker.config().break_duration(), 25 * MS);
    assert!(payments.hedge.is_none());
    let load = payments.load.as_ref().expect("payments has a load control");
    assert_eq!(load.name(), "payments");
    let limit = load.limit().config();
    assert_eq!((limit.initial(), limit.min(), limit.max()), (32, 4, 64));
    assert_eq!(limit.max_wait(), 50 * MS);
    assert_eq!(
        load.limit().limit(),
        32,
        "a new control starts at its initial limit"
    );
    let search_load = config.dependency("search")?.load.expect("on by default");
    assert_eq!(search_load.limit().config().max(), 1000);
    assert!(config.dependency("cache")?.breaker.is_none());
    let search = config.dependency("search")?;
    assert_eq!(search.hedge.as_ref().map(|h| h.max_attempts()), Some(2));
    assert_eq!(search.budget.ratio(), 0.2);
    assert_eq!(payments.budget.ratio(), 0.1, "from [defaults.budget]");

    // payments: 2 attempts, backoff from 100 ms; a 503 is retried once.
    let upstream = Upstream::new();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(payments.retry.clone()))
        .layer(CircuitBreakerLayer::new(payments.breaker_or_off()?))
        .service(upstream.service(|_| (MS, status(503))));
    let started = tokio::time::Instant::now();
    let response = client.oneshot(get("/charge")).await?;
    assert_eq!(response.status(), 503);
    assert_eq!(Attempts::of(&response), 2);
    assert_eq!(upstream.calls(), 2);
    // Two 1 ms answers and the wait, which tokio's timer ends on a whole millisecond
    // (the jitter is drawn in nanoseconds): up to 1 ms later than drawn.
    assert!(
        started.elapsed() < 100 * MS + 3 * MS,
        "the one wait is under 100 ms"
    );
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn every_stack_of_a_dependency_shares_its_budget() -> Result<(), BoxError> {
    let config = example_toml();
    let upstream = Upstream::new();
    let stack = |dependency: stormguard::config::Dependency| {
        ServiceBuilder::new()
            .layer(RetryLayer::new(dependency.retry))
            .service(upstream.service(|_| (MS, status(503))))
    };
    let first = stack(config.dependency("payments")?);
    let second = stack(config.dependency("payments")?);
    first.clone().oneshot(get("/a")).await?;
    second.clone().oneshot(get("/b")).await?;
    first.oneshot(get("/c")).await?;

    let now = tokio::time::Instant::now().into_std();
    let payments = config.dependency("payments")?;
    assert_eq!(payments.retry.stats().requests, 3);
    assert_eq!(
        payments.budget.usage(now),
        (3, payments.retry.stats().retries),
        "both stacks deposited into and were charged by one budget"
    );
    // payments makes two attempts. The first request, from a brand-new client, retries
    // on its allowance (1) and wastes the retry; the next two find less than a retry
    // of room (the three requests earned 0.3), so they are not retried.
    assert_eq!(payments.retry.stats().retries, 1);
    assert_eq!(payments.retry.stats().budget_denied, 2);
    assert_eq!(config.dependency("search")?.budget.usage(now), (0, 0));
    Ok(())
}

/// A dependency of the TOML file with a service config written as TOML tables.
#[tokio::test(start_paused = true)]
async fn a_service_config_in_the_toml_file_bounds_that_dependency_s_grpc_calls(
) -> Result<(), BoxError> {
    let users = example_toml().dependency("users")?;
    fill_budget(&users.retry, "/users.Users/Get").await?;
    let upstream = Upstream::new();
    let failing = ServiceBuilder::new()
        .layer(RetryLayer::new(users.retry.clone()))
        .service(upstream.service(|_| (MS, grpc("14"))));
    let response = failing
        .clone()
        .oneshot(grpc_call("/users.Users/Get"))
        .await?;
    assert_eq!(Attempts::of(&response), 4, "maxAttempts 4");
    assert_eq!(upstream.take_paths().len(), 4);
    failing.oneshot(grpc_call("/users.Users/Delete")).await?;
    assert_eq!(upstream.take_paths().len(), 1, "Delete has neither policy");
    // Not gRPC: the dependency's own retry settings (3 attempts by default). A fresh
    // read of the file, since the failures above spent the throttle's tokens.
    let users = example_toml().dependency("users")?;
    let http = ServiceBuilder::new()
        .layer(RetryLayer::new(users.retry.clone()))
        .service(upstream.service(|_| (MS, status(503))));
    let response = http.oneshot(get("/users/7")).await?;
    // A client with no traffic yet: its allowance pays for the three attempts the
    // policy wants (no method entry limits a request that is not gRPC).
    assert_eq!(Attempts::of(&response), 3);
    assert_eq!(users.retry.stats().budget_denied, 0);
    Ok(())
}

/// gRFC A6's examples: a service-wide retry policy, a method with no policy, a hedged
/// method and retry throttling.
#[tokio::test(start_paused = true)]
async fn grpc_service_config_picks_each_call_s_method_config() -> Result<(), BoxError> {
    let config =
        Config::from_grpc_service_config(include_str!("../examples/grpc_service_config.json"))?;
    let dependency = config.dependency("default")?;
    let upstream = Upstream::new();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(dependency.retry.clone()))
        .option_layer(dependency.hedge.clone().map(HedgeLayer::new))
        .service(upstream.service(|_| (MS, grpc("14"))));
    fill_budget(&dependency.retry, "/grpc.testing.TestService/UnaryCall").await?;

    // The service-wide entry: maxAttempts 4.
    let response = client
        .clone()
        .oneshot(grpc_call("/grpc.testing.TestService/UnaryCall"))
        .await?;
    assert_eq!(response.headers()["grpc-status"], "14");
    assert_eq!(Attempts::of(&response), 4);
    assert_eq!(upstream.take_paths().len(), 4);

    // A method config with neither policy overrides the service's: one attempt.
    client
        .clone()
        .oneshot(grpc_call("/grpc.testing.TestService/StreamingCall"))
        .await?;
    assert_eq!(upstream.take_paths().len(), 1);

    // A service the config does not name: no retry policy, one attempt.
    client
        .clone()
        .oneshot(grpc_call("/other.Service/Call"))
        .await?;
    assert_eq!(upstream.take_paths().len(), 1);

    // Throttling: four failed attempts took 10 tokens to 6 (successes refilled them
    // before); one more failure leaves 5, at which A6 allows no retry.
    let response = client
        .clone()
        .oneshot(grpc_call("/grpc.testing.TestService/UnaryCall"))
        .await?;
    assert_eq!(Attempts::of(&response), 1, "throttled at half the tokens");
    assert_eq!(upstream.take_paths().len(), 1);
    assert_eq!(dependency.retry.stats().budget_denied, 1);
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn grpc_hedging_policy_hedges_its_method_after_its_delay() -> Result<(), BoxError> {
    let config =
        Config::from_grpc_service_config(include_str!("../examples/grpc_service_config.json"))?;
    let dependency = config.dependency("default")?;
    let hedge = dependency
        .hedge
        .clone()
        .expect("the config hedges a method");
    let upstream = Upstream::new();
    // The first copy takes 2 s; every later one 10 ms.
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(dependency.retry.clone()))
        .layer(HedgeLayer::new(hedge.clone()))
        .service(upstream.service(|attempt| {
            let delay = if attempt == 1 { 2000 * MS } else { 10 * MS };
            (delay, grpc("0"))
        }));

    let started = tokio::time::Instant::now();
    let response = client
        .clone()
        .oneshot(grpc_call("/grpc.testing.TestService/UnaryCallHedged"))
        .await?;
    assert_eq!(response.headers()["grpc-status"], "0");
    assert_eq!(started.elapsed(), 510 * MS, "hedgingDelay 0.5s, then 10 ms");
    assert_eq!(upstream.take_paths().len(), 2);
    assert_eq!(hedge.stats().hedges_won, 1);

    // The service-wide method has a retry policy, not a hedging one: sent once.
    let started = tokio::time::Instant::now();
    client
        .oneshot(grpc_call("/grpc.testing.TestService/UnaryCall"))
        .await?;
    assert_eq!(started.elapsed(), 2000 * MS);
    assert_eq!(upstream.take_paths().len(), 1);
    Ok(())
}

#[test]
fn bad_files_name_the_path_and_the_rule() {
    let toml = |text: &str| Config::from_toml(text).unwrap_err().to_string();
    assert_eq!(
        toml("[dependencies.payments.retry]\nmax_attempts = 0"),
        "dependencies.payments.retry.max_attempts: 0 is not in 1..=100"
    );
    assert_eq!(
        toml("[dependencies.payments.breaker]\nfailure_ratio = 0"),
        "dependencies.payments.breaker.failure_ratio: 0.0 is not greater than 0 and at most 1"
    );
    assert_eq!(
        toml("[dependencies.search.hedging]\nmax_attempts = 6"),
        "dependencies.search.hedging.max_attempts: 6 is not in 1..=5"
    );
    assert_eq!(
        toml("[dependencies.search.hedging]\ndelay = \"0s\""),
        "dependencies.search.hedging.delay: 0ns is not from 1ms to 1h"
    );
    assert_eq!(
        toml("[dependencies.payments.retry]\nbackoff = { base = \"100ms\", jitter = \"fuzzy\" }"),
        "dependencies.payments.retry.backoff.jitter: \"fuzzy\" is not one of \"full\", \"equal\", \"decorrelated\", \"none\""
    );
    assert_eq!(
        toml("[dependencies.payments.breaker]\nbreak = \"1s\""),
        "dependencies.payments.breaker.break: unknown field (expected one of: break_duration, consecutive_failures, enabled, failure_grpc_codes, failure_ratio, failure_statuses, jitter, max_break_duration, min_throughput, probes, window)"
    );
    assert_eq!(
        toml("[dependencies.payments.budget]\nratio = \"10%\""),
        "dependencies.payments.budget.ratio: expected a number, found the string \"10%\""
    );
    let json = Config::from_json(r#"{"dependencies": {"a": {"retry": {"max_attempts": -1}}}}"#)
        .unwrap_err()
        .to_string();
    assert_eq!(
        json,
        "dependencies.a.retry.max_attempts: -1 is not in 1..=100"
    );

    let grpc = Config::from_grpc_service_config(
        r#"{"methodConfig": [{"name": [{"service": "s.S"}],
            "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                            "backoffMultiplier": 2, "retryableStatusCodes": []}}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        grpc,
        "methodConfig[0].retryPolicy.retryableStatusCodes: must not be empty (gRFC A6)"
    );

    let missing = example_toml()
        .dependency("billing")
        .unwrap_err()
        .to_string();
    assert_eq!(
        missing,
        "dependencies.billing: not in the configuration (it has: cache, inventory, payments, search, users)"
    );
}

/// A service config whose service `s.S` has calls of 1 s, except `Long`, whose own
/// entry has no timeout; both retry after 2 s at most.
const TIMEOUTS: &str = r#"{"methodConfig": [
    {"name": [{"service": "s.S"}], "timeout": "1s",
     "retryPolicy": {"maxAttempts": 3, "initialBackoff": "2s", "maxBackoff": "2s",
                     "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}},
    {"name": [{"service": "s.S", "method": "Long"}],
     "retryPolicy": {"maxAttempts": 3, "initialBackoff": "2s", "maxBackoff": "2s",
                     "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}
]}"#;

#[tokio::test(start_paused = true)]
async fn a_method_configs_timeout_is_the_calls_deadline() -> Result<(), BoxError> {
    // The service config's methods and timeouts, a budget that refuses nothing, seeded.
    let settings = stormguard_core::config::Settings::from_grpc_service_config(TIMEOUTS)?;
    let settings = settings
        .dependency("default")
        .expect("the default dependency");
    let policy = stormguard::RetryPolicy::builder()
        .grpc_methods(settings.methods.as_ref().expect("methods"))
        .grpc_timeouts(settings.method_timeouts.as_ref().expect("timeouts"))
        .budget(
            stormguard::RetryBudget::builder()
                .ratio(1.0)
                .allowance(1000)
                .build()?,
        )
        .seed(7)
        .build()?;
    let upstream = Upstream::new();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .service(upstream.service(|_| (MS, grpc("14"))));
    // Full jitter draws each wait in [0, 2 s): a draw under what is left of the second
    // is waited out, one past it is given up as `deadline`. Every call's last attempt
    // starts within its second; on this seed some draws fall past it.
    for _ in 0..20 {
        let start = tokio::time::Instant::now();
        let response = client.clone().oneshot(grpc_call("/s.S/Get")).await?;
        assert_eq!(response.headers()["grpc-status"], "14");
        assert!(
            start.elapsed() <= Duration::from_secs(1) + MS,
            "{:?}",
            start.elapsed()
        );
    }
    let stats = policy.stats();
    assert!(stats.deadline > 0, "{stats:?}");
    assert_eq!(stats.deadline + stats.exhausted, 20, "{stats:?}");
    // A method whose own config has no timeout gets none from its service's entry: it
    // makes its three attempts.
    let response = client.clone().oneshot(grpc_call("/s.S/Long")).await?;
    assert_eq!(Attempts::of(&response), 3);
    // A call's own earlier deadline wins over the method's.
    let mut call = grpc_call("/s.S/Get");
    call.headers_mut().insert("grpc-timeout", "100m".parse()?);
    let start = tokio::time::Instant::now();
    client.clone().oneshot(call).await?;
    assert!(start.elapsed() < 100 * MS, "{:?}", start.elapsed());
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_dependency_from_a_service_config_keeps_its_calls_within_their_timeout(
) -> Result<(), BoxError> {
    let dependency = Config::from_grpc_service_config(TIMEOUTS)?.dependency("default")?;
    let upstream = Upstream::new();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(dependency.retry.clone()))
        .service(upstream.service(|_| (MS, grpc("14"))));
    // Whatever the draws and the budget decide, no retry is scheduled past the second:
    // the last attempt starts within it (and takes its 1 ms).
    for _ in 0..20 {
        let start = tokio::time::Instant::now();
        client.clone().oneshot(grpc_call("/s.S/Get")).await?;
        assert!(
            start.elapsed() <= Duration::from_secs(1) + MS,
            "{:?}",
            start.elapsed()
        );
    }
    Ok(())
}
