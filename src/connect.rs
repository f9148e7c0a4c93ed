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
//! The repository's drain test (`tests/drain.rs`, a server draining its HTTP/2
//! connections every few requests) meets it now and then;
//! `tests/handoff.rs` reproduces the race that strands them.
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
//! # What it proves of a GOAWAY
//!
//! A GOAWAY from an HTTP/2 server names the last stream it took: the streams above it
//! were not processed (RFC 9113, 6.8). h2 fails those streams with the GOAWAY, and
//! requests given no stream after it; but hyper's client also hands the GOAWAY to the
//! request whose stream it opened just as the GOAWAY was read, and drops that stream,
//! which the server may have taken and acted on. The error is the same in all three
//! cases, so on its own it proves nothing, and a request the retry layer may not repeat
//! is not sent again on it. A tracked connection follows the heads of the HTTP/2 frames
//! on it (the streams the client wrote, the server's GOAWAYs), and the retry layer
//! takes a GOAWAY as proof that the request was not processed when either holds:
//!
//! - the request was handed to the connection after h2 had acted on its first GOAWAY
//!   (h2 then opens no stream for it);
//! - the client wrote a stream above the GOAWAY's last stream id. The request hyper
//!   abandons is the last stream the connection opened, so its stream is above the
//!   last stream id too;
//! - two or more of the requests the layer tracks failed on the connection with a
//!   GOAWAY. hyper abandons at most one request on a connection, and then refuses none
//!   (nor abandons one after refusing), so one of the two had a stream above the last
//!   stream id, and the abandoned one is above it too. The failures of one GOAWAY come
//!   together, so a request whose failure proves nothing yet waits for the others, at
//!   most until its connection closes or as long as its first retry's backoff could
//!   (200 ms by default).
//!
//! What none proves (a POST hyper abandoned, the only tracked failure on a connection
//! where no stream was written past the GOAWAY's last id) fails at the caller; an
//! `Idempotency-Key` lets it be sent again. Over a client whose connections are not
//! tracked (hyper-util's without this connector, reqwest's, a tonic `Channel`), every
//! request the retry layer may not repeat that fails with a GOAWAY fails at the caller:
//! against nginx draining every 50 requests, about one POST in six.
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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBuf, ReadBufCursor, Write};
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
            mark: Mark::default(),
            written: Frames::preface(),
            read: Frames::new(),
            scratch: Vec::new(),
        })
    }
}

/// A connection made by a [`TrackedConnector`]: its I/O, the mark it carries, and what
/// it follows of the HTTP/2 frames on it.
pub struct TrackedIo<T> {
    io: T,
    mark: Mark,
    /// The frames written: the streams whose heads went out.
    written: Frames,
    /// The frames read: the GOAWAYs.
    read: Frames,
    /// Where a read lands to be looked at before it is handed on (HTTP/2 only).
    scratch: Vec<u8>,
}

impl<T> fmt::Debug for TrackedIo<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedIo")
            .field("mark", &self.mark)
            .finish_non_exhaustive()
    }
}

impl<T> Drop for TrackedIo<T> {
    fn drop(&mut self) {
        self.mark.goaway_acted_on();
        self.mark.0.closed.store(true, Ordering::SeqCst);
        self.mark.0.changed.notify_waiters();
    }
}

impl<T: Connection> Connection for TrackedIo<T> {
    fn connected(&self) -> Connected {
        self.io.connected().extra(self.mark.clone())
    }
}

/// The most a read looks at in one go on an HTTP/2 connection.
const SCRATCH: usize = 16 * 1024;

