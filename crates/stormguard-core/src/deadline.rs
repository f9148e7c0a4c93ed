//! Deadlines: never schedule a retry the caller will not wait for.
//!
//! A retry whose wait ends after the caller has stopped waiting spends a budget token
//! and a server's work on an answer nobody reads. A request's [`Deadline`] comes from
//! the caller (an extension the retry layer reads) or, for gRPC, from its
//! `grpc-timeout` header ([`parse_grpc_timeout`]); before each retry the layer asks
//! [`Deadline::allows`] whether the wait fits, and on gRPC rewrites `grpc-timeout` to
//! what remains ([`grpc_timeout_value`]).
//!
//! ```
//! use std::time::{Duration, Instant};
//! use http::HeaderValue;
//! use stormguard_core::deadline::{grpc_timeout_value, parse_grpc_timeout, Deadline};
//!
//! let now = Instant::now();
//! let timeout = parse_grpc_timeout(&HeaderValue::from_static("1S")).expect("valid");
//! let deadline = Deadline::at(now + timeout);
//! assert!(deadline.allows(now, Duration::from_millis(300)));
//! assert!(!deadline.allows(now, Duration::from_secs(2)));
//! let left = deadline.remaining(now + Duration::from_millis(300));
//! assert_eq!(grpc_timeout_value(left), HeaderValue::from_static("700000u"));
//! ```

use std::time::{Duration, Instant};

use http::HeaderValue;

/// The instant after which the caller no longer waits for an answer.
///
/// As a request extension, `stormguard::Deadline` tells the retry layer not to
/// schedule a retry whose wait would end after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(Instant);

impl Deadline {
    /// A deadline at `instant`.
    pub const fn at(instant: Instant) -> Self {
        Deadline(instant)
    }

    /// A deadline `timeout` after `now` (saturating far in the future).
    pub fn after(now: Instant, timeout: Duration) -> Self {
        Deadline(now.checked_add(timeout).unwrap_or_else(|| far_future(now)))
    }

    /// The instant itself.
    pub fn instant(&self) -> Instant {
        self.0
    }

    /// How long is left at `now`; zero once it has passed.
    pub fn remaining(&self, now: Instant) -> Duration {
        self.0.saturating_duration_since(now)
    }

    /// Whether an attempt sent after waiting `wait` from `now` still starts before the
    /// deadline.
    pub fn allows(&self, now: Instant, wait: Duration) -> bool {
        now.checked_add(wait).is_some_and(|sent| sent < self.0)
    }
}

/// About thirty years on: what "no deadline" saturates to.
fn far_future(now: Instant) -> Instant {
    const THIRTY_YEARS: Duration = Duration::from_secs(30 * 365 * 24 * 3600);
    now.checked_add(THIRTY_YEARS).unwrap_or(now)
}

