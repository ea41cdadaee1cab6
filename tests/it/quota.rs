//! The daily quota, on both stores: racing requests, spread over instances, get exactly the day's
//! limit and fire each alert once; a penalty block hides neither a used-up quota nor the alerts an
//! overdraw during it fires. On Redis in Redis's time: the count starts over at midnight, and a
//! quota used every day keeps two days' counts.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::redis_server::{TestRedis, unique_prefix};
use common::redis_store::{assert_every_key_expires, store};
use redis::Commands;
use tower_redis_ratelimit::quota::QuotaThreshold;
use tower_redis_ratelimit::store::{CheckRequest, QuotaRequest};
use tower_redis_ratelimit::{Algorithm, MemoryStore, Rule, Store};

/// A daily quota used every day keeps two days' counts (the day's and the last one's, for a clock
/// that steps back), however many days' counts its hash held (an earlier version kept one per
/// day): the day's first charge clears the older ones, and leaves the alerts' flags.
#[tokio::test]
async fn a_quota_used_every_day_keeps_two_days_counts() {
    const DAY: u64 = 86_400_000;
    let redis = TestRedis::shared();
    let store = store(&redis);
    let mut client = redis.client();
    let prefix = unique_prefix("quotadays");
    let (secs, _): (u64, u64) = redis::cmd("TIME").query(&mut client).unwrap();
    let today = secs * 1_000 / DAY * DAY;
    let quota_key = format!("{prefix}:{{user:ann}}:daily:q:86400000:0");
    let _: () = redis::pipe()
        .hset(&quota_key, (today - 5 * DAY).to_string(), 7)
        .hset(&quota_key, (today - 3 * DAY).to_string(), 2)
        .hset(&quota_key, (today - DAY).to_string(), 3)
        .hset(&quota_key, "a80", (today - DAY).to_string())
        .pexpire(&quota_key, 60_000)
        .query(&mut client)
        .unwrap();
    store.fix_time_for_tests(Some((today + 1_000) * 1_000));
    let rules = [Rule::per_minute(5)];
    let daily = format!("{prefix}:daily:user:ann");
    let policy_key = format!("{prefix}:p:user:ann");
    let quota = QuotaRequest::new(&daily, 100, DAY, 0, &[]).identity("user:ann");
    let decision = store
        .check(
            &CheckRequest::new(&policy_key, &rules, Algorithm::FixedWindow)
                .identity("user:ann")
                .quota(Some(quota)),
        )
        .await
        .unwrap();
    store.fix_time_for_tests(None);
    assert!(decision.allowed);
    let fields: HashMap<String, String> = client.hgetall(&quota_key).unwrap();
    let wanted: HashMap<String, String> = [
        ((today - DAY).to_string(), "3".to_owned()),
        (today.to_string(), "1".to_owned()),
        ("a80".to_owned(), (today - DAY).to_string()),
    ]
    .into_iter()
    .collect();
    assert_eq!(fields, wanted);
    assert_every_key_expires(&redis, &prefix);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_race_in_memory_admits_the_limit_and_alerts_once() {
    let store: std::sync::Arc<dyn tower_redis_ratelimit::Store> =
        std::sync::Arc::new(MemoryStore::new());
    common::a_quota_race_admits_the_limit_and_alerts_once(vec![store], "race").await;
}

/// The quota race on two stores with pools of their own (two app instances) sharing one Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_race_over_two_instances_admits_the_limit_and_alerts_once() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("race");
    let stores: Vec<Arc<dyn Store>> = vec![Arc::new(store(&redis)), Arc::new(store(&redis))];
    common::a_quota_race_admits_the_limit_and_alerts_once(stores, &prefix).await;
    // The count expires with its day, and the alert flags with it: they are fields of the
    // day's hash, each holding the day it fired for.
    let mut client = redis.client();
    let quota_key = format!("{prefix}:{{user:free-user}}:daily:q:86400000:0");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&quota_key)
        .query(&mut client)
        .unwrap();
    assert!(ttl > 0 && ttl <= 86_400_000, "{quota_key}: PTTL {ttl}");
    let fields: std::collections::BTreeMap<String, i64> = redis::cmd("HGETALL")
        .arg(&quota_key)
        .query(&mut client)
        .unwrap();
    let days: Vec<&String> = fields
        .keys()
        .filter(|field| !field.starts_with('a'))
        .collect();
    assert_eq!(days.len(), 1, "one day counted: {fields:?}");
    let day_start: i64 = days[0].parse().unwrap();
    assert_eq!(fields[days[0]], 100, "{fields:?}");
    assert_eq!(
        (fields.get("a80"), fields.get("a100")),
        (Some(&day_start), Some(&day_start)),
        "each flag holds the day it fired for: {fields:?}"
    );
    assert_every_key_expires(&redis, &prefix);
}

