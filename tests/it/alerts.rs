//! Quota alerts end to end: the race that fires each threshold once, the queue that keeps a slow
//! or failing notifier off the request path, and the webhook's JSON.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use common::redis_server::{TestRedis, unique_prefix};
use common::{from_user, send};
use http::StatusCode;
use tower_redis_ratelimit::alert::{NotifyFuture, QuotaAlert, QuotaNotifier};
use tower_redis_ratelimit::{
    Key, MemoryStore, Policy, Quota, RateLimitLayer, RedisStore, Rule, Store, quota::Tier,
};

/// A notifier that keeps what it gets.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<QuotaAlert>>>);

impl QuotaNotifier for Recorder {
    fn notify<'a>(&'a self, alert: &'a QuotaAlert) -> NotifyFuture<'a> {
        self.0.lock().unwrap().push(alert.clone());
        Box::pin(async { Ok(()) })
    }
}

impl Recorder {
    /// The alerts, sorted by percent, once the queues of `quotas` hold none (or after 5 s): called
    /// when the requests that could fire one have ended, it has them all, duplicates included.
    async fn all_of(&self, quotas: &[&Quota]) -> Vec<QuotaAlert> {
        let pending = || -> u64 {
            quotas
                .iter()
                .map(|quota| quota.alert_stats().unwrap().pending())
                .sum()
        };
        for _ in 0..500 {
            if pending() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pending(), 0, "the notifier saw every alert within 5 s");
        let mut alerts = self.0.lock().unwrap().clone();
        alerts.sort_by_key(|alert| alert.percent);
        alerts
    }
}

fn quota(prefix: &str, notifier: impl QuotaNotifier) -> Quota {
    Quota::builder("daily")
        .prefix(prefix)
        .key(Key::user())
        .tier("free", 100)
        .tier("pro", 5_000)
        .default_tier("free")
        .notifier(notifier)
        .build()
        .unwrap()
}

/// An app instance: `GET /` with a per-second rule and the daily `quota`.
fn instance(prefix: &str, store: impl Store, quota: &Quota) -> Router {
    let policy = Policy::builder("api")
        .prefix(prefix)
        .key(Key::user())
        .rule(Rule::per_second(10_000))
        .quota(quota.clone())
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, store))
}

/// 150 racing requests of one free user over `apps`, whose quotas are `quotas`: 100 admitted,
/// one alert at 80 and one at 100.
async fn race(apps: Vec<Router>, recorder: &Recorder, quotas: &[&Quota]) {
    let tasks: Vec<_> = (0..150)
        .map(|n| {
            let app = apps[n % apps.len()].clone();
            tokio::spawn(async move { send(&app, from_user("carol")).await.status() })
        })
        .collect();
    let (admitted, refused) = common::admitted_and_refused(tasks).await;
    assert_eq!((admitted, refused), (100, 50));
    let alerts = recorder.all_of(quotas).await;
    let summary: Vec<(u8, u64, u64, &str, &str)> = alerts
        .iter()
        .map(|a| (a.percent, a.used, a.limit, a.user.as_str(), a.tier.as_str()))
        .collect();
    assert_eq!(
        summary,
        [
            (80, 80, 100, "carol", "free"),
            (100, 100, 100, "carol", "free")
        ]
    );
    let today = alerts[0].day.clone();
    assert_eq!(today.len(), 10, "{today}");
    assert!(alerts.iter().all(|alert| alert.day == today));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_a_race_alerts_once_per_threshold() {
    let recorder = Recorder::default();
    let quota = quota("mem", recorder.clone());
    race(
        vec![instance("mem", MemoryStore::new(), &quota)],
        &recorder,
        &[&quota],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_a_redis_alert_once_per_threshold() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("alerts");
    let recorder = Recorder::default();
    let store = || {
        RedisStore::from_url(&redis.url)
            .unwrap()
            .timeout(Duration::from_secs(10))
    };
    // Two instances: separate pools, layers and alert queues, one Redis, one place the alerts
    // end up.
    let quotas = [
        quota(&prefix, recorder.clone()),
        quota(&prefix, recorder.clone()),
    ];
    let apps = vec![
        instance(&prefix, store(), &quotas[0]),
        instance(&prefix, store(), &quotas[1]),
    ];
    race(apps, &recorder, &[&quotas[0], &quotas[1]]).await;
}

#[tokio::test]
async fn the_tier_decides_the_limit_and_the_alert_says_it() {
    let recorder = Recorder::default();
    let quota = quota("tiers", recorder.clone());
    let app = instance("tiers", MemoryStore::new(), &quota);
    for _ in 0..4_000 {
        let mut request = from_user("dave");
        request.extensions_mut().insert(Tier::new("pro"));
        assert_eq!(send(&app, request).await.status(), StatusCode::OK);
    }
    let alerts = recorder.all_of(&[&quota]).await;
    assert_eq!(alerts.len(), 1);
    assert_eq!(
        (
            alerts[0].percent,
            alerts[0].used,
            alerts[0].limit,
            alerts[0].tier.as_str()
        ),
        (80, 4_000, 5_000, "pro")
    );
}

/// A notifier that never finishes.
struct Hangs(Arc<tokio::sync::Notify>);

impl QuotaNotifier for Hangs {
    fn notify<'a>(&'a self, _: &'a QuotaAlert) -> NotifyFuture<'a> {
        self.0.notify_one();
        Box::pin(std::future::pending())
    }
}

#[tokio::test]
async fn a_full_queue_drops_and_counts_and_never_blocks() {
    let started = Arc::new(tokio::sync::Notify::new());
    let quota = Quota::builder("daily")
        .tier("free", 1)
        .alert_at([100])
        .notifier(Hangs(started.clone()))
        .alert_queue(1)
        .build()
        .unwrap();
    let policy = Policy::builder("api")
        .key(Key::user())
        .rule(Rule::per_second(100))
        .quota(quota.clone())
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, MemoryStore::new()));
    // Each user's first request fires the 100 % alert. The first is taken by the notifier, which
    // hangs; the second waits in the queue; the next two find it full.
    assert_eq!(send(&app, from_user("u0")).await.status(), StatusCode::OK);
    started.notified().await;
    for user in ["u1", "u2", "u3"] {
        assert_eq!(send(&app, from_user(user)).await.status(), StatusCode::OK);
    }
    let stats = quota.alert_stats().unwrap();
    assert_eq!((stats.sent(), stats.failed(), stats.dropped()), (0, 0, 2));
    assert_eq!(
        stats.pending(),
        2,
        "the one the notifier holds and the one queued"
    );
}

