//! A connector for hyper-util's client whose connections say when they have closed, so
//! that the retry layer can prove a timed-out request was never written.
//!
//! # The request hyper strands
//!
//! hyper-util's client hands each request to a connection's dispatch task through a
//! channel. When an HTTP/2 server drains a connection (a GOAWAY: an nginx reload, a
//! rolling restart, `keepalive_requests`), the dispatch task ends the next time a
//! request wakes it, dropping its end of the channel. A request sent into the channel
//! at that very moment can be left in it: tokio's channel drains what it holds when its
//! receiver is dropped, but a send already under way when the receiver closes lands
//! after the drain, and stays until the last sender is gone. The request's own handle
//! on the connection is one of the senders, so nothing ever answers it: it waits until
//! its attempt times out, though not one byte of it was written. (An HTTP/1.1
//! connection that closes as a request is handed to it can strand it the same way.)
//!
//! The retry layer cannot tell that timeout from one whose request the server is still
//! working on, so it retries it only when the request may be repeated: a POST is lost.
//! In the repository's drain test (`tests/drain.rs`: 2,000 requests, half POST, 32 at a
//! time, a server draining each HTTP/2 connection every 10 requests) this happened in
//! one or two runs in a hundred. docs/checking.md has the evidence and the fix it
//! calls for in hyper.
//!
//! # What a tracked connection proves
//!
//! Build the client on a [`TrackedConnector`]. Each of its connections then carries
//! a mark that is set when the connection's I/O is dropped, after which nothing more can
//! be written on it. The retry layer, for each attempt of a request it would not repeat
//! after a timeout, asks hyper-util which connection the attempt was handed
//! ([`capture_connection`](hyper_util::client::legacy::connect::capture_connection)) and
//! puts a token among the request's extensions. hyper drops a request's extensions when
//! it hands the request to the connection's writer, before a byte of it is written
//! (h2 clears them before it opens the stream; HTTP/1.1 drops them with the head once
//! encoded; `tests/handoff.rs` pins both). So when an attempt fails, the connection it
//! was handed has closed, and the token is still alive, the request was never written
//! and never will be: the retry layer retries it at once, as a request the server never
//! saw ([`Unprocessed`](crate::Unprocessed), a transparent retry), whatever its method.
//!
//! The retry layer learns from the first response of a request it tracks whether the
//! client below it uses a tracked connector, and stops tracking if not, so a client
//! without one pays nothing after its first request. Requests it may repeat anyway
//! (idempotent methods, an `Idempotency-Key`, [`Idempotent`](crate::Idempotent)) are not
//! tracked. The proof needs hyper-util's client directly below the retry layer, with
//! nothing between but layers that pass the request on whole (this crate's breaker,
//! tower's timeout). It reaches only hyper-util's legacy `Client`: reqwest builds its own
//! connector inside, and a tonic `Channel` drives hyper's connections itself, so their
//! stranded requests still wait out the attempt timeout (and a POST that does is not
//! sent again).
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::{connect::HttpConnector, Client};
//! use hyper_util::rt::TokioExecutor;
//! use stormguard::connect::TrackedConnector;
//! use stormguard::StandardStack;
//!
//! let connector = TrackedConnector::new(HttpConnector::new());
//! let client = Client::builder(TokioExecutor::new()).build::<_, Full<Bytes>>(connector);
//! let _orders = StandardStack::new("orders").http(client);
//! ```

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection};
use tower_service::Service;

/// A connector whose connections mark themselves closed when their I/O is dropped; see
/// the [module docs](self) for what the retry layer proves with the mark.
#[derive(Clone, Debug)]
pub struct TrackedConnector<C> {
    inner: C,
}

impl<C> TrackedConnector<C> {
    /// Tracks the connections `inner` makes.
    pub fn new(inner: C) -> Self {
        TrackedConnector { inner }
    }

    /// The connector wrapped.
    pub fn get_ref(&self) -> &C {
        &self.inner
    }

    /// The connector wrapped, consuming the tracked one.
    pub fn into_inner(self) -> C {
        self.inner
    }
}

impl<C> Service<Uri> for TrackedConnector<C>
where
    C: Service<Uri>,
{
    type Response = TrackedIo<C::Response>;
    type Error = C::Error;
    type Future = Connecting<C::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        Connecting {
            inner: self.inner.call(dst),
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of a [`TrackedConnector`]'s connection.
    pub struct Connecting<F> {
        #[pin]
        inner: F,
    }
}

impl<F> fmt::Debug for Connecting<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connecting").finish_non_exhaustive()
    }
}

impl<F, T, E> Future for Connecting<F>
where
    F: Future<Output = Result<T, E>>,
{
    type Output = Result<TrackedIo<T>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx).map_ok(|io| TrackedIo {
            io,
            closed: Closed::default(),
        })
    }
}

/// A connection made by a [`TrackedConnector`]: its I/O, and the mark set when it is
/// dropped.
pub struct TrackedIo<T> {
    io: T,
    closed: Closed,
}

impl<T> fmt::Debug for TrackedIo<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedIo")
            .field("closed", &self.closed.is_closed())
            .finish_non_exhaustive()
    }
}

impl<T> Drop for TrackedIo<T> {
    fn drop(&mut self) {
        self.closed.0.store(true, Ordering::SeqCst);
    }
}

impl<T: Connection> Connection for TrackedIo<T> {
    fn connected(&self) -> Connected {
        self.io.connected().extra(self.closed.clone())
    }
}

impl<T: Read + Unpin> Read for TrackedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for TrackedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

/// The mark a tracked connection carries in its [`Connected`] extras (and so in the
/// extensions of the responses it brings): set once its I/O is dropped.
#[derive(Clone, Debug, Default)]
pub(crate) struct Closed(Arc<AtomicBool>);

impl Closed {
    /// Whether the connection's I/O has been dropped: nothing more is written on it.
    pub(crate) fn is_closed(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}
