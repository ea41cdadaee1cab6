//! Fair shares of one budget (issue 62): once the budget is saturated, each tenant is admitted
//! up to its weighted share, what one leaves goes to the others, and one that arrives has its
//! share within a window. Real tenants: 8 concurrent loops each, as fast as they can, through
//! a layer over one store, on the real clock.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use common::{limits, send};
use http::{Request, StatusCode};
use tower_redis_ratelimit::fair::FairShare;
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, PolicyError, RateLimitLayer, Rule, Store,
};

/// A gateway: 300 requests a second shared by the tenants of `x-tenant`, each weighing its
/// `x-weight`; each tenant may send up to 10 000 a second on its own.
fn gateway(store: impl Store) -> Router {
    gateway_counting(store, Algorithm::default())
}

/// [`gateway`] counting with `algorithm`.
fn gateway_counting(store: impl Store, algorithm: Algorithm) -> Router {
    let policy = Policy::builder("gateway")
        .key(Key::header("x-tenant"))
        .algorithm(algorithm)
        .rule(Rule::per_second(10_000))
        .fair_share(
            FairShare::new(Rule::per_second(300).named("budget")).weight_from_fn(|parts| {
                parts
                    .headers
                    .get("x-weight")
                    .and_then(|weight| weight.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            }),
        )
        .build()
        .unwrap();
    Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(RateLimitLayer::new(policy, store))
}

fn request(tenant: &str, weight: u32) -> Request<Body> {
    Request::get("/")
        .header("x-tenant", tenant)
        .header("x-weight", weight.to_string())
        .body(Body::empty())
        .unwrap()
}

/// A tenant sending from 8 loops until told to stop, counting its admissions.
struct Tenant {
    admitted: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    loops: Vec<tokio::task::JoinHandle<()>>,
}

impl Tenant {
    fn start(app: &Router, name: &'static str, weight: u32) -> Tenant {
        let admitted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let loops = (0..8)
            .map(|_| {
                let (app, admitted, stop) = (app.clone(), admitted.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let response = send(&app, request(name, weight)).await;
                        match response.status() {
                            StatusCode::OK => {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                            StatusCode::TOO_MANY_REQUESTS => {}
                            other => panic!("{name}: {other}"),
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        Tenant {
            admitted,
            stop,
            loops,
        }
    }

    fn admitted(&self) -> u64 {
        self.admitted.load(Ordering::Relaxed)
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.loops {
            task.await.unwrap();
        }
    }
}

/// What each of `tenants` was admitted a second over `seconds` from now.
async fn rates(tenants: &HashMap<&str, &Tenant>, seconds: u64) -> HashMap<String, f64> {
    let before: HashMap<&str, u64> = tenants
        .iter()
        .map(|(name, tenant)| (*name, tenant.admitted()))
        .collect();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let elapsed = started.elapsed().as_secs_f64();
    tenants
        .iter()
        .map(|(name, tenant)| {
            let admitted = tenant.admitted() - before[name];
            ((*name).to_owned(), admitted as f64 / elapsed)
        })
        .collect()
}

fn assert_near(rates: &HashMap<String, f64>, tenant: &str, share: f64) {
    let rate = rates[tenant];
    assert!(
        (0.9 * share..=1.1 * share).contains(&rate),
        "{tenant}: {rate:.1} a second, not within 10 % of {share} (all: {rates:?})"
    );
}

async fn shares_hold_as_tenants_stop_and_arrive(store: impl Store + Clone) {
    let app = gateway(store);
    let (a, b, c) = (
        Tenant::start(&app, "a", 1),
        Tenant::start(&app, "b", 1),
        Tenant::start(&app, "c", 2),
    );
    // The first window saturates while running: shares from the next one.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let all = HashMap::from([("a", &a), ("b", &b), ("c", &c)]);
    let measured = rates(&all, 5).await;
    assert_near(&measured, "a", 75.0);
    assert_near(&measured, "b", 75.0);
    assert_near(&measured, "c", 150.0);
    let total: f64 = measured.values().sum();
    assert!(total >= 0.95 * 300.0, "{total:.1} a second of 300");

    // c stops: a and b share what it leaves.
    c.stop().await;
    let two = HashMap::from([("a", &a), ("b", &b)]);
    let measured = rates(&two, 5).await;
    assert_near(&measured, "a", 150.0);
    assert_near(&measured, "b", 150.0);

    // d arrives while a and b saturate the budget: within a second it has its share.
    let d = Tenant::start(&app, "d", 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let three = HashMap::from([("a", &a), ("b", &b), ("d", &d)]);
    let measured = rates(&three, 2).await;
    assert!(
        measured["d"] >= 90.0,
        "d: {:.1} a second, not 90 % of 100 ({measured:?})",
        measured["d"]
    );
    for tenant in [a, b, d] {
        tenant.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_hold_as_tenants_stop_and_arrive_in_memory() {
    shares_hold_as_tenants_stop_and_arrive(MemoryStore::new()).await;
}

/// Waits for the start of the next second (the budget's windows), and 5 ms more.
async fn next_second() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let left = u64::try_from(1000 - now % 1000).unwrap();
    tokio::time::sleep(Duration::from_millis(left + 5)).await;
}

#[tokio::test]
async fn a_binding_share_is_the_identitys_own_limit_in_the_headers_and_its_refusal_names_it() {
    let app = gateway_counting(MemoryStore::new(), Algorithm::FixedWindow);
    next_second().await;
    // a and b ask 400 together in one window: the budget admits 300, and is saturated.
    let mut admitted = 0;
    for n in 0..400 {
        let tenant = if n % 2 == 0 { "a" } else { "b" };
        if send(&app, request(tenant, 1)).await.status() == StatusCode::OK {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 300, "the budget is never passed");
    // The next window's shares hold from its first millisecond: half each.
    next_second().await;
    let first = send(&app, request("b", 1)).await;
    assert_eq!(first.status(), StatusCode::OK);
    let headers = limits(&first);
    let budget = headers.policy("budget").expect("the budget's item");
    assert_eq!((budget.quota, budget.window), (300, Some(1)));
    let share = headers
        .policy("budget-share")
        .expect("the share's item while it binds");
    assert_eq!((share.quota, share.window), (150, Some(1)));
    for _ in 0..150 {
        assert_eq!(send(&app, request("a", 1)).await.status(), StatusCode::OK);
    }
    let refused = send(&app, request("a", 1)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(common::retry_after_secs(&refused) <= 1);
    common::assert_refused(refused, &["budget-share"]).await;
}

#[test]
fn bad_fair_shares_are_refused_when_the_policy_is_built() {
    let build = |key: Key, budget: Rule| {
        Policy::builder("p")
            .key(key)
            .rule(Rule::per_minute(10))
            .fair_share(FairShare::new(budget))
            .build()
    };
    for (key, budget) in [
        (Key::header("x-tenant"), Rule::per_minute(0)),
        (Key::global(), Rule::per_minute(100)),
        (Key::header("x-tenant"), Rule::per_minute(10)),
        (Key::header("x-tenant"), Rule::per_minute(100).metered()),
    ] {
        let refused = build(key, budget.clone());
        assert!(
            matches!(
                refused,
                Err(PolicyError::InvalidOption {
                    option: "fair_share",
                    ..
                })
            ),
            "{budget:?}: {refused:?}"
        );
    }
}

#[test]
fn a_store_without_fair_shares_refuses_the_policy() {
    let store = tower_redis_ratelimit::RedisStore::from_url("redis://127.0.0.1:1").unwrap();
    let policy = Policy::builder("p")
        .key(Key::header("x-tenant"))
        .rule(Rule::per_minute(10))
        .fair_share(FairShare::new(Rule::per_minute(100)))
        .build()
        .unwrap();
    let refused = RateLimitLayer::try_new(policy, store);
    assert!(
        matches!(
            refused,
            Err(PolicyError::InvalidOption {
                option: "fair_share",
                ..
            })
        ),
        "{refused:?}"
    );
}

#[tokio::test]
async fn refusals_for_fairness_are_counted_apart_from_the_budgets_and_saturated_windows_too() {
    use common::prometheus::{prometheus, value};
    prometheus();
    let policy = Policy::builder("fair-metrics")
        .key(Key::header("x-tenant"))
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_second(10_000))
        .fair_share(FairShare::new(Rule::per_second(300).named("budget")))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(RateLimitLayer::new(policy, MemoryStore::new()));
    let refusals = |rule: &str| {
        value(
            "ratelimit_rule_refusals_total",
            &[("policy", "fair-metrics"), ("rule", rule)],
        )
    };
    next_second().await;
    // 400 asked in one window: 300 admitted, 150 each; the rest refused by the budget, and by
    // the shares once it saturated.
    for n in 0..400 {
        send(&app, request(if n % 2 == 0 { "a" } else { "b" }, 1)).await;
    }
    assert_eq!(
        (refusals("budget"), refusals("budget-share")),
        (100.0, 100.0)
    );
    // The next window: a has its 150, then its share alone refuses it.
    next_second().await;
    for _ in 0..151 {
        send(&app, request("a", 1)).await;
    }
    assert_eq!(
        (refusals("budget"), refusals("budget-share")),
        (100.0, 101.0)
    );
    next_second().await;
    send(&app, request("a", 1)).await;
    let windows = |saturated: &str| {
        value(
            "ratelimit_fair_windows_total",
            &[("policy", "fair-metrics"), ("saturated", saturated)],
        )
    };
    assert_eq!((windows("true"), windows("false")), (2.0, 0.0));
}
