//! Units come back only where they were charged (issue 46): a `count_only` settle, a receipt
//! (`Admitted::refund`), units taken ahead given back at shutdown or when they sat idle, each
//! gives back to the window (sliding-log entry, token bucket's unrepaid time, quota day) its
//! admission charged, and a rolled window gets nothing. Every case runs on both stores, at times
//! the test sets: a memory store on a manual clock, a Redis store fixed at the same times.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, assert_every_key_expires, unique_prefix};
use common::timed::{a_minute_an_hour_ahead, both_stores};
use common::{request_from, send};
use http::StatusCode;
use proptest::prelude::*;
use tokio::sync::Notify;
use tower_redis_ratelimit::store::{CheckRequest, ManualClock};
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, RateLimitLayer, RateLimiter, RedisStore, Rule, Store,
};

/// A policy `name` of one rule, `limit` per `secs`, counted by `algorithm` under `prefix`.
fn one_rule(name: &str, prefix: &str, algorithm: Algorithm, limit: u64, secs: u64) -> Policy {
    Policy::builder(name)
        .prefix(prefix)
        .algorithm(algorithm)
        .rule(Rule::new(limit, Duration::from_secs(secs)))
        .build()
        .unwrap()
}

fn login_failures(prefix: &str, algorithm: Algorithm) -> Policy {
    Policy::builder("login-failures")
        .prefix(prefix)
        .key(Key::global())
        .algorithm(algorithm)
        .rule(Rule::new(3, Duration::from_secs(4)))
        .count_only(|status| status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap()
}

/// `/slow` answers 200 once `release` is notified, `/fail` answers 401 at once; both count the
/// calls that reach them.
fn login(
    policy: Policy,
    store: Arc<dyn Store>,
    release: Arc<Notify>,
) -> (Router, Arc<AtomicUsize>) {
    let reached = Arc::new(AtomicUsize::new(0));
    let (slow_reached, fail_reached) = (reached.clone(), reached.clone());
    let router = Router::new()
        .route(
            "/slow",
            get(move || {
                let (reached, release) = (slow_reached.clone(), release.clone());
                async move {
                    let released = release.notified();
                    reached.fetch_add(1, Ordering::SeqCst);
                    released.await;
                    StatusCode::OK
                }
            }),
        )
        .route(
            "/fail",
            get(move || {
                fail_reached.fetch_add(1, Ordering::SeqCst);
                async { StatusCode::UNAUTHORIZED }
            }),
        )
        .layer(RateLimitLayer::new(policy, store));
    (router, reached)
}

async fn status_of(app: &Router, uri: &str) -> StatusCode {
    send(app, request_from("203.0.113.9:1000", uri))
        .await
        .status()
}

/// Issue 46, row 1: fixed window 3 per 4 s, only 401 counts. Three slow 200s are charged 3 s
/// into window w; three failures come 150 ms into w+1; the 200s then finish. Their charges go
/// back to w, which has rolled: nothing comes out of w+1, and a fourth failure in w+1 is refused.
/// (Before the fix: the refunds came out of w+1, and 6 counted 401s passed one window of 3.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_only_success_settled_after_a_roll_gives_nothing_to_the_new_window() {
    let w = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("give-back-roll", w + 3_000) {
        let release = Arc::new(Notify::new());
        let policy = login_failures(&prefix, Algorithm::FixedWindow);
        let (app, reached) = login(policy, timed.store.clone(), release.clone());
        let slow: Vec<_> = (0..3)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(async move { status_of(&app, "/slow").await })
            })
            .collect();
        while reached.load(Ordering::SeqCst) < 3 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        timed.at(w + 4_150);
        for _ in 0..3 {
            assert_eq!(status_of(&app, "/fail").await, StatusCode::UNAUTHORIZED);
        }
        release.notify_waiters();
        for request in slow {
            assert_eq!(request.await.unwrap(), StatusCode::OK);
        }
        timed.until_calls_land().await;
        assert_eq!(
            status_of(&app, "/fail").await,
            StatusCode::TOO_MANY_REQUESTS,
            "{}: a fourth counted failure in one window of 3",
            timed.name
        );
        timed.assert_keys_expire();
    }
}

