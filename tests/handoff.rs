//! A request stranded unwritten: what `stormguard::connect` proves, and the hyper
//! behaviour the proof rests on, pinned at the versions in `Cargo.lock`.
//!
//! hyper-util's client can leave a request in a connection's dispatch channel that
//! nothing will ever read (docs of `stormguard::connect`). That happens by a race; these
//! tests make the same state on purpose: an executor that never runs one connection's
//! dispatch task, so a request handed to that connection stays in its channel, unwritten,
//! while the connection itself is driven and then closed by the server.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::{Connect, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard::connect::TrackedConnector;
use stormguard::{BoxError, RetryLayer, RetryPolicy};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tower::{ServiceBuilder, ServiceExt};

#[path = "support/server.rs"]
mod support;

/// The request ids a test server's application processed, with how many times.
type Processed = Arc<Mutex<HashMap<u64, u32>>>;

fn request_id<B>(req: &Request<B>) -> u64 {
    req.headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX)
}

fn request(method: Method, addr: SocketAddr, id: u64) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(format!("http://{addr}/orders"))
        .header("x-request-id", id)
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request")
}

/// The test servers' application: reads each request whole, records it as processed and
/// answers 200, calling `on_request` with its id as its head arrives.
fn recording<F>(
    seen: Processed,
    on_request: F,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future: Send,
> + Send
       + 'static
where
    F: Fn(u64) + Send + Sync + 'static,
{
    hyper::service::service_fn(move |req: Request<Incoming>| {
        let id = request_id(&req);
        on_request(id);
        let seen = seen.clone();
        async move {
            let _ = req.into_body().collect().await;
            *seen.lock().expect("lock").entry(id).or_default() += 1;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }
    })
}

/// Serves HTTP/1.1 and HTTP/2 on 127.0.0.1:0 with [`recording`], and says what it
/// processed.
async fn server<F>(on_request: F) -> (SocketAddr, Processed)
where
    F: Fn(u64) + Clone + Send + Sync + 'static,
{
    let processed = Processed::default();
    let seen = processed.clone();
    let addr = support::serve(move || recording(seen.clone(), on_request.clone())).await;
    (addr, processed)
}

/// Set when dropped: what the retry layer's token does.
#[derive(Clone)]
struct Witness(Arc<AtomicBool>);

impl Drop for Witness {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The premise of the proof: hyper drops a request's extensions before a byte of the
/// request is written, so none is still alive when its head reaches the server. Fails
/// if an upgrade of hyper or hyper-util keeps them longer.
async fn extensions_are_dropped_before_the_head_is_written(h2: bool) {
    let witnesses: Arc<Mutex<HashMap<u64, Arc<AtomicBool>>>> = Arc::default();
    let alive_at_server: Arc<Mutex<Vec<u64>>> = Arc::default();
    let (lookup, alive) = (witnesses.clone(), alive_at_server.clone());
    let (addr, processed) = server(move |id| {
        let dropped = lookup.lock().expect("lock")[&id].load(Ordering::SeqCst);
        if !dropped {
            alive.lock().expect("lock").push(id);
        }
    })
    .await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(h2)
        .build::<_, Full<Bytes>>(HttpConnector::new());
    for id in 0..20 {
        let method = if id % 2 == 0 {
            Method::GET
        } else {
            Method::POST
        };
        let mut req = request(method, addr, id);
        let dropped = Arc::new(AtomicBool::new(false));
        witnesses.lock().expect("lock").insert(id, dropped.clone());
        req.extensions_mut().insert(Witness(dropped));
        let res = client.request(req).await.expect("served");
        assert_eq!(res.status(), 200);
    }
    assert_eq!(processed.lock().expect("lock").len(), 20);
    assert_eq!(
        *alive_at_server.lock().expect("lock"),
        Vec::<u64>::new(),
        "requests whose extensions were still alive when the server took their head"
    );
}

#[tokio::test]
async fn hyper_http1_drops_a_requests_extensions_before_writing_it() {
    extensions_are_dropped_before_the_head_is_written(false).await;
}

#[tokio::test]
async fn hyper_http2_drops_a_requests_extensions_before_writing_it() {
    extensions_are_dropped_before_the_head_is_written(true).await;
}

/// A task kept and never polled.
type Kept = Pin<Box<dyn Future<Output = ()> + Send>>;

/// An executor that runs everything but the first connection's dispatch task, which it
/// keeps without polling: a request handed to that connection stays in its channel,
/// unread. It says when that task is kept, and when the first connection's own task
/// (which owns its socket) has ended. [`StrandingExecutor::watching`] runs every task and
/// only says when that connection's task has ended.
#[derive(Clone, Default)]
struct StrandingExecutor {
    runs_everything: bool,
    spawned: Arc<AtomicUsize>,
    kept: Arc<Mutex<Vec<Kept>>>,
    dispatch_kept: Arc<Notify>,
    connection_ended: Arc<Notify>,
}

impl StrandingExecutor {
    fn watching() -> Self {
        StrandingExecutor {
            runs_everything: true,
            ..StrandingExecutor::default()
        }
    }
}

impl<F> hyper::rt::Executor<F> for StrandingExecutor
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        // hyper's HTTP/2 handshake spawns the connection's task first, then hyper-util
        // spawns the dispatch task.
        match self.spawned.fetch_add(1, Ordering::SeqCst) {
            0 => {
                let ended = self.connection_ended.clone();
                tokio::spawn(async move {
                    fut.await;
                    ended.notify_one();
                });
            }
            1 if !self.runs_everything => {
                self.kept.lock().expect("lock").push(Box::pin(async move {
                    fut.await;
                }));
                self.dispatch_kept.notify_one();
            }
            _ => {
                tokio::spawn(fut);
            }
        }
    }
}

