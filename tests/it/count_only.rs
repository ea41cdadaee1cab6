//! `count_only`: only responses whose status counts use the limit up. Every admitted request is
//! charged up front, so concurrent failures never pass the limit; a response that doesn't count
//! gives its charge back. Both stores.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, unique_prefix};
use common::{request_from, send};
use http::StatusCode;
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, RateLimitLayer, RateLimiter, RedisStore, Rule, Store,
};

fn failures(prefix: &str) -> Policy {
    Policy::builder("login-failures")
        .prefix(prefix)
        .key(Key::global())
        .rule(Rule::per_hour(5))
        .count_only(|status| status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap()
}

/// A login route whose handler answers `status` after a while (so requests overlap), counting
/// the calls that reach it.
fn login(
    policy: Policy,
    store: impl Store,
    status: StatusCode,
    reached: Arc<AtomicUsize>,
) -> Router {
    Router::new()
        .route(
            "/login",
            get(move || {
                let reached = reached.clone();
                async move {
                    reached.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    status
                }
            }),
        )
        .layer(RateLimitLayer::new(policy, store))
}

async fn twenty_at_once(app: &Router) -> Vec<StatusCode> {
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                send(&app, request_from("203.0.113.9:1000", "/login"))
                    .await
                    .status()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for request in requests {
        statuses.push(request.await.unwrap());
    }
    statuses
}

/// Successes first (they give their charges back), then 20 failures at once: exactly the
/// limit's worth reach the handler.
async fn only_failures_use_the_limit_up(store: impl Store + Clone, prefix: &str) {
    let policy = failures(prefix);
    let reached = Arc::new(AtomicUsize::new(0));
    let ok = login(
        policy.clone(),
        store.clone(),
        StatusCode::OK,
        reached.clone(),
    );
    for _ in 0..12 {
        let response = send(&ok, request_from("203.0.113.9:1000", "/login")).await;
        assert_eq!(response.status(), StatusCode::OK);
        // The refund runs in the background on a networked store: wait until it has.
        let watcher = RateLimiter::new(policy.clone(), store.clone());
        let deadline = Instant::now() + Duration::from_secs(5);
        while watcher_remaining(&watcher).await < 5 {
            assert!(
                Instant::now() < deadline,
                "a success's charge never came back"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert_eq!(
        reached.load(Ordering::SeqCst),
        12,
        "successes never use the limit up"
    );
    let failed = Arc::new(AtomicUsize::new(0));
    let unauthorized = login(policy, store, StatusCode::UNAUTHORIZED, failed.clone());
    let statuses = twenty_at_once(&unauthorized).await;
    assert_eq!(failed.load(Ordering::SeqCst), 5, "{statuses:?}");
    let refused = statuses
        .iter()
        .filter(|status| **status == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!(refused, 15, "{statuses:?}");
}

/// What the layer's global key has left, read without counting.
async fn watcher_remaining(watcher: &RateLimiter) -> u64 {
    // The layer keys this policy globally ("global"); a handle names its identity itself.
    watcher.peek("global").await.unwrap().rules[0].remaining
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_failures_use_the_limit_up_in_memory() {
    only_failures_use_the_limit_up(MemoryStore::new(), "rl").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_failures_use_the_limit_up_on_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).expect("a valid Redis URL");
    only_failures_use_the_limit_up(store, &unique_prefix("failures")).await;
}

#[test]
fn count_only_needs_a_rule_to_count_in() {
    let error = Policy::builder("slots")
        .max_in_flight(2)
        .lease(Duration::from_secs(30))
        .count_only(|status| status.is_server_error())
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("count_only"), "{error}");
}

/// A config file's `count_only`: only the listed statuses (codes and classes) use the limit up.
#[tokio::test]
async fn a_config_route_counts_only_the_statuses_it_lists() {
    use tower_redis_ratelimit::config::RateLimitConfig;
    let config = RateLimitConfig::from_toml_str(
        r#"
        [[routes]]
        path = "/login"
        key = "global"
        rules = [{ limit = 2, period = "1h" }]
        count_only = [401, "5xx"]
        "#,
    )
    .unwrap();
    let status = Arc::new(std::sync::Mutex::new(StatusCode::OK));
    let answer = status.clone();
    let router = Router::new().route(
        "/login",
        get(move || {
            let answer = answer.clone();
            async move { *answer.lock().unwrap() }
        }),
    );
    let app = config.apply(router).unwrap();
    let mut answered = Vec::new();
    for code in [200, 403, 200, 401, 503, 401, 200] {
        *status.lock().unwrap() = StatusCode::from_u16(code).unwrap();
        let response = send(&app, request_from("203.0.113.9:1000", "/login")).await;
        answered.push(response.status().as_u16());
    }
    // 200 and 403 don't count; 401 and 503 use the two units; then everything is refused.
    assert_eq!(answered, [200, 403, 200, 401, 503, 429, 429]);
}

/// `count_only` with units taken ahead: the requests admitted from units in hand give their
/// charges back by the take's receipt when their responses don't count, so successes never use
/// the limit up, and failures use exactly the limit. (Requests follow each other at once: the
/// identity is hot, and its units are taken ahead.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_only_gives_back_units_taken_ahead_in_memory() {
    let policy = Policy::builder("login-failures-prefetched")
        .key(Key::global())
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_hour(50))
        .prefetch(16)
        .count_only(|status| status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap();
    // One layer (one instance): its units in hand serve both phases.
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed = Arc::new(AtomicUsize::new(0));
    let app = {
        let (failing, failed) = (failing.clone(), failed.clone());
        Router::new()
            .route(
                "/login",
                get(move || {
                    let fails = failing.load(Ordering::SeqCst);
                    if fails {
                        failed.fetch_add(1, Ordering::SeqCst);
                    }
                    async move {
                        if fails {
                            StatusCode::UNAUTHORIZED
                        } else {
                            StatusCode::OK
                        }
                    }
                }),
            )
            .layer(RateLimitLayer::new(policy, MemoryStore::new()))
    };
    for round in 0..200 {
        let response = send(&app, request_from("203.0.113.9:1000", "/login")).await;
        assert_eq!(response.status(), StatusCode::OK, "success {round}");
    }
    failing.store(true, Ordering::SeqCst);
    for _ in 0..60 {
        send(&app, request_from("203.0.113.9:1000", "/login")).await;
    }
    assert_eq!(
        failed.load(Ordering::SeqCst),
        50,
        "failures use exactly the limit"
    );
}
