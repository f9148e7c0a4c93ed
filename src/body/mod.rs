//! Making streaming request bodies retryable.
//!
//! Tower's retry clones the request before each attempt, so a body must be `Clone` to be
//! retried. `String`, `Full<Bytes>` and `Empty` are, and they are simply cloned. The
//! bodies real clients stream — tonic's `Body`, hyper's `Incoming` — are not: their
//! bytes exist once, as they go over the wire.
//!
//! [`ReplayBody`] wraps such a body. The first attempt streams it as usual while each
//! frame's `Bytes` is kept (a reference-counted handle, not a copy) together with any
//! trailers. A retry then sends the same frames again from memory. There is a hard cap
//! on what is kept ([64 KiB](DEFAULT_MAX_REPLAY_BYTES) by default): past it the buffer
//! is dropped and that request is simply not retried. The same happens when the response
//! arrives before the body was completely sent, since the rest of the body was never
//! read. The first attempt is never failed or altered by any of this.
//!
//! A body the first attempt never read at all (its connection was refused, or the
//! request was handed back unwritten) is not lost with it: the attempt's copy hands the
//! untouched body on, and the retry streams it as the first attempt would have.
//!
//! The price: with `replay_bodies()` each request allocates one shared buffer (an
//! `Arc`), the body's box and an extension entry, and each frame of the first attempt
//! takes an uncontended lock to be kept. Bodies that are `Clone` need none of it under
//! the plain [`RetryLayer`](crate::RetryLayer).
//!
//! The stack for tonic, whose `Channel` takes its own body type, is under *gRPC and
//! tonic* in the [`retry`](crate::retry#grpc-and-tonic) module.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use crate::BoxError;

/// The default cap on the bytes kept to replay one request body: 64 KiB.
pub const DEFAULT_MAX_REPLAY_BYTES: usize = 64 * 1024;

/// A request body that can be sent again: the first attempt streams the wrapped body
/// and keeps its frames (up to a cap); clones replay them.
///
/// You rarely build one yourself: [`RetryLayer::replay_bodies`] wraps every request
/// body and lets the retry policy see whether it can be replayed, so that a request
/// whose body went over the cap, or was not sent to its end, is simply not retried.
/// A replay that is polled all the same (say a `ReplayBody` built by hand under the
/// plain [`RetryLayer`]) fails with [`NotReplayable`] rather than send a truncated
/// body as if it were whole.
///
/// # Clone
///
/// Clones share one buffer. Only the original streams the inner body; a clone yields
/// the kept frames and trailers, and is only sent by the retry layer once the original
/// was sent completely and within the cap, or was dropped before any of it was read
/// (the request never left): the next clone polled then streams the body itself, and
/// keeps it as the original would have.
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use stormguard::ReplayBody;
///
/// # tokio_test_block_on(async {
/// let original = ReplayBody::new(Full::new(Bytes::from_static(b"hello")), 1024);
/// let replay = original.clone();
/// assert_eq!(original.collect().await?.to_bytes(), "hello");
/// assert!(replay.is_replayable());
/// assert_eq!(replay.collect().await?.to_bytes(), "hello");
/// # Ok::<(), stormguard::BoxError>(())
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
/// # }
/// ```
///
/// [`RetryLayer`]: crate::RetryLayer
/// [`RetryLayer::replay_bodies`]: crate::RetryLayer::replay_bodies
pub struct ReplayBody<B> {
    shared: Arc<Mutex<Kept<B>>>,
    // The body itself, on the copy that streams it (boxed, so that it can be handed
    // on to another copy if this one is dropped before reading it).
    inner: Option<Pin<Box<B>>>,
    // Whether this copy has read from `inner` yet.
    read: bool,
    next_frame: usize,
    trailers_sent: bool,
    // The original's frame read ahead of hyper (see `poll_frame`), to hand out next.
    ahead: Option<Result<Frame<Bytes>, BoxError>>,
    // The original's end, read ahead of hyper.
    ended: bool,
}

