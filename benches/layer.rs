//! What the rate-limit layer adds to one request, next to a bare router and to `tower_governor`.
//!
//! Every function sends one `GET /` through the same axum router (one route answering `"hello"`),
//! in-process with `oneshot` (no network, no hyper), on a current-thread tokio runtime. The service is
//! built once; each iteration clones it, builds the same request (empty body, a `ConnectInfo` peer
//! address, always the same client IP so the same bucket is hit) and awaits the response.
//!
//! Group `one_request` (admitted requests; the limits are huge so nothing is ever refused):
//! - `no_limiter`: the bare router, the baseline;
//! - `memory_fixed_1_rule`: [`RateLimitLayer`] keyed by client IP with a [`MemoryStore`], one rule,
//!   fixed window (O(1) state per rule, like governor's GCRA);
//! - `memory_fixed_3_rules`: the same with three rules (per second, per minute, per hour);
//! - `memory_sliding_1_rule`: the sliding log (the default algorithm) with one per-second rule. The
//!   log keeps one entry per admitted request, so a billion-per-hour rule would measure a deque
//!   growing to millions of entries rather than the layer; real sliding-log limits are small.
//! - `tower_governor_1_rule`: `tower_governor`'s `GovernorLayer`, peer-IP key, one quota.
//!
//! Group `redis` (a local Redis: `REDIS_URL`, default `redis://127.0.0.1:6379/0`; skipped with a
//! message when none answers), side by side with the memory store in the same run:
//! - `memory_fixed_1_rule`, `redis_fixed_1_rule`, `redis_fixed_3_rules`: fixed window, huge limits;
//!   one `EVALSHA` per request whatever the number of rules.
//!
//! Group `algorithms` (admitted requests, huge limits), the four algorithms on both stores side by
//! side in the same run, with one per-second rule each (the sliding log's period stays one second
//! so its log stays small, as above; the token bucket refills a million per second into a bucket of
//! a billion, since a token bucket refills at most one unit per microsecond):
//! - `no_limiter`: the bare router, the baseline;
//! - `memory_fixed_window`, `memory_sliding_log`, `memory_sliding_counter`, `memory_token_bucket`:
//!   [`MemoryStore`];
//! - `redis_fixed_window`, `redis_sliding_log`, `redis_sliding_counter`, `redis_token_bucket`:
//!   [`RedisStore`] on the same Redis as group `redis` (skipped with a message when none answers;
//!   the memory functions still run).
//!
//! Group `refused` (the flood case: the client's bucket is already used up):
//! - `memory_1_rule`: our layer refusing with 429 (1 per hour, already used, sliding log);
//! - `tower_governor_1_rule`: `tower_governor` refusing with 429 (burst 1, one per hour), for scale.
//!
//! Group `recorder` (what recording metrics costs; run LAST, since it installs the process's global
//! `metrics` recorder, which can be installed only once): one fixed-window rule on a [`MemoryStore`]
//! as in `one_request`, built twice. A layer registers its metric handles at its first request,
//! from whatever recorder is installed then, and keeps them; so the first app is built and sent its
//! first request before any recorder is installed (no-op handles), then a Prometheus recorder
//! (`metrics-exporter-prometheus`, `PrometheusBuilder::new().install_recorder()`, upkeep every 5 s
//! on a thread, as its `install` would) is installed, and the second app's first request registers
//! real handles. Both are checked through the exporter's output: the first adds no series, the
//! second its `ratelimit_requests_total`. Groups before this one bound their layers' handles (to
//! no-ops) before the install, whatever the filter, since every group function builds and checks
//! its services even when none of its functions is measured.
//! - `no_limiter`: the bare router, the baseline;
//! - `memory_fixed_1_rule_no_recorder`: the layer with no-op handles;
//! - `memory_fixed_1_rule_with_recorder`: the layer recording into Prometheus (a counter per request,
//!   a store-latency summary sample, the near-limit check).
//!
//! Each service is checked once before it is measured (status, and our `RateLimit` header; a request
//! without `ConnectInfo` must get a 500, which shows the limiter really sits in the path), and every
//! measured response's status is asserted, so a misconfigured bench panics instead of measuring an
//! error path.
//!
//! Run with:
//!
//! ```text
//! cargo bench --bench layer
//! cargo bench --bench layer -- --warm-up-time 2 --measurement-time 5   # quicker
//! cargo bench --bench layer -- one_request/memory                      # a subset
//! cargo bench --bench layer -- '^one_request/no_limiter$'               # one function
//! cargo bench --bench layer -- algorithms                               # one group
//! cargo bench --bench layer -- recorder                                 # metrics cost
//! ```
//!
//! Differences are a few hundred nanoseconds to a couple of microseconds, so on a shared or virtual
//! machine compare several runs; running each function alone (as in the last line) and taking the
//! median over repeats keeps one function's heap and cache state from affecting the next.

