//! The layer driven in-process through a real axum router (`oneshot`), with the in-memory store.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use common::{
    DownStore, app, assert_refused, json, limits, request_from, retry_after_secs, send, text,
};
use http::{HeaderValue, Request, Response, StatusCode};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::store::{CheckFuture, CheckRequest, Clock, ManualClock};
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, OnStoreError, Policy, RateLimitLayer, Rule, Store, UserId,
    client_ip::ClientIp,
    layer::RateLimit,
    policy::{MissingKey, Scope},
};

const PEER: &str = "203.0.113.10:4000";

fn policy(rules: impl IntoIterator<Item = Rule>) -> tower_redis_ratelimit::PolicyBuilder {
    Policy::builder("test").prefix("t").rules(rules)
}

/// A clock at the start of an hour, so fixed windows of every test period start at 0.
fn clock() -> ManualClock {
    ManualClock::new(1_700_000_000_000 - 1_700_000_000_000 % 3_600_000)
}

fn store_at(clock: &ManualClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build()
}

#[tokio::test]
async fn seed_curl_loop_twenty_per_minute() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingLog] {
        // Half a minute into a window, so a real minute boundary can't fall inside the loop.
        let clock = clock();
        clock.advance(Duration::from_secs(30));
        let app = app(
            policy([Rule::per_minute(20)])
                .algorithm(algorithm)
                .build()
                .unwrap(),
            store_at(&clock),
        );
        for n in 1..=20u64 {
            let response = send(&app, request_from(PEER, "/")).await;
            assert_eq!(response.status(), StatusCode::OK, "request {n}");
            let limits = limits(&response);
            assert_eq!(limits.policy("20-per-60s").unwrap().quota, 20);
            assert_eq!(limits.policy("20-per-60s").unwrap().window, Some(60));
            assert_eq!(limits.status("20-per-60s").unwrap().remaining, 20 - n);
            assert_eq!(text(response).await, "hello");
        }
        for n in 21..=22 {
            let response = send(&app, request_from(PEER, "/")).await;
            assert_eq!(
                response.status(),
                StatusCode::TOO_MANY_REQUESTS,
                "request {n}"
            );
            let retry = retry_after_secs(&response);
            // The window ends (fixed) or the first request leaves (log) 30 s or 60 s from now.
            let expected = match algorithm {
                Algorithm::FixedWindow => 30,
                _ => 60,
            };
            assert_eq!(retry, expected, "{algorithm}");
            let limits = limits(&response);
            assert_eq!(limits.status("20-per-60s").unwrap().remaining, 0);
            assert_refused(response, &["20-per-60s"]).await;
        }
    }
}