struct Kept<B> {
    frames: Vec<Bytes>,
    trailers: Option<HeaderMap>,
    bytes: usize,
    cap: usize,
    /// The original reached its end.
    complete: bool,
    /// Past the cap, or the original failed: nothing is kept any more.
    abandoned: bool,
    /// The body, untouched, left by a copy dropped before it read any of it: the next
    /// copy polled streams it.
    untouched: Option<Pin<Box<B>>>,
}

impl<B> std::fmt::Debug for Kept<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept")
            .field("frames", &self.frames.len())
            .field("bytes", &self.bytes)
            .field("cap", &self.cap)
            .field("complete", &self.complete)
            .field("abandoned", &self.abandoned)
            .field("untouched", &self.untouched.is_some())
            .finish()
    }
}

impl<B> ReplayBody<B> {
    /// Wraps `body`, keeping at most `max_bytes` of it for replay.
    pub fn new(body: B, max_bytes: usize) -> Self {
        ReplayBody {
            shared: Arc::new(Mutex::new(Kept {
                frames: Vec::new(),
                trailers: None,
                bytes: 0,
                cap: max_bytes,
                complete: false,
                abandoned: false,
                untouched: None,
            })),
            inner: Some(Box::pin(body)),
            read: false,
            next_frame: 0,
            trailers_sent: false,
            ahead: None,
            ended: false,
        }
    }

    /// Whether a clone can send the whole body: the original was streamed to its end
    /// and fit under the cap, or was dropped before any of it was read.
    pub fn is_replayable(&self) -> bool {
        self.kept().is_replayable()
    }

    /// The bytes kept so far for replay.
    pub fn kept_bytes(&self) -> usize {
        self.kept().bytes
    }

    fn kept(&self) -> MutexGuard<'_, Kept<B>> {
        lock(&self.shared)
    }

    pub(crate) fn handle(&self) -> ReplayHandle
    where
        B: Send + 'static,
    {
        ReplayHandle(self.shared.clone())
    }
}

fn lock<B>(shared: &Mutex<Kept<B>>) -> MutexGuard<'_, Kept<B>> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<B> Drop for ReplayBody<B> {
    /// A copy dropped before it read any of its body leaves the body, untouched, to the
    /// next copy (the request was never sent: refused, or handed back unwritten).
    fn drop(&mut self) {
        if self.read {
            return;
        }
        if let Some(inner) = self.inner.take() {
            lock(&self.shared).untouched = Some(inner);
        }
    }
}

impl<B> Clone for ReplayBody<B> {
    fn clone(&self) -> Self {
        ReplayBody {
            shared: self.shared.clone(),
            inner: None,
            read: false,
            next_frame: 0,
            trailers_sent: false,
            ahead: None,
            ended: false,
        }
    }
}

impl<B> std::fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self.kept();
        f.debug_struct("ReplayBody")
            .field("original", &self.inner.is_some())
            .field("kept_bytes", &kept.bytes)
            .field("cap", &kept.cap)
            .field("complete", &kept.complete)
            .field("abandoned", &kept.abandoned)
            .finish()
    }
}

impl<B> Kept<B> {
    /// Whether a copy can send the whole body: the kept frames, or the untouched body.
    fn is_replayable(&self) -> bool {
        self.whole() || self.untouched.is_some()
    }

    /// Whether the kept frames are the whole body.
    fn whole(&self) -> bool {
        self.complete && !self.abandoned
    }

    fn keep(&mut self, data: &Bytes) {
        if self.abandoned {
            return;
        }
        match self.bytes.checked_add(data.len()) {
            Some(total) if total <= self.cap => {
                self.bytes = total;
                self.frames.push(data.clone());
            }
            _ => self.abandon(),
        }
    }

    /// Keeps a frame of the original: data up to the cap; trailers, which end the body
    /// (hyper polls no further after them), even when empty.
    fn record(&mut self, frame: &Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            self.keep(data);
        } else if let Some(trailers) = frame.trailers_ref() {
            if !self.abandoned {
                self.trailers = Some(trailers.clone());
            }
            self.complete = true;
        } else {
            // A frame kind http-body may add later: passed on, but not replayable.
            self.abandon();
        }
    }

    fn abandon(&mut self) {
        self.abandoned = true;
        self.frames = Vec::new();
        self.trailers = None;
        self.bytes = 0;
    }
}