use std::hint::black_box;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, criterion_group, criterion_main};
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::runtime::Runtime;
use tower::ServiceExt;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Rule, Store, headers,
};

#[path = "support/app.rs"]
mod app;

use app::{request, router};

/// A limit no benchmark run comes near: a billion requests (per second, minute or hour).
const HUGE: u64 = 1_000_000_000;

/// The same billion as `tower_governor`'s burst size.
const HUGE_BURST: u32 = 1_000_000_000;

/// The router behind our layer: client-IP key, these rules, a fresh memory store.
fn ours(algorithm: Algorithm, rules: impl IntoIterator<Item = Rule>) -> Router {
    ours_in(MemoryStore::new(), "bench", algorithm, rules)
}

/// The router behind our layer with `store`, keys under `prefix`.
fn ours_in(
    store: impl Store,
    prefix: &str,
    algorithm: Algorithm,
    rules: impl IntoIterator<Item = Rule>,
) -> Router {
    let policy = Policy::builder("bench")
        .prefix(prefix)
        .key(Key::ip())
        .algorithm(algorithm)
        .rules(rules)
        .build()
        .expect("a valid policy");
    router().layer(RateLimitLayer::new(policy, store))
}

/// The router behind `tower_governor`: peer-IP key, one quota of `burst` replenished one per
/// `period`.
fn governor(period: Duration, burst: u32) -> Router {
    let config = GovernorConfigBuilder::default()
        .period(period)
        .burst_size(burst)
        .finish()
        .expect("a valid governor config");
    router().layer(GovernorLayer::new(config))
}

/// Which headers a checked response must carry.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Limiter {
    None,
    Ours,
    Governor,
}

