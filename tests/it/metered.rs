//! Metered limits through the layer (issue 48): a request reserves its estimate, its handler
//! (or a stream as it ends, or a usage header) records what it used, and the layer settles once
//! the body has ended and the last `Usage` is gone. Both stores, at times the test sets.

use crate::common;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::response::IntoResponse;
use axum::routing::get;
use bytes::Bytes;
use common::capture::Captured;
use common::timed::{Timed, a_minute_an_hour_ahead, both_stores};
use common::{limits, request_from, retry_after_secs, send};
use http::{Response, StatusCode};
use http_body::{Body as _, Frame};
use tower_redis_ratelimit::headers::RateLimitHeaders;
use tower_redis_ratelimit::meter::{Meter, Usage};
use tower_redis_ratelimit::{Algorithm, Key, Policy, RateLimitLayer, RateLimiter, Rule, Store};

const TOKENS: &str = "10000-tokens-per-3600s";

/// What the rule named `rule` has left, as a response's headers say.
fn left(headers: &RateLimitHeaders, rule: &str) -> u64 {
    headers.status(rule).expect("the rule's item").remaining
}

/// A streamed answer of `chunks` chunks that records `per_chunk` units as each is sent, and
/// lets its `Usage` go when it ends (or is dropped: the client left).
struct Streamed {
    chunks: u64,
    per_chunk: u64,
    usage: Option<Usage>,
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.chunks == 0 {
            self.usage = None;
            return Poll::Ready(None);
        }
        self.chunks -= 1;
        if let Some(usage) = &self.usage {
            usage.record(self.per_chunk);
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
            b"data: token\n\n",
        )))))
    }
}

/// The routes of a gateway whose handlers report usage every way a handler can.
fn gateway(policy: Policy, store: Arc<dyn Store>) -> Router {
    Router::new()
        .route(
            "/use/{units}",
            get(|Path(units): Path<u64>, usage: Usage| async move {
                usage.record(units);
                "ok"
            }),
        )
        .route("/silent", get(|_usage: Usage| async { "nothing recorded" }))
        .route(
            "/header/{value}",
            get(|Path(value): Path<String>| async move {
                ([("x-usage-tokens", value)], "reported in a header")
            }),
        )
        .route(
            "/both/{recorded}/{header}",
            get(
                |Path((recorded, header)): Path<(u64, String)>, usage: Usage| async move {
                    usage.record(recorded);
                    (
                        [("x-usage-tokens", header)],
                        "recorded and reported in a header",
                    )
                },
            ),
        )
        .route(
            "/stream/{chunks}/{per_chunk}",
            get(
                |Path((chunks, per_chunk)): Path<(u64, u64)>, usage: Usage| async move {
                    Body::new(Streamed {
                        chunks,
                        per_chunk,
                        usage: Some(usage),
                    })
                },
            ),
        )
        .route(
            "/status/{code}/{units}",
            get(
                |Path((code, units)): Path<(u16, u64)>, usage: Usage| async move {
                    usage.record(units);
                    StatusCode::from_u16(code).unwrap().into_response()
                },
            ),
        )
        .route(
            "/panic/{units}",
            get(|Path(units): Path<u64>, usage: Usage| async move {
                usage.record(units);
                if units < u64::MAX {
                    panic!("the handler failed after recording {units}");
                }
                "unreachable"
            }),
        )
        .layer(RateLimitLayer::new(policy, store))
}

/// 10 000 tokens an hour by client IP, 500 reserved per request, reported in `x-usage-tokens`.
fn tokens_an_hour(prefix: &str, algorithm: Algorithm) -> Policy {
    Policy::builder("llm")
        .prefix(prefix)
        .algorithm(algorithm)
        .rule(Rule::per_hour(10_000).metered())
        .meter(
            Meter::new("tokens")
                .estimate(|_| 500)
                .usage_header("x-usage-tokens"),
        )
        .build()
        .unwrap()
}

