//! The Redis store against a real Redis (see `common::redis_server`): same answers as the in-memory
//! store, one round trip per request, every key with a TTL, NOSCRIPT recovery, and outages that are
//! store errors, never 429s.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::routing::get;
use common::redis_server::{
    TestRedis, expire_time_ms, has_functions, store_call_command, unique_prefix,
};
use common::{app, assert_refused, limits, request_from, retry_after_secs, send};
use http::StatusCode;
use proptest::prelude::*;
use redis::Commands;
use tower_redis_ratelimit::concurrency::ConcurrencyLimit;
use tower_redis_ratelimit::quota::QuotaThreshold;
use tower_redis_ratelimit::store::{CheckRequest, ManualClock, QuotaRequest, RedisStore};
use tower_redis_ratelimit::{
    Algorithm, MemoryStore, OnStoreError, Policy, RateLimitLayer, Rule, Store,
};

const PEER: &str = "203.0.113.10:4000";

/// A store on the test server. Its timeout is far above the default 250 ms: these tests check what
/// Redis answers, and a busy CI machine can stall a first connect and script load for longer than
/// that. The outage tests set their own.
fn store(redis: &TestRedis) -> RedisStore {
    RedisStore::from_url(&redis.url)
        .expect("a valid Redis URL")
        .timeout(Duration::from_secs(10))
}

/// Every key under `prefix` has a TTL: none is immortal.
fn assert_every_key_expires(redis: &TestRedis, prefix: &str) -> usize {
    common::redis_server::assert_every_key_expires(&mut redis.client(), prefix)
}

/// The calls per command, from `INFO commandstats`.
fn command_calls(redis: &TestRedis) -> HashMap<String, u64> {
    common::redis_server::command_calls(&mut redis.client())
}

#[tokio::test]
async fn seed_curl_loop_on_redis() {
    let redis = TestRedis::shared();
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
    ] {
        let prefix = unique_prefix("curl");
        let policy = Policy::builder("curl")
            .prefix(&prefix)
            .algorithm(algorithm)
            .rule(Rule::per_minute(20))
            .build()
            .unwrap();
        let app = app(policy, store(&redis));
        for n in 1..=20u64 {
            let response = send(&app, request_from(PEER, "/")).await;
            assert_eq!(response.status(), StatusCode::OK, "{algorithm} request {n}");
            assert_eq!(
                limits(&response).status("20-per-60s").unwrap().remaining,
                20 - n
            );
        }
        for _ in 21..=22 {
            let refused = send(&app, request_from(PEER, "/")).await;
            let retry = retry_after_secs(&refused);
            assert!(
                (1..=60).contains(&retry),
                "{algorithm}: Retry-After {retry}"
            );
            assert_refused(refused, &["20-per-60s"]).await;
        }
        assert_eq!(assert_every_key_expires(&redis, &prefix), 1);
    }
}

/// 2 per second AND 5 per 10 seconds on Redis time, each phase waiting 1.2 s after the admissions
/// it depends on.
#[tokio::test]
async fn two_rules_on_redis_time() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("two");
    let app = app(
        Policy::builder("two")
            .prefix(&prefix)
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::per_second(2))
            .rule(Rule::new(5, Duration::from_secs(10)))
            .build()
            .unwrap(),
        store(&redis),
    );
    let get = || send(&app, request_from(PEER, "/"));
    let settle = Duration::from_millis(1_200);

    assert_eq!(get().await.status(), StatusCode::OK);
    assert_eq!(get().await.status(), StatusCode::OK);
    let after_second = Instant::now();
    let refused = get().await;
    assert_eq!(retry_after_secs(&refused), 1);
    assert_eq!(limits(&refused).status("5-per-10s").unwrap().remaining, 3);
    assert_refused(refused, &["2-per-1s"]).await;

    tokio::time::sleep_until((after_second + settle).into()).await;
    assert_eq!(get().await.status(), StatusCode::OK);
    assert_eq!(get().await.status(), StatusCode::OK);
    let after_fourth = Instant::now();
    assert_refused(get().await, &["2-per-1s"]).await;

    tokio::time::sleep_until((after_fourth + settle).into()).await;
    let fifth = get().await;
    assert_eq!(fifth.status(), StatusCode::OK);
    assert_eq!(limits(&fifth).status("5-per-10s").unwrap().remaining, 0);
    let refused = get().await;
    // The first admission is about 2.4 s old: it leaves the 10-second window in about 7.6 s.
    let retry = retry_after_secs(&refused);
    assert!((6..=8).contains(&retry), "Retry-After {retry}");
    assert_eq!(limits(&refused).status("2-per-1s").unwrap().remaining, 1);
    assert_refused(refused, &["5-per-10s"]).await;
    assert_eq!(assert_every_key_expires(&redis, &prefix), 2);
}

/// Two app instances (two layers, each with its own pool) share one limit exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_share_one_limit_exactly() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("shared");
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
    ] {
        let policy = Policy::builder(algorithm.as_str())
            .prefix(&prefix)
            .algorithm(algorithm)
            .rule(Rule::per_hour(100))
            .build()
            .unwrap();
        let stores = [store(&redis), store(&redis)];
        let instances = [
            app(policy.clone(), stores[0].clone()),
            app(policy, stores[1].clone()),
        ];
        assert_eq!(
            common::race(&instances, 400, PEER).await,
            (100, 300),
            "{algorithm}"
        );
        // The racing requests went out in batches (group commit), and still exactly.
        let stats = stores[0].batch_stats();
        assert!(stats.largest_batch > 1, "{algorithm}: {stats:?}");
    }
    assert_eq!(assert_every_key_expires(&redis, &prefix), 3);
}

