//! Overrides set at run time on Redis (issue 61): kept in Redis, read by the check of the
//! identity in its own call (`lua/overrides.lua`), so every instance applies one at its next
//! check; two stores made from one URL (their own pools) stand for two instances.

use crate::common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::admitted;
use common::redis_server::{TestRedis, unique_prefix};
use common::redis_store::store;
use common::{request_from, send};
use http::StatusCode;
use tower_redis_ratelimit::headers;
use tower_redis_ratelimit::operate::OverrideAction;
use tower_redis_ratelimit::policy::Override;
use tower_redis_ratelimit::{Algorithm, Key, Policy, RateLimitLayer, RateLimiter, Rule, UserId};

const MINUTE: Duration = Duration::from_secs(60);

fn by_user(redis: &TestRedis, prefix: &str, window: Duration) -> RateLimiter {
    let policy = Policy::builder("plans")
        .prefix(prefix)
        .key(Key::user())
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::new(5, window))
        .build()
        .unwrap();
    RateLimiter::new(policy, store(redis))
}

/// Waits for the start of the next fixed window of `window` (Redis and this process share the
/// machine's clock).
async fn next_window(window: Duration) {
    let period = window.as_millis();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let left = period - now % period;
    tokio::time::sleep(Duration::from_millis(u64::try_from(left).unwrap() + 20)).await;
}

#[tokio::test]
async fn a_raise_on_one_instance_carries_the_count_to_the_other_and_a_removal_ends_it() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtraise");
    let window = Duration::from_secs(3);
    let (one, other) = (
        by_user(&redis, &prefix, window),
        by_user(&redis, &prefix, window),
    );
    next_window(window).await;
    for _ in 0..3 {
        one.check("alice").await.unwrap();
    }
    one.set_override(Override::identity("alice").rules([Rule::new(20, window)]))
        .await
        .unwrap();
    assert_eq!(admitted(&other, "alice").await, 17);
    assert_eq!(admitted(&other, "bob").await, 5);
    // The headers' limit is the override's.
    let peeked = one.peek("alice").await.unwrap();
    assert_eq!((peeked.rules[0].limit, peeked.rules[0].remaining), (20, 0));

    // Removed: alice has used 20 of her 5 again, refused until the window frees.
    other
        .remove_override(Override::identity("alice"))
        .await
        .unwrap();
    assert_eq!(admitted(&one, "alice").await, 0);
    next_window(window).await;
    assert_eq!(admitted(&one, "alice").await, 5);
}

#[tokio::test]
async fn lowering_below_what_was_used_refuses_at_once() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtlower");
    let (one, other) = (
        by_user(&redis, &prefix, MINUTE),
        by_user(&redis, &prefix, MINUTE),
    );
    for _ in 0..3 {
        one.check("alice").await.unwrap();
    }
    one.set_override(Override::identity("alice").rules([Rule::new(2, MINUTE)]))
        .await
        .unwrap();
    assert_eq!(admitted(&other, "alice").await, 0);
    assert_eq!(admitted(&other, "bob").await, 5);
}

#[tokio::test]
async fn a_deny_for_a_while_refuses_everywhere_at_once_and_ends_by_itself() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtdeny");
    // (All of it within one window: the count after the deny is the one before.)
    let window = Duration::from_secs(3);
    let (one, other) = (
        by_user(&redis, &prefix, window),
        by_user(&redis, &prefix, window),
    );
    next_window(window).await;
    one.check("alice").await.unwrap();
    one.set_override_for(Override::identity("alice").deny(), Duration::from_secs(1))
        .await
        .unwrap();
    // Denied as a policy's own deny answers: 403.
    let denied = other.check("alice").await.err();
    assert_eq!(
        denied.map(|refused| refused.status()),
        Some(http::StatusCode::FORBIDDEN)
    );
    let listed = other.overrides().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].action, OverrideAction::Deny);
    assert!(listed[0].left_ms.is_some_and(|left| left <= 1_000));
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    // Nothing was counted while denied: 4 of 5 left.
    assert_eq!(admitted(&other, "alice").await, 4);
    assert!(other.overrides().await.unwrap().is_empty());
}

