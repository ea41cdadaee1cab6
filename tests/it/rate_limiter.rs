//! The [`RateLimiter`] handle: a policy's limits for an identity the code names, on both stores.
//! Two handles on one Redis share one limit exactly; a refusal is the layer's, byte for byte;
//! store failures follow `on_store_error`; bad input is refused and never shares a bucket.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::to_bytes;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use common::redis_server::{TestRedis, free_port, unique_prefix};
use common::{request_from, send};
use http::StatusCode;
use redis::Commands;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::{
    Admitted, Key, MemoryStore, Mode, OnStoreError, Policy, RateLimitLayer, RateLimiter,
    RedisStore, Refused, Rule, Store,
};

const PEER: &str = "198.51.100.20:4000";

fn otp(prefix: &str) -> Policy {
    Policy::builder("otp")
        .prefix(prefix)
        .rule(Rule::per_hour(5))
        .build()
        .unwrap()
}

fn redis_store(redis: &TestRedis) -> RedisStore {
    RedisStore::from_url(&redis.url)
        .expect("a valid Redis URL")
        .timeout(Duration::from_secs(10))
}

/// 20 attempts at once for one identity, split between two handles (two app instances): the
/// guarded code runs exactly `limit` times.
async fn two_handles_share_one_limit(first: RateLimiter, second: RateLimiter) {
    let guarded = Arc::new(AtomicUsize::new(0));
    let attempts = (0..20).map(|attempt| {
        let limiter = if attempt % 2 == 0 {
            first.clone()
        } else {
            second.clone()
        };
        let guarded = guarded.clone();
        tokio::spawn(async move {
            if limiter.check("+15550100").await.is_ok() {
                guarded.fetch_add(1, Ordering::SeqCst);
            }
        })
    });
    for attempt in attempts.collect::<Vec<_>>() {
        attempt.await.unwrap();
    }
    assert_eq!(guarded.load(Ordering::SeqCst), 5);
    // Another identity has its own count.
    assert!(first.check("+15550101").await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handles_on_one_redis_share_one_limit_exactly() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("handles");
    two_handles_share_one_limit(
        RateLimiter::new(otp(&prefix), redis_store(&redis)),
        RateLimiter::new(otp(&prefix), redis_store(&redis)),
    )
    .await;
    let mut client = redis.client();
    common::redis_server::assert_every_key_expires(&mut client, &prefix);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handles_on_one_memory_store_share_one_limit_exactly() {
    let store = MemoryStore::new();
    two_handles_share_one_limit(
        RateLimiter::new(otp("rl"), store.clone()),
        RateLimiter::new(otp("rl"), store),
    )
    .await;
}

/// Status, headers and body of a response.
async fn parts_of(
    response: axum::response::Response,
) -> (StatusCode, Vec<(String, String)>, Vec<u8>) {
    let status = response.status();
    let mut headers: Vec<(String, String)> = response
        .headers()
        .iter()
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
        .collect();
    headers.sort();
    let body = to_bytes(response.into_body(), usize::MAX).await.unwrap();
    (status, headers, body.to_vec())
}

/// A handle's refusal and the layer's, for the same state of the same policy at the same time:
/// identical, byte for byte (and so are the admissions' headers). (Under prefixes of their own:
/// a global policy's layer and handle share one bucket.)
async fn a_refusal_is_the_layers_byte_for_byte(store: impl Store + Clone, prefix: &str) {
    let policy = |prefix: &str| {
        Policy::builder("login")
            .prefix(prefix)
            .key(Key::global())
            .rule(Rule::per_minute(2))
            .rule(Rule::per_hour(10))
            .build()
            .unwrap()
    };
    let layered = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy(prefix), store.clone()));
    let handle = RateLimiter::new(policy(&format!("{prefix}-handle")), store);
    let handled = Router::new()
        .route(
            "/",
            get(|State(limiter): State<RateLimiter>| async move {
                let admitted: Admitted = limiter.check("alice").await?;
                Ok::<_, Refused>((admitted, "hello"))
            }),
        )
        .with_state(handle);
    for _ in 0..3 {
        let by_layer = parts_of(send(&layered, request_from(PEER, "/")).await).await;
        let by_handle = parts_of(send(&handled, request_from(PEER, "/")).await).await;
        assert_eq!(by_handle, by_layer);
    }
}

