//! Turning an inner service's error into what it means for a retry.
//!
//! Tower services report failures as values of their own error type, usually a
//! [`BoxError`](crate::BoxError) whose [`source()`](std::error::Error::source) chain
//! holds the real cause. The chain is walked from the outside in: a cause that settles
//! the matter (a breaker's refusal, a request provably not sent or not processed, the
//! caller's own failure) decides where it is met; otherwise the deepest cause
//! stormguard recognises does:
//!
//! | cause | meaning |
//! |---|---|
//! | h2 `REFUSED_STREAM` from the server, hyper's or hyper-util's "canceled" (the request was never written: it waited for a connection that closed or was not ready) | the request reached the server but not its application, or never left the client: retried at once, once, for free (a transparent retry, gRFC A6) |
//! | h2 GOAWAY from the server | the server drained the connection; the request may or may not have been processed (hyper does not say whether its stream was above the GOAWAY's last stream id): a transparent retry when the request may be repeated anyway, or when a [`TrackedConnector`](crate::connect::TrackedConnector) proves it was not processed; otherwise as a reset |
//! | hyper-util connect error, tonic's `ConnectError`, `io::ErrorKind::ConnectionRefused` | the request never reached the application, but the dependency may be down: an ordinary retry, for any method |
//! | `tower::timeout::error::Elapsed`, connection reset or aborted, broken pipe, `io::ErrorKind::TimedOut`, hyper's closed, incomplete or timed-out connections, other h2 stream resets | the request may have been processed: retry idempotent requests only |
//! | hyper's user errors (the request's own body failed or was cut short; not its "dispatch task is gone", which is looked into), a body that could not be replayed ([`NotReplayable`](crate::NotReplayable)) | the caller's doing, not the dependency's: not retried, and not a breaker failure |
//! | [`CircuitOpen`](crate::circuit_open::CircuitOpen) | a breaker failed fast: never retried |
//! | [`Shed`](crate::load::Shed) | the load control shed the call: never sent, not retried |
//! | anything else | not known to be transient: not retried |
//!
//! A classifier of the user's ([`crate::classify`]) is asked before this table, of each
//! link of the chain. An error whose own type is none of those below and not boxed
//! cannot be looked into unless its type is named to the policy
//! (`RetryPolicyBuilder::error_type`); it is not retried, and the policy warns once.
//!
//! The hyper, hyper-util, h2 and tonic types are recognised with the features of those
//! names (all but `tonic` on by default); without them their `source()` chains are
//! still walked when boxed. With `tonic`, the retry layer can sit right on a tonic
//! `Channel`, whose `transport::Error` it then looks into.

use std::any::Any;
use std::error::Error;
use std::io;

use crate::BoxError;

/// An error saying the request provably never reached the server's application: the
/// server refused it unprocessed, or it never left the client.
///
/// stormguard recognises this on its own in hyper-util's and h2's errors (a
/// `REFUSED_STREAM`, a GOAWAY, a request handed back unwritten) with the `h2` and
/// `hyper-util` features, on by default. A transport of your
/// own that knows as much can say so by returning this error, or one whose `source()`
/// chain holds it; the retry layer then makes its one transparent retry (see
/// [`retry`](crate::retry#transparent-retries)) and a breaker does not count it.
///
/// ```
/// use stormguard::{BoxError, Unprocessed};
///
/// let err: BoxError = Box::new(Unprocessed::new("server is draining"));
/// assert_eq!(err.to_string(), "request not processed: server is draining");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unprocessed {
    reason: &'static str,
}

impl Unprocessed {
    /// An unprocessed request, for the stated reason.
    pub const fn new(reason: &'static str) -> Self {
        Unprocessed { reason }
    }

    /// Why the request was not processed.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl std::fmt::Display for Unprocessed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request not processed: {}", self.reason)
    }
}

impl Error for Unprocessed {}

