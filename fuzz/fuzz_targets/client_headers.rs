//! The client side's header parser (`headers::parse`): `RateLimit`, `RateLimit-Policy`,
//! `Retry-After`, `X-RateLimit-*`. Properties: nothing panics on any values, and what the layer
//! writes parses back to the same names and numbers.
#![no_main]

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_redis_ratelimit::fuzzing::{SF_INTEGER_MAX, written_headers};
use tower_redis_ratelimit::headers;

const NAMES: [&str; 6] = [
    "ratelimit",
    "ratelimit-policy",
    "retry-after",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

#[derive(Debug, Arbitrary)]
struct Input {
    /// Any values under the six names.
    raw: Vec<(u8, Vec<u8>)>,
    /// Rules as the layer writes them: name, (quota, window), (remaining, reset).
    rules: Vec<(String, (u64, u64), (u64, u64))>,
}

fuzz_target!(|input: Input| {
    let mut raw = HeaderMap::new();
    for (name, value) in &input.raw {
        if let Ok(value) = HeaderValue::from_bytes(value) {
            raw.append(NAMES[usize::from(*name) % NAMES.len()], value);
        }
    }
    let _ = headers::parse(&raw);

    // Names repeat in a policy only once: the parser keeps the first of a name.
    let mut rules = input.rules;
    let mut seen = std::collections::HashSet::new();
    rules.retain(|(name, _, _)| seen.insert(name.clone()));
    let Some(written) = written_headers(&rules) else {
        return;
    };
    let parsed = headers::parse(&written)
        .unwrap_or_else(|error| panic!("{written:?} doesn't parse: {error}"));
    assert_eq!(parsed.policies.len(), rules.len(), "{written:?}");
    assert_eq!(parsed.limits.len(), rules.len(), "{written:?}");
    for ((name, (quota, window), (remaining, reset)), (policy, status)) in
        rules.iter().zip(parsed.policies.iter().zip(&parsed.limits))
    {
        assert_eq!(&policy.name, name);
        assert_eq!(policy.quota, (*quota).min(SF_INTEGER_MAX));
        assert_eq!(policy.window, Some((*window).min(SF_INTEGER_MAX)));
        assert_eq!(&status.name, name);
        assert_eq!(status.remaining, (*remaining).min(SF_INTEGER_MAX));
        assert_eq!(status.reset, Some((*reset).min(SF_INTEGER_MAX)));
    }
});