#[tokio::test]
async fn a_refusal_is_the_layers_byte_for_byte_in_memory() {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryStore::builder().clock(clock).build();
    a_refusal_is_the_layers_byte_for_byte(store, "rl").await;
}

#[tokio::test]
async fn a_refusal_is_the_layers_byte_for_byte_on_redis() {
    let redis = TestRedis::shared();
    let store = redis_store(&redis);
    // Both doors at one fixed time (an hour ahead of Redis's clock), on keys no earlier run
    // used: the headers count down from the same instant.
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    store.fix_time_for_tests(Some(now_us + 3_600_000_000));
    a_refusal_is_the_layers_byte_for_byte(store, &unique_prefix("bytes")).await;
}

#[tokio::test]
async fn a_refused_check_answers_429_with_its_wait() {
    let limiter = RateLimiter::new(otp("rl"), MemoryStore::new());
    for _ in 0..5 {
        let admitted = limiter.check("bob").await.unwrap();
        assert!(admitted.decision().unwrap().allowed);
    }
    let refused = limiter.check("bob").await.unwrap_err();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let wait = refused.retry_after().unwrap();
    assert!(wait > Duration::from_secs(3_590), "{wait:?}");
    assert_eq!(
        refused.to_string(),
        "rate limited by policy \"otp\": retry in 3600 s"
    );
    let grpc = refused.grpc_response();
    assert_eq!(grpc.status(), StatusCode::OK);
    assert_eq!(grpc.headers()["grpc-status"], "8");
    let response = refused.into_response();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "3600");
    // A cost no rule could ever admit: 413, not a wait.
    let too_costly = limiter.check_n("carol", 6).await.unwrap_err();
    assert_eq!(too_costly.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(too_costly.retry_after(), None);
    // A reset forgets the counts.
    limiter.reset("bob").await.unwrap();
    assert!(limiter.check("bob").await.is_ok());
}

#[tokio::test]
async fn delay_mode_holds_the_check_until_its_slot() {
    let policy = Policy::builder("spaced")
        .rule(Rule::new(1, Duration::from_millis(300)))
        .mode(Mode::Delay {
            max_delay: Duration::from_secs(1),
        })
        .build()
        .unwrap();
    let limiter = RateLimiter::new(policy, MemoryStore::new());
    let started = std::time::Instant::now();
    limiter.check("job-7").await.unwrap();
    let held = limiter.check("job-7").await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(290));
    assert_eq!(held.decision().unwrap().delay.as_millis().div_ceil(100), 3);
}

/// A store that isn't there: a closed loopback port.
fn unreachable_store() -> RedisStore {
    RedisStore::from_url(&format!("redis://127.0.0.1:{}/0", free_port()))
        .unwrap()
        .timeout(Duration::from_millis(300))
}