/// What a failed call tells the retry layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    /// The request provably reached the server but not its application (h2
    /// `REFUSED_STREAM`, a GOAWAY whose last stream is below it), or never left the
    /// client: worth one transparent retry (gRFC A6), and says nothing about the
    /// dependency's health.
    Unprocessed,
    /// The request provably never reached the application, but the failure says the
    /// dependency may be down (the connection was refused): an ordinary retry.
    NotSent,
    /// The server drained the connection (an HTTP/2 GOAWAY): the request was not
    /// processed if its stream was above the GOAWAY's last stream id (RFC 9113, 6.8), or
    /// it was given no stream. hyper does not say which: its HTTP/2 client also hands the
    /// GOAWAY to a request whose stream it had just opened, one the server may have
    /// taken (`tests/drain.rs` pins the double POST that followed). So it is a free retry
    /// for a request that may be repeated anyway, or one proved unprocessed
    /// (`crate::connect`), and a failure after which the request may have been processed
    /// otherwise.
    #[cfg_attr(not(feature = "h2"), allow(dead_code))]
    Drained,
    /// A transient failure after which the request may have been processed.
    MaybeProcessed,
    /// A circuit breaker refused the call.
    CircuitOpen,
    /// The load control shed the call ([`Shed`](crate::load::Shed)): never sent, and
    /// not retried (more load on a dependency that has no room).
    Shed,
    /// The caller's own doing: the request's body failed or was cut short, or could not
    /// be replayed. Retrying will not help, and the dependency is not to blame.
    Local,
    /// Nothing recognised: not retried.
    Unknown,
}

/// Classifies an error of any type, looking inside the types services commonly return
/// (the layers go through `crate::classify::Classifiers`, which names more types).
#[cfg(test)]
pub(crate) fn classify_error<E: 'static>(err: &E) -> ErrorClass {
    match as_std_error(err) {
        Some(err) => classify_chain(err),
        None => ErrorClass::Unknown,
    }
}

/// The [`CircuitOpen`](crate::circuit_open::CircuitOpen) in `err`'s source chain; `None`
/// for an isolated circuit, which stays open until reset.
pub(crate) fn circuit_open_refusal<E: 'static>(
    err: &E,
) -> Option<&crate::circuit_open::CircuitOpen> {
    sources(as_std_error(err)?)
        .find_map(|err| err.downcast_ref::<crate::circuit_open::CircuitOpen>())
        .filter(|open| open.state() != stormguard_core::breaker::CircuitState::Isolated)
}

/// `err` as a `std` error, when it is a boxed error or one of the types recognised.
pub(crate) fn as_std_error<E: 'static>(err: &E) -> Option<&(dyn Error + 'static)> {
    let any = err as &dyn Any;
    if let Some(boxed) = any.downcast_ref::<BoxError>() {
        return Some(&**boxed);
    }
    if let Some(boxed) = any.downcast_ref::<Box<dyn Error + Send>>() {
        return Some(&**boxed);
    }
    if let Some(boxed) = any.downcast_ref::<Box<dyn Error>>() {
        return Some(&**boxed);
    }
    macro_rules! concrete {
        ($($ty:ty),*) => {$(
            if let Some(err) = any.downcast_ref::<$ty>() {
                return Some(err);
            }
        )*};
    }
    #[cfg(feature = "hyper-util")]
    concrete!(hyper_util::client::legacy::Error);
    #[cfg(feature = "hyper")]
    concrete!(hyper::Error);
    #[cfg(feature = "h2")]
    concrete!(h2::Error);
    #[cfg(feature = "tonic")]
    concrete!(tonic::transport::Error);
    concrete!(
        io::Error,
        tower::timeout::error::Elapsed,
        crate::circuit_open::CircuitOpen,
        Unprocessed
    );
    None
}

/// `err`, then each of its sources in turn.
pub(crate) fn sources<'a>(
    err: &'a (dyn Error + 'static),
) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    std::iter::successors(Some(err), |err: &&'a (dyn Error + 'static)| (*err).source())
}

