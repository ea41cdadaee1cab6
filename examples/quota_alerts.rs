//! A billed API on one router: a per-minute rate limit, a daily quota that depends on the
//! user's plan tier, and a webhook alert when a user reaches 80 % and 100 % of it, sent once per
//! user, threshold and day however many requests race.
//!
//! ```text
//! cargo run --example quota_alerts --features webhook  # serves 127.0.0.1:3002, and receives its own alerts on :3003
//! for i in $(seq 1 12); do curl -s -o /dev/null -w "%{http_code} " -H 'x-user-id: ann' 127.0.0.1:3002/maps; done
//! ```
//!
//! The free tier here allows 10 requests a day (so the alerts come quickly), pro 5 000; the tier is
//! read from `x-tier`, the user from `x-user-id` (a real app takes both from its authentication
//! layer). The webhook receiver is part of the example so it runs alone: it prints each alert.
//! Point `WebhookNotifier::new` at your own endpoint instead. With `REDIS_URL` set, counts and
//! alert flags live in Redis and several instances share them.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use tower_redis_ratelimit::alert::WebhookNotifier;
use tower_redis_ratelimit::{
    Key, MemoryStore, Policy, Quota, RateLimitLayer, RedisStore, Rule, Store,
};

/// The API: a per-minute limit per user and the daily quota by tier, alerts to `webhook`.
fn app(store: impl Store, webhook: &str, free_per_day: u64) -> Router {
    let user = || {
        Key::user_from_fn(|parts| {
            let user = parts.headers.get("x-user-id")?.to_str().ok()?;
            Some(user.to_owned())
        })
    };
    let quota = Quota::builder("daily")
        .key(user())
        .tier("free", free_per_day)
        .tier("pro", 5_000)
        .default_tier("free")
        .tier_from_fn(|parts| Some(parts.headers.get("x-tier")?.to_str().ok()?.to_owned()))
        .alert_at([80, 100])
        .notifier(
            WebhookNotifier::new(webhook)
                .timeout(Duration::from_secs(2))
                .retries(3),
        )
        .build()
        .expect("a valid quota");
    let policy = Policy::builder("maps")
        .key(user())
        .rule(Rule::per_minute(60))
        .quota(quota)
        .message("Too many map requests, or the day's quota is used up.")
        .build()
        .expect("a valid policy");
    Router::new()
        .route("/maps", get(|| async { "tile\n" }))
        .layer(RateLimitLayer::new(policy, store))
}

/// A webhook receiver that prints what it gets.
fn receiver() -> Router {
    Router::new().route(
        "/alerts",
        post(|body: String| async move {
            println!("alert: {body}");
        }),
    )
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let alerts = tokio::net::TcpListener::bind("127.0.0.1:3003").await?;
    tokio::spawn(async move { axum::serve(alerts, receiver()).await });
    let webhook = "http://127.0.0.1:3003/alerts";
    let app = match std::env::var("REDIS_URL") {
        Ok(url) => app(
            RedisStore::from_url(&url).expect("a valid REDIS_URL"),
            webhook,
            10,
        ),
        Err(_) => app(MemoryStore::new(), webhook, 10),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3002").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::{Arc, Mutex};

    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use http::{Request, StatusCode};
    use tower::ServiceExt;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_requests_alert_once_at_80_and_once_at_100_percent() {
        // The receiver records instead of printing.
        let got = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
        let seen = got.clone();
        let receiver = Router::new().route(
            "/alerts",
            post(move |body: String| {
                seen.lock()
                    .unwrap()
                    .push(serde_json::from_str(&body).unwrap());
                async {}
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let webhook = format!("http://{}/alerts", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, receiver).await });

        let app = app(MemoryStore::new(), &webhook, 10);
        let tasks: Vec<_> = (0..15)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(async move {
                    let mut request = Request::get("/maps")
                        .header("x-user-id", "ann")
                        .body(Body::empty())
                        .unwrap();
                    let peer: SocketAddr = "192.0.2.9:1".parse().unwrap();
                    request.extensions_mut().insert(ConnectInfo(peer));
                    app.oneshot(request).await.unwrap().status()
                })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            admitted += usize::from(task.await.unwrap() == StatusCode::OK);
        }
        assert_eq!(admitted, 10);
        for _ in 0..500 {
            if got.lock().unwrap().len() >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut alerts = got.lock().unwrap().clone();
        alerts.sort_by_key(|alert| alert["percent"].as_u64());
        assert_eq!(alerts.len(), 2, "{alerts:?}");
        for (alert, (percent, used)) in alerts.iter().zip([(80, 8), (100, 10)]) {
            assert_eq!(alert["user"], "ann");
            assert_eq!(alert["tier"], "free");
            assert_eq!(alert["percent"], percent);
            assert_eq!(alert["used"], used);
            assert_eq!(alert["limit"], 10);
        }
    }
}