/// Sends `GET uri` and reads the whole body (which ends the request), then gives a networked
/// store's background settle the few milliseconds the contract allows it.
async fn call(app: &Router, timed: &Timed, uri: &str) -> Response<Body> {
    let response = send(app, request_from("192.0.2.7:1", uri)).await;
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    settled(timed).await;
    Response::from_parts(parts, Body::from(bytes))
}

async fn settled(timed: &Timed) {
    timed.until_calls_land().await;
}

/// How many calls of `uri` are admitted in a row before the first 429, and that 429.
async fn admitted_in_a_row(app: &Router, timed: &Timed, uri: &str) -> (usize, Response<Body>) {
    for admitted in 0..1_000 {
        let response = call(app, timed, uri).await;
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            return (admitted, response);
        }
        assert_eq!(response.status(), StatusCode::OK);
    }
    panic!("never refused");
}

/// 10 000 tokens an hour with 500 reserved per request: using 3 000 each admits exactly 4,
/// then refuses with a Retry-After; using 100 each admits exactly 96 (each needs room for its
/// 500: the 96th fits at 9 500 used, the 97th does not).
#[tokio::test]
async fn settling_is_exact_in_sequence() {
    let start = a_minute_an_hour_ahead();
    let algorithms = [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ];
    for algorithm in algorithms {
        for (timed, prefix) in both_stores("metered-exact", start) {
            let case = format!("{} {algorithm:?}", timed.name);
            let app = gateway(tokens_an_hour(&prefix, algorithm), timed.store.clone());
            let (admitted, refused) = admitted_in_a_row(&app, &timed, "/use/3000").await;
            assert_eq!(admitted, 4, "{case}");
            assert!(retry_after_secs(&refused) >= 1, "{case}");
            timed.assert_keys_expire();
        }
    }
    for algorithm in [Algorithm::FixedWindow, Algorithm::TokenBucket] {
        for (timed, prefix) in both_stores("metered-exact-small", start) {
            let case = format!("{} {algorithm:?}", timed.name);
            let app = gateway(tokens_an_hour(&prefix, algorithm), timed.store.clone());
            let (admitted, _) = admitted_in_a_row(&app, &timed, "/use/100").await;
            assert_eq!(admitted, 96, "{case}");
        }
    }
}

/// A streamed body records as it goes: the reservation settles at what the whole stream
/// recorded once it has ended, and the header of the next request says so.
#[tokio::test]
async fn a_streamed_body_settles_what_it_recorded_when_it_ends() {
    let start = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("metered-stream", start) {
        let app = gateway(
            tokens_an_hour(&prefix, Algorithm::FixedWindow),
            timed.store.clone(),
        );
        // 5 chunks of 300: 1 500 used where 500 were reserved.
        let streamed = call(&app, &timed, "/stream/5/300").await;
        assert_eq!(left(&limits(&streamed), TOKENS), 9_500);
        let next = call(&app, &timed, "/silent").await;
        // 1 500 settled, and the next request's 500 reserved.
        assert_eq!(left(&limits(&next), TOKENS), 8_000, "{}", timed.name);
    }
}

/// A client that leaves mid-stream settles what was recorded so far; nothing recorded leaves
/// the reservation standing; a handler that panics settles what it recorded first.
#[tokio::test]
async fn leaving_early_settles_what_was_recorded_or_else_the_reservation() {
    let start = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("metered-leave", start) {
        let app = gateway(
            tokens_an_hour(&prefix, Algorithm::FixedWindow),
            timed.store.clone(),
        );
        // Two chunks of 40 read, then the client goes: 80 used, 420 back.
        let response = send(&app, request_from("192.0.2.7:1", "/stream/10/40")).await;
        let mut body = response.into_body();
        for _ in 0..2 {
            let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
            assert!(frame.is_some());
        }
        drop(body);
        settled(&timed).await;
        let after = call(&app, &timed, "/silent").await;
        assert_eq!(
            left(&limits(&after), TOKENS),
            10_000 - 80 - 500,
            "{}",
            timed.name
        );
        // That request recorded nothing: its 500 stand. A panic after recording 100 settles
        // at 100.
        let panicked = tokio::spawn({
            let app = app.clone();
            async move { send(&app, request_from("192.0.2.7:1", "/panic/100")).await }
        })
        .await;
        assert!(panicked.is_err(), "the handler panicked");
        settled(&timed).await;
        let after = call(&app, &timed, "/silent").await;
        assert_eq!(
            left(&limits(&after), TOKENS),
            10_000 - 80 - 500 - 100 - 500,
            "{}",
            timed.name
        );
    }
}