#[tokio::test]
async fn a_store_failure_admits_under_allow_and_answers_503_under_deny() {
    let policy = |on_error| {
        Policy::builder("outage")
            .rule(Rule::per_minute(1))
            .on_store_error(on_error)
            .build()
            .unwrap()
    };
    let open = RateLimiter::new(policy(OnStoreError::Allow), unreachable_store());
    for _ in 0..3 {
        let admitted = open.check("dave").await.unwrap();
        assert!(
            admitted.decision().is_none(),
            "no decision: nothing was checked"
        );
        let (_, headers, _) = parts_of((admitted, "ok").into_response()).await;
        assert!(
            !headers
                .iter()
                .any(|(name, _)| name.starts_with("ratelimit"))
        );
    }
    let closed = RateLimiter::new(policy(OnStoreError::Deny), unreachable_store());
    let refused = closed.check("dave").await.unwrap_err();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.retry_after(), None);
    assert_eq!(
        refused.into_response().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn bad_input_is_refused_and_never_shares_a_bucket() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("bad");
    let limiter = RateLimiter::new(otp(&prefix), redis_store(&redis));
    for _ in 0..10 {
        let empty = limiter.check("").await.unwrap_err();
        assert_eq!(empty.status(), StatusCode::BAD_REQUEST);
    }
    let zero = limiter.check_n("erin", 0).await.unwrap_err();
    assert_eq!(zero.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(zero.to_string().contains("cost 0"), "{zero}");
    let mut client = redis.client();
    let keys: Vec<String> = client.keys(format!("{prefix}*")).unwrap();
    assert!(
        keys.is_empty(),
        "an empty identity or a cost of 0 wrote {keys:?}"
    );
    // A long identity is hashed, as a header's value is; an ordinary one is kept.
    let long = "x".repeat(300);
    limiter.check(&long).await.unwrap();
    limiter.check("+15550102").await.unwrap();
    let mut keys: Vec<String> = client.keys(format!("{prefix}*")).unwrap();
    keys.sort();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys.iter().all(|key| !key.contains(&long)), "{keys:?}");
    assert!(keys.iter().any(|key| key.contains("{#")), "{keys:?}");
    assert!(keys.iter().any(|key| key.contains("+15550102")), "{keys:?}");
    assert!(limiter.reset("").await.is_err());
}

/// Redis's count of writes since its last save (none is made: the test servers keep nothing).
fn writes(client: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("persistence").query(client).unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("rdb_changes_since_last_save:"))
        .and_then(|count| count.trim().parse().ok())
        .expect("rdb_changes_since_last_save in INFO persistence")
}

/// Every algorithm, with a guard, a block, a quota and a concurrency limit in turn: a peek writes
/// nothing to Redis (its write count doesn't move), and says what a check would find.
#[tokio::test]
async fn a_peek_writes_nothing_and_finds_what_a_check_would() {
    // A server of our own: no other test's writes are counted.
    let redis = TestRedis::own();
    let mut client = redis.client();
    let store = redis_store(&redis);
    // The first call loads the store's function library, which Redis counts as a write.
    RateLimiter::new(otp("warm"), store.clone())
        .peek("up")
        .await
        .unwrap();
    for algorithm in [
        tower_redis_ratelimit::Algorithm::SlidingLog,
        tower_redis_ratelimit::Algorithm::FixedWindow,
        tower_redis_ratelimit::Algorithm::SlidingCounter,
        tower_redis_ratelimit::Algorithm::TokenBucket,
    ] {
        for extra in 0..4 {
            let prefix = unique_prefix("peek");
            let mut builder = Policy::builder("peek")
                .prefix(&prefix)
                .algorithm(algorithm)
                .rule(Rule::per_hour(3));
            builder = match extra {
                1 => builder.prevent_duplicate(Duration::from_secs(60)),
                2 => builder.block_for(Duration::from_secs(60)),
                3 => builder.max_in_flight(2).lease(Duration::from_secs(60)),
                _ => builder.quota(
                    tower_redis_ratelimit::Quota::builder("daily")
                        .prefix(&prefix)
                        .tier("free", 10)
                        .build()
                        .unwrap(),
                ),
            };
            let limiter = RateLimiter::new(builder.build().unwrap(), store.clone());
            let case = format!("{algorithm}, case {extra}");
            // A fresh identity: admitted, everything left, and no key made.
            let before = writes(&mut client);
            let fresh = limiter.peek("frank").await.unwrap();
            assert!(fresh.allowed, "{case}");
            assert_eq!(fresh.rules[0].remaining, 3, "{case}");
            assert_eq!(writes(&mut client), before, "{case}: a peek wrote");
            let keys: Vec<String> = client.keys(format!("{prefix}*")).unwrap();
            assert!(keys.is_empty(), "{case}: {keys:?}");
            // Used, then refused (and blocked, in case 2): each peek finds what a check does.
            let mut admitted = Vec::new();
            for _ in 0..4 {
                let peeked = limiter.peek("frank").await.unwrap();
                let before = writes(&mut client);
                let _ = limiter.peek("frank").await.unwrap();
                assert_eq!(writes(&mut client), before, "{case}: a peek wrote");
                let checked = limiter.check("frank").await;
                assert_eq!(peeked.allowed, checked.is_ok(), "{case}: {peeked:?}");
                if !peeked.allowed {
                    let refused = checked.unwrap_err();
                    let (peek_wait, check_wait) = (
                        peeked.retry_after().unwrap(),
                        refused.retry_after().unwrap(),
                    );
                    // A refused check starts case 2's block of 60 s, which a peek doesn't: in the
                    // hour's last minute, a fixed window's end comes sooner than the block's.
                    let expected = if extra == 2 {
                        peek_wait.max(Duration::from_secs(60))
                    } else {
                        peek_wait
                    };
                    assert!(
                        expected.abs_diff(check_wait) < Duration::from_secs(1),
                        "{case}: peek {peek_wait:?}, check {check_wait:?}"
                    );
                }
                // (An admission of case 3 holds its slot while it lives: this one is dropped at
                // once, so the rules decide.)
                admitted.push(peeked.allowed);
            }
            // Case 1's guard refuses the second at once; the others admit three.
            let expected = if extra == 1 {
                vec![true, false, false, false]
            } else {
                vec![true, true, true, false]
            };
            assert_eq!(admitted, expected, "{case}");
        }
    }
}