#[tokio::test]
async fn one_round_trip_per_request_whatever_the_rules() {
    // A server of our own, so no other test's commands are counted.
    let redis = TestRedis::own();
    let prefix = unique_prefix("trips");
    let policy = Policy::builder("trips")
        .prefix(&prefix)
        .rule(Rule::per_second(1_000))
        .rule(Rule::per_minute(10_000))
        .rule(Rule::per_hour(100_000))
        .build()
        .unwrap();
    let app = app(policy, store(&redis));
    // The first request loads the library (FCALL, "Function not found", FUNCTION LOAD, FCALL).
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    let before = command_calls(&redis);
    for _ in 0..50 {
        assert_eq!(
            send(&app, request_from(PEER, "/")).await.status(),
            StatusCode::OK
        );
    }
    let after = command_calls(&redis);
    let mut sent: HashMap<&str, u64> = after
        .iter()
        .map(|(name, calls)| {
            (
                name.as_str(),
                calls - before.get(name).copied().unwrap_or(0),
            )
        })
        // The test's own reading connections: INFO, and the CLIENT SETINFO that redis-rs sends
        // when it connects (a command Redis 6.2 counts though it lacks the subcommand; Valkey
        // counts it as `client|setinfo`).
        .filter(|(name, calls)| {
            let command = name.split('|').next().unwrap_or(name);
            *calls > 0 && !["info", "client"].contains(&command)
        })
        .collect();
    // Redis counts the commands a script runs too: one TIME per script run, and per rule the
    // sliding log's trim, its oldest and newest members' reads (which give its count), add and
    // expiry. Anything the client sent besides FCALL (a pool health check's PING, a second read)
    // would show up or change these counts.
    let rules = 3;
    let mut client = redis.client();
    let mut wanted = HashMap::from([
        (store_call_command(&mut client), 50),
        ("time", 50),
        ("zremrangebyscore", 50 * rules),
        ("zrange", 2 * 50 * rules),
        ("zadd", 50 * rules),
    ]);
    if has_functions(&mut client) {
        // Redis 7: PEXPIREAT … GT extends the expiry in one command.
        wanted.insert("pexpireat", 50 * rules);
    } else {
        // Redis 6.2 reads the expiry (PTTL) and extends it (PEXPIRE) unless it already reaches
        // far enough: not when an earlier request of the same millisecond extended it.
        wanted.insert("pttl", 50 * rules);
        let extended = sent.get("pexpire").copied().unwrap_or(0);
        assert!((1..=50 * rules).contains(&extended), "{sent:?}");
        sent.remove("pexpire");
    }
    assert_eq!(sent, wanted);
}

#[tokio::test]
async fn a_quota_rides_in_the_same_round_trip() {
    let redis = TestRedis::own();
    let prefix = unique_prefix("quota-trips");
    let quota = tower_redis_ratelimit::Quota::builder("daily")
        .prefix(&prefix)
        .key(tower_redis_ratelimit::Key::ip())
        .tier("free", 1_000)
        .build()
        .unwrap();
    let policy = Policy::builder("trips")
        .prefix(&prefix)
        .rule(Rule::per_second(1_000))
        .rule(Rule::per_minute(10_000))
        .prevent_duplicate(Duration::from_millis(1))
        .block_for(Duration::from_secs(1))
        .quota(quota)
        .build()
        .unwrap();
    let app = app(policy, store(&redis));
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    let before = command_calls(&redis);
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(
            send(&app, request_from(PEER, "/")).await.status(),
            StatusCode::OK
        );
    }
    let after = command_calls(&redis);
    let call = store_call_command(&mut redis.client());
    let calls = after[call] - before.get(call).copied().unwrap_or(0);
    assert_eq!(
        calls, 20,
        "one {call} per request, quota, guard and block included"
    );
    assert_every_key_expires(&redis, &prefix);
}

#[tokio::test]
async fn a_function_flush_between_requests_is_recovered_in_the_request() {
    let redis = TestRedis::own();
    let prefix = unique_prefix("flush");
    let app = app(
        Policy::builder("flush")
            .prefix(&prefix)
            .rule(Rule::per_hour(3))
            .build()
            .unwrap(),
        store(&redis),
    );
    let first = send(&app, request_from(PEER, "/")).await;
    assert_eq!(limits(&first).status("3-per-3600s").unwrap().remaining, 2);
    // Redis 6.2 has no functions: there the store's script stands in for its library, and
    // `SCRIPT FLUSH` for `FUNCTION FLUSH`.
    let functions = has_functions(&mut redis.client());
    let _: () = redis::cmd(if functions { "FUNCTION" } else { "SCRIPT" })
        .arg("FLUSH")
        .query(&mut redis.client())
        .unwrap();
    let second = send(&app, request_from(PEER, "/")).await;
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(limits(&second).status("3-per-3600s").unwrap().remaining, 1);
    let calls = command_calls(&redis);
    if functions {
        // Both times (the first request, and after the flush) the library was loaded within the
        // request, which then went through; the script was never needed.
        assert_eq!(calls.get("function|load").copied(), Some(2), "{calls:?}");
        assert_eq!(calls.get("fcall").copied(), Some(4), "{calls:?}");
        assert_eq!(calls.get("eval"), None, "{calls:?}");
        assert_eq!(calls.get("evalsha"), None, "{calls:?}");
    } else {
        // The first request's FCALL is an unknown command (not counted); both times the script
        // went as EVAL, the second after EVALSHA answered NOSCRIPT.
        assert_eq!(calls.get("eval").copied(), Some(2), "{calls:?}");
        assert_eq!(calls.get("evalsha").copied(), Some(1), "{calls:?}");
        assert_eq!(calls.get("fcall"), None, "{calls:?}");
    }
}

