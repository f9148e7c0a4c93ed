//! The tracing events of HedgeLayer, on target `stormguard::hedge`. A file of its own,
//! with a single test, because tracing caches each call site's interest process-wide.

use std::time::Duration;

use http::{Request, Response};
use stormguard::{HedgeLayer, HedgePolicy, RetryBudget};
use tokio::time::advance;
use tower::{ServiceBuilder, ServiceExt};
use tower_test::mock;

#[path = "support/captured.rs"]
mod captured;

use captured::Captured;

const MS: Duration = Duration::from_millis(1);

fn policy(ratio: f64) -> HedgePolicy {
    let budget = RetryBudget::builder()
        .ratio(ratio)
        .allowance(0)
        .build()
        .expect("budget");
    HedgePolicy::builder()
        .delay(50 * MS)
        .budget(budget)
        .build()
        .expect("policy")
}

#[tokio::test(start_paused = true)]
async fn hedges_sent_won_and_refused_are_traced() {
    let (captured, _guard) = Captured::install();

    for (ratio, hedged) in [(1.0, true), (0.0, false)] {
        let (service, mut upstream) = mock::pair::<Request<String>, Response<String>>();
        let client = ServiceBuilder::new()
            .layer(HedgeLayer::new(policy(ratio)))
            .service(service);
        let call = tokio::spawn(client.oneshot(Request::new(String::new())));
        let (_, original) = upstream.next_request().await.expect("the original");
        advance(50 * MS).await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        if hedged {
            let (_, hedge) = upstream.next_request().await.expect("a hedge");
            hedge.send_response(Response::new("hedge".to_string()));
        } else {
            original.send_response(Response::new("original".to_string()));
        }
        let res = call.await.expect("task").expect("response");
        assert_eq!(res.into_body(), if hedged { "hedge" } else { "original" });
    }

    let text = captured.text();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("stormguard::hedge"))
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].contains("hedge sent") && lines[0].contains("attempt=2"),
        "{text}"
    );
    assert!(lines[0].contains("delay_ms=50"), "{text}");
    assert!(
        lines[1].contains("hedge won") && lines[1].contains("attempt=2"),
        "{text}"
    );
    assert!(
        lines[2].contains("no further hedges") && lines[2].contains("reason=\"budget\""),
        "{text}"
    );
}