#[tokio::test]
async fn an_instance_made_after_the_override_applies_it_and_unlimited_counts_nothing() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtlater");
    let one = by_user(&redis, &prefix, MINUTE);
    one.set_override(Override::identity("alice").rules([Rule::new(8, MINUTE)]))
        .await
        .unwrap();
    one.set_override(Override::identity("carol").unlimited())
        .await
        .unwrap();
    let later = by_user(&redis, &prefix, MINUTE);
    assert_eq!(admitted(&later, "alice").await, 8);
    assert_eq!(admitted(&later, "carol").await, 100);
    later
        .remove_override(Override::identity("carol"))
        .await
        .unwrap();
    assert_eq!(admitted(&one, "carol").await, 5);
}

/// A policy named `name` keyed by `key`, `per_minute` a minute.
fn policy_of(prefix: &str, name: &str, key: Key, per_minute: u64) -> Policy {
    Policy::builder(name)
        .prefix(prefix)
        .key(key)
        .rule(Rule::per_minute(per_minute))
        .build()
        .unwrap()
}

/// `GET /` behind `layer`.
fn app_of(layer: RateLimitLayer) -> axum::Router {
    axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(layer)
}

/// An instance: a policy named `name` keyed by `key`, 2 a minute, behind a layer over its own
/// store.
fn instance(
    redis: &TestRedis,
    prefix: &str,
    name: &str,
    key: Key,
) -> (RateLimitLayer, axum::Router) {
    let layer = RateLimitLayer::new(policy_of(prefix, name, key, 2), store(redis));
    (layer.clone(), app_of(layer))
}

/// A policy keyed by client address, 2 a minute, behind a layer over its own store.
fn by_address(redis: &TestRedis, prefix: &str) -> (RateLimitLayer, axum::Router) {
    instance(redis, prefix, "byip", Key::ip())
}

async fn status(app: &axum::Router, peer: &str) -> StatusCode {
    send(app, request_from(peer, "/")).await.status()
}

#[tokio::test]
async fn networks_apply_to_a_policy_keyed_by_address_and_an_identity_wins() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtnet");
    let (one, _) = by_address(&redis, &prefix);
    let (other, app) = by_address(&redis, &prefix);
    one.set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).deny())
        .await
        .unwrap();
    one.set_override(Override::identity("10.1.2.3").unlimited())
        .await
        .unwrap();
    one.set_override(Override::cidr("2001:db8::/32".parse().unwrap()).rules([Rule::per_minute(3)]))
        .await
        .unwrap();
    assert_eq!(status(&app, "10.9.9.9:1").await, StatusCode::FORBIDDEN);
    for _ in 0..4 {
        assert_eq!(status(&app, "10.1.2.3:1").await, StatusCode::OK);
    }
    // An IPv6 client, counted by its /64, which the /32 holds: 3, not 2.
    for _ in 0..3 {
        assert_eq!(status(&app, "[2001:db8:1:2::5]:1").await, StatusCode::OK);
    }
    assert_eq!(
        status(&app, "[2001:db8:1:2::6]:1").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(status(&app, "192.0.2.1:1").await, StatusCode::OK);
    assert_eq!(status(&app, "192.0.2.1:1").await, StatusCode::OK);
    assert_eq!(
        status(&app, "192.0.2.1:1").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let listed = other.overrides().await.unwrap();
    let targets: Vec<&str> = listed.iter().map(|set| set.target.as_str()).collect();
    assert_eq!(targets, ["10.1.2.3", "10.0.0.0/8", "2001:db8::/32"]);
    // Removed on one instance: the other counts 10.9.9.9 by the policy again.
    one.remove_override(Override::cidr("10.0.0.0/8".parse().unwrap()))
        .await
        .unwrap();
    assert_eq!(status(&app, "10.9.9.9:1").await, StatusCode::OK);
}

#[tokio::test]
async fn a_network_for_a_while_ends_by_itself() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtnetfor");
    let (one, app) = by_address(&redis, &prefix);
    one.set_override_for(
        Override::cidr("198.51.100.0/24".parse().unwrap()).deny(),
        Duration::from_millis(500),
    )
    .await
    .unwrap();
    assert_eq!(status(&app, "198.51.100.7:1").await, StatusCode::FORBIDDEN);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(status(&app, "198.51.100.7:1").await, StatusCode::OK);
    assert!(one.overrides().await.unwrap().is_empty());
}

