use std::future::Future;
use std::task::{Context, Waker};

use super::*;
use crate::decision::RuleState;

fn key(identity: &str) -> StorageKey {
    crate::Policy::builder("p")
        .rule(crate::Rule::per_minute(1))
        .build()
        .unwrap()
        .named_key(identity)
}

fn decision(remaining: u64) -> Decision {
    Decision {
        allowed: true,
        rules: vec![RuleState {
            limit: 1_000,
            remaining,
            reset: Duration::from_secs(10),
            retry_after: None,
            bucket_full_at_us: None,
        }],
        now_unix_ms: 0,
        delay: Duration::ZERO,
        quota_alerts: Vec::new(),
        lease: None,
        run_time_override: None,
    }
}

#[test]
fn a_cold_key_takes_single_units_and_a_hot_one_doubles_up_to_the_max() {
    let prefetched = Prefetched::new(16);
    let start = Instant::now();
    // Asks a second apart: never hot, never more than the cost.
    for second in 0..3 {
        let at = start + Duration::from_secs(second);
        assert!(matches!(
            prefetched.spend("cold", 1, at, false, true),
            Spend::Ask { extra: 0, .. }
        ));
    }
    // Requests 100 µs apart, each take answered at once: the second asks for 2 units; from
    // then on each take goes in the background once three quarters of the last are spent,
    // doubling (less what is still in hand) up to the max: no request asks again.
    let mut takes = Vec::new();
    let mut at = start;
    let hot = key("hot");
    for request in 0..60 {
        at += Duration::from_micros(100);
        let (cost, extra) = match prefetched.spend(hot.as_str(), 1, at, false, true) {
            Spend::Local { take_ahead: 0, .. } => continue,
            Spend::Local { take_ahead, .. } => (0, take_ahead),
            Spend::Ask { extra, .. } => {
                assert!(request < 2, "request {request} asked the store");
                (1, extra)
            }
            Spend::Wait { .. } => unreachable!("asked not to wait"),
        };
        takes.push(cost + extra);
        let until = at + Duration::from_secs(1);
        prefetched.took(
            (&hot, None),
            cost,
            extra,
            &Arc::new(decision(500)),
            until,
            at,
        );
    }
    assert_eq!(&takes[..5], [1, 2, 4, 7, 14]);
    assert!(takes[5..].iter().all(|&take| take == 12), "{takes:?}");
}

#[test]
fn one_take_ahead_at_a_time_and_none_for_a_key_spent_slowly() {
    let prefetched = Prefetched::new(8);
    let start = Instant::now();
    let k = key("k");
    let spend = |at| match prefetched.spend(k.as_str(), 1, at, false, true) {
        Spend::Local { take_ahead, .. } => Some(take_ahead),
        Spend::Ask { .. } => None,
        Spend::Wait { .. } => unreachable!("asked not to wait"),
    };
    assert_eq!(spend(start), None);
    let at = start + Duration::from_millis(1);
    assert_eq!(spend(at), None);
    prefetched.took(
        (&k, None),
        1,
        7,
        &Arc::new(decision(50)),
        at + Duration::from_secs(60),
        at,
    );
    // 7 in hand of a take of 8: the 5th request leaves 2 (a quarter) and takes 6 ahead (the
    // max less what is in hand); while that is in flight nobody takes more, and the units
    // left are still spent.
    let spent: Vec<_> = (0..7).map(|_| spend(at).unwrap()).collect();
    assert_eq!(spent, [0, 0, 0, 0, 6, 0, 0]);
    assert_eq!(
        spend(at),
        None,
        "nothing in hand while the take is in flight"
    );
    // One that may wait for the take in flight is woken when it lands.
    let Spend::Wait { landed, .. } = prefetched.spend(k.as_str(), 1, at, true, true) else {
        panic!("a take is in flight: wait for it");
    };
    let mut landed = std::pin::pin!(landed);
    let mut context = Context::from_waker(Waker::noop());
    assert!(landed.as_mut().poll(&mut context).is_pending());
    // The take lands; spending its units over 2 s is not hot: no take ahead.
    prefetched.took(
        (&k, None),
        0,
        6,
        &Arc::new(decision(40)),
        at + Duration::from_secs(60),
        at,
    );
    assert!(landed.as_mut().poll(&mut context).is_ready());
    let slowly: Vec<_> = (1..=6)
        .map(|second| spend(at + Duration::from_secs(second)).unwrap())
        .collect();
    assert_eq!(slowly, [0; 6]);
}

#[test]
fn units_held_never_exceed_the_max_and_expire_with_their_window() {
    let prefetched = Prefetched::new(10);
    let start = Instant::now();
    let k = key("k");
    let ask = |at| match prefetched.spend(k.as_str(), 1, at, false, true) {
        Spend::Ask { extra, .. } => extra,
        Spend::Local { .. } => panic!("nothing in hand"),
        Spend::Wait { .. } => unreachable!("asked not to wait"),
    };
    assert_eq!(ask(start), 0);
    // Hot, and two asks in flight at once: together at most the max.
    let first = ask(start + Duration::from_millis(1));
    let second = ask(start + Duration::from_millis(2));
    assert!(first + second + 2 <= 10, "{first} + {second}");
    let until = start + Duration::from_millis(50);
    let told = prefetched.took((&k, None), 1, first, &Arc::new(decision(100)), until, start);
    assert_eq!(told.rules[0].remaining, 100 + first);
    for _ in 0..first {
        assert!(matches!(
            prefetched.spend(k.as_str(), 1, start + Duration::from_millis(3), false, true),
            Spend::Local { .. }
        ));
    }
    // In hand again, then the window ends: the units are dropped, not spent.
    prefetched.untook(k.as_str(), 1, second);
    prefetched.took((&k, None), 1, 3, &Arc::new(decision(100)), until, start);
    match prefetched.spend(k.as_str(), 1, until, false, true) {
        Spend::Ask { expired, .. } => assert_eq!(expired.units, 3),
        Spend::Local { .. } => panic!("spent a unit past its window"),
        Spend::Wait { .. } => unreachable!("asked not to wait"),
    }
}
