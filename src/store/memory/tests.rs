use std::time::Duration;

use super::super::QuotaRequest;
use super::*;
use crate::policy::quota::QuotaThreshold;
use crate::policy::{Algorithm, Rule};

fn store(clock: &ManualClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build()
}

fn check(store: &MemoryStore, algorithm: Algorithm, rules: &[Rule]) -> Decision {
    store.check_now(&CheckRequest::new("k", rules, algorithm))
}

const ALL: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
    Algorithm::TokenBucket,
];

#[test]
fn admits_the_limit_then_refuses_with_the_time_left() {
    for algorithm in ALL {
        // Start 10 s into a minute, so the fixed window has 50 s left.
        let clock = ManualClock::new(1_000_000 * 60_000 + 10_000);
        let store = store(&clock);
        let rules = [Rule::per_minute(3)];
        for expected_remaining in [2, 1, 0] {
            let decision = check(&store, algorithm, &rules);
            assert!(decision.allowed, "{algorithm}");
            assert_eq!(decision.rules[0].remaining, expected_remaining);
            clock.advance(Duration::from_secs(1));
        }
        let refused = check(&store, algorithm, &rules);
        assert!(!refused.allowed);
        assert_eq!(refused.rules[0].remaining, 0);
        let expected = match algorithm {
            // The window ends 50 s after the first request; 3 s have passed.
            Algorithm::FixedWindow => Duration::from_secs(47),
            // The first admission (3 s ago) leaves the log in 57 s.
            Algorithm::SlidingLog => Duration::from_secs(57),
            // This window's 3 count in full when the next one starts, and fade 1 ms later.
            Algorithm::SlidingCounter => Duration::from_millis(47_001),
            // One unit drips back every 20 s; the bucket was full 3 s ago.
            Algorithm::TokenBucket => Duration::from_secs(17),
        };
        assert_eq!(refused.retry_after(), Some(expected), "{algorithm}");
        assert_eq!(refused.rules[0].reset, expected, "{algorithm}");
    }
}

#[test]
fn a_refused_request_consumes_nothing_in_any_rule() {
    for algorithm in ALL {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::per_second(2), Rule::per_minute(10)];
        assert!(check(&store, algorithm, &rules).allowed);
        assert!(check(&store, algorithm, &rules).allowed);
        let mut wait = Duration::ZERO;
        for _ in 0..5 {
            let refused = check(&store, algorithm, &rules);
            assert!(!refused.allowed);
            // The per-second rule refused; the per-minute rule was not charged.
            assert!(refused.rules[0].refused());
            assert!(!refused.rules[1].refused());
            assert_eq!(refused.rules[1].remaining, 8, "{algorithm}");
            wait = refused.retry_after().unwrap();
        }
        clock.advance(wait);
        let next = check(&store, algorithm, &rules);
        assert!(next.allowed);
        assert_eq!(next.rules[1].remaining, 7, "{algorithm}");
    }
}

#[test]
fn at_a_window_edge_only_the_fixed_window_lets_twice_the_limit_through() {
    // Five at the end of one second, five more at the start of the next.
    let rules = [Rule::per_second(5)];
    for algorithm in ALL {
        let clock = ManualClock::new(10_900);
        let store = store(&clock);
        let mut admitted = 0;
        for at in [10_900, 11_000] {
            clock.set(at);
            for _ in 0..5 {
                admitted += u32::from(check(&store, algorithm, &rules).allowed);
            }
        }
        let expected = match algorithm {
            Algorithm::FixedWindow => 10,
            // The log, the counter (the last window still weighs in full) and the bucket
            // (one unit drips back every 200 ms) all hold the line.
            _ => 5,
        };
        assert_eq!(admitted, expected, "{algorithm}");
    }
}

