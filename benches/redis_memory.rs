//! How much Redis memory each algorithm costs: per key, per identity, and per sliding-log entry.
//!
//! Every check goes through [`RedisStore`], as the layer sends it: the policy key
//! `rl:api:user:<n>` with the identity `user:<n>`, which the store turns into
//! `rl:{user:<n>}:api:<algorithm>:<period ms>:<limit>` (and `:<burst>` for a token bucket), one key
//! per rule. Three tables:
//!
//! 1. **Per key**: a one-rule policy (100 per day), one admitted request per identity, so Redis
//!    holds one key per identity; the sliding log also with 10 requests.
//! 2. **Per identity**: the two-rule policy of issue 28 (100 per minute and 1 000 per hour), each
//!    identity making N admitted requests, N = 1, 10, 50, 100 (100 is the most the minute rule
//!    admits at once), under each algorithm.
//! 3. **Per sliding-log entry**: one rule (1 000 per hour) and N = 1, 128, 129, 1 000 requests per
//!    identity. Redis keeps a sorted set of up to 128 members (`zset-max-listpack-entries`) as one
//!    compact listpack (a ziplist on 6.2) and a larger one as a skiplist and a hash table, so a log costs less per
//!    entry up to 128 entries than past them. These figures are the constants behind the warning
//!    `PolicyBuilder::build` logs for a policy with large sliding logs (`src/policy/footprint.rs`).
//!
//! Two measures per row:
//!
//! - `used_memory`: the growth of `INFO memory`'s `used_memory` over the fill, divided by the
//!   number of identities (or keys). Everything they cost the server: the key names, the values,
//!   the keyspace's two hash tables (keys and expiries), allocator rounding. Each row fills
//!   3 · 2^k keys (at most 24 576, fewer when that would take over 200 000 checks), so both tables
//!   end three quarters full and every row pays the same share of them (about 11 bytes per key and
//!   table).
//! - `MEMORY USAGE`: the sum of `MEMORY USAGE <key> SAMPLES 0` over an identity's keys, averaged
//!   over a few identities each measured right after its requests: the keys' own names, objects
//!   and values, without the hash-table slots.
//!
//! Keys expire (a token bucket's as soon as it is full again: 0.6 s after one request to a
//! 100-per-minute rule), and the measure is what an identity costs while its keys live. So on the
//! private server active expiry is paused during each fill (`DEBUG SET-ACTIVE-EXPIRE 0`) and nothing
//! reads a key after its identity's requests; every row then checks the key count.
//!
//! The bench starts a private `redis-server` (no persistence; `REDIS_SERVER` names another binary,
//! such as a Redis 6.2) on a free loopback port and kills it at the end, flushing it between rows.
//! Without a `redis-server` it uses `REDIS_URL` instead and deletes only its own keys; its numbers
//! are then noisier (others may be using that Redis, and keys that expire during a fill are missing
//! from it).
//!
//! Run with (about two and a half minutes on two shared cores):
//!
//! ```text
//! cargo bench --bench redis_memory
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use tower_redis_ratelimit::store::CheckRequest;
use tower_redis_ratelimit::{Algorithm, RedisStore, Rule, Store};

#[path = "support/redis_server.rs"]
mod redis_server;

use redis_server::Server;

/// The most keys a row fills: 3/4 of 2^15.
const MAX_KEYS: usize = 24_576;

/// The most checks a row sends, to keep the run short.
const CHECK_BUDGET: usize = 200_000;

/// Identities measured with `MEMORY USAGE` per row.
const PROBES: usize = 16;

/// Checks in flight at once.
const CONCURRENCY: usize = 64;

/// The policy name in every key.
const POLICY: &str = "api";

/// The four algorithms, in the tables' order.
const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::FixedWindow,
    Algorithm::TokenBucket,
];

/// One row: a policy's rules and algorithm, how many requests each identity makes, and how many
/// identities make them.
struct Case {
    rules: Arc<[Rule]>,
    algorithm: Algorithm,
    requests: usize,
    identities: usize,
}

impl Case {
    /// A row with the most identities (3 · 2^k keys, at most [`MAX_KEYS`]) whose checks fit
    /// [`CHECK_BUDGET`].
    fn new(rules: &[Rule], algorithm: Algorithm, requests: usize) -> Case {
        let mut keys = MAX_KEYS;
        while keys > 3 && keys / rules.len() * requests > CHECK_BUDGET {
            keys /= 2;
        }
        Case {
            rules: Arc::from(rules),
            algorithm,
            requests,
            identities: keys / rules.len(),
        }
    }

