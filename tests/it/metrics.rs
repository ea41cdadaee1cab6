//! The metrics a layer records through the `metrics` facade, read back from a real Prometheus
//! exporter: after a known mix of traffic every counter is exactly what was sent.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use common::prometheus::{prometheus, value};
use common::{DownStore, from_user, request_from, send};
use http::{Request, StatusCode};
use tower_redis_ratelimit::alert::{NotifyFuture, QuotaAlert, QuotaNotifier};
use tower_redis_ratelimit::store::{CheckFuture, CheckRequest, ManualClock};
use tower_redis_ratelimit::{
    Key, MemoryStore, Mode, OnStoreError, Policy, PolicyBuilder, Quota, RateLimitLayer, Rule,
    Store, policy::MissingKey,
};

fn requests(policy: &str, outcome: &str) -> f64 {
    value(
        "ratelimit_requests_total",
        &[("policy", policy), ("outcome", outcome)],
    )
}

fn rule_refusals(policy: &str, rule: &str) -> f64 {
    value(
        "ratelimit_rule_refusals_total",
        &[("policy", policy), ("rule", rule)],
    )
}

fn near_limit(policy: &str, rule: &str) -> f64 {
    value(
        "ratelimit_near_limit_total",
        &[("policy", policy), ("rule", rule)],
    )
}

fn app(policy: Policy, store: impl Store) -> (Router, RateLimitLayer) {
    let layer = RateLimitLayer::new(policy, store);
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer.clone());
    (app, layer)
}

fn builder(name: &str) -> PolicyBuilder {
    Policy::builder(name).key(Key::user())
}

/// Sends `request()` `times` times; the statuses.
async fn statuses(app: &Router, times: usize, request: impl Fn() -> Request<Body>) -> Vec<u16> {
    let mut statuses = Vec::new();
    for _ in 0..times {
        statuses.push(send(app, request()).await.status().as_u16());
    }
    statuses
}

