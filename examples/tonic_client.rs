//! A tonic client whose client-streaming call is replayed after UNAVAILABLE.
//!
//! Starts an in-process tonic server on 127.0.0.1 whose `Upload/Send` reads the whole
//! stream and answers UNAVAILABLE the first time, then OK with what it received. The
//! client sends eight messages through retry (with body replay), circuit breaker and
//! per-attempt timeout. The messages are written by hand with prost's derive, so no
//! protoc is needed.
//!
//! `cargo run --example tonic_client`

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::uri::PathAndQuery;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stormguard::{CircuitBreaker, CircuitBreakerLayer, ReplayBody, RetryLayer, RetryPolicy};
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::codegen::tokio_stream;
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;
use tower::{service_fn, BoxError, ServiceBuilder};

/// One piece of an upload.
#[derive(Clone, PartialEq, prost::Message)]
struct Chunk {
    #[prost(bytes = "vec", tag = "1")]
    data: Vec<u8>,
}

/// What the server received.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(uint32, tag = "1")]
    messages: u32,
    #[prost(uint64, tag = "2")]
    bytes: u64,
}

/// The server: reads each upload whole, fails the first call with UNAVAILABLE.
async fn serve() -> std::io::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let calls = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let calls = calls.clone();
            let http = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                let calls = calls.clone();
                async move {
                    let handler = service_fn(move |req: Request<Streaming<Chunk>>| {
                        let calls = calls.clone();
                        async move {
                            let mut stream = req.into_inner();
                            let mut got = Summary::default();
                            while let Some(chunk) = stream.message().await? {
                                got.messages += 1;
                                got.bytes += chunk.data.len() as u64;
                            }
                            let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
                            println!(
                                "server: call {call} received {} messages, {} bytes",
                                got.messages, got.bytes
                            );
                            if call == 1 {
                                return Err(Status::unavailable("warming up"));
                            }
                            Ok(Response::new(got))
                        }
                    });
                    let mut grpc =
                        tonic::server::Grpc::new(ProstCodec::<Summary, Chunk>::default());
                    Ok::<_, Infallible>(grpc.client_streaming(handler, req.map(Body::new)).await)
                }
            });
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), http)
                    .await;
            });
        }
    });
    Ok(format!("http://{addr}"))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let uri = serve().await?;
    let channel = tonic::transport::Endpoint::from_shared(uri)?
        .connect()
        .await?;
    let policy = RetryPolicy::builder().build()?;

    // The HTTP stack plus one line: tonic's Channel takes its own body type. With the
    // `tonic` feature, `StandardStack::new("upload").grpc(channel)` builds the same
    // layers, with a total timeout on top, as a nameable `GrpcStack`.
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()).replay_bodies())
        .map_request(|r: http::Request<ReplayBody<Body>>| r.map(Body::new))
        .layer(CircuitBreakerLayer::new(CircuitBreaker::builder().build()?))
        .timeout(Duration::from_secs(2))
        .service(channel);

    let mut grpc = tonic::client::Grpc::new(svc);
    grpc.ready().await?;
    let messages: Vec<Chunk> = (0..8u8)
        .map(|i| Chunk {
            data: vec![i; 1000],
        })
        .collect();
    let summary = grpc
        .client_streaming(
            Request::new(tokio_stream::iter(messages)),
            PathAndQuery::from_static("/stormguard.example.Upload/Send"),
            ProstCodec::<Chunk, Summary>::default(),
        )
        .await?
        .into_inner();
    let stats = policy.stats();
    println!(
        "client: the server confirmed {} messages, {} bytes, after {} retry",
        summary.messages, summary.bytes, stats.retries
    );
    Ok(())
}