/// Sends one request outside any timing and panics unless the service answers `expected`, carries
/// our `RateLimit` header exactly when it is ours, and (for a limiter) refuses a request without a
/// client address, which shows the limiter is really in the path.
fn verify(rt: &Runtime, name: &str, app: &Router, limiter: Limiter, expected: StatusCode) {
    let response = rt
        .block_on(app.clone().oneshot(request()))
        .unwrap_or_else(|never| match never {});
    assert_eq!(response.status(), expected, "{name}: unexpected status");
    assert_eq!(
        response.headers().contains_key(headers::RATELIMIT),
        limiter == Limiter::Ours,
        "{name}: the RateLimit header should be there exactly for our layer: {:?}",
        response.headers()
    );
    let anonymous = Request::get("/")
        .body(Body::empty())
        .expect("a valid request");
    let response = rt
        .block_on(app.clone().oneshot(anonymous))
        .unwrap_or_else(|never| match never {});
    let without_peer = if limiter == Limiter::None {
        StatusCode::OK
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    assert_eq!(
        response.status(),
        without_peer,
        "{name}: a request without ConnectInfo"
    );
}

/// Measures one request through `app`, asserting every response's status.
fn bench(
    group: &mut BenchmarkGroup<'_, WallTime>,
    rt: &Runtime,
    name: &str,
    app: Router,
    expected: StatusCode,
) {
    group.bench_function(name, |b| {
        b.to_async(rt).iter(|| {
            let app = app.clone();
            async move {
                let response = app
                    .oneshot(black_box(request()))
                    .await
                    .unwrap_or_else(|never| match never {});
                assert_eq!(response.status(), expected, "{name}: status changed");
                response
            }
        });
    });
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn one_request(c: &mut Criterion) {
    let rt = runtime();
    let services = [
        ("no_limiter", Limiter::None, router()),
        (
            "memory_fixed_1_rule",
            Limiter::Ours,
            ours(Algorithm::FixedWindow, [Rule::per_second(HUGE)]),
        ),
        (
            "memory_fixed_3_rules",
            Limiter::Ours,
            ours(
                Algorithm::FixedWindow,
                [
                    Rule::per_second(HUGE),
                    Rule::per_minute(HUGE),
                    Rule::per_hour(HUGE),
                ],
            ),
        ),
        (
            "memory_sliding_1_rule",
            Limiter::Ours,
            ours(Algorithm::SlidingLog, [Rule::per_second(HUGE)]),
        ),
        (
            "tower_governor_1_rule",
            Limiter::Governor,
            // One cell per nanosecond, a billion of burst: a billion per second.
            governor(Duration::from_nanos(1), HUGE_BURST),
        ),
    ];
    for (name, limiter, app) in &services {
        verify(&rt, name, app, *limiter, StatusCode::OK);
    }
    let mut group = c.benchmark_group("one_request");
    for (name, _, app) in services {
        bench(&mut group, &rt, name, app, StatusCode::OK);
    }
    group.finish();
}

fn refused(c: &mut Criterion) {
    let rt = runtime();
    let services = [
        (
            "memory_1_rule",
            Limiter::Ours,
            ours(Algorithm::SlidingLog, [Rule::per_hour(1)]),
        ),
        (
            "tower_governor_1_rule",
            Limiter::Governor,
            governor(Duration::from_secs(3600), 1),
        ),
    ];
    for (name, limiter, app) in &services {
        // The first request uses the bucket up; from then on the client is refused.
        verify(&rt, name, app, *limiter, StatusCode::OK);
        verify(&rt, name, app, *limiter, StatusCode::TOO_MANY_REQUESTS);
    }
    let mut group = c.benchmark_group("refused");
    for (name, _, app) in services {
        bench(&mut group, &rt, name, app, StatusCode::TOO_MANY_REQUESTS);
    }
    group.finish();
}

/// The Redis the `redis` and `algorithms` groups use: `REDIS_URL`, else the local default.
fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".to_owned())
}

/// A store on `url` with a timeout no local run comes near.
fn redis_store(url: &str) -> RedisStore {
    RedisStore::from_url(url)
        .expect("a valid REDIS_URL")
        .timeout(Duration::from_secs(2))
}

/// The prefix of this run's Redis keys, so runs don't share buckets; the keys expire with their
/// windows.
fn redis_prefix() -> String {
    format!("bench-{}", std::process::id())
}

/// Whether the store behind `app` answered: a Redis that doesn't answer makes the layer fail open,
/// a 200 without a RateLimit header.
fn redis_answers(rt: &Runtime, app: &Router) -> bool {
    let probe = rt
        .block_on(app.clone().oneshot(request()))
        .unwrap_or_else(|never| match never {});
    probe.headers().contains_key(headers::RATELIMIT)
}

/// The one huge per-second rule of `algorithm` in group `algorithms`.
fn huge_rule(algorithm: Algorithm) -> Rule {
    match algorithm {
        // At most one unit per microsecond; a bucket of a billion drains no faster than it refills.
        Algorithm::TokenBucket => Rule::per_second(1_000_000).burst(HUGE),
        _ => Rule::per_second(HUGE),
    }
}

fn algorithms(c: &mut Criterion) {
    const ALL: [Algorithm; 4] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ];
    let rt = runtime();
    let mut services = vec![("no_limiter".to_owned(), Limiter::None, router())];
    for algorithm in ALL {
        services.push((
            format!("memory_{algorithm}"),
            Limiter::Ours,
            ours(algorithm, [huge_rule(algorithm)]),
        ));
    }
    let url = redis_url();
    let store = redis_store(&url);
    let prefix = redis_prefix();
    let redis: Vec<_> = ALL
        .into_iter()
        .map(|algorithm| {
            (
                format!("redis_{algorithm}"),
                Limiter::Ours,
                ours_in(store.clone(), &prefix, algorithm, [huge_rule(algorithm)]),
            )
        })
        .collect();
    if redis_answers(&rt, &redis[0].2) {
        services.extend(redis);
    } else {
        eprintln!("algorithms/redis_* skipped: no Redis answered at {url} (set REDIS_URL)");
    }
    for (name, limiter, app) in &services {
        verify(&rt, name, app, *limiter, StatusCode::OK);
    }
    let mut group = c.benchmark_group("algorithms");
    for (name, _, app) in services {
        bench(&mut group, &rt, &name, app, StatusCode::OK);
    }
    group.finish();
}

