//! The Redis store: many app instances share one limit.
//!
//! Every rule of a request goes to one `EVALSHA` of one script from `lua/`, which reads the time
//! with Redis `TIME`, checks every rule, and records the request in all of them only if all admit
//! it, setting each key's expiry in the same call. So a request costs one round trip whatever the
//! number of rules, app servers' clocks don't matter, and no key outlives its window.
//!
//! Connections: the store checks one connection out of the `deadpool_redis::Pool` and shares it as
//! a multiplexed connection (requests are pipelined on it). It goes back to the pool only when that
//! connection fails or a request times out, so no request pays for the pool's per-checkout health
//! check (a `PING`, a second round trip).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ::redis::{RedisError, Script};
use deadpool_redis::redis::aio::MultiplexedConnection;
use deadpool_redis::{Config, Pool, Runtime};

use super::{CheckFuture, CheckRequest, Store, StoreError};
use crate::decision::{Decision, RuleState};
use crate::policy::Algorithm;

/// How long a check may take by default before it counts as a store failure.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// A [`Store`] in Redis. Cheap to clone; clones share the connection.
///
/// ```no_run
/// use tower_redis_ratelimit::{Policy, RateLimitLayer, Rule};
/// use tower_redis_ratelimit::store::RedisStore;
///
/// let store = RedisStore::from_url("redis://127.0.0.1:6379/0")?;
/// let policy = Policy::builder("api").rule(Rule::per_minute(20)).build()?;
/// let layer = RateLimitLayer::new(policy, store);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct RedisStore {
    shared: Arc<Shared>,
    timeout: Duration,
}

struct Shared {
    pool: Pool,
    /// The shared connection; `None` until the first request and after a failure.
    connection: Mutex<Option<MultiplexedConnection>>,
    /// Held while a new connection is fetched, so a reconnect storm asks the pool once.
    reconnecting: tokio::sync::Mutex<()>,
    fixed_window: Script,
    sliding_log: Script,
}

