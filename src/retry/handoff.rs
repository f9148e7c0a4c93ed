//! Whether a failed attempt's request was ever written: the retry layer's half of
//! [`crate::connect`] (its module docs say what is proved, and why it matters).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, Request, Response};
use hyper_util::client::legacy::connect::{capture_connection, CaptureConnection};

use crate::connect::{GoawayPhase, Mark};
use crate::error_class::ErrorClass;

use super::service::Proved;

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
        let capture = capture_connection(req);
        let shared = Arc::new(Shared {
            handed: AtomicU8::new(NOT_HANDED),
            capture,
        });
        req.extensions_mut().insert(Token(Arc::clone(&shared)));
        Some(Box::new(Handoff { shared }))
    }

    /// Learns from a tracked attempt's response whether its connection was tracked.
    pub(super) fn learn<B>(&self, res: &Response<B>) {
        if self.0.load(Ordering::Relaxed) == UNKNOWN {
            let tracked = res.extensions().get::<Mark>().is_some();
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

/// What an attempt's token and its handoff share: the connection hyper-util gave the
/// attempt, and whether (and when) its request was handed to that connection's writer.
struct Shared {
    /// [`NOT_HANDED`], or 1 + the [`GoawayPhase`] of the connection when it was handed.
    handed: AtomicU8,
    capture: CaptureConnection,
}

const NOT_HANDED: u8 = 0;

impl Shared {
    /// The mark of the connection the attempt was given, if it is tracked.
    fn mark(&self) -> Option<Mark> {
        let metadata = self.capture.connection_metadata();
        let mut extras = Extensions::new();
        metadata.as_ref()?.get_extras(&mut extras);
        extras.remove::<Mark>()
    }
}

/// Dropped by whoever drops the request's extensions: hyper, as it hands the request to
/// a connection's writer (h2 as it opens the request's stream, or refuses to), or as it
/// drops a request it never sent. A clone made on the way (a request copied below the
/// retry layer) marks the request as handed when it is dropped too; only the first drop
/// counts, which can only err on the side of "may have been written".
#[derive(Clone)]
struct Token(Arc<Shared>);

impl Drop for Token {
    fn drop(&mut self) {
        let phase = self
            .0
            .mark()
            .map_or(GoawayPhase::None, |mark| mark.goaway_phase());
        let _ = self.0.handed.compare_exchange(
            NOT_HANDED,
            1 + phase as u8,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }
}

/// One attempt's tracking: whether its request was handed to a writer, and the
/// connection hyper-util gave it.
pub(super) struct Handoff {
    shared: Arc<Shared>,
}

impl Handoff {
    /// What the attempt, which failed with an error of `class`, proves of its request.
    /// Read while the attempt's future is still held, before it is dropped. The request
    /// was not processed when:
    ///
    /// - the connection it was given has closed (nothing more is written on it) and,
    ///   read after that, the request was never handed to its writer;
    /// - the failure is a GOAWAY, and the request was handed over after h2 had acted on
    ///   the connection's first GOAWAY: h2 then opens no stream for it;
    /// - the failure is a GOAWAY, and the connection proves that none of its GOAWAY
    ///   failures was processed ([`Mark::drain_proved`]), now or soon: the failures of
    ///   one GOAWAY come together, so the proof may be a moment behind this one.
    ///
    /// A proof still to come is waited for, at most `settle` or until the connection
    /// closes ([`Mark::settle`]).
    pub(super) fn unprocessed(
        &self,
        class: ErrorClass,
        tracking: &Tracking,
        settle: Duration,
    ) -> Proved {
        let Some(mark) = self.shared.mark() else {
            if self.shared.capture.connection_metadata().is_some() {
                tracking.0.store(UNTRACKED, Ordering::Relaxed);
            }
            return Proved::No;
        };
        tracking.0.store(TRACKED, Ordering::Relaxed);
        if class == ErrorClass::Drained {
            mark.note_drained();
            let handed = self.shared.handed.load(Ordering::SeqCst);
            if handed == 1 + GoawayPhase::ActedOn as u8 || mark.drain_proved() {
                return Proved::Yes;
            }
            return Proved::Later(Box::pin(mark.settle(settle)));
        }
        // The order matters: a request not handed over by the time its connection is
        // known closed never will be.
        if mark.is_closed() && self.shared.handed.load(Ordering::SeqCst) == NOT_HANDED {
            return Proved::Yes;
        }
        Proved::No
    }
}