/// A Redis that won't run functions (here an ACL without them, nor `INFO`; before 7.0, a server
/// without the commands): the store turns to its script for good, and recovers a `SCRIPT FLUSH` in
/// the request.
#[tokio::test]
async fn without_functions_the_script_serves_and_a_script_flush_is_recovered() {
    let redis = TestRedis::own();
    // Nor `INFO`: a store that can't read the server's version goes on without checking it.
    let mut user = vec![
        "SETUSER",
        "nofunctions",
        "on",
        ">secret",
        "~*",
        "&*",
        "+@all",
        "-info",
    ];
    // Before 7.0 there are no functions to forbid (nor their names in ACLs).
    if has_functions(&mut redis.client()) {
        user.extend(["-function", "-fcall", "-fcall_ro"]);
    }
    let _: () = redis::cmd("ACL")
        .arg(&user[..])
        .query(&mut redis.client())
        .unwrap();
    let url = redis
        .url
        .replacen("redis://", "redis://nofunctions:secret@", 1);
    let store = RedisStore::from_url(&url)
        .unwrap()
        .timeout(Duration::from_secs(10));
    let prefix = unique_prefix("no-functions");
    let app = app(
        Policy::builder("flush")
            .prefix(&prefix)
            .rule(Rule::per_hour(5))
            .build()
            .unwrap(),
        store,
    );
    for remaining in [4, 3] {
        let response = send(&app, request_from(PEER, "/")).await;
        assert_eq!(
            limits(&response).status("5-per-3600s").unwrap().remaining,
            remaining
        );
    }
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut redis.client())
        .unwrap();
    for remaining in [2, 1] {
        let response = send(&app, request_from(PEER, "/")).await;
        assert_eq!(
            limits(&response).status("5-per-3600s").unwrap().remaining,
            remaining
        );
    }
    // FCALL refused once (Redis lists it, with no call run); then the script went as EVAL (the
    // first request, and the first after the flush, each caching it) and as EVALSHA (the other
    // two, and the flushed request's first try, answered NOSCRIPT).
    let calls = command_calls(&redis);
    assert_eq!(calls.get("fcall").copied().unwrap_or(0), 0, "{calls:?}");
    assert_eq!(calls.get("eval").copied(), Some(2), "{calls:?}");
    assert_eq!(calls.get("evalsha").copied(), Some(3), "{calls:?}");
    assert_eq!(calls.get("function|load"), None, "{calls:?}");
    // The limit holds exactly: the fifth is admitted, the sixth refused.
    let fifth = send(&app, request_from(PEER, "/")).await;
    assert_eq!(limits(&fifth).status("5-per-3600s").unwrap().remaining, 0);
    assert_refused(send(&app, request_from(PEER, "/")).await, &["5-per-3600s"]).await;
}

/// Two apps limiting one key by `rule`: one fails open, one fails closed.
fn failing_open_and_closed(
    redis: &TestRedis,
    name: &str,
    rule: Rule,
    timeout: Duration,
) -> (Router, Router) {
    let prefix = unique_prefix(name);
    let policy = |on_error| {
        Policy::builder(name)
            .prefix(&prefix)
            .rule(rule.clone())
            .on_store_error(on_error)
            .build()
            .unwrap()
    };
    // Without the refusal cache, so that every request asks Redis: a refusal it already gave
    // would otherwise be answered from the cache while Redis is down (rightly: it still stands).
    let app = |policy, store| {
        Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(RateLimitLayer::new(policy, store).refusal_cache(0))
    };
    (
        app(policy(OnStoreError::Allow), store(redis).timeout(timeout)),
        app(policy(OnStoreError::Deny), store(redis).timeout(timeout)),
    )
}

#[tokio::test]
async fn an_outage_fails_open_or_closed_and_limiting_resumes() {
    let mut redis = TestRedis::own();
    let timeout = Duration::from_millis(250);
    let (open, closed) = failing_open_and_closed(&redis, "outage", Rule::per_hour(2), timeout);
    assert_eq!(
        send(&open, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&closed, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );

    redis.stop();
    for _ in 0..3 {
        for (app, expected) in [
            (&open, StatusCode::OK),
            (&closed, StatusCode::SERVICE_UNAVAILABLE),
        ] {
            let started = Instant::now();
            let response = send(app, request_from(PEER, "/")).await;
            assert_eq!(response.status(), expected);
            assert!(response.headers().get("ratelimit").is_none());
            let took = started.elapsed();
            assert!(took < timeout + Duration::from_millis(500), "took {took:?}");
        }
    }

    // Back up (empty: the server keeps nothing): limiting resumes without a restart of the app.
    redis.start();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let response = send(&closed, request_from(PEER, "/")).await;
        if response.status() == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis came back but requests still fail"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        send(&open, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    let refused = send(&open, request_from(PEER, "/")).await;
    assert_refused(refused, &["2-per-3600s"]).await;
}

/// The store's timeout is the only one: redis-rs's own default response timeout (500 ms) must not
/// cut a longer one short.
#[tokio::test]
async fn a_timeout_longer_than_half_a_second_is_waited_out() {
    let redis = TestRedis::own();
    let policy = Policy::builder("patient")
        .prefix(unique_prefix("patient"))
        .rule(Rule::per_hour(5))
        .on_store_error(OnStoreError::Deny)
        .build()
        .unwrap();
    let app = app(policy, store(&redis).timeout(Duration::from_secs(5)));
    let first = send(&app, request_from(PEER, "/")).await;
    assert_eq!(limits(&first).status("5-per-3600s").unwrap().remaining, 4);

    redis.pause();
    let started = Instant::now();
    let pending = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request_from(PEER, "/")).await }
    });
    let frozen_for = Duration::from_millis(1200);
    tokio::time::sleep(frozen_for).await;
    redis.resume();
    let second = pending.await.unwrap();
    assert!(started.elapsed() >= frozen_for);
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(limits(&second).status("5-per-3600s").unwrap().remaining, 3);
}

