//! Which outcomes deserve another attempt.
//!
//! Classify before you retry. A timeout, a connection failure, a 408, a 429 or a 5xx
//! from an overloaded server is transient: the same request may well succeed a moment
//! later. A malformed request, a failed validation or a reference to something that does
//! not exist fails the same way for ever, and retrying it only spends the attempts (and
//! the shared budget) that transient failures needed. Such a failure goes straight back
//! to the caller, who may dead-letter it with its reason.
//!
//! The rules here are the ones stormguard's retry layer and circuit breaker share:
//!
//! | outcome | [`Class`] |
//! |---|---|
//! | 1xx, 2xx, 3xx | `Success` |
//! | 408, 429, 500, 502, 503, 504 (configurable: [`StatusSet`]) | `Retryable`, with the `Retry-After` wait on 429 and 503; `DontRetry` with an [`X_NO_RETRY`], Finagle's `finagle-http-nonretryable-nack` or Envoy's `x-envoy-overloaded` or `x-envoy-ratelimited` header |
//! | 501, 505, every other 4xx and 5xx | `Permanent` |
//! | `grpc-status: 0` | `Success` |
//! | `grpc-status: 14` UNAVAILABLE (configurable: [`GrpcCodeSet`]) | `Retryable`, or `DontRetry` when `grpc-retry-pushback-ms` or one of the headers above says so |
//! | any other `grpc-status` | `Permanent` |
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use http::{HeaderMap, HeaderValue, StatusCode};
//! use stormguard_core::classify::{Class, Rules};
//!
//! let rules = Rules::default();
//! let mut headers = HeaderMap::new();
//! headers.insert("retry-after", HeaderValue::from_static("2"));
//! let now = SystemTime::UNIX_EPOCH;
//!
//! assert_eq!(
//!     rules.classify(StatusCode::TOO_MANY_REQUESTS, &headers, now),
//!     Class::Retryable { after: Some(Duration::from_secs(2)) },
//! );
//! assert_eq!(rules.classify(StatusCode::BAD_REQUEST, &headers, now), Class::Permanent);
//! ```

use std::fmt;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, Method, StatusCode};

use crate::retry_after::{parse_grpc_pushback, parse_retry_after, Pushback};

/// The header that makes a POST or PATCH safe to retry.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The gRPC status of a response (in its headers when it is trailers-only).
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// How long a gRPC server asks the client to wait before retrying (gRFC A6).
pub const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
/// The number of earlier attempts of a retried gRPC call (gRFC A6).
pub const GRPC_PREVIOUS_RPC_ATTEMPTS: HeaderName =
    HeaderName::from_static("grpc-previous-rpc-attempts");
/// Response header: the server failed because its own dependencies gave up (or it shed
/// load), and its callers must not retry; the value names why (`budget`, `exhausted`,
/// `circuit_open`...). stormguard's server-side signals layer sets it, its retry layer
/// honours it. gRPC's equivalent is `grpc-retry-pushback-ms: -1`.
pub const X_NO_RETRY: HeaderName = HeaderName::from_static("x-no-retry");
/// Finagle's "do not retry" response header, honoured like [`X_NO_RETRY`].
pub const FINAGLE_NONRETRYABLE_NACK: HeaderName =
    HeaderName::from_static("finagle-http-nonretryable-nack");
/// Envoy's response header for a request it shed (its circuit breaker overflowed, or
/// maintenance mode): Envoy itself does not retry a response carrying it, and neither
/// does stormguard.
pub const X_ENVOY_OVERLOADED: HeaderName = HeaderName::from_static("x-envoy-overloaded");
/// Envoy's response header for a request its rate limit service refused: Envoy does not
/// retry a response carrying it (unless told to), and neither does stormguard.
pub const X_ENVOY_RATELIMITED: HeaderName = HeaderName::from_static("x-envoy-ratelimited");
/// Request header: which attempt this is (2 for the first retry), like Envoy's
/// `x-envoy-attempt-count`. Set by the retry layer on HTTP retries; absent means 1.
pub const X_ATTEMPT_COUNT: HeaderName = HeaderName::from_static("x-attempt-count");

