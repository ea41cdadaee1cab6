//! How much Redis memory one key costs under each algorithm.
//!
//! For each algorithm, 100 000 distinct identities each get one admitted request (a one-rule policy,
//! 100 per day) through [`RedisStore`], so Redis holds one key per identity; the sliding log is also
//! run with 10 admitted requests per identity, since its log grows with every admission. Two
//! measures per row:
//!
//! - `used_memory`: the growth of `INFO memory`'s `used_memory` over the run, divided by the number
//!   of keys. Everything a key costs the server: the key name, the value, both hash tables
//!   (keyspace and expires) growing to fit 100 000 entries, allocator rounding.
//! - `MEMORY USAGE`: the average of `MEMORY USAGE <key> SAMPLES 0` over 1 000 keys: the key's own
//!   name, object and value, without the hash-table slots.
//!
//! The rule is 100 per day rather than per hour so no key expires while it is measured: a fixed
//! window's key expires at the end of its epoch-aligned window, a token bucket's once the bucket is
//! full again (one day / 100 = 864 s after the request). The bench still checks the key count after
//! measuring.
//!
//! Keys look like the layer's: the policy key `rl:api:user:<n>` (`n` below 100 000), which the
//! store turns into `rl:{rl:api:user:<n>}:<algorithm>:<period ms>:<limit>` (and `:<burst>` for a
//! token bucket), about 40 bytes. The key name is part of both measures: longer prefixes, policy
//! names or identities cost their length on every key. The table gives the example key's length.
//!
//! The bench starts a private `redis-server` (no persistence) on a free loopback port and kills it
//! at the end, flushing it between algorithms. Without a `redis-server` on the `PATH` it uses
//! `REDIS_URL` instead, and then deletes only its own keys (its numbers are then noisier: others
//! may be using that Redis).
//!
//! Run with:
//!
//! ```text
//! cargo bench --bench redis_memory
//! ```

use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use tower_redis_ratelimit::store::CheckRequest;
use tower_redis_ratelimit::{Algorithm, RedisStore, Rule, Store};

/// Identities, hence keys, per algorithm.
const IDENTITIES: usize = 100_000;

/// Keys whose `MEMORY USAGE` is averaged.
const SAMPLE: usize = 1_000;

/// Checks in flight at once.
const CONCURRENCY: usize = 64;

/// The policy name in every key.
const POLICY: &str = "api";

/// One row of the table: an algorithm, and how many requests each identity makes.
struct Case {
    algorithm: Algorithm,
    requests: u64,
}

/// What one case measured.
struct Measured {
    used_memory_per_key: f64,
    memory_usage_per_key: f64,
    encoding: String,
    example_key: String,
    seconds: f64,
}

/// The Redis the bench talks to: a private server it started (killed on drop), or `REDIS_URL`.
struct Server {
    child: Option<Child>,
    url: String,
}

