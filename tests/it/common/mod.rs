//! Shared helpers of the integration tests.
#![allow(dead_code)] // each test crate uses a different subset

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Extension;
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::headers::{self, RateLimitHeaders};
use tower_redis_ratelimit::quota::QuotaThreshold;
use tower_redis_ratelimit::store::{CheckRequest, ManualClock, QuotaRequest};
use tower_redis_ratelimit::{
    Algorithm, Key, LimitPolicy, LimitStore, Limited, MemoryStore, Mode, Policy, PolicyBuilder,
    PolicyError, Quota, RateLimitLayer, Rule, Store, UserId, policy::Cost, quota::Tier,
};

/// How many checks of `identity` `limiter` admits before its first refusal (at most 100).
pub async fn admitted(limiter: &tower_redis_ratelimit::RateLimiter, identity: &str) -> usize {
    for admitted in 0..100 {
        if limiter.check(identity).await.is_err() {
            return admitted;
        }
    }
    100
}

/// An operator's refund and reset of alice, under a run-time override of 2 an hour (a period
/// `limiter`'s policy of 5 a minute lacks), reach the override's own counter.
pub async fn operators_reach_a_run_time_overrides_own_period(
    limiter: &tower_redis_ratelimit::RateLimiter,
) {
    use tower_redis_ratelimit::policy::Override;
    // 2 an hour: a period the policy (5 a minute) lacks, counted apart.
    limiter
        .set_override(Override::identity("alice").rules([Rule::per_hour(2)]))
        .await
        .unwrap();
    assert_eq!(admitted(limiter, "alice").await, 2);
    let refunded = limiter.refund("alice", 1).await.unwrap();
    assert_eq!(
        (refunded.rules[0].limit, refunded.rules[0].remaining),
        (2, 1)
    );
    assert_eq!(admitted(limiter, "alice").await, 1);
    limiter.reset("alice").await.unwrap();
    assert_eq!(admitted(limiter, "alice").await, 2);
}

/// A router with `GET /` answering "hello", limited by `policy` in `store`.
pub fn app(policy: Policy, store: impl Store) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }).post(|| async { "posted" }))
        .layer(RateLimitLayer::new(policy, store))
}

/// A policy "test" of `rules` under the prefix "t", for a test to finish building.
pub fn policy(rules: impl IntoIterator<Item = Rule>) -> PolicyBuilder {
    Policy::builder("test").prefix("t").rules(rules)
}

/// A clock at the start of an hour, so fixed windows of every test period start at 0.
pub fn clock() -> ManualClock {
    ManualClock::new(1_700_000_000_000 - 1_700_000_000_000 % 3_600_000)
}

/// A memory store on `clock`.
pub fn store_at(clock: &ManualClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build()
}

/// `GET /` from a fixed peer, as the user `user` (a `UserId` an authentication layer would set).
pub fn from_user(user: &str) -> Request<Body> {
    let mut request = request_from("192.0.2.1:1", "/");
    request.extensions_mut().insert(UserId::new(user));
    request
}

/// `GET uri` from a fixed peer, as the user `user`.
pub fn from_user_at(user: &str, uri: &str) -> Request<Body> {
    let mut request = request_from("192.0.2.1:1", uri);
    request.extensions_mut().insert(UserId::new(user));
    request
}

/// A router whose `GET /{used}` records `used` units with `Usage`, limited by `policy` in
/// `store`: a metered route whose handler reports what it used.
pub fn recording_usage(policy: Policy, store: impl Store) -> Router {
    use axum::extract::Path;
    use tower_redis_ratelimit::meter::Usage;
    Router::new()
        .route(
            "/{used}",
            get(|Path(used): Path<u64>, usage: Usage| async move {
                usage.record(used);
                "ok"
            }),
        )
        .layer(RateLimitLayer::new(policy, store))
}

/// A store that is down: every check times out.
#[derive(Clone)]
pub struct DownStore;

impl Store for DownStore {
    fn check(&self, _: &CheckRequest<'_>) -> tower_redis_ratelimit::store::CheckFuture {
        tower_redis_ratelimit::store::CheckFuture::ready(Err(
            tower_redis_ratelimit::store::StoreError::Timeout(std::time::Duration::from_millis(5)),
        ))
    }
}

