//! Group commit on Redis: a batch of checks decides exactly what the same checks one call at a
//! time decide, batches form under concurrency without losing exactness, a failing check fails
//! alone, and the queue survives timeouts and dropped requests.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proptest::prelude::*;
use tower_redis_ratelimit::quota::QuotaThreshold;
use tower_redis_ratelimit::store::{CheckRequest, QuotaRequest, RedisStore, Store, StoreError};
use tower_redis_ratelimit::{Algorithm, Mode, Policy, Rule};

use common::redis_server::{TestRedis, unique_prefix};

fn store(redis: &TestRedis) -> RedisStore {
    RedisStore::from_url(&redis.url)
        .expect("a valid Redis URL")
        .timeout(Duration::from_secs(10))
}

/// The policies the property test mixes: every algorithm, delays, the duplicate guard, penalty
/// blocks, (on the requests of policy 4) a daily quota with alerts, and the common case of
/// `lua/fast.lua` (policies 0, 5, 7 and 8: no option at all; 7 and 8 with one rule, which
/// `fast.fw` takes without tables).
fn policies() -> Vec<Policy> {
    let delay = |ms| Mode::Delay {
        max_delay: Duration::from_millis(ms),
    };
    vec![
        Policy::builder("fw")
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::new(3, Duration::from_secs(1)))
            .rule(Rule::per_minute(10))
            .build()
            .unwrap(),
        Policy::builder("sl")
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::new(4, Duration::from_secs(1)))
            .mode(delay(2_000))
            .build()
            .unwrap(),
        Policy::builder("sc")
            .algorithm(Algorithm::SlidingCounter)
            .rule(Rule::new(5, Duration::from_secs(10)))
            .block_for(Duration::from_secs(5))
            .build()
            .unwrap(),
        Policy::builder("tb")
            .algorithm(Algorithm::TokenBucket)
            .rule(Rule::new(3, Duration::from_secs(1)).burst(5))
            .prevent_duplicate(Duration::from_millis(200))
            .mode(delay(1_000))
            .build()
            .unwrap(),
        Policy::builder("quota")
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::per_minute(4))
            .build()
            .unwrap(),
        Policy::builder("log")
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::new(3, Duration::from_secs(1)))
            .rule(Rule::new(6, Duration::from_secs(5)))
            .build()
            .unwrap(),
        Policy::builder("guarded")
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::new(2, Duration::from_millis(500)))
            .prevent_duplicate(Duration::from_millis(300))
            .block_for(Duration::from_secs(2))
            .build()
            .unwrap(),
        Policy::builder("window")
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::new(3, Duration::from_secs(1)))
            .build()
            .unwrap(),
        Policy::builder("one_log")
            .algorithm(Algorithm::SlidingLog)
            .rule(Rule::new(2, Duration::from_millis(700)))
            .build()
            .unwrap(),
    ]
}

const THRESHOLDS: [QuotaThreshold; 2] = [
    QuotaThreshold {
        percent: 50,
        used: 3,
    },
    QuotaThreshold {
        percent: 100,
        used: 6,
    },
];

/// One request of the property test: which policy, which identity, what cost.
#[derive(Debug, Clone, Copy)]
struct Planned {
    policy: usize,
    identity: usize,
    cost: u64,
}

/// The keys of `planned` under `prefix`: the policy's key and the quota's.
fn keys_of(prefix: &str, planned: &Planned, policies: &[Policy]) -> (String, String, String) {
    let identity = format!("user:{}", planned.identity);
    (
        format!("{prefix}:{}:{identity}", policies[planned.policy].name()),
        format!("{prefix}:daily:{identity}"),
        identity,
    )
}

fn request_of<'a>(
    planned: &Planned,
    policies: &'a [Policy],
    (key, quota_key, identity): &'a (String, String, String),
) -> CheckRequest<'a> {
    let policy = &policies[planned.policy];
    let quota = (policy.name() == "quota")
        .then(|| QuotaRequest::new(quota_key, 6, 86_400_000, 0, &THRESHOLDS).identity(identity));
    CheckRequest::new(key, policy.rules(), policy.algorithm())
        .identity(identity)
        .cost(planned.cost)
        .max_delay(policy.mode().max_delay())
        .block_for(policy.block_for())
        .quota(quota)
}