#[tokio::test]
async fn the_429_body_is_problem_details() {
    let app = app(
        policy([Rule::per_hour(1)])
            .message("Slow down, please.")
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    send(&app, request_from(PEER, "/")).await;
    let refused = send(&app, request_from(PEER, "/")).await;
    assert_eq!(
        refused.headers()["content-type"],
        HeaderValue::from_static("application/problem+json")
    );
    assert_eq!(
        json(refused).await,
        serde_json::json!({
            "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
            "title": "Request cannot be satisfied as assigned quota has been exceeded",
            "status": 429,
            "detail": "Slow down, please.",
            "violated-policies": ["1-per-3600s"],
        })
    );
}

/// 2 per second AND 5 per 10 seconds: which rule binds in each phase, and its Retry-After.
#[tokio::test]
async fn two_rules_bind_in_turn_with_exact_retry_after() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingLog] {
        let clock = clock();
        let start = clock.now_unix_ms();
        let at = |ms: u64| clock.set(start + ms);
        let app = app(
            policy([Rule::per_second(2), Rule::new(5, Duration::from_secs(10))])
                .algorithm(algorithm)
                .build()
                .unwrap(),
            store_at(&clock),
        );
        let get = || send(&app, request_from(PEER, "/"));

        // Phase 1: two pass at 0 and 300 ms, then the per-second rule binds.
        at(0);
        assert_eq!(get().await.status(), StatusCode::OK);
        at(300);
        let second = get().await;
        assert_eq!(second.status(), StatusCode::OK);
        let state = limits(&second);
        assert_eq!(state.status("2-per-1s").unwrap().remaining, 0);
        assert_eq!(state.status("5-per-10s").unwrap().remaining, 3);
        at(400);
        let refused = get().await;
        // 600 ms left: to the window end (fixed) or until the 0 ms admission leaves (log).
        assert_eq!(retry_after_secs(&refused), 1, "{algorithm}");
        assert_eq!(limits(&refused).status("2-per-1s").unwrap().reset, Some(1));
        assert_refused(refused, &["2-per-1s"]).await;

        // Phase 2 at 1.2 s: a new window has room for two; the log still holds the 300 ms one.
        at(1_200);
        assert_eq!(get().await.status(), StatusCode::OK);
        let fourth = get().await;
        match algorithm {
            Algorithm::FixedWindow => assert_eq!(fourth.status(), StatusCode::OK),
            _ => {
                assert_eq!(retry_after_secs(&fourth), 1);
                assert_refused(fourth, &["2-per-1s"]).await;
                at(1_300);
                assert_eq!(get().await.status(), StatusCode::OK);
            }
        }

        // Phase 3 at 2.5 s: the fifth passes, then the 10-second rule binds alone.
        at(2_500);
        let fifth = get().await;
        assert_eq!(fifth.status(), StatusCode::OK);
        assert_eq!(limits(&fifth).status("5-per-10s").unwrap().remaining, 0);
        let refused = get().await;
        // 7.5 s until 10 s, where the window ends (fixed) or the 0 ms admission leaves (log).
        assert_eq!(retry_after_secs(&refused), 8, "{algorithm}");
        assert_eq!(limits(&refused).status("2-per-1s").unwrap().remaining, 1);
        assert_refused(refused, &["5-per-10s"]).await;

        at(9_999);
        assert_eq!(get().await.status(), StatusCode::TOO_MANY_REQUESTS);
        at(10_000);
        assert_eq!(get().await.status(), StatusCode::OK, "{algorithm}");
    }
}

#[tokio::test]
async fn retry_after_counts_to_when_every_violated_rule_admits() {
    let clock = clock();
    let app = app(
        policy([Rule::per_second(1), Rule::new(2, Duration::from_secs(10))])
            .build()
            .unwrap(),
        store_at(&clock),
    );
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    clock.advance(Duration::from_millis(1_500));
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    clock.advance(Duration::from_millis(200));
    // Now at 1.7 s: the per-second rule frees at 2.5 s, the 10-second rule at 10 s.
    let refused = send(&app, request_from(PEER, "/")).await;
    assert_eq!(retry_after_secs(&refused), 9);
    assert_refused(refused, &["1-per-1s", "2-per-10s"]).await;
}

#[tokio::test]
async fn rejected_requests_consume_nothing() {
    let clock = clock();
    let app = app(
        policy([Rule::per_second(1), Rule::per_minute(3)])
            .build()
            .unwrap(),
        store_at(&clock),
    );
    for second in 0..3 {
        let admitted = send(&app, request_from(PEER, "/")).await;
        assert_eq!(admitted.status(), StatusCode::OK, "second {second}");
        // A burst of refusals within the second changes neither rule.
        for _ in 0..20 {
            let refused = send(&app, request_from(PEER, "/")).await;
            assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
            let state = limits(&refused);
            assert_eq!(state.status("3-per-60s").unwrap().remaining, 2 - second);
        }
        clock.advance(Duration::from_secs(1));
    }
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_racing_tasks_get_exactly_fifty() {
    let app = app(
        policy([Rule::per_hour(50)]).build().unwrap(),
        MemoryStore::new(),
    );
    let barrier = Arc::new(tokio::sync::Barrier::new(200));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let app = app.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                send(&app, request_from(PEER, "/")).await.status()
            })
        })
        .collect();
    assert_eq!(common::admitted_and_refused(tasks).await, (50, 150));
}