/// Refunds on both stores, every algorithm, at fixed times: units given back within a window
/// admit again; after the window rolls, only what the new window charged comes back (never more
/// than the limit).
async fn refunds_give_back_the_current_window_only(store: impl Store, set_time: impl Fn(u64)) {
    use tower_redis_ratelimit::Algorithm;
    use tower_redis_ratelimit::store::CheckRequest;
    // On a minute boundary, an hour ahead of Redis's own clock (no key expires meanwhile).
    let first_start = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 3_600_000)
        / 60_000
        * 60_000;
    let algorithms = [
        Algorithm::SlidingLog,
        Algorithm::FixedWindow,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ];
    for (index, algorithm) in algorithms.into_iter().enumerate() {
        // Each algorithm later than the last one ended: the memory store's clock never goes
        // back (a shard keeps the latest time it saw).
        let start = first_start + index as u64 * 600_000;
        let key = format!("{}:refund:{algorithm}", unique_prefix("refund"));
        let rules = [Rule::per_minute(3)];
        let request = |cost| CheckRequest::new(&key, &rules, algorithm).cost(cost);
        set_time(start);
        for _ in 0..3 {
            assert!(
                store.check(&request(1)).await.unwrap().allowed,
                "{algorithm}"
            );
        }
        assert!(
            !store.check(&request(1)).await.unwrap().allowed,
            "{algorithm}"
        );
        // Two back: two admitted, then refused again.
        let after = store.refund(&request(2)).await.unwrap();
        assert_eq!(after.rules[0].remaining, 2, "{algorithm}");
        assert!(after.allowed, "{algorithm}: a check would be admitted");
        assert!(
            store.check(&request(1)).await.unwrap().allowed,
            "{algorithm}"
        );
        assert!(
            store.check(&request(1)).await.unwrap().allowed,
            "{algorithm}"
        );
        assert!(
            !store.check(&request(1)).await.unwrap().allowed,
            "{algorithm}"
        );
        // Never below zero: a refund of more than was charged gives back what was.
        let emptied = store.refund(&request(10)).await.unwrap();
        assert_eq!(emptied.rules[0].remaining, 3, "{algorithm}");
        // A minute and more later, the old charges are gone from every window: one check, then
        // a refund of three gives back the one.
        for _ in 0..3 {
            store.check(&request(1)).await.unwrap();
        }
        set_time(start + 120_000);
        assert!(
            store.check(&request(1)).await.unwrap().allowed,
            "{algorithm}"
        );
        let rolled = store.refund(&request(3)).await.unwrap();
        assert_eq!(
            rolled.rules[0].remaining, 3,
            "{algorithm}: nothing past the limit"
        );
        for _ in 0..3 {
            assert!(
                store.check(&request(1)).await.unwrap().allowed,
                "{algorithm}"
            );
        }
        assert!(
            !store.check(&request(1)).await.unwrap().allowed,
            "{algorithm}"
        );
    }
}