/// The error a replay yields when there is nothing whole to replay: the original body
/// was not sent to its end, or went over the cap. The retry layer does not retry such a
/// request in the first place; this error is the safety net that keeps a replay from
/// ever sending a truncated body as if it were complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NotReplayable;

impl std::fmt::Display for NotReplayable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("request body cannot be replayed: it was not sent to its end or exceeded the replay cap")
    }
}

impl std::error::Error for NotReplayable {}

impl<B> Body for ReplayBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.inner.is_none() {
            let mut kept = lock(&this.shared);
            // A copy takes over a body its original left untouched, if there is one;
            // else it replays what the original kept.
            match kept.untouched.take() {
                Some(untouched) => this.inner = Some(untouched),
                None => return replay(&kept, &mut this.next_frame, &mut this.trailers_sent),
            }
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(Some(Err(NotReplayable.into())));
        };
        if this.ended {
            return Poll::Ready(None);
        }
        if let Some(ahead) = this.ahead.take() {
            // Already kept when it was read ahead.
            return Poll::Ready(Some(ahead));
        }
        // Pending reads nothing: the body stays whole, handed on if this copy is dropped.
        let Poll::Ready(polled) = inner.as_mut().poll_frame(cx) else {
            return Poll::Pending;
        };
        this.read = true;
        let frame = match polled {
            None => {
                lock(&this.shared).complete = true;
                this.ended = true;
                return Poll::Ready(None);
            }
            Some(Err(err)) => {
                lock(&this.shared).abandon();
                return Poll::Ready(Some(Err(err.into())));
            }
            Some(Ok(frame)) => into_bytes(frame),
        };
        {
            let mut kept = lock(&this.shared);
            kept.record(&frame);
            if frame.is_data() && inner.is_end_stream() {
                // It says it has ended: hyper polls no further, and nothing follows.
                kept.complete = true;
            }
        }
        // A body is whole only once its end or its trailers were seen. hyper's HTTP/2
        // polls on to that end, but over HTTP/1 with a `content-length` taken from an
        // exact size hint, hyper stops polling as soon as the last byte is sent, unless
        // the body says it has ended. So once an exact size hint reaches 0 and the body
        // does not say it has ended, the next frame is read here, ahead of hyper: the
        // end (whole), trailers (whole, kept and handed out next), or nothing yet
        // (not whole: the first attempt goes on unchanged, the request is not retried).
        if frame.is_data() && !inner.is_end_stream() && inner.size_hint().exact() == Some(0) {
            match inner.as_mut().poll_frame(cx) {
                Poll::Pending => {}
                Poll::Ready(None) => {
                    lock(&this.shared).complete = true;
                    this.ended = true;
                }
                Poll::Ready(Some(Err(err))) => {
                    lock(&this.shared).abandon();
                    this.ahead = Some(Err(err.into()));
                }
                Poll::Ready(Some(Ok(next))) => {
                    let next = into_bytes(next);
                    lock(&this.shared).record(&next);
                    this.ahead = Some(Ok(next));
                }
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Some(_) if self.ended => true,
            Some(_) if self.ahead.is_some() => false,
            Some(inner) => {
                let end = inner.is_end_stream();
                if end {
                    // hyper stops polling a body that says it has ended, so the end is
                    // recorded here as well as on `None`.
                    lock(&self.shared).complete = true;
                }
                end
            }
            None => {
                let kept = self.kept();
                if let Some(untouched) = &kept.untouched {
                    // What this copy will stream once polled.
                    return untouched.is_end_stream();
                }
                kept.whole()
                    && self.next_frame >= kept.frames.len()
                    && (self.trailers_sent || kept.trailers.is_none())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Some(inner) => inner.size_hint(),
            None => {
                let kept = self.kept();
                if let Some(untouched) = &kept.untouched {
                    // What this copy will stream once polled (hyper reads it first,
                    // for the `content-length`).
                    return untouched.size_hint();
                }
                if !kept.whole() {
                    return SizeHint::default();
                }
                let left: usize = kept
                    .frames
                    .iter()
                    .skip(self.next_frame)
                    .map(Bytes::len)
                    .sum();
                SizeHint::with_exact(left as u64)
            }
        }
    }
}

