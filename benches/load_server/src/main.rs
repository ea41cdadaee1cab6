//! The servers that `benches/load_peers.sh` loads, one binary so that every setup serves the same
//! axum app (`GET /api/ping` answering `PONG`, `GET /healthz` unlimited) on the same runtime:
//!
//! - `bare`: no limiter, the baseline;
//! - `governor`: `tower_governor` 0.8 (in memory, GCRA), keyed by peer IP;
//! - `naive`: a naive Redis middleware, one `EVALSHA` of an INCR + PEXPIRE script per request on a
//!   shared redis-rs `ConnectionManager`, keyed by peer IP;
//! - `trl-redis`: `tower-rate-limit-redis` 1.0.2, GCRA in one `EVALSHA` (with `TIME`) per request
//!   on a redis-rs 0.32 `MultiplexedConnection`, with the 300 ms timeout of its example;
//! - `trl-fred`: `tower-rate-limit-fred` 2.1.1, the same script through a Fred 10 pool of 4
//!   connections, with the 300 ms command timeout its example advises;
//! - `memory`, `redis`: this crate's `RateLimitLayer` on its memory or Redis store, keyed by client
//!   IP, fixed window, one rule;
//! - `redis-prefetch`: `redis` with `prefetch(100)`: the hot key's units taken ahead;
//! - `static-429`: no limiter, every request answered with the 429 this crate answers a flood
//!   with (its status, headers and problem body, taken from the layer once at start): what sending that answer costs over
//!   `PONG`, the floor of any limiter that answers a flood with it.
//!
//! ```text
//! load_server <bare|governor|naive|trl-redis|trl-fred|memory|redis|redis-prefetch|static-429> <listen address> [--redis URL] [--refuse] [--by-user]
//! ```
//!
//! In the `redis` modes, `GET /batch_stats` (unlimited) tells how many checks went out in how many
//! script calls (the store's group commit).
//!
//! With `--by-user`, every setup keys by the `x-user-id` header instead (the many-identities
//! scenario: `benches/many_users.lua` sends one of 10 000 at random).
//!
//! Limits are far above what a run reaches (every request admitted), or, with `--refuse`, one
//! request per hour (a rejection flood: all but the first refused). Logs go to stderr at `info`,
//! as a service would have them.
//!
//! The two `trl-*` peers hold at most a `u16` capacity per key, so one hot key (every request from
//! 127.0.0.1) would be refused within a second. They are keyed per connection instead, by the
//! peer's socket address with its port ([`PerConnection`]), with a capacity of 65 535 and one
//! request per millisecond (their shortest emission interval) after it, and a fresh key every
//! [`TRL_ROTATE`] requests of the server, so that a long run on one connection stays admitted;
//! with `--refuse`, a capacity of 1 and one request per hour (and no fresh keys), so all but the
//! first request of each connection are refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use fred::interfaces::ClientLike;
use redis::aio::ConnectionManager;
use tower::ServiceExt;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_redis_ratelimit::store::RedisStore;
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, OnStoreError, Policy, RateLimitLayer, Rule,
};

/// Admitted requests: a limit no run reaches.
const HUGE: u64 = 1_000_000_000;

/// The `trl-*` peers' capacity when every request is to be admitted: the largest their `u16` takes.
const TRL_CAPACITY: u16 = u16::MAX;

/// A `trl-*` key is renewed after this many requests of the whole server, so that no key ever sees
/// more than its capacity, however long a run on one connection (at one request per millisecond,
/// the peers' fastest refill, a busy connection would otherwise exhaust 65 535 in a few seconds).
const TRL_ROTATE: u64 = 60_000;

/// The naive middleware's whole script: count, set the window on the first count, compare.
const NAIVE_SCRIPT: &str = r"
local count = redis.call('INCR', KEYS[1])
if count == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if count > tonumber(ARGV[1]) then return 0 end
return 1
";

/// The 429 this crate's layer answers a flood with on the memory store (the `memory` mode's
/// policy under `--refuse`), taken from the layer itself once, then kept as static bytes: each
/// answer copies it without formatting or writing a shared count.
async fn flood_answer() -> (&'static [(HeaderName, HeaderValue)], &'static [u8]) {
    let policy = ping_policy(1, Duration::from_secs(3600), false, false);
    let app = Router::new()
        .route("/api/ping", get(|| async { "PONG" }))
        .layer(RateLimitLayer::new(policy, MemoryStore::new()));
    let request = || {
        let mut request = Request::get("/api/ping")
            .body(Body::empty())
            .expect("a request");
        let peer = SocketAddr::from(([127, 0, 0, 1], 1));
        request.extensions_mut().insert(ConnectInfo(peer));
        request
    };
    let mut answers = Vec::new();
    for _ in 0..2 {
        let answer = app.clone().oneshot(request()).await;
        answers.push(answer.unwrap_or_else(|never| match never {}));
    }
    let refused = answers.pop().expect("the second answer");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let (parts, body) = refused.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .expect("the body");
    let kept = |bytes: &[u8]| -> &'static [u8] { Box::leak(bytes.to_vec().into_boxed_slice()) };
    let headers: Vec<(HeaderName, HeaderValue)> = parts
        .headers
        .iter()
        .map(|(name, value)| {
            let value = HeaderValue::from_maybe_shared(Bytes::from_static(kept(value.as_bytes())));
            (name.clone(), value.expect("a header value"))
        })
        .collect();
    (Box::leak(headers.into_boxed_slice()), kept(&body))
}