/// A listener whose first connection reads the client's preface and is closed when
/// `close` is notified; the connections after it are served over HTTP/2.
async fn first_connection_closed_on_demand(close: Arc<Notify>) -> (SocketAddr, Processed) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let processed = Processed::default();
    let seen = processed.clone();
    tokio::spawn(async move {
        let Ok((mut first, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            let mut preface = [0u8; 24];
            let _ = first.read_exact(&mut preface).await;
            close.notified().await;
            drop(first);
        });
        while let Ok((stream, _)) = listener.accept().await {
            let service = recording(seen.clone(), |_| {});
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    (addr, processed)
}

/// When the attempt fails: after the stranded request's connection has closed, or while
/// it is still open.
#[derive(Clone, Copy, PartialEq)]
enum FailAttempt {
    AfterTheConnectionClosed,
    WhileItIsOpen,
}

/// One POST through the retry layer's defaults over an HTTP/2 client on `connector`
/// whose first connection strands it; its first attempt is failed with a timeout as
/// `fail` says. Returns the outcome, the transparent retries and retries made, and how
/// many times the server processed the POST.
async fn stranded_post<C>(connector: C, fail: FailAttempt) -> (Result<u16, BoxError>, u64, u64, u32)
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let close = Arc::new(Notify::new());
    let (addr, processed) = first_connection_closed_on_demand(close.clone()).await;
    let executor = StrandingExecutor::default();
    // No pooling: a retry gets a connection of its own, as it would once hyper-util's
    // pool saw the stranded connection's dispatch task gone.
    let client = Client::builder(executor.clone())
        .http2_only(true)
        .pool_max_idle_per_host(0)
        .build::<_, Full<Bytes>>(connector);
    // The attempt's timeout, fired on demand instead of by a clock.
    let timeout = Arc::new(Notify::new());
    let fire = timeout.clone();
    let attempt = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let response = client.request(req);
        let timeout = timeout.clone();
        async move {
            tokio::select! {
                res = response => res.map_err(BoxError::from),
                () = timeout.notified() => Err(BoxError::from(tower::timeout::error::Elapsed::new())),
            }
        }
    });
    let policy = RetryPolicy::default();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .service(attempt);
    let call = tokio::spawn(svc.oneshot(request(Method::POST, addr, 7)));

    executor.dispatch_kept.notified().await;
    if fail == FailAttempt::AfterTheConnectionClosed {
        close.notify_one();
        executor.connection_ended.notified().await;
        fire.notify_one();
    } else {
        fire.notify_one();
    }
    let outcome = call
        .await
        .expect("the call's task")
        .map(|res| res.status().as_u16());
    close.notify_one();
    let stats = policy.stats();
    let times = processed
        .lock()
        .expect("lock")
        .get(&7)
        .copied()
        .unwrap_or(0);
    (outcome, stats.transparent_retries, stats.retries, times)
}

#[tokio::test]
async fn a_post_stranded_on_a_tracked_connection_that_closed_is_retried_at_once() {
    let connector = TrackedConnector::new(HttpConnector::new());
    let (outcome, transparent, retries, times) =
        stranded_post(connector, FailAttempt::AfterTheConnectionClosed).await;
    assert_eq!(outcome.ok(), Some(200));
    assert_eq!((transparent, retries), (1, 0), "one transparent retry");
    assert_eq!(times, 1, "processed once");
}

