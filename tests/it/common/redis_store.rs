//! The Redis store on a `TestRedis`, and what the tests read back from that server, given the
//! server rather than a connection to it.

use std::collections::HashMap;
use std::time::Duration;

use tower_redis_ratelimit::store::RedisStore;

use super::redis_server::{self, TestRedis};

/// A store on the test server. Its timeout is far above the default 250 ms: these tests check what
/// Redis answers, and a busy CI machine can stall a first connect and script load for longer than
/// that. The outage tests set their own.
pub fn store(redis: &TestRedis) -> RedisStore {
    RedisStore::from_url(&redis.url)
        .expect("a valid Redis URL")
        .timeout(Duration::from_secs(10))
}

/// Every key under `prefix` has a TTL: none is immortal.
pub fn assert_every_key_expires(redis: &TestRedis, prefix: &str) -> usize {
    redis_server::assert_every_key_expires(&mut redis.client(), prefix)
}

/// The calls per command, from `INFO commandstats`.
pub fn command_calls(redis: &TestRedis) -> HashMap<String, u64> {
    redis_server::command_calls(&mut redis.client())
}