#[cfg(feature = "webhook")]
mod webhook {
    use super::*;
    use std::net::SocketAddr;

    use axum::routing::post;
    use tower_redis_ratelimit::alert::WebhookNotifier;

    /// A webhook receiver on a free loopback port: what it got, and how it answers.
    async fn receiver(answer: StatusCode, hang: Arc<tokio::sync::Notify>) -> (String, Recorded) {
        let got = Recorded::default();
        let seen = got.clone();
        let app = Router::new().route(
            "/alerts",
            post(move |body: String| {
                let seen = seen.clone();
                let hang = hang.clone();
                async move {
                    seen.0.lock().unwrap().push(body);
                    if answer == StatusCode::GATEWAY_TIMEOUT {
                        hang.notified().await;
                    }
                    answer
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (format!("http://{addr}/alerts"), got)
    }

    #[derive(Clone, Default)]
    struct Recorded(Arc<Mutex<Vec<String>>>);

    impl Recorded {
        async fn wait_for(&self, count: usize) -> Vec<String> {
            for _ in 0..500 {
                if self.0.lock().unwrap().len() >= count {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            self.0.lock().unwrap().clone()
        }
    }

    fn app_with(webhook: WebhookNotifier) -> (Router, Quota) {
        let quota = Quota::builder("daily")
            .tier("free", 5)
            .alert_at([80, 100])
            .notifier(webhook)
            .build()
            .unwrap();
        let policy = Policy::builder("api")
            .key(Key::user())
            .rule(Rule::per_second(100))
            .quota(quota.clone())
            .build()
            .unwrap();
        let app = Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(RateLimitLayer::new(policy, MemoryStore::new()));
        (app, quota)
    }

    #[tokio::test]
    async fn the_webhook_gets_the_alerts_as_json() {
        let (url, got) = receiver(StatusCode::OK, Arc::default()).await;
        let (app, quota) = app_with(WebhookNotifier::new(url));
        for _ in 0..5 {
            assert_eq!(send(&app, from_user("erin")).await.status(), StatusCode::OK);
        }
        let bodies = got.wait_for(2).await;
        let alerts: Vec<serde_json::Value> = bodies
            .iter()
            .map(|body| serde_json::from_str(body).unwrap())
            .collect();
        assert_eq!(alerts.len(), 2);
        assert_eq!(alerts[0]["user"], "erin");
        assert_eq!(alerts[0]["tier"], "free");
        assert_eq!(alerts[0]["percent"], 80);
        assert_eq!(alerts[0]["used"], 4);
        assert_eq!(alerts[0]["limit"], 5);
        assert_eq!(alerts[1]["percent"], 100);
        let day = alerts[0]["day"].as_str().unwrap();
        assert!(day.len() == 10 && day.as_bytes()[4] == b'-', "{day}");
        let stats = quota.alert_stats().unwrap();
        for _ in 0..100 {
            if stats.sent() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!((stats.sent(), stats.failed()), (2, 0));
    }

    #[tokio::test]
    async fn a_failing_webhook_is_retried_then_counted_and_requests_go_on() {
        let (url, got) = receiver(StatusCode::INTERNAL_SERVER_ERROR, Arc::default()).await;
        let (app, quota) = app_with(
            WebhookNotifier::new(url)
                .retries(2)
                .backoff(Duration::from_millis(10)),
        );
        for _ in 0..4 {
            assert_eq!(send(&app, from_user("finn")).await.status(), StatusCode::OK);
        }
        // The 80 % alert (the 4th request): one attempt and two retries.
        assert_eq!(got.wait_for(3).await.len(), 3);
        let stats = quota.alert_stats().unwrap();
        for _ in 0..100 {
            if stats.failed() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!((stats.sent(), stats.failed()), (0, 1));
    }

    #[tokio::test]
    async fn a_hanging_webhook_never_holds_a_request() {
        // The receiver answers only once every request has been answered: a request that waited
        // for its alert would never finish, and the test would hang instead of passing.
        let release = Arc::new(tokio::sync::Notify::new());
        let (url, got) = receiver(StatusCode::GATEWAY_TIMEOUT, release.clone()).await;
        let (app, _quota) = app_with(WebhookNotifier::new(url).timeout(Duration::from_secs(30)));
        for _ in 0..6 {
            let status = send(&app, from_user("gus")).await.status();
            assert!(status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS);
        }
        assert_eq!(got.wait_for(1).await.len(), 1, "the webhook was called");
        release.notify_waiters();
    }
}

/// A metered quota's alerts fire when a settle takes the day's units past a threshold, once.
#[tokio::test]
async fn a_settle_past_a_threshold_of_a_metered_quota_alerts_once() {
    use tower_redis_ratelimit::meter::Meter;
    let recorder = Recorder::default();
    let quota = Quota::builder("tokens-daily")
        .key(Key::user())
        .tier("free", 10_000)
        .metered()
        .notifier(recorder.clone())
        .build()
        .unwrap();
    let policy = Policy::builder("llm")
        .key(Key::user())
        .rule(Rule::per_minute(100))
        .quota(quota.clone())
        .meter(Meter::new("tokens").estimate(|_| 500))
        .build()
        .unwrap();
    let app = common::recording_usage(policy, MemoryStore::new());
    for used in [7_000, 1_200, 100] {
        let response = send(&app, common::from_user_at("ann", &format!("/{used}"))).await;
        assert_eq!(response.status(), StatusCode::OK);
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
    }
    // 7 000, then 8 200 (past 80 %: its reservation took it to 7 500, its settle to 8 200), then
    // 8 300: one alert, at 80 %. (A settle in memory is made as its body ends.)
    let alerts = recorder.all_of(&[&quota]).await;
    assert_eq!(
        alerts.iter().map(|alert| alert.percent).collect::<Vec<_>>(),
        [80]
    );
    assert_eq!(alerts[0].used, 8_200);
}

/// A policy with a concurrency limit beside its quota: the alert reads the quota's state, not
/// the concurrency limit's (which comes after it in a decision).
#[tokio::test]
async fn an_alert_beside_a_concurrency_limit_counts_the_quota() {
    let recorder = Recorder::default();
    let quota = quota("alerts-slots", recorder.clone());
    let policy = Policy::builder("api-slots")
        .prefix("alerts-slots")
        .key(Key::user())
        .rule(Rule::per_second(10_000))
        .max_in_flight(5)
        .lease(Duration::from_secs(30))
        .quota(quota.clone())
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, MemoryStore::new()));
    for _ in 0..80 {
        let response = send(&app, from_user("erin")).await;
        assert_eq!(response.status(), StatusCode::OK);
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
    }
    let alerts = recorder.all_of(&[&quota]).await;
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(
        (alerts[0].percent, alerts[0].used, alerts[0].limit),
        (80, 80, 100)
    );
}
