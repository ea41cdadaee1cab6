//! How users reach Redis and their app, besides the plain case: a `?protocol=resp3` URL, and Redis
//! and the app on IPv6 and dual-stack listeners. Exact limits over real sockets.

use crate::common;

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, assert_every_key_expires, unique_prefix};
use common::{limits, race, request_from, send, serve_on};
use http::StatusCode;
use tower_redis_ratelimit::store::RedisStore;
use tower_redis_ratelimit::{Key, Policy, RateLimitLayer, Rule};

const PEER: &str = "203.0.113.10:4000";

fn store(url: &str) -> RedisStore {
    RedisStore::from_url(url)
        .unwrap()
        .timeout(Duration::from_secs(10))
}

fn app(policy: &Policy, store: RedisStore) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy.clone(), store))
}

/// A `?protocol=resp3` URL: Redis answers in RESP3 (maps, verbatim strings, doubles), and the
/// store reads them alike: the probe, racing checks in batches over two stores, the headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resp3_url_limits_exactly() {
    let redis = TestRedis::shared();
    let url = if redis.url.contains('?') {
        format!("{}&protocol=resp3", redis.url)
    } else {
        format!("{}?protocol=resp3", redis.url)
    };
    let prefix = unique_prefix("resp3");
    let policy = Policy::builder("resp3")
        .prefix(&prefix)
        .rule(Rule::per_hour(10))
        .rule(Rule::per_minute(20))
        .build()
        .unwrap();
    let (first, second) = (store(&url), store(&url));
    let probed = first.probe().await.unwrap();
    assert!(probed.version.major >= 6, "{probed}");
    let apps = [app(&policy, first.clone()), app(&policy, second)];
    assert_eq!(race(&apps, 40, PEER).await, (10, 30));
    assert!(first.batch_stats().script_calls > 0);
    let refused = send(&apps[0], request_from(PEER, "/")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        limits(&refused).status("10-per-3600s").unwrap().remaining,
        0
    );
    let other = send(&apps[1], request_from("203.0.113.11:4000", "/")).await;
    assert_eq!(limits(&other).status("10-per-3600s").unwrap().remaining, 9);
    assert_eq!(limits(&other).status("20-per-60s").unwrap().remaining, 19);
    assert_eq!(assert_every_key_expires(&mut redis.client(), &prefix), 4);
}

/// Redis on `::1` (`redis://[::1]:port`), the app on an IPv6-only and on a dual-stack listener:
/// clients over `127.0.0.1` (seen as `::ffff:127.0.0.1` by the dual-stack socket) and over `::1`
/// are each limited exactly, by their own address, keyed as IPv4 and as an IPv6 /64.
#[tokio::test]
async fn redis_and_the_app_on_ipv6_and_dual_stack_listeners() {
    let redis = TestRedis::own_dual_stack();
    assert!(redis.url.starts_with("redis://[::1]:"), "{}", redis.url);
    let prefix = unique_prefix("ipv6");
    let policy = Policy::builder("ipv6")
        .prefix(&prefix)
        .key(Key::ip())
        .rule(Rule::per_hour(3))
        .build()
        .unwrap();
    let store = store(&redis.url);
    let dual = serve_on("[::]:0", app(&policy, store.clone())).await.port();
    let v6_only = serve_on("[::1]:0", app(&policy, store)).await.port();
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let statuses = |url: String| {
        let client = client.clone();
        async move {
            let mut statuses = Vec::new();
            for _ in 0..4 {
                let response = client.get(&url).send().await.unwrap();
                statuses.push(response.status().as_u16());
            }
            statuses
        }
    };
    // IPv4 through the dual-stack listener, then IPv6 through both: ::1 is one client whichever
    // listener it reaches.
    assert_eq!(
        statuses(format!("http://127.0.0.1:{dual}/")).await,
        [200, 200, 200, 429]
    );
    assert_eq!(
        statuses(format!("http://[::1]:{dual}/")).await,
        [200, 200, 200, 429]
    );
    assert_eq!(
        statuses(format!("http://[::1]:{v6_only}/")).await,
        [429, 429, 429, 429]
    );
    let mut client = redis.client();
    let keys: Vec<String> =
        redis::Commands::scan_match::<_, String>(&mut client, format!("{prefix}:*"))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(
        keys.iter().any(|key| key.contains("{ip:127.0.0.1}")),
        "{keys:?}"
    );
    assert!(
        keys.iter().any(|key| key.contains("{ip:::/64}")),
        "{keys:?}"
    );
    assert!(!keys.iter().any(|key| key.contains("ffff")), "{keys:?}");
}
