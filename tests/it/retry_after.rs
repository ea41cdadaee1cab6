//! Retry-After keeps its promise, on both stores: a client that waits as long as it says is
//! admitted. With two rules broken (it counts to when both admit), through a penalty block (every
//! algorithm, with and without the duplicate guard), and in delay mode behind the refusal cache,
//! which must not refuse what the store would hold and admit.

use crate::common;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, unique_prefix};
use common::{app, assert_refused, clock, policy, request_from, retry_after_secs, send, store_at};
use http::StatusCode;
use tower_redis_ratelimit::store::{CheckRequest, ManualClock};
use tower_redis_ratelimit::{
    Algorithm, Decision, MemoryStore, Mode, Policy, RateLimitLayer, RedisStore, Rule, Store,
};

/// A store whose clock the test sets: the memory store's manual clock, or Redis's time fixed for
/// the scripts.
enum Clocked {
    Memory(MemoryStore, ManualClock),
    Redis(RedisStore),
}

impl Clocked {
    fn memory(now_ms: u64) -> Clocked {
        let clock = ManualClock::new(now_ms);
        Clocked::Memory(MemoryStore::builder().clock(clock.clone()).build(), clock)
    }

    fn redis(redis: &TestRedis) -> Clocked {
        Clocked::Redis(RedisStore::from_url(&redis.url).expect("a valid Redis URL"))
    }

    fn set_time(&self, now_ms: u64) {
        match self {
            Clocked::Memory(_, clock) => clock.set(now_ms),
            Clocked::Redis(store) => store.fix_time_for_tests(Some(now_ms * 1_000)),
        }
    }

    async fn check(&self, request: &CheckRequest<'_>) -> Decision {
        match self {
            Clocked::Memory(store, _) => store.check(request).await,
            Clocked::Redis(store) => store.check(request).await,
        }
        .expect("the store answers")
    }
}

/// An hour ahead of Redis's clock, on a multiple of 8 s (so a fixed window of 8 s starts there):
/// no key expires by Redis's own time while a case runs.
fn start_ms() -> u64 {
    let now = u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    (now + 3_600_000) / 8_000 * 8_000
}

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::SlidingLog,
    Algorithm::FixedWindow,
    Algorithm::TokenBucket,
    Algorithm::SlidingCounter,
];

