//! What each kind of policy costs Redis per request, counted in commands (`INFO commandstats`): a
//! request is one round trip whatever its rules, its quota, duplicate guard and block included; a
//! check runs only the commands its rules and options need, and the work a request leaves for
//! after its response (a give-back, a settle, a lease's release) is one more entry of a batch,
//! never a script call of its own beside it. On every Redis version the suite runs on.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::routing::get;
use common::redis_server::{
    TestRedis, command_calls, has_functions, store_call_command, unique_prefix,
};
use common::redis_store::{self, assert_every_key_expires, store};
use common::{app, recording_usage, request_from, send};
use http::StatusCode;
use tower_redis_ratelimit::meter::Meter;
use tower_redis_ratelimit::quota::Quota;
use tower_redis_ratelimit::store::{CheckRequest, QuotaRequest, RedisStore};
use tower_redis_ratelimit::{
    Algorithm, Mode, Policy, PolicyBuilder, RateLimitLayer, RateLimiter, Refused, Rule, Store,
};

const PEER: &str = "203.0.113.10:4000";
/// Requests counted per kind, after one that loads the library and opens the windows.
const REQUESTS: u64 = 20;

/// A token bucket's rule: a unit drips back every 3.6 s, so each request of a test finds the
/// bucket in debt (its key there), and none is refused.
const BUCKET: Rule = Rule::per_hour(1_000);

/// A policy of one rule per hour that no test reaches, so no request opens a window.
fn hourly(name: &str, prefix: &str, algorithm: Algorithm) -> PolicyBuilder {
    Policy::builder(name)
        .prefix(prefix)
        .algorithm(algorithm)
        .rule(Rule::per_hour(1_000_000))
}

/// A route the handle guards: it checks the client, then gives the admission back by its receipt.
fn refunding(limiter: RateLimiter) -> Router {
    async fn hello(State(limiter): State<RateLimiter>) -> Result<&'static str, Refused> {
        let admitted = limiter.check("203.0.113.10").await?;
        admitted.refund().await.expect("a refund");
        Ok("hello")
    }
    Router::new()
        .route("/{used}", get(hello))
        .with_state(limiter)
}

/// How many times Redis has run `command` (as `INFO commandstats` names it).
fn calls_of(client: &mut redis::Connection, command: &str) -> u64 {
    command_calls(client).get(command).copied().unwrap_or(0)
}

/// The commands Redis ran for `REQUESTS` requests to `app`, one after another, each counted once
/// the store calls it started have all landed (`calls_per_request` of them each): per command, as
/// `INFO commandstats` names it, less the test's own reads.
async fn commands_of(
    app: &Router,
    redis: &TestRedis,
    calls_per_request: u64,
) -> HashMap<String, u64> {
    let mut client = redis.client();
    let store_call = store_call_command(&mut client);
    assert_eq!(
        send(app, request_from(PEER, "/100")).await.status(),
        StatusCode::OK
    );
    let landed = |client: &mut redis::Connection, wanted: u64| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let calls = calls_of(client, store_call);
            if calls >= wanted || Instant::now() > deadline {
                return calls;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    // The warm-up's calls (the library's load among them) land before the count starts.
    let first = calls_of(&mut client, store_call);
    landed(&mut client, first.max(calls_per_request));
    let before = command_calls(&mut client);
    for _ in 0..REQUESTS {
        assert_eq!(
            send(app, request_from(PEER, "/100")).await.status(),
            StatusCode::OK
        );
    }
    let start = before.get(store_call).copied().unwrap_or(0);
    landed(&mut client, start + REQUESTS * calls_per_request);
    let after = command_calls(&mut client);
    after
        .iter()
        .map(|(name, calls)| (name.clone(), calls - before.get(name).copied().unwrap_or(0)))
        // The test's own reads (INFO, and the CLIENT SETINFO of a new connection).
        .filter(|(name, calls)| {
            let command = name.split('|').next().unwrap_or(name);
            *calls > 0 && !["info", "client"].contains(&command)
        })
        .collect()
}

/// `per_request` commands for each of `REQUESTS` requests, with `calls` script calls (each with
/// its TIME).
fn wanted(
    client: &mut redis::Connection,
    calls: u64,
    per_request: &[(&str, u64)],
) -> HashMap<String, u64> {
    let store_call = store_call_command(client);
    // Each request's check reads whether its policy has run-time overrides (the gate, once per
    // batch: here every batch is one request's).
    [(store_call, calls), ("time", calls), ("exists", 1)]
        .iter()
        .chain(per_request)
        .map(|(name, count)| ((*name).to_owned(), count * REQUESTS))
        .collect()
}

/// A kind of policy: its name, its app, the script calls a request makes, and the commands a
/// request runs, by name.
type Case = (&'static str, Router, u64, Vec<(&'static str, u64)>);

