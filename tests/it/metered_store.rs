//! Metered units in the stores (issue 48): a check charges requests to the rules that count them
//! and units to the metered ones, all or nothing, in one call; a settle's debt (`Store::overdraw`)
//! passes a limit and later checks wait an honest retry time; a give-back of units reaches only
//! the metered rules. Every case runs on both stores at times the test sets, and the property
//! test holds the two stores to the same answers.

use crate::common;

use std::time::Duration;

use common::redis_server::{TestRedis, assert_every_key_expires, unique_prefix};
use common::timed::{a_minute_an_hour_ahead, both_stores};
use proptest::prelude::*;
use tower_redis_ratelimit::quota::QuotaThreshold;
use tower_redis_ratelimit::store::{CheckRequest, ManualClock, QuotaRequest};
use tower_redis_ratelimit::{Algorithm, Decision, MemoryStore, RedisStore, Rule, Store};

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::TokenBucket,
];

fn remaining(decision: &Decision) -> Vec<u64> {
    decision.rules.iter().map(|state| state.remaining).collect()
}

/// 10 requests and 1 000 tokens per 10 s: a request and its estimate are checked together, and
/// a refusal by the token rule charges no request.
#[tokio::test]
async fn requests_and_units_are_checked_together_all_or_nothing() {
    let start = a_minute_an_hour_ahead();
    let rules = [
        Rule::new(10, Duration::from_secs(10)),
        Rule::new(1_000, Duration::from_secs(10)).metered(),
    ];
    for algorithm in ALGORITHMS {
        for (timed, prefix) in both_stores("metered-together", start) {
            let key = format!("{prefix}:api:user:{algorithm:?}");
            let request = CheckRequest::new(&key, &rules, algorithm).identity("user");
            let store = &timed.store;
            let first = store.check(&request.units(400)).await.unwrap();
            assert!(first.allowed, "{} {algorithm:?}", timed.name);
            assert_eq!(remaining(&first), [9, 600], "{} {algorithm:?}", timed.name);
            let too_big = store.check(&request.units(700)).await.unwrap();
            assert!(!too_big.allowed, "{} {algorithm:?}", timed.name);
            assert_eq!(too_big.violated().collect::<Vec<_>>(), [1]);
            // Nothing of the refusal was charged: the request rule still has 9.
            let after = store.peek(&request.units(0)).await.unwrap();
            assert_eq!(remaining(&after), [9, 600], "{} {algorithm:?}", timed.name);
            let fits = store.check(&request.units(600)).await.unwrap();
            assert!(fits.allowed, "{} {algorithm:?}", timed.name);
            assert_eq!(remaining(&fits), [8, 0], "{} {algorithm:?}", timed.name);
            timed.assert_keys_expire();
        }
    }
}

/// A rule of 100 requests and one of 100 tokens a minute count apart: one store key each.
#[tokio::test]
async fn a_metered_rule_counts_apart_from_a_rule_of_requests_of_the_same_limit() {
    let start = a_minute_an_hour_ahead();
    let rules = [Rule::per_minute(100), Rule::per_minute(100).metered()];
    for (timed, prefix) in both_stores("metered-apart", start) {
        let key = format!("{prefix}:api:user:u");
        let request = CheckRequest::new(&key, &rules, Algorithm::FixedWindow).identity("u");
        let decision = timed.store.check(&request.units(50)).await.unwrap();
        assert_eq!(remaining(&decision), [99, 50], "{}", timed.name);
        // Rule order swapped (a redeployed policy): each rule keeps its own count.
        let swapped = [Rule::per_minute(100).metered(), Rule::per_minute(100)];
        let request = CheckRequest::new(&key, &swapped, Algorithm::FixedWindow).identity("u");
        let decision = timed.store.peek(&request.units(0).cost(0)).await.unwrap();
        assert_eq!(remaining(&decision), [50, 99], "{}", timed.name);
    }
}