#[tokio::test]
async fn a_reply_slower_than_the_timeout_is_a_store_error_not_a_429() {
    let redis = TestRedis::own();
    let timeout = Duration::from_millis(200);
    let (open, closed) = failing_open_and_closed(&redis, "slow", Rule::per_hour(1), timeout);
    assert_eq!(
        send(&open, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&closed, request_from(PEER, "/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // Frozen: the connection stays open but no reply comes. The limit is used up, yet a store
    // that can't answer is never a 429.
    redis.pause();
    for (app, expected) in [
        (&open, StatusCode::OK),
        (&closed, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let started = Instant::now();
        let response = send(app, request_from(PEER, "/")).await;
        let took = started.elapsed();
        assert_eq!(response.status(), expected);
        assert!(took >= timeout, "answered before the timeout: {took:?}");
        assert!(took < timeout + Duration::from_millis(500), "took {took:?}");
    }

    // Thawed: the limit that Redis kept applies again.
    redis.resume();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = send(&open, request_from(PEER, "/")).await.status();
        if status == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        assert_eq!(
            status,
            StatusCode::OK,
            "only fail-open answers until Redis answers"
        );
        assert!(
            Instant::now() < deadline,
            "Redis is back but limiting did not resume"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn shadow_cost_duplicate_and_block_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("features");
    common::policy_features_work(store(&redis), &prefix).await;
    // The guard and the block keys expire like the counters.
    assert!(assert_every_key_expires(&redis, &prefix) >= 6);
}

#[tokio::test]
async fn the_extractor_on_redis_answers_like_the_layer() {
    let redis = TestRedis::shared();
    common::the_extractor_limits_like_the_layer(store(&redis), &unique_prefix("who")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_mode_on_redis_admits_exactly_the_reserved_slots() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("delay");
    common::delay_mode_spaces_concurrent_waiters(store(&redis), &prefix).await;
    assert_every_key_expires(&redis, &prefix);
}

#[tokio::test]
async fn a_token_bucket_on_redis_bursts_then_drips() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("bucket");
    let policy = Policy::builder("bucket")
        .prefix(&prefix)
        .algorithm(Algorithm::TokenBucket)
        .rule(Rule::per_second(10).burst(5))
        .build()
        .unwrap();
    let app = app(policy, store(&redis));
    let (admitted, refused) = {
        let mut statuses = Vec::new();
        for _ in 0..8 {
            statuses.push(send(&app, request_from(PEER, "/")).await.status());
        }
        let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
        (admitted, statuses.len() - admitted)
    };
    // Five at once (a unit drips back every 100 ms, so at most one more if the machine stalled).
    assert!((5..=6).contains(&admitted), "{admitted} admitted");
    assert_eq!(admitted + refused, 8);
    let keys = assert_every_key_expires(&redis, &prefix);
    assert_eq!(keys, 1, "one timestamp per rule and identity");
    // The key holds the theoretical arrival time in microseconds, and expires at it.
    let mut client = redis.client();
    let key: String = client
        .scan_match::<_, String>(format!("{prefix}:*"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let tat: u64 = client.get(&key).unwrap();
    let expires_at = expire_time_ms(&mut client, &key);
    assert_eq!(expires_at, tat.div_ceil(1_000) as i64);
    tokio::time::sleep(Duration::from_millis(110)).await;
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
}

/// Five requests just before a window edge and five just after, on Redis time, per algorithm: the
/// fixed window lets all ten through, the sliding log and the token bucket five, the sliding
/// counter what its weighting says for the exact times Redis answered. A run whose batches Redis
/// didn't place on either side of the edge (a stalled machine) is repeated with fresh keys.
#[tokio::test]
async fn window_edges_on_redis_time() {
    let redis = TestRedis::shared();
    let store = store(&redis);
    let period = 2_000u64;
    let rules = [Rule::new(5, Duration::from_millis(period))];
    let redis_now = |client: &mut redis::Connection| -> u64 {
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query(client).unwrap();
        secs * 1_000 + micros / 1_000
    };
    let mut client = redis.client();
    'attempt: for attempt in 0..5 {
        let prefix = unique_prefix("edge");
        // Wait for 1.85 s into a 2 s window.
        let now = redis_now(&mut client);
        let edge = now - now % period + period;
        let first_at = if now < edge - 150 {
            edge - 150
        } else {
            edge + period - 150
        };
        tokio::time::sleep(Duration::from_millis(first_at - now)).await;
        let edge = first_at + 150;
        let mut outcomes = Vec::new();
        for batch in 0..2 {
            if batch == 1 {
                let now = redis_now(&mut client);
                tokio::time::sleep(Duration::from_millis((edge + 5).saturating_sub(now))).await;
            }
            for algorithm in [
                Algorithm::FixedWindow,
                Algorithm::SlidingLog,
                Algorithm::SlidingCounter,
                Algorithm::TokenBucket,
            ] {
                let key = format!("{prefix}:edge:{algorithm}");
                for _ in 0..5 {
                    let decision = store
                        .check(&CheckRequest::new(&key, &rules, algorithm))
                        .await
                        .unwrap();
                    let on_its_side = if batch == 0 {
                        decision.now_unix_ms < edge
                    } else {
                        decision.now_unix_ms < edge + 150
                    };
                    if !on_its_side {
                        eprintln!("attempt {attempt}: a batch missed its side of the edge; again");
                        continue 'attempt;
                    }
                    outcomes.push((algorithm, decision.now_unix_ms, decision.allowed));
                }
            }
        }
        let admitted = |algorithm| {
            outcomes
                .iter()
                .filter(|(a, _, allowed)| *a == algorithm && *allowed)
                .count()
        };
        assert_eq!(admitted(Algorithm::FixedWindow), 10);
        assert_eq!(admitted(Algorithm::SlidingLog), 5);
        // A unit drips back every 400 ms; the batches are less than that apart.
        assert_eq!(admitted(Algorithm::TokenBucket), 5);
        // The counter: five in the last window, weighed by what is left of it at each request.
        let mut current = 0;
        let mut expected = 5;
        for (_, at, _) in outcomes
            .iter()
            .filter(|(a, at, _)| *a == Algorithm::SlidingCounter && *at >= edge)
        {
            let elapsed = at - edge;
            let weight = (period - elapsed) * 65_536 / period;
            if 5 * weight / 65_536 + current < 5 {
                current += 1;
                expected += 1;
            }
        }
        assert_eq!(admitted(Algorithm::SlidingCounter), expected);
        assert!(expected <= 6, "the counter let {expected} through");
        return;
    }
    panic!("five attempts in a row missed the window edge: the machine is too slow for this test");
}

/// A request of cost 0 (a `Cost(0)`, a cost function saying 0) is answered by every script, as by
/// the memory store: admitted while the rules hold, refused by the duplicate guard after one, and
/// it leaves no key without a TTL.
#[tokio::test]
async fn a_request_of_cost_zero_is_answered_by_every_script() {
    let redis = TestRedis::shared();
    let redis_store = store(&redis);
    let prefix = unique_prefix("free");
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ] {
        for max_delay in [Duration::ZERO, Duration::from_secs(1)] {
            let policy = Policy::builder("free")
                .algorithm(algorithm)
                .rule(Rule::per_minute(2))
                .prevent_duplicate(Duration::from_secs(60))
                .build()
                .unwrap();
            let memory_store = MemoryStore::new();
            let key = format!("{prefix}:free:{algorithm}:{}", max_delay.as_millis());
            let request = CheckRequest::new(&key, policy.rules(), algorithm)
                .cost(0)
                .max_delay(max_delay);
            for expected in [true, false] {
                let in_redis = redis_store.check(&request).await.unwrap();
                let in_memory = memory_store.check(&request).await.unwrap();
                assert_eq!(in_redis.allowed, expected, "{algorithm}, {max_delay:?}");
                assert_eq!(in_memory.allowed, expected, "{algorithm}, {max_delay:?}");
                assert_eq!(in_redis.rules[0].remaining, 2, "{algorithm}");
            }
        }
    }
    assert_every_key_expires(&redis, &prefix);
}

/// A log's member numbers its request's units (`lua/common.lua`); a log never empty for so long
/// that the numbers near 2^53 (past which Lua's doubles are not exact) is numbered again from 0,
/// keeping its members, times, count and expiry.
#[tokio::test]
async fn a_sliding_log_numbered_near_2_pow_50_is_renumbered() {
    let redis = TestRedis::shared();
    let store = store(&redis);
    let mut client = redis.client();
    let prefix = unique_prefix("renumber");
    let rules = [Rule::per_hour(5)];
    let key = format!("{prefix}:user:ann");
    let check =
        |cost| store.check(&CheckRequest::new(&key, &rules, Algorithm::SlidingLog).cost(cost));
    let (secs, _): (u64, u64) = redis::cmd("TIME").query(&mut client).unwrap();
    let at = secs * 1_000;
    store.fix_time_for_tests(Some(at * 1_000));
    assert!(check(2).await.unwrap().allowed);
    let keys: Vec<String> = client.keys(format!("{prefix}*")).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let log = &keys[0];
    let members: Vec<String> = client.zrange(log, 0, -1).unwrap();
    assert_eq!(members, ["a0:2"], "one member for a request of two units");
    // As if the log had held 2^50 - 4 units before this one: 16 digits, letter p.
    let _: () = redis::pipe()
        .del(log)
        .zadd(log, "p1125899906842620:2", at)
        .pexpire_at(log, (at + 3_600_000) as i64)
        .query(&mut client)
        .unwrap();
    store.fix_time_for_tests(Some((at + 1) * 1_000));
    let full = check(3).await.unwrap();
    assert!(full.allowed);
    assert_eq!(full.rules[0].remaining, 0);
    let members: Vec<String> = client.zrange(log, 0, -1).unwrap();
    assert_eq!(members, ["a0:2", "a2:3"], "numbered from 0 again, in order");
    store.fix_time_for_tests(Some((at + 2) * 1_000));
    let refused = check(1).await.unwrap();
    assert!(!refused.allowed);
    // The oldest request's units leave first: an hour after it.
    assert_eq!(
        refused.retry_after(),
        Some(Duration::from_millis(3_600_000 - 2))
    );
    let expires_at = expire_time_ms(&mut client, log);
    let wanted = (at + 1 + 3_600_000) as i64;
    // Redis 6.2 extends an expiry relative to its clock (lua/common.lua): never earlier than
    // wanted, later by at most the milliseconds the script ran (and the fixed time's lead).
    assert!(
        (wanted..wanted + 1_000).contains(&expires_at),
        "{expires_at}, {wanted}"
    );
    store.fix_time_for_tests(None);
}

/// A log's first member, added after a free check of the same batch found it empty (an
/// inspection's check of cost 0), makes a key that expires: the free check set no expiry on a key
/// that wasn't there, and the batch doesn't take it for one it set.
#[tokio::test]
async fn a_log_first_charged_after_a_free_check_in_its_batch_expires() {
    let redis = TestRedis::shared();
    let store = store(&redis);
    let prefix = unique_prefix("freelog");
    let rules = [Rule::per_minute(5)];
    let key = format!("{prefix}:user:ann");
    let decisions = store
        .check_batch_for_tests(&[
            CheckRequest::new(&key, &rules, Algorithm::SlidingLog).cost(0),
            CheckRequest::new(&key, &rules, Algorithm::SlidingLog),
        ])
        .await;
    assert!(
        decisions
            .iter()
            .all(|decided| decided.as_ref().unwrap().allowed)
    );
    assert_eq!(decisions[1].as_ref().unwrap().rules[0].remaining, 4);
    assert_eq!(assert_every_key_expires(&redis, &prefix), 1);
}

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

/// A penalty block on Redis outlasts the rule's window, and ends on its own (its key's TTL).
#[tokio::test]
async fn a_penalty_block_on_redis_outlasts_the_window() {
    let redis = TestRedis::shared();
    let store = store(&redis);
    let prefix = unique_prefix("block");
    let key = format!("{prefix}:block:global");
    let rules = [Rule::new(1, Duration::from_millis(200))];
    let check = || {
        store.check(
            &CheckRequest::new(&key, &rules, Algorithm::SlidingLog)
                .block_for(Some(Duration::from_secs(3))),
        )
    };
    let started = Instant::now();
    assert!(check().await.unwrap().allowed);
    let refused = check().await.unwrap();
    assert_eq!(refused.retry_after(), Some(Duration::from_secs(3)));
    // Two windows later the rule would admit again; the block still refuses, to its end.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let blocked = check().await.unwrap();
    assert!(!blocked.allowed);
    let left = blocked.retry_after().unwrap();
    assert!(left < Duration::from_millis(2_600), "{left:?}");
    assert_eq!(blocked.rules[0].remaining, 0);
    assert_eq!(
        assert_every_key_expires(&redis, &prefix),
        1,
        "the log has expired with its window, the block has not"
    );
    tokio::time::sleep(
        Duration::from_secs(3).saturating_sub(started.elapsed()) + Duration::from_millis(50),
    )
    .await;
    assert!(check().await.unwrap().allowed, "the block ended");
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

/// A policy (algorithm, rules as limit, period and burst, duplicate guard, penalty block, daily
/// quota, delay mode's max delay in ms), a request sequence (which of three identities, and how
/// much each request costs), and a scale that multiplies every limit and cost (large costs).
type Case = (
    (Algorithm, Vec<(u64, u64, u64)>, bool, bool),
    (Option<(u64, u64)>, Option<u64>),
    Option<u64>,
    Vec<(usize, u64, Step)>,
    u64,
);

/// What a request of [`memory_and_redis_agree`] does.
#[derive(Debug, Clone, Copy)]
enum Step {
    Check,
    /// A refund of its cost to the current windows.
    Refund,
    /// A give-back of its key's last admission, by its receipt.
    GiveBack,
    /// An overdraw of its cost, past the limits if need be.
    Overdraw,
    /// The release of the oldest lease taken for its key.
    Release,
}

fn sequences() -> impl Strategy<Value = Case> {
    let algorithm = prop_oneof![
        Just(Algorithm::FixedWindow),
        Just(Algorithm::SlidingLog),
        Just(Algorithm::SlidingCounter),
        Just(Algorithm::TokenBucket)
    ];
    // Periods of an hour or more, so no window edge falls inside a case, and no token drips back.
    let rule = (
        1u64..6,
        prop_oneof![Just(3_600_000u64), Just(7_200_000), Just(86_400_000)],
        1u64..8,
    );
    let rules = prop::collection::vec(rule, 1..4).prop_filter("distinct rules", |rules| {
        let mut seen: Vec<_> = rules
            .iter()
            .map(|(limit, period, _)| (limit, period))
            .collect();
        seen.sort_unstable();
        seen.dedup();
        seen.len() == rules.len()
    });
    // Which identity, the cost, and what the request does.
    let step = prop_oneof![
        12 => Just(Step::Check),
        2 => Just(Step::Refund),
        2 => Just(Step::GiveBack),
        1 => Just(Step::Overdraw),
        3 => Just(Step::Release),
    ];
    let requests = prop::collection::vec((0usize..3, 0u64..4, step), 1..25);
    // A daily limit and where its days start (the UTC offset's midnight, as ms after UTC's).
    let quota = prop::option::of((1u64..8, 0u64..86_400_000));
    // A concurrency limit's most requests in flight, its leases longer than any case runs.
    let in_flight = prop::option::of(1u64..4);
    // Waits within the cases' periods (an hour or more), so reservations are made.
    let max_delay = prop::option::of(prop_oneof![Just(3_600_000u64), Just(10_800_000)]);
    // Costs of millions and billions of units cost the stores no more than costs of one.
    let scale = prop_oneof![Just(1u64), Just(1_000_000), Just(500_000_000)];
    (
        (algorithm, rules, any::<bool>(), any::<bool>()),
        (quota, in_flight),
        max_delay,
        requests,
        scale,
    )
}

/// The same requests through the in-memory store and the Redis store get the same answers, for
/// every algorithm, with and without a duplicate guard, a penalty block, a daily quota (shared
/// by the three identities' two keys each, with alerts at 50 % and 100 %), a concurrency limit
/// and delay mode (for the algorithms that reserve), with costs of a few units or of billions,
/// refunds, give-backs by receipt, overdraws and lease releases among the checks, and a peek
/// before each finds the same in both. One Redis for all cases.
#[test]
fn memory_and_redis_agree() {
    let redis = TestRedis::shared();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 96,
        ..ProptestConfig::default()
    });
    let outcome = runner.run(
        &sequences(),
        |((algorithm, rules, guard, block), (quota, in_flight), max_delay, requests, scale)| {
            let mut builder = Policy::builder("agree").algorithm(algorithm);
            for (limit, period, burst) in rules {
                let rule = Rule::new(limit * scale, Duration::from_millis(period));
                builder = builder.rule(if algorithm == Algorithm::TokenBucket {
                    rule.burst(burst * scale)
                } else {
                    rule
                });
            }
            if guard {
                // Longer than any case runs, so its refusals don't depend on timing either.
                builder = builder.prevent_duplicate(Duration::from_secs(600));
            }
            let policy = builder.build().unwrap();
            let block_for = block.then_some(Duration::from_secs(3_600));
            let max_delay =
                Duration::from_millis(max_delay.filter(|_| algorithm.can_reserve()).unwrap_or(0));
            let quota = quota.map(|(limit, offset)| (limit * scale, offset));
            let prefix = unique_prefix("agree");
            // Both stores at one fixed time: a token bucket of billions an hour refills hundreds
            // of units a millisecond, so clocks a few milliseconds apart would show.
            let now_ms = u64::try_from(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_millis(),
            )
            .unwrap();
            let redis_store = store(&redis);
            redis_store.fix_time_for_tests(Some(now_ms * 1_000));
            let memory_store = MemoryStore::builder()
                .clock(ManualClock::new(now_ms))
                .build();
            let concurrency =
                in_flight.map(|most| ConcurrencyLimit::new(most, Duration::from_secs(36_000)));
            // Per key and store: its last admission (a receipt) and the leases it holds (a lease
            // is released by the key it was taken for: ids are unique per key).
            let mut admitted: HashMap<(String, bool), tower_redis_ratelimit::Decision> =
                HashMap::new();
            let mut leases: HashMap<(String, bool), Vec<u64>> = HashMap::new();
            let remaining = |d: &tower_redis_ratelimit::Decision| {
                d.rules
                    .iter()
                    .map(|r| (r.remaining, r.retry_after.is_some()))
                    .collect::<Vec<_>>()
            };
            runtime.block_on(async {
                for (who, cost, step) in requests {
                    let key = format!("{prefix}:p{}:user:{who}", cost % 2);
                    let quota_key = format!("{prefix}:daily:user:{who}");
                    let thresholds = quota.map(|(limit, _)| {
                        [50u8, 100].map(|percent| QuotaThreshold {
                            percent,
                            used: (u64::from(percent) * limit).div_ceil(100),
                        })
                    });
                    let quota =
                        quota
                            .zip(thresholds.as_ref())
                            .map(|((limit, offset), thresholds)| {
                                QuotaRequest::new(&quota_key, limit, 86_400_000, offset, thresholds)
                            });
                    let request = CheckRequest::new(&key, policy.rules(), algorithm)
                        .cost(cost * scale)
                        .max_delay(max_delay)
                        .block_for(block_for)
                        .quota(quota)
                        .concurrency(concurrency);
                    // A peek first: it finds the same in both, and changes nothing.
                    let peek_memory = memory_store.peek(&request).await.unwrap();
                    let peek_redis = redis_store.peek(&request).await.unwrap();
                    prop_assert_eq!(&peek_memory, &peek_redis);
                    let (in_memory, in_redis) = match step {
                        Step::Refund => {
                            let in_memory = memory_store.refund(&request).await.unwrap();
                            let in_redis = redis_store.refund(&request).await.unwrap();
                            prop_assert_eq!(&in_memory, &in_redis);
                            continue;
                        }
                        Step::GiveBack => {
                            let (Some(memory), Some(redis)) = (
                                admitted.get(&(key.clone(), false)),
                                admitted.get(&(key.clone(), true)),
                            ) else {
                                continue;
                            };
                            (
                                memory_store.give_back(&request, memory).await.unwrap(),
                                redis_store.give_back(&request, redis).await.unwrap(),
                            )
                        }
                        Step::Overdraw => (
                            memory_store.overdraw(&request).await.unwrap(),
                            redis_store.overdraw(&request).await.unwrap(),
                        ),
                        Step::Release => {
                            let taken = |in_redis: bool, leases: &mut HashMap<_, Vec<u64>>| {
                                let held = leases.entry((key.clone(), in_redis)).or_default();
                                (!held.is_empty()).then(|| held.remove(0))
                            };
                            if let (Some(memory), Some(redis)) =
                                (taken(false, &mut leases), taken(true, &mut leases))
                            {
                                memory_store.release(&request, memory).await.unwrap();
                                redis_store.release(&request, redis).await.unwrap();
                            }
                            continue;
                        }
                        Step::Check => {
                            let in_memory = memory_store.check(&request).await.unwrap();
                            let in_redis = redis_store.check(&request).await.unwrap();
                            for (decision, in_redis) in [(&in_memory, false), (&in_redis, true)] {
                                if decision.allowed {
                                    admitted.insert((key.clone(), in_redis), decision.clone());
                                }
                                if let Some(lease) = decision.lease {
                                    leases
                                        .entry((key.clone(), in_redis))
                                        .or_default()
                                        .push(lease);
                                }
                            }
                            prop_assert_eq!(in_memory.lease.is_some(), in_redis.lease.is_some());
                            (in_memory, in_redis)
                        }
                    };
                    prop_assert_eq!(in_memory.allowed, in_redis.allowed);
                    prop_assert_eq!(&in_memory.quota_alerts, &in_redis.quota_alerts);
                    prop_assert_eq!(remaining(&in_memory), remaining(&in_redis));
                    // Resets, retries and delays agree too, up to the two clocks' difference (the
                    // memory store's ms since its start against Redis TIME, a few ms apart at most).
                    let close =
                        |a: Duration, b: Duration| a.abs_diff(b) <= Duration::from_millis(500);
                    prop_assert!(
                        close(in_memory.delay, in_redis.delay),
                        "delay {:?} vs {:?}",
                        in_memory.delay,
                        in_redis.delay
                    );
                    for (memory, redis) in in_memory.rules.iter().zip(&in_redis.rules) {
                        prop_assert!(
                            close(memory.reset, redis.reset),
                            "reset {memory:?} vs {redis:?}"
                        );
                        if let (Some(a), Some(b)) = (memory.retry_after, redis.retry_after) {
                            prop_assert!(close(a, b), "retry {memory:?} vs {redis:?}");
                        }
                    }
                }
                Ok(())
            })?;
            assert_every_key_expires(&redis, &prefix);
            Ok(())
        },
    );
    if let Err(error) = outcome {
        panic!("{error}");
    }
}

/// The sliding counter's waits as `lua/sliding_counter.lua` computes them (its helper functions
/// run alone, on chosen counts and times), for one period.
fn lua_sliding_counter_waits(
    redis: &mut redis::Connection,
    (previous, current, cost, limit, period, elapsed): (u64, u64, u64, u64, u64, u64),
) -> (u64, u64) {
    let script = include_str!("../../lua/sliding_counter.lua");
    let helpers = &script[script.find("local function weighted").unwrap()
        ..script.find("-- (end of the helpers").unwrap()];
    let body = format!(
        "local floor = math.floor\nlocal ONE = 65536\n{helpers}\n\
         local a = {{}}\nfor i = 1, 6 do a[i] = tonumber(ARGV[i]) end\n\
         return {{wait_until_fits(a[2], a[3], a[1], a[4], a[5], a[6]), wait_until_frees(a[2], a[3], a[5], a[6])}}"
    );
    let (fits, frees): (u64, u64) = redis::cmd("EVAL")
        .arg(body)
        .arg(0)
        .arg(cost)
        .arg(previous)
        .arg(current)
        .arg(limit)
        .arg(period)
        .arg(elapsed)
        .query(redis)
        .unwrap();
    (fits, frees)
}

/// The script's waits are exact, checked against a millisecond-by-millisecond reading of the
/// definition: a refused request fits at `elapsed + wait` and not a millisecond earlier, and the used
/// count drops at `elapsed + reset` and not earlier.
#[test]
fn the_sliding_counter_script_waits_exactly() {
    let redis = TestRedis::shared();
    let client = std::cell::RefCell::new(redis.client());
    let cases = (
        1u64..400,
        1u64..3_000,
        0u64..=100,
        0u64..=100,
        1u64..20,
        0u64..100,
    );
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 200,
        ..ProptestConfig::default()
    });
    runner
        .run(
            &cases,
            |(limit, period, previous_share, current_share, cost, elapsed_share)| {
                let previous = limit * previous_share / 100;
                let current = limit * current_share / 100;
                let elapsed = period * elapsed_share / 100;
                // used = floor(previous * weight / 65536) + current,
                // weight = floor((period - t) * 65536 / period)
                let fade = |count: u64, t: u64| count * ((period - t) * 65_536 / period) / 65_536;
                let used_at = |t: u64| -> u64 {
                    if t < period {
                        fade(previous, t) + current
                    } else if t < 2 * period {
                        fade(current, t - period)
                    } else {
                        0
                    }
                };
                let first_after = |holds: &dyn Fn(u64) -> bool| {
                    (elapsed..=3 * period).find(|&t| holds(t)).unwrap()
                };
                let (fits, frees) = lua_sliding_counter_waits(
                    &mut client.borrow_mut(),
                    (previous, current, cost, limit, period, elapsed),
                );
                if cost > limit {
                    prop_assert_eq!(fits, period);
                } else if used_at(elapsed) + cost > limit {
                    let fits_at = first_after(&|t| used_at(t) + cost <= limit);
                    prop_assert_eq!(fits, fits_at - elapsed);
                }
                let now = used_at(elapsed);
                let frees_at = if now == 0 {
                    elapsed
                } else {
                    first_after(&|t| used_at(t) < now)
                };
                prop_assert_eq!(frees, frees_at - elapsed);
                Ok(())
            },
        )
        .unwrap();
}

/// A fixed window's counter busy in every window lives on from window to window (each window's
/// first request extends its expiry): it keeps the last two windows' counts, not one per window
/// it has lived through. So on the lean path of one rule, on that of several, and on the generic
/// path.
#[tokio::test]
async fn a_busy_fixed_window_counter_holds_two_windows_not_one_per_window_lived() {
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let rules = [Rule::per_second(1_000), Rule::per_minute(100_000)];
    for (case, rules, generic) in [
        ("lean_one", &rules[..1], false),
        ("lean_two", &rules[..], false),
        ("generic", &rules[..], true),
    ] {
        let store = store(&redis);
        store.generic_checks_for_tests(generic);
        let key = format!("{}:api:ann", unique_prefix(case));
        // An hour ahead of Redis's clock, so no key expires by Redis's time while the test runs.
        let start_us = (SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
            / 1_000_000
            + 3_600)
            * 1_000_000;
        for second in 0..6 {
            store.fix_time_for_tests(Some(start_us + second * 1_000_000 + 500_000));
            let request = CheckRequest::new(&key, rules, Algorithm::FixedWindow);
            for _ in 0..3 {
                assert!(store.check(&request).await.unwrap().allowed, "{case}");
            }
        }
        let counter = format!("{}:{{{key}}}:fw:1000:1000", key.split(':').next().unwrap());
        let windows: HashMap<String, u64> = client.hgetall(&counter).unwrap();
        let last = (start_us / 1_000 + 5_000).to_string();
        let before = (start_us / 1_000 + 4_000).to_string();
        assert_eq!(
            windows,
            HashMap::from([(before, 3), (last.clone(), 3)]),
            "{case}: {counter}"
        );
        // It lives to the end of its last window, as before.
        assert_eq!(
            expire_time_ms(&mut client, &counter),
            i64::try_from(start_us / 1_000 + 6_000).unwrap(),
            "{case}"
        );
    }
}