/// What an outcome means for the next attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The call succeeded (as far as retrying is concerned): hand the result back.
    Success,
    /// A transient failure: another attempt may succeed.
    Retryable {
        /// How long the server asked the client to wait (`Retry-After`,
        /// `grpc-retry-pushback-ms`), if it said.
        after: Option<Duration>,
    },
    /// The request itself is at fault and will fail the same way every time.
    Permanent,
    /// The server asked not to be retried (negative gRPC pushback), or the failure
    /// came from a circuit breaker failing fast.
    DontRetry,
}

impl Class {
    /// Whether another attempt is worth making.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Class::Retryable { .. })
    }
}

/// A set of HTTP status codes, 100 to 999, kept as a bitmap (no allocation).
///
/// ```
/// use http::StatusCode;
/// use stormguard_core::classify::StatusSet;
///
/// let set = StatusSet::retryable_default().with(StatusCode::CONFLICT);
/// assert!(set.contains(StatusCode::CONFLICT));
/// assert!(set.contains(StatusCode::SERVICE_UNAVAILABLE));
/// assert!(!set.contains(StatusCode::NOT_IMPLEMENTED));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct StatusSet {
    bits: [u64; 16],
}

impl StatusSet {
    /// The empty set.
    pub const fn new() -> Self {
        StatusSet { bits: [0; 16] }
    }

    /// 408, 429, 500, 502, 503 and 504: the statuses retried by default.
    pub fn retryable_default() -> Self {
        [408, 429, 500, 502, 503, 504].into_iter().collect()
    }

    /// 408, 429 and every 5xx: the statuses a circuit breaker counts as the
    /// dependency's failures by default. Other 4xx are the caller's fault.
    pub fn breaker_default() -> Self {
        [408, 429].into_iter().chain(500..=599).collect()
    }

    /// This set with `status` added.
    pub fn with(mut self, status: StatusCode) -> Self {
        self.insert(status.as_u16());
        self
    }

    /// This set with `status` removed.
    pub fn without(mut self, status: StatusCode) -> Self {
        let code = status.as_u16() as usize;
        self.bits[code / 64] &= !(1 << (code % 64));
        self
    }

    /// Whether `status` is in the set.
    pub fn contains(&self, status: StatusCode) -> bool {
        let code = status.as_u16() as usize;
        self.bits[code / 64] & (1 << (code % 64)) != 0
    }

    fn insert(&mut self, code: u16) {
        let code = code as usize;
        if code < 1024 {
            self.bits[code / 64] |= 1 << (code % 64);
        }
    }
}

impl FromIterator<u16> for StatusSet {
    /// Collects status codes; numbers outside 0..1024 are ignored.
    fn from_iter<I: IntoIterator<Item = u16>>(iter: I) -> Self {
        let mut set = StatusSet::new();
        for code in iter {
            set.insert(code);
        }
        set
    }
}

impl FromIterator<StatusCode> for StatusSet {
    fn from_iter<I: IntoIterator<Item = StatusCode>>(iter: I) -> Self {
        iter.into_iter().map(|s| s.as_u16()).collect()
    }
}

impl fmt::Debug for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let codes = (0..1024u16).filter(|c| self.bits[*c as usize / 64] & (1 << (c % 64)) != 0);
        f.debug_set().entries(codes).finish()
    }
}

/// gRPC status codes (0 to 16), kept as a bitmap.
///
/// ```
/// use stormguard_core::classify::GrpcCodeSet;
///
/// let set = GrpcCodeSet::retryable_default().with(GrpcCodeSet::RESOURCE_EXHAUSTED);
/// assert!(set.contains(14));
/// assert!(set.contains(8));
/// assert!(!set.contains(3));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct GrpcCodeSet {
    bits: u32,
}

impl GrpcCodeSet {
    /// `OK` (0).
    pub const OK: i32 = 0;
    /// `CANCELLED` (1).
    pub const CANCELLED: i32 = 1;
    /// `UNKNOWN` (2).
    pub const UNKNOWN: i32 = 2;
    /// `DEADLINE_EXCEEDED` (4).
    pub const DEADLINE_EXCEEDED: i32 = 4;
    /// `RESOURCE_EXHAUSTED` (8).
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    /// `ABORTED` (10).
    pub const ABORTED: i32 = 10;
    /// `INTERNAL` (13).
    pub const INTERNAL: i32 = 13;
    /// `UNAVAILABLE` (14).
    pub const UNAVAILABLE: i32 = 14;
    /// `DATA_LOSS` (15).
    pub const DATA_LOSS: i32 = 15;

