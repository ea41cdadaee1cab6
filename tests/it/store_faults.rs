//! Store failures against a real Redis: faults (a key of the wrong type, a Redis out of memory, a
//! script error, a reply the crate can't read) and an outage. Each is answered by the policy's
//! `on_store_error` (fail open: admitted without headers; fail closed: 503), never a 429; counted
//! under its kind in `ratelimit_store_errors_total`; logged at its level (faults at `error`, in
//! Redis's words; outages at `warn`); and a failure per request is not a log line per request.
//! Every test has a Redis server of its own: they stop it, fill its memory or replace its
//! functions.

use crate::common;

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use common::capture::Captured;
use common::prometheus::{prometheus, value};
use common::redis_server::{TestRedis, has_functions, unique_prefix};
use common::{limits, request_from, send};
use http::StatusCode;
use redis::Value;
use tower_redis_ratelimit::store::RedisStore;
use tower_redis_ratelimit::{Algorithm, OnStoreError, Policy, RateLimitLayer, Rule};

const PEER: &str = "203.0.113.10:4000";

/// Each policy's limit per minute.
const LIMIT: u64 = 5;

/// Store-failure log lines per second per policy and kind at most (as `src/store_error_log.rs`).
const LINES_PER_SECOND: usize = 2;

/// Requests sent while the store fails, per app.
const FLOOD: usize = 400;

/// A store on `redis` with a timeout far above the default: these tests check what Redis
/// answers, and a busy machine can stall a first connect and library load.
fn store(redis: &TestRedis) -> RedisStore {
    RedisStore::from_url(&redis.url)
        .unwrap()
        .timeout(Duration::from_secs(10))
}

/// An app limited by `name` (LIMIT a minute per client IP, fixed windows: hashes in Redis) under
/// `prefix`; without the refusal cache, so every request asks the store.
fn app(name: &str, prefix: &str, on_error: OnStoreError, store: RedisStore) -> Router {
    let policy = Policy::builder(name)
        .prefix(prefix)
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_minute(LIMIT))
        .on_store_error(on_error)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, store).refusal_cache(0))
}

/// A policy failing open and one failing closed, on one store and prefix.
struct Apps {
    open: Router,
    closed: Router,
    open_name: String,
    closed_name: String,
    prefix: String,
}

impl Apps {
    /// Every store failure so far was answered as its app's policy says: `failed` requests let
    /// through by the open app, `failed` refused with 503 by the closed one.
    fn answered_per_policy(&self, failed: usize) {
        let failed = failed as f64;
        assert_eq!(requests(&self.open_name, "store_error_allowed"), failed);
        assert_eq!(requests(&self.closed_name, "store_error_denied"), failed);
    }

    /// A flood on both apps while the store fails with a fault of `kind`: every failure counted
    /// under `kind`, and logged at ERROR with Redis's `words`, in a bounded number of lines
    /// ([`check_log`], which sends each app one more request).
    async fn flood_fails_as(&self, kind: &str, words: &str) {
        let before = errors(kind);
        let took = self.both_fail().await;
        assert_eq!(errors(kind) - before, 2.0 * FLOOD as f64);
        for (app, name) in [
            (&self.open, &self.open_name),
            (&self.closed, &self.closed_name),
        ] {
            check_log(app, name, kind, "ERROR", words, FLOOD, took).await;
        }
    }

    fn new(test: &str, store: &RedisStore) -> Apps {
        let prefix = unique_prefix(test);
        let (open_name, closed_name) = (format!("{test}_open"), format!("{test}_closed"));
        Apps {
            open: app(&open_name, &prefix, OnStoreError::Allow, store.clone()),
            closed: app(&closed_name, &prefix, OnStoreError::Deny, store.clone()),
            open_name,
            closed_name,
            prefix,
        }
    }

    /// One request to each, admitted with headers: the store works (its library is loaded).
    async fn both_admit(&self) {
        for app in [&self.open, &self.closed] {
            let response = send(app, request_from(PEER, "/")).await;
            assert_eq!(response.status(), StatusCode::OK);
            assert!(response.headers().contains_key("ratelimit"));
        }
    }