/// The commands of a token bucket's check of a bucket in debt: its read, then its new full time,
/// moved by the difference (`INCRBY`) with its expiry made later only (`PEXPIREAT … GT`); Redis
/// 6.2, without `GT`, writes both with one `SET … PXAT`.
fn bucket(seven: bool) -> Vec<(&'static str, u64)> {
    if seven {
        vec![("get", 1), ("incrby", 1), ("pexpireat", 1)]
    } else {
        vec![("get", 1), ("set", 1)]
    }
}

/// The commands of a fixed window's check and the give-back of all of it (by count_only or a
/// receipt), alone on its key: the check's charge, the give-back's reading of the reset marker
/// and its take-back. The give-back leaves the window's count at 0, so the next charge is the
/// window's first again as far as its count can tell, and makes sure of the key's expiry
/// (`PEXPIREAT … NX`, which finds one, then `GT`; Redis 6.2 reads it with `PTTL`) and drops the
/// count of the window before the last, as a window's first charge does.
fn given_back(seven: bool) -> Vec<(&'static str, u64)> {
    let expiry = if seven { ("pexpireat", 2) } else { ("pttl", 1) };
    vec![("hincrby", 2), ("get", 1), expiry, ("hdel", 1)]
}

#[tokio::test]
async fn each_kind_of_policy_runs_only_the_commands_it_needs() {
    // A server of our own, so no other test's commands are counted.
    let redis = TestRedis::own();
    let mut client = redis.client();
    let seven = has_functions(&mut client);
    let store = || {
        RedisStore::from_url(&redis.url)
            .expect("a Redis URL")
            .timeout(Duration::from_secs(10))
    };
    let layer = |policy: Policy| {
        Router::new()
            .route("/{used}", get(|| async { "ok" }))
            .layer(RateLimitLayer::new(policy, store()))
    };
    let quota = Quota::builder("daily")
        .prefix("calls")
        .tier("all", 1_000_000)
        .build()
        .unwrap();
    // A leases key new at each request (the one before released it) takes its expiry in one
    // command on every version.
    let cases: Vec<Case> = vec![
        (
            "fixed window",
            layer(
                hourly("fw", "calls", Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            ),
            1,
            vec![("hincrby", 1)],
        ),
        (
            "token bucket",
            layer(
                Policy::builder("tb")
                    .prefix("calls")
                    .algorithm(Algorithm::TokenBucket)
                    .rule(BUCKET)
                    .build()
                    .unwrap(),
            ),
            1,
            bucket(seven),
        ),
        (
            "sliding counter",
            layer(
                hourly("sc", "calls", Algorithm::SlidingCounter)
                    .build()
                    .unwrap(),
            ),
            1,
            // Its read, then its count moved by the cost (the window was opened already).
            vec![("hmget", 1), ("hincrby", 1)],
        ),
        (
            "a rule and a daily quota",
            layer(
                hourly("quota", "calls", Algorithm::FixedWindow)
                    .quota(quota)
                    .build()
                    .unwrap(),
            ),
            1,
            vec![("hincrby", 2)],
        ),
        (
            "a rule and a penalty block",
            layer(
                hourly("block", "calls", Algorithm::FixedWindow)
                    .block_for(Duration::from_secs(900))
                    .build()
                    .unwrap(),
            ),
            1,
            vec![("get", 1), ("hincrby", 1)],
        ),
        (
            "delay mode on a token bucket",
            layer(
                Policy::builder("delay")
                    .prefix("calls")
                    .algorithm(Algorithm::TokenBucket)
                    .rule(BUCKET)
                    .mode(Mode::Delay {
                        max_delay: Duration::from_secs(2),
                    })
                    .build()
                    .unwrap(),
            ),
            1,
            bucket(seven),
        ),
        (
            "a rule and a concurrency limit, its lease released in a batch",
            layer(
                hourly("inflight", "calls", Algorithm::FixedWindow)
                    .max_in_flight(1_000)
                    .lease(Duration::from_secs(60))
                    .build()
                    .unwrap(),
            ),
            2,
            // The leases' earliest (none: the key is gone, nothing to count), the lease and its
            // expiry; the release.
            vec![
                ("hincrby", 1),
                ("lrange", 1),
                ("rpush", 1),
                ("pexpireat", 1),
                ("lrem", 1),
            ],
        ),
        (
            "count_only, every success given back",
            layer(
                hourly("count-only", "calls", Algorithm::FixedWindow)
                    .count_only(|status| status != StatusCode::OK)
                    .build()
                    .unwrap(),
            ),
            2,
            // The check's charge; the give-back's reading of the reset marker and its take-back.
            given_back(seven),
        ),
        (
            "a refund by receipt",
            refunding(RateLimiter::new(
                hourly("refund", "calls", Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
                store(),
            )),
            2,
            given_back(seven),
        ),
        (
            "a metered rule settled below its estimate",
            recording_usage(
                Policy::builder("settle")
                    .prefix("calls")
                    .algorithm(Algorithm::FixedWindow)
                    .rule(Rule::per_hour(1_000_000_000).metered())
                    .meter(Meter::new("tokens").estimate(|_| 500))
                    .build()
                    .unwrap(),
                store(),
            ),
            2,
            vec![("hincrby", 2), ("get", 1)],
        ),
    ];
    for (kind, app, calls, per_request) in cases {
        let mut sent = commands_of(&app, &redis, calls).await;
        if !seven {
            // Redis 6.2 extends an expiry it read (PTTL) only when it falls short: by then a
            // millisecond may have passed.
            let extended = sent.remove("pexpire").unwrap_or(0);
            assert!(
                extended <= sent.get("pttl").copied().unwrap_or(0),
                "{kind}: {sent:?}"
            );
        }
        assert_eq!(
            sent,
            wanted(&mut client, calls, &per_request),
            "{kind} (Redis {})",
            if seven { "7 and on" } else { "before 7" }
        );
    }
}

#[tokio::test]
async fn a_sliding_log_trims_reads_both_ends_adds_and_extends() {
    let redis = TestRedis::own();
    let mut client = redis.client();
    let app = Router::new()
        .route("/{used}", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(
            hourly("sl", "calls", Algorithm::SlidingLog)
                .build()
                .unwrap(),
            RedisStore::from_url(&redis.url).expect("a Redis URL"),
        ));
    let mut sent = commands_of(&app, &redis, 1).await;
    let mut per_request = vec![("zremrangebyscore", 1), ("zrange", 2), ("zadd", 1)];
    if has_functions(&mut client) {
        // PEXPIREAT … GT extends the expiry in one command.
        per_request.push(("pexpireat", 1));
    } else {
        // Redis 6.2 reads the expiry (PTTL) and extends it (PEXPIRE) unless it already reaches
        // far enough: not when an earlier request of the same millisecond extended it.
        per_request.push(("pttl", 1));
        let extended = sent.remove("pexpire").unwrap_or(0);
        assert!((1..=REQUESTS).contains(&extended), "{sent:?}");
    }
    assert_eq!(sent, wanted(&mut client, 1, &per_request));
}

#[tokio::test]
async fn the_leases_a_batch_takes_go_in_one_push() {
    // 200 leases of one identity at once: each gets an id of its own without asking Redis, and
    // a batch pushes its leases in one RPUSH (and reads the list's last at most once).
    let redis = TestRedis::own();
    let mut client = redis.client();
    let policy = Policy::builder("leases")
        .prefix("calls")
        .max_in_flight(10_000)
        .lease(Duration::from_secs(60))
        .build()
        .unwrap();
    let limiter = RateLimiter::new(
        policy,
        RedisStore::from_url(&redis.url).expect("a Redis URL"),
    );
    limiter.acquire("warm-up").await.expect("a slot");
    let before = command_calls(&mut client);
    let held: Vec<_> =
        futures_util::future::join_all((0..200).map(|_| limiter.acquire("one-identity")))
            .await
            .into_iter()
            .map(|slot| slot.expect("a slot"))
            .collect();
    let after = command_calls(&mut client);
    let calls =
        |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    let batches = calls(store_call_command(&mut client));
    assert!(
        batches < 200,
        "the leases were taken in batches: {batches} calls"
    );
    assert!(
        calls("rpush") <= batches && calls("lindex") <= batches,
        "{} RPUSH, {} LINDEX in {batches} calls",
        calls("rpush"),
        calls("lindex")
    );
    let leases: Vec<String> = redis::cmd("LRANGE")
        .arg("calls:{one-identity}:leases:leases")
        .arg(0)
        .arg(-1)
        .query(&mut client)
        .unwrap();
    assert_eq!(leases.len(), 200, "every lease pushed");
    let mut ids: Vec<u64> = leases.iter().map(|id| id.parse().unwrap()).collect();
    assert!(ids.is_sorted(), "the list is in expiry order");
    ids.dedup();
    assert_eq!(ids.len(), 200, "each lease its own id");
    drop(held);
}

#[tokio::test]
async fn a_refused_check_only_reads_the_quota() {
    // A flood past a rule: each refusal charges and takes back the rule's count (one command
    // each, however the check went), and reads the day's quota without writing it.
    let redis = TestRedis::own();
    let mut client = redis.client();
    let store = RedisStore::from_url(&redis.url).expect("a Redis URL");
    let rules = [Rule::per_hour(1)];
    let quota = QuotaRequest::new("calls:daily:ip:1", 1_000, 86_400_000, 0, &[]);
    let request =
        CheckRequest::new("calls:flood:ip:1", &rules, Algorithm::FixedWindow).quota(Some(quota));
    assert!(store.check(&request).await.unwrap().allowed);
    let before = command_calls(&mut client);
    for _ in 0..REQUESTS {
        assert!(!store.check(&request).await.unwrap().allowed);
    }
    let after = command_calls(&mut client);
    let sent =
        |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    assert_eq!(
        (sent("hincrby"), sent("hget")),
        (2 * REQUESTS, REQUESTS),
        "{after:?}"
    );
}

/// Under load a hot key's batch carries many give-backs alike (the requests of one batch share
/// its time, so their receipts match): where units simply come off counts (a fixed window, a
/// sliding counter), the batch sends them as one entry, their units summed, and each is answered.
/// The counts left are those of one give-back after another, as the memory store's are.
#[tokio::test]
async fn identical_give_backs_of_one_batch_go_as_one_entry_and_leave_the_same_counts() {
    let redis = TestRedis::own();
    let mut client = redis.client();
    let rules = [Rule::per_hour(1_000)];
    // Not across an hour's end, where the counts would start again.
    let into_hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
        % 3_600;
    if into_hour > 3_590 {
        tokio::time::sleep(Duration::from_secs(3_601 - into_hour)).await;
    }
    for (algorithm, name) in [
        (Algorithm::FixedWindow, "merge-fw"),
        (Algorithm::SlidingCounter, "merge-sc"),
    ] {
        let store = RedisStore::from_url(&redis.url)
            .expect("a Redis URL")
            .timeout(Duration::from_secs(10));
        let memory = tower_redis_ratelimit::MemoryStore::new();
        let key = format!("{name}:{{ip:203.0.113.10}}");
        let request = CheckRequest::new(&key, &rules, algorithm)
            .identity("ip:203.0.113.10")
            .cost(3);
        // 40 checks at once: the first goes alone, the others share the next call's time.
        let checks = (0..40).map(|_| store.check(&request));
        let decisions: Vec<_> = futures_util::future::join_all(checks)
            .await
            .into_iter()
            .map(|decision| decision.expect("a check"))
            .collect();
        let batched = &decisions[1..];
        assert!(
            batched
                .iter()
                .all(|decision| decision.now_unix_ms == batched[0].now_unix_ms),
            "the queued checks went in one call"
        );
        let mut in_memory = Vec::new();
        for decision in &decisions {
            assert!(decision.allowed);
            in_memory.push(memory.check(&request).await.expect("a memory check"));
        }
        let before = command_calls(&mut client);
        // Their give-backs at once: the first goes alone, the other 38 queue behind it.
        let give_backs = batched
            .iter()
            .map(|decision| store.give_back(&request, decision));
        let answers = futures_util::future::join_all(give_backs).await;
        let after = command_calls(&mut client);
        // The first went alone (117 of its 120 units left); the others together, each told what
        // they all left.
        let remaining: Vec<u64> = answers
            .into_iter()
            .map(|answer| answer.expect("a give-back").rules[0].remaining)
            .collect();
        assert_eq!(remaining[0], 1_000 - 117, "{name}");
        assert!(
            remaining[1..].iter().all(|&left| left == 1_000 - 3),
            "{name}: {remaining:?}"
        );
        let writes = |calls: &HashMap<String, u64>| {
            ["hincrby", "hset"]
                .iter()
                .map(|name| calls.get(*name).copied().unwrap_or(0))
                .sum::<u64>()
        };
        let written = writes(&after) - writes(&before);
        assert!(
            written <= 4,
            "{name}: 39 give-backs alike wrote {written} times: they went one by one"
        );
        // The same counts as one give-back after another (the memory store's).
        for decision in &in_memory[1..] {
            memory
                .give_back(&request, decision)
                .await
                .expect("a memory give-back");
        }
        let in_memory = memory.peek(&request.cost(1)).await.expect("a memory peek");
        let peek = store.peek(&request.cost(1)).await.expect("a peek");
        assert_eq!(
            peek.rules[0].remaining,
            1_000 - 3,
            "{name}: the first check's 3 units are all that count"
        );
        assert_eq!(peek.rules[0].remaining, in_memory.rules[0].remaining);
    }
}

#[tokio::test]
async fn releases_of_one_key_in_a_batch_end_together_at_the_head_of_its_leases() {
    // 40 leases of one identity, released at once, the last taken first: the first release goes
    // alone, the others queue behind it and go as one entry, their ids in the list's order,
    // which ends them with one LTRIM (they lead the list) after one read of them all.
    let redis = TestRedis::own();
    let mut client = redis.client();
    let policy = Policy::builder("releases")
        .prefix("calls")
        .max_in_flight(1_000)
        .lease(Duration::from_secs(60))
        .build()
        .unwrap();
    let store = RedisStore::from_url(&redis.url)
        .expect("a Redis URL")
        .timeout(Duration::from_secs(10));
    let request = CheckRequest::new(
        "calls:releases:user:ann",
        policy.rules(),
        policy.algorithm(),
    )
    .identity("user:ann")
    .concurrency(policy.concurrency());
    let mut leases = Vec::new();
    for _ in 0..40 {
        leases.push(store.check(&request).await.unwrap().lease.expect("a slot"));
    }
    let list = "calls:{user:ann}:releases:leases";
    let held: u64 = redis::cmd("LLEN").arg(list).query(&mut client).unwrap();
    assert_eq!(held, 40);
    let before = command_calls(&mut client);
    let released = leases
        .iter()
        .rev()
        .map(|&lease| store.release(&request, lease));
    for result in futures_util::future::join_all(released).await {
        result.expect("a release");
    }
    let after = command_calls(&mut client);
    let calls =
        |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    assert!(
        calls("lrem") <= 1 && calls("ltrim") <= 1 && calls("lrange") <= 2,
        "39 releases went apart: {} LREM, {} LTRIM, {} LRANGE",
        calls("lrem"),
        calls("ltrim"),
        calls("lrange")
    );
    let held: u64 = redis::cmd("LLEN").arg(list).query(&mut client).unwrap();
    assert_eq!(held, 0, "every lease ended");
    // Every slot is free again, and each lease released once: a second release ends nothing.
    let check = store.check(&request).await.unwrap();
    assert_eq!(check.rules.last().unwrap().remaining, 999);
    let again = leases.iter().map(|&lease| store.release(&request, lease));
    for result in futures_util::future::join_all(again).await {
        result.expect("a release");
    }
    let held: u64 = redis::cmd("LLEN").arg(list).query(&mut client).unwrap();
    assert_eq!(held, 1, "the new lease holds, the old ones ended once");
}

#[tokio::test]
async fn a_batch_charges_a_hot_quota_in_two_commands_and_counts_exactly() {
    // 50 checks at once of one identity's daily quota of 30 (one taken already): the first goes
    // alone, the others in batches, each batch's first charge at once and the rest counted in
    // the batch and written at its end, refusals' charges taken back among them.
    let redis = TestRedis::own();
    let mut client = redis.client();
    let store = RedisStore::from_url(&redis.url)
        .expect("a Redis URL")
        .timeout(Duration::from_secs(10));
    let quota = QuotaRequest::new("calls:daily:ip:2", 30, 86_400_000, 0, &[]).identity("ip:2");
    let request = CheckRequest::new("calls:hot:ip:2", &[], Algorithm::FixedWindow)
        .identity("ip:2")
        .quota(Some(quota));
    assert!(store.check(&request).await.unwrap().allowed);
    let before = command_calls(&mut client);
    let decisions = futures_util::future::join_all((0..50).map(|_| store.check(&request))).await;
    let after = command_calls(&mut client);
    let calls =
        |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    let admitted = decisions
        .into_iter()
        .filter(|decision| decision.as_ref().expect("a check").allowed)
        .count();
    assert_eq!(admitted, 29, "the quota's 30, one taken before");
    let batches = calls(store_call_command(&mut client));
    assert!(
        calls("hincrby") <= 2 * batches && batches < 50,
        "{} HINCRBY in {batches} calls",
        calls("hincrby")
    );
    let days: HashMap<String, u64> = redis::cmd("HGETALL")
        .arg("calls:{ip:2}:daily:q:86400000:0")
        .query(&mut client)
        .unwrap();
    assert_eq!(days.values().sum::<u64>(), 30, "{days:?}");
    let ttl: i64 = redis::cmd("PTTL")
        .arg("calls:{ip:2}:daily:q:86400000:0")
        .query(&mut client)
        .unwrap();
    assert!(ttl > 0, "the quota's key lives to the day's end: {ttl}");
}

#[tokio::test]
async fn a_batch_writes_a_hot_bucket_or_sliding_counter_once_and_counts_exactly() {
    // 50 checks at once of one key's limit of 30 (one taken already): the first goes alone, the
    // others in batches, each batch reading the key once and writing what its checks charged
    // once, at its end.
    let redis = TestRedis::own();
    let mut client = redis.client();
    let store = RedisStore::from_url(&redis.url)
        .expect("a Redis URL")
        .timeout(Duration::from_secs(10));
    let rules = [Rule::per_hour(30)];
    for (algorithm, writes) in [
        (Algorithm::TokenBucket, &["incrby", "pexpireat", "set"][..]),
        (
            Algorithm::SlidingCounter,
            &["hincrby", "hset", "pexpireat"][..],
        ),
    ] {
        let key = format!("calls:hot-{algorithm}:ip:3");
        let request = CheckRequest::new(&key, &rules, algorithm);
        assert!(store.check(&request).await.unwrap().allowed);
        let before = command_calls(&mut client);
        let decisions =
            futures_util::future::join_all((0..50).map(|_| store.check(&request))).await;
        let after = command_calls(&mut client);
        let calls = |name: &str| {
            after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0)
        };
        let admitted = decisions
            .into_iter()
            .filter(|decision| decision.as_ref().expect("a check").allowed)
            .count();
        assert_eq!(
            admitted, 29,
            "{algorithm}: the limit's 30, one taken before"
        );
        let batches = calls(store_call_command(&mut client));
        let written: u64 = writes.iter().map(|name| calls(name)).sum();
        assert!(
            written <= 2 * batches && batches < 50,
            "{algorithm}: {written} writes in {batches} calls"
        );
        // What the batches wrote is all of it: the next check is refused, and the key expires.
        let next = store.check(&request).await.unwrap();
        assert!(!next.allowed, "{algorithm}: {next:?}");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("*hot-{algorithm}*"))
            .query(&mut client)
            .unwrap();
        assert_eq!(keys.len(), 1, "{keys:?}");
        let ttl: i64 = redis::cmd("PTTL").arg(&keys[0]).query(&mut client).unwrap();
        assert!(ttl > 0, "{algorithm}: the key expires: {ttl}");
        if algorithm == Algorithm::SlidingCounter {
            let count: u64 = redis::cmd("HGET")
                .arg(&keys[0])
                .arg("c")
                .query(&mut client)
                .unwrap();
            assert_eq!(count, 30, "{algorithm}");
        }
    }
}