/// A settle's debt passes the limit (by at most the limit), and the next check is refused for
/// exactly as long as the store says: refused a millisecond before its retry time, admitted at
/// it. On every algorithm and both stores.
#[tokio::test]
async fn debt_refuses_until_its_honest_retry_time() {
    let start = a_minute_an_hour_ahead();
    let rules = [
        Rule::new(5, Duration::from_secs(10)),
        Rule::new(1_000, Duration::from_secs(10)).metered(),
    ];
    for algorithm in ALGORITHMS {
        for (timed, prefix) in both_stores("metered-debt", start) {
            let case = format!("{} {algorithm:?}", timed.name);
            let key = format!("{prefix}:api:user:{algorithm:?}");
            let request = CheckRequest::new(&key, &rules, algorithm).identity("user");
            let store = &timed.store;
            timed.at(start + 1_000);
            assert!(store.check(&request.units(500)).await.unwrap().allowed);
            timed.at(start + 2_000);
            // Used 1 700 where 500 were reserved: 1 200 more, capped at the limit (1 000).
            let owed = request.cost(0).units(1_200);
            let after = store.overdraw(&owed).await.unwrap();
            assert_eq!(remaining(&after), [4, 0], "{case}");
            let refused = store.check(&request.units(1)).await.unwrap();
            assert!(!refused.allowed, "{case}");
            assert_eq!(refused.violated().collect::<Vec<_>>(), [1], "{case}");
            let retry = refused.retry_after().unwrap();
            let retry_ms = retry.as_millis() as u64;
            assert!(retry_ms > 0, "{case}");
            // Never later than the debt can last: a window and a half at most.
            assert!(retry_ms <= 20_000, "{case}: {retry:?}");
            timed.at(start + 2_000 + retry_ms - 1);
            let early = store.check(&request.units(1)).await.unwrap();
            assert!(!early.allowed, "{case}: admitted 1 ms before {retry:?}");
            timed.at(start + 2_000 + retry_ms);
            let on_time = store.check(&request.units(1)).await.unwrap();
            assert!(on_time.allowed, "{case}: refused at {retry:?}");
            timed.assert_keys_expire();
        }
    }
}

/// An overdraw on a key the store holds nothing of (its reservation's window expired) still
/// charges, and its keys expire.
#[tokio::test]
async fn an_overdraw_on_a_fresh_key_charges_and_expires() {
    let start = a_minute_an_hour_ahead();
    let rules = [Rule::new(100, Duration::from_secs(10)).metered()];
    for algorithm in ALGORITHMS {
        for (timed, prefix) in both_stores("metered-fresh-debt", start) {
            let key = format!("{prefix}:api:user:{algorithm:?}");
            let request = CheckRequest::new(&key, &rules, algorithm).identity("user");
            let after = timed
                .store
                .overdraw(&request.cost(0).units(30))
                .await
                .unwrap();
            assert_eq!(remaining(&after), [70], "{} {algorithm:?}", timed.name);
            timed.assert_keys_expire();
        }
    }
}

/// A give-back of units alone (cost 0) reaches the metered rule, not the rule of requests.
#[tokio::test]
async fn a_give_back_of_units_reaches_only_the_metered_rules() {
    let start = a_minute_an_hour_ahead();
    let rules = [
        Rule::new(10, Duration::from_secs(10)),
        Rule::new(1_000, Duration::from_secs(10)).metered(),
    ];
    for algorithm in ALGORITHMS {
        for (timed, prefix) in both_stores("metered-give-back", start) {
            let key = format!("{prefix}:api:user:{algorithm:?}");
            let request = CheckRequest::new(&key, &rules, algorithm).identity("user");
            let charged = timed.store.check(&request.units(500)).await.unwrap();
            let after = timed
                .store
                .give_back(&request.cost(0).units(400), &charged)
                .await
                .unwrap();
            assert_eq!(remaining(&after), [9, 900], "{} {algorithm:?}", timed.name);
        }
    }
}

/// A metered quota counts units, past its limit by a settle's debt, and its alerts fire when a
/// settle reaches them.
#[tokio::test]
async fn a_metered_quota_counts_units_and_its_alerts_fire_on_a_settle() {
    let start = a_minute_an_hour_ahead();
    let rules = [Rule::per_minute(100)];
    let thresholds = [QuotaThreshold {
        percent: 80,
        used: 8_000,
    }];
    for (timed, prefix) in both_stores("metered-quota", start) {
        let key = format!("{prefix}:api:user:u");
        let quota_key = format!("{prefix}:quota:user:u");
        let quota = QuotaRequest::new(&quota_key, 10_000, 86_400_000, 0, &thresholds)
            .identity("user:u")
            .metered(true);
        let request = CheckRequest::new(&key, &rules, Algorithm::FixedWindow)
            .identity("user:u")
            .quota(Some(quota));
        let admitted = timed.store.check(&request.units(5_000)).await.unwrap();
        assert!(admitted.allowed, "{}", timed.name);
        assert_eq!(remaining(&admitted), [99, 5_000], "{}", timed.name);
        assert!(admitted.quota_alerts.is_empty());
        let settled = timed
            .store
            .overdraw(&request.cost(0).units(4_000))
            .await
            .unwrap();
        assert_eq!(settled.quota_alerts, [80], "{}", timed.name);
        assert_eq!(remaining(&settled), [99, 1_000], "{}", timed.name);
        let refused = timed.store.check(&request.units(1_500)).await.unwrap();
        assert!(!refused.allowed, "{}", timed.name);
        timed.assert_keys_expire();
    }
}