    /// Floods both while the store fails: every request is let through without headers by the
    /// open policy and answered 503 by the closed one. Returns how long the flood took.
    async fn both_fail(&self) -> Duration {
        let started = Instant::now();
        let (open, closed) = tokio::join!(
            flood(&self.open, FLOOD, PEER),
            flood(&self.closed, FLOOD, PEER)
        );
        for (answers, expected) in [
            (open, StatusCode::OK),
            (closed, StatusCode::SERVICE_UNAVAILABLE),
        ] {
            assert_eq!(answers.len(), FLOOD);
            for (status, headers, _) in answers {
                assert_eq!(status, expected);
                assert!(!headers, "a failed check has no rate-limit headers");
            }
        }
        started.elapsed()
    }

    /// After the store is mended: a new client gets exactly LIMIT admissions, counted down, then
    /// refusals.
    async fn limit_exactly(&self, peer: &str) {
        for app in [&self.open, &self.closed] {
            for left in (0..LIMIT).rev() {
                let response = send(app, request_from(peer, "/")).await;
                assert_eq!(response.status(), StatusCode::OK);
                assert_eq!(
                    limits(&response).status("5-per-60s").unwrap().remaining,
                    left
                );
            }
            let refused = send(app, request_from(peer, "/")).await;
            assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        }
    }
}

/// Sends `n` requests from `peer` to `app` at once, each from a task of its own: their statuses,
/// whether they had rate-limit headers, and how long each took.
async fn flood(app: &Router, n: usize, peer: &str) -> Vec<(StatusCode, bool, Duration)> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (app, request) = (app.clone(), request_from(peer, "/"));
        tasks.spawn(async move {
            let started = Instant::now();
            let response = send(&app, request).await;
            let headers = response.headers().contains_key("ratelimit");
            (response.status(), headers, started.elapsed())
        });
    }
    tasks.join_all().await
}

/// `ratelimit_store_errors_total` of the Redis store for `kind`.
fn errors(kind: &str) -> f64 {
    value(
        "ratelimit_store_errors_total",
        &[("store", "redis"), ("kind", kind)],
    )
}

fn requests(policy: &str, outcome: &str) -> f64 {
    value(
        "ratelimit_requests_total",
        &[("policy", policy), ("outcome", outcome)],
    )
}

/// The store-failure lines of `policy` of `kind` so far.
fn failure_lines(policy: &str, kind: &str) -> Vec<String> {
    Captured::global()
        .lines_with(&format!("policy=\"{policy}\""))
        .into_iter()
        .filter(|line| line.contains(&format!("kind=\"{kind}\"")))
        .collect()
}

/// The count of failures not logged before `line`.
fn unlogged(line: &str) -> usize {
    line.split_once("unlogged_store_errors=")
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no count of unlogged failures in {line}"))
}

/// Checks the log of `failures` failures of `kind` in `policy`, which took `took`: each line at
/// `level` with `words` (Redis's own, for a fault), the first at once, then at most
/// LINES_PER_SECOND a second. Then sends one more request after a second's pause (the store still
/// failing), whose line reports every failure not logged: lines and counts add up exactly.
async fn check_log(
    app: &Router,
    policy: &str,
    kind: &str,
    level: &str,
    words: &str,
    failures: usize,
    took: Duration,
) {
    let lines = failure_lines(policy, kind);
    assert!(!lines.is_empty(), "no {kind} line for {policy}");
    assert_eq!(unlogged(&lines[0]), 0, "the first is logged at once");
    // The flood touched at most this many of the budget's seconds.
    let seconds = usize::try_from(took.as_secs()).unwrap() + 2;
    assert!(
        lines.len() <= LINES_PER_SECOND * seconds,
        "{} lines for {failures} failures in {took:?}",
        lines.len()
    );
    // A new second: the next failure is logged, with the count of those that were not.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let response = send(app, request_from(PEER, "/")).await;
    assert_ne!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let lines = failure_lines(policy, kind);
    for line in &lines {
        assert!(line.contains(level), "{line}");
        assert!(line.contains(words), "{line}");
        assert!(line.contains("rate-limit store"), "{line}");
    }
    let accounted: usize = lines.len() + lines.iter().map(|line| unlogged(line)).sum::<usize>();
    assert_eq!(accounted, failures + 1, "{lines:#?}");
    eprintln!(
        "{policy}: {} lines for {} failures of kind {kind} ({took:?})",
        lines.len(),
        failures + 1
    );
}