/// A policy keyed by user, 2 a minute, behind a layer over its own store.
fn by_user_layer(redis: &TestRedis, prefix: &str) -> (RateLimitLayer, axum::Router) {
    instance(redis, prefix, "byuser", Key::user())
}

/// `user`'s request from `peer` through `app`.
async fn sent_as(app: &axum::Router, user: &str, peer: &str) -> http::Response<axum::body::Body> {
    let mut request = request_from(peer, "/");
    request.extensions_mut().insert(UserId::new(user));
    send(app, request).await
}

/// What `app` answers a new user's request from `peer`, once it is `expected` (an instance
/// hears of a network's change within a notice's round trip): its status and its limit.
async fn eventually(app: &axum::Router, peer: &str, expected: (StatusCode, u64)) {
    let mut answered = (StatusCode::OK, 0);
    for probe in 0..250 {
        let response = sent_as(app, &format!("probe-{probe}"), peer).await;
        let limit = headers::parse(response.headers())
            .ok()
            .and_then(|parsed| parsed.policies.first().map(|item| item.quota))
            .unwrap_or(0);
        answered = (response.status(), limit);
        if answered == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{peer} answered {answered:?}, not {expected:?}, after 5 s");
}

#[tokio::test]
async fn networks_apply_under_a_key_of_another_kind_through_each_instances_copy() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtnetuser");
    let (one, _) = by_user_layer(&redis, &prefix);
    let (_other, app) = by_user_layer(&redis, &prefix);
    // The other instance's copy is read (empty) before anything is set.
    eventually(&app, "10.1.1.1:1", (StatusCode::OK, 2)).await;
    one.set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).deny())
        .await
        .unwrap();
    one.set_override(Override::cidr("192.0.2.0/24".parse().unwrap()).rules([Rule::per_minute(3)]))
        .await
        .unwrap();
    one.set_override(Override::identity("alice").unlimited())
        .await
        .unwrap();
    // The other instance hears of the networks, and applies them.
    eventually(&app, "10.1.1.1:1", (StatusCode::FORBIDDEN, 0)).await;
    eventually(&app, "192.0.2.9:1", (StatusCode::OK, 3)).await;
    // alice's own override wins over her network's, in the same call.
    for _ in 0..4 {
        assert_eq!(
            sent_as(&app, "alice", "10.1.1.1:1").await.status(),
            StatusCode::OK
        );
    }
    // bob counts by his network's rules, carol (elsewhere) by the policy's, in one counter.
    for _ in 0..3 {
        assert_eq!(
            sent_as(&app, "bob", "192.0.2.5:1").await.status(),
            StatusCode::OK
        );
    }
    let refused = sent_as(&app, "bob", "192.0.2.5:1").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        sent_as(&app, "bob", "198.51.100.1:1").await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "3 used: over the policy's 2 outside the network"
    );
    for _ in 0..2 {
        assert_eq!(
            sent_as(&app, "carol", "198.51.100.1:1").await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        sent_as(&app, "carol", "198.51.100.1:1").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // An instance made after they were set reads them when it is made.
    let (_late, late_app) = by_user_layer(&redis, &prefix);
    eventually(&late_app, "10.200.0.1:1", (StatusCode::FORBIDDEN, 0)).await;
    // Removed on one instance: the others hear of it.
    one.remove_override(Override::cidr("10.0.0.0/8".parse().unwrap()))
        .await
        .unwrap();
    eventually(&app, "10.1.1.1:1", (StatusCode::OK, 2)).await;
    eventually(&late_app, "10.1.1.1:1", (StatusCode::OK, 2)).await;
    let listed = one.overrides().await.unwrap();
    let targets: Vec<&str> = listed.iter().map(|set| set.target.as_str()).collect();
    assert_eq!(targets, ["user:alice", "192.0.2.0/24"]);
}

#[tokio::test]
async fn a_network_set_through_an_instance_applies_there_before_the_call_returns() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtnetown");
    let (one, app) = by_user_layer(&redis, &prefix);
    eventually(&app, "10.1.1.1:1", (StatusCode::OK, 2)).await;
    one.set_override_for(
        Override::cidr("10.0.0.0/8".parse().unwrap()).deny(),
        Duration::from_millis(400),
    )
    .await
    .unwrap();
    assert_eq!(
        sent_as(&app, "dave", "10.3.3.3:1").await.status(),
        StatusCode::FORBIDDEN
    );
    // It ends by itself, in the copy as in Redis.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        sent_as(&app, "dave", "10.3.3.3:1").await.status(),
        StatusCode::OK
    );
    assert!(one.overrides().await.unwrap().is_empty());
}