/// During a penalty block a used-up quota still says it is out until midnight, as in memory.
#[tokio::test]
async fn a_block_on_redis_does_not_hide_a_used_up_quota() {
    let redis = TestRedis::shared();
    let store = store(&redis);
    let prefix = unique_prefix("blockquota");
    let rules = [Rule::per_minute(10)];
    let quota_key = format!("{prefix}:daily:user:ida");
    let key = format!("{prefix}:p:user:ida");
    let quota = QuotaRequest::new(&quota_key, 1, 86_400_000, 0, &[]).identity("user:ida");
    let request = CheckRequest::new(&key, &rules, Algorithm::SlidingLog)
        .identity("user:ida")
        .block_for(Some(Duration::from_secs(10)))
        .quota(Some(quota));
    assert!(store.check(&request).await.unwrap().allowed);
    let refused = store.check(&request).await.unwrap();
    let blocked = store.check(&request).await.unwrap();
    let to_midnight = |decision: &tower_redis_ratelimit::Decision| {
        Duration::from_millis(86_400_000 - decision.now_unix_ms % 86_400_000)
    };
    assert_eq!(refused.retry_after(), Some(to_midnight(&refused)));
    assert_eq!(blocked.retry_after(), Some(to_midnight(&blocked)));
    assert!(blocked.rules[0].retry_after.unwrap() <= Duration::from_secs(10));
    assert_every_key_expires(&redis, &prefix);
}

/// A settle's overdraw during a penalty block still charges the day's quota, and the alerts it
/// fires are in the block's answer, on Redis as in memory.
#[tokio::test]
async fn an_overdraw_during_a_block_fires_its_quota_alerts_on_both_stores() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("blockalerts");
    let rules = [Rule::per_hour(1)];
    let thresholds = [50u8, 100].map(|percent| QuotaThreshold {
        percent,
        used: (u64::from(percent) * 2).div_ceil(100),
    });
    let quota_key = format!("{prefix}:daily:user:ivo");
    let key = format!("{prefix}:p:user:ivo");
    let quota = QuotaRequest::new(&quota_key, 2, 86_400_000, 0, &thresholds);
    let request = CheckRequest::new(&key, &rules, Algorithm::FixedWindow)
        .block_for(Some(Duration::from_secs(3_600)))
        .quota(Some(quota))
        .cost(2);
    let stores: [Box<dyn Store>; 2] = [Box::new(MemoryStore::new()), Box::new(store(&redis))];
    for store in stores {
        // Refused (it costs more than the rule holds), which starts the block.
        assert!(!store.check(&request).await.unwrap().allowed);
        let overdrawn = store.overdraw(&request).await.unwrap();
        assert!(!overdrawn.allowed, "{}: blocked", store.name());
        assert_eq!(overdrawn.quota_alerts, [50, 100], "{}", store.name());
    }
    assert_every_key_expires(&redis, &prefix);
}

/// Crossing midnight on Redis time, with a day shortened to two seconds: the count starts over and
/// the alerts fire again.
#[tokio::test]
async fn a_quota_on_redis_starts_over_at_midnight() {
    let redis = TestRedis::shared();
    let store = store(&redis);
    let prefix = unique_prefix("midnight");
    let rules = [Rule::per_second(1_000)];
    let thresholds = [QuotaThreshold {
        percent: 100,
        used: 3,
    }];
    let quota_key = format!("{prefix}:daily:user:cy");
    let key = format!("{prefix}:api:user:cy");
    let quota = QuotaRequest::new(&quota_key, 3, 2_000, 0, &thresholds);
    let request = CheckRequest::new(&key, &rules, Algorithm::FixedWindow).quota(Some(quota));
    // Start right after a midnight, so one day holds the first four requests.
    let first = store
        .check(&CheckRequest::new(&key, &rules, Algorithm::FixedWindow))
        .await
        .unwrap();
    let to_midnight = 2_000 - first.now_unix_ms % 2_000;
    tokio::time::sleep(Duration::from_millis(to_midnight + 20)).await;
    let mut day = Vec::new();
    for _ in 0..4 {
        day.push(store.check(&request).await.unwrap());
    }
    let day_of = |decision: &tower_redis_ratelimit::Decision| decision.now_unix_ms / 2_000;
    assert!(
        day.iter().all(|d| day_of(d) == day_of(&day[0])),
        "a stall crossed midnight"
    );
    let allowed: Vec<bool> = day.iter().map(|d| d.allowed).collect();
    assert_eq!(allowed, [true, true, true, false]);
    assert_eq!(day[2].quota_alerts, [100]);
    let wait = day[3].retry_after().unwrap();
    assert!(wait <= Duration::from_secs(2));
    tokio::time::sleep(wait + Duration::from_millis(10)).await;
    let next_day = store.check(&request).await.unwrap();
    assert!(next_day.allowed);
    assert_eq!(next_day.rules[1].remaining, 2);
}