fn planned() -> impl Strategy<Value = Planned> {
    (
        0..policies().len(),
        0..2usize,
        prop_oneof![3 => Just(1u64), 1 => 0..5u64],
    )
        .prop_map(|(policy, identity, cost)| Planned {
            policy,
            identity,
            cost,
        })
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Deletes the keys under `prefix` (their windows are an hour ahead of Redis's clock).
fn delete_keys(redis: &TestRedis, prefix: &str) {
    let mut client = redis.client();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(&mut client)
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL").arg(keys).query(&mut client).unwrap();
    }
}

/// Rounds of requests, each round at one instant: one batch call on one store decides exactly
/// what one call per request, in the same order, decides on another (every decision and rule
/// state, quota alerts included), and the lean functions of the common case exactly what the
/// generic ones decide. One Redis serves every case.
#[test]
fn a_batch_decides_exactly_as_one_call_per_request() {
    let redis = TestRedis::shared();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    });
    let rounds =
        prop::collection::vec((0..1_500u64, prop::collection::vec(planned(), 1..14)), 1..6);
    let result = runner.run(&rounds, |rounds| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let policies = policies();
        let (batched_prefix, single_prefix) = (unique_prefix("batched"), unique_prefix("single"));
        let (batched, single) = (store(&redis), store(&redis));
        // One at a time, the checks without options take `lua/entry.lua`'s check rather than
        // the lean ones of lua/fast.lua: they must decide alike too.
        single.generic_checks_for_tests(true);
        // An hour ahead of Redis's clock, so no key expires by Redis's time while the test runs:
        // every window is the scripts' own arithmetic on the fixed time.
        let mut now_us = unix_us() + 3_600_000_000;
        let outcome = runtime.block_on(async {
            for (step_ms, requests) in &rounds {
                now_us += step_ms * 1_000;
                batched.fix_time_for_tests(Some(now_us));
                single.fix_time_for_tests(Some(now_us));
                let batched_keys: Vec<_> = requests
                    .iter()
                    .map(|p| keys_of(&batched_prefix, p, &policies))
                    .collect();
                let single_keys: Vec<_> = requests
                    .iter()
                    .map(|p| keys_of(&single_prefix, p, &policies))
                    .collect();
                let batch: Vec<CheckRequest<'_>> = requests
                    .iter()
                    .zip(&batched_keys)
                    .map(|(planned, keys)| request_of(planned, &policies, keys))
                    .collect();
                let decided = batched.check_batch_for_tests(&batch).await;
                for ((planned, keys), in_batch) in requests.iter().zip(&single_keys).zip(decided) {
                    let alone = single.check(&request_of(planned, &policies, keys)).await;
                    let (in_batch, alone) = (in_batch.unwrap(), alone.unwrap());
                    if in_batch != alone {
                        return Err(format!(
                            "{planned:?} at {now_us} µs: batched {in_batch:?}, alone {alone:?}"
                        ));
                    }
                }
            }
            Ok(())
        });
        delete_keys(&redis, &batched_prefix);
        delete_keys(&redis, &single_prefix);
        let stats = batched.batch_stats();
        prop_assert_eq!(stats.script_calls, rounds.len() as u64);
        prop_assert_eq!(single.batch_stats().largest_batch, 1);
        if let Err(difference) = outcome {
            return Err(TestCaseError::fail(difference));
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

/// Concurrent checks on two stores (two app instances) queue behind each one's call in flight and
/// go out in batches; the limit still holds exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_checks_form_batches_and_admit_exactly_the_limit() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("racing");
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ] {
        let rules = Arc::new([Rule::per_hour(100)]);
        let key = Arc::new(format!("{prefix}:{algorithm}:global"));
        let stores = [store(&redis), store(&redis)];
        let barrier = Arc::new(tokio::sync::Barrier::new(400));
        let tasks: Vec<_> = (0..400)
            .map(|n| {
                let store = stores[n % 2].clone();
                let (rules, key, barrier) = (rules.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store
                        .check(&CheckRequest::new(&key, &rules[..], algorithm))
                        .await
                        .unwrap()
                        .allowed
                })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            admitted += usize::from(task.await.unwrap());
        }
        assert_eq!(admitted, 100, "{algorithm}");
        for store in &stores {
            let stats = store.batch_stats();
            assert_eq!(stats.checks, 200, "{algorithm}: {stats:?}");
            assert!(
                stats.largest_batch > 1 && stats.script_calls < stats.checks,
                "{algorithm}: no batch formed: {stats:?}"
            );
        }
    }
    assert_eq!(
        common::redis_server::assert_every_key_expires(&mut redis.client(), &prefix),
        4
    );
}