fn redis(c: &mut Criterion) {
    let url = redis_url();
    let rt = runtime();
    let store = redis_store(&url);
    let prefix = redis_prefix();
    let three = [
        Rule::per_second(HUGE),
        Rule::per_minute(HUGE),
        Rule::per_hour(HUGE),
    ];
    let services = [
        (
            "memory_fixed_1_rule",
            ours(Algorithm::FixedWindow, [Rule::per_second(HUGE)]),
        ),
        (
            "redis_fixed_1_rule",
            ours_in(
                store.clone(),
                &prefix,
                Algorithm::FixedWindow,
                [Rule::per_second(HUGE)],
            ),
        ),
        (
            "redis_fixed_3_rules",
            ours_in(store, &prefix, Algorithm::FixedWindow, three),
        ),
    ];
    if !redis_answers(&rt, &services[1].1) {
        eprintln!("redis benches skipped: no Redis answered at {url} (set REDIS_URL)");
        return;
    }
    for (name, app) in &services {
        verify(&rt, name, app, Limiter::Ours, StatusCode::OK);
    }
    let mut group = c.benchmark_group("redis");
    for (name, app) in services {
        bench(&mut group, &rt, name, app, StatusCode::OK);
    }
    group.finish();
}

/// The series a layer's first request registers, named in the exporter's output.
const REQUESTS_SERIES: &str = "ratelimit_requests_total";

fn recorder(c: &mut Criterion) {
    if !cfg!(feature = "metrics") {
        eprintln!("recorder benches skipped: built without the `metrics` feature");
        return;
    }
    let rt = runtime();
    let baseline = router();
    verify(&rt, "no_limiter", &baseline, Limiter::None, StatusCode::OK);
    let fixed = || ours(Algorithm::FixedWindow, [Rule::per_second(HUGE)]);
    // Bound to no-op handles: its first request comes before any recorder.
    let no_recorder = fixed();
    verify(
        &rt,
        "memory_fixed_1_rule_no_recorder",
        &no_recorder,
        Limiter::Ours,
        StatusCode::OK,
    );
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .expect("group `recorder` runs last: no recorder installed before it");
    // What `install` would do: drain the histograms every 5 s, so their buckets don't pile up.
    let upkeep = handle.clone();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(5));
            upkeep.run_upkeep();
        }
    });
    verify(
        &rt,
        "memory_fixed_1_rule_no_recorder",
        &no_recorder,
        Limiter::Ours,
        StatusCode::OK,
    );
    let rendered = handle.render();
    assert!(
        !rendered.contains("ratelimit_"),
        "the layer bound before the install should record nothing:\n{rendered}"
    );
    let with_recorder = fixed();
    verify(
        &rt,
        "memory_fixed_1_rule_with_recorder",
        &with_recorder,
        Limiter::Ours,
        StatusCode::OK,
    );
    let rendered = handle.render();
    assert!(
        rendered.contains(REQUESTS_SERIES),
        "the layer bound after the install should record {REQUESTS_SERIES}:\n{rendered}"
    );
    let services = [
        ("no_limiter", baseline),
        ("memory_fixed_1_rule_no_recorder", no_recorder),
        ("memory_fixed_1_rule_with_recorder", with_recorder),
    ];
    let mut group = c.benchmark_group("recorder");
    for (name, app) in services {
        bench(&mut group, &rt, name, app, StatusCode::OK);
    }
    group.finish();
}

// `recorder` installs the global recorder: it stays last.
criterion_group!(benches, one_request, refused, redis, algorithms, recorder);
criterion_main!(benches);