/// Serves `app` on a free loopback port with connect info, as a real deployment does.
pub async fn serve(app: Router) -> SocketAddr {
    serve_on("127.0.0.1:0", app).await
}

/// Serves `app` on `addr` (a loopback, IPv6 or dual-stack address) with connect info; the
/// address it listens on.
pub async fn serve_on(addr: &str, app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

/// `GET uri` from `peer`.
pub fn request_from(peer: &str, uri: &str) -> Request<Body> {
    let peer: SocketAddr = peer.parse().expect("a socket address");
    let mut request = Request::get(uri).body(Body::empty()).unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

/// Sends one request through a clone of `app`.
pub async fn send(app: &Router, request: Request<Body>) -> Response<Body> {
    app.clone().oneshot(request).await.expect("infallible")
}

/// The status and the parsed rate-limit headers of a response.
pub fn limits(response: &Response<Body>) -> RateLimitHeaders {
    headers::parse(response.headers()).expect("well-formed rate-limit headers")
}

/// Retry-After as whole seconds (panics when absent or in date form).
pub fn retry_after_secs(response: &Response<Body>) -> u64 {
    response
        .headers()
        .get(http::header::RETRY_AFTER)
        .expect("a Retry-After header")
        .to_str()
        .unwrap()
        .parse()
        .expect("Retry-After in delay-seconds")
}

/// The body as JSON.
pub async fn json(response: Response<Body>) -> serde_json::Value {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).expect("a JSON body")
}

/// The body as text.
pub async fn text(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// Asserts a 429 with the problem body naming exactly `violated`.
pub async fn assert_refused(response: Response<Body>, violated: &[&str]) {
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = json(response).await;
    assert_eq!(body["violated-policies"], serde_json::json!(violated));
}

/// Awaits racing tasks and counts their 200s and 429s; any other status fails the test.
pub async fn admitted_and_refused(
    tasks: Vec<tokio::task::JoinHandle<StatusCode>>,
) -> (usize, usize) {
    let mut admitted = 0;
    let mut refused = 0;
    for task in tasks {
        match task.await.expect("the task finishes") {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    (admitted, refused)
}

/// `requests` requests from `peer`, spread in turn over `apps`, all started together (a barrier):
/// how many were admitted and refused.
pub async fn race(apps: &[Router], requests: usize, peer: &str) -> (usize, usize) {
    let barrier = Arc::new(tokio::sync::Barrier::new(requests));
    let tasks = (0..requests)
        .map(|n| {
            let app = apps[n % apps.len()].clone();
            let barrier = barrier.clone();
            let peer = peer.to_owned();
            tokio::spawn(async move {
                barrier.wait().await;
                send(&app, request_from(&peer, "/")).await.status()
            })
        })
        .collect();
    admitted_and_refused(tasks).await
}

/// One limited router for the feature checks: `GET /` through a layer of `policy`, keyed globally.
fn feature_app(policy: Policy, store: impl Store) -> (Router, RateLimitLayer) {
    let layer = RateLimitLayer::new(policy, store).legacy_headers(true);
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer.clone());
    (app, layer)
}

fn global(prefix: &str, name: &str, rule: Rule) -> PolicyBuilder {
    Policy::builder(name)
        .prefix(prefix)
        .key(Key::global())
        .rule(rule)
}

fn weighing(cost: u64) -> Request<Body> {
    let mut request = request_from("192.0.2.1:1", "/");
    request.extensions_mut().insert(Cost(cost));
    request
}

/// Shadow mode, costs, the duplicate guard and the penalty block through the layer, with the same
/// expected answers whatever the store.
pub async fn policy_features_work(store: impl Store + Clone, prefix: &str) {
    let peer = "192.0.2.1:1";

    // Shadow: nothing refused, the refusals counted, the headers true.
    let (app, layer) = feature_app(
        global(prefix, "shadow", Rule::per_minute(2))
            .mode(Mode::Shadow)
            .build()
            .unwrap(),
        store.clone(),
    );
    let mut remaining = Vec::new();
    for _ in 0..4 {
        let response = send(&app, request_from(peer, "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get(http::header::RETRY_AFTER).is_none());
        remaining.push(limits(&response).status("2-per-60s").unwrap().remaining);
    }
    assert_eq!(remaining, [1, 0, 0, 0]);
    assert_eq!(layer.shadow_refusals(), 2);
    // Even a request no rule could ever admit goes through, counted.
    let costly = send(&app, weighing(3)).await;
    assert_eq!(costly.status(), StatusCode::OK);
    assert_eq!(layer.shadow_refusals(), 3);

    // Costs: charged in full, refused whole, and a cost no rule could ever admit is a 413.
    let (app, _) = feature_app(
        global(prefix, "cost", Rule::per_minute(5)).build().unwrap(),
        store.clone(),
    );
    let left = |response: &Response<Body>| limits(response).status("5-per-60s").unwrap().remaining;
    let first = send(&app, weighing(3)).await;
    assert_eq!((first.status(), left(&first)), (StatusCode::OK, 2));
    let refused = send(&app, weighing(3)).await;
    assert_eq!(
        (refused.status(), left(&refused)),
        (StatusCode::TOO_MANY_REQUESTS, 2)
    );
    let last = send(&app, weighing(2)).await;
    assert_eq!((last.status(), left(&last)), (StatusCode::OK, 0));
    let too_costly = send(&app, weighing(6)).await;
    assert_eq!(too_costly.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        too_costly
            .headers()
            .get(http::header::RETRY_AFTER)
            .is_none()
    );
    let body = json(too_costly).await;
    assert_eq!(
        body["detail"],
        "This request costs 6 units; rule \"5-per-60s\" admits at most 5 at once."
    );
    assert_eq!(body["violated-policies"], serde_json::json!(["5-per-60s"]));

    // The duplicate guard: the second request within 5 s is refused, and charges nothing.
    let (app, _) = feature_app(
        global(prefix, "dup", Rule::per_minute(10))
            .prevent_duplicate(Duration::from_secs(5))
            .build()
            .unwrap(),
        store.clone(),
    );
    let first = send(&app, request_from(peer, "/")).await;
    assert_eq!(first.status(), StatusCode::OK);
    let legacy_of_first = limits(&first).legacy.expect("legacy headers");
    assert_eq!((legacy_of_first.limit, legacy_of_first.remaining), (10, 9));
    let duplicate = send(&app, request_from(peer, "/")).await;
    assert_eq!(retry_after_secs(&duplicate), 5);
    // The legacy headers show the guard only when it refused.
    let legacy = |response: &Response<Body>| {
        let legacy = limits(response).legacy.expect("legacy headers");
        (legacy.limit, legacy.remaining)
    };
    assert_eq!(legacy(&duplicate), (1, 0));
    let headers = limits(&duplicate);
    assert_eq!(headers.status("10-per-60s").unwrap().remaining, 9);
    assert_eq!(headers.status("duplicate").unwrap().remaining, 0);
    assert_refused(duplicate, &["duplicate"]).await;

    // A daily quota by tier: its own item in the headers, refusals naming it, tiers from the
    // `Tier` extension, unknown tiers counting as the default one.
    let quota = Quota::builder("daily")
        .prefix(prefix)
        .key(Key::user())
        .tier("free", 2)
        .tier("pro", 3)
        .default_tier("free")
        .build()
        .unwrap();
    let (app, _) = feature_app(
        global(prefix, "tiered", Rule::per_minute(10))
            .quota(quota)
            .build()
            .unwrap(),
        store.clone(),
    );
    let as_user = |user: &str, tier: Option<&'static str>| {
        let mut request = request_from(peer, "/");
        request.extensions_mut().insert(UserId::new(user));
        if let Some(tier) = tier {
            request.extensions_mut().insert(Tier::new(tier));
        }
        request
    };
    let first = send(&app, as_user("ann", Some("pro"))).await;
    assert_eq!(
        first.headers()[headers::RATELIMIT_POLICY],
        "\"10-per-60s\";q=10;w=60, \"daily\";q=3;w=86400"
    );
    assert_eq!(limits(&first).status("daily").unwrap().remaining, 2);
    for _ in 0..2 {
        let pro = send(&app, as_user("ann", Some("pro"))).await;
        assert_eq!(pro.status(), StatusCode::OK);
    }
    for tier in [None, Some("gold"), Some("pro")] {
        // Ann's count is hers whatever the tier says: 3, the pro limit and over the free one.
        let refused = send(&app, as_user("ann", tier)).await;
        let limit = if tier == Some("pro") { 3 } else { 2 };
        assert_eq!(
            refused.headers()[headers::RATELIMIT_POLICY],
            format!("\"10-per-60s\";q=10;w=60, \"daily\";q={limit};w=86400").as_str()
        );
        let retry = retry_after_secs(&refused);
        assert!(retry > 0 && retry <= 86_400, "{retry}");
        assert_refused(refused, &["daily"]).await;
    }
    assert_eq!(
        send(&app, as_user("bob", None)).await.status(),
        StatusCode::OK
    );
    // More than the tier allows in a day is a 413 naming the quota, not a day-long 429.
    let too_costly = send(&app, weighing(3)).await;
    assert_eq!(too_costly.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        json(too_costly).await["detail"],
        "This request costs 3 units; rule \"daily\" admits at most 2 at once."
    );

    // The penalty block: once refused, refused for 15 minutes, not the rest of the minute.
    let (app, _) = feature_app(
        global(prefix, "block", Rule::per_minute(1))
            .block_for(Duration::from_secs(900))
            .build()
            .unwrap(),
        store.clone(),
    );
    assert_eq!(
        send(&app, request_from(peer, "/")).await.status(),
        StatusCode::OK
    );
    for _ in 0..2 {
        let blocked = send(&app, request_from(peer, "/")).await;
        let retry = retry_after_secs(&blocked);
        assert!((899..=900).contains(&retry), "Retry-After {retry}");
        assert_refused(blocked, &["1-per-60s"]).await;
    }
}

/// Delay mode: 20 concurrent requests; exactly those whose reserved time is within `max_delay`
/// are admitted, each runs no earlier than its reservation, the rest get the 429 at once.
pub async fn delay_mode_spaces_concurrent_waiters(store: impl Store + Clone, prefix: &str) {
    let cases = [
        // 10 per second, a bucket of one: one every 100 ms; 450 ms reach five of them.
        (
            Algorithm::TokenBucket,
            Rule::per_second(10).burst(1),
            Duration::from_millis(450),
            vec![0u64, 100, 200, 300, 400],
        ),
        // 2 per 500 ms: two now, two when they leave the window; the next would wait 1 s.
        (
            Algorithm::SlidingLog,
            Rule::new(2, Duration::from_millis(500)),
            Duration::from_millis(700),
            vec![0u64, 0, 500, 500],
        ),
    ];
    for (algorithm, rule, max_delay, slots_ms) in cases {
        let policy = global(prefix, algorithm.as_str(), rule)
            .algorithm(algorithm)
            .mode(Mode::Delay { max_delay })
            .build()
            .unwrap();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let seen = calls.clone();
        let app = Router::new()
            .route(
                "/",
                get(move || {
                    seen.lock().unwrap().push(Instant::now());
                    async { "hello" }
                }),
            )
            .layer(RateLimitLayer::new(policy, store.clone()));
        let start = Instant::now();
        let tasks = (0..20)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(
                    async move { send(&app, request_from("192.0.2.1:1", "/")).await.status() },
                )
            })
            .collect();
        let (admitted, refused) = admitted_and_refused(tasks).await;
        assert_eq!(
            (admitted, refused),
            (slots_ms.len(), 20 - slots_ms.len()),
            "{algorithm}"
        );
        let mut calls = calls.lock().unwrap().clone();
        calls.sort();
        for (call, slot) in calls.iter().zip(&slots_ms) {
            // Stores count whole milliseconds: allow for the one `start` falls in.
            let earliest = Duration::from_millis(slot.saturating_sub(2));
            assert!(
                *call - start >= earliest,
                "{algorithm}: a request ran {:?} after the start, before its slot at {slot} ms",
                *call - start
            );
        }
    }
}

/// The policy of the extractor checks, as a type.
pub struct ExtractedPolicy;

impl LimitPolicy for ExtractedPolicy {
    fn policy() -> Result<Policy, PolicyError> {
        Policy::builder("extracted")
            .key(Key::user())
            .rule(Rule::per_minute(2))
            .build()
    }
}

/// `Limited<ExtractedPolicy>` in a handler admits and refuses like a layer of the same policy:
/// the same statuses, the same 429 body, the same headers. `identity` must be new to the store.
pub async fn the_extractor_limits_like_the_layer(store: impl Store + Clone, identity: &str) {
    let extracted = Router::new()
        .route(
            "/",
            get(|limited: Limited<ExtractedPolicy>| async move { (limited, "hello") }),
        )
        .layer(Extension(LimitStore::new(store.clone())));
    let layered = app(ExtractedPolicy::policy().unwrap(), store);
    let request = |who: String| {
        let mut request = request_from("192.0.2.1:1", "/");
        request.extensions_mut().insert(UserId::new(who));
        request
    };
    for round in 0..3 {
        let by_extractor = send(&extracted, request(format!("{identity}-x"))).await;
        let by_layer = send(&layered, request(format!("{identity}-l"))).await;
        assert_eq!(by_extractor.status(), by_layer.status(), "round {round}");
        let names = |response: &Response<Body>| {
            let mut names: Vec<_> = response.headers().keys().map(|n| n.to_string()).collect();
            names.sort();
            names
        };
        assert_eq!(names(&by_extractor), names(&by_layer));
        assert_eq!(limits(&by_extractor).limits, limits(&by_layer).limits);
        if round == 2 {
            assert_eq!(by_extractor.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(json(by_extractor).await, json(by_layer).await);
        }
    }
    // Without a LimitStore the handler is not silently unlimited.
    let unconfigured =
        Router::new().route("/", get(|_: Limited<ExtractedPolicy>| async { "hello" }));
    let response = send(&unconfigured, request(format!("{identity}-u"))).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

/// 150 concurrent requests of one user with a daily quota of 100, spread over `stores` (say two
/// app instances): exactly 100 admitted, and exactly one alert at 80 % and one at 100 %.
pub async fn a_quota_race_admits_the_limit_and_alerts_once(
    stores: Vec<Arc<dyn Store>>,
    prefix: &str,
) {
    let thresholds = [
        QuotaThreshold {
            percent: 80,
            used: 80,
        },
        QuotaThreshold {
            percent: 100,
            used: 100,
        },
    ];
    let tasks: Vec<_> = (0..150)
        .map(|n| {
            let store = stores[n % stores.len()].clone();
            let prefix = prefix.to_owned();
            tokio::spawn(async move {
                let rules = [Rule::per_second(1_000)];
                let quota_key = format!("{prefix}:daily:user:free-user");
                let key = format!("{prefix}:api:user:free-user");
                let quota = QuotaRequest::new(&quota_key, 100, 86_400_000, 0, &thresholds)
                    .identity("user:free-user");
                store
                    .check(
                        &CheckRequest::new(&key, &rules, Algorithm::SlidingLog)
                            .identity("user:free-user")
                            .quota(Some(quota)),
                    )
                    .await
                    .expect("the store answers")
            })
        })
        .collect();
    let mut admitted = 0;
    let mut alerts = Vec::new();
    for task in tasks {
        let decision = task.await.unwrap();
        admitted += usize::from(decision.allowed);
        alerts.extend(decision.quota_alerts);
    }
    alerts.sort_unstable();
    assert_eq!(admitted, 100);
    assert_eq!(alerts, [80, 100]);
}

pub mod capture;
pub mod prometheus;
pub mod recording;
pub mod redis_cluster;
pub mod redis_server;
pub mod redis_store;
pub mod redis_tls;
pub mod timed;

/// The TOML configs shipped in `examples/`, sorted (at least one).
pub fn example_configs() -> Vec<std::path::PathBuf> {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut paths: Vec<_> = std::fs::read_dir(examples)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "toml")
        })
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no example configs");
    paths
}

/// Unix time that follows tokio's clock (paused in the tests that use it), from
/// 1 700 000 000 000 ms (on a 20 s boundary): a memory store on it and the limiter's own timers
/// (a held request's sleep, units taken ahead) move together.
#[derive(Clone)]
pub struct TokioClock {
    start: tokio::time::Instant,
}

impl TokioClock {
    pub const START_UNIX_MS: u64 = 1_700_000_000_000;

    pub fn new() -> Self {
        TokioClock {
            start: tokio::time::Instant::now(),
        }
    }
}

impl tower_redis_ratelimit::store::Clock for TokioClock {
    fn now_unix_ms(&self) -> u64 {
        Self::START_UNIX_MS + self.start.elapsed().as_millis() as u64
    }
}
