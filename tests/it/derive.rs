//! `#[derive(LimitPolicy)]`: bad attributes fail to compile with the builder's messages, a derived
//! policy is the policy the builder builds, and a `Limited<P>` route with one refuses as usual.
// Clippy misreads repeated `rule(limit = ..)` as one attribute given twice (rust-clippy#13238).

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::post;
use axum::{Extension, Router};
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::{
    Algorithm, Key, LimitPolicy, LimitStore, Limited, MemoryStore, Mode, OnStoreError, Policy,
    Rule, policy::Scope,
};

/// Every bad attribute of `tests/derive_fail/` is a compile error, with the message and the
/// span written in its `.stderr` (regenerate with `TRYBUILD=overwrite` and read the diff).
#[test]
fn bad_attributes_fail_to_compile_with_the_builders_messages() {
    trybuild::TestCases::new().compile_fail("tests/derive_fail/*.rs");
}

#[derive(LimitPolicy)]
#[rate_limit(
    name = "login",
    key = "ip",
    algorithm = "sliding_log",
    message = "Too many login attempts, try again later.",
    rule(limit = 10, period = "60s"),
    rule(limit = 20, period = "120s"),
    prevent_duplicate(period = "5s")
)]
struct Login;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 100, period = "1h30m", burst = 150, name = "steady"))]
#[rate_limit(algorithm = "token_bucket", key = "header:X-Api-Key", scope = "route")]
#[rate_limit(on_store_error = "deny", block_for = "15m", cost_header = "x-cost")]
struct Api;

#[derive(LimitPolicy)]
#[rate_limit(
    key = "user",
    mode = "delay",
    max_delay = "2s",
    max_in_flight = 2,
    lease = "30s",
    prevent_duplicate
)]
struct Reports;

#[derive(LimitPolicy)]
#[rate_limit(
    key = "query:tenant",
    algorithm = "sliding_counter",
    mode = "shadow",
    rule(limit = 5, period = "1500ms")
)]
struct Shadowed;

#[derive(LimitPolicy)]
#[rate_limit(
    key = "global",
    algorithm = "fixed_window",
    rule(limit = 1000, period = "1d")
)]
struct Everyone;

#[derive(LimitPolicy)]
#[rate_limit(rule(limit = 3, period = "1s"))]
#[allow(non_camel_case_types)]
struct r#match;

#[derive(LimitPolicy)]
#[rate_limit(
    key = "header:x-api-key",
    algorithm = "fixed_window",
    rule(limit = 60, period = "1m"),
    rule(limit = 40000, period = "1m", metered),
    meter(
        unit = "tokens",
        estimate = 500,
        estimate_header = "x-estimated-tokens",
        usage_header = "x-usage-tokens",
        max_usage = 100000
    )
)]
struct Tokens;

/// A derived meter is the builder's: its rules, names and unit, and its estimate (a header's
/// whole number, else the fixed one).
#[test]
fn a_derived_meter_is_the_meter_the_builder_builds() {
    let policy = Tokens::policy().unwrap();
    let names: Vec<&str> = policy.rule_names().iter().map(|name| &**name).collect();
    assert_eq!(names, ["60-per-60s", "40000-tokens-per-60s"]);
    assert!(policy.rules()[1].is_metered() && !policy.rules()[0].is_metered());
    assert_eq!(policy.meter().unwrap().unit(), "tokens");
    let limiter = tower_redis_ratelimit::RateLimiter::new(policy, MemoryStore::new());
    // The estimate decides what a request reserves: seen in what the check leaves.
    let app = Router::new()
        .route("/", post(|| async { ([("x-usage-tokens", "10")], "ok") }))
        .layer(tower_redis_ratelimit::RateLimitLayer::new(
            Tokens::policy().unwrap(),
            MemoryStore::new(),
        ));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let request = |estimate: Option<&str>| {
            let mut request = Request::post("/").header("x-api-key", "k");
            if let Some(estimate) = estimate {
                request = request.header("x-estimated-tokens", estimate);
            }
            request.body(Body::empty()).unwrap()
        };
        let first = app.clone().oneshot(request(None)).await.unwrap();
        let headers = tower_redis_ratelimit::headers::parse(first.headers()).unwrap();
        assert_eq!(
            headers.status("40000-tokens-per-60s").unwrap().remaining,
            39_500
        );
        axum::body::to_bytes(first.into_body(), usize::MAX)
            .await
            .unwrap();
        let second = app.clone().oneshot(request(Some("2000"))).await.unwrap();
        let headers = tower_redis_ratelimit::headers::parse(second.headers()).unwrap();
        // 10 settled from the first's usage header, then 2 000 reserved.
        assert_eq!(
            headers.status("40000-tokens-per-60s").unwrap().remaining,
            37_990
        );
        let reservation = limiter.reserve("k", 100).await.unwrap();
        assert_eq!(reservation.decision().unwrap().rules[1].remaining, 39_900);
    });
}

