//! Classification of arbitrary statuses and header maps, several values per name:
//! never panics; the clock is read only for a 429 or 503 without a valid `grpc-status`;
//! a success without a valid `grpc-status` is a success.
#![no_main]

use std::cell::Cell;
use std::time::{Duration, SystemTime};

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use libfuzzer_sys::fuzz_target;
use stormguard_core::classify::{grpc_status, Class, Rules};

const NAMES: [&str; 6] = [
    "retry-after",
    "grpc-status",
    "grpc-retry-pushback-ms",
    "grpc-message",
    "content-type",
    "x-other",
];

#[derive(Debug, Arbitrary)]
struct Input<'a> {
    status: u16,
    now_secs: u32,
    headers: Vec<(u8, &'a [u8])>,
}

fuzz_target!(|input: Input<'_>| {
    let Ok(status) = StatusCode::from_u16(input.status) else {
        return;
    };
    let mut headers = HeaderMap::new();
    for (name, value) in input.headers {
        let name = HeaderName::from_static(NAMES[usize::from(name) % NAMES.len()]);
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.append(name, value);
        }
    }
    let rules = Rules::default();
    let read = Cell::new(false);
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(u64::from(input.now_secs));
    let class = rules.classify_with(status, &headers, || {
        read.set(true);
        now
    });
    // An empty or non-numeric `grpc-status` is no gRPC status: the HTTP rules apply.
    let grpc = grpc_status(&headers).is_some();
    if read.get() {
        assert!(
            !grpc && matches!(status.as_u16(), 429 | 503),
            "clock read for {status}"
        );
    }
    if !grpc && status.is_success() {
        assert_eq!(class, Class::Success);
    }
    assert_eq!(rules.classify(status, &headers, now), class);
    let _ = rules.classify_grpc_response(status, &headers);
});
