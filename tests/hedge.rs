//! HedgeLayer behaviour on a scripted service, with paused time: every wait below is
//! virtual, so the instants asserted are exact.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, Request, Response};
use stormguard::breaker::ResponseBody;
use stormguard::hedge::Hedge;
use stormguard::{
    CircuitBreaker, CircuitBreakerLayer, HedgeLayer, HedgePolicy, Idempotent, NoRetry, RetryBudget,
};
use tokio::time::{advance, Instant};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

#[path = "support/budget.rs"]
mod budget;

use budget::roomy;

const MS: Duration = Duration::from_millis(1);

/// One scripted reply: after `ms`, this status with these headers. The body is the
/// index of the call that produced it ("0" for the original, "1" for the first hedge).
#[derive(Clone, Copy)]
struct Reply {
    ms: u64,
    status: u16,
    headers: &'static [(&'static str, &'static str)],
}

const fn reply(ms: u64, status: u16) -> Reply {
    Reply {
        ms,
        status,
        headers: &[],
    }
}

/// A service answering its n-th call by `plan[n]` (the last entry for later calls),
/// counting calls and calls dropped before they answered.
#[derive(Clone)]
struct Scripted {
    plan: Arc<Vec<Reply>>,
    calls: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<HeaderMap>>>,
}

