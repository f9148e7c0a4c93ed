//! The tracing events of RetryLayer: one per retry, one per give-up. A file of its own,
//! with a single test, because tracing caches each call site's interest process-wide:
//! tests running in parallel threads without a subscriber would disturb the capture.

use std::time::Duration;

use http::{Request, Response};
use stormguard::{Backoff, Jitter, RetryLayer, RetryPolicy};
use tokio::time::advance;
use tower::{ServiceBuilder, ServiceExt};
use tower_test::mock;

#[path = "support/captured.rs"]
mod captured;

use captured::Captured;

const MS: Duration = Duration::from_millis(1);

#[tokio::test(start_paused = true)]
async fn every_retry_and_the_give_up_are_traced() {
    let (captured, _guard) = Captured::install();

    let policy = RetryPolicy::builder()
        .backoff(Backoff::new(200 * MS, 20_000 * MS, Jitter::None).expect("backoff"))
        .budget(
            stormguard::RetryBudget::builder()
                .allowance(100)
                .build()
                .expect("budget"),
        )
        .build()
        .expect("policy");
    let (service, mut upstream) = mock::pair::<Request<String>, Response<String>>();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(service);
    let call = tokio::spawn(client.oneshot(Request::new(String::new())));
    for wait in [Duration::ZERO, 200 * MS, 400 * MS] {
        advance(wait).await;
        let (_, send) = upstream.next_request().await.expect("an attempt");
        let mut response = Response::new(String::new());
        *response.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        send.send_response(response);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }
    call.await.expect("task").expect("response");

    let log = captured.text();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 3, "{log}");
    for (line, (attempt, delay)) in lines.iter().zip([(2, 200), (3, 400)]) {
        assert!(
            line.contains("stormguard::retry") && line.contains("retrying"),
            "{line}"
        );
        assert!(
            line.contains(&format!("attempt={attempt} delay_ms={delay}")),
            "{line}"
        );
        assert!(line.contains("reason=\"status\" status=503"), "{line}");
    }
    assert!(lines[2].contains("giving up"), "{}", lines[2]);
    assert!(
        lines[2].contains("attempts=3 reason=\"exhausted\""),
        "{}",
        lines[2]
    );
}
