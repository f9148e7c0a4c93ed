//! `parse_retry_after` on arbitrary bytes and clocks: never panics, delta-seconds are
//! read exactly, and where httpdate (whose checks are a subset of ours for the
//! IMF-fixdate and asctime forms from 1970 on) accepts a date, we read the same instant.
#![no_main]

use std::time::{Duration, SystemTime};

use http::HeaderValue;
use libfuzzer_sys::fuzz_target;
use stormguard_core::retry_after::parse_retry_after;

fuzz_target!(|input: (i64, &[u8])| {
    let (secs, bytes) = input;
    // Any clock from 9999 BC-ish to 9999 AD-ish, both sides of 1970.
    let secs = secs % 400_000_000_000;
    let now = if secs >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        match SystemTime::UNIX_EPOCH.checked_sub(Duration::from_secs(secs.unsigned_abs())) {
            Some(now) => now,
            None => return,
        }
    };
    let Ok(value) = HeaderValue::from_bytes(bytes) else {
        return;
    };
    let parsed = parse_retry_after(&value, now);
    let trimmed = value.as_bytes().trim_ascii();
    if !trimmed.is_empty() && trimmed.iter().all(u8::is_ascii_digit) {
        assert!(parsed.is_some(), "delta-seconds {trimmed:?} refused");
        return;
    }
    // Only the forms without a two-digit year, where both parsers must agree.
    let rfc850 = trimmed.contains(&b'-');
    let Ok(text) = std::str::from_utf8(trimmed) else {
        return;
    };
    if rfc850 || text.len() != trimmed.len() || trimmed != value.as_bytes() {
        return;
    }
    if let Ok(when) = httpdate::parse_http_date(text) {
        let expected = when.duration_since(now).unwrap_or(Duration::ZERO);
        assert_eq!(parsed, Some(expected), "{text:?}");
    }
});