impl<T: Read + Unpin> Read for TrackedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.written.is_off() {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        // h2 takes in every frame of a read before it reads again: a GOAWAY the last
        // read brought in has been acted on by now.
        this.mark.goaway_acted_on();
        // Read into the scratch space, follow the frames, then hand the bytes on.
        let want = buf.remaining().min(SCRATCH);
        if this.scratch.len() < want {
            this.scratch.resize(want, 0);
        }
        let mut scratch = ReadBuf::new(&mut this.scratch[..want]);
        std::task::ready!(Pin::new(&mut this.io).poll_read(cx, scratch.unfilled()))?;
        let filled = scratch.filled();
        let mark = &this.mark;
        this.read.follow(filled, |kind, stream, payload| {
            mark.read(kind, stream, payload)
        });
        buf.put_slice(filled);
        Poll::Ready(Ok(()))
    }
}

impl<T: Write + Unpin> Write for TrackedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = std::task::ready!(Pin::new(&mut this.io).poll_write(cx, buf))?;
        this.wrote(&buf[..n]);
        Poll::Ready(Ok(n))
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
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = std::task::ready!(Pin::new(&mut this.io).poll_write_vectored(cx, bufs))?;
        let mut left = n;
        for slice in bufs {
            if left == 0 {
                break;
            }
            let taken = left.min(slice.len());
            this.wrote(&slice[..taken]);
            left -= taken;
        }
        Poll::Ready(Ok(n))
    }
}

impl<T> TrackedIo<T> {
    /// Follows the bytes the connection took: the heads of the streams it opened.
    fn wrote(&mut self, bytes: &[u8]) {
        let mark = &self.mark;
        self.written
            .follow(bytes, |kind, stream, _| mark.wrote(kind, stream));
    }
}

/// The mark a tracked connection carries in its [`Connected`] extras (and so in the
/// extensions of the responses it brings).
#[derive(Clone, Debug, Default)]
pub(crate) struct Mark(Arc<MarkState>);

#[derive(Debug)]
struct MarkState {
    /// Set once the connection's I/O is dropped: nothing more is written on it.
    closed: AtomicBool,
    /// The highest stream whose HEADERS frame the client wrote (HTTP/2; 0 for none).
    headers: AtomicU32,
    /// The lowest last stream id of the GOAWAYs the server sent ([`NO_GOAWAY`] for none).
    goaway_last: AtomicU32,
    /// How far the connection is with the server's first GOAWAY ([`GoawayPhase`]).
    goaway_phase: AtomicU8,
    /// How many tracked requests failed on it with a GOAWAY ([`Mark::note_drained`]).
    drained: AtomicU32,
    /// Told when `drained` grows or the connection closes.
    changed: tokio::sync::Notify,
}

/// How far a connection is with the server's first GOAWAY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub(crate) enum GoawayPhase {
    /// None has been read.
    None = 0,
    /// Read, and maybe not yet acted on.
    Read = 1,
    /// Acted on: h2 gives no new stream on the connection.
    ActedOn = 2,
}

const NO_GOAWAY: u32 = u32::MAX;

impl Default for MarkState {
    fn default() -> Self {
        MarkState {
            closed: AtomicBool::new(false),
            headers: AtomicU32::new(0),
            goaway_last: AtomicU32::new(NO_GOAWAY),
            goaway_phase: AtomicU8::new(GoawayPhase::None as u8),
            drained: AtomicU32::new(0),
            changed: tokio::sync::Notify::new(),
        }
    }
}

impl Mark {
    /// Whether the connection's I/O has been dropped: nothing more is written on it.
    pub(crate) fn is_closed(&self) -> bool {
        self.0.closed.load(Ordering::SeqCst)
    }

    /// Whether the client wrote the head of a stream above the last stream id of a GOAWAY
    /// the server sent on this connection.
    ///
    /// Then no request on it that failed with the GOAWAY was processed. h2 fails with the
    /// GOAWAY the streams above its last id, and requests given no stream; hyper's HTTP/2
    /// client also hands it to the one request whose stream it opened as the GOAWAY was
    /// read, a stream the server may have taken. That stream is the last the connection
    /// opened (hyper opens none after it), so when a stream above the last id was written,
    /// that request's stream is above it too.
    pub(crate) fn wrote_above_goaway(&self) -> bool {
        let last = self.0.goaway_last.load(Ordering::SeqCst);
        last != NO_GOAWAY && self.0.headers.load(Ordering::SeqCst) > last
    }

