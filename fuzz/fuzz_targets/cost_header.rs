//! A request's cost from its cost header (`PolicyBuilder::cost_from_header`). Properties:
//! nothing panics; the cost is the header's whole number when it is one of at least 1, else 1.
#![no_main]

use std::sync::LazyLock;

use http::{HeaderName, HeaderValue, Request};
use libfuzzer_sys::fuzz_target;
use tower_redis_ratelimit::{Policy, Rule};

static POLICY: LazyLock<Policy> = LazyLock::new(|| {
    Policy::builder("fuzz")
        .rule(Rule::per_minute(10))
        .cost_from_header(HeaderName::from_static("x-cost"))
        .build()
        .expect("a valid policy")
});

fuzz_target!(|data: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let request = Request::get("/")
        .header("x-cost", value.clone())
        .body(())
        .unwrap();
    let cost = POLICY.cost(&request.into_parts().0);
    assert!(cost >= 1);
    // (A value with other than visible ASCII is no number: `HeaderValue::to_str` refuses it.)
    let text = value.to_str().unwrap_or("").trim();
    if !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit()) {
        match text.parse::<u64>() {
            Ok(number) if number >= 1 => assert_eq!(cost, number),
            _ => assert_eq!(cost, 1),
        }
    }
});
