//! A store that fails or loses its scripts. An error or a malformed answer, a Redis that is down,
//! frozen or slower than the store's timeout: each is answered by the policy's `on_store_error`
//! (fail open: admitted without headers; fail closed: 503), never a 429, and limiting resumes
//! with the store. A timeout longer than redis-rs's own is waited out. A library or script
//! flushed between requests (or functions refused, where the script serves) is loaded again
//! within the request. (What store failures count and log: `tests/it/store_faults.rs`.)

use crate::common;

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, has_functions, unique_prefix};
use common::redis_store::{command_calls, store};
use common::{DownStore, app, assert_refused, json, limits, policy, request_from, send};
use http::StatusCode;
use tower_redis_ratelimit::store::{CheckFuture, CheckRequest, RedisStore};
use tower_redis_ratelimit::{OnStoreError, Policy, RateLimitLayer, Rule, Store};

const PEER: &str = "203.0.113.10:4000";

/// A store that answers for fewer rules than the policy has.
#[derive(Clone)]
struct BrokenStore;

impl Store for BrokenStore {
    fn check(&self, _: &CheckRequest<'_>) -> CheckFuture {
        CheckFuture::ready(Ok(tower_redis_ratelimit::Decision {
            allowed: false,
            rules: Vec::new(),
            now_unix_ms: 0,
            delay: std::time::Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
            run_time_override: None,
        }))
    }
}

/// A failing store lets requests through without headers by default and gets a 503 problem when
/// the policy fails closed; never a 429.
async fn assert_fails_open_or_closed(store: impl Store + Clone) {
    let open = app(
        policy([Rule::per_second(1)]).build().unwrap(),
        store.clone(),
    );
    for _ in 0..3 {
        let response = send(&open, request_from(PEER, "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get("ratelimit").is_none());
    }
    let closed = app(
        policy([Rule::per_second(1)])
            .on_store_error(OnStoreError::Deny)
            .build()
            .unwrap(),
        store,
    );
    let response = send(&closed, request_from(PEER, "/")).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json(response).await["status"], 503);
}

#[tokio::test]
async fn store_errors_fail_open_or_closed_never_429() {
    assert_fails_open_or_closed(DownStore).await;
}

#[tokio::test]
async fn a_malformed_store_answer_is_a_store_error_not_a_panic() {
    assert_fails_open_or_closed(BrokenStore).await;
}

/// Two apps limiting one key by `rule`: one fails open, one fails closed.
fn failing_open_and_closed(
    redis: &TestRedis,
    name: &str,
    rule: Rule,
    timeout: Duration,
) -> (Router, Router) {
    let prefix = unique_prefix(name);
    let policy = |on_error| {
        Policy::builder(name)
            .prefix(&prefix)
            .rule(rule.clone())
            .on_store_error(on_error)
            .build()
            .unwrap()
    };
    // Without the refusal cache, so that every request asks Redis: a refusal it already gave
    // would otherwise be answered from the cache while Redis is down (rightly: it still stands).
    let app = |policy, store| {
        Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(RateLimitLayer::new(policy, store).refusal_cache(0))
    };
    (
        app(policy(OnStoreError::Allow), store(redis).timeout(timeout)),
        app(policy(OnStoreError::Deny), store(redis).timeout(timeout)),
    )
}

#[tokio::test]
async fn an_outage_fails_open_or_closed_and_limiting_resumes() {
    let mut redis = TestRedis::own();
    let timeout = Duration::from_millis(250);
    let (open, closed) = failing_open_and_closed(&redis, "outage", Rule::per_hour(2), timeout);
    assert_eq!(
        send(&open, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&closed, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );

    redis.stop();
    for _ in 0..3 {
        for (app, expected) in [
            (&open, StatusCode::OK),
            (&closed, StatusCode::SERVICE_UNAVAILABLE),
        ] {
            let started = Instant::now();
            let response = send(app, request_from(PEER, "/")).await;
            assert_eq!(response.status(), expected);
            assert!(response.headers().get("ratelimit").is_none());
            let took = started.elapsed();
            assert!(took < timeout + Duration::from_millis(500), "took {took:?}");
        }
    }

    // Back up (empty: the server keeps nothing): limiting resumes without a restart of the app.
    redis.start();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let response = send(&closed, request_from(PEER, "/")).await;
        if response.status() == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis came back but requests still fail"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        send(&open, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    let refused = send(&open, request_from(PEER, "/")).await;
    assert_refused(refused, &["2-per-3600s"]).await;
}

/// The store's timeout is the only one: redis-rs's own default response timeout (500 ms) must not
/// cut a longer one short.
#[tokio::test]
async fn a_timeout_longer_than_half_a_second_is_waited_out() {
    let redis = TestRedis::own();
    let policy = Policy::builder("patient")
        .prefix(unique_prefix("patient"))
        .rule(Rule::per_hour(5))
        .on_store_error(OnStoreError::Deny)
        .build()
        .unwrap();
    let app = app(policy, store(&redis).timeout(Duration::from_secs(5)));
    let first = send(&app, request_from(PEER, "/")).await;
    assert_eq!(limits(&first).status("5-per-3600s").unwrap().remaining, 4);

    redis.pause();
    let started = Instant::now();
    let pending = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request_from(PEER, "/")).await }
    });
    let frozen_for = Duration::from_millis(1200);
    tokio::time::sleep(frozen_for).await;
    redis.resume();
    let second = pending.await.unwrap();
    assert!(started.elapsed() >= frozen_for);
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(limits(&second).status("5-per-3600s").unwrap().remaining, 3);
}