#[test]
fn the_default_name_is_the_types_name_without_its_raw_prefix() {
    assert_eq!(r#match::policy().unwrap().name(), "match");
    assert_eq!(Everyone::policy().unwrap().name(), "Everyone");
}

/// What a policy is, field by field, as its public accessors tell.
fn fields(policy: &Policy) -> String {
    format!(
        "name={:?} prefix={:?} key={:?} rules={:?} names={:?} algorithm={:?} message={:?} \
         scope={:?} missing_key={:?} on_store_error={:?} mode={:?} block_for={:?} \
         concurrency={:?} max_cost={}",
        policy.name(),
        policy.prefix(),
        policy.key(),
        policy.rules(),
        policy.rule_names(),
        policy.algorithm(),
        policy.message(),
        policy.scope(),
        policy.missing_key(),
        policy.on_store_error(),
        policy.mode(),
        policy.block_for(),
        policy.concurrency(),
        policy.max_cost(),
    )
}

fn cost_of(policy: &Policy, cost_header: Option<&str>) -> u64 {
    let mut request = Request::post("/");
    if let Some(cost) = cost_header {
        request = request.header("x-cost", cost);
    }
    policy.cost(&request.body(()).unwrap().into_parts().0)
}

#[test]
fn a_derived_policy_is_the_policy_the_builder_builds() {
    let secs = Duration::from_secs;
    let table: Vec<(Policy, Policy)> = vec![
        (
            Login::policy().unwrap(),
            Policy::builder("login")
                .key(Key::ip())
                .algorithm(Algorithm::SlidingLog)
                .message("Too many login attempts, try again later.")
                .rule(Rule::per_minute(10))
                .rule(Rule::new(20, secs(120)))
                .prevent_duplicate(secs(5))
                .build()
                .unwrap(),
        ),
        (
            Api::policy().unwrap(),
            Policy::builder("Api")
                .rule(Rule::new(100, secs(5400)).burst(150).named("steady"))
                .algorithm(Algorithm::TokenBucket)
                .key(Key::header(http::HeaderName::from_static("x-api-key")))
                .scope(Scope::Route)
                .on_store_error(OnStoreError::Deny)
                .block_for(secs(900))
                .cost_from_header(http::HeaderName::from_static("x-cost"))
                .build()
                .unwrap(),
        ),
        (
            Reports::policy().unwrap(),
            Policy::builder("Reports")
                .key(Key::user())
                .mode(Mode::Delay { max_delay: secs(2) })
                .max_in_flight(2)
                .lease(secs(30))
                .prevent_duplicate(tower_redis_ratelimit::policy::DEFAULT_DUPLICATE_WINDOW)
                .build()
                .unwrap(),
        ),
        (
            Shadowed::policy().unwrap(),
            Policy::builder("Shadowed")
                .key(Key::query("tenant"))
                .algorithm(Algorithm::SlidingCounter)
                .mode(Mode::Shadow)
                .rule(Rule::new(5, Duration::from_millis(1500)))
                .build()
                .unwrap(),
        ),
        (
            Everyone::policy().unwrap(),
            Policy::builder("Everyone")
                .key(Key::global())
                .algorithm(Algorithm::FixedWindow)
                .rule(Rule::per_day(1000))
                .build()
                .unwrap(),
        ),
    ];
    for (derived, built) in &table {
        assert_eq!(fields(derived), fields(built));
        for header in [None, Some("7"), Some("nonsense")] {
            assert_eq!(
                cost_of(derived, header),
                cost_of(built, header),
                "{header:?}"
            );
        }
    }
    // The cost header is read: the check above can tell a policy that ignores it.
    assert_eq!(cost_of(&table[1].0, Some("7")), 7);
    assert_eq!(cost_of(&table[0].0, Some("7")), 1);
}

#[derive(LimitPolicy)]
#[rate_limit(name = "two-a-minute", rule(limit = 2, period = "1m"))]
struct TwoAMinute;

async fn limited(limited: Limited<TwoAMinute>) -> (Limited<TwoAMinute>, &'static str) {
    (limited, "ok")
}

#[tokio::test]
async fn a_limited_route_with_a_derived_policy_refuses_the_third_request() {
    let store = LimitStore::new(MemoryStore::new());
    store
        .check::<TwoAMinute>()
        .expect("a derived policy builds");
    let app = Router::new()
        .route("/", post(limited))
        .layer(Extension(store));
    let peer: SocketAddr = "203.0.113.9:4000".parse().unwrap();
    let mut answers = Vec::new();
    for _ in 0..3 {
        let request = Request::post("/")
            .extension(ConnectInfo(peer))
            .body(Body::empty())
            .unwrap();
        answers.push(app.clone().oneshot(request).await.unwrap());
    }
    let statuses: Vec<StatusCode> = answers.iter().map(|answer| answer.status()).collect();
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let refused = answers[2].headers();
    assert_eq!(refused["ratelimit-policy"], "\"2-per-60s\";q=2;w=60");
    assert!(
        refused["ratelimit"]
            .to_str()
            .unwrap()
            .starts_with("\"2-per-60s\";r=0;t="),
        "{refused:?}"
    );
    let retry_after: u64 = refused["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    assert_eq!(
        answers[1].headers()["ratelimit-policy"],
        "\"2-per-60s\";q=2;w=60"
    );
}

#[derive(LimitPolicy)]
#[rate_limit(
    name = "failures",
    key = "global",
    rule(limit = 5, period = "15m"),
    count_only = [401, 403, "5xx"]
)]
struct LoginFailures;

#[test]
fn count_only_counts_the_codes_and_classes_written() {
    let policy = LoginFailures::policy().unwrap();
    for (status, counts) in [
        (401, true),
        (403, true),
        (500, true),
        (599, true),
        (200, false),
        (404, false),
        (499, false),
    ] {
        let status = http::StatusCode::from_u16(status).unwrap();
        assert_eq!(policy.counts(status), counts, "{status}");
    }
    assert!(policy.counts_only_some());
}
