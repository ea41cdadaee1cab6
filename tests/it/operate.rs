//! An operator's actions on one identity, on both stores: `inspect` reads the state without
//! counting, `reset` forgets the counts and lifts a penalty block for every instance.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, assert_every_key_expires, unique_prefix};
use common::{from_user, send};
use tower_redis_ratelimit::meter::Meter;
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Rule, Store,
    operate::OperatorError, policy::Scope,
};

fn redis_store(redis: &TestRedis) -> RedisStore {
    RedisStore::from_url(&redis.url)
        .unwrap()
        .timeout(Duration::from_secs(10))
}

fn instance(layer: &RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer.clone())
}

async fn status(app: &Router, user: &str) -> u16 {
    send(app, from_user(user)).await.status().as_u16()
}

/// An OTP policy: 3 a minute, and a refused client blocked for an hour.
fn otp(prefix: &str) -> Policy {
    Policy::builder("otp")
        .prefix(prefix)
        .key(Key::user())
        .rule(Rule::per_minute(3))
        .block_for(Duration::from_secs(3600))
        .build()
        .unwrap()
}

/// A blocked identity, reset through one instance, is admitted by the other at once; the others
/// stay blocked.
async fn a_reset_unblocks_on_every_instance(stores: [Arc<dyn Store>; 2], prefix: &str) {
    let [a, b] = stores.map(|store| RateLimitLayer::new(otp(prefix), store));
    let (app_a, app_b) = (instance(&a), instance(&b));
    for user in ["alice", "mallory"] {
        let mut statuses = Vec::new();
        for n in 0..5 {
            statuses.push(status(if n % 2 == 0 { &app_a } else { &app_b }, user).await);
        }
        assert_eq!(statuses, [200, 200, 200, 429, 429], "{user}");
    }
    assert_eq!(status(&app_b, "alice").await, 429, "blocked");
    a.reset("user:alice").await.unwrap();
    assert_eq!(
        status(&app_b, "alice").await,
        200,
        "unblocked through the other instance"
    );
    assert_eq!(status(&app_a, "alice").await, 200);
    assert_eq!(
        status(&app_b, "mallory").await,
        429,
        "another identity stays blocked"
    );
    // Reset means a fresh start: the minute's three again, then the block again.
    assert_eq!(status(&app_a, "alice").await, 200);
    assert_eq!(status(&app_a, "alice").await, 429);
    assert_eq!(b.inspect("user:mallory").await.unwrap()[0].remaining, 0);
}

#[tokio::test]
async fn in_memory_a_reset_unblocks_on_every_instance() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    a_reset_unblocks_on_every_instance([store.clone(), store], "mem").await;
}

#[tokio::test]
async fn on_redis_a_reset_unblocks_on_every_instance() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("reset");
    let stores: [Arc<dyn Store>; 2] =
        [Arc::new(redis_store(&redis)), Arc::new(redis_store(&redis))];
    a_reset_unblocks_on_every_instance(stores, &prefix).await;
    assert!(assert_every_key_expires(&mut redis.client(), &prefix) > 0);
}

/// Every algorithm, as inspection is tested on each.
const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::TokenBucket,
];

/// Inspection reads remaining and reset per rule and counts nothing: for every algorithm, the
/// request after an inspection sees what it would have seen without one; a duplicate guard is
/// not consumed; an identity never seen is whole and leaves nothing behind.
async fn inspection_counts_nothing(store: Arc<dyn Store>, prefix: &str) {
    for algorithm in ALGORITHMS {
        let policy = Policy::builder(format!("look-{algorithm}"))
            .prefix(prefix)
            .key(Key::user())
            .algorithm(algorithm)
            .rule(Rule::per_minute(5))
            .rule(Rule::per_hour(7))
            .prevent_duplicate(Duration::from_millis(1))
            .build()
            .unwrap();
        let layer = RateLimitLayer::new(policy, store.clone());
        let app = instance(&layer);
        let fresh = layer.inspect("user:nobody").await.unwrap();
        let whole: Vec<(&str, u64, u64, u64)> = fresh
            .iter()
            .map(|s| (s.rule.as_str(), s.limit, s.remaining, s.reset_ms))
            .collect();
        assert_eq!(
            whole,
            [("5-per-60s", 5, 5, 0), ("7-per-3600s", 7, 7, 0)],
            "{algorithm}"
        );
        for sent in 1..=6u64 {
            // Past the guard's millisecond.
            tokio::time::sleep(Duration::from_millis(3)).await;
            let expected = if sent <= 5 { 200 } else { 429 };
            assert_eq!(
                status(&app, "bob").await,
                expected,
                "{algorithm} request {sent}"
            );
            for _ in 0..3 {
                let state = layer.inspect("user:bob").await.unwrap();
                let remaining: Vec<u64> = state.iter().map(|s| s.remaining).collect();
                let used = sent.min(5);
                assert_eq!(remaining, [5 - used, 7 - used], "{algorithm} after {sent}");
                assert!(
                    state
                        .iter()
                        .all(|s| s.reset_ms > 0 && s.reset_ms <= 3_600_000)
                );
            }
        }
    }
}

