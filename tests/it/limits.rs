//! Limits counted and answered end to end, through the layer on both stores: a client gets
//! exactly its limit, then 429s with an honest Retry-After; two rules bind in turn; refused
//! requests use nothing up; racing tasks, and two app instances on one Redis, get exactly the
//! limit; shadow mode, costs, the duplicate guard and the penalty block, delay mode and the
//! `Limited` extractor answer alike on both stores; a penalty block outlasts its rule's window.
//! In memory on a manual clock, on Redis in Redis's time.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis_server::{TestRedis, unique_prefix};
use common::redis_store::{assert_every_key_expires, store};
use common::{
    app, assert_refused, clock, limits, policy, request_from, retry_after_secs, send, store_at,
    text,
};
use http::StatusCode;
use tower_redis_ratelimit::store::{CheckRequest, Clock};
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Rule, Store};

const PEER: &str = "203.0.113.10:4000";

#[tokio::test]
async fn seed_curl_loop_twenty_per_minute() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingLog] {
        // Half a minute into a window, so a real minute boundary can't fall inside the loop.
        let clock = clock();
        clock.advance(Duration::from_secs(30));
        let app = app(
            policy([Rule::per_minute(20)])
                .algorithm(algorithm)
                .build()
                .unwrap(),
            store_at(&clock),
        );
        for n in 1..=20u64 {
            let response = send(&app, request_from(PEER, "/")).await;
            assert_eq!(response.status(), StatusCode::OK, "request {n}");
            let limits = limits(&response);
            assert_eq!(limits.policy("20-per-60s").unwrap().quota, 20);
            assert_eq!(limits.policy("20-per-60s").unwrap().window, Some(60));
            assert_eq!(limits.status("20-per-60s").unwrap().remaining, 20 - n);
            assert_eq!(text(response).await, "hello");
        }
        for n in 21..=22 {
            let response = send(&app, request_from(PEER, "/")).await;
            assert_eq!(
                response.status(),
                StatusCode::TOO_MANY_REQUESTS,
                "request {n}"
            );
            let retry = retry_after_secs(&response);
            // The window ends (fixed) or the first request leaves (log) 30 s or 60 s from now.
            let expected = match algorithm {
                Algorithm::FixedWindow => 30,
                _ => 60,
            };
            assert_eq!(retry, expected, "{algorithm}");
            let limits = limits(&response);
            assert_eq!(limits.status("20-per-60s").unwrap().remaining, 0);
            assert_refused(response, &["20-per-60s"]).await;
        }
    }
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

