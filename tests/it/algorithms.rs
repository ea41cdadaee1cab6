//! Each algorithm's own edges, on Redis: requests on both sides of a window's edge in Redis's
//! time (the fixed window admits both sides, the sliding log and the token bucket one, the
//! sliding counter as its weighting says), a token bucket's burst then drip, a sliding log
//! renumbered before its member numbers reach 2^53, a log first charged after a free check of its
//! batch, the sliding counter script's exact waits, a busy fixed-window counter that keeps two
//! windows, and a request of cost 0 answered by every script as by the memory store.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::redis_server::{TestRedis, expire_time_ms, unique_prefix};
use common::redis_store::{assert_every_key_expires, store};
use common::{app, request_from, send};
use http::StatusCode;
use proptest::prelude::*;
use redis::Commands;
use tower_redis_ratelimit::store::CheckRequest;
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Rule, Store};

const PEER: &str = "203.0.113.10:4000";

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
