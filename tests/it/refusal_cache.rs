//! The layer's cache of refused identities: a flood of refusals costs one store call per identity
//! and window, it never refuses what the store would admit (a property test against a layer
//! without the cache, on stores driven by one manual clock in step with tokio's paused time).
//! (That a refusal flood is not a log flood is in `tests/it/logging.rs`.)

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::{request_from, send};
use http::StatusCode;
use proptest::prelude::*;
use tower_redis_ratelimit::store::{CheckFuture, CheckRequest, ManualClock};
use tower_redis_ratelimit::{
    Algorithm, MemoryStore, Mode, Policy, RateLimitLayer, Rule, Store, policy::Cost,
};

const PEER: &str = "198.51.100.7:1000";

/// A memory store that counts the checks it is asked.
#[derive(Clone)]
struct Counting {
    store: MemoryStore,
    checks: Arc<AtomicU64>,
}

impl Store for Counting {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.checks.fetch_add(1, Ordering::Relaxed);
        self.store.check(request)
    }
}

fn store(clock: &ManualClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build()
}

fn app(policy: Policy, store: impl Store, cache: usize) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, store).refusal_cache(cache))
}

/// A request costing `cost`.
fn request(cost: u64) -> http::Request<axum::body::Body> {
    let mut request = request_from(PEER, "/");
    request.extensions_mut().insert(Cost(cost));
    request
}

fn retry_after(response: &http::Response<axum::body::Body>) -> Option<String> {
    response
        .headers()
        .get(http::header::RETRY_AFTER)
        .map(|value| value.to_str().unwrap().to_owned())
}

/// Both clocks move together: the store's and the cache's (tokio's paused time).
async fn advance(clock: &ManualClock, by: Duration) {
    clock.advance(by);
    tokio::time::advance(by).await;
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_refusals_asks_the_store_once_a_second_at_most() {
    let clock = ManualClock::new(1_700_000_000_000);
    let checks = Arc::new(AtomicU64::new(0));
    let counting = Counting {
        store: store(&clock),
        checks: checks.clone(),
    };
    let policy = Policy::builder("flood")
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_minute(3))
        .build()
        .unwrap();
    let app = app(policy, counting, 100);
    let mut statuses = Vec::new();
    for _ in 0..100 {
        statuses.push(send(&app, request(1)).await.status());
    }
    assert_eq!(statuses.iter().filter(|s| **s == StatusCode::OK).count(), 3);
    // Three admissions and the first refusal asked the store; 96 refusals did not.
    assert_eq!(checks.load(Ordering::Relaxed), 4);

    // A cached refusal counts down to the same instant as the store's.
    let window_end = 60 - (clock_secs(&clock) % 60);
    advance(&clock, Duration::from_millis(900)).await;
    let cached = send(&app, request(1)).await;
    assert_eq!(cached.status(), StatusCode::TOO_MANY_REQUESTS);
    // 0.9 s later, rounded up: the same whole second.
    assert_eq!(retry_after(&cached), Some(window_end.to_string()));
    assert_eq!(checks.load(Ordering::Relaxed), 4);

    // A cached refusal stands a second at most (an operator's reset elsewhere may lift it): then
    // the store is asked again, which refuses again, and the cache answers for another second.
    advance(&clock, Duration::from_secs(9)).await;
    for _ in 0..10 {
        let refused = send(&app, request(1)).await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        // 9.9 s later, rounded up.
        assert_eq!(retry_after(&refused), Some((window_end - 9).to_string()));
    }
    assert_eq!(checks.load(Ordering::Relaxed), 5);

    // Once the window is over the store is asked again, and admits.
    advance(&clock, Duration::from_millis(window_end * 1000 - 9_900)).await;
    assert_eq!(send(&app, request(1)).await.status(), StatusCode::OK);
    assert_eq!(checks.load(Ordering::Relaxed), 6);
}

fn clock_secs(clock: &ManualClock) -> u64 {
    use tower_redis_ratelimit::store::Clock;
    clock.now_unix_ms() / 1000
}