/// One policy of 5 requests and 1 000 tokens a minute: the token rule's refusal charges no
/// request, and each rule says its own unit in its name.
#[tokio::test]
async fn a_refusal_by_the_token_rule_charges_no_request() {
    let start = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("metered-all-or-nothing", start) {
        let policy = Policy::builder("llm")
            .prefix(&prefix)
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_minute(5))
            .rule(Rule::per_minute(1_000).metered())
            .meter(Meter::new("tokens").estimate(|parts| {
                parts
                    .headers
                    .get("x-estimate")
                    .and_then(|value| value.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            }))
            .build()
            .unwrap();
        assert_eq!(
            policy
                .rule_names()
                .iter()
                .map(|name| &**name)
                .collect::<Vec<_>>(),
            ["5-per-60s", "1000-tokens-per-60s"]
        );
        let app = gateway(policy, timed.store.clone());
        let with_estimate = |estimate: u64, uri: &str| {
            let mut request = request_from("192.0.2.7:1", uri);
            request.headers_mut().insert("x-estimate", estimate.into());
            request
        };
        let first = send(&app, with_estimate(800, "/use/800")).await;
        assert_eq!(first.status(), StatusCode::OK);
        axum::body::to_bytes(first.into_body(), usize::MAX)
            .await
            .unwrap();
        settled(&timed).await;
        let refused = send(&app, with_estimate(300, "/use/300")).await;
        assert_eq!(
            refused.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{}",
            timed.name
        );
        let small = send(&app, with_estimate(100, "/silent")).await;
        assert_eq!(small.status(), StatusCode::OK);
        let headers = limits(&small);
        // Two requests admitted (the refused one charged nothing), 900 tokens reserved.
        assert_eq!(left(&headers, "5-per-60s"), 3, "{}", timed.name);
        assert_eq!(left(&headers, "1000-tokens-per-60s"), 100);
    }
}

/// A usage header settles as a record would; one that isn't a whole number is no report, said
/// once; a huge report counts as `max_usage`, said once, and the identity waits honestly.
#[tokio::test]
async fn reports_in_a_header_and_bad_reports() {
    let start = a_minute_an_hour_ahead();
    let captured = Captured::global();
    for (timed, prefix) in both_stores("metered-reports", start) {
        let app = gateway(
            tokens_an_hour(&prefix, Algorithm::FixedWindow),
            timed.store.clone(),
        );
        call(&app, &timed, "/header/120").await;
        let after = call(&app, &timed, "/header/lots").await;
        // 120 settled; then 500 reserved, and "lots" is no report: they stand.
        assert_eq!(left(&limits(&after), TOKENS), 9_380);
        let next = call(&app, &timed, "/silent").await;
        assert_eq!(left(&limits(&next), TOKENS), 8_880, "{}", timed.name);
        // A report of u64::MAX counts as the largest metered limit, 10 000: past the limit,
        // and the next request waits.
        call(&app, &timed, &format!("/use/{}", u64::MAX)).await;
        let refused = call(&app, &timed, "/silent").await;
        assert_eq!(
            refused.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{}",
            timed.name
        );
        assert!(retry_after_secs(&refused) >= 1);
    }
    assert!(
        !captured
            .lines_with("a usage header that isn't a whole number")
            .is_empty()
    );
    assert!(
        !captured
            .lines_with("above the meter's max_usage")
            .is_empty()
    );
}

