//! The Redis store over a Sentinel-managed primary (a primary, a replica and three sentinels that
//! the test starts itself, see `common::redis_cluster`): exact counts over two stores, every key
//! with an expiry, and a killed primary answered per policy until the sentinels promote the
//! replica, then limiting exactly again on it with no restart.

use crate::common;

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::redis_cluster::{TestSentinel, assert_answered_per_policy, node_client};
use common::redis_server::unique_prefix;
use common::{admitted_and_refused, request_from, send};
use http::StatusCode;
use tower_redis_ratelimit::store::ServerMode;
use tower_redis_ratelimit::{OnStoreError, Policy, RateLimitLayer, RedisStore, Rule};

const TIMEOUT: Duration = Duration::from_millis(500);
const HUNG: Duration = Duration::from_secs(5);
const GENEROUS: Duration = Duration::from_secs(10);

/// An app over a store of its own; `timeout`: the failover's `TIMEOUT`, or a generous one where
/// the test checks what Redis answers (a busy CI machine can stall a first connect).
fn app(sentinel: &TestSentinel, policy: Policy, timeout: Duration) -> Router {
    let store = RedisStore::sentinel(TestSentinel::MASTER, sentinel.urls())
        .expect("valid sentinel URLs")
        .timeout(timeout);
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, store))
}

/// An app over a `deadpool_redis::sentinel::Pool` of the test's.
fn pool_app(sentinel: &TestSentinel, policy: Policy, timeout: Duration) -> Router {
    let pool = deadpool_redis::sentinel::Config::from_urls(
        sentinel.urls(),
        TestSentinel::MASTER.to_owned(),
        deadpool_redis::sentinel::SentinelServerType::Master,
    )
    .create_pool(Some(deadpool_redis::Runtime::Tokio1))
    .expect("a sentinel pool");
    let store = RedisStore::from_sentinel_pool(pool).timeout(timeout);
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, store))
}

fn policy(prefix: &str, name: &str, limit: u64, on_error: OnStoreError) -> Policy {
    Policy::builder(name)
        .prefix(prefix)
        .rule(Rule::per_hour(limit))
        .on_store_error(on_error)
        .build()
        .unwrap()
}

/// 400 requests racing over two apps with stores apart against a limit of 100.
async fn exactly_100_of_400(apps: [&Router; 2], peer: &str) {
    let tasks = (0..400)
        .map(|n| {
            let app = apps[n % 2].clone();
            let peer = peer.to_owned();
            tokio::spawn(async move { send(&app, request_from(&peer, "/")).await.status() })
        })
        .collect();
    assert_eq!(admitted_and_refused(tasks).await, (100, 300));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_primary_limits_exactly_and_fails_over() {
    let mut sentinel = TestSentinel::start();
    let prefix = unique_prefix("sentinel");
    let exact = policy(&prefix, "exact", 100, OnStoreError::Deny);
    // One store of its own, one over a pool of the user's.
    let (first, second) = (
        app(&sentinel, exact.clone(), GENEROUS),
        pool_app(&sentinel, exact, GENEROUS),
    );
    let probed = RedisStore::sentinel(TestSentinel::MASTER, sentinel.urls())
        .unwrap()
        .timeout(GENEROUS)
        .probe()
        .await
        .unwrap();
    assert_eq!(probed.mode, ServerMode::SentinelManaged, "{probed}");
    exactly_100_of_400([&first, &second], "192.0.2.1:1000").await;

    // The primary dies while requests flow.
    let open = app(
        &sentinel,
        policy(&prefix, "open", 1_000_000, OnStoreError::Allow),
        TIMEOUT,
    );
    let closed = app(
        &sentinel,
        policy(&prefix, "closed", 1_000_000, OnStoreError::Deny),
        TIMEOUT,
    );
    let flowing = |app: Router| {
        tokio::spawn(async move {
            let mut answers = Vec::new();
            // Until the store answers again after the failover.
            loop {
                let response =
                    tokio::time::timeout(HUNG, send(&app, request_from("192.0.2.2:1", "/")))
                        .await
                        .unwrap_or_else(|_| panic!("a request hung for {HUNG:?}"));
                let answer = (
                    response.status(),
                    response.headers().contains_key("ratelimit"),
                );
                answers.push(answer);
                if answers.len() > 20 && answer.1 && answers.iter().any(|(_, limited)| !limited) {
                    return answers;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let (open_flow, closed_flow) = (flowing(open.clone()), flowing(closed.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::task::block_in_place(|| sentinel.kill_primary_and_wait_for_promotion());
    let open_answers = tokio::time::timeout(Duration::from_secs(30), open_flow)
        .await
        .expect("limiting resumed (fail open) within 30 s")
        .unwrap();
    let closed_answers = tokio::time::timeout(Duration::from_secs(30), closed_flow)
        .await
        .expect("limiting resumed (fail closed) within 30 s")
        .unwrap();
    assert_answered_per_policy(&open_answers, &closed_answers);

    // Exact again on the promoted replica, through the same stores. Their connections still lead
    // to the dead primary: the first request of each meets that (a store error, 503 here) and the
    // store connects again through the sentinels.
    for app in [&first, &second] {
        let status = send(app, request_from("192.0.2.4:1000", "/"))
            .await
            .status();
        assert!(
            [StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE].contains(&status),
            "{status}"
        );
    }
    exactly_100_of_400([&first, &second], "192.0.2.3:1000").await;

    // No key on the new primary lacks an expiry.
    let keys =
        common::redis_server::assert_every_key_expires(&mut node_client(sentinel.replica), &prefix);
    assert!(keys > 0, "the runs left keys to check");
}