/// Parses a `grpc-timeout` header: one to eight ASCII digits and a unit, `H` hours,
/// `M` minutes, `S` seconds, `m` milliseconds, `u` microseconds, `n` nanoseconds (the
/// gRPC over HTTP/2 protocol). Anything else gives `None`; never panics.
///
/// ```
/// use std::time::Duration;
/// use http::HeaderValue;
/// use stormguard_core::deadline::parse_grpc_timeout;
///
/// assert_eq!(parse_grpc_timeout(&HeaderValue::from_static("250m")), Some(Duration::from_millis(250)));
/// assert_eq!(parse_grpc_timeout(&HeaderValue::from_static("2H")), Some(Duration::from_secs(7200)));
/// assert_eq!(parse_grpc_timeout(&HeaderValue::from_static("123456789S")), None);
/// assert_eq!(parse_grpc_timeout(&HeaderValue::from_static("1.5S")), None);
/// ```
pub fn parse_grpc_timeout(value: &HeaderValue) -> Option<Duration> {
    let bytes = value.as_bytes();
    let (&unit, digits) = bytes.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits
        .iter()
        .fold(0u64, |acc, d| acc * 10 + u64::from(d - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The `grpc-timeout` value for `remaining`: the finest unit whose count fits the
/// protocol's eight digits, rounded down so that a rewritten timeout never outlasts
/// the caller's.
///
/// ```
/// use std::time::Duration;
/// use stormguard_core::deadline::grpc_timeout_value;
///
/// assert_eq!(grpc_timeout_value(Duration::from_millis(1500)), "1500000u");
/// assert_eq!(grpc_timeout_value(Duration::from_secs(86_400)), "86400000m");
/// assert_eq!(grpc_timeout_value(Duration::from_secs(1_000_000)), "1000000S");
/// assert_eq!(grpc_timeout_value(Duration::ZERO), "0n");
/// ```
pub fn grpc_timeout_value(remaining: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let nanos = remaining.as_nanos();
    let units: [(u128, char); 6] = [
        (1, 'n'),
        (1_000, 'u'),
        (1_000_000, 'm'),
        (1_000_000_000, 'S'),
        (60_000_000_000, 'M'),
        (3_600_000_000_000, 'H'),
    ];
    let (count, unit) = units
        .iter()
        .map(|&(size, unit)| (nanos / size, unit))
        .find(|&(count, _)| count <= MAX)
        .unwrap_or((MAX, 'H'));
    let mut text = count.to_string();
    text.push(unit);
    HeaderValue::try_from(text).unwrap_or(HeaderValue::from_static("99999999H"))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests take their time zero from the clock
mod tests {
    use super::*;

    fn parse(s: &'static str) -> Option<Duration> {
        parse_grpc_timeout(&HeaderValue::from_static(s))
    }

    #[test]
    fn every_unit_and_the_limits() {
        assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse("7S"), Some(Duration::from_secs(7)));
        assert_eq!(parse("20m"), Some(Duration::from_millis(20)));
        assert_eq!(parse("9u"), Some(Duration::from_micros(9)));
        assert_eq!(parse("0n"), Some(Duration::ZERO));
        assert_eq!(
            parse("99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        for bad in [
            "",
            "S",
            "1",
            "1s",
            "-1S",
            "+1S",
            " 1S",
            "1 S",
            "123456789m",
            "1x",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn encoding_round_trips_down_to_the_unit() {
        for d in [
            Duration::ZERO,
            Duration::from_nanos(99_999_999),
            Duration::from_nanos(100_000_001),
            Duration::from_millis(700),
            Duration::from_secs(99_999_999),
            Duration::from_secs(400_000_000),
            Duration::MAX,
        ] {
            let value = grpc_timeout_value(d);
            let back = parse_grpc_timeout(&value).expect("parses back");
            assert!(back <= d, "{d:?} -> {value:?} -> {back:?}");
            // Rounded down by less than one unit of the encoding (or clamped at the
            // largest value the header can carry).
            let unit = match value.as_bytes().last() {
                Some(b'n') => Duration::from_nanos(1),
                Some(b'u') => Duration::from_micros(1),
                Some(b'm') => Duration::from_millis(1),
                Some(b'S') => Duration::from_secs(1),
                Some(b'M') => Duration::from_secs(60),
                _ => Duration::from_secs(3600),
            };
            assert!(
                d - back < unit || back == Duration::from_secs(99_999_999 * 3600),
                "{d:?} -> {value:?}"
            );
        }
    }

    #[test]
    fn a_wait_fits_only_if_the_attempt_starts_before_the_deadline() {
        let now = Instant::now();
        let deadline = Deadline::after(now, Duration::from_secs(1));
        assert!(deadline.allows(now, Duration::from_millis(999)));
        assert!(!deadline.allows(now, Duration::from_secs(1)));
        assert!(!deadline.allows(now, Duration::MAX));
        assert_eq!(
            deadline.remaining(now + Duration::from_secs(5)),
            Duration::ZERO
        );
        assert!(Deadline::after(now, Duration::MAX).instant() > now);
    }

    #[test]
    fn what_remains_is_the_deadline_less_the_time_gone() {
        let now = Instant::now();
        let deadline = Deadline::after(now, Duration::from_secs(1));
        assert_eq!(deadline.remaining(now), Duration::from_secs(1));
        assert_eq!(
            deadline.remaining(now + Duration::from_millis(300)),
            Duration::from_millis(700)
        );
    }

    #[test]
    fn a_timeout_too_large_to_add_means_thirty_years() {
        let now = Instant::now();
        let years = |n: u64| Duration::from_secs(n * 365 * 24 * 3600);
        let none = Deadline::after(now, Duration::MAX);
        assert_eq!(none.remaining(now), years(30));
        assert!(none.allows(now, years(29)));
        assert!(!none.allows(now, years(31)));
    }
}