#[tokio::test]
async fn a_spoofed_forwarded_for_from_an_untrusted_peer_changes_nothing() {
    let app = app(
        policy([Rule::per_hour(2)]).build().unwrap(),
        MemoryStore::new(),
    );
    for spoof in ["198.51.100.1", "198.51.100.2", "198.51.100.3"] {
        let mut request = request_from(PEER, "/");
        for header in ["x-forwarded-for", "x-real-ip"] {
            request
                .headers_mut()
                .insert(header, HeaderValue::from_str(spoof).unwrap());
        }
        request.headers_mut().insert(
            "forwarded",
            HeaderValue::from_str(&format!("for={spoof}")).unwrap(),
        );
        let status = send(&app, request).await.status();
        if spoof == "198.51.100.3" {
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        } else {
            assert_eq!(status, StatusCode::OK);
        }
    }
}

#[tokio::test]
async fn a_trusted_proxy_forwards_the_client_address() {
    let proxy = "10.0.0.5:443";
    let app = app(
        policy([Rule::per_hour(1)])
            .client_ip(ClientIp::new().trust_proxy("10.0.0.0/8".parse().unwrap()))
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    let via_proxy = |chain: &str| {
        let mut request = request_from(proxy, "/");
        request
            .headers_mut()
            .insert("x-forwarded-for", HeaderValue::from_str(chain).unwrap());
        request
    };
    // Two clients behind the proxy have their own buckets.
    assert_eq!(
        send(&app, via_proxy("198.51.100.1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, via_proxy("198.51.100.2")).await.status(),
        StatusCode::OK
    );
    // A client forging the leftmost entry is still counted by the address the proxy saw.
    let forged = send(&app, via_proxy("192.0.2.99, 198.51.100.1")).await;
    assert_eq!(forged.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn ipv6_clients_share_a_bucket_per_64() {
    let app = app(
        policy([Rule::per_hour(1)]).build().unwrap(),
        MemoryStore::new(),
    );
    let first = send(&app, request_from("[2001:db8:1:2::1]:80", "/")).await;
    assert_eq!(first.status(), StatusCode::OK);
    let same_64 = send(&app, request_from("[2001:db8:1:2:ffff::9]:80", "/")).await;
    assert_eq!(same_64.status(), StatusCode::TOO_MANY_REQUESTS);
    let other_64 = send(&app, request_from("[2001:db8:1:3::1]:80", "/")).await;
    assert_eq!(other_64.status(), StatusCode::OK);
}

#[tokio::test]
async fn user_header_and_global_keys() {
    let user_app = app(
        policy([Rule::per_hour(1)])
            .key(Key::user())
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    let as_user = |id: &str| {
        let mut request = request_from(PEER, "/");
        request.extensions_mut().insert(UserId::new(id));
        request
    };
    assert_eq!(
        send(&user_app, as_user("alice")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&user_app, as_user("bob")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&user_app, as_user("alice")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    let key_app = app(
        policy([Rule::per_hour(1)])
            .key(Key::header(http::HeaderName::from_static("x-api-key")))
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    let with_key = |key: &str, peer: &str| {
        let mut request = request_from(peer, "/");
        request
            .headers_mut()
            .insert("x-api-key", HeaderValue::from_str(key).unwrap());
        request
    };
    assert_eq!(
        send(&key_app, with_key("k1", PEER)).await.status(),
        StatusCode::OK
    );
    // Same key from another address: same bucket.
    assert_eq!(
        send(&key_app, with_key("k1", "198.51.100.7:1"))
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&key_app, with_key("k2", PEER)).await.status(),
        StatusCode::OK
    );

    let global_app = app(
        policy([Rule::per_hour(2)])
            .key(Key::global())
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    assert_eq!(
        send(&global_app, request_from("192.0.2.1:1", "/"))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&global_app, request_from("192.0.2.2:1", "/"))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&global_app, request_from("192.0.2.3:1", "/"))
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn missing_keys_fall_back_to_the_client_ip_or_as_configured() {
    let user_policy = |missing| {
        policy([Rule::per_hour(1)])
            .key(Key::user())
            .on_missing_key(missing)
            .build()
            .unwrap()
    };
    let fallback = app(user_policy(MissingKey::ClientIp), MemoryStore::new());
    assert_eq!(
        send(&fallback, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&fallback, request_from(PEER, "/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&fallback, request_from("192.0.2.1:1", "/"))
            .await
            .status(),
        StatusCode::OK
    );

    let open = app(user_policy(MissingKey::Allow), MemoryStore::new());
    for _ in 0..3 {
        let response = send(&open, request_from(PEER, "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get("ratelimit").is_none());
    }

    let strict = app(
        user_policy(MissingKey::Reject(StatusCode::UNAUTHORIZED)),
        MemoryStore::new(),
    );
    assert_eq!(
        send(&strict, request_from(PEER, "/")).await.status(),
        StatusCode::UNAUTHORIZED
    );

    // No ConnectInfo at all: refuse with 500 rather than silently not limiting.
    let ip_app = app(
        policy([Rule::per_hour(1)]).build().unwrap(),
        MemoryStore::new(),
    );
    let bare = Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(
        send(&ip_app, bare).await.status(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
}

#[tokio::test]
async fn legacy_headers_on_request() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        RateLimitLayer::new(
            policy([Rule::per_minute(5), Rule::per_hour(50)])
                .build()
                .unwrap(),
            MemoryStore::new(),
        )
        .legacy_headers(true),
    );
    let response = send(&app, request_from(PEER, "/")).await;
    let legacy = limits(&response).legacy.expect("X-RateLimit-* headers");
    assert_eq!((legacy.limit, legacy.remaining), (5, 4));
    let now = SystemTime::now();
    let reset_in = legacy.reset.duration_since(now).unwrap_or_default();
    assert!(reset_in <= Duration::from_secs(61), "{reset_in:?}");
    assert!(legacy.reset > now - Duration::from_secs(1));

    let plain = common::app(
        policy([Rule::per_minute(5)]).build().unwrap(),
        MemoryStore::new(),
    );
    let response = send(&plain, request_from(PEER, "/")).await;
    assert!(response.headers().get("x-ratelimit-limit").is_none());
}

#[tokio::test]
async fn the_429_can_be_replaced() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        RateLimitLayer::new(
            policy([Rule::per_hour(1)]).build().unwrap(),
            MemoryStore::new(),
        )
        .on_rejected(|rejected| {
            let rules: Vec<&str> = rejected.violated_rules().collect();
            let mut response = Response::new(Body::from(format!("no: {}", rules.join(","))));
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            response
        }),
    );
    send(&app, request_from(PEER, "/")).await;
    let refused = send(&app, request_from(PEER, "/")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(retry_after_secs(&refused) >= 1);
    assert_eq!(limits(&refused).status("1-per-3600s").unwrap().remaining, 0);
    assert_eq!(text(refused).await, "no: 1-per-3600s");
}

/// What a handler would return serves as the 429: `(StatusCode, Json(..))`, with the layer's
/// headers added to it.
#[tokio::test]
async fn the_429_can_be_anything_a_handler_returns() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        RateLimitLayer::new(
            policy([Rule::per_hour(1)]).build().unwrap(),
            MemoryStore::new(),
        )
        .on_rejected(|rejected| {
            let body = serde_json::json!({ "error": "slow down", "retry_in": rejected.retry_after_secs() });
            (StatusCode::TOO_MANY_REQUESTS, axum::Json(body))
        }),
    );
    send(&app, request_from(PEER, "/")).await;
    let refused = send(&app, request_from(PEER, "/")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.headers()["content-type"],
        "application/json",
        "the handler's own headers stay"
    );
    let retry = retry_after_secs(&refused);
    assert!(retry >= 1);
    assert_eq!(limits(&refused).status("1-per-3600s").unwrap().remaining, 0);
    let body: serde_json::Value = serde_json::from_str(&text(refused).await).unwrap();
    assert_eq!(body["error"], "slow down");
    assert_eq!(body["retry_in"], retry);
}

/// A store that answers for fewer rules than the policy has.
#[derive(Clone)]
struct BrokenStore;

impl Store for BrokenStore {
    fn check(&self, _: &CheckRequest<'_>) -> CheckFuture {
        CheckFuture::ready(Ok(tower_redis_ratelimit::Decision {
            allowed: false,
            rules: Vec::new(),
            now_unix_ms: 0,
            delay: std::time::Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
        }))
    }
}

/// A failing store lets requests through without headers by default and gets a 503 problem when
/// the policy fails closed; never a 429.
async fn assert_fails_open_or_closed(store: impl Store + Clone) {
    let open = app(
        policy([Rule::per_second(1)]).build().unwrap(),
        store.clone(),
    );
    for _ in 0..3 {
        let response = send(&open, request_from(PEER, "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get("ratelimit").is_none());
    }
    let closed = app(
        policy([Rule::per_second(1)])
            .on_store_error(OnStoreError::Deny)
            .build()
            .unwrap(),
        store,
    );
    let response = send(&closed, request_from(PEER, "/")).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json(response).await["status"], 503);
}

#[tokio::test]
async fn store_errors_fail_open_or_closed_never_429() {
    assert_fails_open_or_closed(DownStore).await;
}

#[tokio::test]
async fn a_malformed_store_answer_is_a_store_error_not_a_panic() {
    assert_fails_open_or_closed(BrokenStore).await;
}

/// The memory store answering asynchronously, to drive the future's checking state.
#[derive(Clone)]
struct SlowStore(MemoryStore);

impl Store for SlowStore {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        let mut answer = self.0.check(request);
        let result = answer
            .take_ready()
            .expect("the memory store answers at once");
        CheckFuture::from_future(async move {
            tokio::task::yield_now().await;
            result
        })
    }
}

#[tokio::test]
async fn an_asynchronous_store_gives_the_same_answers() {
    let app = app(
        policy([Rule::per_minute(3)]).build().unwrap(),
        SlowStore(MemoryStore::new()),
    );
    for remaining in [2, 1, 0] {
        let response = send(&app, request_from(PEER, "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            limits(&response).status("3-per-60s").unwrap().remaining,
            remaining
        );
    }
    let refused = send(&app, request_from(PEER, "/")).await;
    assert!((1..=60).contains(&retry_after_secs(&refused)));
    assert_refused(refused, &["3-per-60s"]).await;
}

#[tokio::test]
async fn route_scope_gives_each_route_its_own_bucket() {
    let layer = RateLimitLayer::new(
        policy([Rule::per_hour(1)])
            .scope(Scope::Route)
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    let app = Router::new()
        .route("/a", get(|| async { "a" }).post(|| async { "a" }))
        .route("/users/{id}", get(|| async { "user" }))
        .layer(layer);
    let call = |method: &str, uri: &str| {
        let mut request = request_from(PEER, uri);
        *request.method_mut() = method.parse().unwrap();
        send(&app, request)
    };
    assert_eq!(call("GET", "/a").await.status(), StatusCode::OK);
    assert_eq!(call("POST", "/a").await.status(), StatusCode::OK);
    assert_eq!(
        call("GET", "/a").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // One route, whatever the parameter.
    assert_eq!(call("GET", "/users/1").await.status(), StatusCode::OK);
    assert_eq!(
        call("GET", "/users/2").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Made-up paths share one bucket: a client can't mint fresh buckets with them.
    assert_eq!(call("GET", "/nope-1").await.status(), StatusCode::NOT_FOUND);
    assert_eq!(
        call("GET", "/nope-2").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn works_with_route_layer_service_builder_and_nesting() {
    let store = MemoryStore::new();
    let login = policy([Rule::per_hour(1)]).build().unwrap();
    let site = Policy::builder("site")
        .rule(Rule::per_hour(100).named("site-hourly"))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/login", post(|| async { "welcome" }))
        .route_layer(RateLimitLayer::new(login, store.clone()))
        .route("/open", get(|| async { "open" }))
        .layer(ServiceBuilder::new().layer(RateLimitLayer::new(site, store)));

    let mut login_request = request_from(PEER, "/login");
    *login_request.method_mut() = http::Method::POST;
    let response = send(&app, login_request).await;
    assert_eq!(response.status(), StatusCode::OK);
    // Both layers' items, appended into one list each.
    let state = limits(&response);
    let names: Vec<&str> = state.policies.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["1-per-3600s", "site-hourly"]);
    assert_eq!(state.status("site-hourly").unwrap().remaining, 99);

    let mut again = request_from(PEER, "/login");
    *again.method_mut() = http::Method::POST;
    assert_eq!(
        send(&app, again).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // The route layer doesn't cover /open.
    let open = send(&app, request_from(PEER, "/open")).await;
    assert_eq!(open.status(), StatusCode::OK);
    assert_eq!(limits(&open).policies.len(), 1);
}

/// A service that is ready only when told.
#[derive(Clone)]
struct Gate {
    open: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

impl Service<Request<Body>> for Gate {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.open.load(Ordering::SeqCst) {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::new(Body::from("through"))))
    }
}

#[tokio::test]
async fn poll_ready_passes_through_and_the_service_is_clone() {
    let gate = Gate {
        open: Arc::new(AtomicBool::new(false)),
        calls: Arc::new(AtomicUsize::new(0)),
    };
    let mut service = RateLimit::new(
        gate.clone(),
        policy([Rule::per_hour(1)]).build().unwrap(),
        MemoryStore::new(),
    );
    let mut cx = Context::from_waker(Waker::noop());
    assert!(service.poll_ready(&mut cx).is_pending());
    gate.open.store(true, Ordering::SeqCst);
    assert!(matches!(service.poll_ready(&mut cx), Poll::Ready(Ok(()))));

    let response = service
        .clone()
        .oneshot(request_from(PEER, "/"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let refused = service.oneshot(request_from(PEER, "/")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // The refused request never reached the inner service.
    assert_eq!(gate.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn headers_name_the_same_items_in_policy_and_status() {
    let app = app(
        policy([Rule::per_minute(20), Rule::per_hour(100)])
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    let response = send(&app, request_from(PEER, "/")).await;
    assert_eq!(
        response.headers()["ratelimit-policy"],
        "\"20-per-60s\";q=20;w=60, \"100-per-3600s\";q=100;w=3600"
    );
    let status = response.headers()["ratelimit"].to_str().unwrap();
    // The sliding log frees the first unit a full period after it was used.
    assert_eq!(
        status,
        "\"20-per-60s\";r=19;t=60, \"100-per-3600s\";r=99;t=3600"
    );
    let state = limits(&response);
    for item in &state.limits {
        assert!(state.policy(&item.name).is_some(), "{}", item.name);
    }
}

#[tokio::test]
async fn axums_mock_connect_info_is_the_peer_in_tests() {
    use axum::extract::connect_info::MockConnectInfo;

    let peer: std::net::SocketAddr = "192.0.2.44:1234".parse().unwrap();
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(
            policy([Rule::per_hour(1)]).build().unwrap(),
            MemoryStore::new(),
        ))
        .layer(MockConnectInfo(peer));
    let request = || Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(send(&app, request()).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, request()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn shadow_cost_duplicate_and_block_in_memory() {
    common::policy_features_work(MemoryStore::new(), "features").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_mode_in_memory_admits_exactly_the_reserved_slots() {
    common::delay_mode_spaces_concurrent_waiters(MemoryStore::new(), "delay").await;
}

#[tokio::test]
async fn the_extractor_in_memory_answers_like_the_layer() {
    common::the_extractor_limits_like_the_layer(MemoryStore::new(), "alice").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_race_in_memory_admits_the_limit_and_alerts_once() {
    let store: std::sync::Arc<dyn tower_redis_ratelimit::Store> =
        std::sync::Arc::new(MemoryStore::new());
    common::a_quota_race_admits_the_limit_and_alerts_once(vec![store], "race").await;
}