/// Every metered admission needs room: an estimate of 0 reserves nothing (its unit goes back when
/// it settles with nothing reported), but a window without room for one unit refuses it, so the
/// debt stays within its bound.
#[tokio::test]
async fn an_estimate_of_zero_reserves_nothing_but_needs_room() {
    let start = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("metered-zero", start) {
        let policy = Policy::builder("llm")
            .prefix(&prefix)
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_hour(10_000).metered())
            .meter(Meter::new("tokens").estimate(|_| 0))
            .build()
            .unwrap();
        let app = gateway(policy, timed.store.clone());
        call(&app, &timed, "/silent").await;
        let next = call(&app, &timed, "/silent").await;
        // The first's unit went back: the second finds the window whole, less its own unit.
        assert_eq!(left(&limits(&next), TOKENS), 9_999, "{}", timed.name);
        call(&app, &timed, "/use/10000").await;
        let refused = call(&app, &timed, "/use/500").await;
        assert_eq!(
            refused.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{}: no room, not even for an estimate of 0",
            timed.name
        );
    }
}

/// One report per request: what the code records wins over the usage header, which counts only
/// when nothing was recorded; a request with both is said once, at WARN.
#[tokio::test]
async fn a_record_and_a_usage_header_count_once_the_record_winning() {
    let start = a_minute_an_hour_ahead();
    let captured = Captured::global();
    for (timed, prefix) in both_stores("metered-two-reports", start) {
        let app = gateway(
            tokens_an_hour(&prefix, Algorithm::FixedWindow),
            timed.store.clone(),
        );
        call(&app, &timed, "/both/100/300").await;
        let next = call(&app, &timed, "/silent").await;
        // 100 settled (not 300, nor 400); the next holds its 500.
        assert_eq!(left(&limits(&next), TOKENS), 9_400, "{}", timed.name);
        // A header alone still counts.
        call(&app, &timed, "/header/50").await;
        let after = call(&app, &timed, "/silent").await;
        assert_eq!(
            left(&limits(&after), TOKENS),
            9_400 - 50 - 500,
            "{}",
            timed.name
        );
    }
    let said = captured.lines_with("both recorded its usage and reported it in the usage header");
    assert!(!said.is_empty(), "{}", captured.text());
    assert!(said.iter().all(|line| line.contains("WARN")), "{said:?}");
}

/// Under count_only, a response that doesn't count settles to zero: its request and its
/// reservation go back whole, whatever it recorded.
#[tokio::test]
async fn a_response_that_does_not_count_settles_to_zero() {
    let start = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("metered-count-only", start) {
        let policy = Policy::builder("llm")
            .prefix(&prefix)
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_minute(5))
            .rule(Rule::per_minute(1_000).metered())
            .meter(Meter::new("tokens").estimate(|_| 300))
            .count_only(|status| status.is_success())
            .build()
            .unwrap();
        let app = gateway(policy, timed.store.clone());
        let failed = call(&app, &timed, "/status/502/250").await;
        assert_eq!(failed.status(), StatusCode::BAD_GATEWAY);
        let next = call(&app, &timed, "/status/200/0").await;
        let headers = limits(&next);
        assert_eq!(left(&headers, "5-per-60s"), 4, "{}", timed.name);
        assert_eq!(left(&headers, "1000-tokens-per-60s"), 700);
    }
}