/// Within its window, the same success gives its charge back (the case above is not passing
/// for giving nothing back at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_only_success_settled_in_its_window_gives_its_charge_back() {
    let w = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("give-back-same", w + 1_000) {
        let release = Arc::new(Notify::new());
        let policy = login_failures(&prefix, Algorithm::FixedWindow);
        let (app, reached) = login(policy, timed.store.clone(), release.clone());
        let slow = {
            let app = app.clone();
            tokio::spawn(async move { status_of(&app, "/slow").await })
        };
        while reached.load(Ordering::SeqCst) < 1 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        release.notify_waiters();
        assert_eq!(slow.await.unwrap(), StatusCode::OK);
        timed.until_calls_land().await;
        for _ in 0..3 {
            assert_eq!(
                status_of(&app, "/fail").await,
                StatusCode::UNAUTHORIZED,
                "{}",
                timed.name
            );
        }
        assert_eq!(
            status_of(&app, "/fail").await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}

/// Issue 46, row 2: a handle's receipts, `check` ×3 in w, `check` ×3 in w+1, then w's three
/// refunded by receipt: w+1 stays full. The same receipts inside their window give back.
#[tokio::test]
async fn a_receipt_gives_nothing_back_once_its_window_rolled() {
    let w = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("receipt-roll", w + 500) {
        let policy = one_rule("otp", &prefix, Algorithm::FixedWindow, 3, 4);
        let limiter = RateLimiter::new(policy, timed.store.clone());
        let mut first = Vec::new();
        for _ in 0..3 {
            first.push(limiter.check("alice").await.unwrap());
        }
        timed.at(w + 4_500);
        for _ in 0..3 {
            limiter.check("alice").await.unwrap();
        }
        for admitted in first {
            let after = admitted.refund().await.unwrap();
            assert_eq!(
                after.rules[0].remaining, 0,
                "{}: w+1 got w's units",
                timed.name
            );
        }
        assert!(limiter.check("alice").await.is_err(), "{}", timed.name);
        // In its own window a receipt gives its units back, once.
        timed.at(w + 8_500);
        let admitted = limiter.check_n("alice", 2).await.unwrap();
        assert_eq!(admitted.decision().unwrap().rules[0].remaining, 1);
        let after = admitted.refund().await.unwrap();
        assert_eq!(after.rules[0].remaining, 3, "{}", timed.name);
        timed.assert_keys_expire();
    }
}

/// Issue 46, row 3: `count_only` on a sliding log, 3 per 4 s. A slow 200 is charged at 0, two
/// failures at 3.0 s, the 200 finishes at 3.5 s: its own entry goes, not a failure's. A third
/// failure then fits at 3.5 s, and a fourth is refused at 4.0 s (the three failures are within
/// 1 s). (Before the fix: the refund dropped a failure's entry, and 4 failures passed in 1.1 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_log_gives_back_the_admission_s_own_entry() {
    let t0 = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("give-back-log", t0) {
        let release = Arc::new(Notify::new());
        let policy = login_failures(&prefix, Algorithm::SlidingLog);
        let (app, reached) = login(policy, timed.store.clone(), release.clone());
        let slow = {
            let app = app.clone();
            tokio::spawn(async move { status_of(&app, "/slow").await })
        };
        while reached.load(Ordering::SeqCst) < 1 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        timed.at(t0 + 3_000);
        for _ in 0..2 {
            assert_eq!(status_of(&app, "/fail").await, StatusCode::UNAUTHORIZED);
        }
        timed.at(t0 + 3_500);
        release.notify_waiters();
        assert_eq!(slow.await.unwrap(), StatusCode::OK);
        timed.until_calls_land().await;
        assert_eq!(
            status_of(&app, "/fail").await,
            StatusCode::UNAUTHORIZED,
            "{}",
            timed.name
        );
        timed.at(t0 + 4_000);
        assert_eq!(
            status_of(&app, "/fail").await,
            StatusCode::TOO_MANY_REQUESTS,
            "{}: a fourth failure within a second, against 3 per 4 s",
            timed.name
        );
        timed.assert_keys_expire();
    }
}