    /// The empty set.
    pub const fn new() -> Self {
        GrpcCodeSet { bits: 0 }
    }

    /// `UNAVAILABLE` alone: the code gRPC documents as safe to retry.
    pub const fn retryable_default() -> Self {
        GrpcCodeSet::new().with(Self::UNAVAILABLE)
    }

    /// The codes a circuit breaker counts as the dependency's failures by default:
    /// UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE, DATA_LOSS.
    pub const fn breaker_default() -> Self {
        GrpcCodeSet::new()
            .with(Self::UNKNOWN)
            .with(Self::DEADLINE_EXCEEDED)
            .with(Self::RESOURCE_EXHAUSTED)
            .with(Self::INTERNAL)
            .with(Self::UNAVAILABLE)
            .with(Self::DATA_LOSS)
    }

    /// This set with `code` added; codes outside 0..=16 are ignored.
    pub const fn with(self, code: i32) -> Self {
        if 0 <= code && code <= 16 {
            GrpcCodeSet {
                bits: self.bits | (1 << code),
            }
        } else {
            self
        }
    }

    /// Whether `code` is in the set.
    pub const fn contains(&self, code: i32) -> bool {
        0 <= code && code <= 16 && self.bits & (1 << code) != 0
    }
}

impl fmt::Debug for GrpcCodeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries((0..=16).filter(|c| self.contains(*c)))
            .finish()
    }
}

/// The `grpc-status` of a response whose headers carry one (a trailers-only response),
/// or `None` when there is none or it is not a number.
pub fn grpc_status(headers: &HeaderMap) -> Option<i32> {
    // A static, not the `const`: a `const` name is built and dropped at every use, and
    // this lookup is on every response's path.
    static NAME: HeaderName = GRPC_STATUS;
    let value = headers.get(&NAME)?.to_str().ok()?;
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok()
}

/// Whether a response's status is in its trailers: a `200` of a gRPC content type
/// (`application/grpc`, `application/grpc+proto`, `application/grpc;...`) with no
/// `grpc-status` in its head, as every server stream and some unary answers are.
/// gRPC-Web (`application/grpc-web`) carries its trailers inside the body: not this.
///
/// ```
/// use http::{HeaderMap, HeaderValue, StatusCode};
/// use stormguard_core::classify::status_in_trailers;
///
/// let mut head = HeaderMap::new();
/// head.insert("content-type", HeaderValue::from_static("application/grpc"));
/// assert!(status_in_trailers(StatusCode::OK, &head));
/// head.insert("grpc-status", HeaderValue::from_static("14")); // trailers-only
/// assert!(!status_in_trailers(StatusCode::OK, &head));
/// ```
pub fn status_in_trailers(status: StatusCode, headers: &HeaderMap) -> bool {
    status == StatusCode::OK
        && headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|value| value.as_bytes().strip_prefix(b"application/grpc"))
            .is_some_and(|rest| rest.is_empty() || rest[0] == b'+' || rest[0] == b';')
        && grpc_status(headers).is_none()
}

/// Whether a failed response says not to retry it: [`X_NO_RETRY`], Finagle's
/// [`FINAGLE_NONRETRYABLE_NACK`], or Envoy's [`X_ENVOY_OVERLOADED`] or
/// [`X_ENVOY_RATELIMITED`] (a proxy that shed the request: retrying adds load where
/// there is already too much).
fn told_not_to_retry(headers: &HeaderMap) -> bool {
    [
        &X_NO_RETRY,
        &FINAGLE_NONRETRYABLE_NACK,
        &X_ENVOY_OVERLOADED,
        &X_ENVOY_RATELIMITED,
    ]
    .into_iter()
    .any(|name| headers.contains_key(name))
}

/// The gRPC code a client reports for an HTTP status that came without a
/// `grpc-status`, per gRPC's HTTP-to-gRPC status mapping: 400 INTERNAL, 401
/// UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 UNIMPLEMENTED, 429, 502, 503 and 504
/// UNAVAILABLE, anything else UNKNOWN.
pub fn grpc_code_for_http_status(status: StatusCode) -> i32 {
    match status.as_u16() {
        400 => GrpcCodeSet::INTERNAL,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502 | 503 | 504 => GrpcCodeSet::UNAVAILABLE,
        _ => GrpcCodeSet::UNKNOWN,
    }
}