#[tokio::test]
async fn a_post_stranded_on_an_untracked_connection_is_not_retried() {
    let (outcome, transparent, retries, times) =
        stranded_post(HttpConnector::new(), FailAttempt::AfterTheConnectionClosed).await;
    let err = outcome.expect_err("a timed-out POST is not repeated");
    assert!(err.is::<tower::timeout::error::Elapsed>(), "{err}");
    assert_eq!((transparent, retries, times), (0, 0, 0));
}

#[tokio::test]
async fn a_post_whose_connection_is_still_open_is_not_retried() {
    // Still open, the connection could yet write it: nothing is proved.
    let connector = TrackedConnector::new(HttpConnector::new());
    let (outcome, transparent, retries, times) =
        stranded_post(connector, FailAttempt::WhileItIsOpen).await;
    let err = outcome.expect_err("a timed-out POST is not repeated");
    assert!(err.is::<tower::timeout::error::Elapsed>(), "{err}");
    assert_eq!((transparent, retries, times), (0, 0, 0));
}

/// A capture of the caller's own is left alone: the retry layer tracks no attempt of a
/// request that carries one (its own would replace it).
#[tokio::test]
async fn the_callers_own_connection_capture_still_works() {
    let (addr, processed) = server(|_| {}).await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build::<_, Full<Bytes>>(TrackedConnector::new(HttpConnector::new()));
    let policy = RetryPolicy::default();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(client);
    for id in 0..3 {
        let mut req = request(Method::POST, addr, id);
        let capture = hyper_util::client::legacy::connect::capture_connection(&mut req);
        let res = svc.clone().oneshot(req).await.expect("served");
        assert_eq!(res.status(), 200);
        assert!(
            capture.connection_metadata().is_some(),
            "the caller's capture was filled in"
        );
    }
    assert_eq!(processed.lock().expect("lock").len(), 3);
}

/// Counts its live instances: a message that outlives its channel's receiver.
struct Probe(Arc<AtomicUsize>);

