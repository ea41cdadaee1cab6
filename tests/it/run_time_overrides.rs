//! Overrides set at run time (issue 61): kept in the store, applied by every instance sharing it
//! at its next check, with the counts already made; on the memory store, two limiters sharing
//! one `MemoryStore` stand for two instances.

use crate::common;

use std::time::Duration;

use common::{admitted, clock, from_user, request_from, send, store_at};
use http::StatusCode;
use tower_redis_ratelimit::operate::{OperatorError, OverrideAction};
use tower_redis_ratelimit::policy::Override;
use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, RateLimiter, Rule, Store};

const MINUTE: Duration = Duration::from_secs(60);

fn by_user(store: impl Store) -> RateLimiter {
    let policy = Policy::builder("plans")
        .prefix("rt")
        .key(Key::user())
        .rule(Rule::new(5, MINUTE))
        .build()
        .unwrap();
    RateLimiter::new(policy, store)
}

#[tokio::test]
async fn a_raise_on_one_instance_carries_the_count_to_the_other() {
    let clock = clock();
    let store = store_at(&clock);
    let (one, other) = (by_user(store.clone()), by_user(store.clone()));
    for _ in 0..3 {
        one.check("alice").await.unwrap();
    }
    one.set_override(Override::identity("alice").rules([Rule::new(20, MINUTE)]))
        .await
        .unwrap();
    assert_eq!(admitted(&other, "alice").await, 17);
    assert_eq!(admitted(&other, "bob").await, 5);

    // Removed: alice has used 20 of her 5 again, refused until the window frees.
    other
        .remove_override(Override::identity("alice"))
        .await
        .unwrap();
    assert_eq!(admitted(&one, "alice").await, 0);
    clock.advance(MINUTE);
    assert_eq!(admitted(&one, "alice").await, 5);
}

#[tokio::test]
async fn lowering_below_what_was_used_refuses_until_the_window_frees() {
    let clock = clock();
    let store = store_at(&clock);
    let (one, other) = (by_user(store.clone()), by_user(store.clone()));
    for _ in 0..3 {
        one.check("alice").await.unwrap();
    }
    one.set_override(Override::identity("alice").rules([Rule::new(2, MINUTE)]))
        .await
        .unwrap();
    assert_eq!(admitted(&other, "alice").await, 0);
    clock.advance(MINUTE);
    assert_eq!(admitted(&other, "alice").await, 2);
}

#[tokio::test]
async fn a_block_for_a_while_ends_by_itself() {
    let clock = clock();
    let store = store_at(&clock);
    let (one, other) = (by_user(store.clone()), by_user(store.clone()));
    one.set_override_for(Override::identity("alice").deny(), Duration::from_secs(1))
        .await
        .unwrap();
    let refused = other.check("alice").await.unwrap_err();
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    other.check("bob").await.unwrap();
    let listed = other.overrides().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].target.as_str(),
            &listed[0].action,
            listed[0].left_ms
        ),
        ("user:alice", &OverrideAction::Deny, Some(1000))
    );

    clock.advance(Duration::from_secs(1));
    other.check("alice").await.unwrap();
    assert!(one.overrides().await.unwrap().is_empty());
}

#[tokio::test]
async fn an_instance_made_after_the_override_applies_it() {
    let store = MemoryStore::new();
    by_user(store.clone())
        .set_override(Override::identity("alice").unlimited())
        .await
        .unwrap();
    let later = by_user(store.clone());
    assert_eq!(admitted(&later, "alice").await, 100);
    assert_eq!(admitted(&later, "bob").await, 5);
}

#[tokio::test]
async fn a_run_time_override_wins_over_the_policys_own() {
    let policy = Policy::builder("plans")
        .key(Key::user())
        .rule(Rule::new(5, MINUTE))
        .overrides([Override::identity("alice").rules([Rule::new(2, MINUTE)])])
        .build()
        .unwrap();
    let limiter = RateLimiter::new(policy, MemoryStore::new());
    limiter
        .set_override(Override::identity("alice").rules([Rule::new(8, MINUTE)]))
        .await
        .unwrap();
    assert_eq!(admitted(&limiter, "alice").await, 8);
}

#[tokio::test]
async fn an_identity_wins_over_a_network_and_a_layer_applies_both() {
    let store = MemoryStore::new();
    let policy = Policy::builder("by-ip")
        .key(Key::ip())
        .rule(Rule::new(2, MINUTE))
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(policy, store.clone());
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(layer.clone());
    layer
        .set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).deny())
        .await
        .unwrap();
    layer
        .set_override(Override::identity("10.1.2.3").unlimited())
        .await
        .unwrap();
    let status = |peer: &'static str| {
        let app = app.clone();
        async move { send(&app, request_from(peer, "/")).await.status() }
    };
    assert_eq!(status("10.9.9.9:1").await, StatusCode::FORBIDDEN);
    for _ in 0..4 {
        assert_eq!(status("10.1.2.3:1").await, StatusCode::OK);
    }
    assert_eq!(status("192.0.2.1:1").await, StatusCode::OK);
    assert_eq!(status("192.0.2.1:1").await, StatusCode::OK);
    assert_eq!(status("192.0.2.1:1").await, StatusCode::TOO_MANY_REQUESTS);
    let listed = layer.overrides().await.unwrap();
    let targets: Vec<&str> = listed.iter().map(|set| set.target.as_str()).collect();
    assert_eq!(targets, ["10.1.2.3", "10.0.0.0/8"]);
}

