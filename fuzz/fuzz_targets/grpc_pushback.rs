//! `parse_grpc_pushback` on arbitrary bytes: never panics, and waits exactly when the
//! value is a non-negative 32-bit decimal integer, an optional sign before its digits
//! as grpc-go and grpc-java read it (gRFC A6), else says do not retry.
#![no_main]

use std::time::Duration;

use http::HeaderValue;
use libfuzzer_sys::fuzz_target;
use stormguard_core::retry_after::{parse_grpc_pushback, Pushback};

fuzz_target!(|bytes: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(bytes) else {
        return;
    };
    let unsigned = bytes.strip_prefix(b"+").or(bytes.strip_prefix(b"-")).unwrap_or(bytes);
    let digits = !unsigned.is_empty() && unsigned.iter().all(u8::is_ascii_digit);
    let expected = digits
        .then(|| std::str::from_utf8(bytes).ok()?.parse::<i32>().ok())
        .flatten()
        .filter(|ms| *ms >= 0)
        .map_or(Pushback::DontRetry, |ms| {
            Pushback::After(Duration::from_millis(u64::from(ms.unsigned_abs())))
        });
    assert_eq!(parse_grpc_pushback(&value), expected);
});