impl Drop for Probe {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The race `stormguard::connect` rests on, in tokio's unbounded channel (the one
/// hyper's dispatch uses): a send under way as the receiver is dropped can be accepted
/// and land after the receiver's drop has drained the channel, and then nothing drops
/// the message until the last sender is gone. A second thread sends while this one drops
/// the receiver, a little later each try (a sweep of 0 to 255 spins), a third sender held
/// throughout (as hyper-util's pooled handle is), and counts the messages `send`
/// accepted that are alive once both are done, until it has found `FOUND` of them (or
/// made `TRIES` tries, or spent two minutes); the test passes if it found one. A tokio that
/// closes the race fails it, and the docs of `stormguard::connect` are then to be read
/// again. `STRANDED_TRIES=N` makes it go on for N tries.
#[test]
fn tokio_unbounded_send_racing_the_receivers_drop_can_strand_its_message() {
    use std::sync::atomic::AtomicU64;
    use std::time::{Duration, Instant};
    use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

    const TRIES: u64 = 4_000_000;
    const FOUND: u64 = 10;
    // For the figures: that many tries, however many are found.
    let figures: Option<u64> = std::env::var("STRANDED_TRIES")
        .ok()
        .and_then(|n| n.parse().ok());
    let (tries_wanted, found) = figures.map_or((TRIES, FOUND), |n| (n, u64::MAX));
    let round = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let live = Arc::new(AtomicUsize::new(0));
    let slot: Arc<Mutex<Option<UnboundedSender<Probe>>>> = Arc::default();
    let accepted = Arc::new(AtomicU64::new(0));

    // The sender: waits for each round, sends once, reports done; `u64::MAX` ends it.
    let sender = {
        let (round, done, slot) = (round.clone(), done.clone(), slot.clone());
        let (live, accepted) = (live.clone(), accepted.clone());
        std::thread::spawn(move || {
            let mut seen = 0;
            loop {
                let now = round.load(Ordering::Acquire);
                if now == u64::MAX {
                    return;
                }
                if now == seen {
                    std::hint::spin_loop();
                    continue;
                }
                seen = now;
                let tx = slot.lock().expect("slot").take();
                if let Some(tx) = tx {
                    live.fetch_add(1, Ordering::SeqCst);
                    if tx.send(Probe(live.clone())).is_ok() {
                        accepted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                done.store(now, Ordering::Release);
            }
        })
    };

    let started = Instant::now();
    let (mut stranded, mut tries) = (0, 0);
    while tries < tries_wanted && stranded < found && started.elapsed() < Duration::from_secs(120) {
        tries += 1;
        let (tx, rx) = unbounded_channel::<Probe>();
        let held = tx.clone();
        *slot.lock().expect("slot") = Some(tx);
        round.store(tries, Ordering::Release);
        for _ in 0..tries % 256 {
            std::hint::spin_loop();
        }
        drop(rx);
        while done.load(Ordering::Acquire) < tries {
            std::hint::spin_loop();
        }
        // The receiver is gone and the send is over: a live message is stranded.
        if live.load(Ordering::SeqCst) > 0 {
            stranded += 1;
        }
        drop(held);
        assert_eq!(live.load(Ordering::SeqCst), 0, "the last sender frees it");
    }
    round.store(u64::MAX, Ordering::Release);
    sender.join().expect("sender");
    println!(
        "{tries} tries, {} sends accepted, {stranded} message(s) stranded past the \
         receiver's drop, in {:?}",
        accepted.load(Ordering::Relaxed),
        started.elapsed()
    );
    assert!(
        stranded > 0,
        "no send outlived the receiver's drop in {tries} tries"
    );
}

/// The proof needs both halves: a POST the server took, whose connection then closed
/// under it, was written (its token went with it), so its failure is not taken for one
/// the server never saw, and it is not sent again.
#[tokio::test]
async fn a_post_written_before_its_connection_closed_is_not_retried() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let processed = Processed::default();
    let (took, close) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    {
        let (seen, took, close) = (processed.clone(), took.clone(), close.clone());
        tokio::spawn(async move {
            // The first connection processes the POST and never answers; it is closed on
            // demand. Any later one answers at once (a wrong retry would get its 200).
            let mut first = true;
            while let Ok((stream, _)) = listener.accept().await {
                let (seen, took) = (seen.clone(), took.clone());
                let answers = !first;
                first = false;
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let (seen, took) = (seen.clone(), took.clone());
                    async move {
                        let id = request_id(&req);
                        let _ = req.into_body().collect().await;
                        *seen.lock().expect("lock").entry(id).or_default() += 1;
                        took.notify_one();
                        if !answers {
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }
                });
                let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service);
                let close = close.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = conn => {}
                        () = close.notified(), if !answers => {}
                    }
                });
            }
        });
    }
    let executor = StrandingExecutor::watching();
    let ended = executor.connection_ended.clone();
    let client = Client::builder(executor)
        .http2_only(true)
        .pool_max_idle_per_host(0)
        .build::<_, Full<Bytes>>(TrackedConnector::new(HttpConnector::new()));
    // The attempt fails only once its connection is gone, so that the retry layer sees
    // the connection closed when it looks.
    let attempt = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let (client, ended) = (client.clone(), ended.clone());
        async move {
            let res = client.request(req).await;
            if res.is_err() {
                ended.notified().await;
            }
            res.map_err(BoxError::from)
        }
    });
    let policy = RetryPolicy::default();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .service(attempt);
    let call = tokio::spawn(svc.oneshot(request(Method::POST, addr, 9)));
    took.notified().await;
    close.notify_one();
    let outcome = call.await.expect("the call's task");
    assert!(
        outcome.is_err(),
        "a POST the server may have processed is not repeated"
    );
    let stats = policy.stats();
    assert_eq!((stats.transparent_retries, stats.retries), (0, 0));
    assert_eq!(processed.lock().expect("lock").get(&9), Some(&1));
}

/// What the retry layer adds to a request's extensions (a token and a connection
/// capture) it adds only where it may prove something: never to a request it may repeat
/// anyway, and no more once the client below has answered without a tracked connection.
#[tokio::test]
async fn requests_reach_an_untracked_client_as_sent_after_its_first_answer() {
    let seen: Arc<Mutex<Vec<(Method, usize)>>> = Arc::default();
    let record = seen.clone();
    let inner = tower::service_fn(move |req: Request<Full<Bytes>>| {
        record
            .lock()
            .expect("lock")
            .push((req.method().clone(), req.extensions().len()));
        async { Ok::<_, BoxError>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
    });
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .service(inner);
    let addr: SocketAddr = "127.0.0.1:9".parse().expect("addr");
    for (id, method) in [
        Method::GET,
        Method::POST,
        Method::GET,
        Method::POST,
        Method::POST,
    ]
    .into_iter()
    .enumerate()
    {
        let res = svc
            .clone()
            .oneshot(request(method, addr, id as u64))
            .await
            .expect("served");
        assert_eq!(res.status(), 200);
    }
    let seen = seen.lock().expect("lock");
    assert_eq!(
        *seen,
        vec![
            (Method::GET, 0),
            // The first POST is tracked: the layer does not know the client yet.
            (Method::POST, 2),
            (Method::GET, 0),
            (Method::POST, 0),
            (Method::POST, 0),
        ]
    );
}