/// A reset forgets an identity's counts: a receipt of an admission before it gives nothing back
/// to the counts after it (they hold none of its units), though its window is still current.
#[tokio::test]
async fn a_receipt_from_before_a_reset_gives_nothing_to_the_counts_after_it() {
    let w = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("receipt-reset", w + 500) {
        let policy = one_rule("otp", &prefix, Algorithm::FixedWindow, 3, 4);
        let limiter = RateLimiter::new(policy, timed.store.clone());
        let mut before = Vec::new();
        for _ in 0..3 {
            before.push(limiter.check("alice").await.unwrap());
        }
        timed.at(w + 1_000);
        limiter.reset("alice").await.unwrap();
        timed.at(w + 1_500);
        for _ in 0..3 {
            limiter.check("alice").await.unwrap();
        }
        for admitted in before {
            let after = admitted.refund().await.unwrap();
            assert_eq!(
                after.rules[0].remaining, 0,
                "{}: a reset's counts gave back",
                timed.name
            );
        }
        assert!(limiter.check("alice").await.is_err(), "{}", timed.name);
        timed.assert_keys_expire();
    }
}

/// The reset's mark lasts as long as a receipt of an earlier admission can give back: a
/// sliding counter's charged window still weighs a period after it ends, so the mark outlives
/// the period, and the counts after the reset keep what they hold.
#[tokio::test]
async fn a_reset_outlasts_every_earlier_receipt() {
    let w = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("receipt-reset-counter", w + 1_000) {
        let policy = one_rule("counter", &prefix, Algorithm::SlidingCounter, 10, 10);
        let limiter = RateLimiter::new(policy, timed.store.clone());
        let before = limiter.check_n("k", 5).await.unwrap();
        timed.at(w + 2_000);
        limiter.reset("k").await.unwrap();
        timed.at(w + 3_000);
        limiter.check_n("k", 10).await.unwrap();
        // Halfway through the next window: the 10 after the reset weigh 5.
        timed.at(w + 15_000);
        assert_eq!(limiter.peek("k").await.unwrap().rules[0].remaining, 5);
        let after = before.refund().await.unwrap();
        assert_eq!(
            after.rules[0].remaining, 5,
            "{}: a reset's counts gave back",
            timed.name
        );
        timed.assert_keys_expire();
    }
}

/// A sliding counter's units go back to the window they were charged in, even once it is the
/// previous one (it still weighs in the estimate), and lower the estimate by what they added.
#[tokio::test]
async fn a_sliding_counter_gives_back_to_the_charged_window_while_it_weighs() {
    let w = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("give-back-counter", w + 9_000) {
        let policy = one_rule("counter", &prefix, Algorithm::SlidingCounter, 10, 10);
        let limiter = RateLimiter::new(policy, timed.store.clone());
        let first = limiter.check_n("k", 5).await.unwrap();
        let second = limiter.check_n("k", 5).await.unwrap();
        // 1 s into the next window: the previous window's 10 weigh just under 90 %: 8 used.
        timed.at(w + 11_000);
        assert_eq!(limiter.peek("k").await.unwrap().rules[0].remaining, 2);
        let after = first.refund().await.unwrap();
        // Without those 5, the previous window holds 5: 4 (4.4999…) used.
        assert_eq!(after.rules[0].remaining, 6, "{}", timed.name);
        // Two windows on, the charge's window weighs nothing: it gives nothing to the current
        // window's count.
        timed.at(w + 21_000);
        limiter.check_n("k", 4).await.unwrap();
        let after = second.refund().await.unwrap();
        assert_eq!(after.rules[0].remaining, 6, "{}", timed.name);
        timed.assert_keys_expire();
    }
}