#[tokio::test]
async fn a_layer_and_a_handle_over_one_store_see_the_same_overrides() {
    let store = MemoryStore::new();
    let policy = Policy::builder("plans")
        .prefix("rt")
        .key(Key::user())
        .rule(Rule::new(1, MINUTE))
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(policy, store.clone());
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(layer);
    by_user(store)
        .set_override(Override::identity("carol").rules([Rule::new(3, MINUTE)]))
        .await
        .unwrap();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(send(&app, from_user("carol")).await.status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
}

#[tokio::test]
async fn bad_overrides_are_refused_before_anything_is_stored() {
    let limiter = by_user(MemoryStore::new());
    let zero = limiter
        .set_override(Override::identity("alice").rules([Rule::new(0, MINUTE)]))
        .await
        .unwrap_err();
    assert!(matches!(zero, OperatorError::InvalidOverride(_)), "{zero}");
    assert!(zero.to_string().contains("0 per 60s"), "{zero}");
    let empty = limiter
        .set_override(Override::identity("").deny())
        .await
        .unwrap_err();
    assert!(matches!(empty, OperatorError::BadIdentity(_)), "{empty}");
    let no_rules = limiter
        .set_override(Override::identity("alice").rules([]))
        .await
        .unwrap_err();
    assert!(
        matches!(no_rules, OperatorError::InvalidOverride(_)),
        "{no_rules}"
    );
    assert!(limiter.overrides().await.unwrap().is_empty());
    assert_eq!(admitted(&limiter, "alice").await, 5);
}

#[tokio::test]
async fn a_rule_of_another_period_starts_afresh_and_the_shared_one_carries_over() {
    let limiter = by_user(MemoryStore::new());
    for _ in 0..4 {
        limiter.check("alice").await.unwrap();
    }
    limiter
        .set_override(Override::identity("alice").rules([
            Rule::new(6, MINUTE),
            Rule::new(100, Duration::from_secs(3600)),
        ]))
        .await
        .unwrap();
    // 4 of the minute's 6 are used; the hour counts from now.
    assert_eq!(admitted(&limiter, "alice").await, 2);
    let usage = limiter.peek("alice").await.unwrap();
    assert_eq!(usage.rules[1].remaining, 98);
}

#[test]
fn the_operations_futures_are_send() {
    fn send<T: Send>(_: T) {}
    let limiter = by_user(MemoryStore::new());
    let layer = RateLimitLayer::new(
        Policy::builder("p")
            .rule(Rule::per_minute(1))
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    send(limiter.set_override(Override::identity("a").deny()));
    send(limiter.set_override_for(Override::identity("a").deny(), MINUTE));
    send(limiter.remove_override(Override::identity("a")));
    send(limiter.overrides());
    send(layer.set_override(Override::identity("10.0.0.1").deny()));
    send(layer.set_override_for(Override::identity("10.0.0.1").deny(), MINUTE));
    send(layer.remove_override(Override::identity("10.0.0.1")));
    send(layer.overrides());
}

#[tokio::test]
async fn a_hashed_key_is_set_and_listed_by_its_hash_alone() {
    let policy = Policy::builder("keys")
        .key(Key::header("x-api-key"))
        .rule(Rule::new(5, MINUTE))
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(policy, MemoryStore::new());
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(layer.clone());
    layer
        .set_override(Override::identity("sk-live-secret").deny())
        .await
        .unwrap();
    let with_key = |key: &'static str| {
        let mut request = request_from("192.0.2.1:1", "/");
        request
            .headers_mut()
            .insert("x-api-key", http::HeaderValue::from_static(key));
        request
    };
    assert_eq!(
        send(&app, with_key("sk-live-secret")).await.status(),
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        send(&app, with_key("sk-other")).await.status(),
        StatusCode::OK
    );
    let listed = layer.overrides().await.unwrap();
    assert!(listed[0].target.starts_with("header#"), "{listed:?}");
    assert!(!listed[0].target.contains("secret"), "{listed:?}");
}

#[tokio::test]
async fn counts_carry_over_under_every_algorithm() {
    use tower_redis_ratelimit::Algorithm;
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ] {
        let clock = clock();
        let policy = Policy::builder("algorithms")
            .key(Key::user())
            .rule(Rule::new(5, MINUTE))
            .algorithm(algorithm)
            .build()
            .unwrap();
        let store = store_at(&clock);
        let (one, other) = (
            RateLimiter::new(policy.clone(), store.clone()),
            RateLimiter::new(policy, store),
        );
        for _ in 0..3 {
            one.check("alice").await.unwrap();
        }
        one.set_override(Override::identity("alice").rules([Rule::new(20, MINUTE)]))
            .await
            .unwrap();
        // The token bucket carries the time owed: 3 units of 12 s are 36 s, 12 of the new 3 s.
        let left = if algorithm == Algorithm::TokenBucket {
            8
        } else {
            17
        };
        assert_eq!(admitted(&other, "alice").await, left, "{algorithm:?}");
    }
}

#[tokio::test]
async fn an_operators_refund_and_reset_reach_the_counter_of_a_run_time_overrides_own_period() {
    let limiter = by_user(MemoryStore::new());
    common::operators_reach_a_run_time_overrides_own_period(&limiter).await;
}