/// `answer` (headers and body), as a 429.
fn static_429((headers, body): (&[(HeaderName, HeaderValue)], &'static [u8])) -> Response {
    let mut response = Response::new(Body::from(Bytes::from_static(body)));
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    for (name, value) in headers {
        response.headers_mut().append(name.clone(), value.clone());
    }
    response
}

/// The policy of the `memory` and `redis` modes: fixed window, one rule of `limit` per `period`,
/// keyed by client IP (or by `x-user-id`, `by_user`); `prefetch` takes 100 ahead.
fn ping_policy(limit: u64, period: Duration, by_user: bool, prefetch: bool) -> Policy {
    let key = if by_user {
        Key::header(HeaderName::from_static(USER_HEADER))
    } else {
        Key::ip()
    };
    let mut policy = Policy::builder("ping")
        .prefix("load")
        .key(key)
        .algorithm(Algorithm::FixedWindow)
        .rule(Rule::new(limit, period))
        .on_store_error(OnStoreError::Deny);
    if prefetch {
        policy = policy.prefetch(100);
    }
    policy.build().expect("a valid policy")
}

#[derive(Clone)]
struct Naive {
    connection: ConnectionManager,
    script: redis::Script,
    limit: u64,
    window_ms: u64,
    by_user: bool,
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: load_server <bare|governor|governor-headers|naive|trl-redis|trl-fred|\
                 memory|redis|redis-prefetch|static-429> <listen> [--redis URL] [--refuse] [--by-user]";
    let (Some(mode), Some(listen)) = (args.get(1), args.get(2)) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let refuse = args.iter().any(|arg| arg == "--refuse");
    let by_user = args.iter().any(|arg| arg == "--by-user");
    let redis_url = args
        .iter()
        .position(|arg| arg == "--redis")
        .and_then(|at| args.get(at + 1))
        .map_or("redis://127.0.0.1:6379/0", String::as_str);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();

    let (limit, period) = if refuse {
        (1, Duration::from_secs(3600))
    } else {
        (HUGE, Duration::from_secs(1))
    };
    let ping = Router::new().route("/api/ping", get(|| async { "PONG" }));
    let ping = match mode.as_str() {
        "bare" => ping,
        "static-429" => {
            let answer = flood_answer().await;
            Router::new().route("/api/ping", get(move || async move { static_429(answer) }))
        }
        "governor-headers" => {
            // With its x-ratelimit-* headers, as this crate sends its own: like for like.
            let mut config = GovernorConfigBuilder::default();
            config
                .period(period / u32::try_from(limit.min(u64::from(u32::MAX))).unwrap())
                .burst_size(u32::try_from(limit).unwrap_or(u32::MAX));
            let mut config = config.use_headers();
            if by_user {
                let config = config.key_extractor(UserHeader).finish();
                ping.layer(GovernorLayer::new(config.expect("a valid governor config")))
            } else {
                let config = config.finish().expect("a valid governor config");
                ping.layer(GovernorLayer::new(config))
            }
        }
        "governor" => {
            let mut config = GovernorConfigBuilder::default();
            config
                .period(period / u32::try_from(limit.min(u64::from(u32::MAX))).unwrap())
                .burst_size(u32::try_from(limit).unwrap_or(u32::MAX));
            if by_user {
                let config = config.key_extractor(UserHeader).finish();
                ping.layer(GovernorLayer::new(config.expect("a valid governor config")))
            } else {
                let config = config.finish().expect("a valid governor config");
                ping.layer(GovernorLayer::new(config))
            }
        }
        "naive" => {
            let client = redis::Client::open(redis_url).expect("a Redis URL");
            let connection = ConnectionManager::new(client)
                .await
                .expect("a connection to Redis");
            let naive = Naive {
                connection,
                script: redis::Script::new(NAIVE_SCRIPT),
                limit,
                window_ms: u64::try_from(period.as_millis()).unwrap(),
                by_user,
            };
            ping.layer(middleware::from_fn_with_state(naive, naive_limit))
        }
        "trl-redis" | "trl-fred" => {
            let (capacity, emission_interval, rotate_every) = if refuse {
                (1, Duration::from_secs(3600), u64::MAX)
            } else {
                (TRL_CAPACITY, Duration::from_millis(1), TRL_ROTATE)
            };
            let keys = PerConnection {
                requests: Arc::new(AtomicU64::new(0)),
                rotate_every,
                by_user,
            };
            if mode == "trl-redis" {
                let connection = redis032::Client::open(redis_url)
                    .expect("a Redis URL")
                    .get_multiplexed_async_connection()
                    .await
                    .expect("a connection to Redis");
                ping.layer(
                    tower_rate_limit_redis::RateLimitLayer::builder()
                        .conn(connection)
                        .key_resolver(keys)
                        .capacity(capacity)
                        .emission_interval(emission_interval)
                        .timeout(Duration::from_millis(300))
                        .build(),
                )
            } else {
                let mut builder = fred::types::Builder::from_config(
                    fred::types::config::Config::from_url(redis_url).expect("a Redis URL"),
                );
                builder.with_performance_config(|config| {
                    config.default_command_timeout = Duration::from_millis(300);
                });
                let pool = builder.build_pool(4).expect("a Fred pool");
                pool.init().await.expect("a connection to Redis");
                ping.layer(
                    tower_rate_limit_fred::RateLimitLayer::builder()
                        .conn(pool)
                        .key_resolver(keys)
                        .capacity(capacity)
                        .emission_interval(emission_interval)
                        .build(),
                )
            }
        }
        "memory" | "redis" | "redis-prefetch" => {
            let policy = ping_policy(limit, period, by_user, mode == "redis-prefetch");
            if mode == "memory" {
                ping.layer(RateLimitLayer::new(policy, MemoryStore::new()))
            } else {
                let store = RedisStore::from_url(redis_url).expect("a Redis URL");
                let stats = store.clone();
                ping.layer(RateLimitLayer::new(policy, store)).route(
                    "/batch_stats",
                    get(move || {
                        let stats = stats.batch_stats();
                        async move {
                            format!(
                                "{} checks in {} script calls, largest batch {}\n",
                                stats.checks, stats.script_calls, stats.largest_batch
                            )
                        }
                    }),
                )
            }
        }
        other => {
            eprintln!("unknown mode {other:?}; {usage}");
            std::process::exit(2);
        }
    };
    let app = ping.route("/healthz", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(listen.as_str())
        .await
        .expect("the listen address");
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .expect("the server");
}

/// The naive middleware: one script call per request, 429 over the limit, 503 on a Redis error.
async fn naive_limit(
    State(mut naive): State<Naive>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    let key = match user(&request) {
        Some(user) if naive.by_user => format!("naive:{user}"),
        _ => format!("naive:{}", peer.ip()),
    };
    let admitted: Result<i64, _> = naive
        .script
        .key(key)
        .arg(naive.limit)
        .arg(naive.window_ms)
        .invoke_async(&mut naive.connection)
        .await;
    match admitted {
        Ok(1) => next.run(request).await,
        Ok(_) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// The `trl-*` peers' key: the connection's peer address with its port, and which run of
/// [`TRL_ROTATE`] requests of the server this one is in (with `--refuse`, always the first).
#[derive(Clone)]
struct PerConnection {
    requests: Arc<AtomicU64>,
    rotate_every: u64,
    /// Keyed by `x-user-id` instead of the connection (`--by-user`).
    by_user: bool,
}

impl PerConnection {
    /// The key, or none if the server was not started with `ConnectInfo` (the peers answer 500).
    fn key<T>(&self, request: &Request<T>) -> Option<String> {
        if self.by_user {
            let run = self.requests.fetch_add(1, Ordering::Relaxed) / self.rotate_every;
            return user(request).map(|user| format!("trl:{user}:{run}"));
        }
        let ConnectInfo(peer) = request.extensions().get::<ConnectInfo<SocketAddr>>()?;
        let run = self.requests.fetch_add(1, Ordering::Relaxed) / self.rotate_every;
        Some(format!("trl:{peer}:{run}"))
    }
}

impl tower_rate_limit_redis::KeyResolver for PerConnection {
    type Key = String;
    type ErrorBody = Body;

    fn key<T>(&self, request: &Request<T>) -> Result<String, Response> {
        PerConnection::key(self, request).ok_or_else(no_peer)
    }
}

impl tower_rate_limit_fred::KeyResolver for PerConnection {
    type ErrorBody = Body;

    fn key<T>(&self, request: &Request<T>) -> Result<Option<tower_rate_limit_fred::Key>, Response> {
        PerConnection::key(self, request)
            .map(|key| Some(key.into()))
            .ok_or_else(no_peer)
    }
}

/// The answer of a `trl-*` peer to a request without a peer address.
fn no_peer() -> Response {
    StatusCode::INTERNAL_SERVER_ERROR.into_response()
}

/// The header that carries the identity with `--by-user`.
const USER_HEADER: &str = "x-user-id";

/// The request's `x-user-id`, if it has one.
fn user<T>(request: &Request<T>) -> Option<&str> {
    request.headers().get(USER_HEADER)?.to_str().ok()
}

/// `tower_governor`'s key with `--by-user`: the `x-user-id` header.
#[derive(Clone)]
struct UserHeader;

impl tower_governor::key_extractor::KeyExtractor for UserHeader {
    type Key = String;

    fn extract<T>(&self, request: &Request<T>) -> Result<String, tower_governor::GovernorError> {
        user(request)
            .map(str::to_owned)
            .ok_or(tower_governor::GovernorError::UnableToExtractKey)
    }
}
