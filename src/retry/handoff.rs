//! Whether a failed attempt's request was ever written: the retry layer's half of
//! [`crate::connect`] (its module docs say what is proved, and why it matters).

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use http::{Extensions, Request, Response};
use hyper_util::client::legacy::connect::{capture_connection, CaptureConnection};

use crate::connect::Closed;

/// Whether the client below a retry layer tracks its connections, as learned from the
/// first response of a request the layer tracked.
#[derive(Debug, Default)]
pub(super) struct Tracking(AtomicU8);

const UNKNOWN: u8 = 0;
const TRACKED: u8 = 1;
const UNTRACKED: u8 = 2;

impl Tracking {
    /// Tracks `req`'s attempt when it may yet be useful: the client's connections are
    /// tracked (or not known yet not to be), and the request is one the layer would not
    /// repeat after a timeout.
    pub(super) fn attach<B>(&self, req: &mut Request<B>) -> Option<Box<Handoff>> {
        if self.0.load(Ordering::Relaxed) == UNTRACKED
            || super::request::safe_to_repeat(req)
            || has_capture(req)
        {
            return None;
        }
        let handed = Arc::new(AtomicBool::new(false));
        req.extensions_mut().insert(Token(Arc::clone(&handed)));
        let capture = capture_connection(req);
        Some(Box::new(Handoff { handed, capture }))
    }

    /// Learns from a tracked attempt's response whether its connection was tracked.
    pub(super) fn learn<B>(&self, res: &Response<B>) {
        if self.0.load(Ordering::Relaxed) == UNKNOWN {
            let tracked = res.extensions().get::<Closed>().is_some();
            self.0
                .store(if tracked { TRACKED } else { UNTRACKED }, Ordering::Relaxed);
        }
    }
}

/// Whether `req` already carries a capture of its connection, the caller's own: a
/// second would replace it, and hyper-util's capture extension cannot be named to look
/// for it, so a copy of the extensions is asked whether a capture adds an entry (only if
/// there are any: most requests carry none, and then the probe's capture is not made).
fn has_capture<B>(req: &Request<B>) -> bool {
    if req.extensions().is_empty() {
        return false;
    }
    let mut probe = Request::new(());
    *probe.extensions_mut() = req.extensions().clone();
    let before = probe.extensions().len();
    drop(capture_connection(&mut probe));
    probe.extensions().len() == before
}

/// Dropped by whoever drops the request's extensions: hyper, as it hands the request to
/// a connection's writer. A clone made on the way (a request copied below the retry
/// layer) marks the request as handed when it is dropped too, which can only err on the
/// side of "may have been written".
#[derive(Clone)]
struct Token(Arc<AtomicBool>);

impl Drop for Token {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// One attempt's tracking: whether its request was handed to a writer, and the
/// connection hyper-util gave it.
pub(super) struct Handoff {
    handed: Arc<AtomicBool>,
    capture: CaptureConnection,
}

impl Handoff {
    /// Whether the attempt, which failed, provably never wrote its request: the
    /// connection it was given has closed (nothing more is written on it) and, read
    /// after that, the request was never handed to its writer. Read while the attempt's
    /// future is still held, before it is dropped.
    pub(super) fn never_written(&self, tracking: &Tracking) -> bool {
        let metadata = self.capture.connection_metadata();
        let Some(connected) = metadata.as_ref() else {
            return false;
        };
        let mut extras = Extensions::new();
        connected.get_extras(&mut extras);
        let Some(closed) = extras.get::<Closed>() else {
            tracking.0.store(UNTRACKED, Ordering::Relaxed);
            return false;
        };
        tracking.0.store(TRACKED, Ordering::Relaxed);
        // The order matters: a request not handed over by the time its connection is
        // known closed never will be.
        closed.is_closed() && !self.handed.load(Ordering::SeqCst)
    }
}
