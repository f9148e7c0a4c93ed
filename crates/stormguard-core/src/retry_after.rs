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
/// not delta-seconds) and the three HTTP-date forms of RFC 9110, section 5.6.7, each
/// checked byte for byte against its grammar:
/// IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the obsolete RFC 850 form
/// (`Sunday, 06-Nov-94 08:49:37 GMT`) and asctime (`Sun Nov  6 08:49:37 1994`). The
/// day name must be the date's weekday. An RFC 850 two-digit year is read as RFC 9110
/// says: as the year with those last two digits that is at most 50 years after `now`'s
/// year, and otherwise in the past (in 2026, `70` is 2070 and `77` is 1977).
///
/// A date in the past, however far (before 1970 included), gives [`Duration::ZERO`]. A
/// delta too large for a `u64` saturates at `u64::MAX` seconds. Anything else (empty,
/// non-ASCII, a malformed or impossible date such as day 32, hour 25 or a Monday that
/// was a Sunday) gives `None`, and the caller falls back to its own backoff. This
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
    let text = value.as_bytes();
    let start = text.iter().position(|b| !matches!(b, b' ' | b'\t'))?;
    let end = text.iter().rposition(|b| !matches!(b, b' ' | b'\t'))?;
    let text = &text[start..=end];
    if text.iter().all(u8::is_ascii_digit) {
        let secs = text.iter().fold(0u64, |acc, digit| {
            acc.saturating_mul(10)
                .saturating_add(u64::from(digit - b'0'))
        });
        return Some(Duration::from_secs(secs));
    }
    let now = unix_nanos(now);
    let wait = http_date(text, now)? - now;
    if wait <= 0 {
        return Some(Duration::ZERO);
    }
    let secs = u64::try_from(wait / NANOS).unwrap_or(u64::MAX);
    let nanos = u32::try_from(wait % NANOS).unwrap_or(0);
    Some(Duration::new(secs, nanos))
}

const NANOS: i128 = 1_000_000_000;

/// Nanoseconds from the Unix epoch to `time` (negative before it).
fn unix_nanos(time: SystemTime) -> i128 {
    match time.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => after.as_nanos() as i128,
        Err(before) => -(before.duration().as_nanos() as i128),
    }
}

