//! RetryLayer in a tonic client stack: a client-streaming call whose body spans several
//! frames is replayed after UNAVAILABLE, against a tonic server on 127.0.0.1; unary and
//! client-streaming calls of a brand-new client with the default budget get all their
//! attempts.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::uri::PathAndQuery;
use hyper::body::Incoming;
use stormguard::{ReplayBody, RetryLayer};
use tonic::body::Body;
use tonic::codegen::tokio_stream;
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;
use tower::{service_fn, Service, ServiceBuilder};

#[path = "support/budget.rs"]
mod budget;
#[path = "support/policy.rs"]
mod policy;
#[path = "support/server.rs"]
mod server;

use policy::fast_policy;

/// One piece of an upload (written by hand: no protoc needed).
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

const PATH: &str = "/stormguard.test.Upload/Send";

/// Serves `Upload/Send` on 127.0.0.1:0. Each call reads the whole stream and records
/// what it got; the first `failures` calls then answer UNAVAILABLE.
async fn serve(failures: usize) -> (String, Arc<Mutex<Vec<Summary>>>) {
    let received = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(AtomicUsize::new(0));
    let log = received.clone();
    let addr = server::serve(move || {
        let (log, calls) = (log.clone(), calls.clone());
        hyper::service::service_fn(move |req: http::Request<Incoming>| {
            let (log, calls) = (log.clone(), calls.clone());
            async move {
                let handler = service_fn(move |req: Request<Streaming<Chunk>>| {
                    let (log, calls) = (log.clone(), calls.clone());
                    async move {
                        let mut stream = req.into_inner();
                        let mut got = Summary::default();
                        while let Some(chunk) = stream.message().await? {
                            got.messages += 1;
                            got.bytes += chunk.data.len() as u64;
                        }
                        log.lock().expect("lock").push(got.clone());
                        if calls.fetch_add(1, Ordering::SeqCst) < failures {
                            return Err(Status::unavailable("warming up"));
                        }
                        Ok::<_, Status>(Response::new(got))
                    }
                });
                let mut grpc = tonic::server::Grpc::new(ProstCodec::<Summary, Chunk>::default());
                Ok::<_, Infallible>(grpc.client_streaming(handler, req.map(Body::new)).await)
            }
        })
    })
    .await;
    (format!("http://{addr}"), received)
}

/// A channel connected to `uri`.
async fn connect(uri: String) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(uri)
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}

/// `policy`'s retry layer right on `channel`, replaying the call's body.
fn stack(
    channel: tonic::transport::Channel,
    policy: &stormguard::RetryPolicy,
) -> impl Service<
    http::Request<Body>,
    Response = http::Response<Body>,
    Error = tonic::transport::Error,
    Future: Send,
> + Clone {
    ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()).replay_bodies())
        .map_request(|r: http::Request<ReplayBody<Body>>| r.map(Body::new))
        .service(channel)
}

fn chunks(n: usize, size: usize) -> Vec<Chunk> {
    (0..n)
        .map(|i| Chunk {
            data: vec![i as u8; size],
        })
        .collect()
}

async fn upload<S>(svc: S, messages: Vec<Chunk>) -> Result<Summary, Status>
where
    S: tonic::client::GrpcService<Body>,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError>,
    S::Error: Into<tonic::codegen::StdError>,
{
    let mut grpc = tonic::client::Grpc::new(svc);
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(e.into().to_string()))?;
    let request = Request::new(tokio_stream::iter(messages));
    let response = grpc
        .client_streaming(
            request,
            PathAndQuery::from_static(PATH),
            ProstCodec::<Chunk, Summary>::default(),
        )
        .await?;
    Ok(response.into_inner())
}

#[tokio::test]
async fn a_client_stream_is_replayed_after_unavailable() {
    let (uri, received) = serve(2).await;
    let channel = connect(uri).await;
    let policy = fast_policy(3).build().expect("policy");
    let svc = stack(channel, &policy);

    let summary = tokio::time::timeout(Duration::from_secs(5), upload(svc, chunks(8, 1000)))
        .await
        .expect("in time")
        .expect("third attempt succeeds");
    assert_eq!(
        summary,
        Summary {
            messages: 8,
            bytes: 8000
        }
    );
    // Every attempt, the successful one included, carried the whole stream.
    assert_eq!(*received.lock().expect("lock"), vec![summary.clone(); 3]);
    assert_eq!(policy.stats().retries, 2);
}

#[tokio::test]
async fn a_stream_over_the_cap_is_sent_once_and_the_status_returned() {
    let (uri, received) = serve(1).await;
    let channel = connect(uri).await;
    let policy = fast_policy(3)
        .max_replay_bytes(2048)
        .build()
        .expect("policy");
    let mut svc = stack(channel, &policy);
    std::future::poll_fn(|cx| svc.poll_ready(cx))
        .await
        .expect("ready");

    let status = upload(svc, chunks(8, 1000))
        .await
        .expect_err("UNAVAILABLE comes back");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(
        *received.lock().expect("lock"),
        vec![Summary {
            messages: 8,
            bytes: 8000
        }]
    );
    assert_eq!(policy.stats().not_replayable, 1);
}

