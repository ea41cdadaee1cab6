//! What a check costs the app, in CPU per request, on each store, under concurrency: the part of a
//! load run that is the limiter's own, without HTTP, sockets to clients or wrk.
//!
//! Each setup sends `GET /` through the same axum router in-process (`oneshot`, no hyper) from
//! `CONCURRENCY` tasks at once on a two-worker tokio runtime, as a server's connections would,
//! for a few seconds, every request from the same client IP (one hot key, as in
//! `benches/load_peers.sh`), every request admitted (a limit no run reaches, fixed window, one
//! rule). It prints requests per second and the CPU time per request of this process and of
//! `redis-server` (from `/proc/<pid>/stat`), interleaved over rounds, then the medians:
//!
//! - `bare`: the router alone, the baseline;
//! - `governor`, `governor-headers`: `tower_governor` (keyed by the peer's IP, as `memory` is),
//!   without and with its `x-ratelimit-*` headers: the in-process peer;
//! - `memory`: [`RateLimitLayer`] on a [`MemoryStore`];
//! - `governor-flood`, `memory-flood`: a refusal flood: one request per hour, every request after
//!   the first refused (`tower_governor` with its headers, and the layer on a `MemoryStore`);
//! - `redis`: [`RateLimitLayer`] on a [`RedisStore`], whose checks group-commit into script calls;
//! - `handle-memory`, `handle-redis`: the same policy and stores through a [`RateLimiter`] the
//!   handler calls (`check` for the client's address, its headers on the response), not a layer:
//!   the handle's cost beside the layer's;
//! - `redis-prefetch`: the layer on Redis with `prefetch(100)`: the hot key's units taken ahead
//!   (it prints the store calls per request);
//! - `metered-memory`, `metered-redis`: the layer with a meter, its one rule metered, each request
//!   reserving an estimate of 500 and its handler recording nothing (the reservation stands): a
//!   metered check beside a plain one;
//! - `settled-memory`, `settled-redis`: the same, the handler recording 120 of the 500 (with
//!   `Usage`): each request's settle, a give-back to where it was charged, on top;
//! - a setup per kind of policy, `<kind>-memory` and `<kind>-redis`, each beside the plain
//!   `memory` and `redis` (one fixed-window rule): `sl`, `sc` and `tb`, the other algorithms
//!   alone; `quota` (the plain rule and a daily quota), `block` (and `block_for`), `delay` (a
//!   token bucket in delay mode: compare it with `tb`), `inflight` (and `max_in_flight`, each
//!   request's lease released when its body ends), `count-only` (every success gives its unit
//!   back), `refund` (the handle's check, then `Admitted::refund`).
//!
//! Work a request starts after its response (a settle, a give-back, a lease's release) counts as
//! its cost: a run ends when the Redis store's last call has landed, and only then is the CPU
//! read.
//!
//! `redis` minus `memory` is what a Redis check costs the app beyond a memory check: packing the
//! check, queueing it, the connection's work shared by a batch, reading the decision, the wake-ups.
//!
//! The bench starts a private `redis-server` (no persistence) on a free loopback port, so its CPU
//! can be read; with `REDIS_URL` set it uses that Redis instead and prints no Redis CPU.
//!
//! ```text
//! cargo bench --bench check_cost                 # 3 rounds of 3 s, 64 and 1 concurrent
//! cargo bench --bench check_cost -- 5 5          # 5 rounds of 5 s
//! cargo bench --bench check_cost -- 1 20 redis-c64   # the setups whose name has `redis-c64`
//! cargo bench --bench check_cost -- 5 3 'bare-c64|=memory-c64'   # either (`=`: exactly)
//! cargo bench --bench check_cost -- 3 4 'redis-c256'   # 256 tasks, only when named
//! ```
//!
//! Timings on two shared cores move by tens of percent from minute to minute; instructions don't.
//! `instructions N SETUP` sends N requests of one setup one after another on one thread and
//! prints nothing else, to be counted under callgrind: the difference of two counts (N = 2 000
//! and 12 000, say) over 10 000 is the instructions of one request, setup and warm-up cancelled.
//! A Redis setup needs `REDIS_URL` there; its checks then go one at a time, each alone in its call.
//! With `CHECK_COST_SUBSCRIBER` set, a `tracing` subscriber at `info` is installed first, as a
//! service (the demo) has one: without one, axum's default `tower-log` feature sends every span
//! operation through `log`'s checks.
//!
//! ```text
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/deps/check_cost-* \
//!     instructions 2000 memory-flood 2>&1 | grep refs
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tower::ServiceExt;
use tower_redis_ratelimit::meter::{Meter, Usage};
use tower_redis_ratelimit::quota::Quota;
use tower_redis_ratelimit::{
    Admitted, Algorithm, MemoryStore, Mode, Policy, RateLimitLayer, RateLimiter, RedisStore,
    Refused, Rule,
};

