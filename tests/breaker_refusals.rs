//! The breaker sees a dependency that turns every call away unprocessed, against raw
//! HTTP/2 servers (the `h2` crate) on 127.0.0.1: one that refuses every stream
//! (`REFUSED_STREAM`), one that answers every connection with a GOAWAY naming stream 0.
//! Each refusal alone says nothing (a graceful drain refuses a few; `tests/drain.rs`
//! checks that drains never trip the circuit), but an unbroken run of them is a
//! dependency that is down.

#![cfg(feature = "h2")]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stormguard::{breaker::CircuitState, CircuitBreaker, CircuitBreakerLayer, CircuitOpen};
use tokio::net::TcpListener;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

/// How a server turns calls away.
#[derive(Clone, Copy)]
enum Refusal {
    /// Every stream reset with `REFUSED_STREAM`.
    EveryStream,
    /// Every connection closed at once with a GOAWAY (`NO_ERROR`, last stream 0).
    EveryConnection,
}

/// An HTTP/2 server on 127.0.0.1:0 that does no work for anyone.
async fn refusing_server(refusal: Refusal) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Refusal::EveryConnection = refusal {
                    send_away(stream).await;
                    return;
                }
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                match refusal {
                    Refusal::EveryStream => {
                        while let Some(Ok((_request, mut respond))) = conn.accept().await {
                            respond.send_reset(h2::Reason::REFUSED_STREAM);
                        }
                    }
                    Refusal::EveryConnection => unreachable!("served by hand"),
                }
            });
        }
    });
    addr
}

/// Speaks just enough HTTP/2 by hand to send a connection away: the server's preface
/// (an empty SETTINGS frame), then a GOAWAY with `NO_ERROR` and last stream 0, and then
/// reads what the client sends until it closes (a server that closed at once would
/// reset the connection before the client read the GOAWAY: a broken pipe, not a
/// refusal).
async fn send_away(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SETTINGS: [u8; 9] = [0, 0, 0, 0x4, 0, 0, 0, 0, 0];
    const GOAWAY: [u8; 17] = [0, 0, 8, 0x7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let mut preface = [0u8; 24];
    if stream.read_exact(&mut preface).await.is_err() {
        return;
    }
    if stream.write_all(&SETTINGS).await.is_err() || stream.write_all(&GOAWAY).await.is_err() {
        return;
    }
    let mut sink = [0u8; 4096];
    let read_all = async { while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {} };
    let _ = tokio::time::timeout(Duration::from_secs(5), read_all).await;
}

type Svc = stormguard::breaker::CircuitBreakerService<Client<HttpConnector, Empty<Bytes>>>;

fn stack(breaker: &CircuitBreaker) -> Svc {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    ServiceBuilder::new()
        .layer(CircuitBreakerLayer::new(breaker.clone()))
        .service(client)
}

/// Calls `svc` until the circuit opens (at most `limit` calls); returns the calls made.
async fn calls_until_open(
    svc: &mut Svc,
    breaker: &CircuitBreaker,
    addr: SocketAddr,
    limit: u32,
) -> u32 {
    for call in 1..=limit {
        let request = http::Request::get(format!("http://{addr}/"))
            .body(Empty::<Bytes>::new())
            .expect("request");
        let ready = svc.ready().await.expect("ready");
        let result = tokio::time::timeout(Duration::from_secs(5), ready.call(request))
            .await
            .expect("in time");
        let err: BoxError = result.expect_err("nothing is ever served");
        if err.is::<CircuitOpen>() {
            assert_eq!(breaker.state(), CircuitState::Open);
            return call;
        }
    }
    panic!(
        "the circuit never opened in {limit} calls: {:?}",
        breaker.stats()
    );
}

async fn trips(refusal: Refusal) {
    let addr = refusing_server(refusal).await;
    // The default breaker: 50 failures in a row, or 95% of at least 20 calls in 2 s.
    let breaker = CircuitBreaker::default();
    let mut svc = stack(&breaker);
    let calls = calls_until_open(&mut svc, &breaker, addr, 300).await;
    let stats = breaker.stats();
    // Refusals count only in a run of failures in a row: the 50th opens the circuit,
    // and the call after it fails fast.
    assert_eq!(calls, 51, "{stats:?}");
    assert_eq!((stats.refused, stats.failures), (50, 0), "{stats:?}");
    assert_eq!(stats.rejected, 1);
}

#[tokio::test]
async fn a_dependency_that_refuses_every_stream_trips_the_circuit() {
    trips(Refusal::EveryStream).await;
}

#[tokio::test]
async fn a_dependency_that_sends_every_connection_away_trips_the_circuit() {
    trips(Refusal::EveryConnection).await;
}
