//! One request's cost costs the stores neither work nor memory in proportion to it: a request of
//! millions or billions of units is one sorted-set member of a sliding log, one number of the
//! other algorithms, on Redis and in memory (where 2^32 units once asked for 32 GiB).

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::redis_server::{TestRedis, command_calls, unique_prefix};
use redis::Commands;
use tower_redis_ratelimit::store::CheckRequest;
use tower_redis_ratelimit::{Algorithm, MemoryStore, RedisStore, Rule, Store};

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::SlidingLog,
    Algorithm::FixedWindow,
    Algorithm::SlidingCounter,
    Algorithm::TokenBucket,
];

/// A policy's rules as the outside probe had them: limits far above one request's units.
fn rules() -> [Rule; 2] {
    [Rule::per_hour(100_000_000), Rule::per_day(1 << 35)]
}

/// Checks `costs` in turn on a fresh key; returns the decisions' admissions.
async fn admit(store: &impl Store, key: &str, algorithm: Algorithm, costs: &[u64]) -> Vec<bool> {
    let rules = rules();
    let mut admitted = Vec::new();
    for &cost in costs {
        let request = CheckRequest::new(key, &rules, algorithm).cost(cost);
        admitted.push(store.check(&request).await.unwrap().allowed);
    }
    admitted
}

#[tokio::test]
async fn huge_costs_in_memory_are_counted_without_growing() {
    let store = MemoryStore::new();
    for algorithm in ALGORITHMS {
        let key = format!("huge:{algorithm}");
        // 3 million fits the hourly rule, 2^32 doesn't (it never will: refused at once), then
        // the rest of the hour's 100 million in one request.
        let admitted = admit(&store, &key, algorithm, &[3_000_000, 1 << 32, 97_000_000]).await;
        assert_eq!(admitted, [true, false, true], "{algorithm}");
        let refused = store
            .check(&CheckRequest::new(&key, &rules(), algorithm).cost(1))
            .await
            .unwrap();
        assert!(!refused.allowed, "{algorithm}: the hour's units are used");
        assert_eq!(refused.rules[0].remaining, 0);
    }
    // A log of 2^35 a day takes a request of 2^32 as one admission (it aborted the process).
    let daily = [Rule::per_day(1 << 35)];
    let request = CheckRequest::new("huge:daily", &daily, Algorithm::SlidingLog).cost(1 << 32);
    let decision = store.check(&request).await.unwrap();
    assert!(decision.allowed);
    assert_eq!(decision.rules[0].remaining, (1 << 35) - (1 << 32));
}

/// The commands one check runs on Redis, counted by the server, for requests of `costs`.
async fn commands_of(
    redis: &TestRedis,
    algorithm: Algorithm,
    costs: &[u64],
) -> HashMap<String, u64> {
    let store = RedisStore::from_url(&redis.url)
        .expect("a valid Redis URL")
        .timeout(Duration::from_secs(10));
    let mut client = redis.client();
    // Loads the library first, so its loading isn't counted.
    admit(&store, &unique_prefix("warm"), algorithm, &[1]).await;
    let before = command_calls(&mut client);
    let key = unique_prefix("count");
    admit(&store, &key, algorithm, costs).await;
    let after = command_calls(&mut client);
    after
        .into_iter()
        .map(|(name, calls)| {
            let earlier = before.get(&name).copied().unwrap_or(0);
            (name, calls - earlier)
        })
        // Redis 6.2 extends an expiry (PEXPIRE) only when no earlier check of the same
        // millisecond did (lua/common.lua): a matter of timing, not of cost.
        .filter(|(name, calls)| {
            *calls > 0 && !["info", "client", "pexpire"].contains(&name.as_str())
        })
        .collect()
}

#[tokio::test]
async fn a_huge_cost_costs_redis_the_commands_of_a_cost_of_one() {
    // A server of our own, so no other test's commands are counted.
    let redis = TestRedis::own();
    for algorithm in ALGORITHMS {
        // The same story in both: admitted, refused (more than the hour's limit: never),
        // admitted (the hour is full), refused (until the oldest request leaves).
        let mut small = commands_of(&redis, algorithm, &[1, 100_000_001, 99_999_999, 1]).await;
        let mut huge = commands_of(&redis, algorithm, &[3_000_000, 1 << 32, 97_000_000, 1]).await;
        if algorithm == Algorithm::TokenBucket {
            // A bucket moves its expiry only when its full time passes into a later millisecond
            // (lua/token_bucket.lua): a cost of 1 (36 µs here) may or may not cross one, a matter
            // of timing, not of cost. At most once per check either way.
            for commands in [&mut small, &mut huge] {
                let moved = commands.remove("pexpireat").unwrap_or(0);
                assert!(moved <= 4, "{algorithm}: {moved} PEXPIREAT for 4 checks");
            }
        }
        assert_eq!(huge, small, "{algorithm}");
    }
}

#[tokio::test]
async fn a_huge_cost_is_one_small_key_on_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).expect("a valid Redis URL");
    let mut client = redis.client();
    for algorithm in ALGORITHMS {
        let prefix = unique_prefix("huge");
        let admitted = admit(&store, &prefix, algorithm, &[3_000_000, 97_000_000]).await;
        assert_eq!(admitted, [true, true], "{algorithm}");
        let keys: Vec<String> = client.keys(format!("{prefix}*")).unwrap();
        assert_eq!(keys.len(), 2, "{algorithm}: a key per rule, {keys:?}");
        for key in keys {
            let bytes: u64 = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(&key)
                .query(&mut client)
                .unwrap();
            assert!(bytes < 1_024, "{algorithm}: {key} takes {bytes} bytes");
            if algorithm == Algorithm::SlidingLog {
                let members: u64 = client.zcard(&key).unwrap();
                assert_eq!(
                    members, 2,
                    "{algorithm}: a member per request, not per unit"
                );
            }
            let ttl: i64 = client.pttl(&key).unwrap();
            assert!(ttl > 0, "{key} expires");
        }
    }
}