/// The next frame of a replay from what the original `kept`, if it is the whole body;
/// `next_frame` and `trailers_sent` are the replaying copy's place in it.
fn replay<B>(
    kept: &Kept<B>,
    next_frame: &mut usize,
    trailers_sent: &mut bool,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    if !kept.whole() {
        return Poll::Ready(Some(Err(NotReplayable.into())));
    }
    if let Some(data) = kept.frames.get(*next_frame) {
        *next_frame += 1;
        return Poll::Ready(Some(Ok(Frame::data(data.clone()))));
    }
    if !*trailers_sent {
        *trailers_sent = true;
        if let Some(trailers) = &kept.trailers {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers.clone()))));
        }
    }
    Poll::Ready(None)
}

fn into_bytes<D: Buf>(frame: Frame<D>) -> Frame<Bytes> {
    frame.map_data(|mut data| data.copy_to_bytes(data.remaining()))
}

/// What the retry policy asks of a [`ReplayBody`]'s shared state, whatever its body.
trait Replayable: Send + Sync {
    fn is_replayable(&self) -> bool;
    fn is_whole(&self) -> bool;
}

impl<B: Send> Replayable for Mutex<Kept<B>> {
    fn is_replayable(&self) -> bool {
        lock(self).is_replayable()
    }

    fn is_whole(&self) -> bool {
        lock(self).whole()
    }
}

/// The retry policy's view of a [`ReplayBody`], carried in the request extensions.
#[derive(Clone)]
pub(crate) struct ReplayHandle(Arc<dyn Replayable>);

impl ReplayHandle {
    /// The handle of a body that can never be sent again (a reqwest streaming body).
    #[cfg(feature = "reqwest")]
    pub(crate) fn never() -> Self {
        struct Never;
        impl Replayable for Never {
            fn is_replayable(&self) -> bool {
                false
            }
            fn is_whole(&self) -> bool {
                false
            }
        }
        ReplayHandle(Arc::new(Never))
    }

    /// Whether one more copy can send the whole body: from the kept frames, or by
    /// streaming a body the original left unread (which only one copy can).
    pub(crate) fn is_replayable(&self) -> bool {
        self.0.is_replayable()
    }

    /// Whether the kept frames are the whole body, for any number of copies.
    pub(crate) fn is_whole(&self) -> bool {
        self.0.is_whole()
    }
}