#[tokio::test]
async fn admissions_refusals_by_each_rule_near_limits_costs_and_missing_keys_count_exactly() {
    prometheus();
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policy = builder("m_mix")
        .rule(Rule::per_minute(3))
        .rule(Rule::per_hour(4))
        .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
        .cost_from_fn(|parts| {
            parts
                .headers
                .get("x-cost")
                .and_then(|cost| cost.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        })
        .build()
        .unwrap();
    let (app, layer) = app(policy, store);

    // 3 admitted (the third leaves the minute rule empty), the fourth refused by it alone.
    assert_eq!(
        statuses(&app, 4, || from_user("alice")).await,
        [200, 200, 200, 429]
    );
    clock.advance(Duration::from_secs(61));
    // The hour's fourth admitted (leaving it empty), the next refused by the hour rule alone.
    assert_eq!(statuses(&app, 2, || from_user("alice")).await, [200, 429]);
    // A cost no rule admits, and a request without a user.
    let mut costly = from_user("alice");
    costly.headers_mut().insert("x-cost", "10".parse().unwrap());
    assert_eq!(
        send(&app, costly).await.status(),
        StatusCode::PAYLOAD_TOO_LARGE
    );
    let anonymous = request_from("192.0.2.1:1", "/");
    assert_eq!(
        send(&app, anonymous).await.status(),
        StatusCode::UNAUTHORIZED
    );

    assert_eq!(requests("m_mix", "allowed"), 4.0);
    assert_eq!(requests("m_mix", "refused"), 2.0);
    assert_eq!(requests("m_mix", "too_costly"), 1.0);
    assert_eq!(requests("m_mix", "no_key"), 1.0);
    for outcome in [
        "shadow_refused",
        "delayed",
        "cached_refusal",
        "store_error_allowed",
    ] {
        assert_eq!(requests("m_mix", outcome), 0.0, "{outcome}");
    }
    // The too-costly request counts against the rule that can't admit it (the minute's 3).
    assert_eq!(rule_refusals("m_mix", "3-per-60s"), 2.0);
    assert_eq!(rule_refusals("m_mix", "4-per-3600s"), 1.0);
    assert_eq!(near_limit("m_mix", "3-per-60s"), 1.0);
    assert_eq!(near_limit("m_mix", "4-per-3600s"), 1.0);
    // Each store call timed: 6 answered, none failed.
    let ok = [("store", "memory"), ("outcome", "ok")];
    assert!(value("ratelimit_store_duration_seconds_count", &ok) >= 6.0);

    let top = layer.top_refused(5);
    assert_eq!(top.len(), 1, "{top:?}");
    assert_eq!(
        (top[0].identity.as_str(), top[0].key_kind),
        ("user:alice", "user")
    );
    assert_eq!((top[0].count, top[0].error), (3, 0));
}

#[tokio::test]
async fn shadow_refusals_and_cached_refusals_count_as_their_own_outcomes() {
    prometheus();
    let shadow = builder("m_shadow")
        .rule(Rule::per_minute(1))
        .mode(Mode::Shadow)
        .build()
        .unwrap();
    let (shadow_app, _) = app(shadow, MemoryStore::new());
    assert_eq!(
        statuses(&shadow_app, 3, || from_user("bob")).await,
        [200; 3]
    );
    assert_eq!(requests("m_shadow", "allowed"), 1.0);
    assert_eq!(requests("m_shadow", "shadow_refused"), 2.0);
    assert_eq!(rule_refusals("m_shadow", "1-per-60s"), 2.0);

    // A store the layer treats as remote caches refusals: the third answer comes from the cache.
    let cached = builder("m_cached")
        .rule(Rule::per_minute(1))
        .build()
        .unwrap();
    let (cached_app, layer) = app(cached, Remote(MemoryStore::new()));
    assert_eq!(
        statuses(&cached_app, 3, || from_user("bob")).await,
        [200, 429, 429]
    );
    assert_eq!(requests("m_cached", "allowed"), 1.0);
    assert_eq!(requests("m_cached", "refused"), 1.0);
    assert_eq!(requests("m_cached", "cached_refusal"), 1.0);
    assert_eq!(rule_refusals("m_cached", "1-per-60s"), 2.0);
    assert_eq!(layer.top_refused(1)[0].count, 2);
}

#[tokio::test(start_paused = true)]
async fn delayed_admissions_count_and_their_waits_are_timed() {
    prometheus();
    let policy = builder("m_delay")
        .rule(Rule::per_second(1))
        .algorithm(tower_redis_ratelimit::Algorithm::SlidingLog)
        .mode(Mode::Delay {
            max_delay: Duration::from_secs(5),
        })
        .build()
        .unwrap();
    let (app, _) = app(policy, MemoryStore::new());
    assert_eq!(statuses(&app, 2, || from_user("carol")).await, [200, 200]);
    assert_eq!(requests("m_delay", "allowed"), 1.0);
    assert_eq!(requests("m_delay", "delayed"), 1.0);
    let waits = [("policy", "m_delay")];
    assert_eq!(value("ratelimit_delay_seconds_count", &waits), 1.0);
    let waited = value("ratelimit_delay_seconds_sum", &waits);
    assert!(waited > 0.9 && waited <= 1.0, "{waited}");
}

#[tokio::test]
async fn a_failing_store_counts_its_errors_and_what_the_policy_did_about_them() {
    prometheus();
    let before = value(
        "ratelimit_store_errors_total",
        &[("store", "custom"), ("kind", "timeout")],
    );
    let timeouts = [("store", "custom"), ("outcome", "timeout")];
    let timed_before = value("ratelimit_store_duration_seconds_count", &timeouts);
    for (name, on_error, status) in [
        ("m_open", OnStoreError::Allow, 200),
        ("m_closed", OnStoreError::Deny, 503),
    ] {
        let policy = builder(name)
            .rule(Rule::per_minute(1))
            .on_store_error(on_error)
            .build()
            .unwrap();
        let (app, _) = app(policy, DownStore);
        assert_eq!(statuses(&app, 2, || from_user("dave")).await, [status; 2]);
    }
    assert_eq!(requests("m_open", "store_error_allowed"), 2.0);
    assert_eq!(requests("m_closed", "store_error_denied"), 2.0);
    assert_eq!(requests("m_open", "allowed"), 0.0);
    let errors = [("store", "custom"), ("kind", "timeout")];
    assert_eq!(value("ratelimit_store_errors_total", &errors) - before, 4.0);
    let timed = value("ratelimit_store_duration_seconds_count", &timeouts);
    assert_eq!(timed - timed_before, 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_alerts_count_as_sent_or_failed() {
    prometheus();
    let notifier = FailsAt100::default();
    let quota = Quota::builder("m_daily")
        .key(Key::user())
        .tier("free", 5)
        .default_tier("free")
        .alert_at([80, 100])
        .notifier(notifier.clone())
        .build()
        .unwrap();
    let policy = builder("m_quota")
        .rule(Rule::per_minute(100))
        .quota(quota.clone())
        .build()
        .unwrap();
    let (app, _) = app(policy, MemoryStore::new());
    assert_eq!(
        statuses(&app, 6, || from_user("erin")).await,
        [200, 200, 200, 200, 200, 429]
    );
    // The counter is bumped after the notifier returns: wait for the queue to drain.
    let stats = quota.alert_stats().expect("a quota with alerts");
    for _ in 0..500 {
        if stats.pending() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        notifier.0.lock().unwrap().len(),
        2,
        "both alerts reached the notifier"
    );
    let alerts = |percent, outcome| {
        value(
            "ratelimit_quota_alerts_total",
            &[
                ("quota", "m_daily"),
                ("percent", percent),
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(alerts("80", "sent"), 1.0);
    assert_eq!(alerts("100", "failed"), 1.0);
    assert_eq!(alerts("80", "failed") + alerts("100", "sent"), 0.0);
    // The refusal was the quota's: it counts under the quota's name.
    assert_eq!(rule_refusals("m_quota", "m_daily"), 1.0);
    assert_eq!(near_limit("m_quota", "m_daily"), 1.0);
}

#[tokio::test]
async fn a_thousand_users_add_no_series() {
    prometheus();
    let policy = builder("m_many").rule(Rule::per_minute(1)).build().unwrap();
    let (app, _) = app(policy, MemoryStore::new());
    send(&app, from_user("first")).await;
    send(&app, from_user("first")).await;
    let series = || {
        prometheus()
            .render()
            .lines()
            .filter(|line| line.contains("m_many"))
            .count()
    };
    let before = series();
    for user in 0..1_000 {
        let user = format!("user-{user}");
        assert_eq!(send(&app, from_user(&user)).await.status(), StatusCode::OK);
        assert_eq!(
            send(&app, from_user(&user)).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    assert_eq!(series(), before);
    assert_eq!(requests("m_many", "refused"), 1_001.0);
    assert!(!prometheus().render().contains("user-"));
}

/// A memory store the layer treats as remote, so it caches refusals.
struct Remote(MemoryStore);

impl Store for Remote {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.0.check(request)
    }

    fn is_remote(&self) -> bool {
        true
    }
}

/// A notifier that delivers every alert but the one at 100 %.
#[derive(Clone, Default)]
struct FailsAt100(Arc<Mutex<Vec<u8>>>);

impl QuotaNotifier for FailsAt100 {
    fn notify<'a>(&'a self, alert: &'a QuotaAlert) -> NotifyFuture<'a> {
        self.0.lock().unwrap().push(alert.percent);
        let percent = alert.percent;
        Box::pin(async move {
            if percent == 100 {
                Err("the mailer is down".into())
            } else {
                Ok(())
            }
        })
    }
}

#[cfg(feature = "config")]
#[tokio::test]
async fn config_reloads_are_counted_by_outcome() {
    use tower_redis_ratelimit::config::RateLimitConfig;

    prometheus();
    let reloads = |outcome| value("ratelimit_config_reloads_total", &[("outcome", outcome)]);
    let good = "[[routes]]\npath = \"/m_reload\"\nrules = [{ limit = 1, period = \"1m\" }]\n";
    let limits = RateLimitConfig::from_toml_str(good)
        .unwrap()
        .route_limits(Arc::new(MemoryStore::new()))
        .unwrap();
    let (applied, refused) = (reloads("applied"), reloads("refused"));
    limits
        .reload(&RateLimitConfig::from_toml_str(&good.replace("1m", "2m")).unwrap())
        .unwrap();
    let path = std::env::temp_dir().join(format!("trr-metrics-{}.toml", std::process::id()));
    std::fs::write(&path, good.replace("limit = 1", "limit = 0")).unwrap();
    let error = limits
        .reload_from_path(&RateLimitConfig::loader(), &path)
        .unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(error.field(), "routes[0].rules[0].limit");
    assert_eq!(reloads("applied") - applied, 1.0);
    assert_eq!(reloads("refused") - refused, 1.0);
}

#[tokio::test]
async fn units_taken_ahead_are_counted_as_taken_and_spent() {
    prometheus();
    let policy = builder("m_prefetch")
        .algorithm(tower_redis_ratelimit::Algorithm::FixedWindow)
        .rule(Rule::per_hour(1_000))
        .prefetch(8)
        .build()
        .unwrap();
    let (app, _) = app(policy, MemoryStore::new());
    assert_eq!(statuses(&app, 40, || from_user("erin")).await, [200; 40]);
    let units = |event| {
        value(
            "ratelimit_prefetch_units_total",
            &[("policy", "m_prefetch"), ("event", event)],
        )
    };
    // Back to back the takes grow to 8 units; every unit spent from hand was taken first.
    let (taken, spent) = (units("taken"), units("spent"));
    assert!(spent > 20.0, "{spent}");
    assert!(
        taken >= spent && taken <= spent + 8.0,
        "{taken} taken, {spent} spent"
    );
    assert_eq!(requests("m_prefetch", "allowed"), 40.0);
}

/// A meter's units, per policy and unit: reserved at admission, used as recorded, given back
/// (reserved and not used) and overdrawn (used beyond the reservation).
#[tokio::test]
async fn metered_units_are_counted_reserved_used_given_back_and_overdrawn() {
    use tower_redis_ratelimit::meter::Meter;
    let _ = prometheus();
    let policy = builder("metrics-metered")
        .rule(Rule::per_minute(100_000).metered())
        .meter(Meter::new("tokens").estimate(|_| 500))
        .build()
        .unwrap();
    let app = common::recording_usage(policy, MemoryStore::new());
    for used in [100, 900, 500] {
        let response = send(&app, common::from_user_at("metered", &format!("/{used}"))).await;
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
    }
    let units = |event: &str| {
        value(
            "ratelimit_metered_units_total",
            &[
                ("policy", "metrics-metered"),
                ("unit", "tokens"),
                ("event", event),
            ],
        )
    };
    assert_eq!(units("reserved"), 1_500.0);
    assert_eq!(units("used"), 1_500.0);
    assert_eq!(units("given_back"), 400.0);
    assert_eq!(units("overdrawn"), 400.0);
}

/// An outbound layer's metered calls are counted as a route's: 600 reserved, 100 used, 500 back.
#[tokio::test]
async fn metered_outbound_calls_are_counted_too() {
    use tower::{BoxError, Service, ServiceExt, service_fn};
    use tower_redis_ratelimit::meter::{Meter, Usage};
    use tower_redis_ratelimit::outbound::OutboundLayer;
    let _ = prometheus();
    let policy = builder("metrics-outbound-metered")
        .algorithm(tower_redis_ratelimit::Algorithm::SlidingLog)
        .rule(Rule::per_minute(100_000).metered())
        .meter(Meter::new("tokens").estimate(|_| 600))
        .build()
        .unwrap();
    let mut client = tower::ServiceBuilder::new()
        .layer(OutboundLayer::new(policy, MemoryStore::new()))
        .service(service_fn(|_: Request<String>| async {
            Ok::<_, BoxError>(http::Response::new(String::new()))
        }));
    let request = Request::post("http://llm.example/v1")
        .body(String::new())
        .unwrap();
    let response = client.ready().await.unwrap().call(request).await.unwrap();
    response.extensions().get::<Usage>().unwrap().record(100);
    drop(response);
    let units = |event: &str| {
        value(
            "ratelimit_metered_units_total",
            &[
                ("policy", "metrics-outbound-metered"),
                ("unit", "tokens"),
                ("event", event),
            ],
        )
    };
    assert_eq!(units("reserved"), 600.0);
    assert_eq!(units("used"), 100.0);
    assert_eq!(units("given_back"), 500.0);
}