#[test]
fn the_sliding_counter_errs_by_its_even_spread_assumption() {
    let rules = [Rule::per_second(10)];
    let admitted_at = |first: u64, second: u64| {
        let clock = ManualClock::new(first);
        let store = store(&clock);
        for _ in 0..10 {
            assert!(check(&store, Algorithm::SlidingCounter, &rules).allowed);
        }
        clock.set(second);
        (0..20)
            .filter(|_| check(&store, Algorithm::SlidingCounter, &rules).allowed)
            .count()
    };
    // Ten at the very end of a window, then half a window later: the counter weighs the last
    // window at one half, so five more pass where an exact log would pass none (the documented
    // worst case: about 1.5x in that second)...
    assert_eq!(admitted_at(10_999, 11_500), 5);
    // ...and ten at the very start: the log would pass ten, the counter five.
    assert_eq!(admitted_at(10_000, 11_500), 5);
}

#[test]
fn a_token_bucket_bursts_then_keeps_the_steady_rate() {
    let clock = ManualClock::new(1_000_000);
    let store = store(&clock);
    // 10 per second, a bucket of 5: five at once, then one every 100 ms.
    let rules = [Rule::per_second(10).burst(5)];
    for left in (0..5).rev() {
        let decision = check(&store, Algorithm::TokenBucket, &rules);
        assert!(decision.allowed);
        assert_eq!(decision.rules[0].remaining, left);
    }
    let refused = check(&store, Algorithm::TokenBucket, &rules);
    assert_eq!(refused.retry_after(), Some(Duration::from_millis(100)));
    assert_eq!(refused.rules[0].reset, Duration::from_millis(100));
    let mut admitted_at = Vec::new();
    for _ in 0..1_000 {
        clock.advance(Duration::from_millis(1));
        if check(&store, Algorithm::TokenBucket, &rules).allowed {
            admitted_at.push(clock.now_unix_ms() - 1_000_000);
        }
    }
    assert_eq!(
        admitted_at,
        [100, 200, 300, 400, 500, 600, 700, 800, 900, 1_000]
    );
    // Quiet for half a second: the bucket refills five units, not more.
    clock.advance(Duration::from_secs(10));
    let burst = (0..10)
        .filter(|_| check(&store, Algorithm::TokenBucket, &rules).allowed)
        .count();
    assert_eq!(burst, 5);
}

fn guarded(algorithm: Algorithm, rules: &[Rule]) -> Vec<Rule> {
    let mut builder = crate::Policy::builder("p")
        .algorithm(algorithm)
        .rules(rules.iter().cloned());
    builder = builder.prevent_duplicate(Duration::from_secs(5));
    builder.build().unwrap().rules().to_vec()
}

#[test]
fn the_duplicate_guard_refuses_a_second_request_within_its_window() {
    for algorithm in ALL {
        // Just before a fixed window's edge, where a counted 1-per-5s rule would let a double
        // click through.
        let clock = ManualClock::new(4_999);
        let store = store(&clock);
        let rules = guarded(algorithm, &[Rule::per_minute(10)]);
        assert!(check(&store, algorithm, &rules).allowed);
        clock.set(5_001);
        let refused = check(&store, algorithm, &rules);
        assert!(!refused.allowed, "{algorithm}");
        assert_eq!(refused.violated().collect::<Vec<_>>(), [1]);
        assert_eq!(refused.retry_after(), Some(Duration::from_millis(4_998)));
        // The refusal charged nothing.
        assert_eq!(refused.rules[0].remaining, 9, "{algorithm}");
        clock.set(9_999);
        let next = check(&store, algorithm, &rules);
        assert!(next.allowed, "{algorithm}");
        assert_eq!(next.rules[0].remaining, 8, "{algorithm}");
    }
}

#[test]
fn a_penalty_block_outlasts_the_window() {
    for algorithm in ALL {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::per_minute(2)];
        let blocked = |store: &MemoryStore| {
            store.check_now(
                &CheckRequest::new("k", &rules, algorithm)
                    .block_for(Some(Duration::from_secs(900))),
            )
        };
        assert!(blocked(&store).allowed);
        assert!(blocked(&store).allowed);
        let refused = blocked(&store);
        assert!(!refused.allowed);
        assert_eq!(refused.retry_after(), Some(Duration::from_secs(900)));
        // Long after the rule's window, still blocked, to the end of the block.
        clock.set(600_000);
        let still = blocked(&store);
        assert!(!still.allowed, "{algorithm}");
        assert_eq!(still.retry_after(), Some(Duration::from_secs(300)));
        assert_eq!(still.rules[0].remaining, 0);
        clock.set(900_000);
        assert!(blocked(&store).allowed, "{algorithm}");
    }
}