#[path = "support/app.rs"]
mod app;
#[path = "support/redis_server.rs"]
mod redis_server;

use app::{request, router};
use redis_server::Server;

/// A limit no run comes near.
const HUGE: u64 = 1_000_000_000;

/// The setups, in the order of the first round.
const SETUPS: [&str; 32] = [
    "bare",
    "governor",
    "governor-headers",
    "memory",
    "governor-flood",
    "memory-flood",
    "handle-memory",
    "redis",
    "handle-redis",
    "redis-prefetch",
    "metered-memory",
    "metered-redis",
    "settled-memory",
    "settled-redis",
    "sl-memory",
    "sl-redis",
    "sc-memory",
    "sc-redis",
    "tb-memory",
    "tb-redis",
    "quota-memory",
    "quota-redis",
    "block-memory",
    "block-redis",
    "delay-memory",
    "delay-redis",
    "inflight-memory",
    "inflight-redis",
    "count-only-memory",
    "count-only-redis",
    "refund-memory",
    "refund-redis",
];

/// The policy of a kind's setups (`<kind>-memory`, `<kind>-redis`): one rule no run reaches, and
/// the kind's option, each at a size no run reaches either.
fn kind_policy(kind: &str, prefix: &str) -> Policy {
    // A token bucket refills at most a unit a microsecond: its huge limit is per hour.
    let period = if matches!(kind, "tb" | "delay") {
        Duration::from_secs(3600)
    } else {
        Duration::from_secs(1)
    };
    let builder = Policy::builder(format!("cost-{kind}"))
        .prefix(prefix)
        .rule(Rule::new(HUGE, period));
    let builder = match kind {
        "sl" => builder.algorithm(Algorithm::SlidingLog),
        "sc" => builder.algorithm(Algorithm::SlidingCounter),
        "tb" => builder.algorithm(Algorithm::TokenBucket),
        "quota" => {
            let quota = Quota::builder("cost-daily")
                .prefix(prefix)
                .tier("all", HUGE)
                .build()
                .expect("a valid quota");
            builder.algorithm(Algorithm::FixedWindow).quota(quota)
        }
        "block" => builder
            .algorithm(Algorithm::FixedWindow)
            .block_for(Duration::from_secs(900)),
        "delay" => builder.algorithm(Algorithm::TokenBucket).mode(Mode::Delay {
            max_delay: Duration::from_secs(2),
        }),
        "inflight" => builder
            .algorithm(Algorithm::FixedWindow)
            .max_in_flight(HUGE)
            .lease(Duration::from_secs(60)),
        "count-only" => builder
            .algorithm(Algorithm::FixedWindow)
            .count_only(|status| status != StatusCode::OK),
        // The handle's check and refund (`refund`).
        _ => builder.algorithm(Algorithm::FixedWindow),
    };
    builder.build().expect("a valid policy")
}

/// The router of the refund setups: the handler checks the client, then gives the admission
/// back by its receipt.
fn refunding(limiter: RateLimiter) -> Router {
    async fn hello(State(limiter): State<RateLimiter>) -> Result<&'static str, Refused> {
        let admitted = limiter.check("203.0.113.7").await?;
        admitted.refund().await.expect("a refund");
        Ok("hello")
    }
    Router::new().route("/", get(hello)).with_state(limiter)
}

/// The router of a kind's setup (see [`kind_policy`]) on `store`.
fn kind_app<S: tower_redis_ratelimit::Store + Clone>(kind: &str, prefix: &str, store: S) -> Router {
    let policy = kind_policy(kind, prefix);
    if kind == "refund" {
        return refunding(RateLimiter::new(policy, store));
    }
    router().layer(RateLimitLayer::new(policy, store))
}

/// The metered setups' policy: its one rule metered, 500 reserved per request.
fn metered_policy(prefix: &str) -> Policy {
    Policy::builder("cost-metered")
        .prefix(prefix)
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::new(HUGE, Duration::from_secs(1)).metered())
        .meter(Meter::new("tokens").estimate(|_| 500))
        .build()
        .expect("a valid policy")
}