#[tokio::test]
async fn a_reply_slower_than_the_timeout_is_a_store_error_not_a_429() {
    let redis = TestRedis::own();
    let timeout = Duration::from_millis(200);
    let (open, closed) = failing_open_and_closed(&redis, "slow", Rule::per_hour(1), timeout);
    assert_eq!(
        send(&open, request_from(PEER, "/")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&closed, request_from(PEER, "/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // Frozen: the connection stays open but no reply comes. The limit is used up, yet a store
    // that can't answer is never a 429.
    redis.pause();
    for (app, expected) in [
        (&open, StatusCode::OK),
        (&closed, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let started = Instant::now();
        let response = send(app, request_from(PEER, "/")).await;
        let took = started.elapsed();
        assert_eq!(response.status(), expected);
        assert!(took >= timeout, "answered before the timeout: {took:?}");
        assert!(took < timeout + Duration::from_millis(500), "took {took:?}");
    }

    // Thawed: the limit that Redis kept applies again.
    redis.resume();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = send(&open, request_from(PEER, "/")).await.status();
        if status == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        assert_eq!(
            status,
            StatusCode::OK,
            "only fail-open answers until Redis answers"
        );
        assert!(
            Instant::now() < deadline,
            "Redis is back but limiting did not resume"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_function_flush_between_requests_is_recovered_in_the_request() {
    let redis = TestRedis::own();
    let prefix = unique_prefix("flush");
    let app = app(
        Policy::builder("flush")
            .prefix(&prefix)
            .rule(Rule::per_hour(3))
            .build()
            .unwrap(),
        store(&redis),
    );
    let first = send(&app, request_from(PEER, "/")).await;
    assert_eq!(limits(&first).status("3-per-3600s").unwrap().remaining, 2);
    // Redis 6.2 has no functions: there the store's script stands in for its library, and
    // `SCRIPT FLUSH` for `FUNCTION FLUSH`.
    let functions = has_functions(&mut redis.client());
    let _: () = redis::cmd(if functions { "FUNCTION" } else { "SCRIPT" })
        .arg("FLUSH")
        .query(&mut redis.client())
        .unwrap();
    let second = send(&app, request_from(PEER, "/")).await;
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(limits(&second).status("3-per-3600s").unwrap().remaining, 1);
    let calls = command_calls(&redis);
    if functions {
        // Both times (the first request, and after the flush) the library was loaded within the
        // request, which then went through; the script was never needed.
        assert_eq!(calls.get("function|load").copied(), Some(2), "{calls:?}");
        assert_eq!(calls.get("fcall").copied(), Some(4), "{calls:?}");
        assert_eq!(calls.get("eval"), None, "{calls:?}");
        assert_eq!(calls.get("evalsha"), None, "{calls:?}");
    } else {
        // The first request's FCALL is an unknown command (not counted); both times the script
        // went as EVAL, the second after EVALSHA answered NOSCRIPT.
        assert_eq!(calls.get("eval").copied(), Some(2), "{calls:?}");
        assert_eq!(calls.get("evalsha").copied(), Some(1), "{calls:?}");
        assert_eq!(calls.get("fcall"), None, "{calls:?}");
    }
}

/// A Redis that won't run functions (here an ACL without them, nor `INFO`; before 7.0, a server
/// without the commands): the store turns to its script for good, and recovers a `SCRIPT FLUSH` in
/// the request.
#[tokio::test]
async fn without_functions_the_script_serves_and_a_script_flush_is_recovered() {
    let redis = TestRedis::own();
    // Nor `INFO`: a store that can't read the server's version goes on without checking it.
    let mut user = vec![
        "SETUSER",
        "nofunctions",
        "on",
        ">secret",
        "~*",
        "&*",
        "+@all",
        "-info",
    ];
    // Before 7.0 there are no functions to forbid (nor their names in ACLs).
    if has_functions(&mut redis.client()) {
        user.extend(["-function", "-fcall", "-fcall_ro"]);
    }
    let _: () = redis::cmd("ACL")
        .arg(&user[..])
        .query(&mut redis.client())
        .unwrap();
    let url = redis
        .url
        .replacen("redis://", "redis://nofunctions:secret@", 1);
    let store = RedisStore::from_url(&url)
        .unwrap()
        .timeout(Duration::from_secs(10));
    let prefix = unique_prefix("no-functions");
    let app = app(
        Policy::builder("flush")
            .prefix(&prefix)
            .rule(Rule::per_hour(5))
            .build()
            .unwrap(),
        store,
    );
    for remaining in [4, 3] {
        let response = send(&app, request_from(PEER, "/")).await;
        assert_eq!(
            limits(&response).status("5-per-3600s").unwrap().remaining,
            remaining
        );
    }
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut redis.client())
        .unwrap();
    for remaining in [2, 1] {
        let response = send(&app, request_from(PEER, "/")).await;
        assert_eq!(
            limits(&response).status("5-per-3600s").unwrap().remaining,
            remaining
        );
    }
    // FCALL refused once (Redis lists it, with no call run); then the script went as EVAL (the
    // first request, and the first after the flush, each caching it) and as EVALSHA (the other
    // two, and the flushed request's first try, answered NOSCRIPT).
    let calls = command_calls(&redis);
    assert_eq!(calls.get("fcall").copied().unwrap_or(0), 0, "{calls:?}");
    assert_eq!(calls.get("eval").copied(), Some(2), "{calls:?}");
    assert_eq!(calls.get("evalsha").copied(), Some(3), "{calls:?}");
    assert_eq!(calls.get("function|load"), None, "{calls:?}");
    // The limit holds exactly: the fifth is admitted, the sixth refused.
    let fifth = send(&app, request_from(PEER, "/")).await;
    assert_eq!(limits(&fifth).status("5-per-3600s").unwrap().remaining, 0);
    assert_refused(send(&app, request_from(PEER, "/")).await, &["5-per-3600s"]).await;
}
