//! Graceful drains: a real server that closes every connection after a few requests, as
//! nginx does every `keepalive_requests` (HTTP/2: GOAWAY) and any server does on a
//! graceful restart. Through every client, no request may be processed twice that was
//! not marked idempotent; over hyper-util on a `TrackedConnector` with the default
//! policy, no error may reach the caller (reqwest's and tonic's errors are printed). A server that closes a drained connection at once,
//! without the lingering close real servers do, resets it under the client: then only a
//! POST caught in flight may fail (processed or not, nothing says which).
//!
//! Run with `--nocapture` to see the side-by-side of "no retries" and stormguard.

#[path = "support/nginx.rs"]
mod nginx;

use nginx::{Conf, Nginx};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard::breaker::ResponseBody;
use stormguard::connect::TrackedConnector;
use stormguard::{CircuitBreaker, CircuitBreakerLayer, RetryLayer, RetryPolicy};
use tokio::net::TcpListener;
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceBuilder, ServiceExt};

const REQUESTS: u64 = 2_000;
const CONCURRENCY: u64 = 32;
/// Each attempt's timeout.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Protocol {
    Http1,
    Http2,
}

/// How many times the server's application processed each request id.
type Processed = Arc<Mutex<HashMap<u64, u32>>>;

/// The id the test client stamps on each request (`u64::MAX` if it is missing).
fn request_id(headers: &http::HeaderMap) -> u64 {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(u64::MAX)
}

/// How the server closes a connection it has drained.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Close {
    /// As nginx (`lingering_close`) and RFC 9112 §9.6 do: send its end of the stream,
    /// then read and discard what the client still sends, until the client closes or
    /// [`LINGER`] passes. The client reads everything the server sent (the GOAWAY, the
    /// last responses) before it sees the end.
    Lingering,
    /// Close the socket at once. Bytes the client sent that the server never read make
    /// the kernel answer with a reset, and a reset discards what the client had not yet
    /// read: responses of requests the server processed, and the GOAWAY itself.
    Abrupt,
}

/// The longest a lingering close waits for the client to close its end.
const LINGER: Duration = Duration::from_secs(2);

/// A server's socket that closes as [`Close`] says when hyper drops it.
struct ServerSocket {
    stream: Option<tokio::net::TcpStream>,
    close: Close,
}

impl Drop for ServerSocket {
    fn drop(&mut self) {
        let Some(mut stream) = self.stream.take() else {
            return;
        };
        if self.close == Close::Abrupt {
            return;
        }
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = stream.shutdown().await;
            let mut sink = [0u8; 4096];
            let _ = tokio::time::timeout(LINGER, async {
                while let Ok(n) = stream.read(&mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
            })
            .await;
        });
    }
}

impl ServerSocket {
    fn stream(&mut self) -> std::io::Result<std::pin::Pin<&mut tokio::net::TcpStream>> {
        match self.stream.as_mut() {
            Some(stream) => Ok(std::pin::Pin::new(stream)),
            None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }
}

impl tokio::io::AsyncRead for ServerSocket {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.stream() {
            Ok(stream) => stream.poll_read(cx, buf),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }
}

impl tokio::io::AsyncWrite for ServerSocket {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.stream() {
            Ok(stream) => stream.poll_write(cx, buf),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.stream() {
            Ok(stream) => stream.poll_flush(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.stream() {
            Ok(stream) => stream.poll_shutdown(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }
}

/// A server on 127.0.0.1:0 that drains each connection gracefully once it has taken
/// `per_connection` requests (nginx's `keepalive_requests`, set low) and closes it as
/// `close` says. The accept loop ends with the test's runtime. Returns its address, what
/// it processed, and how many connections it has drained.
async fn draining_server(
    protocol: Protocol,
    per_connection: usize,
    close: Close,
) -> (SocketAddr, Processed, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let processed = Processed::default();
    let seen = processed.clone();
    let drains = Arc::new(AtomicUsize::new(0));
    let drained = drains.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = seen.clone();
            let taken = Arc::new(AtomicUsize::new(0));
            let drain = Arc::new(tokio::sync::Notify::new());
            let (count, signal, drained) = (taken.clone(), drain.clone(), drained.clone());
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let last = count.fetch_add(1, Ordering::SeqCst) + 1 == per_connection;
                if last {
                    drained.fetch_add(1, Ordering::SeqCst);
                    signal.notify_one();
                }
                // Over HTTP/1.1 the last response says `Connection: close`, as nginx's
                // does at `keepalive_requests`: the shutdown that `signal` starts may
                // reach the connection only after that response is written, and then
                // closes it idle, racing the client's next request on it (a request
                // written into a closing connection, which no client may resend
                // unless it is idempotent: RFC 9112 §9.3.1).
                let close = last && protocol == Protocol::Http1;
                let seen = seen.clone();
                async move {
                    let id = request_id(req.headers());
                    let grpc = req
                        .headers()
                        .get(http::header::CONTENT_TYPE)
                        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
                    // The application acts on a whole request, as one that reads its
                    // body does: a request whose body never arrived is not processed.
                    let mut res = if req.into_body().collect().await.is_err() {
                        let mut res = Response::new(Full::new(Bytes::new()).boxed());
                        *res.status_mut() = http::StatusCode::BAD_REQUEST;
                        res
                    } else {
                        // A little work, so requests overlap the drain.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        *seen.lock().expect("lock").entry(id).or_default() += 1;
                        if grpc {
                            grpc_ok()
                        } else {
                            Response::new(Full::new(Bytes::from_static(b"ok")).boxed())
                        }
                    };
                    if close {
                        res.headers_mut().insert(
                            http::header::CONNECTION,
                            http::HeaderValue::from_static("close"),
                        );
                    }
                    Ok::<_, Infallible>(res)
                }
            });
            let io = TokioIo::new(ServerSocket {
                stream: Some(stream),
                close,
            });
            tokio::spawn(async move {
                match protocol {
                    Protocol::Http1 => {
                        let conn = hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, service);
                        serve_then_drain(conn, &drain, |c| c.graceful_shutdown()).await;
                    }
                    Protocol::Http2 => {
                        let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, service);
                        serve_then_drain(conn, &drain, |c| c.graceful_shutdown()).await;
                    }
                }
            });
        }
    });
    (addr, processed, drains)
}