/// A long stream across a window roll: what it used less than it reserved goes back to the
/// window that was charged (a rolled one gets nothing); what it used more is charged to the
/// window current when it settles.
#[tokio::test]
async fn a_window_roll_during_a_stream() {
    let start = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("metered-roll", start) {
        let policy = Policy::builder("llm")
            .prefix(&prefix)
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_minute(1_000).metered())
            .meter(Meter::new("tokens").estimate(|_| 500))
            .build()
            .unwrap();
        let app = gateway(policy, timed.store.clone());
        // Reserved in the first minute; ends in the second having used 100.
        timed.at(start + 10_000);
        let response = send(&app, request_from("192.0.2.7:1", "/stream/1/100")).await;
        timed.at(start + 70_000);
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        settled(&timed).await;
        let next = call(&app, &timed, "/silent").await;
        // Nothing went back into the new minute: only this request's 500.
        assert_eq!(
            left(&limits(&next), "1000-tokens-per-60s"),
            500,
            "{}",
            timed.name
        );
        // Reserved in the second minute; ends in the third having used 900: 400 of debt there.
        let response = send(&app, request_from("192.0.2.7:1", "/stream/1/900")).await;
        timed.at(start + 130_000);
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        settled(&timed).await;
        let next = call(&app, &timed, "/silent").await;
        assert_eq!(
            left(&limits(&next), "1000-tokens-per-60s"),
            1_000 - 400 - 500,
            "{}",
            timed.name
        );
    }
}

/// Two instances on one Redis, 40 concurrent requests: never more than the limit reserved at
/// once, whatever the settles give back meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_never_reserve_past_the_limit_together() {
    let redis = common::redis_server::TestRedis::shared();
    let prefix = common::redis_server::unique_prefix("metered-two");
    let reserved = Arc::new(AtomicU64::new(0));
    let most = Arc::new(AtomicU64::new(0));
    let instance = || {
        let store = tower_redis_ratelimit::RedisStore::from_url(&redis.url).unwrap();
        let policy = Policy::builder("llm")
            .prefix(&prefix)
            .key(Key::global())
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::per_minute(5_000).metered())
            .meter(Meter::new("tokens").estimate(|_| 500))
            .build()
            .unwrap();
        let (reserved, most) = (reserved.clone(), most.clone());
        Router::new()
            .route(
                "/",
                get(move |usage: Usage| {
                    let (reserved, most) = (reserved.clone(), most.clone());
                    async move {
                        let now = reserved.fetch_add(500, Ordering::SeqCst) + 500;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        reserved.fetch_sub(500, Ordering::SeqCst);
                        usage.record(200);
                        "ok"
                    }
                }),
            )
            .layer(RateLimitLayer::new(policy, store))
    };
    let apps = [instance(), instance()];
    let admitted = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for index in 0..40 {
        let app = apps[index % 2].clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            let response = send(&app, request_from("192.0.2.7:1", "/")).await;
            if response.status() == StatusCode::OK {
                admitted.fetch_add(1, Ordering::SeqCst);
            }
            axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .unwrap();
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 5_000, "{most} tokens reserved at once");
    // 10 fit at once; settles (200 of 500 used) let more in as they come back.
    assert!(admitted.load(Ordering::SeqCst) >= 10);
}

/// The handle: reserve, then settle what was used; a refusal reserves nothing.
#[tokio::test]
async fn a_handle_reserves_and_settles() {
    let start = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("metered-handle", start) {
        let policy = Policy::builder("jobs")
            .prefix(&prefix)
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_hour(1_000).metered())
            .meter(Meter::new("tokens"))
            .build()
            .unwrap();
        let limiter = RateLimiter::new(policy, timed.store.clone());
        let reservation = limiter.reserve("tenant", 600).await.unwrap();
        assert!(
            limiter.reserve("tenant", 600).await.is_err(),
            "no room for 600"
        );
        let after = reservation.settle(1_200).await.unwrap();
        assert_eq!(after.rules[0].remaining, 0, "{}", timed.name);
        let refused = limiter.reserve("tenant", 1).await.unwrap_err();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        // A reservation dropped unsettled stands.
        timed.at(start + 3_600_000);
        drop(limiter.reserve("tenant", 300).await.unwrap());
        let after = limiter.peek("tenant").await.unwrap();
        assert_eq!(after.rules[0].remaining, 700, "{}", timed.name);
    }
}

/// `Usage` is what a streamed body needs to carry.
#[test]
fn usage_can_travel_into_a_streamed_body() {
    fn travels<T: Clone + Send + Sync + 'static>() {}
    travels::<Usage>();
}

