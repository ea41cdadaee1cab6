//! Stores whose time a test sets: a memory store on a manual clock and a Redis store fixed at
//! the same times, for cases that run on both across windows.

use std::sync::Arc;

use super::redis_server::{TestRedis, assert_every_key_expires, unique_prefix};
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::{MemoryStore, RedisStore, Store};

/// A store and a way to set its time (Unix ms).
pub struct Timed {
    pub name: &'static str,
    pub store: Arc<dyn Store>,
    set_time: Box<dyn Fn(u64) + Send + Sync>,
    redis: Option<(TestRedis, String)>,
    /// The Redis store, whose background calls a case may wait for.
    redis_store: Option<RedisStore>,
}

impl Timed {
    pub fn at(&self, unix_ms: u64) {
        (self.set_time)(unix_ms);
    }

    /// Waits until the give-backs, settles and releases a response started in the background have
    /// landed, their answers applied (Redis; the memory store's land before the response ends).
    pub async fn until_calls_land(&self) {
        if let Some(store) = &self.redis_store {
            store.until_calls_land_for_tests().await;
        }
    }

    /// Every key the case wrote under its prefix expires (Redis).
    pub fn assert_keys_expire(&self) {
        if let Some((redis, prefix)) = &self.redis {
            assert_every_key_expires(&mut redis.client(), prefix);
        }
    }
}

/// The two stores, at `start` (Unix ms), the Redis one with its own prefix.
pub fn both_stores(test: &str, start: u64) -> Vec<(Timed, String)> {
    let clock = ManualClock::new(start);
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    let redis = TestRedis::shared();
    let redis_store = RedisStore::from_url(&redis.url).expect("a valid Redis URL");
    redis_store.fix_time_for_tests(Some(start * 1_000));
    let fixed = redis_store.clone();
    let landing = redis_store.clone();
    let prefix = unique_prefix(test);
    vec![
        (
            Timed {
                name: "memory",
                store: Arc::new(memory),
                set_time: Box::new(move |ms| clock.set(ms)),
                redis: None,
                redis_store: None,
            },
            "rl".to_owned(),
        ),
        (
            Timed {
                name: "redis",
                store: Arc::new(redis_store),
                set_time: Box::new(move |ms| fixed.fix_time_for_tests(Some(ms * 1_000))),
                redis: Some((redis, prefix.clone())),
                redis_store: Some(landing),
            },
            prefix,
        ),
    ]
}

/// The start of a minute an hour ahead (Unix ms): every window of the cases (4 s, 10 s, 60 s)
/// starts there, and the Redis store's keys expire after the test, not during it.
pub fn a_minute_an_hour_ahead() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    (now + 3_600_000) / 60_000 * 60_000
}