#[derive(Debug, Clone)]
struct Case {
    algorithm: Algorithm,
    block: bool,
    /// Delay mode's `max_delay` (ms), for the algorithms that can reserve.
    max_delay: Option<u64>,
    steps: Vec<(u64, u64)>,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![
            Algorithm::FixedWindow,
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::TokenBucket,
        ]),
        any::<bool>(),
        prop::option::of(1u64..2_500),
        prop::collection::vec((0u64..1_500, 1u64..=3), 1..60),
    )
        .prop_map(|(algorithm, block, max_delay, steps)| Case {
            algorithm,
            block,
            max_delay: max_delay.filter(|_| algorithm.can_reserve()),
            steps,
        })
}

fn tokio_clocked() -> MemoryStore {
    MemoryStore::builder()
        .clock(common::TokioClock::new())
        .build()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The cached layer answers every request as a layer without the cache does (status and
    /// Retry-After), so it never refuses what the store would admit: with and without a penalty
    /// block, and in delay mode, where the store holds what fits within `max_delay`.
    #[test]
    fn the_cache_answers_as_the_store_would(case in cases()) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut builder = Policy::builder("same")
                .algorithm(case.algorithm)
                .rule(Rule::per_second(3))
                .rule(Rule::new(6, Duration::from_secs(10)));
            if case.block {
                builder = builder.block_for(Duration::from_secs(4));
            }
            if let Some(max_delay) = case.max_delay {
                builder = builder.mode(Mode::Delay { max_delay: Duration::from_millis(max_delay) });
            }
            let policy = builder.build().unwrap();
            let checks = Arc::new(AtomicU64::new(0));
            let cached = app(
                policy.clone(),
                Counting { store: tokio_clocked(), checks: checks.clone() },
                100,
            );
            let uncached = app(policy, tokio_clocked(), 0);
            for (step, &(wait_ms, cost)) in case.steps.iter().enumerate() {
                tokio::time::advance(Duration::from_millis(wait_ms)).await;
                // Side by side, so both are checked at the same instant, however long a held
                // request then sleeps.
                let (expected, got) =
                    tokio::join!(send(&uncached, request(cost)), send(&cached, request(cost)));
                assert_eq!(got.status(), expected.status(), "step {step} of {case:?}");
                assert_eq!(
                    retry_after(&got),
                    retry_after(&expected),
                    "step {step} of {case:?}"
                );
            }
        });
    }
}

#[tokio::test]
async fn a_give_back_lifts_a_cached_refusal_at_once() {
    // One login attempt an hour, counted only when it fails (count_only): while one attempt is
    // in flight, the next is refused, and the refusal cached; the first then succeeds and gives
    // its unit back, so the next attempt is admitted by the store, not refused by the cache.
    let store = MemoryStore::new();
    let policy = Policy::builder("login")
        .prefix("cache-give-back")
        .rule(Rule::per_hour(1))
        .count_only(|status| status != StatusCode::OK)
        .build()
        .unwrap();
    let (entered, proceed) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let handler = {
        let (entered, proceed) = (entered.clone(), proceed.clone());
        move || async move {
            entered.notify_one();
            proceed.notified().await;
            "welcome"
        }
    };
    let slow = Router::new()
        .route("/", get(handler))
        .route("/fast", get(|| async { "welcome" }))
        .layer(RateLimitLayer::new(policy, store).refusal_cache(16));
    let first = tokio::spawn({
        let slow = slow.clone();
        async move { send(&slow, request_from(PEER, "/")).await.status() }
    });
    entered.notified().await;
    assert_eq!(send(&slow, request_from(PEER, "/")).await.status(), 429);
    assert_eq!(
        send(&slow, request_from(PEER, "/")).await.status(),
        429,
        "from the cache"
    );
    proceed.notify_one();
    assert_eq!(first.await.unwrap(), 200);
    // (The give-back runs once the body ends, which `send` does not wait for.)
    let mut status = StatusCode::TOO_MANY_REQUESTS;
    for _ in 0..100 {
        status = send(&slow, request_from(PEER, "/fast")).await.status();
        if status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        status,
        StatusCode::OK,
        "the store admits it again, the cache did not answer"
    );
}