#[tokio::test]
async fn refunds_give_back_the_current_window_only_in_memory() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    refunds_give_back_the_current_window_only(store, |ms| clock.set(ms)).await;
}

#[tokio::test]
async fn refunds_give_back_the_current_window_only_on_redis() {
    let redis = TestRedis::shared();
    let store = redis_store(&redis);
    let fixed = store.clone();
    refunds_give_back_the_current_window_only(store, move |ms| {
        fixed.fix_time_for_tests(Some(ms * 1_000));
    })
    .await;
}

#[tokio::test]
async fn an_otp_refused_by_its_prefix_gives_the_numbers_charge_back() {
    let store = MemoryStore::new();
    let number = RateLimiter::new(otp("rl"), store.clone());
    let prefix = RateLimiter::new(
        Policy::builder("otp-prefix")
            .rule(Rule::per_hour(2))
            .build()
            .unwrap(),
        store,
    );
    for phone in ["+1555010001", "+1555010002", "+1555010003"] {
        number.check(phone).await.unwrap();
        if prefix.check(&phone[..8]).await.is_err() {
            let after = number.refund(phone, 1).await.unwrap();
            assert_eq!(after.rules[0].remaining, 5, "{phone}");
        }
    }
    assert_eq!(
        number.peek("+1555010003").await.unwrap().rules[0].remaining,
        5
    );
    assert_eq!(
        number.peek("+1555010002").await.unwrap().rules[0].remaining,
        4
    );
}

fn one_worker_per_user(prefix: &str, lease: Duration) -> Policy {
    Policy::builder("workers")
        .prefix(prefix)
        .max_in_flight(1)
        .lease(lease)
        .build()
        .unwrap()
}

/// A permit holds its slot until it is released, dropped, or (its holder gone without a word)
/// its lease ends; two handles stand for two processes.
async fn permits_are_freed_by_release_drop_and_lease(first: RateLimiter, second: RateLimiter) {
    let permit = first.acquire("user-1").await.unwrap();
    assert!(permit.holds_slot());
    let busy = second.acquire("user-1").await.unwrap_err();
    assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        second.acquire("user-2").await.is_ok(),
        "another user's slot"
    );
    // Released and waited for: free at once, everywhere.
    permit.release().await.unwrap();
    let permit = second.acquire("user-1").await.unwrap();
    // Dropped: freed in the background.
    drop(permit);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let permit = loop {
        match first.acquire("user-1").await {
            Ok(permit) => break permit,
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(refused) => panic!("a dropped permit's slot stayed held: {refused}"),
        }
    };
    // A holder that crashes never releases: its lease ends.
    std::mem::forget(permit);
    assert!(
        second.acquire("user-1").await.is_err(),
        "held until the lease ends"
    );
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(second.acquire("user-1").await.is_ok(), "the lease ended");
}

#[tokio::test]
async fn permits_are_freed_by_release_drop_and_lease_in_memory() {
    let store = MemoryStore::new();
    let policy = one_worker_per_user("rl", Duration::from_millis(400));
    permits_are_freed_by_release_drop_and_lease(
        RateLimiter::new(policy.clone(), store.clone()),
        RateLimiter::new(policy, store),
    )
    .await;
}

#[tokio::test]
async fn permits_are_freed_by_release_drop_and_lease_on_redis() {
    let redis = TestRedis::shared();
    let policy = one_worker_per_user(&unique_prefix("workers"), Duration::from_millis(400));
    permits_are_freed_by_release_drop_and_lease(
        RateLimiter::new(policy.clone(), redis_store(&redis)),
        RateLimiter::new(policy, redis_store(&redis)),
    )
    .await;
}

