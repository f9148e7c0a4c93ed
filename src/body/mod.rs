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
//! on what is kept ([64 KiB] by default): past it the buffer is dropped and that request
//! is simply not retried. The same happens when the response arrives before the body
//! was completely sent, since the rest of the body was never read. The first attempt is
//! never failed or altered by any of this.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// The default cap on the bytes kept to replay one request body: 64 KiB.
pub const DEFAULT_MAX_REPLAY_BYTES: usize = 64 * 1024;

pin_project! {
    /// A request body that can be sent again: the first attempt streams the wrapped body
    /// and keeps its frames (up to a cap); clones replay them.
    ///
    /// You rarely build one yourself: [`RetryLayer::replay_bodies`] wraps every request
    /// body. For a client whose body type you choose (hyper-util's `Client<C, B>`), you
    /// may also build requests with `ReplayBody::new` and use the plain
    /// [`RetryLayer`].
    ///
    /// # Clone
    ///
    /// Clones share one buffer. Only the original streams the inner body; a clone yields
    /// the kept frames and trailers, and is only sent by the retry layer once the
    /// original was sent completely and within the cap.
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
    /// # Ok::<(), std::convert::Infallible>(())
    /// # });
    /// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
    /// # }
    /// ```
    ///
    /// [`RetryLayer`]: crate::RetryLayer
    /// [`RetryLayer::replay_bodies`]: crate::RetryLayer::replay_bodies
    pub struct ReplayBody<B> {
        shared: Arc<Mutex<Kept>>,
        #[pin]
        inner: Option<B>,
        next_frame: usize,
        trailers_sent: bool,
    }
}

#[derive(Debug)]
struct Kept {
    frames: Vec<Bytes>,
    trailers: Option<HeaderMap>,
    bytes: usize,
    cap: usize,
    /// The original reached its end.
    complete: bool,
    /// Past the cap, or the original failed: nothing is kept any more.
    abandoned: bool,
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
            })),
            inner: Some(body),
            next_frame: 0,
            trailers_sent: false,
        }
    }

    /// Whether a clone can replay the whole body: the original was streamed to its end
    /// and fit under the cap.
    pub fn is_replayable(&self) -> bool {
        let kept = self.kept();
        kept.complete && !kept.abandoned
    }

    /// The bytes kept so far for replay.
    pub fn kept_bytes(&self) -> usize {
        self.kept().bytes
    }

    fn kept(&self) -> MutexGuard<'_, Kept> {
        lock(&self.shared)
    }

    pub(crate) fn handle(&self) -> ReplayHandle {
        ReplayHandle(self.shared.clone())
    }
}

fn lock(shared: &Mutex<Kept>) -> MutexGuard<'_, Kept> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<B> Clone for ReplayBody<B> {
    fn clone(&self) -> Self {
        ReplayBody {
            shared: self.shared.clone(),
            inner: None,
            next_frame: 0,
            trailers_sent: false,
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

impl Kept {
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

    fn abandon(&mut self) {
        self.abandoned = true;
        self.frames = Vec::new();
        self.trailers = None;
        self.bytes = 0;
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let Some(inner) = this.inner.as_pin_mut() else {
            // A replay: hand out what the original kept.
            let kept = lock(this.shared);
            if let Some(data) = kept.frames.get(*this.next_frame) {
                *this.next_frame += 1;
                return Poll::Ready(Some(Ok(Frame::data(data.clone()))));
            }
            if !*this.trailers_sent {
                *this.trailers_sent = true;
                if let Some(trailers) = &kept.trailers {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers.clone()))));
                }
            }
            return Poll::Ready(None);
        };
        let frame = match inner.poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => {
                lock(this.shared).complete = true;
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Err(err))) => {
                lock(this.shared).abandon();
                return Poll::Ready(Some(Err(err)));
            }
            Poll::Ready(Some(Ok(frame))) => frame,
        };
        let frame = match frame.into_data() {
            Ok(mut data) => {
                let data = data.copy_to_bytes(data.remaining());
                lock(this.shared).keep(&data);
                Frame::data(data)
            }
            Err(frame) => match frame.into_trailers() {
                Ok(trailers) => {
                    let mut kept = lock(this.shared);
                    if !kept.abandoned {
                        kept.trailers = Some(trailers.clone());
                    }
                    Frame::trailers(trailers)
                }
                // A frame kind http-body may add later: passed on, but not replayable.
                Err(_) => {
                    lock(this.shared).abandon();
                    return Poll::Ready(None);
                }
            },
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
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
                self.next_frame >= kept.frames.len()
                    && (self.trailers_sent || kept.trailers.is_none())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Some(inner) => inner.size_hint(),
            None => {
                let kept = self.kept();
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

/// The retry policy's view of a [`ReplayBody`], carried in the request extensions.
#[derive(Clone)]
pub(crate) struct ReplayHandle(Arc<Mutex<Kept>>);

impl ReplayHandle {
    pub(crate) fn is_replayable(&self) -> bool {
        let kept = lock(&self.0);
        kept.complete && !kept.abandoned
    }
}

impl std::fmt::Debug for ReplayHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReplayHandle")
            .field(&*lock(&self.0))
            .finish()
    }
}