/// The keys under `prefix` on `redis`.
fn keys_under(redis: &TestRedis, prefix: &str) -> Vec<String> {
    redis::Commands::scan_match::<_, String>(&mut redis.client(), format!("{prefix}:*"))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_the_wrong_type_is_a_fault_answered_by_the_policy() {
    Captured::global();
    prometheus();
    let redis = TestRedis::own();
    let store = store(&redis);
    let apps = Apps::new("f_wrongtype", &store);
    apps.both_admit().await;
    // Something else writes plain strings where the policies keep their counters (hashes).
    let keys = keys_under(&redis, &apps.prefix);
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in &keys {
        let _: () = redis::Commands::set(&mut redis.client(), key, "not a hash").unwrap();
    }

    let words = "WRONGTYPE Operation against a key holding the wrong kind of value";
    apps.flood_fails_as("wrong_type", words).await;
    apps.answered_per_policy(FLOOD + 1);

    // The key is the fault, not the store: other clients are limited as ever.
    apps.limit_exactly("198.51.100.7:1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_out_of_memory_is_a_fault_answered_by_the_policy() {
    Captured::global();
    prometheus();
    let redis = TestRedis::own();
    let store = store(&redis);
    let apps = Apps::new("f_oom", &store);
    apps.both_admit().await;
    let config = |name: &str, value: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut redis.client())
            .unwrap();
    };
    config("maxmemory-policy", "noeviction");
    config("maxmemory", "1");

    let words = "OOM command not allowed when used memory > 'maxmemory'";
    apps.flood_fails_as("out_of_memory", words).await;
    apps.answered_per_policy(FLOOD + 1);

    config("maxmemory", "0");
    apps.limit_exactly("198.51.100.8:1").await;
}

/// The name of the store's function library on `redis`.
fn library_name(redis: &TestRedis) -> String {
    fn strings(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::BulkString(bytes) => out.push(String::from_utf8_lossy(bytes).into_owned()),
            Value::SimpleString(text) => out.push(text.clone()),
            Value::Array(items) | Value::Set(items) => {
                items.iter().for_each(|item| strings(item, out))
            }
            Value::Map(pairs) => pairs.iter().for_each(|(key, value)| {
                strings(key, out);
                strings(value, out);
            }),
            _ => {}
        }
    }
    let list: Value = redis::cmd("FUNCTION")
        .arg("LIST")
        .query(&mut redis.client())
        .unwrap();
    let mut found = Vec::new();
    strings(&list, &mut found);
    let names: Vec<&String> = found
        .windows(2)
        .filter(|pair| pair[0] == "library_name")
        .map(|pair| &pair[1])
        .collect();
    assert_eq!(names.len(), 1, "{found:?}");
    assert!(names[0].starts_with("tower_redis_ratelimit_"), "{names:?}");
    names[0].clone()
}