#[tokio::test]
async fn the_policys_own_override_of_an_address_wins_over_a_network_set_at_run_time() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtnetstatic");
    let policy = Policy::builder("byip")
        .prefix(&prefix)
        .key(Key::ip())
        .rule(Rule::per_minute(2))
        .overrides([Override::identity("10.1.2.3").rules([Rule::per_minute(4)])])
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(policy, store(&redis));
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(layer.clone());
    layer
        .set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).deny())
        .await
        .unwrap();
    assert_eq!(status(&app, "10.9.9.9:1").await, StatusCode::FORBIDDEN);
    // The address the policy overrides: counted by its 4, not denied by the network.
    for _ in 0..4 {
        assert_eq!(status(&app, "10.1.2.3:1").await, StatusCode::OK);
    }
    assert_eq!(
        status(&app, "10.1.2.3:1").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // An override of that address set at run time wins over the policy's own.
    layer
        .set_override(Override::identity("10.1.2.3").unlimited())
        .await
        .unwrap();
    assert_eq!(status(&app, "10.1.2.3:1").await, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_held_ahead_go_when_another_instance_changes_the_identitys_override() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtprefetch");
    let policy = || {
        Policy::builder("hot")
            .prefix(&prefix)
            .key(Key::user())
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::per_hour(1_000))
            .prefetch(10)
            .build()
            .unwrap()
    };
    let held = tower_redis_ratelimit::RedisStore::from_url(&redis.url).unwrap();
    let holder = RateLimiter::new(policy(), held.clone());
    let changer = RateLimiter::new(policy(), store(&redis));
    // The holder takes units ahead: its next checks of alice don't ask Redis. (Its subscription
    // to the notices starts with its first units.)
    holder.check("alice").await.unwrap();
    holder.check("alice").await.unwrap();
    held.until_resets_live_for_tests(true).await;
    changer
        .set_override(Override::identity("alice").deny())
        .await
        .unwrap();
    // The notice crosses Redis to the holder, which drops alice's units in hand.
    held.until_reset_heard_for_tests(&prefix).await;
    let denied = holder.check("alice").await.err();
    assert_eq!(
        denied.map(|refused| refused.status()),
        Some(StatusCode::FORBIDDEN)
    );
}

#[tokio::test]
async fn a_give_back_under_a_run_time_override_goes_where_the_script_charged() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtgiveback");
    // alice is the policy's own override (10 a minute); a run-time one raises her to 20, counted
    // in the policy's counter of that period (its 5's), where the script charges her.
    let policy = Policy::builder("plans")
        .prefix(&prefix)
        .key(Key::user())
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_hour(5))
        .overrides([Override::identity("alice").rules([Rule::per_hour(10)])])
        .build()
        .unwrap();
    let limiter = RateLimiter::new(policy, store(&redis));
    limiter
        .set_override(Override::identity("alice").rules([Rule::per_hour(20)]))
        .await
        .unwrap();
    let charged = limiter.check("alice").await.unwrap();
    charged.refund().await.unwrap();
    // Given back to that counter: all 20 left.
    assert_eq!(admitted(&limiter, "alice").await, 20);
}