/// One step of a metered sequence: a check of an estimate, a settle of an earlier admission at
/// what it used, or time passing.
#[derive(Debug, Clone)]
enum Step {
    Reserve(u64),
    Settle(usize, u64),
    Wait(u64),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        4 => (1u64..40).prop_map(Step::Reserve),
        3 => (0usize..12, 0u64..80).prop_map(|(which, used)| Step::Settle(which, used)),
        2 => (1u64..1_500).prop_map(Step::Wait),
    ];
    prop::collection::vec(step, 1..40)
}

/// Any sequence of reservations and settles (less than reserved: a give-back to where it was
/// charged; more: an overdraw) gets the same answers from the memory store and the Redis store,
/// on every algorithm, across window rolls.
#[test]
fn memory_and_redis_agree_on_reserve_and_settle() {
    let redis = TestRedis::shared();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    });
    let algorithm = prop::sample::select(ALGORITHMS.to_vec());
    let outcome = runner.run(&(algorithm, steps()), |(algorithm, steps)| {
        let rules = [
            Rule::new(6, Duration::from_secs(2)),
            Rule::new(100, Duration::from_secs(4)).metered(),
        ];
        let prefix = unique_prefix("metered-agree");
        let key = format!("{prefix}:p:user:k");
        let mut now = a_minute_an_hour_ahead();
        let clock = ManualClock::new(now);
        let memory = MemoryStore::builder().clock(clock.clone()).build();
        let redis_store = RedisStore::from_url(&redis.url).expect("a valid Redis URL");
        redis_store.fix_time_for_tests(Some(now * 1_000));
        runtime.block_on(async {
            let mut reservations = Vec::new();
            for step in steps {
                let request = CheckRequest::new(&key, &rules, algorithm).identity("user:k");
                match step {
                    Step::Wait(ms) => {
                        now += ms;
                        clock.set(now);
                        redis_store.fix_time_for_tests(Some(now * 1_000));
                    }
                    Step::Reserve(estimate) => {
                        let request = request.units(estimate);
                        let in_memory = memory.check(&request).await.unwrap();
                        let in_redis = redis_store.check(&request).await.unwrap();
                        prop_assert_eq!(in_memory.allowed, in_redis.allowed);
                        prop_assert_eq!(remaining(&in_memory), remaining(&in_redis));
                        prop_assert_eq!(in_memory.retry_after(), in_redis.retry_after());
                        if in_memory.allowed {
                            reservations.push(Some((estimate, in_memory, in_redis)));
                        }
                    }
                    Step::Settle(which, used) => {
                        let Some(Some((estimate, charged_memory, charged_redis))) =
                            reservations.get_mut(which).map(Option::take)
                        else {
                            continue;
                        };
                        let (in_memory, in_redis) = if used < estimate {
                            let back = request.cost(0).units(estimate - used);
                            (
                                memory.give_back(&back, &charged_memory).await.unwrap(),
                                redis_store.give_back(&back, &charged_redis).await.unwrap(),
                            )
                        } else {
                            let owed = request.cost(0).units(used - estimate);
                            (
                                memory.overdraw(&owed).await.unwrap(),
                                redis_store.overdraw(&owed).await.unwrap(),
                            )
                        };
                        prop_assert_eq!(remaining(&in_memory), remaining(&in_redis));
                        prop_assert_eq!(in_memory.allowed, in_redis.allowed);
                    }
                }
            }
            Ok(())
        })?;
        assert_every_key_expires(&mut redis.client(), &prefix);
        Ok(())
    });
    if let Err(error) = outcome {
        panic!("{error}");
    }
}