/// The outside probe's case: 1 per 8 s with a 2 s block. Refused at 0.2 s (the block starts),
/// refused again at 0.5 s during the block, whose Retry-After must count to when the rule itself
/// admits (about 8 s), not to the block's end (2 s): waiting that long, the client is admitted.
async fn a_client_obeying_retry_after_through_a_block_is_admitted(make: impl Fn(u64) -> Clocked) {
    for algorithm in ALGORITHMS {
        for guard in [false, true] {
            let start = start_ms();
            let store = make(start);
            let key = format!("{}:block:global", unique_prefix("obey"));
            let rules: Vec<Rule> = if guard {
                let policy = Policy::builder("obey")
                    .algorithm(algorithm)
                    .rule(Rule::new(1, Duration::from_secs(8)))
                    .prevent_duplicate(Duration::from_secs(3))
                    .build()
                    .unwrap();
                policy.rules().to_vec()
            } else {
                vec![Rule::new(1, Duration::from_secs(8))]
            };
            let request =
                CheckRequest::new(&key, &rules, algorithm).block_for(Some(Duration::from_secs(2)));
            let case = format!("{algorithm}, guard {guard}");
            store.set_time(start);
            assert!(store.check(&request).await.allowed, "{case}");
            store.set_time(start + 200);
            let first = store.check(&request).await;
            assert!(!first.allowed, "{case}");
            store.set_time(start + 500);
            let during = store.check(&request).await;
            assert!(!during.allowed, "{case}");
            let wait = during.retry_after().unwrap();
            // Every item counts to the later of the block's end and its own admission, and the
            // RateLimit header's `t` (from `reset`) says the same.
            for state in &during.rules {
                assert!(
                    state.retry_after.unwrap() >= Duration::from_millis(1_500),
                    "{case}"
                );
                assert_eq!(Some(state.reset), state.retry_after, "{case}");
            }
            assert!(
                wait >= Duration::from_millis(7_000),
                "{case}: Retry-After {wait:?} ends with the block, before the rule admits"
            );
            // Retry-After is whole seconds, rounded up.
            store.set_time(start + 500 + wait.as_millis().div_ceil(1_000) as u64 * 1_000);
            let obeyed = store.check(&request).await;
            assert!(
                obeyed.allowed,
                "{case}: waited {wait:?} and was refused: {obeyed:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_client_obeying_retry_after_through_a_block_is_admitted_in_memory() {
    a_client_obeying_retry_after_through_a_block_is_admitted(Clocked::memory).await;
}

#[tokio::test]
async fn a_client_obeying_retry_after_through_a_block_is_admitted_on_redis() {
    let redis = TestRedis::shared();
    a_client_obeying_retry_after_through_a_block_is_admitted(|_| Clocked::redis(&redis)).await;
}

/// A rule that is not full still waits for the block's end; one that is full waits for itself
/// when that is later, and for the block when the block ends later.
async fn a_block_reports_the_later_of_its_end_and_each_rule(store: Clocked) {
    let start = start_ms();
    let key = format!("{}:later:global", unique_prefix("later"));
    // 1 per 8 s fills at once; 100 per hour never does here. A block of 20 s outlasts the first.
    let rules = [Rule::new(1, Duration::from_secs(8)), Rule::per_hour(100)];
    let request = CheckRequest::new(&key, &rules, Algorithm::SlidingLog)
        .block_for(Some(Duration::from_secs(20)));
    store.set_time(start);
    assert!(store.check(&request).await.allowed);
    store.set_time(start + 1_000);
    let refused = store.check(&request).await;
    assert_eq!(refused.rules[0].retry_after, Some(Duration::from_secs(20)));
    store.set_time(start + 2_000);
    let blocked = store.check(&request).await;
    let retries: Vec<_> = blocked.rules.iter().map(|s| s.retry_after).collect();
    assert_eq!(
        retries,
        [Some(Duration::from_secs(19)), Some(Duration::from_secs(19))]
    );
}

#[tokio::test]
async fn a_block_reports_the_later_of_its_end_and_each_rule_on_both_stores() {
    a_block_reports_the_later_of_its_end_and_each_rule(Clocked::memory(start_ms())).await;
    let redis = TestRedis::shared();
    a_block_reports_the_later_of_its_end_and_each_rule(Clocked::redis(&redis)).await;
}

const PEER: &str = "198.51.100.9:1000";

/// The outside probe's delay-mode case, in real time: 1 per 1.5 s, waits of up to 1 s. A request
/// at 0.01 s would wait 1.49 s: refused. One at 0.7 s would wait 0.8 s: held and admitted at
/// 1.5 s. The refusal cache, which answers the same identity without the store, must not refuse
/// it on the first refusal's word.
async fn delay_mode_holds_what_fits_after_a_cached_refusal(store: impl Store) {
    let policy = Policy::builder("held")
        .prefix(unique_prefix("held"))
        .key(tower_redis_ratelimit::Key::global())
        .rule(Rule::new(1, Duration::from_millis(1_500)))
        .mode(Mode::Delay {
            max_delay: Duration::from_secs(1),
        })
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, store).refusal_cache(100));
    let started = Instant::now();
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    let refused = send(&app, request_from(PEER, "/")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after_secs(&refused), 2);
    tokio::time::sleep(Duration::from_millis(700).saturating_sub(started.elapsed())).await;
    let held = send(&app, request_from(PEER, "/")).await;
    assert_eq!(
        held.status(),
        StatusCode::OK,
        "within max_delay of its slot, the request is held, not refused from the cache"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(1_450),
        "held until its slot: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn delay_mode_holds_what_fits_after_a_cached_refusal_in_memory() {
    delay_mode_holds_what_fits_after_a_cached_refusal(MemoryStore::new()).await;
}

#[tokio::test]
async fn delay_mode_holds_what_fits_after_a_cached_refusal_on_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).expect("a valid Redis URL");
    delay_mode_holds_what_fits_after_a_cached_refusal(store).await;
}

#[tokio::test]
async fn retry_after_counts_to_when_every_violated_rule_admits() {
    let clock = clock();
    let app = app(
        policy([Rule::per_second(1), Rule::new(2, Duration::from_secs(10))])
            .build()
            .unwrap(),
        store_at(&clock),
    );
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    clock.advance(Duration::from_millis(1_500));
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    clock.advance(Duration::from_millis(200));
    // Now at 1.7 s: the per-second rule frees at 2.5 s, the 10-second rule at 10 s.
    let refused = send(&app, request_from(PEER, "/")).await;
    assert_eq!(retry_after_secs(&refused), 9);
    assert_refused(refused, &["1-per-1s", "2-per-10s"]).await;
}