/// A unary gRPC call's successful answer: one empty message, then `grpc-status: 0` in
/// the trailers.
fn grpc_ok() -> Response<http_body_util::combinators::BoxBody<Bytes, Infallible>> {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let frames = [
        Ok(http_body::Frame::data(Bytes::from_static(&[0, 0, 0, 0, 0]))),
        Ok(http_body::Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut res = Response::new(body.boxed());
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    res
}

/// Serves `conn` until it ends, starting its graceful shutdown when `drain` fires.
async fn serve_then_drain<C, F>(conn: C, drain: &tokio::sync::Notify, shutdown: F)
where
    C: std::future::Future,
    F: FnOnce(std::pin::Pin<&mut C>),
{
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        () = drain.notified() => shutdown(conn.as_mut()),
    }
    conn.await;
}

type Svc = BoxCloneService<Request<Full<Bytes>>, Response<Incoming>, BoxError>;

fn client<C>(protocol: Protocol, connector: C) -> Client<C, Full<Bytes>>
where
    C: hyper_util::client::legacy::connect::Connect + Clone,
{
    Client::builder(TokioExecutor::new())
        .http2_only(protocol == Protocol::Http2)
        .build(connector)
}

/// A client with a per-attempt timeout and nothing else.
fn no_retries(protocol: Protocol) -> Svc {
    let client = client(protocol, HttpConnector::new());
    BoxCloneService::new(
        ServiceBuilder::new()
            .timeout(ATTEMPT_TIMEOUT)
            .service(client),
    )
}

/// The standard stack's layers with the default policy and breaker, over a client whose
/// connections are tracked (`stormguard::connect`).
fn stormguard(protocol: Protocol, policy: RetryPolicy, breaker: CircuitBreaker) -> Svc {
    stack(
        client(protocol, TrackedConnector::new(HttpConnector::new())),
        policy,
        breaker,
    )
}

/// The same stack over a client built the usual way, without a `TrackedConnector`.
fn stormguard_untracked(protocol: Protocol, policy: RetryPolicy, breaker: CircuitBreaker) -> Svc {
    stack(client(protocol, HttpConnector::new()), policy, breaker)
}

fn stack<C>(client: Client<C, Full<Bytes>>, policy: RetryPolicy, breaker: CircuitBreaker) -> Svc
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    BoxCloneService::new(
        ServiceBuilder::new()
            .map_response(|r: Response<ResponseBody<Incoming>>| r.map(ResponseBody::into_inner))
            .layer(RetryLayer::new(policy))
            .layer(CircuitBreakerLayer::new(breaker))
            .timeout(ATTEMPT_TIMEOUT)
            .service(client),
    )
}

/// What the caller saw: the ids of the requests that failed (and of those whose last
/// attempt timed out), one failure's text, and the ids of the requests served only after
/// waiting out an attempt's timeout (a stranded attempt retried, `stormguard::connect`).
#[derive(Default)]
struct Failures {
    ids: Vec<u64>,
    timed_out: Vec<u64>,
    /// The ids of the requests that failed with a GOAWAY the stack could not prove
    /// came before the server took them.
    goaway: Vec<u64>,
    first: Option<String>,
    served_late: Vec<u64>,
}

impl Failures {
    /// How many of the requests that failed the server never processed.
    fn never_processed(&self, processed: &Processed) -> usize {
        let processed = processed.lock().expect("lock");
        self.ids
            .iter()
            .filter(|id| !processed.contains_key(id))
            .count()
    }
}

/// Sends `REQUESTS` requests, half of them POSTs, `CONCURRENCY` at a time.
async fn run(svc: Svc, addr: SocketAddr) -> Failures {
    run_with(
        move |req| {
            let svc = svc.clone();
            async move { svc.oneshot(req).await.map(drop) }
        },
        addr,
    )
    .await
}