    fn keys(&self) -> usize {
        self.identities * self.rules.len()
    }
}

/// What one row measured.
struct Measured {
    used_memory_per_identity: f64,
    memory_usage_per_identity: f64,
    /// The probed identity's keys' encodings, in rule order, joined by `+`.
    encoding: String,
    /// One key of a probed identity.
    example_key: String,
    seconds: f64,
}

/// A connection of our own for `INFO`, `SCAN`, `MEMORY USAGE` and cleaning up; waits up to 5 s for
/// a server that is still starting.
async fn connect(url: &str) -> MultiplexedConnection {
    let client = redis::Client::open(url).expect("a valid Redis URL");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match client.get_multiplexed_async_connection().await {
            Ok(mut connection) => {
                let pong: redis::RedisResult<String> =
                    redis::cmd("PING").query_async(&mut connection).await;
                if pong.is_ok() {
                    return connection;
                }
            }
            Err(error) if Instant::now() >= deadline => {
                panic!("no Redis answered at {url}: {error}")
            }
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `used_memory` from `INFO memory`, once the keyspace's hash tables have finished growing (Redis
/// moves entries to a grown table a step at a time; until then it holds both).
async fn used_memory(connection: &mut MultiplexedConnection) -> i64 {
    tokio::time::sleep(Duration::from_millis(500)).await;
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(connection)
        .await
        .expect("INFO memory");
    info.lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|value| value.trim().parse().ok())
        .expect("used_memory in INFO memory")
}

/// Pauses (or resumes) active expiry on a private server; `false` when it can't.
async fn active_expiry(server: &Server, connection: &mut MultiplexedConnection, on: bool) -> bool {
    if !server.is_private() {
        return false;
    }
    let reply: redis::RedisResult<String> = redis::cmd("DEBUG")
        .arg("SET-ACTIVE-EXPIRE")
        .arg(u8::from(on))
        .query_async(connection)
        .await;
    reply.is_ok()
}

/// Every key under `prefix`.
async fn keys_under(connection: &mut MultiplexedConnection, prefix: &str) -> Vec<String> {
    let pattern = format!("{prefix}:*");
    let mut cursor = 0_u64;
    let mut keys = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1_000)
            .query_async(connection)
            .await
            .expect("SCAN");
        keys.extend(batch);
        cursor = next;
        if cursor == 0 {
            return keys;
        }
    }
}

/// The number of keys under `prefix`: `DBSIZE` on a private server (which counts keys that have
/// expired but were not removed yet, as `used_memory` does), else a `SCAN`.
async fn key_count(server: &Server, connection: &mut MultiplexedConnection, prefix: &str) -> usize {
    if server.is_private() {
        redis::cmd("DBSIZE")
            .query_async(connection)
            .await
            .expect("DBSIZE")
    } else {
        keys_under(connection, prefix).await.len()
    }
}

/// Removes what a row left: everything on a private server, else only the keys under `prefix`.
async fn clean(server: &Server, connection: &mut MultiplexedConnection, prefix: &str) {
    if server.is_private() {
        let _: String = redis::cmd("FLUSHALL")
            .arg("SYNC")
            .query_async(connection)
            .await
            .expect("FLUSHALL");
        return;
    }
    for chunk in keys_under(connection, prefix).await.chunks(1_000) {
        let _: i64 = redis::cmd("DEL")
            .arg(chunk)
            .query_async(connection)
            .await
            .expect("DEL");
    }
}

/// Sends `case.requests` admitted requests for identity `identity`, one after the other.
async fn requests_of(store: &RedisStore, prefix: &str, case: &Case, identity: usize) {
    let key = format!("{prefix}:{POLICY}:user:{identity}");
    let identity_at = prefix.len() + POLICY.len() + 2;
    for _ in 0..case.requests {
        let request =
            CheckRequest::new(&key, &case.rules, case.algorithm).identity(&key[identity_at..]);
        let decision = store
            .check(&request)
            .await
            .unwrap_or_else(|error| panic!("{key}: {error}"));
        assert!(decision.allowed, "{key}: refused");
    }
}

