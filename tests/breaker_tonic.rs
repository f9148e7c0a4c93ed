//! The breaker over a tonic `Channel`, against servers on 127.0.0.1: a gRPC status that
//! comes only in the trailers (a server stream that fails after its messages, a unary
//! error sent as headers then trailers) is counted as the call's outcome, as a
//! trailers-only error always was; a stream that succeeds, or that its caller drops,
//! is not a failure.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http_body_util::StreamBody;
use hyper::body::{Frame, Incoming};
use stormguard::breaker::{BreakerConfig, CircuitState};
use stormguard::{CircuitBreaker, CircuitBreakerLayer};
use tonic::body::Body;
use tonic::codegen::tokio_stream;
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;
use tower::{service_fn, ServiceBuilder};

#[path = "support/server.rs"]
mod server;

/// A message of the test service (written by hand: no protoc needed).
#[derive(Clone, PartialEq, prost::Message)]
struct Item {
    #[prost(uint32, tag = "1")]
    n: u32,
}

const LIST: &str = "/stormguard.test.Items/List";
const GET: &str = "/stormguard.test.Items/Get";

/// How the server ends each `List` stream after its messages.
#[derive(Clone, Copy)]
enum End {
    Ok,
    Unavailable,
    /// The stream stays open after its messages.
    Never,
}

/// Serves `Items/List` on 127.0.0.1:0 with tonic: `messages` items, then `end`.
async fn serve_list(messages: u32, end: End) -> String {
    let addr = server::serve(move || {
        hyper::service::service_fn(move |req: http::Request<Incoming>| async move {
            let handler = service_fn(move |_req: Request<Item>| async move {
                type Items = std::pin::Pin<
                    Box<dyn tokio_stream::Stream<Item = Result<Item, Status>> + Send>,
                >;
                let items = tokio_stream::iter((0..messages).map(|n| Ok(Item { n })));
                let stream: Items = match end {
                    End::Ok => Box::pin(items),
                    End::Unavailable => Box::pin(tokio_stream::StreamExt::chain(
                        items,
                        tokio_stream::once(Err(Status::unavailable("going away"))),
                    )),
                    End::Never => Box::pin(tokio_stream::StreamExt::chain(
                        items,
                        tokio_stream::pending(),
                    )),
                };
                Ok::<_, Status>(Response::new(stream))
            });
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Item, Item>::default());
            Ok::<_, Infallible>(grpc.server_streaming(handler, req.map(Body::new)).await)
        })
    })
    .await;
    format!("http://{addr}")
}

/// Serves `Items/Get` on 127.0.0.1:0 by hand, the way some servers answer a unary error:
/// `200` and the headers first, then trailers with `grpc-status: 14`, no message.
async fn serve_unary_error_in_trailers() -> String {
    let addr = server::serve(|| {
        hyper::service::service_fn(|_req: http::Request<Incoming>| async {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("14"));
            trailers.insert("grpc-message", http::HeaderValue::from_static("draining"));
            let frames =
                tokio_stream::iter([Ok::<_, Infallible>(Frame::<Bytes>::trailers(trailers))]);
            let response = http::Response::builder()
                .header("content-type", "application/grpc")
                .body(StreamBody::new(frames))
                .expect("response");
            Ok::<_, Infallible>(response)
        })
    })
    .await;
    format!("http://{addr}")
}

/// Serves `Items/Get` with tonic, answering UNAVAILABLE as tonic does: trailers-only.
async fn serve_unary_trailers_only() -> String {
    let addr = server::serve(|| {
        hyper::service::service_fn(|req: http::Request<Incoming>| async move {
            let handler = service_fn(|_req: Request<Item>| async {
                Err::<Response<Item>, _>(Status::unavailable("down"))
            });
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Item, Item>::default());
            Ok::<_, Infallible>(grpc.unary(handler, req.map(Body::new)).await)
        })
    })
    .await;
    format!("http://{addr}")
}

async fn connect(uri: String) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(uri)
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}

/// A breaker that opens after five failures in a row, with breaks long enough that a
/// test never sees one end.
fn breaker() -> CircuitBreaker {
    CircuitBreaker::builder()
        .config(
            BreakerConfig::builder()
                .consecutive_failures(5)
                .break_duration(Duration::from_secs(600))
                .max_break_duration(Duration::from_secs(600)),
        )
        .build()
        .expect("breaker")
}

type Client =
    tonic::client::Grpc<stormguard::breaker::CircuitBreakerService<tonic::transport::Channel>>;