    /// Counts a tracked request that failed on the connection with a GOAWAY, and says
    /// how many have.
    ///
    /// Two or more prove that none of them was processed. Each is a request h2 gave no
    /// stream (the connection had already acted on the GOAWAY), a stream above the
    /// GOAWAY's last stream id, or the one request hyper abandoned as the GOAWAY was read
    /// (see [`Mark::wrote_above_goaway`]). hyper opens no stream after the one it
    /// abandons, and gives none after a request h2 refused, so a connection has at most
    /// one of those two and never both: with two failures, one is a stream above the
    /// last stream id, and the abandoned stream, the last opened, is above it too.
    pub(crate) fn note_drained(&self) -> u32 {
        let drained = self.0.drained.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.changed.notify_waiters();
        drained
    }

    /// Whether two or more tracked requests failed on the connection with a GOAWAY
    /// ([`Mark::note_drained`]), or the client wrote a stream above a GOAWAY's last id.
    pub(crate) fn drain_proved(&self) -> bool {
        self.0.drained.load(Ordering::SeqCst) >= 2 || self.wrote_above_goaway()
    }

    /// Waits until the connection's proof that a GOAWAY failure was not processed
    /// ([`Mark::drain_proved`]) holds, the connection closes, or `limit` passes; says
    /// whether the proof holds.
    pub(crate) async fn settle(self, limit: std::time::Duration) -> bool {
        let _ = tokio::time::timeout(limit, async {
            loop {
                let changed = self.0.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if self.drain_proved() || self.is_closed() {
                    return;
                }
                changed.await;
            }
        })
        .await;
        self.drain_proved()
    }

    /// How far the connection is with the server's first GOAWAY.
    pub(crate) fn goaway_phase(&self) -> GoawayPhase {
        match self.0.goaway_phase.load(Ordering::SeqCst) {
            0 => GoawayPhase::None,
            1 => GoawayPhase::Read,
            _ => GoawayPhase::ActedOn,
        }
    }

    /// Records a frame the client wrote: a HEADERS frame's stream.
    fn wrote(&self, kind: u8, stream: u32) {
        if kind == HEADERS {
            self.0.headers.fetch_max(stream, Ordering::SeqCst);
        }
    }

    /// Records a frame the server sent: a GOAWAY's last stream id (the first four bytes
    /// of its payload).
    fn read(&self, kind: u8, stream: u32, payload: [u8; 4]) {
        if kind == GOAWAY && stream == 0 {
            self.goaway(payload);
        }
    }