/// A metered rule reads as it is too: three reads after each request leave its units, and the
/// rule of requests beside it, where the requests put them (a read is a check of no request and
/// no unit).
async fn metered_inspection_counts_nothing(store: Arc<dyn Store>, prefix: &str) {
    for algorithm in ALGORITHMS {
        let policy = Policy::builder(format!("look-metered-{algorithm}"))
            .prefix(prefix)
            .key(Key::user())
            .algorithm(algorithm)
            .rule(Rule::per_minute(5))
            .rule(Rule::per_minute(1_000).metered())
            .meter(Meter::new("tokens").estimate(|_| 200))
            .build()
            .unwrap();
        let layer = RateLimitLayer::new(policy, store.clone());
        let app = instance(&layer);
        let fresh: Vec<u64> = layer
            .inspect("user:carol")
            .await
            .unwrap()
            .iter()
            .map(|state| state.remaining)
            .collect();
        assert_eq!(fresh, [5, 1_000], "{algorithm}");
        for sent in 1..=3u64 {
            // (Nothing recorded: each request's 200 stand.)
            assert_eq!(
                status(&app, "carol").await,
                200,
                "{algorithm} request {sent}"
            );
            for _ in 0..3 {
                let remaining: Vec<u64> = layer
                    .inspect("user:carol")
                    .await
                    .unwrap()
                    .iter()
                    .map(|state| state.remaining)
                    .collect();
                assert_eq!(
                    remaining,
                    [5 - sent, 1_000 - 200 * sent],
                    "{algorithm} after {sent}"
                );
            }
        }
    }
}

#[tokio::test]
async fn in_memory_inspection_counts_nothing() {
    let store = MemoryStore::new();
    inspection_counts_nothing(Arc::new(store.clone()), "mem").await;
    // The never-seen identity left no entry: one per algorithm for bob, that's all.
    assert_eq!(store.len(), 4);
    metered_inspection_counts_nothing(Arc::new(store), "mem").await;
}

#[tokio::test]
async fn on_redis_inspection_counts_nothing() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("inspect");
    let store: Arc<dyn Store> = Arc::new(redis_store(&redis));
    inspection_counts_nothing(store.clone(), &prefix).await;
    metered_inspection_counts_nothing(store, &prefix).await;
    assert!(assert_every_key_expires(&mut redis.client(), &prefix) > 0);
}

/// A refusal another instance cached stands at most a second after a reset.
#[tokio::test]
async fn on_redis_a_cached_refusal_gives_way_to_a_reset_within_a_second() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("cached");
    let policy = || {
        Policy::builder("api")
            .prefix(&prefix)
            .key(Key::user())
            .rule(Rule::per_hour(1))
            .build()
            .unwrap()
    };
    let a = RateLimitLayer::new(policy(), redis_store(&redis));
    let b = RateLimitLayer::new(policy(), redis_store(&redis));
    let (app_a, app_b) = (instance(&a), instance(&b));
    assert_eq!(status(&app_a, "carol").await, 200);
    assert_eq!(status(&app_a, "carol").await, 429);
    assert_eq!(status(&app_a, "carol").await, 429, "now from a's cache");
    b.reset("user:carol").await.unwrap();
    assert_eq!(status(&app_b, "carol").await, 200, "b asks the store");
    b.reset("user:carol").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(
        status(&app_a, "carol").await,
        200,
        "a's cached refusal has gone stale"
    );
}

#[tokio::test]
async fn bad_identities_and_route_scoped_policies_are_refused_clearly() {
    let layer = RateLimitLayer::new(otp("bad"), MemoryStore::new());
    for identity in ["", "user:{alice}", "user:a\nb", &"x".repeat(600)] {
        let error = layer.reset(identity).await.unwrap_err();
        assert!(
            matches!(error, OperatorError::BadIdentity(_)),
            "{identity:?}: {error}"
        );
        assert!(layer.inspect(identity).await.is_err());
    }
    let scoped = Policy::builder("per-route")
        .scope(Scope::Route)
        .rule(Rule::per_minute(1))
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(scoped, MemoryStore::new());
    let error = layer.inspect("ip:192.0.2.1").await.unwrap_err();
    assert_eq!(
        error.to_string(),
        "policy \"per-route\" counts per route: an identity alone doesn't name its keys"
    );
    // A store that doesn't say how to reset refuses, and the layer says so.
    struct Custom(MemoryStore);
    impl Store for Custom {
        fn check(
            &self,
            request: &tower_redis_ratelimit::store::CheckRequest<'_>,
        ) -> tower_redis_ratelimit::store::CheckFuture {
            self.0.check(request)
        }
    }
    let layer = RateLimitLayer::new(otp("custom"), Custom(MemoryStore::new()));
    let error = layer.reset("user:alice").await.unwrap_err();
    assert_eq!(
        error.to_string(),
        "rate-limit store misconfigured: the custom store can't reset a key"
    );
    assert_eq!(
        layer.inspect("user:alice").await.unwrap()[0].remaining,
        3,
        "inspection needs only check"
    );
}
