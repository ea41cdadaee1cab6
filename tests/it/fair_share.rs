//! Fair shares of one budget (issue 62): once the budget is saturated, each tenant is admitted
//! up to its weighted share, what one leaves goes to the others, and one that arrives has its
//! share within a window. Real tenants: 8 concurrent loops each, as fast as they can, through
//! two instances (a layer each) over one store, on the real clock; on both stores.

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

use common::redis_server::{TestRedis, unique_prefix};
use common::redis_store;

/// A gateway: 300 requests a second shared by the tenants of `x-tenant`, each weighing its
/// `x-weight`; each tenant may send up to 10 000 a second on its own.
fn gateway(store: impl Store, prefix: &str) -> Router {
    gateway_counting(store, Algorithm::default(), prefix)
}

/// [`gateway`] counting with `algorithm`.
fn gateway_counting(store: impl Store, algorithm: Algorithm, prefix: &str) -> Router {
    let policy = Policy::builder("gateway")
        .prefix(prefix)
        .key(Key::header("x-tenant"))
        .algorithm(algorithm)
        .rule(Rule::per_second(10_000))
        .fair_share(weighed_by_header(Rule::per_second(300).named("budget")))
        .build()
        .unwrap();
    Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(RateLimitLayer::new(policy, store))
}

/// `budget` shared by tenants each weighing its request's `x-weight` (1 without one).
pub(crate) fn weighed_by_header(budget: Rule) -> FairShare {
    FairShare::new(budget).weight_from_fn(|parts| {
        parts
            .headers
            .get("x-weight")
            .and_then(|weight| weight.to_str().ok()?.parse().ok())
            .unwrap_or(1)
    })
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
    /// Its loops take turns among `apps` (the instances).
    fn start(apps: &[Router], name: &'static str, weight: u32) -> Tenant {
        let admitted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let loops = (0..8)
            .map(|index| {
                let app = apps[index % apps.len()].clone();
                let (admitted, stop) = (admitted.clone(), stop.clone());
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

/// Three tenants through two instances (each a layer over `stores`' own client of the store).
async fn shares_hold_as_tenants_stop_and_arrive(stores: [impl Store; 2], prefix: &str) {
    let [one, two] = stores;
    let apps = [gateway(one, prefix), gateway(two, prefix)];
    let (a, b, c) = (
        Tenant::start(&apps, "a", 1),
        Tenant::start(&apps, "b", 1),
        Tenant::start(&apps, "c", 2),
    );
    // The first window saturates while running: shares from the next one.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let all = HashMap::from([("a", &a), ("b", &b), ("c", &c)]);
    mid_second().await;
    let measured = rates(&all, 5).await;
    assert_near(&measured, "a", 75.0);
    assert_near(&measured, "b", 75.0);
    assert_near(&measured, "c", 150.0);
    let total: f64 = measured.values().sum();
    assert!(total >= 0.95 * 300.0, "{total:.1} a second of 300");

    // c stops: a and b share what it leaves.
    c.stop().await;
    let two = HashMap::from([("a", &a), ("b", &b)]);
    // (Its share is let go a tenth into the window after the one it stopped in.)
    tokio::time::sleep(Duration::from_secs(1)).await;
    mid_second().await;
    let measured = rates(&two, 5).await;
    assert_near(&measured, "a", 150.0);
    assert_near(&measured, "b", 150.0);

    // d arrives while a and b saturate the budget: within a second it has its share.
    // (From the middle of a second: the measure, a second later, holds whole windows.)
    mid_second().await;
    let d = Tenant::start(&apps, "d", 1);
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
    let store = MemoryStore::new();
    shares_hold_as_tenants_stop_and_arrive([store.clone(), store], "rl").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_hold_as_tenants_stop_and_arrive_on_redis() {
    let redis = TestRedis::shared();
    let prefix = unique_prefix("fair-load");
    shares_hold_as_tenants_stop_and_arrive(
        [redis_store::store(&redis), redis_store::store(&redis)],
        &prefix,
    )
    .await;
    // Nothing of the budget, the shares or the tenants outlives its use.
    assert!(redis_store::assert_every_key_expires(&redis, &prefix) > 0);
}

/// Waits for the start of the next second (the budget's windows), and 5 ms more.
/// Waits for the middle of the next second: a measure of whole seconds from there holds each
/// of the budget's windows once, however a tenant's admissions bunch within them.
pub(crate) async fn mid_second() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let left = u64::try_from(1500 - now % 1000).unwrap();
    tokio::time::sleep(Duration::from_millis(left % 1000)).await;
}

async fn next_second() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let left = u64::try_from(1000 - now % 1000).unwrap();
    tokio::time::sleep(Duration::from_millis(left + 5)).await;
}

async fn a_binding_share_is_the_identitys_own_limit_in_the_headers_and_its_refusal_names_it(
    store: impl Store,
    prefix: &str,
) {
    let app = gateway_counting(store, Algorithm::FixedWindow, prefix);
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

#[tokio::test]
async fn a_binding_share_is_the_identitys_own_limit_in_the_headers_and_its_refusal_names_it_in_memory()
 {
    a_binding_share_is_the_identitys_own_limit_in_the_headers_and_its_refusal_names_it(
        MemoryStore::new(),
        "rl",
    )
    .await;
}

#[tokio::test]
async fn a_binding_share_is_the_identitys_own_limit_in_the_headers_and_its_refusal_names_it_on_redis()
 {
    let redis = TestRedis::shared();
    a_binding_share_is_the_identitys_own_limit_in_the_headers_and_its_refusal_names_it(
        redis_store::store(&redis),
        &unique_prefix("fair-headers"),
    )
    .await;
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
    // (A store of your own says only that it checks.)
    let store = common::DownStore;
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

/// On a Redis Cluster (a scenario of `cluster.rs`, whose cluster serves them all): tenants whose
/// own keys would lie on every primary share one budget, in one call a request. The budget and
/// every tenant's keys have the policy's hash tag, so they live on one node; the budget is never
/// passed, and once it saturates each tenant has its share.
pub(crate) async fn fair_shares_on_a_cluster(
    cluster: &common::redis_cluster::TestCluster,
    prefix: &str,
) {
    use common::redis_cluster::node_client;
    let users: Vec<String> = cluster
        .users_on_every_primary(1)
        .into_values()
        .flatten()
        .collect();
    assert_eq!(users.len(), 3, "a user on each primary");
    // (Daily windows: the test never runs across a window's end.)
    let policy = Policy::builder("shared")
        .prefix(prefix)
        .key(Key::user())
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_day(1_000))
        .fair_share(FairShare::new(Rule::per_day(30).named("budget")))
        .build()
        .unwrap();
    let store = tower_redis_ratelimit::RedisStore::cluster(cluster.urls())
        .unwrap()
        .timeout(Duration::from_secs(10));
    let app = common::app(policy, store);
    let evalsha = || -> u64 {
        cluster
            .primaries()
            .into_iter()
            .map(|port| {
                common::redis_server::command_calls(&mut node_client(port))
                    .get("evalsha")
                    .copied()
                    .unwrap_or(0)
            })
            .sum()
    };
    // (The first request of a node may load the script there.)
    let user_request = |user: &str| {
        let mut request = Request::get("/").body(Body::empty()).unwrap();
        request
            .extensions_mut()
            .insert(tower_redis_ratelimit::UserId::new(user));
        request
    };
    assert_eq!(
        send(&app, user_request(&users[0])).await.status(),
        StatusCode::OK
    );
    let before = evalsha();
    let mut admitted: HashMap<&str, u64> = HashMap::from([(users[0].as_str(), 1)]);
    let mut sent = 0;
    for round in 0..20 {
        for user in &users {
            if round == 0 && user == &users[0] {
                continue;
            }
            sent += 1;
            let response = send(&app, user_request(user)).await;
            match response.status() {
                StatusCode::OK => *admitted.entry(user).or_default() += 1,
                StatusCode::TOO_MANY_REQUESTS => {}
                other => panic!("{user}: {other}"),
            }
        }
    }
    assert_eq!(evalsha() - before, sent, "one call a request");
    // Round after round, each asks as much: the budget saturates with 10 each, then holds them
    // to that.
    for user in &users {
        assert_eq!(admitted.get(user.as_str()), Some(&10), "{admitted:?}");
    }
    let on_nodes: Vec<usize> = cluster
        .primaries()
        .into_iter()
        .map(|port| {
            let mut client = node_client(port);
            redis::Commands::scan_match::<_, String>(&mut client, format!("{prefix}:{{shared}}:*"))
                .unwrap()
                .count()
        })
        .collect();
    assert_eq!(
        on_nodes.iter().filter(|&&keys| keys > 0).count(),
        1,
        "every key of the budget's checks on one node: {on_nodes:?}"
    );
    // The budget's counter, its shares, and a counter per tenant.
    assert_eq!(on_nodes.iter().sum::<usize>(), 2 + users.len());
}

/// What a decision said: admitted, and each state's limit, remaining and whether it refused.
type Said = (bool, Vec<(u64, u64, bool)>);

fn said(decision: &tower_redis_ratelimit::Decision) -> Said {
    (
        decision.allowed,
        decision
            .rules
            .iter()
            .map(|state| (state.limit, state.remaining, state.retry_after.is_some()))
            .collect(),
    )
}

/// A budget of 10 a second shared by `a` and `b` through a handle over `store`, whose clock
/// `at` sets (ms), call after call: checks, a refund, a peek, a give-back and a reset, across
/// two windows. What each call said, and how many of each tenant's checks were admitted per window.
async fn a_budgets_calls_one_after_another(
    store: impl Store,
    at: impl Fn(u64),
    prefix: &str,
) -> (Vec<Said>, [[u64; 2]; 2]) {
    use tower_redis_ratelimit::RateLimiter;
    let policy = Policy::builder("calls")
        .prefix(prefix)
        .key(Key::user())
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_second(100))
        .fair_share(FairShare::new(Rule::per_second(10).named("budget")))
        .build()
        .unwrap();
    let limiter = RateLimiter::new(policy, store);
    // (Real time, at a second's start: Redis expires keys by its own clock.)
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let start = u64::try_from(now - now % 1000 + 1000).unwrap();
    let mut trace = Vec::new();
    let mut admitted = [[0; 2]; 2];
    let check = |tenant: &'static str| {
        let limiter = &limiter;
        async move {
            match limiter.check(tenant).await {
                Ok(admission) => (said(admission.decision().unwrap()), Some(admission)),
                Err(refused) => (said(refused.decision().unwrap()), None),
            }
        }
    };
    at(start);
    // a asks 6, then b 6: the budget admits 10, then refuses b twice.
    for (index, tenant) in ["a", "b"].into_iter().enumerate() {
        for _ in 0..6 {
            let (decision, admission) = check(tenant).await;
            admitted[0][index] += u64::from(admission.is_some());
            trace.push(decision);
        }
    }
    // a's refund makes room: b is held to its share (5: it asked 8, a 6), then refused by it.
    at(start + 100);
    trace.push(said(&limiter.refund("a", 1).await.unwrap()));
    for _ in 0..2 {
        let (decision, admission) = check("b").await;
        admitted[0][1] += u64::from(admission.is_some());
        trace.push(decision);
    }
    trace.push(said(&limiter.peek("a").await.unwrap()));
    // The next window is saturated from its start: 5 each. a's first admission, given back,
    // leaves its share whole.
    at(start + 1_000);
    let (decision, admission) = check("a").await;
    trace.push(decision);
    trace.push(said(&admission.unwrap().refund().await.unwrap()));
    for _ in 0..6 {
        let (decision, admission) = check("a").await;
        admitted[1][0] += u64::from(admission.is_some());
        trace.push(decision);
    }
    // A reset of a clears its own counters, not what it used of the budget and its share.
    limiter.reset("a").await.unwrap();
    let (decision, admission) = check("a").await;
    assert!(admission.is_none(), "{decision:?}");
    trace.push(decision);
    (trace, admitted)
}

#[tokio::test]
async fn a_budgets_checks_refunds_peeks_give_backs_and_resets_say_the_same_on_both_stores() {
    let clock = tower_redis_ratelimit::store::ManualClock::new(0);
    let memory = common::store_at(&clock);
    let (in_memory, admitted) =
        a_budgets_calls_one_after_another(memory, |ms| clock.set(ms), "rl").await;
    assert_eq!(admitted, [[6, 5], [5, 0]]);
    let redis = TestRedis::shared();
    let store = redis_store::store(&redis);
    let fixed = store.clone();
    let (on_redis, admitted) = a_budgets_calls_one_after_another(
        store,
        move |ms| fixed.fix_time_for_tests(Some(ms * 1_000)),
        &unique_prefix("fair-calls"),
    )
    .await;
    assert_eq!(admitted, [[6, 5], [5, 0]]);
    for (step, (memory, redis)) in in_memory.iter().zip(&on_redis).enumerate() {
        assert_eq!(memory, redis, "step {step}");
    }
    assert_eq!(in_memory.len(), on_redis.len());
}

/// A slot of a policy with a fair share, released, is free again, and an inspection reads the
/// identity's own counts: both find its keys where its checks keep them (on Redis, under the
/// budget's hash tag).
async fn slots_and_inspections_find_the_keys_of_a_budgets_checks(
    store: impl Store + Clone,
    prefix: &str,
) {
    use tower_redis_ratelimit::RateLimiter;
    // (A sliding log: the count is exact whenever the test runs.)
    let policy = Policy::builder("slots")
        .prefix(prefix)
        .key(Key::user())
        .algorithm(Algorithm::SlidingLog)
        .rule(Rule::per_hour(100).named("own"))
        .max_in_flight(1)
        .lease(Duration::from_secs(600))
        .fair_share(FairShare::new(Rule::per_hour(1_000)))
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(policy.clone(), store.clone());
    let limiter = RateLimiter::new(policy, store);
    for _ in 0..3 {
        let permit = limiter.acquire("a").await.expect("the one slot is free");
        assert!(permit.holds_slot());
        assert!(limiter.acquire("a").await.is_err(), "the slot is held");
        permit.release().await.unwrap();
    }
    // Three slots taken, each refused once more: three admissions.
    let usage = layer.inspect("user:a").await.unwrap();
    let own = usage.iter().find(|rule| rule.rule == "own").unwrap();
    assert_eq!((own.limit, own.remaining), (100, 97), "{usage:?}");
}

#[tokio::test]
async fn slots_and_inspections_find_the_keys_of_a_budgets_checks_in_memory() {
    slots_and_inspections_find_the_keys_of_a_budgets_checks(MemoryStore::new(), "rl").await;
}

#[tokio::test]
async fn slots_and_inspections_find_the_keys_of_a_budgets_checks_on_redis() {
    let redis = TestRedis::shared();
    slots_and_inspections_find_the_keys_of_a_budgets_checks(
        redis_store::store(&redis),
        &unique_prefix("fair-slots"),
    )
    .await;
}

/// An operator's peek at a tenant (which has no request to weigh) leaves its weight as its
/// requests gave it: the shares after it are by weight still.
async fn an_operators_peek_keeps_the_tenants_weight(
    store: impl Store + Clone,
    at: impl Fn(u64),
    prefix: &str,
) -> u64 {
    let policy = Policy::builder("peeked")
        .prefix(prefix)
        .key(Key::header("x-tenant"))
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::per_second(1_000))
        .fair_share(weighed_by_header(Rule::per_second(12).named("budget")))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(RateLimitLayer::new(policy.clone(), store.clone()));
    let operator = tower_redis_ratelimit::RateLimiter::new(policy, store);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let start = u64::try_from(now - now % 1000 + 1000).unwrap();
    // a (weight 1) and c (weight 2) both ask for more than the budget: both held back.
    at(start);
    for _ in 0..12 {
        send(&app, request("a", 1)).await;
        send(&app, request("c", 2)).await;
    }
    // The next window c asks, the operator peeks at it, and past the tenth (where the shares
    // are worked out again) a is held to a third of 12.
    at(start + 1_000 + 50);
    send(&app, request("c", 2)).await;
    at(start + 1_000 + 60);
    operator.peek("c").await.unwrap();
    at(start + 1_000 + 150);
    let mut admitted = 0;
    for _ in 0..12 {
        if send(&app, request("a", 1)).await.status() == StatusCode::OK {
            admitted += 1;
        }
    }
    admitted
}

#[tokio::test]
async fn an_operators_peek_keeps_the_tenants_weight_on_both_stores() {
    let clock = tower_redis_ratelimit::store::ManualClock::new(0);
    let memory = common::store_at(&clock);
    let in_memory =
        an_operators_peek_keeps_the_tenants_weight(memory, |ms| clock.set(ms), "rl").await;
    assert_eq!(in_memory, 4);
    let redis = TestRedis::shared();
    let store = redis_store::store(&redis);
    let fixed = store.clone();
    let on_redis = an_operators_peek_keeps_the_tenants_weight(
        store,
        move |ms| fixed.fix_time_for_tests(Some(ms * 1_000)),
        &unique_prefix("fair-peek"),
    )
    .await;
    assert_eq!(on_redis, 4);
}
