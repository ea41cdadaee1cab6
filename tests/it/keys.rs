//! What a request is counted by: the client's IP (a forwarded-for header only from a trusted
//! proxy, IPv6 clients by their /64, axum's `MockConnectInfo` in tests), the user, a header or one
//! global key; a request without its key falls back to the client's IP, passes or is refused, as
//! configured; and its route, for a policy scoped per route. In memory.

use crate::common;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use common::{app, policy, request_from, send};
use http::{HeaderValue, Request, StatusCode};
use tower_redis_ratelimit::{
    Key, MemoryStore, RateLimitLayer, Rule, UserId,
    client_ip::ClientIp,
    policy::{MissingKey, Scope},
};

const PEER: &str = "203.0.113.10:4000";

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