/// A token bucket gets back only what time has not repaid of a charge: 10 units charged, 3 s
/// later (3 dripped back) the receipt gives back the other 7; a charge time has fully repaid
/// gives nothing, even to a bucket emptied since by others.
#[tokio::test]
async fn a_token_bucket_gets_back_only_what_time_has_not_repaid() {
    let t0 = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("give-back-bucket", t0) {
        let policy = one_rule("bucket", &prefix, Algorithm::TokenBucket, 10, 10);
        let limiter = RateLimiter::new(policy, timed.store.clone());
        let all = limiter.check_n("k", 10).await.unwrap();
        timed.at(t0 + 3_000);
        assert_eq!(limiter.peek("k").await.unwrap().rules[0].remaining, 3);
        limiter.check_n("k", 3).await.unwrap();
        let after = all.refund().await.unwrap();
        assert_eq!(after.rules[0].remaining, 7, "{}", timed.name);
        // A charge of 2 at 3 s, 12 s idle: full again; another drains it; the old receipt
        // gives nothing.
        let old = limiter.check_n("k", 2).await.unwrap();
        timed.at(t0 + 15_000);
        limiter.check_n("k", 10).await.unwrap();
        let after = old.refund().await.unwrap();
        assert_eq!(after.rules[0].remaining, 0, "{}", timed.name);
        timed.assert_keys_expire();
    }
}

/// The quota's units go back to the day that was charged, and not to the next.
#[tokio::test]
async fn a_quota_gets_back_only_on_the_charged_day() {
    let day = 86_400_000;
    let midnight = a_minute_an_hour_ahead() / day * day + day;
    for (timed, prefix) in both_stores("give-back-quota", midnight - 1_000) {
        let policy = Policy::builder("daily")
            .prefix(&prefix)
            .rule(Rule::per_second(1_000))
            .quota(
                tower_redis_ratelimit::Quota::builder("calls")
                    .prefix(&prefix)
                    .tier("free", 5)
                    .build()
                    .unwrap(),
            )
            .build()
            .unwrap();
        let limiter = RateLimiter::new(policy, timed.store.clone());
        let yesterday = limiter.check_n("k", 3).await.unwrap();
        let today_receipt = limiter.check_n("k", 2).await.unwrap();
        let after = today_receipt.refund().await.unwrap();
        assert_eq!(after.rules[1].remaining, 2, "{}", timed.name);
        timed.at(midnight + 2_000);
        for _ in 0..5 {
            limiter.check("k").await.unwrap();
        }
        let after = yesterday.refund().await.unwrap();
        assert_eq!(
            after.rules[1].remaining, 0,
            "{}: yesterday's units went to today",
            timed.name
        );
        timed.assert_keys_expire();
    }
}

/// Issue 46, row 4: fixed window 300 per 4 s, `prefetch(100)`. A holds units taken in w; B is
/// admitted 300 in w+1; A gives its units back: they don't land in w+1, which stays full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_taken_ahead_given_back_after_a_roll_stay_out_of_the_new_window() {
    let w = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("give-back-prefetch", w + 1_000) {
        let policy = Policy::builder("hot")
            .prefix(&prefix)
            .key(Key::global())
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::new(300, Duration::from_secs(4)))
            .prefetch(100)
            .build()
            .unwrap();
        let a = RateLimiter::new(policy.clone(), timed.store.clone());
        for _ in 0..40 {
            a.check("global").await.unwrap();
        }
        let shared = a.peek("global").await.unwrap().rules[0].remaining;
        assert!(
            shared < 300 - 40,
            "{}: A holds nothing ({shared} left)",
            timed.name
        );
        timed.at(w + 5_000);
        let b = RateLimiter::new(policy.clone(), timed.store.clone());
        let mut admitted = 0;
        while b.check("global").await.is_ok() {
            admitted += 1;
        }
        assert_eq!(admitted, 300, "{}", timed.name);
        a.give_back_prefetched().await;
        let fresh = RateLimiter::new(policy, timed.store.clone());
        assert!(
            fresh.check("global").await.is_err(),
            "{}: A's units from w landed in w+1",
            timed.name
        );
        // Given back within their window, they come back.
        timed.at(w + 9_000);
        let c = RateLimiter::new(fresh.policy().clone(), timed.store.clone());
        for _ in 0..40 {
            c.check("global").await.unwrap();
        }
        let held = 300 - 40 - c.peek("global").await.unwrap().rules[0].remaining;
        assert!(held > 0, "{}: C holds nothing", timed.name);
        c.give_back_prefetched().await;
        let after = c.peek("global").await.unwrap().rules[0].remaining;
        assert_eq!(after, 300 - 40, "{}", timed.name);
        timed.assert_keys_expire();
    }
}