const MONTHS: [&[u8; 3]; 12] = [
    b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// An HTTP-date in any of its three forms, as nanoseconds since the Unix epoch (a
/// whole second). `now` (in the same unit) resolves RFC 850's two-digit years.
fn http_date(text: &[u8], now: i128) -> Option<i128> {
    // IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`
    if let [d0, d1, d2, b',', b' ', dd0, dd1, b' ', m0, m1, m2, b' ', y0, y1, y2, y3, b' ', time @ .., b' ', b'G', b'M', b'T'] =
        text
    {
        let year = digits(&[*y0, *y1, *y2, *y3])?;
        return civil(
            year,
            &[*m0, *m1, *m2],
            &[*dd0, *dd1],
            time,
            &[*d0, *d1, *d2],
        );
    }
    // asctime: `Sun Nov  6 08:49:37 1994` (a one-digit day is padded with a space)
    if let [d0, d1, d2, b' ', m0, m1, m2, b' ', dd0, dd1, b' ', time @ .., b' ', y0, y1, y2, y3] =
        text
    {
        let day = if *dd0 == b' ' {
            [b'0', *dd1]
        } else {
            [*dd0, *dd1]
        };
        let year = digits(&[*y0, *y1, *y2, *y3])?;
        return civil(year, &[*m0, *m1, *m2], &day, time, &[*d0, *d1, *d2]);
    }
    // RFC 850: `Sunday, 06-Nov-94 08:49:37 GMT`
    let comma = text.iter().position(|b| *b == b',')?;
    let (name, rest) = text.split_at(comma);
    if let [b',', b' ', dd0, dd1, b'-', m0, m1, m2, b'-', y0, y1, b' ', time @ .., b' ', b'G', b'M', b'T'] =
        rest
    {
        if !DAYS.iter().any(|day| day.as_bytes() == name) {
            return None;
        }
        let two = digits(&[*y0, *y1])?;
        // RFC 9110, 5.6.7: a year more than 50 years ahead is the last one in the past
        // with the same two digits; otherwise it is the one in the coming 50 years.
        let this_year = year_of(now.div_euclid(NANOS));
        let mut year = this_year - this_year.rem_euclid(100) + two;
        if year > this_year + 50 {
            year -= 100;
        } else if year <= this_year - 50 {
            year += 100;
        }
        return civil(year, &[*m0, *m1, *m2], &[*dd0, *dd1], time, &name[..3]);
    }
    None
}

/// The date from its parts, checked: the month's name, the day within that month, the
/// time `HH:MM:SS` (no leap second), and the day name (its first three letters) that
/// of the date's weekday. Nanoseconds since the Unix epoch.
fn civil(year: i64, month: &[u8], day: &[u8; 2], time: &[u8], weekday: &[u8]) -> Option<i128> {
    let month = MONTHS.iter().position(|m| m.as_slice() == month)? as i64 + 1;
    let day = digits(day)?;
    let [h0, h1, b':', m0, m1, b':', s0, s1] = time else {
        return None;
    };
    let (hour, min, sec) = (
        digits(&[*h0, *h1])?,
        digits(&[*m0, *m1])?,
        digits(&[*s0, *s1])?,
    );
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    if day < 1 || day > month_days || hour > 23 || min > 59 || sec > 59 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    // 1970-01-01 was a Thursday (index 3, Monday first).
    let wday = (days + 3).rem_euclid(7) as usize;
    if DAYS[wday].as_bytes()[..3] != *weekday {
        return None;
    }
    let secs = days * 86_400 + hour * 3600 + min * 60 + sec;
    Some(i128::from(secs) * NANOS)
}

/// The number a run of ASCII digits spells, or `None` if a byte is not a digit.
fn digits(bytes: &[u8]) -> Option<i64> {
    bytes.iter().try_fold(0i64, |acc, b| {
        b.is_ascii_digit().then(|| acc * 10 + i64::from(b - b'0'))
    })
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Hinnant's formula).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The proleptic Gregorian year of the day holding `secs` seconds since the Unix epoch.
fn year_of(secs: i128) -> i64 {
    // Clamped far beyond any date a header can carry (years 0 to 9999).
    let days = secs.div_euclid(86_400).clamp(-1_000_000_000, 1_000_000_000) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    yoe + era * 400 + i64::from(month <= 2)
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
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static("+250")), Pushback::After(Duration::from_millis(250)));
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static("-1")), Pushback::DontRetry);
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static(" 250")), Pushback::DontRetry);
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static("2147483648")), Pushback::DontRetry);
/// ```
pub fn parse_grpc_pushback(value: &HeaderValue) -> Pushback {
    // An int32 as grpc-java reads one (`Integer.valueOf`, as Rust's `i32` parser): an
    // optional sign, then digits, nothing else. grpc-go's `strconv.Atoi` reads 64 bits;
    // past 2^31 - 1 ms (24 days) this reads "do not retry", as grpc-java does.
    let parsed = std::str::from_utf8(value.as_bytes())
        .ok()
        .and_then(|text| text.parse::<i32>().ok())
        .and_then(|ms| u64::try_from(ms).ok());
    match parsed {
        Some(ms) => Pushback::After(Duration::from_millis(ms)),
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
    fn february_has_29_days_in_leap_years_only_and_april_30() {
        let now = at(0);
        for valid in [
            "Tue, 29 Feb 2000 00:00:00 GMT",
            "Thu, 29 Feb 2024 00:00:00 GMT",
            "Sun, 30 Apr 2023 00:00:00 GMT",
        ] {
            assert!(parse(valid.as_bytes(), now).is_some(), "{valid}");
        }
        // Each names the weekday the day after would have, so only the month's length
        // can refuse it.
        for invalid in [
            "Thu, 29 Feb 1900 00:00:00 GMT",
            "Wed, 29 Feb 2023 00:00:00 GMT",
            "Mon, 31 Apr 2023 00:00:00 GMT",
        ] {
            assert_eq!(parse(invalid.as_bytes(), now), None, "{invalid}");
        }
    }

    /// The year a two-digit RFC 850 year is resolved against is right on every day of
    /// four centuries (leap days and century years included).
    #[test]
    fn the_current_year_is_found_on_every_day_from_1900_to_2300() {
        for year in 1900..2300 {
            let first = days_from_civil(year, 1, 1);
            let last = days_from_civil(year, 12, 31);
            for day in first..=last {
                let secs = i128::from(day) * 86_400;
                assert_eq!(year_of(secs), year, "day {day}");
                assert_eq!(year_of(secs + 86_399), year, "end of day {day}");
            }
        }
    }

    #[test]
    fn a_date_is_waited_for_to_the_nanosecond() {
        let now = at(EXAMPLE - 2) + Duration::from_millis(500);
        assert_eq!(
            parse(b"Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(Duration::from_millis(1_500))
        );
    }

    #[test]
    fn past_date_is_zero() {
        let now = at(EXAMPLE + 3600);
        assert_eq!(
            parse(b"Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(Duration::ZERO)
        );
    }

    /// Found by the fuzzer: httpdate never checked the byte before an RFC 850 hour.
    #[test]
    fn malformed_rfc850_dates_are_rejected() {
        let now = at(EXAMPLE - 90);
        for bad in [
            &b"Sunday, 06-Nov-94!08:49:37 GMT"[..],
            b"Sunday, 06-Nov-94 08:49:37!GMT",
            b"Sunday, 06 Nov-94 08:49:37 GMT",
            b"Sunday,06-Nov-94 08:49:37 GMT",
            b"Sun, 06-Nov-94 08:49:37 GMT",
            b"Monday, 06-Nov-94 08:49:37 GMT",
            b"Sunday, 06-Nov-1994 08:49:37 GMT",
            b"Sunday, 06-Nov-94 08:49:37",
            b"Sunday, 6-Nov-94 08:49:37 GMT",
            b"Sunday, 06-nov-94 08:49:37 GMT",
            b"Sunday, 06-Nov-94 08.49.37 GMT",
        ] {
            assert_eq!(parse(bad, now), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn malformed_imf_and_asctime_dates_are_rejected() {
        let now = at(EXAMPLE - 90);
        for bad in [
            &b"Mon, 06 Nov 1994 08:49:37 GMT"[..],
            b"Sun, 06 Nov 1994 08:49:37 GMT.",
            b"Sun,  06 Nov 1994 08:49:37 GMT",
            b"Sun, 6 Nov 1994 08:49:37 GMT",
            b"Sun, 06 Nov 94 08:49:37 GMT",
            b"Sun, 06 Nov 1994 08:49:37 gmt",
            b"Sun, 06 Nov 1994 08:49:60 GMT",
            b"Sun, 31 Nov 1994 08:49:37 GMT",
            b"Sun Nov 6 08:49:37 1994",
            b"Sun Nov  6 08:49:37 94",
            b"Mon Nov  6 08:49:37 1994",
            b"Sun Nov 06 08:49:37 1994 GMT",
        ] {
            assert_eq!(parse(bad, now), None, "{}", String::from_utf8_lossy(bad));
        }
        // Leap days exist only in leap years; an asctime day may be zero-padded too.
        assert_eq!(
            parse(b"Thu, 29 Feb 1996 00:00:00 GMT", at(0)).map(|_| ()),
            Some(())
        );
        assert_eq!(parse(b"Sat, 29 Feb 1997 00:00:00 GMT", at(0)), None);
        assert_eq!(
            parse(b"Sun Nov 06 08:49:37 1994", now),
            Some(Duration::from_secs(90))
        );
    }

    /// Found by the fuzzer: httpdate cannot represent dates before 1970, so they were
    /// `None` instead of the zero promised for any past date.
    #[test]
    fn any_past_date_is_zero_even_before_1970() {
        let now = at(EXAMPLE);
        for past in [
            &b"Thu, 01 Jan 1970 00:00:00 GMT"[..],
            b"Wed, 31 Dec 1969 23:59:59 GMT",
            b"Tue, 04 Jul 1905 12:00:00 GMT",
            b"Sat, 01 Jan 0000 00:00:00 GMT",
            b"Fri Dec 31 23:59:59 1965",
        ] {
            assert_eq!(
                parse(past, now),
                Some(Duration::ZERO),
                "{}",
                String::from_utf8_lossy(past)
            );
        }
        // Even when `now` itself is before 1970.
        let before = SystemTime::UNIX_EPOCH - Duration::from_secs(86_400 * 365);
        assert_eq!(
            parse(b"Wed, 31 Dec 1969 23:59:59 GMT", before),
            Some(Duration::from_secs(86_400 * 365 - 1))
        );
        assert_eq!(
            parse(b"Sun, 01 Jan 1905 00:00:00 GMT", before),
            Some(Duration::ZERO)
        );
    }

    /// Found by the fuzzer: a two-digit year was read with a fixed pivot (70 as 1970).
    /// RFC 9110: a year more than 50 years in the future is the last such year past.
    #[test]
    fn rfc850_two_digit_years_follow_rfc9110() {
        // Thu, 01 Jan 2026 00:00:00 GMT
        let y2026 = at(1_767_225_600);
        // 2070 is 44 years ahead: the future, not 1970.
        let in_2070 = parse(b"Wednesday, 01-Jan-70 00:00:00 GMT", y2026).expect("2070");
        assert_eq!(in_2070, Duration::from_secs(3_155_760_000 - 1_767_225_600));
        // 1 Jan 1970 was a Thursday: that weekday does not match 2070.
        assert_eq!(parse(b"Thursday, 01-Jan-70 00:00:00 GMT", y2026), None);
        // 2076 is exactly 50 years ahead: still the future.
        assert!(parse(b"Wednesday, 01-Jan-76 00:00:00 GMT", y2026).expect("2076") > in_2070);
        // 2077 would be 51 years ahead: it is 1977, in the past.
        assert_eq!(
            parse(b"Saturday, 01-Jan-77 00:00:00 GMT", y2026),
            Some(Duration::ZERO)
        );
        // The weekday is checked against the year it resolves to (1 Jan 1977 was a
        // Saturday, 1 Jan 2077 a Friday).
        assert_eq!(parse(b"Friday, 01-Jan-77 00:00:00 GMT", y2026), None);
        // In 1994, 94 is 1994 and 20 is 2020 (26 years ahead).
        let now = at(EXAMPLE - 90);
        assert_eq!(
            parse(b"Sunday, 06-Nov-94 08:49:37 GMT", now),
            Some(Duration::from_secs(90))
        );
        assert!(parse(b"Wednesday, 01-Jan-20 00:00:00 GMT", now)
            .is_some_and(|d| d > Duration::from_secs(25 * 365 * 86_400)));
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
        // A sign is allowed, as grpc-go (`strconv.Atoi`) and grpc-java
        // (`Integer.valueOf`) allow it.
        assert_eq!(p("+5"), Pushback::After(Duration::from_millis(5)));
        assert_eq!(p("-0"), Pushback::After(Duration::ZERO));
        for bad in [
            "-1",
            "2147483648",
            "99999999999999",
            "",
            "+",
            "-",
            "+-5",
            "1.5",
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
