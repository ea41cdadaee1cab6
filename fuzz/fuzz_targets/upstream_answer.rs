//! The outbound layer's reading of an upstream's answer (`outbound::announced_pause`): HTTP
//! rate-limit headers, and gRPC's `grpc-status`, `grpc-retry-pushback-ms` and
//! `grpc-status-details-bin`. Properties: nothing panics; a 429 with a `Retry-After` of n
//! seconds (digits only, as RFC 9110's delay-seconds) pauses at least n seconds.
#![no_main]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderValue, StatusCode};
use libfuzzer_sys::fuzz_target;
use tower_redis_ratelimit::outbound::announced_pause;

const NAMES: [&str; 9] = [
    "retry-after",
    "ratelimit",
    "ratelimit-policy",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "x-ratelimit-limit",
    "grpc-status",
    "grpc-retry-pushback-ms",
    "grpc-status-details-bin",
];

#[derive(Debug, Arbitrary)]
struct Input {
    status: u16,
    now_secs: u32,
    headers: Vec<(u8, Vec<u8>)>,
}

fuzz_target!(|input: Input| {
    let status = StatusCode::from_u16(input.status % 500 + 100).unwrap_or(StatusCode::OK);
    let now = UNIX_EPOCH + Duration::from_secs(u64::from(input.now_secs));
    let mut headers = HeaderMap::new();
    for (name, value) in &input.headers {
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.append(NAMES[usize::from(*name) % NAMES.len()], value);
        }
    }
    let pause = announced_pause(status, &headers, now);
    let _ = announced_pause(status, &headers, SystemTime::now());
    // One Retry-After of plain seconds on a 429: at least that long.
    let retry: Vec<_> = headers.get_all("retry-after").iter().collect();
    if status == StatusCode::TOO_MANY_REQUESTS
        && let [only] = retry[..]
        && let Ok(text) = only.to_str()
        && !text.is_empty()
        && text.bytes().all(|byte| byte.is_ascii_digit())
        && let Ok(seconds) = text.parse::<u32>()
        && seconds > 0
    {
        let pause = pause.expect("a 429 with Retry-After pauses");
        assert!(
            pause >= Duration::from_secs(u64::from(seconds)),
            "{pause:?} < {seconds} s"
        );
    }
});