/// One policy, one bucket: a layer and a handle of a header-keyed policy, given the same value,
/// share their count, on both stores; and no Redis key (nor the top refused) holds the value.
async fn a_layer_and_a_handle_share_a_header_keyed_bucket(store: impl Store + Clone, prefix: &str) {
    let policy = Policy::builder("otp")
        .prefix(prefix)
        .key(Key::header("x-phone"))
        .rule(Rule::per_hour(3))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "sent" }))
        .layer(RateLimitLayer::new(policy.clone(), store.clone()));
    let handle = RateLimiter::new(policy, store);
    let with_phone = || {
        let mut request = request_from(PEER, "/");
        request
            .headers_mut()
            .insert("x-phone", http::HeaderValue::from_static("+15550100"));
        request
    };
    assert_eq!(send(&app, with_phone()).await.status(), StatusCode::OK);
    let admitted = handle.check("+15550100").await.unwrap();
    assert_eq!(admitted.decision().unwrap().rules[0].remaining, 1);
    assert_eq!(send(&app, with_phone()).await.status(), StatusCode::OK);
    assert!(handle.check("+15550100").await.is_err());
    assert_eq!(
        send(&app, with_phone()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another value is another bucket.
    assert!(handle.check("+15550199").await.is_ok());
}

#[tokio::test]
async fn a_layer_and_a_handle_share_a_header_keyed_bucket_in_memory() {
    a_layer_and_a_handle_share_a_header_keyed_bucket(MemoryStore::new(), "rl").await;
}

#[tokio::test]
async fn a_layer_and_a_handle_share_a_header_keyed_bucket_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("one-bucket");
    a_layer_and_a_handle_share_a_header_keyed_bucket(redis_store(&redis), &prefix).await;
    let mut client = redis.client();
    let keys: Vec<String> = client.keys(format!("{prefix}*")).unwrap();
    assert!(!keys.is_empty());
    assert!(
        keys.iter()
            .all(|key| !key.contains("5550100") && !key.contains("5550199")),
        "a phone number in a key: {keys:?}"
    );
}

/// A handle stores each key kind's value as the layer does: a user id as `user:`, an address
/// grouped as the layer groups a client's, one global bucket; a name given to a policy keyed by
/// client IP keeps its own form and is never refused for it.
#[tokio::test]
async fn a_handle_stores_each_kind_as_its_layer_does() {
    let store = MemoryStore::new();
    let by = |name: &str, key: Key| {
        let policy = Policy::builder(name)
            .key(key)
            .rule(Rule::per_hour(2))
            .build()
            .unwrap();
        (
            RateLimiter::new(policy.clone(), store.clone()),
            Router::new()
                .route("/", get(|| async { "ok" }))
                .layer(RateLimitLayer::new(policy, store.clone())),
        )
    };
    // Client IP: an IPv6 address counts by its /64, as the layer counts clients.
    let (handle, app) = by("by-ip", Key::ip());
    handle.check("2001:db8:1:2::7").await.unwrap();
    handle.check("2001:db8:1:2::8").await.unwrap();
    let from_the_same_64 = request_from("[2001:db8:1:2::9]:443", "/");
    assert_eq!(
        send(&app, from_the_same_64).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // A name under a client-IP key: its own bucket, admitted.
    handle.check("alice").await.unwrap();
    // User ids: as the layer stores a UserId.
    let (handle, app) = by("by-user", Key::user());
    handle.check("42").await.unwrap();
    handle.check("42").await.unwrap();
    let mut request = request_from(PEER, "/");
    request
        .extensions_mut()
        .insert(tower_redis_ratelimit::UserId::new("42"));
    assert_eq!(
        send(&app, request).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Global: one bucket whatever the identity.
    let (handle, app) = by("by-global", Key::global());
    handle.check("anything").await.unwrap();
    handle.check("something else").await.unwrap();
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}