impl Scripted {
    fn new(plan: Vec<Reply>) -> Self {
        Scripted {
            plan: Arc::new(plan),
            calls: Arc::default(),
            dropped: Arc::default(),
            seen: Arc::default(),
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn dropped(&self) -> usize {
        self.dropped.load(Ordering::SeqCst)
    }
}

struct Unfinished(Arc<AtomicUsize>, bool);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Service<Request<String>> for Scripted {
    type Response = Response<String>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<String>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<String>) -> Self::Future {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().expect("lock").push(req.headers().clone());
        let r = self.plan[n.min(self.plan.len() - 1)];
        let guard = Unfinished(self.dropped.clone(), false);
        Box::pin(async move {
            let mut guard = guard;
            tokio::time::sleep(Duration::from_millis(r.ms)).await;
            guard.1 = true;
            let mut res = Response::builder().status(r.status);
            for (k, v) in r.headers {
                res = res.header(*k, *v);
            }
            Ok(res.body(n.to_string()).expect("response"))
        })
    }
}

type Outcome = Result<Response<String>, BoxError>;

fn start(
    policy: &HedgePolicy,
    script: &Scripted,
    req: Request<String>,
) -> tokio::task::JoinHandle<Outcome> {
    let svc = ServiceBuilder::new()
        .layer(HedgeLayer::new(policy.clone()))
        .service(script.clone());
    tokio::spawn(svc.oneshot(req))
}

fn get() -> Request<String> {
    Request::get("http://upstream/")
        .body(String::new())
        .expect("request")
}

fn fixed(delay_ms: u64) -> HedgePolicy {
    HedgePolicy::builder()
        .delay(Duration::from_millis(delay_ms))
        .budget(roomy())
        .build()
        .expect("valid policy")
}

/// Lets the spawned request run until it waits on a timer.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

async fn finish(task: tokio::task::JoinHandle<Outcome>) -> Response<String> {
    tokio::time::timeout(Duration::from_secs(3600), task)
        .await
        .expect("finishes within an hour of virtual time")
        .expect("task")
        .expect("response")
}

#[tokio::test(start_paused = true)]
async fn a_slow_request_is_hedged_after_the_delay_and_the_loser_cancelled() {
    let policy = fixed(50);
    let script = Scripted::new(vec![reply(1000, 200), reply(10, 200)]);
    let t0 = Instant::now();
    let task = start(&policy, &script, get());
    settle().await;
    advance(49 * MS).await;
    settle().await;
    assert_eq!(script.calls(), 1, "no hedge before the delay");
    advance(MS).await;
    settle().await;
    assert_eq!(script.calls(), 2, "the hedge goes at 50 ms");
    let res = finish(task).await;
    assert_eq!(res.into_body(), "1", "the hedge answered");
    assert_eq!(Instant::now() - t0, 60 * MS);
    assert_eq!(script.dropped(), 1, "the slow original was cancelled");
    let stats = policy.stats();
    assert_eq!(
        (
            stats.requests,
            stats.hedges_sent,
            stats.hedges_won,
            stats.cancelled
        ),
        (1, 1, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_fast_request_is_not_hedged() {
    let policy = fixed(50);
    let script = Scripted::new(vec![reply(10, 200)]);
    let res = finish(start(&policy, &script, get())).await;
    assert_eq!(res.into_body(), "0");
    advance(1000 * MS).await;
    settle().await;
    assert_eq!(script.calls(), 1);
    assert_eq!(policy.stats().hedges_sent, 0);
}

#[tokio::test(start_paused = true)]
async fn a_non_fatal_failure_sends_the_hedge_at_once() {
    let policy = fixed(50);
    let script = Scripted::new(vec![reply(5, 503), reply(10, 200)]);
    let t0 = Instant::now();
    let res = finish(start(&policy, &script, get())).await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.into_body(), "1");
    assert_eq!(Instant::now() - t0, 15 * MS, "hedged at 5 ms, not 50 ms");
}

#[tokio::test(start_paused = true)]
async fn a_fatal_failure_is_returned_at_once() {
    let policy = fixed(50);
    let script = Scripted::new(vec![reply(5, 404), reply(10, 200)]);
    let t0 = Instant::now();
    let res = finish(start(&policy, &script, get())).await;
    assert_eq!(res.status(), 404);
    assert_eq!(Instant::now() - t0, 5 * MS);
    advance(1000 * MS).await;
    settle().await;
    assert_eq!(script.calls(), 1, "no hedge after a fatal answer");
}

#[tokio::test(start_paused = true)]
async fn a_failed_hedge_does_not_beat_a_slower_success() {
    let policy = fixed(50);
    let script = Scripted::new(vec![reply(100, 200), reply(10, 500)]);
    let t0 = Instant::now();
    let res = finish(start(&policy, &script, get())).await;
    assert_eq!((res.status().as_u16(), res.body().as_str()), (200, "0"));
    assert_eq!(Instant::now() - t0, 100 * MS);
    assert_eq!(policy.stats().hedges_won, 0);
}

#[tokio::test(start_paused = true)]
async fn when_every_copy_fails_the_last_failure_is_returned() {
    let policy = fixed(50);
    let script = Scripted::new(vec![reply(100, 503), reply(10, 502)]);
    let res = finish(start(&policy, &script, get())).await;
    assert_eq!((res.status().as_u16(), res.body().as_str()), (503, "0"));
    assert_eq!(script.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn the_budget_can_refuse_a_hedge() {
    let budget = RetryBudget::builder()
        .ratio(0.0)
        .allowance(0)
        .build()
        .expect("valid budget");
    let policy = HedgePolicy::builder()
        .delay(50 * MS)
        .budget(budget)
        .build()
        .expect("valid policy");
    let script = Scripted::new(vec![reply(1000, 200), reply(10, 200)]);
    let res = finish(start(&policy, &script, get())).await;
    assert_eq!(res.into_body(), "0");
    assert_eq!(script.calls(), 1);
    let stats = policy.stats();
    assert_eq!((stats.hedges_sent, stats.budget_denied), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn hedges_withdraw_from_the_budget_and_requests_deposit() {
    // 50% of requests may be hedged; no floor.
    let budget = RetryBudget::builder()
        .ratio(0.5)
        .allowance(0)
        .build()
        .expect("valid budget");
    let policy = HedgePolicy::builder()
        .delay(50 * MS)
        .budget(budget.clone())
        .build()
        .expect("valid policy");
    let script = Scripted::new(vec![reply(1000, 200)]);
    for _ in 0..4 {
        finish(start(&policy, &script, get())).await;
    }
    let stats = policy.stats();
    assert_eq!((stats.requests, stats.hedges_sent), (4, 2));
    assert_eq!(stats.budget_denied, 2);
    assert_eq!(script.calls(), 6);
}

#[tokio::test(start_paused = true)]
async fn requests_unsafe_to_repeat_are_never_hedged() {
    let policy = fixed(50);
    let cases: Vec<(&str, Request<String>, usize)> = vec![
        (
            "POST",
            Request::post("/").body(String::new()).expect("req"),
            1,
        ),
        (
            "POST with key",
            Request::post("/")
                .header("idempotency-key", "k-1")
                .body(String::new())
                .expect("req"),
            2,
        ),
        (
            "POST marked Idempotent",
            {
                let mut r = Request::post("/").body(String::new()).expect("req");
                r.extensions_mut().insert(Idempotent);
                r
            },
            2,
        ),
        (
            "GET marked NoRetry",
            {
                let mut r = get();
                r.extensions_mut().insert(NoRetry);
                r
            },
            1,
        ),
        (
            "PATCH",
            Request::patch("/").body(String::new()).expect("req"),
            1,
        ),
        (
            "DELETE",
            Request::delete("/").body(String::new()).expect("req"),
            2,
        ),
    ];
    for (name, req, calls) in cases {
        let script = Scripted::new(vec![reply(1000, 200), reply(10, 200)]);
        finish(start(&policy, &script, req)).await;
        assert_eq!(script.calls(), calls, "{name}");
    }
    // Only the three safe ones were counted as hedgeable requests.
    assert_eq!(policy.stats().requests, 3);
}

fn grpc_call() -> Request<String> {
    let mut req = Request::post("http://upstream/pkg.Svc/Get")
        .header("content-type", "application/grpc")
        .body(String::new())
        .expect("request");
    req.extensions_mut().insert(Idempotent);
    req
}

#[tokio::test(start_paused = true)]
async fn grpc_pushback_from_any_attempt_stops_further_hedges() {
    let policy = HedgePolicy::builder()
        .delay(50 * MS)
        .max_attempts(3)
        .budget(roomy())
        .build()
        .expect("valid policy");
    let unavailable_pushback = Reply {
        ms: 10,
        status: 200,
        headers: &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "100")],
    };
    let ok = Reply {
        ms: 1000,
        status: 200,
        headers: &[("grpc-status", "0")],
    };
    let script = Scripted::new(vec![ok, unavailable_pushback, reply(1, 200)]);
    let res = finish(start(&policy, &script, grpc_call())).await;
    assert_eq!(res.into_body(), "0", "the original answered");
    assert_eq!(script.calls(), 2, "no third copy after the pushback");
    assert_eq!(policy.stats().suppressed, 1);
    let seen = script.seen.lock().expect("lock");
    assert_eq!(seen[0].get("grpc-previous-rpc-attempts"), None);
    assert_eq!(
        seen[1]
            .get("grpc-previous-rpc-attempts")
            .map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
}

#[tokio::test(start_paused = true)]
async fn grpc_unavailable_without_pushback_sends_the_next_hedge_at_once() {
    let policy = HedgePolicy::builder()
        .delay(50 * MS)
        .max_attempts(3)
        .budget(roomy())
        .build()
        .expect("valid policy");
    let unavailable = Reply {
        ms: 10,
        status: 200,
        headers: &[("grpc-status", "14")],
    };
    let ok = |ms| Reply {
        ms,
        status: 200,
        headers: &[("grpc-status", "0")],
    };
    let script = Scripted::new(vec![ok(1000), unavailable, ok(10)]);
    let t0 = Instant::now();
    let res = finish(start(&policy, &script, grpc_call())).await;
    assert_eq!(res.into_body(), "2", "the third copy answered");
    assert_eq!(Instant::now() - t0, 70 * MS, "sent at 60 ms, at once");
    assert_eq!(policy.stats().cancelled, 1);
}

#[tokio::test(start_paused = true)]
async fn an_open_breaker_below_stops_further_hedges() {
    let breaker = CircuitBreaker::builder()
        .wait_when_open(false)
        .build()
        .expect("valid breaker");
    let policy = HedgePolicy::builder()
        .delay(50 * MS)
        .max_attempts(3)
        .budget(roomy())
        .build()
        .expect("valid policy");
    let script = Scripted::new(vec![reply(1000, 200), reply(10, 200)]);
    let svc = ServiceBuilder::new()
        .map_response(|r: Response<ResponseBody<String>>| r.map(ResponseBody::into_inner))
        .layer(HedgeLayer::new(policy.clone()))
        .layer(CircuitBreakerLayer::new(breaker.clone()))
        .service(script.clone());
    let task = tokio::spawn(svc.oneshot(get()));
    settle().await;
    assert_eq!(script.calls(), 1);
    let _ = breaker.isolate();
    let res = finish(task).await;
    assert_eq!(
        res.into_body(),
        "0",
        "the original, admitted before, answered"
    );
    assert_eq!(script.calls(), 1, "the hedge met the open breaker");
    let stats = policy.stats();
    assert_eq!(
        (stats.hedges_sent, stats.suppressed),
        (1, 1),
        "one CircuitOpen hedge, no third"
    );
}

#[tokio::test(start_paused = true)]
async fn the_percentile_delay_starts_after_min_samples() {
    let policy = HedgePolicy::builder()
        .percentile(0.95)
        .min_samples(10)
        .build()
        .expect("valid policy");
    let mut plan = vec![reply(20, 200); 10];
    plan.push(reply(1000, 200));
    plan.push(reply(5, 200));
    let script = Scripted::new(plan);
    for i in 0..10 {
        assert_eq!(policy.current_delay(), None, "after {i} latencies");
        finish(start(&policy, &script, get())).await;
    }
    assert_eq!(
        policy.stats().hedges_sent,
        0,
        "nothing hedged while learning"
    );
    let delay = policy.current_delay().expect("ten latencies");
    assert!(delay >= 20 * MS && delay <= 20 * MS * 9 / 8, "{delay:?}");

    let t0 = Instant::now();
    let task = start(&policy, &script, get());
    settle().await;
    advance(20 * MS).await;
    settle().await;
    assert_eq!(script.calls(), 11, "not before the 95th percentile");
    // tokio's timer fires on the next whole millisecond.
    let due = Duration::from_millis(delay.as_micros().div_ceil(1000) as u64);
    advance(due - 20 * MS).await;
    settle().await;
    assert_eq!(script.calls(), 12, "hedged at it");
    let res = finish(task).await;
    assert_eq!(res.into_body(), "11");
    assert_eq!(Instant::now() - t0, due + 5 * MS);
}

/// A streaming body that sends one frame and then never ends (not `Clone`).
struct Trickle(bool);

impl http_body::Body for Trickle {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        if self.0 {
            return Poll::Pending;
        }
        self.0 = true;
        Poll::Ready(Some(Ok(http_body::Frame::data(bytes::Bytes::from_static(
            b"abc",
        )))))
    }
}

/// Under `RetryLayer::replay_bodies()`, a hedge replays a body the original sent whole,
/// and a request whose body is still streaming when the delay is up is not hedged.
async fn streaming<B>(body: B) -> (String, Vec<String>, stormguard::hedge::HedgeStats)
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    use http_body_util::BodyExt;
    use stormguard::{ReplayBody, RetryLayer, RetryPolicy};

    let policy = fixed(50);
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (c, s) = (calls.clone(), seen.clone());
    let upstream = tower::service_fn(move |req: Request<ReplayBody<B>>| {
        let n = c.fetch_add(1, Ordering::SeqCst);
        let seen = s.clone();
        async move {
            let mut body = req.into_body();
            let mut read = Vec::new();
            // Read what arrives; a body that stalls for 5 ms is left as it is.
            while let Ok(Some(frame)) = tokio::time::timeout(5 * MS, body.frame()).await {
                if let Ok(data) = frame?.into_data() {
                    read.extend_from_slice(&data);
                }
            }
            seen.lock()
                .expect("lock")
                .push(String::from_utf8_lossy(&read).into_owned());
            tokio::time::sleep(if n == 0 { 1000 * MS } else { 10 * MS }).await;
            Ok::<_, BoxError>(Response::new(n.to_string()))
        }
    });
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()).replay_bodies())
        .layer(HedgeLayer::new(policy.clone()))
        .service(upstream);
    let req = Request::get("http://upstream/")
        .body(body)
        .expect("request");
    let res = tokio::time::timeout(Duration::from_secs(3600), svc.oneshot(req))
        .await
        .expect("finishes")
        .expect("response");
    let seen = seen.lock().expect("lock").clone();
    (res.into_body(), seen, policy.stats())
}

#[tokio::test(start_paused = true)]
async fn a_hedge_replays_a_body_sent_whole() {
    let body = http_body_util::Full::new(bytes::Bytes::from_static(b"hello"));
    let (winner, seen, stats) = streaming(body).await;
    assert_eq!(winner, "1");
    assert_eq!(seen, ["hello", "hello"]);
    assert_eq!(stats.hedges_won, 1);
}

#[tokio::test(start_paused = true)]
async fn a_body_still_streaming_is_not_hedged() {
    let (winner, seen, stats) = streaming(Trickle(false)).await;
    assert_eq!(winner, "0");
    assert_eq!(seen, ["abc"]);
    assert_eq!((stats.hedges_sent, stats.suppressed), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn under_a_retry_layer_a_shared_budget_is_paid_into_once_per_request() {
    use stormguard::{RetryLayer, RetryPolicy};

    let budget = || {
        RetryBudget::builder()
            .ratio(0.5)
            .allowance(0)
            .build()
            .expect("valid budget")
    };
    let retry = RetryPolicy::builder()
        .budget(budget())
        .build()
        .expect("valid");
    let shared = HedgePolicy::builder()
        .delay(50 * MS)
        .share_retry_budget(&retry)
        .build()
        .expect("valid");
    let retry2 = RetryPolicy::builder()
        .budget(budget())
        .build()
        .expect("valid");
    let double = HedgePolicy::builder()
        .delay(50 * MS)
        .budget(retry2.budget().clone())
        .build()
        .expect("valid");
    for (retry, hedge, expected) in [(retry, shared, 2), (retry2, double, 4)] {
        let script = Scripted::new(vec![reply(10, 200)]);
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new(retry.clone()))
            .layer(HedgeLayer::new(hedge))
            .service(script.clone());
        for _ in 0..4 {
            finish(tokio::spawn(svc.clone().oneshot(get()))).await;
        }
        let now = Instant::now().into_std();
        // 4 requests at 0.5 each: 2 hedges or retries between them, not 4.
        assert_eq!(retry.budget().available(now), expected);
    }
}

/// [`Scripted`], counting how often it is cloned.
struct CountingClones {
    inner: Scripted,
    clones: Arc<AtomicUsize>,
}

impl Clone for CountingClones {
    fn clone(&self) -> Self {
        self.clones.fetch_add(1, Ordering::SeqCst);
        CountingClones {
            inner: self.inner.clone(),
            clones: self.clones.clone(),
        }
    }
}

impl Service<Request<String>> for CountingClones {
    type Response = Response<String>;
    type Error = BoxError;
    type Future = <Scripted as Service<Request<String>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<String>) -> Self::Future {
        self.inner.call(req)
    }
}

#[tokio::test(start_paused = true)]
async fn the_service_is_cloned_only_when_a_hedge_is_sent() {
    let policy = fixed(50);
    // Twenty fast answers, then a slow one that is hedged.
    let mut plan = vec![reply(10, 200); 20];
    plan.extend([reply(200, 200), reply(10, 200)]);
    let clones = Arc::new(AtomicUsize::new(0));
    let mut svc = Hedge::new(
        CountingClones {
            inner: Scripted::new(plan),
            clones: clones.clone(),
        },
        policy.clone(),
    );
    for _ in 0..20 {
        let res = svc.ready().await.expect("ready").call(get()).await;
        assert_eq!(res.expect("response").status(), 200);
    }
    assert_eq!(policy.stats().hedges_sent, 0);
    // One clone kept for the hedges of every request, made once; none per request.
    assert_eq!(clones.load(Ordering::SeqCst), 1);

    let res = svc.ready().await.expect("ready").call(get()).await;
    assert_eq!(res.expect("response").into_body(), "21", "the hedge won");
    assert_eq!(policy.stats().hedges_sent, 1);
    assert_eq!(
        clones.load(Ordering::SeqCst),
        2,
        "one clone for the hedge sent"
    );
}
