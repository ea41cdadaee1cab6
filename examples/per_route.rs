//! Per-route policies, four ways, on one router and one store:
//!
//! - a site-wide limit for every request: `Router::layer`;
//! - a limit for a group of routes: `Router::route_layer` (only requests that match a route are
//!   counted, so a scan of made-up paths gets 404s without using up anyone's quota);
//! - a limit for one method of one route: `MethodRouter::layer` (`post(..).layer(..)`), so `GET
//!   /comments` is free and `POST /comments` limited;
//! - a policy declared next to its handler, as a type required by an extractor:
//!   `async fn login(limited: Limited<LoginPolicy>)`, so the handler's signature says how it is
//!   limited, written with `#[derive(LimitPolicy)]` and checked when the example compiles.
//!
//! ```text
//! cargo run --example per_route --features macros   # serves 127.0.0.1:3001
//! curl -i -X POST 127.0.0.1:3001/login     # again within 1 s: 429 (the duplicate guard); the 6th a minute: 429
//! ```
//!
//! Layers nest: a request to `/login` is counted by the site-wide layer and by the login policy, and
//! its response carries the items of both in `RateLimit-Policy` and `RateLimit`.

use std::net::SocketAddr;

use axum::routing::{get, post};
use axum::{Extension, Router};
use tower_redis_ratelimit::{
    Key, LimitPolicy, LimitStore, Limited, MemoryStore, Policy, RateLimitLayer, Rule,
};

/// The login policy, declared as a type next to its handler: a limit of 0 or a period of "0s"
/// here would not compile.
#[derive(LimitPolicy)]
// Clippy misreads the two rule(limit = ..) as one attribute given twice (rust-clippy#13238).
#[allow(clippy::duplicated_attributes)]
#[rate_limit(
    name = "login",
    key = "ip",
    rule(limit = 5, period = "1m"),
    rule(limit = 20, period = "1h"),
    prevent_duplicate(period = "1s"),
    message = "Too many login attempts, try again later."
)]
struct LoginPolicy;

/// Limited by `LoginPolicy`; returning `limited` adds its headers to the response.
async fn login(limited: Limited<LoginPolicy>) -> (Limited<LoginPolicy>, &'static str) {
    (limited, "welcome\n")
}

fn policy(name: &str, rule: Rule) -> Policy {
    let rule_name = format!("{name}-{}", rule.limit());
    Policy::builder(name)
        .key(Key::ip())
        .rule(rule.named(rule_name))
        .build()
        .expect("a valid policy")
}

/// The app: every style on one store.
fn app() -> Router {
    let store = MemoryStore::new();
    let api = Router::new()
        .route("/api/items", get(|| async { "items\n" }))
        .route("/api/items/{id}", get(|| async { "one item\n" }))
        .route_layer(RateLimitLayer::new(
            policy("api", Rule::per_minute(30)),
            store.clone(),
        ));
    let comments = get(|| async { "comments\n" }).merge(post(|| async { "posted\n" }).layer(
        RateLimitLayer::new(policy("comment", Rule::per_minute(3)), store.clone()),
    ));
    Router::new()
        .route("/login", post(login))
        .route("/comments", comments)
        .merge(api)
        .layer(Extension(LimitStore::new(store.clone())))
        .layer(RateLimitLayer::new(
            policy("site", Rule::per_second(50)),
            store,
        ))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app().into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::Duration;

    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use http::{Method, Request, StatusCode};
    use tower::ServiceExt;
    use tower_redis_ratelimit::headers;

    async fn send(app: &Router, method: Method, path: &str) -> http::Response<Body> {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let peer: SocketAddr = "192.0.2.7:5000".parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        app.clone().oneshot(request).await.unwrap()
    }

    fn rule_names(response: &http::Response<Body>) -> Vec<String> {
        let limits = headers::parse(response.headers()).expect("rate-limit headers");
        limits
            .policies
            .iter()
            .map(|item| item.name.clone())
            .collect()
    }

    #[tokio::test]
    async fn the_extractor_limits_its_handler_with_the_same_429() {
        let app = app();
        let first = send(&app, Method::POST, "/login").await;
        assert_eq!(first.status(), StatusCode::OK);
        // The login policy's items (the extractor's, added first), then the site-wide layer's.
        assert_eq!(
            rule_names(&first),
            ["5-per-60s", "20-per-3600s", "duplicate", "site-50"]
        );
        // Within a second: the duplicate guard.
        let duplicate = send(&app, Method::POST, "/login").await;
        assert_eq!(duplicate.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(duplicate.headers().contains_key(http::header::RETRY_AFTER));
        tokio::time::sleep(Duration::from_millis(1_010)).await;
        let mut statuses = Vec::new();
        for _ in 0..5 {
            statuses.push(send(&app, Method::POST, "/login").await.status());
            tokio::time::sleep(Duration::from_millis(1_010)).await;
        }
        // Four more fit the minute's five; the fifth is refused by the per-minute rule.
        assert_eq!(
            statuses,
            [
                StatusCode::OK,
                StatusCode::OK,
                StatusCode::OK,
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS
            ]
        );
    }

    #[tokio::test]
    async fn route_layer_and_method_router_layer_limit_only_their_routes() {
        let app = app();
        for _ in 0..3 {
            assert_eq!(
                send(&app, Method::POST, "/comments").await.status(),
                StatusCode::OK
            );
        }
        assert_eq!(
            send(&app, Method::POST, "/comments").await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        // GET is not under the POST limit, only under the site-wide one.
        let read = send(&app, Method::GET, "/comments").await;
        assert_eq!(read.status(), StatusCode::OK);
        assert_eq!(rule_names(&read), ["site-50"]);
        let item = send(&app, Method::GET, "/api/items/7").await;
        assert_eq!(rule_names(&item), ["api-30", "site-50"]);
        // A made-up path is a 404 that the route layer never counts.
        let missing = send(&app, Method::GET, "/api/nothing").await;
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        assert_eq!(rule_names(&missing), ["site-50"]);
    }
}