impl Server {
    /// Starts `redis-server` on a free loopback port; `None` when it can't be started.
    fn private() -> Option<Server> {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|listener| listener.local_addr())
            .ok()?
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        Some(Server {
            child: Some(child),
            url: format!("redis://127.0.0.1:{port}/0"),
        })
    }

    /// `REDIS_URL`, shared with others.
    fn shared() -> Option<Server> {
        let url = std::env::var("REDIS_URL").ok()?;
        Some(Server { child: None, url })
    }

    fn is_private(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
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

/// `used_memory` from `INFO memory`.
async fn used_memory(connection: &mut MultiplexedConnection) -> i64 {
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

/// Removes what a case left: everything on a private server, else only the keys under `prefix`.
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

/// Sends `requests` admitted requests for each of `identities` identities under `prefix`, with
/// `CONCURRENCY` checks in flight.
async fn fill(
    store: &RedisStore,
    prefix: &str,
    case: &Case,
    rules: &Arc<[Rule]>,
    identities: std::ops::Range<usize>,
) {
    let prefix: Arc<str> = Arc::from(prefix);
    let identities = Arc::new(identities);
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|worker| {
            let (store, prefix, rules, identities) = (
                store.clone(),
                prefix.clone(),
                rules.clone(),
                identities.clone(),
            );
            let (algorithm, requests) = (case.algorithm, case.requests);
            tokio::spawn(async move {
                let first = identities.start + worker;
                for identity in (first..identities.end).step_by(CONCURRENCY) {
                    let key = format!("{prefix}:{POLICY}:user:{identity}");
                    for _ in 0..requests {
                        let decision = store
                            .check(&CheckRequest::new(&key, &rules, algorithm))
                            .await
                            .unwrap_or_else(|error| panic!("{key}: {error}"));
                        assert!(decision.allowed, "{key}: refused");
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("a worker panicked");
    }
}

async fn measure(
    server: &Server,
    store: &RedisStore,
    connection: &mut MultiplexedConnection,
    case: &Case,
) -> Measured {
    let rules: Arc<[Rule]> = Arc::from([Rule::per_day(100)]);
    // A short prefix like a real one; on a shared Redis, one that is this run's own.
    let prefix = if server.is_private() {
        "rl".to_owned()
    } else {
        format!("rl{}", std::process::id())
    };
    // Load the script and open the store's connection before the baseline, then start clean.
    fill(store, &prefix, case, &rules, 0..CONCURRENCY).await;
    clean(server, connection, &prefix).await;
    let before = used_memory(connection).await;
    let started = Instant::now();
    fill(store, &prefix, case, &rules, 0..IDENTITIES).await;
    let seconds = started.elapsed().as_secs_f64();
    let after = used_memory(connection).await;

    let keys = keys_under(connection, &prefix).await;
    assert_eq!(
        keys.len(),
        IDENTITIES,
        "{}: one key per identity expected (did some expire?)",
        case.algorithm
    );
    let mut total = 0_i64;
    for key in &keys[..SAMPLE] {
        let bytes: i64 = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(key)
            .arg("SAMPLES")
            .arg(0)
            .query_async(connection)
            .await
            .expect("MEMORY USAGE");
        total += bytes;
    }
    let encoding: String = redis::cmd("OBJECT")
        .arg("ENCODING")
        .arg(&keys[0])
        .query_async(connection)
        .await
        .expect("OBJECT ENCODING");
    let example_key = keys[0].clone();
    assert_eq!(
        keys_under(connection, &prefix).await.len(),
        IDENTITIES,
        "{}: keys expired while measured",
        case.algorithm
    );
    clean(server, connection, &prefix).await;
    Measured {
        used_memory_per_key: (after - before) as f64 / IDENTITIES as f64,
        memory_usage_per_key: total as f64 / SAMPLE as f64,
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
        let cases = [
            (Algorithm::FixedWindow, 1),
            (Algorithm::SlidingLog, 1),
            (Algorithm::SlidingLog, 10),
            (Algorithm::SlidingCounter, 1),
            (Algorithm::TokenBucket, 1),
        ]
        .map(|(algorithm, requests)| Case {
            algorithm,
            requests,
        });
        println!(
            "Redis {version} ({}), {IDENTITIES} keys per row, one rule (100 per day), \
             MEMORY USAGE averaged over {SAMPLE} keys\n",
            if server.is_private() {
                "private server"
            } else {
                "REDIS_URL, shared"
            }
        );
        println!(
            "| algorithm | requests per key | used_memory / key (B) | MEMORY USAGE / key (B) | encoding | key name (B) | fill time |"
        );
        println!("|---|---:|---:|---:|---|---:|---:|");
        let mut examples = Vec::new();
        for case in &cases {
            let measured = measure(&server, &store, &mut connection, case).await;
            println!(
                "| {} | {} | {:.1} | {:.1} | {} | {} | {:.1} s |",
                case.algorithm,
                case.requests,
                measured.used_memory_per_key,
                measured.memory_usage_per_key,
                measured.encoding,
                measured.example_key.len(),
                measured.seconds
            );
            examples.push(measured.example_key);
        }
        println!("\nExample keys:");
        for key in examples {
            println!("- `{key}`");
        }
    });
}
