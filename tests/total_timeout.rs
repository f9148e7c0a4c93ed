//! A hand-built stack tells the retry layer its total timeout: no retry is scheduled
//! that would start past it.

use std::time::Duration;

use http::{Request, Response};
use stormguard::{Attempts, BoxError, RetryBudget, RetryLayer, RetryPolicy};
use tower::{service_fn, ServiceBuilder, ServiceExt};

/// An upstream answering 503 with `Retry-After: 2` every time.
fn busy() -> impl tower::Service<
    Request<String>,
    Response = Response<String>,
    Error = BoxError,
    Future = impl Send,
> + Clone {
    service_fn(|_: Request<String>| async {
        Ok::<_, BoxError>(
            Response::builder()
                .status(503)
                .header("retry-after", "2")
                .body(String::new())
                .expect("response"),
        )
    })
}

fn policy() -> RetryPolicy {
    let budget = RetryBudget::builder()
        .allowance(10)
        .build()
        .expect("budget");
    RetryPolicy::builder()
        .budget(budget)
        .build()
        .expect("policy")
}

/// Sends one request through `client`: the answer it hands back.
async fn send<S>(client: S) -> Response<String>
where
    S: tower::Service<Request<String>, Response = Response<String>, Error = BoxError>,
{
    client
        .oneshot(Request::new(String::new()))
        .await
        .expect("the 503")
}

#[tokio::test(start_paused = true)]
async fn no_retry_is_scheduled_past_the_total_timeout_the_layer_is_told() {
    // Told a total of 1 s, the layer does not wait the 2 s the server asks for.
    let policy = policy();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()).total_timeout(Duration::from_secs(1)))
        .service(busy());
    let started = tokio::time::Instant::now();
    let response = send(client).await;
    assert_eq!(response.status(), 503);
    assert_eq!(Attempts::of(&response), 1);
    assert_eq!(policy.stats().deadline, 1);
    assert!(started.elapsed() < Duration::from_millis(10));

    // Not told, it waits and retries.
    let policy = self::policy();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .service(busy());
    let response = send(client).await;
    assert_eq!(Attempts::of(&response), 3);
    assert_eq!(policy.stats().deadline, 0);

    // The same with replayed bodies.
    let policy = self::policy();
    let client = ServiceBuilder::new()
        .layer(
            RetryLayer::new(policy.clone())
                .total_timeout(Duration::from_secs(1))
                .replay_bodies(),
        )
        .map_request(|r: Request<stormguard::ReplayBody<String>>| r.map(|_| String::new()))
        .service(busy());
    let response = send(client).await;
    assert_eq!(Attempts::of(&response), 1);
    assert_eq!(policy.stats().deadline, 1);
}