/// The router of the settled setups: the handler records 120 of its 500.
fn settling() -> Router {
    Router::new().route(
        "/",
        get(|usage: Usage| async move {
            usage.record(120);
            "hello"
        }),
    )
}

/// The router of the handle setups: the handler checks the client itself.
fn handled(limiter: RateLimiter) -> Router {
    async fn hello(
        State(limiter): State<RateLimiter>,
    ) -> Result<(Admitted, &'static str), Refused> {
        Ok((limiter.check("203.0.113.7").await?, "hello"))
    }
    Router::new().route("/", get(hello)).with_state(limiter)
}

/// The app of `setup` as `axum::serve` runs it: its routes made once (`with_state`, as a
/// served router's are for each connection), not again for each request, which a router called
/// directly does and a served one never pays.
fn app(setup: &str, redis_url: &str, prefix: &str) -> (Router, Option<RedisStore>) {
    let (routes, store) = routes(setup, redis_url, prefix);
    (routes.with_state(()), store)
}

/// The router of `setup`, and its Redis store if it has one.
fn routes(setup: &str, redis_url: &str, prefix: &str) -> (Router, Option<RedisStore>) {
    let policy = || {
        Policy::builder("cost")
            .prefix(prefix)
            .algorithm(Algorithm::FixedWindow)
            .rule(Rule::new(HUGE, Duration::from_secs(1)))
            .build()
            .expect("a valid policy")
    };
    match setup {
        "bare" => (router(), None),
        "governor" | "governor-headers" => {
            // tower_governor, the in-process peer: the same huge limit, keyed by the peer's IP.
            let mut config = tower_governor::governor::GovernorConfigBuilder::default();
            config.period(Duration::from_nanos(1)).burst_size(u32::MAX);
            let router = if setup == "governor-headers" {
                let config = config.use_headers().finish();
                router().layer(tower_governor::GovernorLayer::new(
                    config.expect("a valid governor config"),
                ))
            } else {
                let config = config.finish().expect("a valid governor config");
                router().layer(tower_governor::GovernorLayer::new(config))
            };
            (router, None)
        }
        "memory" => (
            router().layer(RateLimitLayer::new(policy(), MemoryStore::new())),
            None,
        ),
        "governor-flood" => {
            let mut config = tower_governor::governor::GovernorConfigBuilder::default();
            config.period(Duration::from_secs(3600)).burst_size(1);
            let config = config.use_headers().finish();
            let config = config.expect("a valid governor config");
            (
                router().layer(tower_governor::GovernorLayer::new(config)),
                None,
            )
        }
        "memory-flood" => {
            let policy = Policy::builder("cost-flood")
                .prefix(prefix)
                .algorithm(Algorithm::FixedWindow)
                .rule(Rule::new(1, Duration::from_secs(3600)))
                .build()
                .expect("a valid policy");
            (
                router().layer(RateLimitLayer::new(policy, MemoryStore::new())),
                None,
            )
        }
        "handle-memory" => (
            handled(RateLimiter::new(policy(), MemoryStore::new())),
            None,
        ),
        "redis" => {
            let store = RedisStore::from_url(redis_url).expect("a Redis URL");
            let app = router().layer(RateLimitLayer::new(policy(), store.clone()));
            (app, Some(store))
        }
        "redis-prefetch" => {
            let store = RedisStore::from_url(redis_url).expect("a Redis URL");
            let policy = Policy::builder("cost-prefetch")
                .prefix(prefix)
                .algorithm(Algorithm::FixedWindow)
                .rule(Rule::new(HUGE, Duration::from_secs(1)))
                .prefetch(100)
                .build()
                .expect("a valid policy");
            let app = router().layer(RateLimitLayer::new(policy, store.clone()));
            (app, Some(store))
        }
        "metered-memory" | "settled-memory" => {
            let router = if setup == "metered-memory" {
                router()
            } else {
                settling()
            };
            let layer = RateLimitLayer::new(metered_policy(prefix), MemoryStore::new());
            (router.layer(layer), None)
        }
        "metered-redis" | "settled-redis" => {
            let store = RedisStore::from_url(redis_url).expect("a Redis URL");
            let router = if setup == "metered-redis" {
                router()
            } else {
                settling()
            };
            let layer = RateLimitLayer::new(metered_policy(prefix), store.clone());
            (router.layer(layer), Some(store))
        }
        "handle-redis" => {
            let store = RedisStore::from_url(redis_url).expect("a Redis URL");
            (
                handled(RateLimiter::new(policy(), store.clone())),
                Some(store),
            )
        }
        other => match other.rsplit_once('-') {
            Some((kind, "memory")) => (kind_app(kind, prefix, MemoryStore::new()), None),
            Some((kind, "redis")) => {
                let store = RedisStore::from_url(redis_url).expect("a Redis URL");
                (kind_app(kind, prefix, store.clone()), Some(store))
            }
            _ => unreachable!("no setup {other}"),
        },
    }
}