#[tokio::test]
async fn an_operators_refund_and_reset_reach_the_counter_of_a_run_time_overrides_own_period() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtoperate");
    let limiter = by_user(&redis, &prefix, MINUTE);
    common::operators_reach_a_run_time_overrides_own_period(&limiter).await;
}

#[tokio::test]
async fn a_policy_named_with_a_tilde_applies_identities_and_networks_alike() {
    let redis = TestRedis::shared();
    let prefix = format!("{}~t", unique_prefix("rttilde"));
    let (one, app) = instance(&redis, &prefix, "api~v2", Key::user());
    eventually(&app, "10.1.1.1:1", (StatusCode::OK, 2)).await;
    one.set_override(Override::identity("erin").rules([Rule::per_minute(7)]))
        .await
        .unwrap();
    one.set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).rules([Rule::per_minute(3)]))
        .await
        .unwrap();
    let mut admitted = 0;
    while admitted < 20 && sent_as(&app, "erin", "192.0.2.1:1").await.status() == StatusCode::OK {
        admitted += 1;
    }
    assert_eq!(admitted, 7);
    let mut admitted = 0;
    while admitted < 20 && sent_as(&app, "frank", "10.2.2.2:1").await.status() == StatusCode::OK {
        admitted += 1;
    }
    assert_eq!(admitted, 3);
}

#[tokio::test]
async fn a_network_counts_where_it_was_set_on_an_instance_of_another_policy_version() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtnetversion");
    // The old version: 2 a minute; the new one, rolling out beside it: 4.
    let (old, old_app) = instance(&redis, &prefix, "byuser", Key::user());
    let new_policy = policy_of(&prefix, "byuser", Key::user(), 4);
    let new_app = app_of(RateLimitLayer::new(new_policy, store(&redis)));
    eventually(&new_app, "10.1.1.1:1", (StatusCode::OK, 4)).await;
    old.set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).rules([Rule::per_minute(5)]))
        .await
        .unwrap();
    eventually(&new_app, "10.1.1.1:1", (StatusCode::OK, 5)).await;
    for _ in 0..5 {
        assert_eq!(
            sent_as(&old_app, "gina", "10.3.3.3:1").await.status(),
            StatusCode::OK
        );
    }
    // The new version counts the network where it was set to count: gina has used her 5.
    assert_eq!(
        sent_as(&new_app, "gina", "10.3.3.3:1").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_read_before_a_change_made_here_never_undoes_it() {
    let redis = TestRedis::shared();
    for round in 0..20 {
        let prefix = unique_prefix(&format!("rtnetrace{round}"));
        // A store over a pool of yours hears no notice: only its own reads refresh its copy.
        let pool = deadpool_redis::Config::from_url(redis.url.clone())
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .unwrap();
        let policy = policy_of(&prefix, "byuser", Key::user(), 2);
        // The copy's first read starts as the layer is made, racing the change.
        let layer = RateLimitLayer::new(policy, tower_redis_ratelimit::RedisStore::new(pool));
        let app = app_of(layer.clone());
        layer
            .set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).deny())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(
            sent_as(&app, "hana", "10.4.4.4:1").await.status(),
            StatusCode::FORBIDDEN,
            "round {round}"
        );
    }
}

#[test]
fn a_limiter_made_outside_a_runtime_leaves_later_ones_their_copy() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("rtnetnort");
    let shared = store(&redis);
    let policy = policy_of(&prefix, "byuser", Key::user(), 2);
    // Outside any runtime: its copy is never read.
    let _outside = RateLimitLayer::new(policy.clone(), shared.clone());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let setter = RateLimitLayer::new(policy.clone(), store(&redis));
        setter
            .set_override(Override::cidr("10.0.0.0/8".parse().unwrap()).deny())
            .await
            .unwrap();
        let app = app_of(RateLimitLayer::new(policy, shared));
        eventually(&app, "10.5.5.5:1", (StatusCode::FORBIDDEN, 0)).await;
    });
}
