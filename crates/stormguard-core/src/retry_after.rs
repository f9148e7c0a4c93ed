//! What the server asked for: `Retry-After` and `grpc-retry-pushback-ms`.
//!
//! A server that answers 429 or 503 with `Retry-After` is saying when it expects to cope
//! again; a client that retries sooner breaks that contract and may be banned for it.
//! gRPC servers say the same with `grpc-retry-pushback-ms`, and can also say "do not
//! retry at all" with a negative value (gRFC A6).
//!
//! Both parsers are pure: `parse_retry_after` takes `now` as an argument instead of
//! reading the clock, so an HTTP-date is turned into a wait exactly and testably.

use std::time::{Duration, SystemTime};

use http::HeaderValue;

/// Parses a `Retry-After` value (RFC 9110, section 10.2.3) into the wait it asks for.
///
/// Accepts delta-seconds (`1*DIGIT`: `"120"`; `"+5"`, `"1.5"`, `"-1"` and `"0x10"` are
/// not delta-seconds) and the three HTTP-date forms of RFC 9110, section 5.6.7:
/// IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the obsolete RFC 850 form
/// (`Sunday, 06-Nov-94 08:49:37 GMT`) and asctime (`Sun Nov  6 08:49:37 1994`).
///
/// A date in the past gives [`Duration::ZERO`]. A delta too large for a `u64` saturates
/// at `u64::MAX` seconds. Anything else (empty, non-ASCII, an impossible date such as
/// day 32 or hour 25) gives `None`, and the caller falls back to its own backoff. This
/// function never panics and never reads the clock.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use http::HeaderValue;
/// use stormguard_core::retry_after::parse_retry_after;
///
/// // Sun, 06 Nov 1994 08:49:37 GMT is 784111777 seconds after the epoch.
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777 - 30);
/// let date = HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT");
/// assert_eq!(parse_retry_after(&date, now), Some(Duration::from_secs(30)));
/// assert_eq!(parse_retry_after(&HeaderValue::from_static("120"), now), Some(Duration::from_secs(120)));
/// assert_eq!(parse_retry_after(&HeaderValue::from_static("1.5"), now), None);
/// ```
pub fn parse_retry_after(value: &HeaderValue, now: SystemTime) -> Option<Duration> {
    let text = std::str::from_utf8(value.as_bytes()).ok()?;
    let text = text.trim_matches(|c| c == ' ' || c == '\t');
    if text.is_empty() || !text.is_ascii() {
        return None;
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        let secs = text.bytes().fold(0u64, |acc, digit| {
            acc.saturating_mul(10)
                .saturating_add(u64::from(digit - b'0'))
        });
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(text).ok()?;
    Some(when.duration_since(now).unwrap_or(Duration::ZERO))
}

/// What a `grpc-retry-pushback-ms` trailer asks of the client (gRFC A6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushback {
    /// Retry after exactly this long.
    After(Duration),
    /// Do not retry this call.
    DontRetry,
}

/// Parses `grpc-retry-pushback-ms`.
///
/// A non-negative 32-bit integer is a wait in milliseconds. Anything else, a negative
/// number, a number outside `i32`, or text that is not a number, means the server asks
/// the client not to retry (gRFC A6: "negative or unparseable").
///
/// ```
/// use std::time::Duration;
/// use http::HeaderValue;
/// use stormguard_core::retry_after::{parse_grpc_pushback, Pushback};
///
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static("250")), Pushback::After(Duration::from_millis(250)));
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static("-1")), Pushback::DontRetry);
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static("2147483648")), Pushback::DontRetry);
/// ```
pub fn parse_grpc_pushback(value: &HeaderValue) -> Pushback {
    let bytes = value.as_bytes();
    let digits = !bytes.is_empty() && bytes.iter().all(u8::is_ascii_digit);
    let parsed = std::str::from_utf8(bytes)
        .ok()
        .filter(|_| digits)
        .and_then(|s| s.parse::<i32>().ok());
    match parsed {
        Some(ms) => Pushback::After(Duration::from_millis(ms.unsigned_abs().into())),
        None => Pushback::DontRetry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Sun, 06 Nov 1994 08:49:37 GMT
    const EXAMPLE: u64 = 784_111_777;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn parse(value: &[u8], now: SystemTime) -> Option<Duration> {
        let value = HeaderValue::from_bytes(value).ok()?;
        parse_retry_after(&value, now)
    }

    #[test]
    fn rfc9110_date_forms_agree() {
        let now = at(EXAMPLE - 90);
        for form in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(
                parse(form.as_bytes(), now),
                Some(Duration::from_secs(90)),
                "{form}"
            );
        }
    }

    #[test]
    fn past_date_is_zero() {
        let now = at(EXAMPLE + 3600);
        assert_eq!(
            parse(b"Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn delta_seconds() {
        let now = at(0);
        assert_eq!(parse(b"0", now), Some(Duration::ZERO));
        assert_eq!(parse(b"120", now), Some(Duration::from_secs(120)));
        assert_eq!(parse(b"007", now), Some(Duration::from_secs(7)));
        assert_eq!(
            parse(b"99999999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
    }

    #[test]
    fn not_delta_seconds_nor_dates() {
        let now = at(EXAMPLE);
        for bad in [
            &b"+5"[..],
            b"1.5",
            b"-1",
            b"0x10",
            b"",
            b"   ",
            b"5 s",
            b"soon",
            b"Sun, 32 Nov 1994 08:49:37 GMT",
            b"Sun, 06 Nov 1994 25:49:37 GMT",
            b"Sun, 06 Nov 1994 08:60:37 GMT",
            b"Sun, 06 Foo 1994 08:49:37 GMT",
            b"Sun, 06 Nov 1994 08:49:37 PST",
            b"Sun, 06 Nov 1994 08:49:37 GMT trailing",
            "Sun, 06 Nov 1994 08:49:37 GMT\u{e9}".as_bytes(),
            b"\xff\xfe",
        ] {
            assert_eq!(parse(bad, now), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn grpc_pushback() {
        let p = |s: &'static str| parse_grpc_pushback(&HeaderValue::from_static(s));
        assert_eq!(p("0"), Pushback::After(Duration::ZERO));
        assert_eq!(
            p("2147483647"),
            Pushback::After(Duration::from_millis(2_147_483_647))
        );
        for bad in [
            "-1",
            "2147483648",
            "99999999999999",
            "",
            "1.5",
            "+5",
            "abc",
            " 5",
        ] {
            assert_eq!(p(bad), Pushback::DontRetry, "{bad:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_any_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64), now in 0u64..=u64::MAX / 4) {
            if let Ok(value) = HeaderValue::from_bytes(&bytes) {
                let _ = parse_retry_after(&value, at(now));
                let _ = parse_grpc_pushback(&value);
            }
        }

        #[test]
        fn delta_seconds_round_trip(secs in proptest::prelude::any::<u64>()) {
            let value = HeaderValue::from_str(&secs.to_string()).expect("digits are a valid header");
            proptest::prop_assert_eq!(parse_retry_after(&value, at(0)), Some(Duration::from_secs(secs)));
        }
    }
}