/// User + system CPU time of process `pid` so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat");
    // Fields after "pid (comm) ": utime and stime are the 12th and 13th, in clock ticks.
    let fields: Vec<&str> = stat
        .rsplit_once(") ")
        .expect("a stat line")
        .1
        .split(' ')
        .collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    // Linux reports these in USER_HZ, 100 per second on every architecture it runs on.
    Duration::from_millis(ticks * 10)
}

/// One run's figures.
struct Run {
    /// Requests sent, the warm-up's included.
    requests: f64,
    per_second: f64,
    app_us: f64,
    redis_us: Option<f64>,
}

/// Waits until the last call of `store` has landed: until its count of checks stops moving.
fn landed(store: Option<&RedisStore>) {
    let Some(store) = store else { return };
    let mut last = store.batch_stats().checks;
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let now = store.batch_stats().checks;
        if now == last {
            return;
        }
        last = now;
    }
}

/// Loads `app` from `concurrency` tasks for `seconds`; under a `flood`, every request after the
/// first is refused. The run ends when the last call of `store` has landed.
fn run(
    app: &Router,
    concurrency: usize,
    seconds: u64,
    (redis_pid, store): (Option<u32>, Option<&RedisStore>),
    flood: bool,
) -> Run {
    let expected = if flood {
        StatusCode::TOO_MANY_REQUESTS
    } else {
        StatusCode::OK
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    // Warm up: the connection, the library, the caches.
    runtime.block_on(async {
        for _ in 0..100 {
            let response = app
                .clone()
                .oneshot(request())
                .await
                .unwrap_or_else(|never| match never {});
            let admitted_first = flood && response.status() == StatusCode::OK;
            assert!(admitted_first || response.status() == expected);
        }
    });
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let me = std::process::id();
    let (app_before, redis_before) = (cpu_time(me), redis_pid.map(cpu_time));
    let started = Instant::now();
    runtime.block_on(async {
        let tasks: Vec<_> = (0..concurrency)
            .map(|_| {
                let (app, done, stop) = (app.clone(), done.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let response = app
                            .clone()
                            .oneshot(request())
                            .await
                            .unwrap_or_else(|never| match never {});
                        assert_eq!(response.status(), expected, "{:?}", response.headers());
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        // Not a tokio timer: a memory-store request never yields, so busy workers would never
        // turn the timer wheel.
        let wait = move || std::thread::sleep(Duration::from_secs(seconds));
        tokio::task::spawn_blocking(wait)
            .await
            .expect("the run's timer");
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            task.await.expect("a load task");
        }
    });
    landed(store);
    let elapsed = started.elapsed();
    let (app_after, redis_after) = (cpu_time(me), redis_pid.map(cpu_time));
    let requests = done.load(Ordering::Relaxed) as f64;
    let per_request =
        |before: Duration, after: Duration| (after - before).as_secs_f64() * 1e6 / requests;
    Run {
        requests: requests + 100.0,
        per_second: requests / elapsed.as_secs_f64(),
        app_us: per_request(app_before, app_after),
        redis_us: redis_before
            .zip(redis_after)
            .map(|(before, after)| per_request(before, after)),
    }
}

/// `count` requests of `setup`, one after another on one thread (see the module docs); a Redis
/// setup needs `REDIS_URL`.
fn one_after_another(setup: &str, count: u64) {
    if std::env::var_os("CHECK_COST_SUBSCRIBER").is_some() {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_writer(std::io::sink)
            .init();
    }
    let flood = setup.ends_with("-flood");
    // A Redis setup counts against the Redis at `REDIS_URL` (its calls go one at a time, alone,
    // not in batches).
    let redis_url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://in-process-setups-only".into());
    let (app, _) = app(setup, &redis_url, "instructions");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        for sent in 0..count {
            let response = app
                .clone()
                .oneshot(request())
                .await
                .unwrap_or_else(|never| match never {});
            let admitted = response.status() == StatusCode::OK;
            assert!(admitted != (flood && sent > 0), "{:?}", response.status());
        }
    });
}

/// Waits up to 5 s for the Redis at `url` to answer.
fn wait_for(url: &str) {
    let client = redis::Client::open(url).expect("a Redis URL");
    for _ in 0..100 {
        if client.get_connection().is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no Redis answers at {url}");
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; the numbers are rounds and seconds.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| arg != "--bench")
        .collect();
    if let [mode, count, setup] = args.as_slice()
        && mode == "instructions"
    {
        let count = count.parse().expect("instructions N SETUP: N requests");
        return one_after_another(setup, count);
    }
    let numbers: Vec<u64> = args.iter().filter_map(|arg| arg.parse().ok()).collect();
    // A word that is not a number picks the setups whose name contains it (or one of its
    // `|`-separated parts: `bare-c64|memory-c64`; `=memory-c64` is that name alone).
    let only = args
        .iter()
        .find(|arg| arg.parse::<u64>().is_err())
        .cloned()
        .unwrap_or_default();
    let rounds = numbers.first().copied().unwrap_or(3);
    let seconds = numbers.get(1).copied().unwrap_or(3);
    let server = Server::shared()
        .or_else(Server::private)
        .expect("redis-server on the PATH (apt-get install redis-server), or REDIS_URL");
    let (redis_url, redis_pid) = (server.url.clone(), server.pid());
    wait_for(&redis_url);
    if !server.is_private() {
        println!("Redis at REDIS_URL, shared: its CPU time is not measured");
    }
    let prefix = format!("check-cost-{}", std::process::id());
    // 256 tasks saturate these cores, where 64 leave them partly idle: run only when named.
    let saturated = only.contains("c256").then_some(256);
    let cases: Vec<(&str, usize)> = [Some(64), saturated, Some(1)]
        .into_iter()
        .flatten()
        .flat_map(|concurrency| SETUPS.map(|setup| (setup, concurrency)))
        .filter(|(setup, concurrency)| {
            let name = format!("{setup}-c{concurrency}");
            only.split('|').any(|part| match part.strip_prefix('=') {
                Some(exact) => name == exact,
                None => name.contains(part),
            })
        })
        .collect();
    let mut results: Vec<Vec<Run>> = cases.iter().map(|_| Vec::new()).collect();
    println!(
        "{:<6} {:<12} {:>10} {:>12} {:>14}",
        "round", "setup", "req/s", "app µs/req", "redis µs/req"
    );
    for round in 0..rounds as usize {
        // Rotated each round, so no setup always runs first or last.
        for i in 0..cases.len() {
            let at = (i + round) % cases.len();
            let (setup, concurrency) = cases[at];
            let (app, store) = app(setup, &redis_url, &prefix);
            let measured = run(
                &app,
                concurrency,
                seconds,
                (
                    redis_pid.filter(|_| setup.contains("redis")),
                    store.as_ref(),
                ),
                setup.ends_with("-flood"),
            );
            let redis = measured
                .redis_us
                .map_or("-".to_owned(), |us| format!("{us:.2}"));
            println!(
                "{:<6} {:<12} {:>10.0} {:>12.2} {:>14}",
                round + 1,
                format!("{setup}-c{concurrency}"),
                measured.per_second,
                measured.app_us,
                redis
            );
            if let Some(store) = store {
                let stats = store.batch_stats();
                println!(
                    "       ({:.1} checks per script call, {:.4} script calls per request)",
                    stats.checks as f64 / stats.script_calls.max(1) as f64,
                    stats.script_calls as f64 / measured.requests
                );
            }
            results[at].push(measured);
        }
    }
    println!("\nmedians of {rounds} rounds of {seconds} s:");
    println!(
        "{:<12} {:>10} {:>12} {:>14}",
        "setup", "req/s", "app µs/req", "redis µs/req"
    );
    for ((setup, concurrency), runs) in cases.iter().zip(&results) {
        let redis: Vec<f64> = runs.iter().filter_map(|run| run.redis_us).collect();
        println!(
            "{:<12} {:>10.0} {:>12.2} {:>14}",
            format!("{setup}-c{concurrency}"),
            median(runs.iter().map(|run| run.per_second).collect()),
            median(runs.iter().map(|run| run.app_us).collect()),
            if redis.is_empty() {
                "-".to_owned()
            } else {
                format!("{:.2}", median(redis))
            }
        );
    }
}