/// 2 per second AND 5 per 10 seconds: which rule binds in each phase, and its Retry-After.
#[tokio::test]
async fn two_rules_bind_in_turn_with_exact_retry_after() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingLog] {
        let clock = clock();
        let start = clock.now_unix_ms();
        let at = |ms: u64| clock.set(start + ms);
        let app = app(
            policy([Rule::per_second(2), Rule::new(5, Duration::from_secs(10))])
                .algorithm(algorithm)
                .build()
                .unwrap(),
            store_at(&clock),
        );
        let get = || send(&app, request_from(PEER, "/"));

        // Phase 1: two pass at 0 and 300 ms, then the per-second rule binds.
        at(0);
        assert_eq!(get().await.status(), StatusCode::OK);
        at(300);
        let second = get().await;
        assert_eq!(second.status(), StatusCode::OK);
        let state = limits(&second);
        assert_eq!(state.status("2-per-1s").unwrap().remaining, 0);
        assert_eq!(state.status("5-per-10s").unwrap().remaining, 3);
        at(400);
        let refused = get().await;
        // 600 ms left: to the window end (fixed) or until the 0 ms admission leaves (log).
        assert_eq!(retry_after_secs(&refused), 1, "{algorithm}");
        assert_eq!(limits(&refused).status("2-per-1s").unwrap().reset, Some(1));
        assert_refused(refused, &["2-per-1s"]).await;

        // Phase 2 at 1.2 s: a new window has room for two; the log still holds the 300 ms one.
        at(1_200);
        assert_eq!(get().await.status(), StatusCode::OK);
        let fourth = get().await;
        match algorithm {
            Algorithm::FixedWindow => assert_eq!(fourth.status(), StatusCode::OK),
            _ => {
                assert_eq!(retry_after_secs(&fourth), 1);
                assert_refused(fourth, &["2-per-1s"]).await;
                at(1_300);
                assert_eq!(get().await.status(), StatusCode::OK);
            }
        }

        // Phase 3 at 2.5 s: the fifth passes, then the 10-second rule binds alone.
        at(2_500);
        let fifth = get().await;
        assert_eq!(fifth.status(), StatusCode::OK);
        assert_eq!(limits(&fifth).status("5-per-10s").unwrap().remaining, 0);
        let refused = get().await;
        // 7.5 s until 10 s, where the window ends (fixed) or the 0 ms admission leaves (log).
        assert_eq!(retry_after_secs(&refused), 8, "{algorithm}");
        assert_eq!(limits(&refused).status("2-per-1s").unwrap().remaining, 1);
        assert_refused(refused, &["5-per-10s"]).await;

        at(9_999);
        assert_eq!(get().await.status(), StatusCode::TOO_MANY_REQUESTS);
        at(10_000);
        assert_eq!(get().await.status(), StatusCode::OK, "{algorithm}");
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

#[tokio::test]
async fn rejected_requests_consume_nothing() {
    let clock = clock();
    let app = app(
        policy([Rule::per_second(1), Rule::per_minute(3)])
            .build()
            .unwrap(),
        store_at(&clock),
    );
    for second in 0..3 {
        let admitted = send(&app, request_from(PEER, "/")).await;
        assert_eq!(admitted.status(), StatusCode::OK, "second {second}");
        // A burst of refusals within the second changes neither rule.
        for _ in 0..20 {
            let refused = send(&app, request_from(PEER, "/")).await;
            assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
            let state = limits(&refused);
            assert_eq!(state.status("3-per-60s").unwrap().remaining, 2 - second);
        }
        clock.advance(Duration::from_secs(1));
    }
    assert_eq!(
        send(&app, request_from(PEER, "/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_racing_tasks_get_exactly_fifty() {
    let app = app(
        policy([Rule::per_hour(50)]).build().unwrap(),
        MemoryStore::new(),
    );
    let barrier = Arc::new(tokio::sync::Barrier::new(200));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let app = app.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                send(&app, request_from(PEER, "/")).await.status()
            })
        })
        .collect();
    assert_eq!(common::admitted_and_refused(tasks).await, (50, 150));
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
async fn shadow_cost_duplicate_and_block_in_memory() {
    common::policy_features_work(MemoryStore::new(), "features").await;
}

#[tokio::test]
async fn shadow_cost_duplicate_and_block_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("features");
    common::policy_features_work(store(&redis), &prefix).await;
    // The guard and the block keys expire like the counters.
    assert!(assert_every_key_expires(&redis, &prefix) >= 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_mode_in_memory_admits_exactly_the_reserved_slots() {
    common::delay_mode_spaces_concurrent_waiters(MemoryStore::new(), "delay").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_mode_on_redis_admits_exactly_the_reserved_slots() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("delay");
    common::delay_mode_spaces_concurrent_waiters(store(&redis), &prefix).await;
    assert_every_key_expires(&redis, &prefix);
}

#[tokio::test]
async fn the_extractor_in_memory_answers_like_the_layer() {
    common::the_extractor_limits_like_the_layer(MemoryStore::new(), "alice").await;
}

#[tokio::test]
async fn the_extractor_on_redis_answers_like_the_layer() {
    let redis = TestRedis::shared();
    common::the_extractor_limits_like_the_layer(store(&redis), &unique_prefix("who")).await;
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