/// On a route without a meter, `Usage` records nothing, and says so once.
#[tokio::test]
async fn usage_on_a_route_without_a_meter_records_nothing_and_says_so() {
    let captured = Captured::global();
    let policy = Policy::builder("plain")
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_minute(5))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|usage: Usage| async move {
                usage.record(1_000);
                "ok"
            }),
        )
        .layer(RateLimitLayer::new(
            policy,
            tower_redis_ratelimit::MemoryStore::new(),
        ));
    for remaining in [4, 3] {
        let response = send(&app, request_from("192.0.2.9:1", "/")).await;
        assert_eq!(left(&limits(&response), "5-per-60s"), remaining);
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
    }
    let said = captured.lines_with("usage recorded on a request no meter reserved for");
    assert_eq!(said.len(), 1, "{said:?}");
}

/// A request shadow mode lets through past its rules reserves nothing: what its handler records
/// counts nowhere, and is said at DEBUG as that, never blamed on a missing meter.
#[tokio::test]
async fn usage_of_a_request_shadow_mode_let_through_counts_nowhere_and_blames_no_meter() {
    let (captured, _guard) = Captured::install_at(tracing::Level::DEBUG);
    let policy = Policy::builder("shadowed")
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_minute(1_000).metered())
        .meter(Meter::new("tokens").estimate(|_| 1_000))
        .mode(tower_redis_ratelimit::Mode::Shadow)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/quiet", get(|| async { "ok" }))
        .route(
            "/record",
            get(|usage: Usage| async move {
                usage.record(100);
                "ok"
            }),
        )
        .layer(RateLimitLayer::new(
            policy,
            tower_redis_ratelimit::MemoryStore::new(),
        ));
    // The first reserves the whole window and records nothing: its 1 000 stand.
    let first = send(&app, request_from("192.0.2.10:1", "/quiet")).await;
    assert_eq!(left(&limits(&first), "1000-tokens-per-60s"), 0);
    axum::body::to_bytes(first.into_body(), usize::MAX)
        .await
        .unwrap();
    // The rules would refuse the second: let through, it records 100 that count nowhere.
    let second = send(&app, request_from("192.0.2.10:1", "/record")).await;
    assert_eq!(second.status(), StatusCode::OK);
    axum::body::to_bytes(second.into_body(), usize::MAX)
        .await
        .unwrap();
    let said = captured.lines_with("let through without a reservation");
    assert_eq!(said.len(), 1, "{}", captured.text());
    assert!(said[0].contains("DEBUG"), "{}", said[0]);
    assert!(
        captured.lines_with("no meter reserved for").is_empty(),
        "{}",
        captured.text()
    );
    let third = send(&app, request_from("192.0.2.10:1", "/quiet")).await;
    assert_eq!(
        left(&limits(&third), "1000-tokens-per-60s"),
        0,
        "the first's 1 000, nothing of the second's"
    );
}

