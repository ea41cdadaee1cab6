//! What the layer answers with: the 429 (a problem details body, or what `on_rejected` returns,
//! anything a handler could return included, with the layer's headers added), and the rate-limit
//! headers (`RateLimit-Policy` and `RateLimit` naming the same items, the legacy `X-RateLimit-*`
//! on request). In memory.

use crate::common;

use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use common::{app, json, limits, policy, request_from, retry_after_secs, send, text};
use http::{HeaderValue, Response, StatusCode};
use tower_redis_ratelimit::{MemoryStore, RateLimitLayer, Rule};

const PEER: &str = "203.0.113.10:4000";

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
