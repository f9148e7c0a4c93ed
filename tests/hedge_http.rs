//! HedgeLayer over real sockets: a hyper server on 127.0.0.1 with a slow 5% tail, and
//! one failing everything. A smaller run of `examples/hedging.rs`, asserting its shape
//! with counts (responses slower than 200 ms, server requests), not timings.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use stormguard::{BoxError, HedgeLayer, HedgePolicy};
use tokio::task::JoinSet;
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt};

#[path = "support/server.rs"]
mod server;

type Req = Request<Empty<Bytes>>;
type Stack = BoxCloneService<Req, Response<Bytes>, BoxError>;

const REQUESTS: usize = 1000;
const RATE_PER_SEC: f64 = 500.0;

/// A server whose requests take 300 ms with probability `slow_percent`, else 2-5 ms;
/// answering `status`. Returns its address and its request count.
async fn serve(slow_percent: u32, status: StatusCode) -> (String, Arc<AtomicU64>) {
    let served = Arc::new(AtomicU64::new(0));
    let count = served.clone();
    let rng = Arc::new(Mutex::new(SmallRng::seed_from_u64(7)));
    let addr = server::serve(move || {
        let served = served.clone();
        let rng = rng.clone();
        hyper::service::service_fn(move |_req: Request<Incoming>| {
            served.fetch_add(1, Ordering::Relaxed);
            let (slow, micros) = {
                let mut rng = rng.lock().unwrap_or_else(|e| e.into_inner());
                let slow = rng.random_range(0..100u32) < slow_percent;
                (slow, rng.random_range(2000..=5000u64))
            };
            async move {
                let delay = if slow {
                    Duration::from_millis(300)
                } else {
                    Duration::from_micros(micros)
                };
                tokio::time::sleep(delay).await;
                let mut res = Response::new(Full::new(Bytes::from_static(b"ok")));
                *res.status_mut() = status;
                Ok::<_, Infallible>(res)
            }
        })
    })
    .await;
    (format!("http://{addr}/"), count)
}

fn client(
) -> impl Service<Req, Response = Response<Bytes>, Error = BoxError, Future: Send> + Clone + Send + 'static
{
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Empty<Bytes>>();
    tower::service_fn(move |req: Req| {
        let client = client.clone();
        async move {
            let res = client.request(req).await?;
            let (parts, body) = res.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, BoxError>(Response::from_parts(parts, body))
        }
    })
}

struct Run {
    /// Responses that took longer than 200 ms from their scheduled send time.
    slow: usize,
    /// Requests the server received beyond one per request, per request.
    extra_load: f64,
}

/// Sends `REQUESTS` GETs at a steady rate through `stack` (bounded: `REQUESTS` in all,
/// each given at most 10 s) and counts.
async fn drive(stack: Stack, url: &str, served: &AtomicU64) -> Run {
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / RATE_PER_SEC));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = JoinSet::new();
    for _ in 0..REQUESTS {
        let scheduled = ticker.tick().await;
        let mut stack = stack.clone();
        let req = Request::get(url).body(Empty::new()).expect("request");
        tasks.spawn(async move {
            let outcome = tokio::time::timeout(Duration::from_secs(10), async {
                stack.ready().await?.call(req).await
            })
            .await;
            assert!(
                matches!(outcome, Ok(Ok(_))),
                "every request gets a response"
            );
            scheduled.elapsed() > Duration::from_millis(200)
        });
    }
    let mut slow = 0;
    while let Some(joined) = tasks.join_next().await {
        if joined.expect("request task") {
            slow += 1;
        }
    }
    // Cancelled copies still on their way count too: wait until the server's count
    // stops moving (two reads 10 ms apart agree), for at most a second.
    let mut count = served.load(Ordering::Relaxed);
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let now = served.load(Ordering::Relaxed);
        if now == count {
            break;
        }
        count = now;
    }
    let extra = count as f64 - REQUESTS as f64;
    Run {
        slow,
        extra_load: extra / REQUESTS as f64,
    }
}

/// The most hedges a default budget grants over a run shorter than its 10 s window, per
/// request: 10% of the requests plus its floor of one retry per window.
fn budget_share() -> f64 {
    0.1 + 1.0 / REQUESTS as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hedging_cuts_the_slow_tail_within_the_budget() {
    let (url, served) = serve(5, StatusCode::OK).await;
    let unhedged = drive(BoxCloneService::new(client()), &url, &served).await;

    let (url, served) = serve(5, StatusCode::OK).await;
    let policy = HedgePolicy::default();
    let stack = ServiceBuilder::new()
        .layer(HedgeLayer::new(policy.clone()))
        .service(client());
    let hedged = drive(BoxCloneService::new(stack), &url, &served).await;

    eprintln!(
        "slow: {} unhedged, {} hedged; extra load {:.3}; {:?}",
        unhedged.slow,
        hedged.slow,
        hedged.extra_load,
        policy.stats()
    );
    assert!(
        unhedged.slow >= 20,
        "about 5% of 1000 are slow without hedging, got {}",
        unhedged.slow
    );
    assert!(
        hedged.slow * 3 <= unhedged.slow,
        "hedging cut the slow responses: {} hedged vs {} unhedged",
        hedged.slow,
        unhedged.slow
    );
    assert_eq!(unhedged.extra_load, 0.0);
    let stats = policy.stats();
    assert!(stats.hedges_sent > 0 && stats.hedges_won > 0, "{stats:?}");
    assert!(
        hedged.extra_load <= budget_share() + 1e-9,
        "extra load {} within the budget's share {}",
        hedged.extra_load,
        budget_share()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_everything_fails_hedging_adds_at_most_the_budget() {
    let (url, served) = serve(0, StatusCode::SERVICE_UNAVAILABLE).await;
    // A fixed delay: with nothing succeeding a percentile delay would never start.
    let policy = HedgePolicy::builder()
        .delay(Duration::from_millis(10))
        .build()
        .expect("valid policy");
    let stack = ServiceBuilder::new()
        .layer(HedgeLayer::new(policy.clone()))
        .service(client());
    let run = drive(BoxCloneService::new(stack), &url, &served).await;
    let stats = policy.stats();
    eprintln!("all 503: extra load {:.3}; {stats:?}", run.extra_load);
    assert!(stats.budget_denied > 0, "the budget ran out: {stats:?}");
    assert!(
        run.extra_load <= budget_share() + 1e-9,
        "extra load {} within the budget's share {}",
        run.extra_load,
        budget_share()
    );
    assert!(
        run.extra_load >= 0.05,
        "the budget was used: {}",
        run.extra_load
    );
}
