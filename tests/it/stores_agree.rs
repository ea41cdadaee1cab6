//! The in-memory store and the Redis store give the same answers to the same requests: a property
//! test over every algorithm and policy option, both stores at one fixed time.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::redis_server::{TestRedis, unique_prefix};
use common::redis_store::{assert_every_key_expires, store};
use proptest::prelude::*;
use tower_redis_ratelimit::concurrency::ConcurrencyLimit;
use tower_redis_ratelimit::quota::QuotaThreshold;
use tower_redis_ratelimit::store::{CheckRequest, ManualClock, QuotaRequest};
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Rule, Store};

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