/// Issue 46, row 5: a token bucket, 100 per 10 s, `prefetch(64)`. A holds units; 10.5 s idle
/// (the bucket is full again by time); B drains it; A's next check finds its units idle and
/// gives them back: time has repaid them already, so they add nothing, and the bucket stays
/// empty. (Before the fix: 127 admitted within ~135 ms against a burst of 100.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_bucket_s_idle_units_add_nothing_once_time_repaid_them() {
    let t0 = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("give-back-idle", t0) {
        let policy = Policy::builder("hot")
            .prefix(&prefix)
            .key(Key::global())
            .algorithm(Algorithm::TokenBucket)
            .rule(Rule::new(100, Duration::from_secs(10)))
            .prefetch(64)
            .build()
            .unwrap();
        let a = RateLimiter::new(policy.clone(), timed.store.clone());
        for _ in 0..40 {
            a.check("global").await.unwrap();
        }
        let left = a.peek("global").await.unwrap().rules[0].remaining;
        assert!(left < 100 - 40, "{}: A holds nothing", timed.name);
        timed.at(t0 + 10_500);
        // Units in hand are idle after a second (the instance's own clock).
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let b = RateLimiter::new(policy.clone(), timed.store.clone());
        let mut admitted = 0;
        while b.check("global").await.is_ok() {
            admitted += 1;
        }
        assert_eq!(admitted, 100, "{}", timed.name);
        assert!(a.check("global").await.is_err(), "{}", timed.name);
        timed.until_calls_land().await;
        let fresh = RateLimiter::new(policy, timed.store.clone());
        assert!(
            fresh.check("global").await.is_err(),
            "{}: A's idle units went back to a bucket time had refilled",
            timed.name
        );
        timed.assert_keys_expire();
    }
}

/// A client that leaves before its answer keeps its `count_only` charge (the outcome is
/// unknown, and the handler's work may have run), and so does a request whose handler
/// panicked: three of them use a limit of 3 up, though no 401 was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_or_panicked_request_keeps_its_count_only_charge() {
    let w = a_minute_an_hour_ahead();
    for (timed, prefix) in both_stores("give-back-abandoned", w + 100) {
        let release = Arc::new(Notify::new());
        let policy = login_failures(&prefix, Algorithm::FixedWindow);
        let (app, reached) = login(policy.clone(), timed.store.clone(), release);
        for _ in 0..2 {
            let abandoned =
                tokio::time::timeout(Duration::from_millis(50), status_of(&app, "/slow"));
            assert!(abandoned.await.is_err(), "the slow request answered");
        }
        assert_eq!(reached.load(Ordering::SeqCst), 2);
        let panicking = Router::new()
            .route(
                "/panic",
                get(|| async {
                    if true {
                        panic!("the handler failed");
                    }
                    StatusCode::OK
                }),
            )
            .layer(RateLimitLayer::new(policy, timed.store.clone()));
        let task = tokio::spawn(async move { status_of(&panicking, "/panic").await });
        assert!(task.await.unwrap_err().is_panic());
        timed.until_calls_land().await;
        assert_eq!(
            status_of(&app, "/fail").await,
            StatusCode::TOO_MANY_REQUESTS,
            "{}",
            timed.name
        );
    }
}

/// One step of a property case: move the clock on, check (keeping the receipt), or give back
/// some units of a receipt kept earlier (each receipt once).
#[derive(Debug, Clone)]
enum Step {
    Wait(u64),
    Check(u64),
    GiveBack(usize, u64),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        1 => (0u64..3_000).prop_map(Step::Wait),
        3 => (1u64..4).prop_map(Step::Check),
        2 => (0usize..16, 1u64..4).prop_map(|(which, units)| Step::GiveBack(which, units)),
    ];
    prop::collection::vec(step, 1..40)
}