/// [`run`], each request sent by `send`.
async fn run_with<F, Fut>(send: F, addr: SocketAddr) -> Failures
where
    F: Fn(Request<Full<Bytes>>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Mutex::new(Failures::default()));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..CONCURRENCY {
        let (svc, next, failures) = (send.clone(), next.clone(), failures.clone());
        workers.spawn(async move {
            loop {
                let id = next.fetch_add(1, Ordering::SeqCst);
                if id >= REQUESTS {
                    break;
                }
                let method = if id % 2 == 0 {
                    Method::GET
                } else {
                    Method::POST
                };
                let req = Request::builder()
                    .method(method)
                    .uri(format!("http://{addr}/items"))
                    .header("x-request-id", id)
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .expect("request");
                let started = tokio::time::Instant::now();
                let result = svc(req).await;
                if result.is_ok() && started.elapsed() >= ATTEMPT_TIMEOUT {
                    failures.lock().expect("lock").served_late.push(id);
                }
                if let Err(err) = result {
                    let mut failures = failures.lock().expect("lock");
                    failures.ids.push(id);
                    if timed_out(&*err) {
                        failures.timed_out.push(id);
                    }
                    if goaway(&*err) {
                        failures.goaway.push(id);
                    }
                    failures.first.get_or_insert_with(|| describe(&*err));
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let failures = std::mem::take(&mut *failures.lock().expect("lock"));
    failures
}

/// Whether the per-attempt timeout is the error or one of its sources.
fn timed_out(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    while let Some(cause) = source {
        if cause.is::<tower::timeout::error::Elapsed>() {
            return true;
        }
        #[cfg(feature = "reqwest")]
        if cause
            .downcast_ref::<reqwest::Error>()
            .is_some_and(reqwest::Error::is_timeout)
        {
            return true;
        }
        source = cause.source();
    }
    false
}

/// A request on its way through reqwest.
#[cfg(feature = "reqwest")]
type Sending = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), BoxError>> + Send>>;

/// Sends each request through reqwest (its own retries off, `ATTEMPT_TIMEOUT` per
/// attempt) under `StormguardMiddleware` with the default policy and breaker.
#[cfg(feature = "reqwest")]
fn reqwest_sender(
    protocol: Protocol,
    policy: RetryPolicy,
    breaker: CircuitBreaker,
) -> impl Fn(Request<Full<Bytes>>) -> Sending + Clone + Send + 'static {
    let mut builder = reqwest::Client::builder()
        .retry(reqwest::retry::never())
        .timeout(ATTEMPT_TIMEOUT);
    if protocol == Protocol::Http2 {
        builder = builder.http2_prior_knowledge();
    }
    let client = reqwest_middleware::ClientBuilder::new(builder.build().expect("client"))
        .with(stormguard::reqwest::StormguardMiddleware::new(policy).with_breaker(breaker))
        .build();
    move |req: Request<Full<Bytes>>| {
        let client = client.clone();
        let sending: Sending = Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await?.to_bytes();
            let response = client
                .request(parts.method, parts.uri.to_string())
                .headers(parts.headers)
                .body(body)
                .send()
                .await
                .map_err(|err| -> BoxError {
                    match err {
                        reqwest_middleware::Error::Reqwest(err) => Box::new(err),
                        reqwest_middleware::Error::Middleware(err) => err.into(),
                    }
                })?;
            response.bytes().await?;
            Ok(())
        });
        sending
    }
}

/// Whether the error is a GOAWAY from the server (h2's, through hyper).
fn goaway(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    while let Some(cause) = source {
        #[cfg(feature = "h2")]
        if let Some(err) = cause.downcast_ref::<h2::Error>() {
            return err.is_go_away() && err.is_remote();
        }
        source = cause.source();
    }
    false
}

/// An error and its sources, on one line.
fn describe(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(&format!(" / {cause}"));
        source = cause.source();
    }
    text
}

/// The POSTs (odd ids) and GETs (even ids) the server processed more than once.
fn processed_twice(processed: &Processed) -> (Vec<u64>, Vec<u64>) {
    let processed = processed.lock().expect("lock");
    let twice = |odd: u64| {
        let mut ids: Vec<u64> = processed
            .iter()
            .filter(|(id, n)| **id % 2 == odd && **n > 1)
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids
    };
    (twice(1), twice(0))
}

/// A graceful drain is no failure of the dependency: its refusals never make a run
/// that opens the circuit. (What can open it is real failures: over HTTP/2 a server
/// that closes a drained connection while the client still writes resets it, and
/// every stream then in flight fails with a broken pipe; in one run of a hundred
/// enough of them met in the breaker's window.)
fn assert_refusals_alone_never_open(breaker: &CircuitBreaker) {
    let circuit = breaker.stats();
    assert!(
        circuit.transitions == 0 || circuit.failures >= 20,
        "refusals alone opened the circuit: {circuit:?}"
    );
}

async fn drain_test(protocol: Protocol, per_connection: usize, close: Close) {
    let (plain_addr, plain_processed, _) = draining_server(protocol, per_connection, close).await;
    let (bare_addr, bare_processed, _) = draining_server(protocol, per_connection, close).await;
    let (addr, processed, drains) = draining_server(protocol, per_connection, close).await;
    let server = format!("server drains every {per_connection}, {close:?} close");
    compare(
        protocol,
        &server,
        close,
        [
            (plain_addr, plain_processed),
            (bare_addr, bare_processed),
            (addr, processed),
        ],
    )
    .await;
    #[cfg(feature = "reqwest")]
    through_reqwest(protocol, per_connection, close).await;
    #[cfg(feature = "tonic")]
    if protocol == Protocol::Http2 {
        through_tonic(per_connection, close).await;
    }
    assert_drained(&drains, per_connection);
}