impl std::fmt::Debug for ReplayHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayHandle")
            .field("replayable", &self.is_replayable())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::convert::Infallible;

    use http_body_util::{BodyExt, Full};

    /// A streaming body that yields its frames one by one; it is not `Clone`.
    struct Frames(VecDeque<Frame<Bytes>>);

    impl Frames {
        fn new(data: &[&'static str], trailers: Option<(&'static str, &'static str)>) -> Self {
            let mut frames: VecDeque<_> = data
                .iter()
                .map(|d| Frame::data(Bytes::from_static(d.as_bytes())))
                .collect();
            if let Some((name, value)) = trailers {
                let mut map = HeaderMap::new();
                map.insert(name, http::HeaderValue::from_static(value));
                frames.push_back(Frame::trailers(map));
            }
            Frames(frames)
        }
    }

    impl Body for Frames {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    /// Polls `body` for `n` frames only, as hyper does when it knows the body has ended.
    async fn take_frames<B: Body<Error = BoxError> + Unpin>(
        body: &mut B,
        n: usize,
    ) -> Vec<Frame<B::Data>> {
        let mut out = Vec::new();
        for _ in 0..n {
            if let Some(frame) = body.frame().await {
                out.push(frame.expect("frame"));
            }
        }
        out
    }

    #[tokio::test]
    async fn trailers_are_kept_and_end_the_body() {
        let mut original = ReplayBody::new(Frames::new(&["ab", "cd"], Some(("x-sum", "7"))), 1024);
        let replay = original.clone();
        // Like hyper, stop after the trailers frame without polling for the end.
        let sent = take_frames(&mut original, 3).await;
        assert!(sent[2].is_trailers());
        assert!(replay.is_replayable());
        let again = replay.collect().await.expect("replay");
        assert_eq!(
            again.trailers().map(|t| &t["x-sum"]),
            Some(&http::HeaderValue::from_static("7"))
        );
        assert_eq!(again.to_bytes(), "abcd");
    }

    #[tokio::test]
    async fn an_exact_length_body_is_complete_once_sent() {
        let mut original = ReplayBody::new(Full::new(Bytes::from_static(b"hello")), 1024);
        let replay = original.clone();
        take_frames(&mut original, 1).await;
        assert!(replay.is_replayable());
        assert_eq!(replay.size_hint().exact(), Some(5));
    }

    #[tokio::test]
    async fn over_the_cap_the_first_attempt_is_intact_and_a_replay_refuses() {
        let original = ReplayBody::new(Frames::new(&["0123456789"; 3], None), 25);
        let replay = original.clone();
        assert_eq!(original.collect().await.expect("body").to_bytes().len(), 30);
        assert!(!replay.is_replayable());
        assert_eq!(replay.kept_bytes(), 0, "the buffer is freed past the cap");
        let err = replay.collect().await.expect_err("not replayable");
        assert!(err.is::<NotReplayable>());
    }

    #[tokio::test]
    async fn a_body_not_sent_to_its_end_is_not_replayed() {
        let mut original = ReplayBody::new(Frames::new(&["ab", "cd", "ef"], None), 1024);
        let replay = original.clone();
        take_frames(&mut original, 1).await;
        drop(original);
        assert!(!replay.is_replayable());
        assert!(!replay.is_end_stream());
        let err = replay
            .collect()
            .await
            .expect_err("truncated bodies are never sent");
        assert!(err.is::<NotReplayable>());
    }

    #[tokio::test]
    async fn a_body_never_read_is_handed_to_the_next_copy() {
        // The first attempt's connection was refused: its copy is dropped unread.
        let original =
            ReplayBody::new(Frames::new(&["ab", "cd"], Some(("grpc-status", "0"))), 1024);
        let (retry, later) = (original.clone(), original.clone());
        assert!(!retry.is_replayable(), "the original may still send it");
        drop(original);
        assert!(retry.is_replayable() && later.is_replayable());
        // The retry streams it, whole, trailers and all...
        let sent = retry.collect().await.expect("streamed");
        assert_eq!(
            sent.trailers().map(|t| t["grpc-status"].clone()),
            Some("0".parse().expect("value"))
        );
        assert_eq!(sent.to_bytes(), "abcd");
        // ...keeping it as the original would have, for the next copy.
        let replayed = later.collect().await.expect("replayed");
        assert_eq!(replayed.to_bytes(), "abcd");
    }

    #[test]
    fn a_copy_of_a_body_never_read_reports_its_size() {
        let original = ReplayBody::new(Full::new(Bytes::from_static(b"hello")), 1024);
        let retry = original.clone();
        drop(original);
        // hyper reads the size before the first poll, for the `content-length`.
        assert_eq!(retry.size_hint().exact(), Some(5));
        assert!(!retry.is_end_stream());
    }

    /// A body with an exact size hint (the bytes left) that never says it has ended, as
    /// a body streamed from a file of known length might; its trailers, if any, can be
    /// not ready on the first poll.
    struct Exact {
        frames: VecDeque<Frame<Bytes>>,
        left: u64,
        trailers_pending_once: bool,
    }

    impl Exact {
        fn new(data: &'static str, trailers: Option<HeaderMap>, pending: bool) -> Self {
            let mut frames = VecDeque::from([Frame::data(Bytes::from_static(data.as_bytes()))]);
            frames.extend(trailers.map(Frame::trailers));
            Exact {
                frames,
                left: data.len() as u64,
                trailers_pending_once: pending,
            }
        }
    }

    impl Body for Exact {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.trailers_pending_once && self.frames.front().is_some_and(Frame::is_trailers) {
                self.trailers_pending_once = false;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let frame = self.frames.pop_front();
            if let Some(data) = frame.as_ref().and_then(Frame::data_ref) {
                self.left -= data.len() as u64;
            }
            Poll::Ready(frame.map(Ok))
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.left)
        }
    }

    fn trailers(name: &'static str, value: &'static str) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(name, http::HeaderValue::from_static(value));
        map
    }

    /// Found by the fuzzer: an exact size hint reaching 0 was taken for the end, so a
    /// body whose trailers were never read was replayed whole but without them.
    #[tokio::test]
    async fn exact_size_with_trailers_not_yet_read_is_not_replayable() {
        let body = Exact::new("abcd", Some(trailers("x-sum", "7")), true);
        let mut original = ReplayBody::new(body, 1024);
        let replay = original.clone();
        // The first attempt is dropped after the data (the response came first).
        let sent = take_frames(&mut original, 1).await;
        assert_eq!(sent.len(), 1);
        assert!(!original.is_end_stream(), "the trailers are still to come");
        drop(original);
        assert!(!replay.is_replayable());
        let err = replay
            .collect()
            .await
            .expect_err("never sent without its trailers");
        assert!(err.is::<NotReplayable>());
    }

    #[tokio::test]
    async fn exact_size_with_trailers_is_sent_and_replayed_identically() {
        let body = Exact::new("abcd", Some(trailers("x-sum", "7")), false);
        let mut original = ReplayBody::new(body, 1024);
        let replay = original.clone();
        let first = take_frames(&mut original, 1).await;
        // The trailers were read ahead of the caller; they are still handed out next.
        assert!(replay.is_replayable());
        assert!(!original.is_end_stream());
        let rest = original.collect().await.expect("rest");
        assert_eq!(first[0].data_ref().map(|d| &d[..]), Some(&b"abcd"[..]));
        assert_eq!(rest.trailers(), Some(&trailers("x-sum", "7")));
        let again = replay.collect().await.expect("replay");
        assert_eq!(again.trailers(), Some(&trailers("x-sum", "7")));
        assert_eq!(again.to_bytes(), "abcd");
    }

    /// hyper's HTTP/1 client stops polling a `content-length` body after its last byte;
    /// a body without trailers that does not say it has ended is whole all the same.
    #[tokio::test]
    async fn exact_size_without_trailers_is_whole_after_its_last_byte() {
        let mut original = ReplayBody::new(Exact::new("abcd", None, false), 1024);
        let replay = original.clone();
        take_frames(&mut original, 1).await;
        assert!(original.is_end_stream());
        drop(original);
        assert!(replay.is_replayable());
        let again = replay.collect().await.expect("replay");
        assert_eq!(again.trailers(), None);
        assert_eq!(again.to_bytes(), "abcd");
    }

    /// Found by the fuzzer: replay exactly what was sent, an empty trailer map included.
    #[tokio::test]
    async fn an_empty_trailer_map_is_replayed_as_sent() {
        let frames = VecDeque::from([
            Frame::data(Bytes::from_static(b"ab")),
            Frame::trailers(HeaderMap::new()),
        ]);
        let mut original = ReplayBody::new(Frames(frames), 1024);
        let mut replay = original.clone();
        let sent = take_frames(&mut original, 3).await;
        let again = take_frames(&mut replay, 3).await;
        assert_eq!(sent.len(), 2);
        assert_eq!(again.len(), 2);
        assert_eq!(again[1].trailers_ref(), Some(&HeaderMap::new()));
        assert!(replay.frame().await.is_none());
    }
}