impl RedisStore {
    /// A store over `pool`, with the default timeout of 250 ms.
    pub fn new(pool: Pool) -> Self {
        RedisStore {
            shared: Arc::new(Shared {
                pool,
                connection: Mutex::new(None),
                reconnecting: tokio::sync::Mutex::new(()),
                fixed_window: Script::new(include_str!("../../lua/fixed_window.lua")),
                sliding_log: Script::new(include_str!("../../lua/sliding_log.lua")),
            }),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// A store with a pool of its own for `url` (`redis://host:port/db`). Nothing connects yet: a
    /// Redis that is down makes requests fail open or closed, not this call.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        let pool = Config::from_url(url)
            .create_pool(Some(Runtime::Tokio1))
            .map_err(|error| StoreError::Unavailable(Box::new(error)))?;
        Ok(RedisStore::new(pool))
    }

    /// How long a check may take, connecting included, before it is a [`StoreError::Timeout`]
    /// (default 250 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The configured timeout.
    pub fn timeout_duration(&self) -> Duration {
        self.timeout
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Store for RedisStore {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        let keys = rule_keys(request);
        let mut args = Vec::with_capacity(1 + 2 * request.rules.len());
        args.push(request.cost);
        for rule in request.rules {
            args.push(rule.limit());
            args.push(rule.period_ms());
        }
        let algorithm = request.algorithm;
        let shared = self.shared.clone();
        let timeout = self.timeout;
        CheckFuture::from_future(async move {
            match tokio::time::timeout(timeout, shared.evaluate(algorithm, &keys, &args)).await {
                Ok(result) => result,
                Err(_elapsed) => {
                    // A connection that stopped answering without an error (a silently dropped
                    // TCP connection) would time out forever: the next request takes a new one.
                    shared.forget_connection();
                    Err(StoreError::Timeout(timeout))
                }
            }
        })
    }
}

/// The keys of a request's rules:
/// `<prefix>:{<prefix>:<policy>:<identity>}:<algorithm>:<period ms>:<limit>`. Every key starts with
/// the prefix, so `SCAN MATCH <prefix>:*` finds them all; the braces make the whole policy key the
/// hash tag, so every key of one identity lands on one Redis Cluster slot; a counter per algorithm,
/// period and limit gives every rule of a policy its own key (a policy can't hold the same rule
/// twice) and keeps rule sets that share a key apart, as in the memory store.
fn rule_keys(request: &CheckRequest<'_>) -> Vec<String> {
    let code = match request.algorithm {
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingLog => "sl",
    };
    // A prefix can't contain ':' (policies refuse it), so the key's first part is the prefix.
    let prefix = request
        .key
        .split_once(':')
        .map_or(request.key, |(prefix, _)| prefix);
    request
        .rules
        .iter()
        .map(|rule| {
            format!(
                "{prefix}:{{{}}}:{code}:{}:{}",
                request.key,
                rule.period_ms(),
                rule.limit()
            )
        })
        .collect()
}

impl Shared {
    async fn evaluate(
        &self,
        algorithm: Algorithm,
        keys: &[String],
        args: &[u64],
    ) -> Result<Decision, StoreError> {
        let script = match algorithm {
            Algorithm::FixedWindow => &self.fixed_window,
            Algorithm::SlidingLog => &self.sliding_log,
        };
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let mut connection = self.connection().await?;
        // EVALSHA; on NOSCRIPT (a restart, SCRIPT FLUSH, a failover) it loads the script and
        // retries once, within this request.
        match invocation.invoke_async::<Vec<i64>>(&mut connection).await {
            Ok(reply) => {
                let limits: Vec<u64> = args[1..].iter().step_by(2).copied().collect();
                decision_from(&reply, &limits)
            }
            Err(error) => {
                if is_connection_failure(&error) {
                    self.forget_connection();
                }
                Err(StoreError::Unavailable(Box::new(error)))
            }
        }
    }

    async fn connection(&self) -> Result<MultiplexedConnection, StoreError> {
        if let Some(connection) = self.cached() {
            return Ok(connection);
        }
        let _only_one = self.reconnecting.lock().await;
        if let Some(connection) = self.cached() {
            return Ok(connection);
        }
        let pooled = self
            .pool
            .get()
            .await
            .map_err(|error| StoreError::Unavailable(Box::new(error)))?;
        let connection = deadpool_redis::Connection::take(pooled);
        *self.lock_connection() = Some(connection.clone());
        Ok(connection)
    }

    fn cached(&self) -> Option<MultiplexedConnection> {
        self.lock_connection().clone()
    }

    fn forget_connection(&self) {
        *self.lock_connection() = None;
    }

    fn lock_connection(&self) -> std::sync::MutexGuard<'_, Option<MultiplexedConnection>> {
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Whether the connection itself is broken (so the next request should get a new one), as opposed
/// to an error answer on a healthy connection.
fn is_connection_failure(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_unrecoverable_error()
}

/// Reads the script's reply: `allowed, now, then remaining, reset, retry per rule`.
fn decision_from(reply: &[i64], limits: &[u64]) -> Result<Decision, StoreError> {
    let malformed = || StoreError::Protocol(format!("unexpected script reply {reply:?}"));
    if reply.len() != 2 + 3 * limits.len() {
        return Err(malformed());
    }
    let unsigned = |value: i64| u64::try_from(value).map_err(|_| malformed());
    let allowed = match reply[0] {
        1 => true,
        0 => false,
        _ => return Err(malformed()),
    };
    let now_unix_ms = unsigned(reply[1])?;
    let rules = reply[2..]
        .chunks_exact(3)
        .zip(limits)
        .map(|(state, &limit)| {
            Ok(RuleState {
                limit,
                remaining: unsigned(state[0])?,
                reset: Duration::from_millis(unsigned(state[1])?),
                retry_after: match state[2] {
                    -1 => None,
                    retry => Some(Duration::from_millis(unsigned(retry)?)),
                },
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(Decision {
        allowed,
        rules,
        now_unix_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Rule;

    #[test]
    fn keys_share_the_identity_hash_tag_and_name_algorithm_and_period() {
        let rules = [Rule::per_minute(10), Rule::per_hour(100)];
        let request = CheckRequest {
            key: "rl:login:ip:2001:db8::/64",
            rules: &rules,
            algorithm: Algorithm::SlidingLog,
            cost: 1,
        };
        assert_eq!(
            rule_keys(&request),
            [
                "rl:{rl:login:ip:2001:db8::/64}:sl:60000:10",
                "rl:{rl:login:ip:2001:db8::/64}:sl:3600000:100"
            ]
        );
    }

    #[test]
    fn replies_become_decisions() {
        let decision = decision_from(&[0, 1_000, 0, 500, 500, 7, 90_000, -1], &[5, 10]).unwrap();
        assert!(!decision.allowed);
        assert_eq!(decision.now_unix_ms, 1_000);
        assert_eq!(
            decision.rules,
            [
                RuleState {
                    limit: 5,
                    remaining: 0,
                    reset: Duration::from_millis(500),
                    retry_after: Some(Duration::from_millis(500)),
                },
                RuleState {
                    limit: 10,
                    remaining: 7,
                    reset: Duration::from_secs(90),
                    retry_after: None,
                },
            ]
        );
    }

    #[test]
    fn malformed_replies_are_protocol_errors() {
        for reply in [
            &[1, 1_000][..],
            &[1, 1_000, 1, 2],
            &[2, 1_000, 1, 2, -1],
            &[1, -5, 1, 2, -1],
            &[0, 1_000, -1, 2, -1],
            &[0, 1_000, 1, 2, -7],
        ] {
            assert!(
                matches!(decision_from(reply, &[5]), Err(StoreError::Protocol(_))),
                "{reply:?}"
            );
        }
    }
}