/// Whether a request may be sent twice without changing its effect.
///
/// GET, HEAD, OPTIONS, TRACE, PUT and DELETE are idempotent (RFC 9110, 9.2.2). POST,
/// PATCH and other methods are idempotent only when the request carries an
/// `Idempotency-Key` header, with which the server can recognise a repeat.
///
/// ```
/// use http::{HeaderMap, HeaderValue, Method};
/// use stormguard_core::classify::is_idempotent;
///
/// let mut headers = HeaderMap::new();
/// assert!(is_idempotent(&Method::PUT, &headers));
/// assert!(!is_idempotent(&Method::POST, &headers));
/// headers.insert("idempotency-key", HeaderValue::from_static("order-7"));
/// assert!(is_idempotent(&Method::POST, &headers));
/// ```
pub fn is_idempotent(method: &Method, headers: &HeaderMap) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    ) || headers.contains_key(IDEMPOTENCY_KEY)
}

/// The classification rules: which HTTP statuses and gRPC codes are retryable.
///
/// `Rules::default()` retries 408, 429, 500, 502, 503, 504 and gRPC UNAVAILABLE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// HTTP statuses worth another attempt.
    pub retryable_statuses: StatusSet,
    /// gRPC codes worth another attempt.
    pub retryable_grpc_codes: GrpcCodeSet,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            retryable_statuses: StatusSet::retryable_default(),
            retryable_grpc_codes: GrpcCodeSet::retryable_default(),
        }
    }
}

impl Rules {
    /// Classifies a response from its status and headers.
    ///
    /// A `grpc-status` header (a trailers-only gRPC response) takes precedence over the
    /// HTTP status. For 429 and 503 the `Retry-After` header, read against `now`, gives
    /// the wait; for gRPC, `grpc-retry-pushback-ms` does, and a negative or unparseable
    /// pushback turns a retryable code into [`Class::DontRetry`] (gRFC A6).
    pub fn classify(&self, status: StatusCode, headers: &HeaderMap, now: SystemTime) -> Class {
        self.classify_with(status, headers, || now)
    }

    /// [`classify`](Self::classify), asking `now` for the time only when it is needed:
    /// for a 429 or 503 whose `Retry-After` has to be read. The retry layer passes
    /// `SystemTime::now` here, so a successful response costs no clock read.
    pub fn classify_with(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        now: impl FnOnce() -> SystemTime,
    ) -> Class {
        if let Some(code) = grpc_status(headers) {
            return self.classify_grpc(code, headers);
        }
        self.classify_http(status, headers, now)
    }

    /// Classifies the response to a gRPC call. A `grpc-status` header decides when there
    /// is one. Otherwise a 2xx is a success (the status follows in the trailers), and
    /// any other HTTP status, typically from a proxy, is read as the gRPC code gRPC's
    /// HTTP-to-gRPC mapping gives it ([`grpc_code_for_http_status`]): a 503 from a load
    /// balancer is UNAVAILABLE. `Retry-After` is not consulted; gRPC's pushback is.
    pub fn classify_grpc_response(&self, status: StatusCode, headers: &HeaderMap) -> Class {
        match grpc_status(headers) {
            Some(code) => self.classify_grpc(code, headers),
            None if status.is_success() => Class::Success,
            None => self.classify_grpc(grpc_code_for_http_status(status), headers),
        }
    }

    fn classify_http(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        now: impl FnOnce() -> SystemTime,
    ) -> Class {
        if status.is_informational() || status.is_success() || status.is_redirection() {
            return Class::Success;
        }
        if !self.retryable_statuses.contains(status) {
            return Class::Permanent;
        }
        if told_not_to_retry(headers) {
            return Class::DontRetry;
        }
        let after = match status {
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => headers
                .get(http::header::RETRY_AFTER)
                .and_then(|v| parse_retry_after(v, now())),
            _ => None,
        };
        Class::Retryable { after }
    }