/// Delay mode holds a request until its estimate fits; shadow mode counts the units and lets
/// every request through; an override's rules meter too; a metered quota's tier sets its limit.
#[tokio::test]
async fn delay_shadow_overrides_and_tiers_work_for_units_as_for_requests() {
    use tower_redis_ratelimit::quota::Tier;
    use tower_redis_ratelimit::{Mode, Quota};
    let start = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("metered-modes", start) {
        // Delay: 1 000 tokens a second by token bucket; 800 used, so a 500 waits ~300 ms.
        let delayed = Policy::builder("delayed")
            .prefix(&prefix)
            .algorithm(Algorithm::TokenBucket)
            .rule(Rule::per_second(1_000).metered())
            .meter(Meter::new("tokens").estimate(|_| 500))
            .mode(Mode::Delay {
                max_delay: Duration::from_secs(2),
            })
            .build()
            .unwrap();
        let limiter = RateLimiter::new(delayed, timed.store.clone());
        limiter.reserve("d", 800).await.unwrap();
        let held = limiter.reserve("d", 500).await.unwrap();
        let delay = held.decision().unwrap().delay;
        assert!(
            delay >= Duration::from_millis(290) && delay <= Duration::from_millis(310),
            "{} {delay:?}",
            timed.name
        );
        // Shadow: refused by the units, and let through.
        let shadow = Policy::builder("shadow")
            .prefix(&prefix)
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_minute(1_000).metered())
            .meter(Meter::new("tokens").estimate(|_| 600))
            .mode(Mode::Shadow)
            .build()
            .unwrap();
        let app = gateway(shadow, timed.store.clone());
        for _ in 0..3 {
            assert_eq!(call(&app, &timed, "/silent").await.status(), StatusCode::OK);
        }
        // Overrides: the VIP's own metered rule.
        let with_override = Policy::builder("vip")
            .prefix(&prefix)
            .key(Key::header("x-api-key"))
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_minute(1_000).metered())
            .meter(Meter::new("tokens").estimate(|_| 600))
            .overrides([tower_redis_ratelimit::policy::Override::identity("vip")
                .rules([Rule::per_minute(10_000).metered()])])
            .build()
            .unwrap();
        let limiter = RateLimiter::new(with_override, timed.store.clone());
        assert!(limiter.reserve("anyone", 600).await.is_ok());
        assert!(limiter.reserve("anyone", 600).await.is_err());
        for _ in 0..5 {
            assert!(limiter.reserve("vip", 600).await.is_ok(), "{}", timed.name);
        }
        // Tiers: a metered quota of 1 000 tokens a day on free, 5 000 on pro.
        let quota = Quota::builder("tokens-daily")
            .prefix(&prefix)
            .key(Key::header("x-api-key"))
            .tier("free", 1_000)
            .tier("pro", 5_000)
            .metered()
            .build()
            .unwrap();
        let tiered = Policy::builder("tiered")
            .prefix(&prefix)
            .key(Key::header("x-api-key"))
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_minute(100))
            .quota(quota)
            .meter(Meter::new("tokens").estimate(|_| 600))
            .build()
            .unwrap();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(RateLimitLayer::new(tiered, timed.store.clone()));
        let as_tier = |key: &str, tier: &str| {
            let mut request = request_from("192.0.2.7:1", "/");
            request
                .headers_mut()
                .insert("x-api-key", key.parse().unwrap());
            request.extensions_mut().insert(Tier::new(tier.to_owned()));
            request
        };
        assert_eq!(
            send(&app, as_tier("f", "free")).await.status(),
            StatusCode::OK
        );
        let refused = send(&app, as_tier("f", "free")).await;
        assert_eq!(
            refused.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{}",
            timed.name
        );
        for _ in 0..8 {
            assert_eq!(
                send(&app, as_tier("p", "pro")).await.status(),
                StatusCode::OK
            );
        }
        assert_eq!(
            send(&app, as_tier("p", "pro")).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}

/// An estimate above a whole day of a metered quota could never be admitted: 413 at once, as a
/// request that costs more than a rule admits, not a wait of a day.
#[tokio::test]
async fn an_estimate_above_a_metered_quota_is_too_costly() {
    use tower_redis_ratelimit::Quota;
    let quota = Quota::builder("tokens-daily")
        .key(Key::global())
        .tier("free", 1_000)
        .metered()
        .build()
        .unwrap();
    let policy = Policy::builder("llm")
        .key(Key::global())
        .rule(Rule::per_minute(60))
        .quota(quota)
        .meter(Meter::new("tokens").estimate(|parts| {
            if parts.uri.path() == "/silent" {
                5_000
            } else {
                100
            }
        }))
        .build()
        .unwrap();
    let app = gateway(policy, Arc::new(tower_redis_ratelimit::MemoryStore::new()));
    let too_big = send(&app, request_from("192.0.2.7:1", "/silent")).await;
    assert_eq!(too_big.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let fits = send(&app, request_from("192.0.2.7:1", "/use/100")).await;
    assert_eq!(fits.status(), StatusCode::OK);
}