#[test]
fn a_refused_first_request_keeps_its_block() {
    let clock = ManualClock::new(0);
    let store = store(&clock);
    let rules = [Rule::per_minute(2)];
    let request = CheckRequest::new("k", &rules, Algorithm::SlidingLog)
        .cost(3)
        .block_for(Some(Duration::from_secs(60)));
    assert!(!store.check_now(&request).allowed);
    assert_eq!(store.len(), 1);
    clock.set(30_000);
    let blocked = store.check_now(&CheckRequest::new("k", &rules, Algorithm::SlidingLog));
    assert_eq!(blocked.retry_after(), Some(Duration::from_secs(30)));
}

#[test]
fn a_duplicate_does_not_start_a_block() {
    let clock = ManualClock::new(0);
    let store = store(&clock);
    let rules = guarded(Algorithm::SlidingLog, &[Rule::per_minute(10)]);
    let request = CheckRequest::new("k", &rules, Algorithm::SlidingLog)
        .block_for(Some(Duration::from_secs(900)));
    assert!(store.check_now(&request).allowed);
    let duplicate = store.check_now(&request);
    assert_eq!(duplicate.retry_after(), Some(Duration::from_secs(5)));
    clock.set(5_000);
    assert!(store.check_now(&request).allowed);
}

#[test]
fn delayed_requests_reserve_exactly_the_limit_in_order() {
    for algorithm in [Algorithm::SlidingLog, Algorithm::TokenBucket] {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        // 2 per second, waits of up to 1.5 s: two now and two reserved for 1 s later (the log),
        // or one each 500 ms (a bucket of one, which spaces requests evenly); the rest refused.
        let rules = match algorithm {
            Algorithm::SlidingLog => [Rule::per_second(2)],
            _ => [Rule::per_second(2).burst(1)],
        };
        let request =
            CheckRequest::new("k", &rules, algorithm).max_delay(Duration::from_millis(1_500));
        let delays: Vec<Option<u64>> = (0..6)
            .map(|_| {
                let decision = store.check_now(&request);
                decision
                    .allowed
                    .then_some(decision.delay.as_millis() as u64)
            })
            .collect();
        let expected = match algorithm {
            Algorithm::SlidingLog => [Some(0), Some(0), Some(1_000), Some(1_000), None, None],
            _ => [Some(0), Some(500), Some(1_000), Some(1_500), None, None],
        };
        assert_eq!(delays, expected, "{algorithm}");
        // No second of the reservations holds more than the limit.
        let admitted: Vec<u64> = delays.iter().flatten().copied().collect();
        for start in 0..=2_000 {
            let in_window = admitted
                .iter()
                .filter(|&&at| at >= start && at < start + 1_000)
                .count();
            assert!(in_window <= 2, "{algorithm}: {in_window} in [{start}, +1s)");
        }
    }
}

#[test]
fn a_request_that_fits_now_goes_before_earlier_reservations() {
    let clock = ManualClock::new(0);
    let store = store(&clock);
    let rules = [Rule::new(2, Duration::from_secs(10))];
    let request =
        CheckRequest::new("k", &rules, Algorithm::SlidingLog).max_delay(Duration::from_secs(20));
    assert!(store.check_now(&request).allowed);
    clock.set(5_000);
    assert!(store.check_now(&request).allowed);
    // Full until 10 s: reserved for then.
    assert_eq!(store.check_now(&request).delay, Duration::from_secs(5));
    // At 10 s the admission of 0 s leaves; the one at 5 s and the reservation at 10 s hold
    // the window, so the next waits for 15 s.
    assert_eq!(store.check_now(&request).delay, Duration::from_secs(10));
}