/// The requests met drains. A connection is drained at its `per_connection`-th request
/// and takes at most the requests then in flight after it; connections left at the end
/// below their share (at most one per request in flight) are not drained.
fn assert_drained(drains: &AtomicUsize, per_connection: usize) {
    let (requests, in_flight) = (REQUESTS as usize, CONCURRENCY as usize);
    let least = (requests - in_flight * per_connection) / (per_connection + in_flight);
    let drains = drains.load(Ordering::SeqCst);
    println!("  the server drained {drains} connections (at least {least} expected)");
    assert!(
        drains >= least,
        "{drains} connections drained, at least {least} expected"
    );
}

/// A unary call's request and answer (written by hand: no protoc needed).
#[cfg(feature = "tonic")]
#[derive(Clone, PartialEq, prost::Message)]
struct Empty {}

/// The same requests as unary gRPC calls through a tonic `Channel` under the standard
/// stack (`StandardStack::grpc`), to a server alike over HTTP/2: the GETs' calls marked
/// `Idempotent`, the POSTs' not. A `Channel` drives hyper's connections itself, so no
/// `TrackedConnector` proves what a drain left unwritten. What must hold is that no
/// call not marked idempotent is processed twice; the errors are printed.
#[cfg(feature = "tonic")]
async fn through_tonic(per_connection: usize, close: Close) {
    let (addr, processed, drains) = draining_server(Protocol::Http2, per_connection, close).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect_lazy();
    let stack = stormguard::StandardStack::builder("drain")
        .attempt_timeout(ATTEMPT_TIMEOUT)
        .build()
        .expect("stack");
    let grpc = tonic::client::Grpc::new(stack.grpc(channel));
    let send = move |req: Request<Full<Bytes>>| {
        let mut grpc = grpc.clone();
        async move {
            let mut call = tonic::Request::new(Empty {});
            let id = request_id(req.headers());
            call.metadata_mut()
                .insert("x-request-id", id.to_string().parse().expect("ascii"));
            if req.method() == Method::GET {
                call.extensions_mut().insert(stormguard::Idempotent);
            }
            grpc.ready().await?;
            grpc.unary(
                call,
                http::uri::PathAndQuery::from_static("/stormguard.test.Drain/Call"),
                tonic_prost::ProstCodec::<Empty, Empty>::default(),
            )
            .await
            .map(drop)
            .map_err(|status| -> BoxError { Box::new(status) })
        }
    };
    let failures = run_with(send, addr).await;
    let (posts_twice, gets_twice) = processed_twice(&processed);
    let unprocessed = failures.never_processed(&processed);
    let stats = stack.retry().stats();
    println!(
        "  tonic Channel, standard stack: {} errors ({unprocessed} of calls the server never \
         processed, {} timed out, {} failed with a GOAWAY not proved unprocessed), {} \
         transparent retries, {} retries, calls not marked idempotent processed twice {}, \
         idempotent twice {}; the first: {:?}",
        failures.ids.len(),
        failures.timed_out.len(),
        failures.goaway.len(),
        stats.transparent_retries,
        stats.retries,
        posts_twice.len(),
        gets_twice.len(),
        failures.first,
    );
    assert_eq!(
        posts_twice,
        Vec::<u64>::new(),
        "through tonic too, no call not marked idempotent is processed twice"
    );
    // Not asserted here, unlike over hyper-util: a `Channel` sends every call on one
    // connection, so a drain at 32 calls in flight refuses them all at once, and the
    // transparent retries that land on the closing connection are refused too. Back to
    // back drains can make a run of 50 refusals, which opens the circuit for a break (one
    // run in 150 here: 250 refusals, 3 transitions, 12 calls refused with
    // `CircuitOpen`, none processed twice).
    println!("  tonic's breaker: {:?}", stack.breaker().stats());
    assert_drained(&drains, per_connection);
}

/// The same requests through reqwest under `StormguardMiddleware`, to a server alike:
/// reqwest's connections are its own (no `TrackedConnector`), so a request stranded
/// unwritten, or one that met a GOAWAY it cannot be proved to have preceded, is not
/// proved unprocessed. What must hold is that no POST is processed twice; the errors at
/// the caller are printed.
#[cfg(feature = "reqwest")]
async fn through_reqwest(protocol: Protocol, per_connection: usize, close: Close) {
    let (addr, processed, drains) = draining_server(protocol, per_connection, close).await;
    reqwest_to(protocol, addr, &processed).await;
    assert_drained(&drains, per_connection);
}

