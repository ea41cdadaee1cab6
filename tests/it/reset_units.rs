//! `reset` reaches units held ahead (`prefetch`) on every instance (issue 46): the memory store's
//! limiters drop theirs inside `reset`; over Redis the reset is published and every instance's
//! subscription drops the key's units within a round trip, another process's included; an
//! instance whose subscription drops forgets every unit it holds.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::recording::Recording;
use common::redis_server::{TestRedis, unique_prefix};

use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, RateLimiter, RedisStore, Rule, Store,
};

/// 300 per 20 s, global, `prefetch(100)`, under `prefix`.
fn hot(prefix: &str) -> Policy {
    Policy::builder("hot")
        .prefix(prefix)
        .key(Key::global())
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::new(300, Duration::from_secs(20)))
        .prefetch(100)
        .build()
        .unwrap()
}

/// Checks until one is refused: how many were admitted.
async fn drain(limiter: &RateLimiter) -> u64 {
    let mut admitted = 0;
    while limiter.check("global").await.is_ok() {
        admitted += 1;
    }
    admitted
}

/// Instance A holds units ahead; `reset` runs elsewhere; a fresh instance and A together are
/// admitted the limit, not the limit and A's units. `listening`: awaited after A's first check
/// (a networked store's subscription to reset notices coming up); `reset` resets, and returns
/// once A has heard of it.
async fn a_reset_reaches_the_units_in_hand<S, L, FL, R, F>(
    store: S,
    prefix: &str,
    listening: L,
    reset: R,
) where
    S: Store + Clone,
    L: FnOnce() -> FL,
    FL: std::future::Future<Output = ()>,
    R: FnOnce() -> F,
    F: std::future::Future<Output = ()>,
{
    let costs = Arc::new(Mutex::new(Vec::new()));
    let a = RateLimiter::new(
        hot(prefix),
        Recording {
            store: store.clone(),
            costs: costs.clone(),
        },
    );
    // The first check registers A for notices; a Redis subscription takes a round trip, and
    // no unit is taken ahead before it is up.
    a.check("global").await.unwrap();
    listening().await;
    for _ in 0..40 {
        a.check("global").await.unwrap();
    }
    let taken: u64 = costs.lock().unwrap().iter().sum();
    assert!(taken > 41, "A holds nothing: {:?}", costs.lock().unwrap());
    reset().await;
    let fresh = RateLimiter::new(hot(prefix), store);
    let by_fresh = drain(&fresh).await;
    let by_a = drain(&a).await;
    assert_eq!(
        by_fresh + by_a,
        300,
        "{by_fresh} + {by_a} admitted after the reset, against 300"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_units_in_hand_in_memory() {
    let store = MemoryStore::new();
    let resetter = RateLimiter::new(hot("rl"), store.clone());
    a_reset_reaches_the_units_in_hand(
        store,
        "rl",
        || async {},
        || async move {
            resetter.reset("global").await.unwrap();
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_units_in_hand_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("reset-units");
    let store = RedisStore::from_url(&redis.url).unwrap();
    let resetter = RateLimiter::new(hot(&prefix), RedisStore::from_url(&redis.url).unwrap());
    a_reset_reaches_the_units_in_hand_on(store, &prefix, resetter).await;
}

/// [`a_reset_reaches_the_units_in_hand`] over the Redis `store`, reset by `resetter`: once A's
/// subscription is up, and until A has heard the notice of its reset.
async fn a_reset_reaches_the_units_in_hand_on(
    store: RedisStore,
    prefix: &str,
    resetter: RateLimiter,
) {
    let (up, heard) = (store.clone(), store.clone());
    a_reset_reaches_the_units_in_hand(
        store,
        prefix,
        || async move { up.until_resets_live_for_tests(true).await },
        || async move {
            resetter.reset("global").await.unwrap();
            // The notice crosses Redis to A's subscription.
            heard.until_reset_heard_for_tests(prefix).await;
        },
    )
    .await;
}

/// The same across two processes: this test binary runs again as the resetting instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_in_another_process_reaches_units_in_hand() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("reset-process");
    let store = RedisStore::from_url(&redis.url).unwrap();
    let url = redis.url.clone();
    let child_prefix = prefix.clone();
    let (up, heard) = (store.clone(), store.clone());
    let heard_prefix = prefix.clone();
    a_reset_reaches_the_units_in_hand(
        store,
        &prefix,
        || async move { up.until_resets_live_for_tests(true).await },
        || async move {
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "reset_units::reset_from_another_process",
                    "--nocapture",
                ])
                .env("RESET_UNITS_URL", url)
                .env("RESET_UNITS_PREFIX", child_prefix)
                .status()
                .unwrap();
            assert!(status.success(), "the resetting process failed");
            heard.until_reset_heard_for_tests(&heard_prefix).await;
        },
    )
    .await;
}

/// The resetting process of the test above (does nothing when run on its own).
#[tokio::test]
async fn reset_from_another_process() {
    let (Ok(url), Ok(prefix)) = (
        std::env::var("RESET_UNITS_URL"),
        std::env::var("RESET_UNITS_PREFIX"),
    ) else {
        return;
    };
    let limiter = RateLimiter::new(hot(&prefix), RedisStore::from_url(&url).unwrap());
    limiter.reset("global").await.unwrap();
}

/// An instance whose subscription drops (Redis kills it) forgets every unit it holds: the
/// notices sent meanwhile are lost. Its next check asks the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_subscription_forgets_the_units_in_hand() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("reset-lost");
    let costs = Arc::new(Mutex::new(Vec::new()));
    let store = RedisStore::from_url(&redis.url).unwrap();
    let a = RateLimiter::new(
        hot(&prefix),
        Recording {
            store: store.clone(),
            costs: costs.clone(),
        },
    );
    a.check("global").await.unwrap();
    store.until_resets_live_for_tests(true).await;
    for _ in 0..40 {
        a.check("global").await.unwrap();
    }
    let asked = costs.lock().unwrap().len();
    // Still in hand: a check spends locally.
    a.check("global").await.unwrap();
    assert_eq!(costs.lock().unwrap().len(), asked, "units were in hand");
    let mut client = redis.client();
    let killed: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query(&mut client)
        .unwrap();
    assert!(killed >= 1, "no subscription to kill");
    // (Waited for by the subscription's own fall, which tells A that notices were lost; it comes
    // back a second later, and tells A again.)
    store.until_resets_live_for_tests(false).await;
    a.check("global").await.unwrap();
    assert_eq!(
        costs.lock().unwrap().get(asked),
        Some(&1),
        "kept spending units after the subscription dropped: {:?}",
        costs.lock().unwrap()
    );
}

/// A store over a pool you built hears resets through the URL it is given: the same reach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_over_your_pool_hears_resets_through_the_url_it_is_given() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("reset-pool");
    let pool = deadpool_redis::Config::from_url(redis.url.clone())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let store = RedisStore::new(pool)
        .reset_notices_from(&redis.url)
        .unwrap();
    let resetter = RateLimiter::new(hot(&prefix), RedisStore::from_url(&redis.url).unwrap());
    a_reset_reaches_the_units_in_hand_on(store, &prefix, resetter).await;
    // Once used (or cloned), the store can't be given a URL any more.
    let used = RedisStore::from_url(&redis.url).unwrap();
    let _clone = used.clone();
    assert!(used.reset_notices_from(&redis.url).is_err());
}