const THRESHOLDS: [QuotaThreshold; 2] = [
    QuotaThreshold {
        percent: 80,
        used: 8,
    },
    QuotaThreshold {
        percent: 100,
        used: 10,
    },
];

#[test]
fn a_daily_quota_caps_the_day_and_alerts_once_per_threshold() {
    const DAY: u64 = 86_400_000;
    // Days start at midnight UTC+01:00, 23:00 UTC; the clock starts at 22:00 UTC.
    let offset = DAY - 3_600_000;
    let clock = ManualClock::new(100 * DAY + offset - 3_600_000);
    let store = store(&clock);
    let rules = [Rule::per_second(1_000)];
    let quota = QuotaRequest::new("rl:daily:user:ann", 10, DAY, offset, &THRESHOLDS);
    let check = |key: &str| {
        store.check_now(&CheckRequest::new(key, &rules, Algorithm::SlidingLog).quota(Some(quota)))
    };
    let mut alerts = Vec::new();
    for n in 1..=10 {
        // Two policies (two keys) share the quota.
        let decision = check(if n % 2 == 0 {
            "rl:a:user:ann"
        } else {
            "rl:b:user:ann"
        });
        assert!(decision.allowed, "request {n}");
        assert_eq!(decision.rules[1].remaining, 10 - n);
        alerts.extend(decision.quota_alerts.iter().map(|percent| (n, *percent)));
    }
    assert_eq!(alerts, [(8, 80), (10, 100)]);
    let refused = check("rl:a:user:ann");
    assert!(!refused.allowed);
    // The day ends in an hour, at midnight UTC+01:00; the per-second rule was not charged.
    assert_eq!(refused.retry_after(), Some(Duration::from_secs(3_600)));
    assert_eq!(refused.rules[1].reset, Duration::from_secs(3_600));
    assert!(!refused.rules[0].refused());
    assert!(refused.quota_alerts.is_empty());
    clock.advance(Duration::from_secs(3_600));
    let next_day = check("rl:a:user:ann");
    assert!(next_day.allowed);
    assert_eq!(next_day.rules[1].remaining, 9);
    for _ in 2..8 {
        check("rl:a:user:ann");
    }
    // A new day, a new 80 % alert at its eighth request.
    assert_eq!(check("rl:a:user:ann").quota_alerts, [80]);
}

#[test]
fn quota_counters_are_capped_like_keys() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder()
        .max_keys(2)
        .clock(clock.clone())
        .build();
    let rules = [Rule::per_minute(100)];
    let check = |user: &str| {
        clock.advance(Duration::from_millis(1));
        let quota_key = format!("rl:daily:user:{user}");
        let quota = QuotaRequest::new(&quota_key, 1, 86_400_000, 0, &[]);
        store
            .check_now(
                &CheckRequest::new("rl:p:global", &rules, Algorithm::FixedWindow)
                    .quota(Some(quota)),
            )
            .allowed
    };
    assert!(check("a"));
    assert!(!check("a"));
    let evictions = store.evictions();
    assert!(check("b"));
    assert!(
        check("c"),
        "a third user evicts the least recently checked counter"
    );
    assert_eq!(store.evictions(), evictions + 1);
    assert!(!check("c"));
    assert!(check("a"), "a's counter was evicted: a starts afresh");
}

#[test]
fn a_block_does_not_hide_a_used_up_quota() {
    const DAY: u64 = 86_400_000;
    let clock = ManualClock::new(10 * DAY + 1_000);
    let store = store(&clock);
    let rules = [Rule::per_minute(10)];
    let quota = QuotaRequest::new("rl:daily:user:ida", 1, DAY, 0, &[]);
    let request = CheckRequest::new("rl:p:user:ida", &rules, Algorithm::SlidingLog)
        .block_for(Some(Duration::from_secs(10)))
        .quota(Some(quota));
    assert!(store.check_now(&request).allowed);
    let to_midnight = Duration::from_millis(DAY - 1_000);
    assert_eq!(store.check_now(&request).retry_after(), Some(to_midnight));
    clock.advance(Duration::from_secs(5));
    // Blocked for 5 s more, but the quota is out until midnight: that is when to come back.
    let blocked = store.check_now(&request);
    assert_eq!(
        blocked.retry_after(),
        Some(to_midnight - Duration::from_secs(5))
    );
    assert_eq!(blocked.rules[0].retry_after, Some(Duration::from_secs(5)));
}