/// A test can wait for the calls a response leaves behind rather than sleep for them: once
/// `until_calls_land_for_tests` returns, Redis has run the request's check and its `count_only`
/// give-back, even one Redis held back (the handler of `/pause` pauses writes for 200 ms, after
/// its check, so the give-back, sent after the response, waits at the server: a test that read
/// the counts at once would find its request a call short).
#[tokio::test]
async fn a_test_waits_for_the_give_backs_a_response_leaves_until_they_land() {
    let redis = TestRedis::own();
    let mut client = redis.client();
    let store_call = store_call_command(&mut client);
    let store = RedisStore::from_url(&redis.url)
        .expect("a Redis URL")
        .timeout(Duration::from_secs(10));
    let policy = hourly("landing", "calls", Algorithm::FixedWindow)
        .count_only(|status| status != StatusCode::OK)
        .build()
        .unwrap();
    let url = redis.url.clone();
    let pausing = move |Path(used): Path<String>| {
        let url = url.clone();
        async move {
            if used != "pause" {
                return "ok";
            }
            let mut pauser = redis::Client::open(url.as_str())
                .and_then(|client| client.get_connection())
                .expect("a connection");
            redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(200)
                .arg("WRITE")
                .query::<()>(&mut pauser)
                .expect("writes paused");
            "ok"
        }
    };
    let app = Router::new()
        .route("/{used}", get(pausing))
        .layer(RateLimitLayer::new(policy, store.clone()));
    // The first request loads the library. A call of the store's own after it runs after its
    // give-back (one queue, one connection, in order): the count starts after both, whatever
    // the hook does.
    assert_eq!(
        send(&app, request_from(PEER, "/1")).await.status(),
        StatusCode::OK
    );
    let rules = [Rule::per_hour(1_000)];
    let after = CheckRequest::new("landing:{after}", &rules, Algorithm::FixedWindow);
    store.peek(&after).await.expect("a peek");
    let start = calls_of(&mut client, store_call);
    for request in 1..=3 {
        assert_eq!(
            send(&app, request_from(PEER, "/pause")).await.status(),
            StatusCode::OK
        );
        store.until_calls_land_for_tests().await;
        let calls = calls_of(&mut client, store_call);
        assert_eq!(
            calls - start,
            2 * request,
            "a check and a give-back per request, landed"
        );
    }
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
    let before = redis_store::command_calls(&redis);
    for _ in 0..50 {
        assert_eq!(
            send(&app, request_from(PEER, "/")).await.status(),
            StatusCode::OK
        );
    }
    let after = redis_store::command_calls(&redis);
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
        // Whether the policy has run-time overrides: once per batch, one request's here.
        ("exists", 50),
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
    let before = redis_store::command_calls(&redis);
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(
            send(&app, request_from(PEER, "/")).await.status(),
            StatusCode::OK
        );
    }
    let after = redis_store::command_calls(&redis);
    let call = store_call_command(&mut redis.client());
    let calls = after[call] - before.get(call).copied().unwrap_or(0);
    assert_eq!(
        calls, 20,
        "one {call} per request, quota, guard and block included"
    );
    assert_every_key_expires(&redis, &prefix);
}
