//! What a request says about itself: whether it may be repeated, its deadline, its body.

use std::time::Instant;

use http::Request;
use stormguard_core::classify::is_idempotent;
use stormguard_core::deadline::{parse_grpc_timeout, Deadline};

use crate::body::ReplayHandle;
use crate::error_class::ErrorClass;

use super::{Idempotent, GRPC_TIMEOUT};

/// Whether `req` may be sent more than once whatever its outcome: an idempotent method
/// (RFC 9110), an `Idempotency-Key`, or the [`Idempotent`] extension.
pub(crate) fn safe_to_repeat<B>(req: &Request<B>) -> bool {
    is_idempotent(req.method(), req.headers()) || req.extensions().get::<Idempotent>().is_some()
}

/// The request's deadline: the earlier of its [`Deadline`] extension and its
/// `grpc-timeout` counted from `now`, whichever it has.
pub(super) fn deadline_of<B>(req: &Request<B>, now: Instant) -> Option<Deadline> {
    let given = req.extensions().get::<Deadline>().copied();
    let grpc = req
        .headers()
        .get(GRPC_TIMEOUT)
        .and_then(parse_grpc_timeout)
        .map(|timeout| Deadline::after(now, timeout));
    // With both, the caller stops waiting at the earlier (as gRPC takes the earlier of a
    // call's timeout and the deadline it inherits).
    match (given, grpc) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Whether the request's body can be sent again (always, but for a [`ReplayBody`]
/// that went over its cap or was not sent whole).
///
/// [`ReplayBody`]: crate::ReplayBody
pub(super) fn body_replayable<B>(req: &Request<B>) -> bool {
    req.extensions()
        .get::<ReplayHandle>()
        .is_none_or(ReplayHandle::is_replayable)
}

/// Whether `req` is a gRPC call, by its content type.
pub(crate) fn is_grpc<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// How a failure is taken, given whether its attempt provably left the request
/// unprocessed (`unprocessed`, from `crate::connect`): one after which the request may
/// have been processed (a timeout, a reset) is then one the server never saw. A GOAWAY
/// proves nothing on its own (see [`ErrorClass::Drained`]): it is taken as unprocessed
/// with that proof, or for a request that may be repeated anyway, and as a failure after
/// which the request may have been processed otherwise. Any other class stands.
pub(super) fn proved<B>(class: ErrorClass, unprocessed: bool, req: &Request<B>) -> ErrorClass {
    match class {
        ErrorClass::MaybeProcessed if unprocessed => ErrorClass::Unprocessed,
        ErrorClass::Drained if unprocessed || safe_to_repeat(req) => ErrorClass::Unprocessed,
        ErrorClass::Drained => ErrorClass::MaybeProcessed,
        class => class,
    }
}