#[test]
fn a_request_over_the_quota_is_refused_in_every_rule_and_counts_nowhere() {
    let clock = ManualClock::new(0);
    let store = store(&clock);
    let rules = [Rule::per_minute(5)];
    let quota = QuotaRequest::new("rl:daily:user:bo", 2, 86_400_000, 0, &[]);
    let request =
        CheckRequest::new("rl:p:user:bo", &rules, Algorithm::FixedWindow).quota(Some(quota));
    assert!(store.check_now(&request).allowed);
    assert!(store.check_now(&request).allowed);
    let refused = store.check_now(&request);
    assert!(!refused.allowed);
    assert_eq!(refused.violated().collect::<Vec<_>>(), [1]);
    assert_eq!(
        refused.rules[0].remaining, 3,
        "the minute's rule keeps what it had"
    );
}

#[test]
fn sliding_log_retry_waits_only_for_the_oldest_needed_admission() {
    let clock = ManualClock::new(0);
    let store = store(&clock);
    let rules = [Rule::new(2, Duration::from_secs(10))];
    assert!(check(&store, Algorithm::SlidingLog, &rules).allowed);
    clock.advance(Duration::from_secs(4));
    assert!(check(&store, Algorithm::SlidingLog, &rules).allowed);
    clock.advance(Duration::from_millis(1_500));
    let refused = check(&store, Algorithm::SlidingLog, &rules);
    // The admission at 0 s expires at 10 s; now is 5.5 s.
    assert_eq!(refused.retry_after(), Some(Duration::from_millis(4_500)));
    clock.set(10_000);
    assert!(check(&store, Algorithm::SlidingLog, &rules).allowed);
}

#[test]
fn costs_count_as_several_units() {
    for algorithm in ALL {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::per_minute(5)];
        let weighted =
            |cost| store.check_now(&CheckRequest::new("k", &rules, algorithm).cost(cost));
        assert_eq!(weighted(3).rules[0].remaining, 2);
        let refused = weighted(3);
        assert!(!refused.allowed);
        assert_eq!(refused.rules[0].remaining, 2);
        assert!(weighted(2).allowed);
    }
}

#[test]
fn keys_are_independent() {
    let clock = ManualClock::new(0);
    let store = store(&clock);
    let rules = [Rule::per_minute(1)];
    for key in ["a", "b", "c"] {
        let decision = store.check_now(&CheckRequest::new(key, &rules, Algorithm::FixedWindow));
        assert!(decision.allowed, "{key}");
    }
    assert_eq!(store.len(), 3);
}

#[test]
fn expired_entries_are_swept_and_refusals_store_nothing() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder()
        .shards(1)
        .clock(clock.clone())
        .build();
    let rules = [Rule::per_second(1)];
    for key in 0..100 {
        let key = key.to_string();
        store.check_now(&CheckRequest::new(&key, &rules, Algorithm::SlidingLog));
    }
    assert_eq!(store.len(), 100);
    // A request that costs more than the limit is refused and leaves no entry behind.
    store.check_now(&CheckRequest::new("heavy", &rules, Algorithm::SlidingLog).cost(2));
    assert_eq!(store.len(), 100);
    clock.advance(Duration::from_secs(2));
    check(&store, Algorithm::SlidingLog, &rules);
    assert_eq!(store.len(), 1);
}

