//! Shared helpers of the integration tests.
#![allow(dead_code)] // each test crate uses a different subset

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::headers::{self, RateLimitHeaders};
use tower_redis_ratelimit::{Policy, RateLimitLayer, Store};

/// A router with `GET /` answering "hello", limited by `policy` in `store`.
pub fn app(policy: Policy, store: impl Store) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }).post(|| async { "posted" }))
        .layer(RateLimitLayer::new(policy, store))
}

/// `GET uri` from `peer`.
pub fn request_from(peer: &str, uri: &str) -> Request<Body> {
    let peer: SocketAddr = peer.parse().expect("a socket address");
    let mut request = Request::get(uri).body(Body::empty()).unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

/// Sends one request through a clone of `app`.
pub async fn send(app: &Router, request: Request<Body>) -> Response<Body> {
    app.clone().oneshot(request).await.expect("infallible")
}

/// The status and the parsed rate-limit headers of a response.
pub fn limits(response: &Response<Body>) -> RateLimitHeaders {
    headers::parse(response.headers()).expect("well-formed rate-limit headers")
}

/// Retry-After as whole seconds (panics when absent or in date form).
pub fn retry_after_secs(response: &Response<Body>) -> u64 {
    response
        .headers()
        .get(http::header::RETRY_AFTER)
        .expect("a Retry-After header")
        .to_str()
        .unwrap()
        .parse()
        .expect("Retry-After in delay-seconds")
}

/// The body as JSON.
pub async fn json(response: Response<Body>) -> serde_json::Value {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).expect("a JSON body")
}

/// The body as text.
pub async fn text(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// Asserts a 429 with the problem body naming exactly `violated`.
pub async fn assert_refused(response: Response<Body>, violated: &[&str]) {
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = json(response).await;
    assert_eq!(body["violated-policies"], serde_json::json!(violated));
}

/// Awaits racing tasks and counts their 200s and 429s; any other status fails the test.
pub async fn admitted_and_refused(
    tasks: Vec<tokio::task::JoinHandle<StatusCode>>,
) -> (usize, usize) {
    let mut admitted = 0;
    let mut refused = 0;
    for task in tasks {
        match task.await.expect("the task finishes") {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    (admitted, refused)
}

pub mod redis_server;