/// [`through_reqwest`] to the server at `addr`, whose backend records `processed`.
#[cfg(feature = "reqwest")]
async fn reqwest_to(protocol: Protocol, addr: SocketAddr, processed: &Processed) {
    let policy = RetryPolicy::default();
    let breaker = CircuitBreaker::default();
    let failures = run_with(
        reqwest_sender(protocol, policy.clone(), breaker.clone()),
        addr,
    )
    .await;
    let (posts_twice, gets_twice) = processed_twice(processed);
    let unprocessed = failures.never_processed(processed);
    println!(
        "  reqwest, StormguardMiddleware defaults: {} errors ({unprocessed} of requests the \
         server never processed, {} timed out, {} POSTs failed with a GOAWAY not proved \
         unprocessed), {} transparent retries, {} retries, POSTs processed twice {}, GETs \
         twice {}; the first: {:?}",
        failures.ids.len(),
        failures.timed_out.len(),
        failures.goaway.len(),
        policy.stats().transparent_retries,
        policy.stats().retries,
        posts_twice.len(),
        gets_twice.len(),
        failures.first,
    );
    assert_eq!(
        posts_twice,
        Vec::<u64>::new(),
        "through reqwest too, no POST is processed twice"
    );
    assert_refusals_alone_never_open(&breaker);
}