#[test]
fn a_full_store_evicts_the_least_recently_checked_key() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder()
        .shards(1)
        .max_keys(3)
        .clock(clock.clone())
        .build();
    let request = |key: &str| {
        clock.advance(Duration::from_millis(1));
        store
            .check_now(&CheckRequest::new(
                key,
                &[Rule::per_hour(1)],
                Algorithm::SlidingLog,
            ))
            .allowed
    };
    assert!(request("blocked"));
    assert!(request("a"));
    assert!(request("b"));
    // The blocked client keeps knocking: refused, but recently seen.
    assert!(!request("blocked"));
    // A flood of new keys evicts the idle ones, never the client being refused.
    assert!(request("c"));
    assert!(request("d"));
    assert_eq!(store.len(), 3);
    assert_eq!(store.evictions(), 2);
    assert!(!request("blocked"));
    assert!(request("a"), "the idle key was evicted and starts afresh");
}

#[test]
fn two_rule_sets_on_one_key_keep_their_own_counters() {
    let clock = ManualClock::new(0);
    let store = store(&clock);
    let minute = [Rule::per_minute(2)];
    let hour = [Rule::per_hour(3)];
    // Alternating requests of two policies that ended up on the same key.
    for _ in 0..2 {
        assert!(check(&store, Algorithm::SlidingLog, &minute).allowed);
        assert!(check(&store, Algorithm::SlidingLog, &hour).allowed);
    }
    assert!(!check(&store, Algorithm::SlidingLog, &minute).allowed);
    assert!(check(&store, Algorithm::SlidingLog, &hour).allowed);
    assert!(!check(&store, Algorithm::SlidingLog, &hour).allowed);
    // Same period, other algorithm: a counter of its own too.
    assert!(check(&store, Algorithm::FixedWindow, &minute).allowed);
}

#[test]
fn rules_of_one_period_keep_their_own_counts() {
    for algorithm in ALL {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::per_hour(1), Rule::per_hour(2)];
        let first = check(&store, algorithm, &rules);
        assert!(first.allowed);
        assert_eq!((first.rules[0].remaining, first.rules[1].remaining), (0, 1));
        let second = check(&store, algorithm, &rules);
        assert!(!second.allowed);
        assert!(second.rules[0].refused() && !second.rules[1].refused());
        assert_eq!(second.rules[1].remaining, 1, "{algorithm}");
    }
}

#[test]
fn a_clock_stepping_back_reopens_nothing() {
    for algorithm in ALL {
        let clock = ManualClock::new(120_000);
        let store = store(&clock);
        let rules = [Rule::per_minute(1)];
        assert!(check(&store, algorithm, &rules).allowed);
        // Back into the previous window: still the same limit, not a fresh count.
        clock.set(90_000);
        let refused = check(&store, algorithm, &rules);
        assert!(!refused.allowed, "{algorithm}");
        // Counted from 120 s, the newest time the store has seen. The sliding counter's
        // window count still counts in full when the next window starts, so it waits 1 ms more.
        let wait = refused.retry_after().unwrap();
        let expected = match algorithm {
            Algorithm::SlidingCounter => Duration::from_millis(60_001),
            _ => Duration::from_secs(60),
        };
        assert_eq!(wait, expected, "{algorithm}");
        clock.set(120_000 + wait.as_millis() as u64);
        assert!(check(&store, algorithm, &rules).allowed, "{algorithm}");
    }
}

#[test]
fn huge_periods_saturate_instead_of_overflowing() {
    let clock = ManualClock::new(1_000);
    let store = store(&clock);
    let rules = [Rule::new(1, Duration::from_millis(u64::MAX))];
    for algorithm in ALL {
        let key = algorithm.as_str();
        let request = CheckRequest::new(key, &rules, algorithm);
        assert!(store.check_now(&request).allowed);
        assert!(!store.check_now(&request).allowed, "{algorithm}");
    }
}