    /// Records a GOAWAY's payload (its first four bytes: the last stream id).
    fn goaway(&self, payload: [u8; 4]) {
        let last = u32::from_be_bytes(payload) & STREAM_ID;
        self.0.goaway_last.fetch_min(last, Ordering::SeqCst);
        let _ = self.0.goaway_phase.compare_exchange(
            GoawayPhase::None as u8,
            GoawayPhase::Read as u8,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    /// Notes that a GOAWAY read, if any, has been acted on.
    fn goaway_acted_on(&self) {
        let _ = self.0.goaway_phase.compare_exchange(
            GoawayPhase::Read as u8,
            GoawayPhase::ActedOn as u8,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }
}

/// HTTP/2's client connection preface (RFC 9113, 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Frame types (RFC 9113, 6).
const HEADERS: u8 = 0x1;
const GOAWAY: u8 = 0x7;
/// A stream id without its reserved bit.
const STREAM_ID: u32 = 0x7fff_ffff;

/// Follows the frames of one direction of an HTTP/2 connection by their 9-byte heads,
/// skipping payloads, with the first four bytes of each payload kept (a GOAWAY's last
/// stream id). A connection that does not open with HTTP/2's preface is not followed.
#[derive(Debug)]
struct Frames {
    state: Follow,
    head: [u8; 9],
    have: usize,
    /// Payload bytes left of the current frame.
    left: usize,
    /// The current frame's first payload bytes.
    start: [u8; 4],
    kept: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Follow {
    /// Matching the preface: this many bytes matched so far.
    Preface(usize),
    Head,
    Payload,
    Off,
}

impl Frames {
    fn new() -> Self {
        Frames {
            state: Follow::Head,
            head: [0; 9],
            have: 0,
            left: 0,
            start: [0; 4],
            kept: 0,
        }
    }

    fn preface() -> Self {
        Frames {
            state: Follow::Preface(0),
            ..Frames::new()
        }
    }

    fn is_off(&self) -> bool {
        self.state == Follow::Off
    }

    /// Follows `bytes`, calling `seen(type, stream id, first payload bytes)` for each
    /// frame whose payload has ended (or whose first four payload bytes are in).
    fn follow(&mut self, mut bytes: &[u8], mut seen: impl FnMut(u8, u32, [u8; 4])) {
        while !bytes.is_empty() {
            match self.state {
                Follow::Off => return,
                Follow::Preface(matched) => {
                    let n = bytes.len().min(PREFACE.len() - matched);
                    if bytes[..n] != PREFACE[matched..matched + n] {
                        self.state = Follow::Off;
                        return;
                    }
                    bytes = &bytes[n..];
                    self.state = match matched + n {
                        done if done == PREFACE.len() => Follow::Head,
                        matched => Follow::Preface(matched),
                    };
                }
                Follow::Head => {
                    let n = bytes.len().min(9 - self.have);
                    self.head[self.have..self.have + n].copy_from_slice(&bytes[..n]);
                    self.have += n;
                    bytes = &bytes[n..];
                    if self.have == 9 {
                        self.have = 0;
                        let [a, b, c, ..] = self.head;
                        self.left = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
                        self.kept = 0;
                        self.start = [0; 4];
                        self.state = Follow::Payload;
                        if self.left == 0 {
                            self.frame_seen(&mut seen);
                        }
                    }
                }
                Follow::Payload => {
                    let n = bytes.len().min(self.left);
                    let keep = n.min(4 - self.kept);
                    self.start[self.kept..self.kept + keep].copy_from_slice(&bytes[..keep]);
                    self.kept += keep;
                    self.left -= n;
                    bytes = &bytes[n..];
                    if self.left == 0 {
                        self.frame_seen(&mut seen);
                    }
                }
            }
        }
    }

    fn frame_seen(&mut self, seen: &mut impl FnMut(u8, u32, [u8; 4])) {
        let [.., kind, _flags, s0, s1, s2, s3] = self.head;
        let stream = u32::from_be_bytes([s0, s1, s2, s3]) & STREAM_ID;
        // A GOAWAY shorter than its last stream id is malformed: not taken.
        if kind != GOAWAY || self.kept == 4 {
            seen(kind, stream, self.start);
        }
        self.state = Follow::Head;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn frame(kind: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut bytes = len.to_be_bytes()[1..].to_vec();
        bytes.extend([kind, 0]);
        bytes.extend(stream.to_be_bytes());
        bytes.extend(payload);
        bytes
    }

    /// Follows the bytes the client wrote, or read (`read`), a few at a time, as writes
    /// and reads come, into `mark`.
    fn follow_in_pieces(frames: &mut Frames, bytes: &[u8], mark: &Mark, piece: usize) {
        let read = !matches!(frames.state, Follow::Preface(_));
        for chunk in bytes.chunks(piece) {
            frames.follow(chunk, |kind, stream, payload| {
                if read {
                    mark.read(kind, stream, payload);
                } else {
                    mark.wrote(kind, stream);
                }
            });
        }
    }

    #[test]
    fn follows_the_streams_written_and_the_goaways_read_in_any_pieces() {
        let mut written = PREFACE.to_vec();
        written.extend(frame(0x4, 0, &[0; 6])); // SETTINGS
        written.extend(frame(HEADERS, 1, &[0x82; 30]));
        written.extend(frame(0x0, 1, &[7; 100])); // DATA
        written.extend(frame(HEADERS, 3, &[]));
        let mut read = frame(0x4, 0, &[]);
        // GOAWAY, last stream 1, NO_ERROR, with debug data; the reserved bit set.
        read.extend(frame(
            GOAWAY,
            0,
            &[0x80, 0, 0, 1, 0, 0, 0, 0, b'b', b'y', b'e'],
        ));
        for piece in [1, 2, 5, 9, 1000] {
            let mark = Mark::default();
            assert!(!mark.wrote_above_goaway());
            follow_in_pieces(&mut Frames::preface(), &written, &mark, piece);
            assert_eq!(mark.0.headers.load(Ordering::SeqCst), 3);
            assert!(!mark.wrote_above_goaway(), "no GOAWAY yet");
            follow_in_pieces(&mut Frames::new(), &read, &mark, piece);
            assert_eq!(mark.0.goaway_last.load(Ordering::SeqCst), 1);
            assert_eq!(mark.goaway_phase(), GoawayPhase::Read);
            assert!(mark.wrote_above_goaway(), "stream 3 is above the last, 1");
            mark.goaway_acted_on();
            assert_eq!(mark.goaway_phase(), GoawayPhase::ActedOn);
        }
    }

    #[test]
    fn a_later_goaway_only_lowers_the_last_stream() {
        let mark = Mark::default();
        mark.0.headers.store(5, Ordering::SeqCst);
        mark.goaway(0x7fff_ffffu32.to_be_bytes());
        assert!(
            !mark.wrote_above_goaway(),
            "a graceful GOAWAY names every stream"
        );
        mark.goaway(3u32.to_be_bytes());
        mark.goaway(9u32.to_be_bytes());
        assert!(mark.wrote_above_goaway());
    }

    #[test]
    fn a_connection_that_is_not_http2_is_not_followed() {
        let mut frames = Frames::preface();
        let mark = Mark::default();
        follow_in_pieces(&mut frames, b"POST / HTTP/1.1\r\n\r\n", &mark, 3);
        assert!(frames.is_off());
        assert_eq!(mark.0.headers.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_goaway_failure_settles_the_first() {
        let mark = Mark::default();
        assert_eq!(mark.note_drained(), 1);
        let waiting = tokio::spawn(mark.clone().settle(Duration::from_millis(200)));
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(!waiting.is_finished(), "one failure alone proves nothing");
        assert_eq!(mark.note_drained(), 2);
        assert!(waiting.await.expect("settled"), "two do");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_goaway_failure_is_given_up_at_the_limit_or_the_close() {
        let mark = Mark::default();
        mark.note_drained();
        let started = tokio::time::Instant::now();
        assert!(!mark.clone().settle(Duration::from_millis(200)).await);
        assert_eq!(started.elapsed(), Duration::from_millis(200));

        let mark = Mark::default();
        mark.note_drained();
        let waiting = tokio::spawn(mark.clone().settle(Duration::from_secs(60)));
        tokio::time::sleep(Duration::from_millis(5)).await;
        mark.0.closed.store(true, Ordering::SeqCst);
        mark.0.changed.notify_waiters();
        assert!(!waiting.await.expect("settled"));
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the close ends the wait"
        );
    }

    #[test]
    fn a_goaway_cut_short_is_not_taken() {
        let mark = Mark::default();
        follow_in_pieces(&mut Frames::new(), &frame(GOAWAY, 0, &[0, 0]), &mark, 4);
        assert_eq!(mark.goaway_phase(), GoawayPhase::None);
    }
}