fn rules() -> impl Strategy<Value = (Algorithm, Vec<(u64, u64)>)> {
    let algorithm = prop_oneof![
        Just(Algorithm::FixedWindow),
        Just(Algorithm::SlidingLog),
        Just(Algorithm::SlidingCounter),
        Just(Algorithm::TokenBucket)
    ];
    // Windows of 1 to 4 s, so a case's waits roll them over and over.
    let rule = (
        1u64..8,
        prop_oneof![Just(1_000u64), Just(2_000), Just(4_000)],
    );
    let rules = prop::collection::vec(rule, 1..3).prop_filter("distinct periods", |rules| {
        rules[0].1 != rules.last().unwrap().1 || rules.len() == 1
    });
    (algorithm, rules)
}

/// The same checks and give-backs, across window rolls, get the same answers from the memory
/// store and the Redis store, for every algorithm; and a fixed window never holds more than its
/// limit of units that stayed charged (admitted, less what went back to that same window).
#[test]
fn memory_and_redis_agree_on_give_backs_across_rolls() {
    let redis = TestRedis::shared();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    });
    let outcome = runner.run(&(rules(), steps()), |((algorithm, rules), steps)| {
        let rules: Vec<Rule> = rules
            .iter()
            .map(|&(limit, period)| Rule::new(limit, Duration::from_millis(period)))
            .collect();
        let prefix = unique_prefix("give-back-agree");
        let key = format!("{prefix}:p:user:k");
        let mut now = a_minute_an_hour_ahead();
        let clock = ManualClock::new(now);
        let memory = MemoryStore::builder().clock(clock.clone()).build();
        let redis_store = RedisStore::from_url(&redis.url).expect("a valid Redis URL");
        redis_store.fix_time_for_tests(Some(now * 1_000));
        // Per fixed-window rule: units charged and still held, by window start.
        let mut held: Vec<std::collections::HashMap<u64, u64>> =
            vec![Default::default(); rules.len()];
        runtime.block_on(async {
            let mut receipts = Vec::new();
            for step in steps {
                let request = CheckRequest::new(&key, &rules, algorithm);
                match step {
                    Step::Wait(ms) => {
                        now += ms;
                        clock.set(now);
                        redis_store.fix_time_for_tests(Some(now * 1_000));
                    }
                    Step::Check(cost) => {
                        let request = request.cost(cost);
                        let in_memory = memory.check(&request).await.unwrap();
                        let in_redis = redis_store.check(&request).await.unwrap();
                        prop_assert_eq!(in_memory.allowed, in_redis.allowed);
                        prop_assert_eq!(remaining(&in_memory), remaining(&in_redis));
                        if in_memory.allowed {
                            for (rule, held) in rules.iter().zip(&mut held) {
                                let period = rule.period_ms();
                                *held.entry(now - now % period).or_default() += cost;
                            }
                            receipts.push(Some((cost, in_memory, in_redis)));
                        }
                    }
                    Step::GiveBack(which, units) => {
                        let Some(Some((cost, charged_memory, charged_redis))) =
                            receipts.get_mut(which).map(Option::take)
                        else {
                            continue;
                        };
                        let units = units.min(cost);
                        let request = request.cost(units);
                        let in_memory = memory.give_back(&request, &charged_memory).await.unwrap();
                        let in_redis = redis_store
                            .give_back(&request, &charged_redis)
                            .await
                            .unwrap();
                        prop_assert_eq!(remaining(&in_memory), remaining(&in_redis));
                        let charged_at = charged_memory.now_unix_ms;
                        for (rule, held) in rules.iter().zip(&mut held) {
                            let period = rule.period_ms();
                            let window = charged_at - charged_at % period;
                            if window == now - now % period {
                                let units_held = held.entry(window).or_default();
                                *units_held -= units.min(*units_held);
                            }
                        }
                    }
                }
                if algorithm == Algorithm::FixedWindow {
                    for (rule, held) in rules.iter().zip(&held) {
                        let window = now - now % rule.period_ms();
                        let units = held.get(&window).copied().unwrap_or(0);
                        prop_assert!(
                            units <= rule.limit(),
                            "{units} held in a window of {rule:?}"
                        );
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

/// Each rule's (remaining, refused) of a decision.
fn remaining(decision: &tower_redis_ratelimit::Decision) -> Vec<(u64, bool)> {
    decision
        .rules
        .iter()
        .map(|rule| (rule.remaining, rule.retry_after.is_some()))
        .collect()
}

/// A batch's admissions into a sliding log wait and go to Redis as one member at its end, or
/// before anything reads the log's members (a give-back, a refusal's wait): checks and
/// give-backs of one key mixed in one batch answer as one after another on the memory store,
/// and every key still expires.
#[tokio::test]
async fn a_sliding_log_s_batch_mixing_checks_and_give_backs_answers_as_one_after_another() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("sl-pending");
    let key = format!("{prefix}:p:user:k");
    let rules = [Rule::new(6, Duration::from_secs(1)), Rule::per_minute(9)];
    let now = a_minute_an_hour_ahead();
    let memory = MemoryStore::builder().clock(ManualClock::new(now)).build();
    let redis_store = RedisStore::from_url(&redis.url).expect("a valid Redis URL");
    redis_store.fix_time_for_tests(Some(now * 1_000));
    let request = CheckRequest::new(&key, &rules, Algorithm::SlidingLog);
    // Charged alone first: the receipts the batch gives back by.
    let mut charged = Vec::new();
    for cost in [2, 1] {
        let request = request.cost(cost);
        let in_memory = memory.check(&request).await.unwrap();
        let in_redis = redis_store.check(&request).await.unwrap();
        assert!(in_memory.allowed && in_redis.allowed);
        charged.push((cost, in_memory, in_redis));
    }
    // Then, at once: the first goes alone, the rest queue behind it and go as one batch, in
    // order: checks joining one waiting member, give-backs reading the log, a refusal's wait.
    enum Step {
        Check(u64),
        GiveBack(usize),
    }
    let steps = [
        Step::Check(1),
        Step::Check(1),
        Step::GiveBack(0),
        Step::Check(2),
        Step::Check(3),
        Step::GiveBack(1),
        Step::Check(1),
        Step::Check(4),
    ];
    let mut in_memory = Vec::new();
    for step in &steps {
        in_memory.push(match step {
            Step::Check(cost) => memory.check(&request.cost(*cost)).await.unwrap(),
            Step::GiveBack(which) => {
                let (cost, charged, _) = &charged[*which];
                let request = request.cost(*cost);
                memory.give_back(&request, charged).await.unwrap()
            }
        });
    }
    let requests: Vec<CheckRequest<'_>> = steps
        .iter()
        .map(|step| match step {
            Step::Check(cost) => request.cost(*cost),
            Step::GiveBack(which) => request.cost(charged[*which].0),
        })
        .collect();
    let calls = steps
        .iter()
        .zip(&requests)
        .map(|(step, request)| match step {
            Step::Check(_) => redis_store.check(request),
            Step::GiveBack(which) => redis_store.give_back(request, &charged[*which].2),
        });
    let in_redis = futures_util::future::join_all(calls).await;
    assert!(
        redis_store.batch_stats().largest_batch >= 7,
        "the queued calls went as one batch: {:?}",
        redis_store.batch_stats()
    );
    for (index, (memory, redis)) in in_memory.iter().zip(in_redis).enumerate() {
        let redis = redis.expect("an answer");
        assert_eq!(memory.allowed, redis.allowed, "step {index}");
        assert_eq!(remaining(memory), remaining(&redis), "step {index}");
        assert_eq!(memory.retry_after(), redis.retry_after(), "step {index}");
    }
    assert_every_key_expires(&mut redis.client(), &prefix);
}