/// Sends the requests of `identities` under `prefix`, with [`CONCURRENCY`] checks in flight.
async fn fill(
    store: &RedisStore,
    prefix: &str,
    case: &Arc<Case>,
    identities: std::ops::Range<usize>,
) {
    let prefix: Arc<str> = Arc::from(prefix);
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|worker| {
            let (store, prefix, case, identities) = (
                store.clone(),
                prefix.clone(),
                case.clone(),
                identities.clone(),
            );
            tokio::spawn(async move {
                let first = identities.start + worker;
                for identity in (first..identities.end).step_by(CONCURRENCY) {
                    requests_of(&store, &prefix, &case, identity).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("a worker panicked");
    }
}

/// `MEMORY USAGE` summed over the keys of [`PROBES`] identities, each read right after its
/// requests, on a keyspace that holds nothing else of ours; the encodings and one key of the last.
async fn probe(
    server: &Server,
    store: &RedisStore,
    connection: &mut MultiplexedConnection,
    prefix: &str,
    case: &Case,
) -> (f64, String, String) {
    let mut total = 0_i64;
    let (mut encoding, mut example_key) = (String::new(), String::new());
    for identity in 0..PROBES {
        requests_of(store, prefix, case, identity).await;
        let mut keys = keys_under(connection, prefix).await;
        keys.sort_by_key(|key| rule_position(key, &case.rules));
        assert_eq!(keys.len(), case.rules.len(), "one key per rule expected");
        let mut encodings = Vec::new();
        for key in &keys {
            let bytes: i64 = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(key)
                .arg("SAMPLES")
                .arg(0)
                .query_async(connection)
                .await
                .expect("MEMORY USAGE");
            total += bytes;
            let kind: String = redis::cmd("OBJECT")
                .arg("ENCODING")
                .arg(key)
                .query_async(connection)
                .await
                .expect("OBJECT ENCODING");
            encodings.push(kind);
        }
        encoding = encodings.join("+");
        example_key = keys.swap_remove(0);
        clean(server, connection, prefix).await;
    }
    (total as f64 / PROBES as f64, encoding, example_key)
}

/// The index of the rule whose period and limit `key` names (`…:<period ms>:<limit>[:<burst>]`).
fn rule_position(key: &str, rules: &[Rule]) -> usize {
    rules
        .iter()
        .position(|rule| key.contains(&format!(":{}:{}", rule.period_ms(), rule.limit())))
        .unwrap_or(usize::MAX)
}

async fn measure(
    server: &Server,
    store: &RedisStore,
    connection: &mut MultiplexedConnection,
    case: Case,
) -> Measured {
    let case = Arc::new(case);
    // A short prefix like a real one; on a shared Redis, one that is this run's own.
    let prefix = if server.is_private() {
        "rl".to_owned()
    } else {
        format!("rl{}", std::process::id())
    };
    // Load the script and open the store's connections, then start clean.
    fill(store, &prefix, &case, 0..CONCURRENCY).await;
    clean(server, connection, &prefix).await;
    let (memory_usage_per_identity, encoding, example_key) =
        probe(server, store, connection, &prefix, &case).await;

    let paused = active_expiry(server, connection, false).await;
    let before = used_memory(connection).await;
    let started = Instant::now();
    fill(store, &prefix, &case, 0..case.identities).await;
    let seconds = started.elapsed().as_secs_f64();
    let after = used_memory(connection).await;
    let keys = key_count(server, connection, &prefix).await;
    if paused {
        active_expiry(server, connection, true).await;
    }
    assert_eq!(
        keys,
        case.keys(),
        "{} after {} requests: one key per identity and rule expected (did some expire?)",
        case.algorithm,
        case.requests
    );
    clean(server, connection, &prefix).await;
    Measured {
        used_memory_per_identity: (after - before) as f64 / case.identities as f64,
        memory_usage_per_identity,
        encoding,
        example_key,
        seconds,
    }
}

fn main() {
    let server = Server::private()
        .or_else(Server::shared)
        .expect("no redis-server on the PATH and no REDIS_URL");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let mut connection = connect(&server.url).await;
        let version: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut connection)
            .await
            .expect("INFO server");
        let version = version
            .lines()
            .find_map(|line| line.strip_prefix("redis_version:"))
            .unwrap_or("?")
            .trim()
            .to_owned();
        let store = RedisStore::from_url(&server.url)
            .expect("a valid Redis URL")
            .timeout(Duration::from_secs(5));
        let expiry = if active_expiry(&server, &mut connection, true).await {
            "private server, active expiry paused during fills"
        } else if server.is_private() {
            "private server, active expiry NOT paused (DEBUG refused): short-lived keys may be missing"
        } else {
            "REDIS_URL, shared: noisy, and short-lived keys may be missing"
        };
        println!("Redis {version} ({expiry}); MEMORY USAGE averaged over {PROBES} identities\n");
        let started = Instant::now();

        println!("## Per key: one rule (100 per day)\n");
        println!(
            "| algorithm | requests per key | keys | used_memory / key (B) | MEMORY USAGE / key (B) | encoding | key name (B) | fill time |"
        );
        println!("|---|---:|---:|---:|---:|---|---:|---:|");
        let per_key = [
            (Algorithm::FixedWindow, 1),
            (Algorithm::SlidingLog, 1),
            (Algorithm::SlidingLog, 10),
            (Algorithm::SlidingCounter, 1),
            (Algorithm::TokenBucket, 1),
        ];
        let mut examples = Vec::new();
        for (algorithm, requests) in per_key {
            let case = Case::new(&[Rule::per_day(100)], algorithm, requests);
            let keys = case.keys();
            let measured = measure(&server, &store, &mut connection, case).await;
            println!(
                "| {algorithm} | {requests} | {keys} | {:.1} | {:.1} | {} | {} | {:.1} s |",
                measured.used_memory_per_identity,
                measured.memory_usage_per_identity,
                measured.encoding,
                measured.example_key.len(),
                measured.seconds
            );
            examples.push(measured.example_key);
        }

        println!("\n## Per identity: two rules (100 per minute, 1000 per hour)\n");
        println!(
            "| algorithm | requests per identity | identities | used_memory / identity (B) | MEMORY USAGE / identity (B) | encodings | fill time |"
        );
        println!("|---|---:|---:|---:|---:|---|---:|");
        let two_rules = [Rule::per_minute(100), Rule::per_hour(1_000)];
        for algorithm in ALGORITHMS {
            for requests in [1, 10, 50, 100] {
                let case = Case::new(&two_rules, algorithm, requests);
                let identities = case.identities;
                let measured = measure(&server, &store, &mut connection, case).await;
                println!(
                    "| {algorithm} | {requests} | {identities} | {:.0} | {:.0} | {} | {:.1} s |",
                    measured.used_memory_per_identity,
                    measured.memory_usage_per_identity,
                    measured.encoding,
                    measured.seconds
                );
                if requests == 1 {
                    examples.push(measured.example_key);
                }
            }
        }

        println!("\n## Per sliding-log entry: one rule (1000 per hour)\n");
        println!(
            "| requests per identity | identities | used_memory / identity (B) | growth since the row above (B) | MEMORY USAGE / identity (B) | encoding | fill time |"
        );
        println!("|---:|---:|---:|---:|---:|---|---:|");
        let mut last: Option<(usize, f64, String)> = None;
        for requests in [1, 128, 129, 1_000] {
            let case = Case::new(&[Rule::per_hour(1_000)], Algorithm::SlidingLog, requests);
            let identities = case.identities;
            let measured = measure(&server, &store, &mut connection, case).await;
            let bytes = measured.used_memory_per_identity;
            let growth = match &last {
                None => String::new(),
                Some((_, previous, encoding)) if *encoding != measured.encoding => {
                    format!("{encoding} to {}: {:+.0} at once", measured.encoding, bytes - previous)
                }
                Some((entries, previous, _)) => {
                    format!("{:.1} per entry", (bytes - previous) / (requests - entries) as f64)
                }
            };
            println!(
                "| {requests} | {identities} | {bytes:.0} | {growth} | {:.0} | {} | {:.1} s |",
                measured.memory_usage_per_identity, measured.encoding, measured.seconds
            );
            last = Some((requests, bytes, measured.encoding));
        }

        println!("\nExample keys:");
        for key in examples {
            println!("- `{key}`");
        }
        println!("\nTotal time: {:.0} s", started.elapsed().as_secs_f64());
    });
}