/// A check whose key holds the wrong type fails alone: the others of its batch are decided, and
/// the error is the failing check's own (`StoreError::WrongType`).
#[tokio::test]
async fn a_failing_check_fails_alone_in_its_batch() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("wrongtype");
    let rules = [Rule::per_minute(5)];
    let (good, bad) = (format!("{prefix}:p:good"), format!("{prefix}:p:bad"));
    // The fixed window's counter is a hash; a string there makes HINCRBY fail.
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}:{{{prefix}:p:bad}}:fw:60000:5"))
        .arg("x")
        .arg("EX")
        .arg(60)
        .query(&mut redis.client())
        .unwrap();
    let store = store(&redis);
    let decisions = store
        .check_batch_for_tests(&[
            CheckRequest::new(&good, &rules, Algorithm::FixedWindow),
            CheckRequest::new(&bad, &rules, Algorithm::FixedWindow),
            CheckRequest::new(&good, &rules, Algorithm::FixedWindow),
        ])
        .await;
    assert_eq!(decisions.len(), 3);
    assert_eq!(decisions[0].as_ref().unwrap().rules[0].remaining, 4);
    // Its own error, a fault, in Redis's words.
    match &decisions[1] {
        Err(error @ StoreError::WrongType(message)) => {
            assert!(message.starts_with("WRONGTYPE Operation"), "{message}");
            assert!(error.is_fault());
        }
        other => panic!("expected the check's own error, got {other:?}"),
    }
    assert_eq!(decisions[2].as_ref().unwrap().rules[0].remaining, 3);
    delete_keys(&redis, &prefix);
}

/// While Redis doesn't answer, queued checks time out at their own deadline; when it answers
/// again, so does the store: nothing is left waiting for a call that never returned, even when the
/// request whose call was in flight was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_survives_timeouts_and_dropped_requests() {
    let redis = TestRedis::own();
    let store = RedisStore::from_url(&redis.url)
        .unwrap()
        .timeout(Duration::from_millis(300));
    let rules = Arc::new([Rule::per_hour(1_000)]);
    let check = |store: RedisStore, rules: Arc<[Rule; 1]>| async move {
        store
            .check(&CheckRequest::new(
                "rl:queue:global",
                &rules[..],
                Algorithm::SlidingLog,
            ))
            .await
    };
    // Connected, and the script loaded.
    assert!(check(store.clone(), rules.clone()).await.unwrap().allowed);

    redis.pause();
    let started = tokio::time::Instant::now();
    let racing: Vec<_> = (0..20)
        .map(|_| tokio::spawn(check(store.clone(), rules.clone())))
        .collect();
    for task in racing {
        assert!(matches!(task.await.unwrap(), Err(StoreError::Timeout(_))));
    }
    // Every check gave up at about its own deadline, not after a queue of them.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    // A request dropped while its call is in flight, with others queued behind it.
    let leader = tokio::spawn(check(store.clone(), rules.clone()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let queued: Vec<_> = (0..5)
        .map(|_| tokio::spawn(check(store.clone(), rules.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A test waiting meanwhile for every call to land hears when they have, the dropped one's
    // included (the hook panics after 10 s).
    let landing = {
        let store = store.clone();
        tokio::spawn(async move { store.until_calls_land_for_tests().await })
    };
    leader.abort();
    redis.resume();
    for task in queued {
        // They may have timed out while Redis was paused; they must not hang.
        let _ = task.await.unwrap();
    }
    landing
        .await
        .expect("every call landed, and the hook heard it");
    for _ in 0..3 {
        assert!(check(store.clone(), rules.clone()).await.unwrap().allowed);
    }
    let racing: Vec<_> = (0..20)
        .map(|_| tokio::spawn(check(store.clone(), rules.clone())))
        .collect();
    for task in racing {
        assert!(task.await.unwrap().unwrap().allowed);
    }
}

/// While one call's answers are handed out (the requests that waited woken, what is done with
/// the others run), Redis already works on the next: it was sent first. Here what is done with
/// the first release's answer finds the second's call already sent.
#[test]
fn the_next_call_is_sent_before_a_call_s_answers_are_handed_out() {
    let redis = TestRedis::shared();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let store = RedisStore::from_url(&redis.url).unwrap();
        let policy = Policy::builder("overlap")
            .prefix(unique_prefix("overlap"))
            .max_in_flight(10)
            .lease(Duration::from_secs(60))
            .build()
            .unwrap();
        let key = format!("{}:overlap:user:ann", policy.prefix());
        let request = CheckRequest::new(&key, policy.rules(), policy.algorithm())
            .identity("user:ann")
            .concurrency(policy.concurrency());
        let first = store.check(&request).await.unwrap().lease.unwrap();
        let second = store.check(&request).await.unwrap().lease.unwrap();
        let sent_before = store.batch_stats().script_calls;
        // The first release's call starts a task of its own (not run yet: one thread); the
        // second queues behind it.
        let (seen, saw) = tokio::sync::oneshot::channel();
        let counting = store.clone();
        store.release_then(
            &request,
            first,
            Box::new(move |result| {
                result.expect("a release");
                let _ = seen.send(counting.batch_stats().script_calls);
            }),
        );
        let (done, finished) = tokio::sync::oneshot::channel();
        store.release_then(
            &request,
            second,
            Box::new(move |result| drop(done.send(result))),
        );
        let sent_when_answered = saw.await.unwrap();
        finished.await.unwrap().expect("a release");
        assert_eq!(
            sent_when_answered,
            sent_before + 2,
            "the second release's call went out before the first's answer was handed out"
        );
    });
}