    fn classify_grpc(&self, code: i32, headers: &HeaderMap) -> Class {
        if code == GrpcCodeSet::OK {
            return Class::Success;
        }
        if !self.retryable_grpc_codes.contains(code) {
            return Class::Permanent;
        }
        if told_not_to_retry(headers) {
            return Class::DontRetry;
        }
        // gRFC A6: a pushback that cannot be read means "do not retry", and a header
        // sent twice cannot be read as one value.
        let mut values = headers.get_all(GRPC_RETRY_PUSHBACK_MS).iter();
        match (values.next(), values.next()) {
            (None, _) => Class::Retryable { after: None },
            (Some(_), Some(_)) => Class::DontRetry,
            (Some(value), None) => match parse_grpc_pushback(value) {
                Pushback::After(after) => Class::Retryable { after: Some(after) },
                Pushback::DontRetry => Class::DontRetry,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn classify(status: u16, headers: &[(&'static str, &'static str)]) -> Class {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.append(*k, HeaderValue::from_static(v));
        }
        let status = StatusCode::from_u16(status).expect("valid status");
        Rules::default().classify(status, &map, SystemTime::UNIX_EPOCH)
    }

    #[test]
    fn http_statuses() {
        for s in [100, 200, 204, 301, 304] {
            assert_eq!(classify(s, &[]), Class::Success, "{s}");
        }
        for s in [408, 429, 500, 502, 503, 504] {
            assert_eq!(classify(s, &[]), Class::Retryable { after: None }, "{s}");
        }
        for s in [400, 401, 403, 404, 409, 422, 501, 505, 507, 599] {
            assert_eq!(classify(s, &[]), Class::Permanent, "{s}");
        }
    }

    #[test]
    fn retry_after_only_on_429_and_503() {
        let after = Some(Duration::from_secs(7));
        assert_eq!(
            classify(429, &[("retry-after", "7")]),
            Class::Retryable { after }
        );
        assert_eq!(
            classify(503, &[("retry-after", "7")]),
            Class::Retryable { after }
        );
        assert_eq!(
            classify(500, &[("retry-after", "7")]),
            Class::Retryable { after: None }
        );
        assert_eq!(
            classify(503, &[("retry-after", "soon")]),
            Class::Retryable { after: None }
        );
    }

    #[test]
    fn grpc_codes() {
        assert_eq!(classify(200, &[("grpc-status", "0")]), Class::Success);
        assert_eq!(
            classify(200, &[("grpc-status", "14")]),
            Class::Retryable { after: None }
        );
        assert_eq!(classify(200, &[("grpc-status", "3")]), Class::Permanent);
        assert_eq!(classify(200, &[("grpc-status", "4")]), Class::Permanent);
        assert_eq!(
            classify(
                200,
                &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "250")]
            ),
            Class::Retryable {
                after: Some(Duration::from_millis(250))
            }
        );
        assert_eq!(
            classify(
                200,
                &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "-1")]
            ),
            Class::DontRetry
        );
        // Two values cannot be read as one: do not retry (gRFC A6, as grpc-go does),
        // whether they agree or not.
        for (a, b) in [("250", "250"), ("250", "500")] {
            assert_eq!(
                classify(
                    200,
                    &[
                        ("grpc-status", "14"),
                        ("grpc-retry-pushback-ms", a),
                        ("grpc-retry-pushback-ms", b)
                    ]
                ),
                Class::DontRetry,
                "{a}, {b}"
            );
        }
        // A server whose own calls gave up says so; retrying it would multiply load.
        assert_eq!(classify(503, &[("x-no-retry", "budget")]), Class::DontRetry);
        assert_eq!(
            classify(503, &[("finagle-http-nonretryable-nack", "true")]),
            Class::DontRetry
        );
        // A proxy that shed the request (Envoy's circuit breaker, its rate limit).
        for header in ["x-envoy-overloaded", "x-envoy-ratelimited"] {
            assert_eq!(classify(503, &[(header, "true")]), Class::DontRetry);
            assert_eq!(classify(429, &[(header, "true")]), Class::DontRetry);
            assert_eq!(
                classify(200, &[("grpc-status", "14"), (header, "true")]),
                Class::DontRetry
            );
        }
        assert_eq!(
            classify(200, &[("grpc-status", "14"), ("x-no-retry", "budget")]),
            Class::DontRetry
        );
        assert_eq!(classify(200, &[("x-no-retry", "budget")]), Class::Success);
        assert_eq!(classify(400, &[("x-no-retry", "budget")]), Class::Permanent);
        // gRPC status wins over the HTTP status; garbage falls back to HTTP rules.
        assert_eq!(classify(503, &[("grpc-status", "3")]), Class::Permanent);
        assert_eq!(classify(200, &[("grpc-status", "x")]), Class::Success);
    }

    #[test]
    fn the_clock_is_read_only_for_a_retry_after() {
        let rules = Rules::default();
        let mut headers = HeaderMap::new();
        headers.insert(
            "retry-after",
            HeaderValue::from_static("Thu, 01 Jan 1970 00:01:40 GMT"),
        );
        let never = || -> SystemTime { panic!("the clock was read") };
        assert_eq!(
            rules.classify_with(StatusCode::OK, &headers, never),
            Class::Success
        );
        assert!(rules
            .classify_with(StatusCode::BAD_GATEWAY, &headers, never)
            .is_retryable());
        let epoch = || SystemTime::UNIX_EPOCH;
        assert_eq!(
            rules.classify_with(StatusCode::SERVICE_UNAVAILABLE, &headers, epoch),
            Class::Retryable {
                after: Some(Duration::from_secs(100))
            }
        );
    }

    #[test]
    fn grpc_calls_read_proxy_statuses_as_grpc_codes() {
        let rules = Rules::default();
        let none = HeaderMap::new();
        let unavailable = Class::Retryable { after: None };
        for s in [429, 502, 503, 504] {
            let status = StatusCode::from_u16(s).expect("status");
            assert_eq!(
                rules.classify_grpc_response(status, &none),
                unavailable,
                "{s}"
            );
        }
        for s in [400, 401, 403, 404, 500] {
            let status = StatusCode::from_u16(s).expect("status");
            assert_eq!(
                rules.classify_grpc_response(status, &none),
                Class::Permanent,
                "{s}"
            );
        }
        assert_eq!(
            rules.classify_grpc_response(StatusCode::OK, &none),
            Class::Success
        );
        let mut retry_after = HeaderMap::new();
        retry_after.insert("retry-after", HeaderValue::from_static("5"));
        // Retry-After is HTTP's; a gRPC call waits only for pushback.
        assert_eq!(
            rules.classify_grpc_response(StatusCode::SERVICE_UNAVAILABLE, &retry_after),
            unavailable
        );
    }

    #[test]
    fn configurable_sets() {
        let rules = Rules {
            retryable_statuses: StatusSet::new().with(StatusCode::CONFLICT),
            retryable_grpc_codes: GrpcCodeSet::new().with(GrpcCodeSet::ABORTED),
        };
        let h = HeaderMap::new();
        let now = SystemTime::UNIX_EPOCH;
        assert!(rules.classify(StatusCode::CONFLICT, &h, now).is_retryable());
        assert_eq!(
            rules.classify(StatusCode::SERVICE_UNAVAILABLE, &h, now),
            Class::Permanent
        );
        let mut g = HeaderMap::new();
        g.insert("grpc-status", HeaderValue::from_static("10"));
        assert!(rules.classify(StatusCode::OK, &g, now).is_retryable());
        g.insert("grpc-status", HeaderValue::from_static("14"));
        assert_eq!(rules.classify(StatusCode::OK, &g, now), Class::Permanent);
    }

    #[test]
    fn sets_ignore_out_of_range_and_debug_lists_members() {
        let set: StatusSet = [503u16, 5000].into_iter().collect();
        assert_eq!(format!("{set:?}"), "{503}");
        assert_eq!(GrpcCodeSet::new().with(-1).with(17), GrpcCodeSet::new());
        assert_eq!(format!("{:?}", GrpcCodeSet::retryable_default()), "{14}");
        assert!(!StatusSet::retryable_default()
            .without(StatusCode::TOO_MANY_REQUESTS)
            .contains(StatusCode::TOO_MANY_REQUESTS));
    }

    #[test]
    fn idempotency() {
        let none = HeaderMap::new();
        for m in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
            assert!(is_idempotent(
                &Method::from_bytes(m.as_bytes()).expect("method"),
                &none
            ));
        }
        for m in ["POST", "PATCH", "CONNECT"] {
            assert!(!is_idempotent(
                &Method::from_bytes(m.as_bytes()).expect("method"),
                &none
            ));
        }
        let mut keyed = HeaderMap::new();
        keyed.insert("Idempotency-Key", http::HeaderValue::from_static("k"));
        assert!(is_idempotent(&Method::PATCH, &keyed));
    }
}