/// Replaces the library `name` on `redis` with one whose function (of the same name) runs `body`.
fn replace_library(redis: &TestRedis, name: &str, body: &str) {
    let code = format!(
        "#!lua name={name}\nredis.register_function('{name}', function(keys, args) {body} end)"
    );
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(code)
        .query(&mut redis.client())
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_error_and_an_unreadable_reply_are_faults_answered_by_the_policy() {
    Captured::global();
    prometheus();
    let redis = TestRedis::own();
    let store = store(&redis);
    let apps = Apps::new("f_script", &store);
    apps.both_admit().await;
    if !has_functions(&mut redis.client()) {
        return a_script_error_before_redis_7(&redis, &apps).await;
    }
    let library = library_name(&redis);

    // A library of the same name whose function raises an error.
    let message = "this library was replaced by a broken one";
    replace_library(&redis, &library, &format!("error('{message}')"));
    apps.flood_fails_as("script", message).await;

    // One whose function answers what the store can't read.
    replace_library(&redis, &library, "return 'nonsense'");
    apps.flood_fails_as("protocol", "nonsense").await;
    apps.answered_per_policy(2 * (FLOOD + 1));

    // Without the library, the store loads its own again.
    let _: String = redis::cmd("FUNCTION")
        .arg("DELETE")
        .arg(&library)
        .query(&mut redis.client())
        .unwrap();
    apps.limit_exactly("198.51.100.9:1").await;
}

/// Redis 6.2 has no library to replace, and the script cache holds only the store's own script:
/// there a script fails when its user may not run a command in it (`TIME`, taken away from the
/// store's user by an ACL). An unreadable reply needs a function of another's (7.0 on): reading
/// replies is the client's work, the same whatever the server.
async fn a_script_error_before_redis_7(redis: &TestRedis, apps: &Apps) {
    let acl = |rule: &str| {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg(rule)
            .query(&mut redis.client())
            .unwrap();
    };
    acl("-time");
    let message = "can't run this command";
    apps.flood_fails_as("script", message).await;
    apps.answered_per_policy(FLOOD + 1);
    acl("+time");
    apps.limit_exactly("198.51.100.9:1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_of_thousands_of_requests_is_a_few_warnings_and_limiting_resumes_exactly() {
    Captured::global();
    prometheus();
    let mut redis = TestRedis::own();
    let timeout = tower_redis_ratelimit::store::DEFAULT_TIMEOUT;
    let store = RedisStore::from_url(&redis.url).unwrap();
    let name = "f_outage";
    let prefix = unique_prefix(name);
    let open = app(name, &prefix, OnStoreError::Allow, store);
    // The first check may connect and load the library slowly on a busy machine: not timed.
    let mut first = send(&open, request_from(PEER, "/")).await;
    while !first.headers().contains_key("ratelimit") {
        tokio::time::sleep(Duration::from_millis(50)).await;
        first = send(&open, request_from(PEER, "/")).await;
    }

    redis.stop();
    let before = (errors("unavailable"), errors("timeout"));
    let outage = 3_000;
    let started = Instant::now();
    let answers = flood(&open, outage, PEER).await;
    let took = started.elapsed();
    assert_eq!(answers.len(), outage);
    let slowest = answers.iter().map(|answer| answer.2).max().unwrap();
    for (status, headers, _) in &answers {
        assert_eq!(*status, StatusCode::OK, "fail open");
        assert!(!headers);
    }
    // Every answer came from the store's own deadline or sooner; the slack is for a machine
    // running 3 000 tasks on two cores, not a claim about speed: a request waiting on the dead
    // server for longer would have hung.
    assert!(slowest < timeout + Duration::from_secs(5), "{slowest:?}");
    let unavailable = (errors("unavailable") - before.0) as usize;
    let timeouts = (errors("timeout") - before.1) as usize;
    assert_eq!(unavailable + timeouts, outage);
    let seconds = usize::try_from(took.as_secs()).unwrap() + 2;
    for kind in ["unavailable", "timeout"] {
        let lines = failure_lines(name, kind);
        assert!(lines.len() <= LINES_PER_SECOND * seconds, "{lines:#?}");
        for line in &lines {
            assert!(line.contains("WARN"), "an outage is a warning: {line}");
        }
    }
    eprintln!(
        "outage: {outage} requests in {took:?} (slowest {slowest:?}): {unavailable} unavailable, \
         {timeouts} timeouts, {} + {} lines",
        failure_lines(name, "unavailable").len(),
        failure_lines(name, "timeout").len()
    );
    // Refused connections are the outage's own words.
    check_log(
        &open,
        name,
        "unavailable",
        "WARN",
        "rate-limit store unavailable",
        unavailable,
        took,
    )
    .await;

    // Back up (empty): counting starts over, exactly.
    redis.start();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let response = send(&open, request_from("192.0.2.1:1", "/")).await;
        if response.headers().contains_key("ratelimit") {
            break;
        }
        assert!(Instant::now() < deadline, "Redis is back but checks fail");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for left in (0..LIMIT).rev() {
        let response = send(&open, request_from("198.51.100.10:1", "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            limits(&response).status("5-per-60s").unwrap().remaining,
            left
        );
    }
    let refused = send(&open, request_from("198.51.100.10:1", "/")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
}