/// With the `tonic` feature the retry layer sits right on a `Channel` and reads its
/// `transport::Error`: a connection that was never made is retried, gRPC call (a POST)
/// or not, as the request never left.
#[cfg(feature = "tonic")]
#[tokio::test]
async fn a_call_on_a_channel_whose_connection_failed_is_retried() {
    // A port nothing listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    drop(listener);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect_lazy();
    let policy = fast_policy(5).max_attempts(3).build().expect("policy");
    let svc = stack(channel, &policy);
    let outcome = tokio::time::timeout(Duration::from_secs(5), upload(svc, chunks(1, 10)))
        .await
        .expect("in time");
    assert!(outcome.is_err(), "nothing listens there");
    let stats = policy.stats();
    assert_eq!((stats.retries, stats.exhausted), (2, 1), "{stats:?}");
}

const UNARY_PATH: &str = "/stormguard.test.Upload/One";

/// Serves the unary `Upload/One` on 127.0.0.1:0: the first `failures` calls answer
/// UNAVAILABLE, the others a summary of the one chunk.
async fn serve_unary(failures: usize) -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let addr = server::serve(move || {
        let calls = calls.clone();
        hyper::service::service_fn(move |req: http::Request<Incoming>| {
            let calls = calls.clone();
            async move {
                let handler = service_fn(move |req: Request<Chunk>| {
                    let calls = calls.clone();
                    async move {
                        if calls.fetch_add(1, Ordering::SeqCst) < failures {
                            return Err(Status::unavailable("warming up"));
                        }
                        let bytes = req.into_inner().data.len() as u64;
                        Ok::<_, Status>(Response::new(Summary { messages: 1, bytes }))
                    }
                });
                let mut grpc = tonic::server::Grpc::new(ProstCodec::<Summary, Chunk>::default());
                Ok::<_, Infallible>(grpc.unary(handler, req.map(Body::new)).await)
            }
        })
    })
    .await;
    (format!("http://{addr}"), seen)
}

/// The default policy but for its waits (5 to 50 ms): the default budget, as a brand-new
/// client has it.
fn new_client_policy(seed: u64) -> stormguard::RetryPolicy {
    let backoff = stormguard::Backoff::new(
        Duration::from_millis(5),
        Duration::from_millis(50),
        stormguard::Jitter::Full,
    )
    .expect("backoff");
    stormguard::RetryPolicy::builder()
        .backoff(backoff)
        .seed(seed)
        .build()
        .expect("policy")
}

#[tokio::test]
async fn a_new_clients_unary_call_gets_all_its_attempts() {
    let (uri, calls) = serve_unary(2).await;
    let channel = connect(uri).await;
    let policy = new_client_policy(4);
    let mut client = UploadClient::new(stack(channel, &policy));
    let call = client.one(Request::new(Chunk { data: vec![7; 100] }));
    let summary = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("in time")
        .expect("the third attempt succeeds")
        .into_inner();
    assert_eq!(summary.bytes, 100);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let stats = policy.stats();
    assert_eq!((stats.retries, stats.budget_denied), (2, 0), "{stats:?}");
}

#[tokio::test]
async fn a_new_clients_client_stream_gets_all_its_attempts() {
    let (uri, received) = serve(2).await;
    let channel = connect(uri).await;
    let policy = new_client_policy(5);
    let svc = stack(channel, &policy);
    let summary = tokio::time::timeout(Duration::from_secs(5), upload(svc, chunks(4, 100)))
        .await
        .expect("in time")
        .expect("the third attempt succeeds");
    assert_eq!((summary.messages, summary.bytes), (4, 400));
    assert_eq!(received.lock().expect("lock").len(), 3);
    let stats = policy.stats();
    assert_eq!((stats.retries, stats.budget_denied), (2, 0), "{stats:?}");
}

/// A client of the shape tonic-build generates: `tonic::client::Grpc` over any
/// `GrpcService`, one method per RPC.
struct UploadClient<T> {
    inner: tonic::client::Grpc<T>,
}

impl<T> UploadClient<T>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    fn new(inner: T) -> Self {
        UploadClient {
            inner: tonic::client::Grpc::new(inner),
        }
    }

    async fn one(&mut self, request: Request<Chunk>) -> Result<Response<Summary>, Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| Status::unknown(format!("service was not ready: {}", e.into())))?;
        self.inner
            .unary(
                request,
                PathAndQuery::from_static(UNARY_PATH),
                ProstCodec::<Chunk, Summary>::default(),
            )
            .await
    }
}

/// What an application keeps: the generated-shape client over the named standard stack.
#[cfg(feature = "tonic")]
struct App {
    upload: UploadClient<stormguard::stack::GrpcStack>,
}

#[cfg(feature = "tonic")]
#[tokio::test]
async fn a_generated_client_over_the_standard_stack_rides_out_unavailable() {
    let (uri, calls) = serve_unary(2).await;
    let channel = connect(uri).await;
    let stack = stormguard::StandardStack::new("upload");
    let mut app = App {
        upload: UploadClient::new(stack.grpc(channel)),
    };
    let call = app.upload.one(Request::new(Chunk { data: vec![7; 100] }));
    let summary = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("in time")
        .expect("the third attempt succeeds")
        .into_inner();
    assert_eq!(summary.bytes, 100);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let stats = stack.retry().stats();
    assert_eq!((stats.retries, stats.budget_denied), (2, 0), "{stats:?}");
}
