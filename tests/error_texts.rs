//! Errors stormguard recognises by their `Display` text, produced with the crates in
//! `Cargo.lock`, so that an upgrade that changes a text fails here and not in
//! production. hyper's "dispatch task is gone" is pinned in `src/error_class.rs`'s unit
//! tests; this pins hyper-util's "client error (Canceled)": its legacy client gives a
//! request back unwritten when the new connection it was queued on closes first, and
//! has no accessor for that kind.

#![cfg(feature = "hyper-util")]

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard::{CircuitBreaker, CircuitBreakerLayer, RetryLayer, RetryPolicy};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::mpsc;
use tower::{BoxError, ServiceBuilder, ServiceExt};

const LIMIT: Duration = Duration::from_secs(10);

/// The client's end of an in-memory connection.
struct Pipe(DuplexStream);

impl Connection for Pipe {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for Pipe {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Pipe {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// A connector whose connections are in-memory pipes; it hands the server's end of each
/// to the test.
#[derive(Clone)]
struct PipeConnector(mpsc::UnboundedSender<DuplexStream>);

impl tower::Service<http::Uri> for PipeConnector {
    type Response = TokioIo<Pipe>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let (client, server) = tokio::io::duplex(1 << 16);
        let sent = self.0.send(server);
        Box::pin(async move {
            sent.map_err(|_| "the test stopped taking connections")?;
            Ok(TokioIo::new(Pipe(client)))
        })
    }
}

/// Answers one bodiless request on `server` with an empty 200, keeping the connection.
async fn answer_one(server: &mut DuplexStream) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = server.read(&mut byte).await.expect("read");
        assert_eq!(n, 1, "the client closed mid-request");
        head.push(byte[0]);
    }
    server
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        .await
        .expect("write");
}

fn get() -> http::Request<Empty<Bytes>> {
    http::Request::get("http://upstream.test/")
        .body(Empty::new())
        .expect("request")
}

/// A client (hyper-util's legacy one, not retrying canceled requests itself) over a
/// connection that served one request and went back to the pool idle, and the server's
/// end of that connection, and where the next connections arrive.
async fn client_with_an_idle_connection() -> (
    Client<PipeConnector, Empty<Bytes>>,
    DuplexStream,
    mpsc::UnboundedReceiver<DuplexStream>,
) {
    let (tx, mut connections) = mpsc::unbounded_channel();
    let client = Client::builder(TokioExecutor::new())
        .retry_canceled_requests(false)
        .build(PipeConnector(tx));
    let first = client.request(get());
    let serve = async {
        let mut server = connections.recv().await.expect("a connection");
        answer_one(&mut server).await;
        server
    };
    let (response, server) = tokio::time::timeout(LIMIT, async { tokio::join!(first, serve) })
        .await
        .expect("in time");
    assert_eq!(response.expect("served").status(), 200);
    // Let the pool take the connection back.
    tokio::time::sleep(Duration::from_millis(50)).await;
    (client, server, connections)
}

#[tokio::test(start_paused = true)]
async fn hyper_utils_canceled_request_is_pinned_by_its_text() {
    let (client, server, _connections) = client_with_an_idle_connection().await;
    // The server closes the idle connection, and a request is handed that connection
    // before the client's connection task has seen the close: the task reads the
    // close before it writes the request, and gives the request back unwritten.
    drop(server);
    let err = tokio::time::timeout(LIMIT, client.request(get()))
        .await
        .expect("in time")
        .expect_err("the connection closed");
    assert_eq!(err.to_string(), "client error (Canceled)", "{err:?}");
}

#[tokio::test(start_paused = true)]
async fn a_canceled_request_is_retried_transparently_and_is_no_breaker_failure() {
    let (client, server, mut connections) = client_with_an_idle_connection().await;
    let policy = RetryPolicy::builder().seed(1).build().expect("policy");
    let breaker = CircuitBreaker::default();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .layer(CircuitBreakerLayer::new(breaker.clone()))
        .service(client);
    // Every new connection is answered.
    tokio::spawn(async move {
        while let Some(mut server) = connections.recv().await {
            tokio::spawn(async move { answer_one(&mut server).await });
        }
    });
    drop(server);
    let response = tokio::time::timeout(LIMIT, svc.oneshot(get()))
        .await
        .expect("in time")
        .expect("served on a new connection");
    assert_eq!(response.status(), 200);
    let (retry, breaker) = (policy.stats(), breaker.stats());
    // Never written: one transparent retry (gRFC A6), which spends no attempt and asks
    // the budget for nothing; and a call turned away unprocessed is no failure of the
    // dependency's, only a refusal.
    assert_eq!(
        (retry.transparent_retries, retry.retries),
        (1, 0),
        "{retry:?}"
    );
    assert_eq!((breaker.refused, breaker.failures), (1, 0), "{breaker:?}");
}