#[test]
fn changed_rules_count_apart_from_the_old_ones() {
    let clock = ManualClock::new(0);
    let store = store(&clock);
    assert!(check(&store, Algorithm::SlidingLog, &[Rule::per_minute(1)]).allowed);
    assert!(!check(&store, Algorithm::SlidingLog, &[Rule::per_minute(1)]).allowed);
    assert!(check(&store, Algorithm::SlidingLog, &[Rule::per_hour(1)]).allowed);
    assert!(check(&store, Algorithm::FixedWindow, &[Rule::per_hour(1)]).allowed);
    // The old per-minute count was kept, not wiped.
    assert!(!check(&store, Algorithm::SlidingLog, &[Rule::per_minute(1)]).allowed);
}

#[test]
fn system_clock_does_not_go_backwards() {
    let clock = SystemClock::new();
    let first = clock.now_unix_ms();
    let second = clock.now_unix_ms();
    assert!(second >= first);
    // 2020-01-01 as a sanity floor: the anchor really is Unix time.
    assert!(first > 1_577_836_800_000);
}

/// A claim (issue 59) holds room for a waiting call against the calls after it, goes when its
/// call is admitted or withdraws, and expires at the end of its call's time to wait.
#[test]
fn a_claim_holds_room_until_its_call_is_served_withdraws_or_expires() {
    use super::super::Claim;
    for algorithm in ALL {
        let clock = ManualClock::new(1_000_000 * 60_000);
        let store = store(&clock);
        let rules = [Rule::per_hour(1_000).metered()];
        let ask = |units: u64, id: u64, lasting_ms: u64| {
            let request = CheckRequest::new("k", &rules, algorithm).units(units);
            store
                .check_claimed(&request, Claim { id, lasting_ms })
                .allowed
        };
        assert!(ask(600, 1, 10_000), "{algorithm}");
        // 400 left: the call of 900 waits, and claims them.
        assert!(!ask(900, 2, 10_000), "{algorithm}");
        // A call of 100 after it sees no room: 400 less the 900 claimed.
        assert!(!ask(100, 3, 10_000), "{algorithm}");
        // Asking again, the call of 900 is first: still no room, nothing changed.
        assert!(!ask(900, 2, 10_000), "{algorithm}");
        // It gives up: the call of 100, next in line, fits.
        assert!(
            !ask(900, 2, 0),
            "{algorithm}: a withdrawal answers as a peek"
        );
        assert!(ask(100, 3, 10_000), "{algorithm}");
        // Served, its claim went: another call of 100 fits too.
        assert!(ask(100, 4, 10_000), "{algorithm}");
        // A claim whose call vanished holds its room until its time to wait ends, then expires.
        assert!(!ask(500, 5, 10_000), "{algorithm}");
        assert!(!ask(100, 6, 10_000), "{algorithm}");
        clock.advance(Duration::from_millis(10_001));
        assert!(
            ask(100, 7, 10_000),
            "{algorithm}: an expired claim still held room"
        );
        assert!(
            lock(&store.0.claims).is_empty(),
            "{algorithm}: claims left behind"
        );
    }
}

/// A claim's peek past a token bucket's burst (issue 59, after review): a call of 200 behind a
/// claim of 900, with 950 back in a bucket of 1 000 a minute, waits until the 900 can have gone
/// and its own 200 dripped back (9 s), not "never" (a whole period).
#[test]
fn behind_a_claim_a_token_bucket_answers_the_wait_past_its_burst() {
    use super::super::Claim;
    let clock = ManualClock::new(1_000_000 * 60_000);
    let store = store(&clock);
    let rules = [Rule::per_minute(1_000).metered()];
    let ask = |units: u64, id: u64| {
        let request = CheckRequest::new("k", &rules, Algorithm::TokenBucket).units(units);
        store.check_claimed(
            &request,
            Claim {
                id,
                lasting_ms: 600_000,
            },
        )
    };
    assert!(ask(1_000, 1).allowed);
    assert!(!ask(900, 2).allowed);
    clock.advance(Duration::from_secs(57));
    let behind = ask(200, 3);
    assert!(!behind.allowed);
    assert_eq!(behind.retry_after(), Some(Duration::from_secs(9)));
}