/// Sends the same requests without retries to the first server, through stormguard's
/// defaults over a client without a `TrackedConnector` to the second, and over one with
/// it to the third (three servers alike, each with its own record of what it processed,
/// closing drained connections as `close` says), and asserts what the caller must see.
/// Without the connector, only that no POST is processed twice: the errors are printed.
///
/// Two kinds of failure at the caller are tolerated, within the 1% bound of lost
/// responses; every other failure fails the test. Against an abrupt close
/// ([`Close::Abrupt`]), a POST in flight when the close reset the connection. It may have
/// been processed (its response discarded by the reset) or not (its stream above the
/// GOAWAY's last id, the reset read before the GOAWAY); nothing tells the two apart, so
/// it is not sent again. Over HTTP/2, a POST that failed with the server's GOAWAY which
/// the tracked connection could not prove unprocessed: hyper hands the GOAWAY to the
/// request whose stream it opened as the GOAWAY arrived, and the server may have taken
/// that stream (`a_post_hyper_abandons_at_a_drain_is_never_processed_twice`).
///
/// Now and then hyper-util's HTTP/2 client leaves the requests it hands a connection
/// around a drain in that connection's dispatch queue, never written, until their
/// attempts time out (`tests/handoff.rs` reproduces the race). The client here is built on stormguard's
/// `TrackedConnector`, with which the retry layer proves such a POST never left and
/// retries it; the test prints the requests served only after an attempt's timeout.
async fn compare(
    protocol: Protocol,
    server: &str,
    close: Close,
    [(plain_addr, plain_processed), (bare_addr, bare_processed), (addr, processed)]: [(SocketAddr, Processed);
        3],
) {
    let plain = run(no_retries(protocol), plain_addr).await;
    let (plain_posts, _) = processed_twice(&plain_processed);
    assert_eq!(
        plain_posts,
        Vec::<u64>::new(),
        "no retries: nothing is sent twice"
    );

    let bare_policy = RetryPolicy::default();
    let bare = run(
        stormguard_untracked(protocol, bare_policy.clone(), CircuitBreaker::default()),
        bare_addr,
    )
    .await;
    let (bare_posts, _) = processed_twice(&bare_processed);
    println!(
        "  stormguard defaults, no TrackedConnector: {} errors ({} timed out, {} POSTs \
         failed with a GOAWAY not proved unprocessed), {} transparent retries, POSTs \
         processed twice {}",
        bare.ids.len(),
        bare.timed_out.len(),
        bare.goaway.len(),
        bare_policy.stats().transparent_retries,
        bare_posts.len(),
    );
    assert_eq!(
        bare_posts,
        Vec::<u64>::new(),
        "without the connector too, no POST is processed twice"
    );

    let policy = RetryPolicy::default();
    let breaker = CircuitBreaker::default();
    let stack = stormguard(protocol, policy.clone(), breaker.clone());
    let failures = run(stack, addr).await;
    let (posts_twice, gets_twice) = processed_twice(&processed);
    let unprocessed = failures.never_processed(&processed);
    let processed = processed.lock().expect("lock");
    // A POST hyper's HTTP/2 client abandoned at a drain after opening its stream gets
    // the connection's GOAWAY, like the POSTs the server never took; when the stack
    // cannot prove which it was (`stormguard::connect`), it is not sent again.
    let excused = |id: &u64| {
        id % 2 == 1
            && (close == Close::Abrupt
                || (protocol == Protocol::Http2 && failures.goaway.contains(id)))
    };
    let unexcused: Vec<u64> = failures
        .ids
        .iter()
        .copied()
        .filter(|id| !excused(id))
        .collect();
    let stalled = failures.timed_out.len();
    let stats = policy.stats();
    println!(
        "{protocol:?}, {REQUESTS} requests (half POST), {CONCURRENCY} at a time, \
         {server}:\n  \
         no retries: {} errors at the caller\n  \
         stormguard defaults: {} errors ({} of requests the server never processed, \
         {stalled} timed out, {} POSTs failed with a GOAWAY not proved unprocessed), \
         {} transparent retries, {} retries, {} budget denials, \
         POSTs processed twice {}, GETs twice {}; \
         served after an attempt's timeout {:?}; \
         breaker: {:?}; failed ids {:?}, the first: {:?}",
        plain.ids.len(),
        failures.ids.len(),
        unprocessed,
        failures.goaway.len(),
        stats.transparent_retries,
        stats.retries,
        stats.budget_denied,
        posts_twice.len(),
        gets_twice.len(),
        failures.served_late,
        breaker.stats(),
        failures.ids,
        failures.first
    );
    assert_refusals_alone_never_open(&breaker);
    assert_eq!(
        unexcused,
        Vec::<u64>::new(),
        "no request fails at the caller with the default policy but those the test \
         tolerates ({stats:?}; {:?})",
        failures.first
    );
    assert!(
        failures.ids.len() <= (REQUESTS / 100) as usize,
        "lost responses stay under 1%: {} ({:?})",
        failures.ids.len(),
        failures.first
    );
    assert_eq!(posts_twice, Vec::<u64>::new(), "no POST is processed twice");
    if protocol == Protocol::Http2 && failures.served_late.is_empty() {
        // Drains at 32 requests in flight catch requests in passing (how many depends on
        // timing: the run without retries shows them as errors, this one as transparent
        // retries; on a busy machine now and then none), and the retries that saved them
        // spent no budget (the retries of GETs whose attempts timed out may).
        assert_eq!(stats.budget_denied, 0);
    }
    assert_eq!(
        (0..REQUESTS)
            .filter(|id| processed.contains_key(id) || excused(id))
            .count() as u64,
        REQUESTS,
        "every request was processed but those whose failure the test tolerates"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_goaway_drains_every_20_never_reach_the_caller() {
    drain_test(Protocol::Http2, 20, Close::Lingering).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_goaway_drains_every_10_never_reach_the_caller() {
    drain_test(Protocol::Http2, 10, Close::Lingering).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_connection_drains_every_20_never_reach_the_caller() {
    drain_test(Protocol::Http1, 20, Close::Lingering).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_connection_drains_every_10_never_reach_the_caller() {
    drain_test(Protocol::Http1, 10, Close::Lingering).await;
}

/// A server that closes a drained connection at once loses responses to the reset: a
/// POST in flight then fails at the caller (processed or not, nothing says), and every
/// other request is retried away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_abrupt_close_fails_only_posts_the_reset_caught() {
    drain_test(Protocol::Http2, 10, Close::Abrupt).await;
}

/// How a server written on the `h2` crate treats the streams it takes.
#[cfg(feature = "h2")]
#[derive(Clone, Copy, PartialEq)]
enum RawH2 {
    /// Drains each connection after `per_connection` streams with h2's own graceful
    /// shutdown: the two-step GOAWAY of real servers, first naming stream 2^31-1, then,
    /// a ping's round trip later, the last stream it took. Every stream it took is
    /// served; the ones above are refused by the GOAWAY, unprocessed.
    Honest,
    /// Never drains, but answers every `per_connection`-th stream with `REFUSED_STREAM`
    /// after acting on it: the server's statement that the stream was not processed
    /// (RFC 9113, section 8.7) is false, as a GOAWAY naming a last stream below one it
    /// acted on would be (section 6.8; the `h2` crate cannot send that one).
    Lies,
}

/// What a raw h2 server saw: the requests it acted on (at their heads), and the POSTs
/// the client cancelled (`RST_STREAM CANCEL`) before their bodies ended.
#[cfg(feature = "h2")]
struct RawH2Server {
    addr: SocketAddr,
    processed: Processed,
    cancelled: Arc<Mutex<Vec<u64>>>,
}

/// A server on 127.0.0.1:0 written on the `h2` crate, whose application acts on each
/// request at its head, before its body has arrived (as a server that starts work on
/// the headers does; the hyper server above acts only on whole requests).
#[cfg(feature = "h2")]
async fn raw_h2_server(per_connection: usize, behaviour: RawH2) -> RawH2Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let processed = Processed::default();
    let cancelled = Arc::new(Mutex::new(Vec::new()));
    let (seen, cancels) = (processed.clone(), cancelled.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (seen, cancels) = (seen.clone(), cancels.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                let mut taken = 0;
                while let Some(next) = conn.accept().await {
                    let (req, mut respond) = match next {
                        Ok(next) => next,
                        Err(_) => break,
                    };
                    taken += 1;
                    let id = request_id(req.headers());
                    *seen.lock().expect("lock").entry(id).or_default() += 1;
                    if behaviour == RawH2::Lies && taken % per_connection == 0 {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    let cancels = cancels.clone();
                    tokio::spawn(async move {
                        let mut body = req.into_body();
                        while let Some(chunk) = body.data().await {
                            match chunk {
                                Ok(chunk) => {
                                    let _ = body.flow_control().release_capacity(chunk.len());
                                }
                                Err(e) => {
                                    if e.reason() == Some(h2::Reason::CANCEL) {
                                        cancels.lock().expect("lock").push(id);
                                    }
                                    return;
                                }
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        if let Ok(mut send) = respond.send_response(Response::new(()), false) {
                            let _ = send.send_data(Bytes::from_static(b"ok"), true);
                        }
                    });
                    if behaviour == RawH2::Honest && taken == per_connection {
                        conn.graceful_shutdown();
                    }
                }
                // Serve the streams still running until the connection closes, as a
                // real server does.
                let _ = std::future::poll_fn(|cx| conn.poll_closed(cx)).await;
            });
        }
    });
    RawH2Server {
        addr,
        processed,
        cancelled,
    }
}

/// A POST acted on at its head and caught by a drain is sent again only when hyper
/// itself abandoned it: hyper 1's HTTP/2 client, when the GOAWAY arrives between
/// opening a request's stream and its next readiness check, cancels that stream
/// (`RST_STREAM CANCEL`) and hands the request the connection's GOAWAY error, which
/// reads as a refusal. A server that took the stream and acts on heads has by then
/// seen it. Every stream the GOAWAY names as taken is otherwise served, and a POST
/// the server received whole is never sent again.
#[cfg(feature = "h2")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_h2_server_draining_gets_a_post_twice_only_when_hyper_cancelled_its_stream() {
    let server = raw_h2_server(10, RawH2::Honest).await;
    let policy = RetryPolicy::default();
    let breaker = CircuitBreaker::default();
    let failures = run(
        stormguard(Protocol::Http2, policy.clone(), breaker.clone()),
        server.addr,
    )
    .await;
    let stats = policy.stats();
    let (posts_twice, _) = processed_twice(&server.processed);
    let cancelled = server.cancelled.lock().expect("lock");
    println!(
        "raw h2 server, acting on heads, two-step GOAWAY every 10 streams, {REQUESTS} \
         requests (half POST), {CONCURRENCY} at a time: {} errors ({} timed out), {} transparent retries, \
         {} retries, POSTs processed twice {posts_twice:?}, POSTs the client cancelled \
         {cancelled:?}; breaker {:?}",
        failures.ids.len(),
        failures.timed_out.len(),
        stats.transparent_retries,
        stats.retries,
        breaker.stats()
    );
    assert!(stats.transparent_retries > 0, "the drains were felt");
    // Not every drain is invisible here: in 100 runs before the client had a
    // `TrackedConnector`, 11 had errors at the caller (44 in all; 20 of them, in 3 runs,
    // POSTs stranded unwritten until the 5 s per-attempt timeout; the rest lost on
    // connections closed under them), and 1 run in 100 with it. They
    // are bounded here; the hyper drain tests above hold them at 0.
    assert!(
        failures.ids.len() <= REQUESTS as usize / 100,
        "{:?}",
        failures.first
    );
    for id in &posts_twice {
        assert!(
            cancelled.contains(id),
            "POST {id} was processed twice though the client never cancelled it"
        );
    }
    assert_refusals_alone_never_open(&breaker);
}

/// What the client cannot help: a refusal is the server's word that it did nothing, and
/// the client sends the call again on that word, whatever its method. Against a server
/// that may break it, a POST needs an `Idempotency-Key` the server deduplicates on.
#[cfg(feature = "h2")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_refuses_a_stream_it_acted_on_gets_that_post_twice() {
    let server = raw_h2_server(10, RawH2::Lies).await;
    let policy = RetryPolicy::default();
    let failures = run(
        stormguard(Protocol::Http2, policy.clone(), CircuitBreaker::default()),
        server.addr,
    )
    .await;
    let (posts_twice, gets_twice) = processed_twice(&server.processed);
    let stats = policy.stats();
    println!(
        "raw h2 server refusing every 10th stream after acting on it: {} errors, \
         POSTs processed twice {}, GETs {}, {stats:?}",
        failures.ids.len(),
        posts_twice.len(),
        gets_twice.len()
    );
    // A request refused again on its transparent retry can fail: the lie is the
    // server's, and rare enough here.
    assert!(
        failures.ids.len() <= REQUESTS as usize / 100,
        "{:?}",
        failures.first
    );
    assert!(
        !posts_twice.is_empty() && !gets_twice.is_empty(),
        "{stats:?}"
    );
}

const NGINX_KEEPALIVE_REQUESTS: usize = 50;

/// nginx in front of a recording server that never drains: the drains are nginx's own.
async fn nginx_test(protocol: Protocol) -> Result<(), BoxError> {
    let (plain_backend, plain_processed, _) =
        draining_server(Protocol::Http1, usize::MAX, Close::Lingering).await;
    let (bare_backend, bare_processed, _) =
        draining_server(Protocol::Http1, usize::MAX, Close::Lingering).await;
    let (backend, processed, _) =
        draining_server(Protocol::Http1, usize::MAX, Close::Lingering).await;
    #[cfg(feature = "reqwest")]
    let (reqwest_backend, reqwest_processed, _) =
        draining_server(Protocol::Http1, usize::MAX, Close::Lingering).await;
    // Draining every client connection after NGINX_KEEPALIVE_REQUESTS requests, as a
    // production nginx does every `keepalive_requests` (1000 by default; 50 here, so
    // that 2,000 requests meet 40 drains or more). Over HTTP/2 a drain is nginx's
    // GOAWAY, over HTTP/1.1 a `Connection: close` on the last response.
    let drains = format!("keepalive_requests {NGINX_KEEPALIVE_REQUESTS};");
    let conf = Conf {
        server: &drains,
        ..Conf::default()
    };
    let http2 = protocol == Protocol::Http2;
    let plain_nginx = Nginx::start(http2, plain_backend, conf).await?;
    let bare_nginx = Nginx::start(http2, bare_backend, conf).await?;
    let nginx = Nginx::start(http2, backend, conf).await?;
    let server = format!("nginx drains every {NGINX_KEEPALIVE_REQUESTS} (keepalive_requests)");
    compare(
        protocol,
        &server,
        // nginx closes a drained connection with a lingering close.
        Close::Lingering,
        [
            (plain_nginx.addr, plain_processed),
            (bare_nginx.addr, bare_processed),
            (nginx.addr, processed),
        ],
    )
    .await;
    #[cfg(feature = "reqwest")]
    {
        let nginx = Nginx::start(http2, reqwest_backend, conf).await?;
        reqwest_to(protocol, nginx.addr, &reqwest_processed).await;
    }
    Ok(())
}

// nginx is a third-party server: the README's test command leaves these out (libtest has
// no run-time skip, and a test returning early would print "ok" for nothing). Run them
// with `cargo test --all-features --test drain -- --ignored nginx`, nginx installed
// (Debian's `nginx-light`); .ci/run installs it and does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs nginx (apt-get install nginx-light); .ci/run runs it"]
async fn nginx_http2_keepalive_requests_drains_never_reach_the_caller() -> Result<(), BoxError> {
    nginx_test(Protocol::Http2).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs nginx (apt-get install nginx-light); .ci/run runs it"]
async fn nginx_http1_keepalive_requests_drains_never_reach_the_caller() -> Result<(), BoxError> {
    nginx_test(Protocol::Http1).await
}

/// The double POST of a drain, pinned: hyper's HTTP/2 client hands a request the
/// connection's GOAWAY error when the GOAWAY is read between opening the request's
/// stream and its next readiness check, though the stream may be one the GOAWAY names
/// as taken (at or below its last stream id) and the server acted on it. A GOAWAY error
/// is therefore no proof on its own that a request was not processed. Against a server
/// that acts on heads and drains every other stream, the race comes up several times in
/// 2,000 requests; no POST may be processed twice.
#[cfg(feature = "h2")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_hyper_abandons_at_a_drain_is_never_processed_twice() {
    // One round meets the race about twice in three runs; four make a miss rare.
    for round in 1..=4 {
        let server = raw_h2_server(2, RawH2::Honest).await;
        let policy = RetryPolicy::default();
        let failures = run(
            stormguard(Protocol::Http2, policy.clone(), CircuitBreaker::default()),
            server.addr,
        )
        .await;
        let (posts_twice, _) = processed_twice(&server.processed);
        let cancelled = server.cancelled.lock().expect("lock").len();
        let stats = policy.stats();
        println!(
            "round {round}: raw h2 server, acting on heads, two-step GOAWAY every 2 \
             streams: {} errors, {} transparent retries, POSTs the client cancelled \
             {cancelled}, POSTs processed twice {posts_twice:?}",
            failures.ids.len(),
            stats.transparent_retries,
        );
        assert_eq!(posts_twice, Vec::<u64>::new(), "no POST is processed twice");
    }
}

/// What the fix rests on, in h2 alone: once a GOAWAY has been read, the client's
/// readiness check reports it whatever stream was opened before it, here one the server
/// took and answered. hyper's HTTP/2 client makes that check right after opening each
/// request's stream and hands its error to that request (`hyper 1.x`,
/// `proto/h2/client.rs`, `ClientTask::poll`), so a GOAWAY error does not say that the
/// request's stream was above the last stream id.
#[cfg(feature = "h2")]
#[tokio::test]
async fn h2_reports_a_goaway_at_readiness_whatever_stream_was_opened() {
    let (client_io, server_io) = tokio::io::duplex(1 << 16);
    let server = tokio::spawn(async move {
        let mut conn = h2::server::handshake(server_io).await.expect("handshake");
        let (_req, mut respond) = conn.accept().await.expect("a stream").expect("stream");
        // Take stream 1, then drain (a GOAWAY naming every stream), then answer it.
        conn.graceful_shutdown();
        respond
            .send_response(Response::new(()), true)
            .expect("respond");
        while let Some(Ok(_)) = conn.accept().await {}
    });
    let (send, connection) = h2::client::handshake(client_io).await.expect("handshake");
    tokio::spawn(connection);
    let mut send = send.ready().await.expect("ready");
    let (response, _) = send
        .send_request(
            Request::post("http://localhost/orders")
                .body(())
                .expect("request"),
            true,
        )
        .expect("stream 1");
    // Stream 1 was taken: the GOAWAY came before its answer, which arrives.
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("in time")
        .expect("answered");
    assert_eq!(response.status(), 200);
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        std::future::poll_fn(|cx| send.poll_ready(cx)),
    )
    .await
    .expect("in time")
    .expect_err("the connection is draining");
    assert!(err.is_go_away() && err.is_remote(), "{err:?}");
    server.abort();
}