fn client(channel: tonic::transport::Channel, breaker: &CircuitBreaker) -> Client {
    tonic::client::Grpc::new(
        ServiceBuilder::new()
            .layer(CircuitBreakerLayer::new(breaker.clone()))
            .service(channel),
    )
}

/// One `List` call read to its end: the items, and the status it ended with.
async fn list(client: &mut Client) -> (u32, Result<(), Status>) {
    let call = async {
        client
            .ready()
            .await
            .map_err(|e| Status::unknown(e.to_string()))?;
        let mut stream = client
            .server_streaming(
                Request::new(Item { n: 0 }),
                PathAndQuery::from_static(LIST),
                ProstCodec::<Item, Item>::default(),
            )
            .await?
            .into_inner();
        let mut items = 0;
        loop {
            match stream.message().await {
                Ok(Some(_)) => items += 1,
                Ok(None) => return Ok((items, Ok(()))),
                Err(status) => return Ok((items, Err(status))),
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("in time")
    {
        Ok(done) => done,
        Err(status) => (0, Err(status)),
    }
}

async fn get(client: &mut Client) -> Result<Item, Status> {
    let call = async {
        client
            .ready()
            .await
            .map_err(|e| Status::unknown(e.to_string()))?;
        client
            .unary(
                Request::new(Item { n: 7 }),
                PathAndQuery::from_static(GET),
                ProstCodec::<Item, Item>::default(),
            )
            .await
            .map(Response::into_inner)
    };
    tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("in time")
}

#[tokio::test]
async fn a_stream_that_fails_after_three_messages_is_a_failure_until_the_breaker_opens() {
    let channel = connect(serve_list(3, End::Unavailable).await).await;
    let breaker = breaker();
    let mut client = client(channel, &breaker);
    for call in 1..=5 {
        let (items, end) = list(&mut client).await;
        assert_eq!(items, 3, "call {call}");
        assert_eq!(end.expect_err("UNAVAILABLE").code(), Code::Unavailable);
        assert_eq!(breaker.stats().failures, call, "{:?}", breaker.stats());
    }
    assert_eq!(breaker.state(), CircuitState::Open);
    // The next call fails fast, without reaching the server.
    let calls = breaker.stats().calls;
    let (items, end) = list(&mut client).await;
    assert_eq!(items, 0);
    assert!(end.is_err());
    assert_eq!(breaker.stats().calls, calls);
    assert_eq!(breaker.stats().rejected, 1);
}

#[tokio::test]
async fn a_stream_that_ends_well_is_a_success() {
    let channel = connect(serve_list(3, End::Ok).await).await;
    let breaker = breaker();
    let mut client = client(channel, &breaker);
    for _ in 0..10 {
        let (items, end) = list(&mut client).await;
        assert_eq!((items, end.map_err(|s| s.code())), (3, Ok(())));
    }
    let stats = breaker.stats();
    assert_eq!((stats.calls, stats.failures), (10, 0), "{stats:?}");
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test]
async fn a_stream_its_caller_drops_is_not_a_failure() {
    let channel = connect(serve_list(1, End::Never).await).await;
    let breaker = breaker();
    let mut client = client(channel, &breaker);
    for _ in 0..10 {
        client.ready().await.expect("ready");
        let mut stream = client
            .server_streaming(
                Request::new(Item { n: 0 }),
                PathAndQuery::from_static(LIST),
                ProstCodec::<Item, Item>::default(),
            )
            .await
            .expect("the stream starts")
            .into_inner();
        let first = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("in time");
        assert_eq!(first.expect("a message"), Some(Item { n: 0 }));
        drop(stream);
    }
    let stats = breaker.stats();
    assert_eq!((stats.calls, stats.failures), (10, 0), "{stats:?}");
    assert_eq!(breaker.state(), CircuitState::Closed);
}

#[tokio::test]
async fn a_unary_error_sent_as_headers_then_trailers_is_a_failure() {
    let channel = connect(serve_unary_error_in_trailers().await).await;
    let breaker = breaker();
    let mut client = client(channel, &breaker);
    for call in 1..=5 {
        let status = get(&mut client).await.expect_err("UNAVAILABLE");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(breaker.stats().failures, call);
    }
    assert_eq!(breaker.state(), CircuitState::Open);
}

#[tokio::test]
async fn a_trailers_only_error_is_a_failure_as_before() {
    let channel = connect(serve_unary_trailers_only().await).await;
    let breaker = breaker();
    let mut client = client(channel, &breaker);
    for call in 1..=5 {
        let status = get(&mut client).await.expect_err("UNAVAILABLE");
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(breaker.stats().failures, call);
    }
    assert_eq!(breaker.state(), CircuitState::Open);
}