/// Walks `err` and its sources: the first cause that settles the matter (see
/// [`ErrorClass`]'s early returns below) decides, else the deepest recognised one.
pub(crate) fn classify_chain(err: &(dyn Error + 'static)) -> ErrorClass {
    let mut class = ErrorClass::Unknown;
    for err in sources(err) {
        if let Some(found) = classify_one(err) {
            if matches!(
                found,
                ErrorClass::CircuitOpen
                    | ErrorClass::Shed
                    | ErrorClass::NotSent
                    | ErrorClass::Unprocessed
                    | ErrorClass::Drained
                    | ErrorClass::Local
            ) {
                return found;
            }
            class = found;
        }
    }
    class
}

fn classify_one(err: &(dyn Error + 'static)) -> Option<ErrorClass> {
    if err.is::<crate::circuit_open::CircuitOpen>() {
        return Some(ErrorClass::CircuitOpen);
    }
    if err.is::<crate::shed::Shed>() {
        return Some(ErrorClass::Shed);
    }
    if err.is::<Unprocessed>() {
        return Some(ErrorClass::Unprocessed);
    }
    if err.is::<crate::NotReplayable>() {
        return Some(ErrorClass::Local);
    }
    if err.is::<tower::timeout::error::Elapsed>() {
        return Some(ErrorClass::MaybeProcessed);
    }
    // tonic's connector says so of every error on the way to a connection (refused,
    // timed out, DNS), which hyper-util's own type, private there, says too.
    #[cfg(feature = "tonic")]
    if err.is::<tonic::ConnectError>() {
        return Some(ErrorClass::NotSent);
    }
    // reqwest's error heads the chain of what its client met: a connection not made,
    // or its own timeout, it says itself; anything else its source says (hyper-util's
    // and hyper's errors, below), so look further down the chain.
    #[cfg(feature = "reqwest")]
    if let Some(err) = err.downcast_ref::<reqwest::Error>() {
        if err.is_connect() {
            return Some(ErrorClass::NotSent);
        }
        return err.is_timeout().then_some(ErrorClass::MaybeProcessed);
    }
    #[cfg(feature = "hyper-util")]
    if let Some(err) = err.downcast_ref::<hyper_util::client::legacy::Error>() {
        if err.is_connect() {
            return Some(ErrorClass::NotSent);
        }
        // hyper-util hands a request back as "canceled" only when the connection took
        // it back unwritten; its kind has no public accessor, its `Display` names it.
        // Anything else: look further down the chain.
        return is_hyper_util_canceled(err).then_some(ErrorClass::Unprocessed);
    }
    #[cfg(feature = "h2")]
    if let Some(err) = err.downcast_ref::<h2::Error>() {
        // A REFUSED_STREAM from the peer is its promise that this stream was not
        // processed (RFC 9113, 8.7). A GOAWAY from the peer is the connection's: h2 fails
        // with it the streams above its last stream id and requests made after it, but
        // hyper's client hands it on as well to a stream it had just opened, which the
        // server may have taken (`ErrorClass::Drained`).
        let refused = err.reason() == Some(h2::Reason::REFUSED_STREAM);
        return Some(if refused && err.is_remote() {
            ErrorClass::Unprocessed
        } else if err.is_go_away() && err.is_remote() {
            ErrorClass::Drained
        } else if err.is_reset() || err.is_go_away() || err.is_io() {
            // Resets the client sent itself too: over HTTP/2 hyper resets a stream whose
            // request body failed, and the caller sees that reset, not hyper's user
            // error (which HTTP/1 gives, above).
            ErrorClass::MaybeProcessed
        } else {
            ErrorClass::Unknown
        });
    }
    #[cfg(feature = "hyper")]
    if let Some(err) = err.downcast_ref::<hyper::Error>() {
        // hyper cancels only requests it never wrote: queued for a connection that then
        // closed, or sent to one that was not ready.
        if err.is_canceled() {
            return Some(ErrorClass::Unprocessed);
        }
        // The request's own body failed (its source is the caller's error, whatever it
        // says), or was shorter than its length: nothing the dependency did. But for
        // the client's connection task being gone (its runtime shut down, or it
        // panicked), which hyper files under user errors too: that is looked into.
        if err.is_user() && !displays_as(err, "dispatch task is gone") {
            return Some(ErrorClass::Local);
        }
        let transient = err.is_timeout() || err.is_closed() || err.is_incomplete_message();
        return transient.then_some(ErrorClass::MaybeProcessed);
    }
    if let Some(err) = err.downcast_ref::<io::Error>() {
        return match err.kind() {
            io::ErrorKind::ConnectionRefused => Some(ErrorClass::NotSent),
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::TimedOut
            | io::ErrorKind::UnexpectedEof => Some(ErrorClass::MaybeProcessed),
            _ => None,
        };
    }
    None
}

/// Whether `err` or one of its sources is a timeout: an attempt the server may have
/// worked on for nobody the whole time (tower's `Elapsed`, `io::ErrorKind::TimedOut`,
/// hyper's and reqwest's own timeouts). A reset, a broken pipe or a closed connection
/// is not: one close fails every stream then in flight at once, whatever work they
/// cost.
pub(crate) fn is_timeout<E: 'static>(err: &E) -> bool {
    as_std_error(err).is_some_and(is_timeout_chain)
}

/// [`is_timeout`] of an error already looked into.
pub(crate) fn is_timeout_chain(err: &(dyn Error + 'static)) -> bool {
    sources(err).any(|err| {
        if err.is::<tower::timeout::error::Elapsed>() {
            return true;
        }
        #[cfg(feature = "reqwest")]
        if let Some(err) = err.downcast_ref::<reqwest::Error>() {
            return err.is_timeout();
        }
        #[cfg(feature = "hyper")]
        if let Some(err) = err.downcast_ref::<hyper::Error>() {
            return err.is_timeout();
        }
        err.downcast_ref::<io::Error>()
            .is_some_and(|err| err.kind() == io::ErrorKind::TimedOut)
    })
}

#[cfg(feature = "hyper-util")]
fn is_hyper_util_canceled(err: &hyper_util::client::legacy::Error) -> bool {
    displays_as(err, "client error (Canceled)")
}

/// Whether `err` displays as exactly `text`, found without allocating: for the kinds
/// hyper and hyper-util name in their `Display` but give no accessor for.
#[cfg(feature = "hyper")]
fn displays_as(err: &dyn std::fmt::Display, text: &str) -> bool {
    use std::fmt::Write;
    /// Compares what is written with one expected text, without allocating.
    struct Matches<'a> {
        rest: &'a str,
        ok: bool,
    }
    impl Write for Matches<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            match self.rest.strip_prefix(s) {
                Some(rest) => self.rest = rest,
                None => self.ok = false,
            }
            Ok(())
        }
    }
    let mut m = Matches {
        rest: text,
        ok: true,
    };
    let _ = write!(m, "{err}");
    m.ok && m.rest.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt;

    #[derive(Debug)]
    struct Wrapped(Box<dyn Error + Send + Sync>);

    impl fmt::Display for Wrapped {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("wrapped")
        }
    }

    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&*self.0)
        }
    }

    fn boxed(err: impl Error + Send + Sync + 'static) -> BoxError {
        Box::new(Wrapped(Box::new(err)))
    }

    #[test]
    fn io_kinds() {
        let class = |kind| classify_error(&boxed(io::Error::from(kind)));
        assert_eq!(class(io::ErrorKind::ConnectionRefused), ErrorClass::NotSent);
        for kind in [
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::ConnectionAborted,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::TimedOut,
        ] {
            assert_eq!(class(kind), ErrorClass::MaybeProcessed, "{kind:?}");
        }
        assert_eq!(class(io::ErrorKind::InvalidInput), ErrorClass::Unknown);
        assert_eq!(
            classify_error(&io::Error::from(io::ErrorKind::ConnectionRefused)),
            ErrorClass::NotSent
        );
    }

    #[cfg(feature = "h2")]
    #[test]
    fn h2_reasons() {
        let refused = h2::Error::from(h2::Reason::REFUSED_STREAM);
        // Made locally (not from the peer): not proof the server never saw it.
        assert_eq!(classify_error(&boxed(refused)), ErrorClass::Unknown);
    }

    #[test]
    fn only_timeouts_are_timeouts() {
        let elapsed: BoxError = Box::new(tower::timeout::error::Elapsed::new());
        assert!(is_timeout(&elapsed));
        assert!(is_timeout(&boxed(tower::timeout::error::Elapsed::new())));
        assert!(is_timeout(&boxed(io::Error::from(io::ErrorKind::TimedOut))));
        for kind in [
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::ConnectionAborted,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::UnexpectedEof,
        ] {
            assert!(!is_timeout(&boxed(io::Error::from(kind))), "{kind:?}");
        }
        assert!(!is_timeout(&String::from("not an error type")));
    }

    #[test]
    fn timeouts_and_breakers() {
        let elapsed: BoxError = Box::new(tower::timeout::error::Elapsed::new());
        assert_eq!(classify_error(&elapsed), ErrorClass::MaybeProcessed);
        let open: BoxError = Box::new(crate::circuit_open::CircuitOpen::new(
            std::time::Duration::from_secs(1),
        ));
        assert_eq!(
            classify_error(&boxed_circuit(open)),
            ErrorClass::CircuitOpen
        );
    }

    fn boxed_circuit(err: BoxError) -> BoxError {
        Box::new(Wrapped(err))
    }

    #[test]
    fn unknown_types_are_not_retried() {
        assert_eq!(classify_error(&"text"), ErrorClass::Unknown);
        assert_eq!(classify_error(&boxed(fmt::Error)), ErrorClass::Unknown);
    }

    #[test]
    fn a_body_that_cannot_be_replayed_is_the_callers_doing() {
        assert_eq!(
            classify_error(&boxed(crate::NotReplayable)),
            ErrorClass::Local
        );
    }

    #[cfg(feature = "hyper")]
    type BoxBody = http_body_util::combinators::BoxBody<bytes::Bytes, BoxError>;

    /// hyper's HTTP/1.1 client connection over an in-memory pipe whose other end only
    /// reads: the connection is not driven until the caller spawns it.
    #[cfg(feature = "hyper")]
    async fn http1_client() -> (
        hyper::client::conn::http1::SendRequest<BoxBody>,
        hyper::client::conn::http1::Connection<
            hyper_util::rt::TokioIo<tokio::io::DuplexStream>,
            BoxBody,
        >,
    ) {
        use tokio::io::AsyncReadExt;
        let (client, mut server) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let mut sink = [0; 1024];
            while server.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(client))
            .await
            .expect("handshake")
    }

    #[cfg(feature = "hyper")]
    fn post(body: BoxBody) -> http::Request<BoxBody> {
        http::Request::post("/orders").body(body).expect("request")
    }

    #[cfg(feature = "hyper")]
    #[tokio::test]
    async fn hyper_cancels_only_what_it_never_wrote() {
        use http_body_util::BodyExt;
        use std::time::Duration;
        let empty = || http_body_util::Empty::new().map_err(|e| match e {}).boxed();
        const LIMIT: Duration = Duration::from_secs(10);

        // A connection takes one request before it is driven; a second is handed back
        // at once, "canceled", unwritten.
        let (mut sender, _connection) = http1_client().await;
        let _first = sender.send_request(post(empty()));
        let err = tokio::time::timeout(LIMIT, sender.send_request(post(empty())))
            .await
            .expect("in time")
            .expect_err("not ready");
        assert!(err.is_canceled(), "{err:?}");
        assert_eq!(classify_error(&boxed(err)), ErrorClass::Unprocessed);

        // On a driven connection the head is written, then the caller's body fails:
        // hyper's user error, whatever the body's own error says (here a refused
        // connection upstream of the caller, which must not pass for the dependency's).
        let (mut sender, connection) = http1_client().await;
        tokio::spawn(connection);
        tokio::time::timeout(LIMIT, sender.ready())
            .await
            .expect("in time")
            .expect("ready");
        let refused: BoxError = Box::new(io::Error::from(io::ErrorKind::ConnectionRefused));
        let failing =
            futures_util::stream::iter([Err::<http_body::Frame<bytes::Bytes>, _>(refused)]);
        let err = tokio::time::timeout(
            LIMIT,
            sender.send_request(post(http_body_util::StreamBody::new(failing).boxed())),
        )
        .await
        .expect("in time")
        .expect_err("body error");
        assert!(err.is_user(), "{err:?}");
        assert_eq!(classify_error(&boxed(err)), ErrorClass::Local);
    }

    /// hyper's "dispatch task is gone" (the client connection's task dropped with a
    /// request in flight: its runtime shut down, or it panicked) is recognised by its
    /// text, which this pins at the hyper version in Cargo.lock: it must not read as the
    /// caller's own body error.
    #[cfg(feature = "hyper")]
    #[tokio::test]
    async fn hypers_dispatch_gone_is_pinned_by_its_text() {
        use http_body_util::BodyExt;
        use std::time::Duration;
        const LIMIT: Duration = Duration::from_secs(10);
        let empty = || http_body_util::Empty::new().map_err(|e| match e {}).boxed();

        let (mut sender, connection) = http1_client().await;
        let driving = tokio::spawn(connection);
        tokio::time::timeout(LIMIT, sender.ready())
            .await
            .expect("in time")
            .expect("ready");
        let response = sender.send_request(post(empty()));
        // Let the connection take the request (the other end reads it and never answers),
        // then drop the connection's task with the request in flight.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        driving.abort();
        let err = tokio::time::timeout(LIMIT, response)
            .await
            .expect("in time")
            .expect_err("the task is gone");
        assert!(err.is_user(), "{err:?}");
        assert_eq!(err.to_string(), "dispatch task is gone");
        // Looked into, and nothing in it is known to be transient: not retried (with the
        // client's task gone, a retry through it has nowhere to go), and not Local.
        assert_eq!(classify_error(&boxed(err)), ErrorClass::Unknown);
    }
}
