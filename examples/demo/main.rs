//! A runnable rate-limited server, configured from a small TOML file.
//!
//! ```text
//! cargo run --all-features --example demo                              # the built-in config: examples/demo.toml
//! cargo run --all-features --example demo -- --config path/to/my.toml  # your own
//! RUST_LOG=debug cargo run --all-features --example demo               # more logging (default: info)
//! ```
//!
//! (The demo needs the crate features `config`, `cluster`, `sentinel`, `tls`, `webhook`,
//! `metrics` and `grpc`; `--all-features` turns them on.)
//!
//! With no arguments the demo listens on `127.0.0.1:3000`, counts in the in-memory store and limits
//! `GET`/`POST /api/ping` to 20 requests a minute and 100 an hour per client IP. It prints a `curl`
//! loop to try: requests 1 to 20 get `200 PONG`, the next ones `429 Too Many Requests` with
//! `Retry-After` and the `RateLimit` headers, and each refusal is logged. `GET /healthz` is never
//! limited. The same port serves the standard gRPC health service (`grpc.health.v1.Health`, h2c,
//! SERVING), unlimited unless a route lists `/grpc.health.v1.Health/Check` in its `paths`, which
//! then shares that route's budget with its HTTP path. Ctrl-C stops the server gracefully. `--no-limiter` serves the same routes without any
//! limiter (the baseline of a load run).
//!
//! # The config file
//!
//! `examples/demo.toml` is both the documentation of the format and the built-in default (it is
//! embedded with `include_str!`, so the two can't drift). The format is the crate's own
//! ([`RateLimitConfig`], feature `config`), which the demo loads and applies: every field with an
//! obvious default may be left out, so the smallest file is one route with its rules
//! (`[[routes]]`, `path = "/api/ping"`, `rules = [{ limit = 10, period = "1m" }]`). Unknown fields
//! are errors, so a typo can't silently disable a limit.
//!
//! Two top-level fields are the demo's own:
//! - `listen` (default `"127.0.0.1:3000"`): an IP address and port (no host names).
//! - `metrics` (default: none, and nothing more listens): `"127.0.0.1:9091"` starts the operator
//!   listener there: Prometheus text at `GET /metrics` and the most refused identities of each
//!   route's policy as JSON at `GET /debug/ratelimit/top` (`?n=`, default 10);
//!   `GET /debug/ratelimit/{policy}/{identity}` reads one identity's state without counting and
//!   `DELETE` on it resets its counts and lifts its block (a policy name's slashes as `%2F`:
//!   `/debug/ratelimit/%2Fapi%2Fping/ip:127.0.0.1`). It answers whoever reaches it: bind it to
//!   loopback or a private interface.
//!
//! The crate's fields, and their defaults:
//! - `store` (default `"memory"`): where the counts live. Or Redis, so that several demo instances
//!   share one limit: a `redis://host:port/db` URL (`rediss://` for TLS), a Redis Cluster found
//!   from any of its nodes, `{ cluster = ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"] }`, or
//!   the primary that Redis Sentinel names `master`, `{ sentinel = ["redis://10.0.0.1:26379"],
//!   master = "mymaster" }`. The URLs of a list are all `redis://` or all `rediss://`. Nothing
//!   connects at start: a Redis that is down is a store failure per request.
//! - `tls_ca`, `tls_insecure` (default: none, and only with `rediss://` URLs): the path of a PEM
//!   file of CA certificates to trust instead of the system's roots; `true` to check no
//!   certificate at all (tests and private networks only).
//! - `wait_for_replicas` (default `0`, off; only with a Redis store): an admission counts only once
//!   that many replicas of its node acknowledged it; see `RedisStore::wait_for_replicas`.
//! - `on_store_error` (default `"allow"`): `"allow"` lets requests through when the store fails,
//!   `"deny"` answers 503.
//! - `store_timeout` (default `"250ms"`): how long a store answer may take.
//! - `prefix` (default `"rl"`; the shipped file sets `"demo"`): the start of every store key; 1 to
//!   64 letters, digits and `-._~@+=!*(),/`.
//! - `trusted_proxies` (default none): CIDRs such as `"10.0.0.0/8"`; a bare address means that one
//!   address.
//! - `forwarded_header` (default: the first present of the three): `"x-forwarded-for"`,
//!   `"forwarded"` or `"x-real-ip"`, the proxy header read from `trusted_proxies`.
//! - `legacy_headers` (default `false`): also send `X-RateLimit-*`.
//! - `routes[].path`, `routes[].paths` (one of them, or both): literal paths (no `{captures}` or
//!   wildcards), which the demo serves and which share the route's policy and counts; `/healthz`
//!   is taken. A gRPC health method (`/grpc.health.v1.Health/Check`) limits the demo's gRPC
//!   health service.
//! - `routes[].rules` (required): `{ limit, period }` pairs that must all pass. A `token_bucket`
//!   rule may add `burst`, the bucket size (default: the limit).
//! - `routes[].key` (default `"ip"`): `ip`, `user`, `global`, `header:<name>` or `query:<name>` (a
//!   query-string parameter, such as a one-time token). To the crate `user` is the
//!   [`UserId`] request extension; the demo puts the `x-user-id` header there, in a middleware
//!   outside the limiter. A request without the key (no `x-user-id`, no such header or parameter)
//!   counts against its client IP.
//! - `routes[].algorithm` (default `"sliding_log"`): `fixed_window`, `sliding_log`,
//!   `sliding_counter` or `token_bucket`.
//! - `routes[].name` (default: the path, or `route-<index>` for a path longer than the 64
//!   characters a policy name may have): the route's policy name, as logs, metrics and the
//!   operator listener show it.
//!
//! Durations are written as people write them, through `humantime`: `"500ms"`, `"10s"`, `"1m"`,
//! `"1h30m"`, `"1d"`, more than zero.
//!
//! Optional per route (all off by default):
//! - `prevent_duplicate`: `true` refuses a second request within 5 s; `{ period = "2s" }` sets the
//!   window (a `limit`, if given, must be 1).
//! - `block_for`: a duration; once a rule refuses a client, it is refused outright that long.
//! - `mode`: `"enforce"` (default), `"shadow"` (log and count would-be refusals, refuse nothing) or
//!   `"delay"` (hold a request until it fits, at most `max_delay`, which it then requires; needs
//!   `sliding_log` or `token_bucket`).
//! - `cost_header`: a header name; a request costs the whole number in it (absent or not a number
//!   of at least 1: 1). The demo trusts it, as an app trusts what its own gateway computed.
//! - `max_in_flight`: at most this many requests of one key in progress at once, across every
//!   instance sharing the store; requires `lease`, the longest a request holds its slot (`"30s"`),
//!   which goes only with it.
//!
//! Besides the configured routes, `GET`/`POST /work?ms=N` answers `200 done` after N milliseconds
//! (at most 10 000; anything else is a 400): a slow endpoint to try `max_in_flight` on. It is
//! limited like any other route when listed in `[[routes]]`, unlimited otherwise.
//!
//! Optional at the top level, a `[quota]` section: a daily quota by tier, named `daily`, on every
//! limited route on top of its rules (one count per user across the routes):
//! - `tiers` (required): a table of tier names and requests per day, `{ free = 100, pro = 5000 }`;
//! - `default_tier`: the tier of requests without a known one (required with several tiers);
//! - `key`: as for routes (default `"user"`, the `x-user-id` header as for routes);
//!   `tier_header`: where the tier is read from (default `"x-tier"`, the demo's stand-in for a
//!   tier lookup);
//! - `alert_at`: thresholds in percent (default `[80, 100]`); `alert_webhook`: an `http://` URL the
//!   alerts are posted to as JSON (default: none, they are only logged);
//! - `utc_offset`: where days start, `"+00:00"` (default), `"+05:30"`, `"-08:00"`.
//!
//! Each route is its own [`Policy`], so it counts apart from other routes; `GET` and `POST` on a
//! route share its budget. One [`RouteLimitsLayer`] limits them all, picking each request's policy
//! by its matched path.
//!
//! A bad file makes the demo exit with status 2 and a message naming the file, the field, and its
//! line and column, such as
//! `my.toml: routes[0].rules[1].limit: must be at least 1 (line 5, column 50)`.
//!
//! With `--config PATH` the limits reload while the demo serves: when the file changes (it is read
//! every second) and on `SIGHUP` (`kill -HUP <pid>`). Routes whose entry did not change keep their
//! limiter, and unchanged rules their counts; a file that fails a check, the crate's or the
//! demo's, changes nothing and is logged naming the field. `listen`, `metrics`, `store` and the
//! paths served change only at the next start.

use std::io::{self, IsTerminal};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use axum::Router;
use axum::extract::{RawQuery, Request};
use axum::routing::get;
use http::StatusCode;
use serde::Deserialize;
use tokio::net::TcpListener;
use tower::BoxError;
use tower_redis_ratelimit::config::RouteConfig;
use tower_redis_ratelimit::config::{
    ConfigError, ConfigFile, ConfigWatcher, RateLimitConfig, RouteLimitsLayer,
};
use tower_redis_ratelimit::{Policy, Rule, UserId};
use tracing_subscriber::EnvFilter;

mod operator;

/// The built-in config, also shipped as `examples/demo.toml`.
const DEFAULT_CONFIG: &str = include_str!("../demo.toml");

/// Where the server listens when the file has no `listen`.
const DEFAULT_LISTEN: &str = "127.0.0.1:3000";

/// Where `key = "user"` reads the user id from. A real app would take it from its authentication
/// layer (a session, a verified token); a plain header keeps the demo testable with curl.
const USER_ID_HEADER: &str = "x-user-id";

/// The unlimited health-check route.
const HEALTHZ: &str = "/healthz";

const USAGE: &str = "\
usage: cargo run --example demo [-- [--config PATH] [--no-limiter]]

Serves a rate-limited sample route. Without --config the built-in examples/demo.toml is used.
--no-limiter serves the same routes without any limiter (the baseline of a load run).
RUST_LOG sets the log filter (default: info).";

#[tokio::main]
async fn main() -> ExitCode {
    let CommandLine {
        source,
        path,
        text,
        no_limiter,
    } = match read_command_line(std::env::args().skip(1)) {
        Ok(Some(command_line)) => command_line,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    // Logging first: building the config's policies may warn (a large sliding log, say).
    init_tracing();
    let mut config = match load_config(&text) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("{source}: {error}");
            return ExitCode::from(2);
        }
    };
    config.no_limiter = no_limiter;
    config.file = path;
    let listener = match TcpListener::bind(config.listen).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!(
                "{source}: listen: cannot listen on {}: {error}",
                config.listen
            );
            return ExitCode::FAILURE;
        }
    };
    if let Ok(addr) = listener.local_addr() {
        print!("{}", banner(&config, addr));
    }
    match run(config, listener).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("server error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
struct CommandLine {
    /// The config's name (for error messages), its path (none for the built-in one) and text.
    source: String,
    path: Option<PathBuf>,
    text: String,
    /// Serve the same routes without any limiter: the baseline of a load run.
    no_limiter: bool,
}

/// Reads the command line: `Ok(None)` for `--help`.
fn read_command_line(args: impl Iterator<Item = String>) -> Result<Option<CommandLine>, String> {
    let mut path = None;
    let mut no_limiter = false;
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--no-limiter" => no_limiter = true,
            "--config" if path.is_none() => path = Some(args.next().ok_or(USAGE)?),
            _ if arg.starts_with("--config=") && path.is_none() => {
                path = Some(arg["--config=".len()..].to_owned());
            }
            _ => return Err(USAGE.to_owned()),
        }
    }
    let (source, text) = match &path {
        None => ("demo.toml (built in)".to_owned(), DEFAULT_CONFIG.to_owned()),
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => (path.clone(), text),
            Err(error) => return Err(format!("{path}: cannot read the config file: {error}")),
        },
    };
    Ok(Some(CommandLine {
        source,
        path: path.map(PathBuf::from),
        text,
        no_limiter,
    }))
}

/// Logs go to stderr, so stdout holds only the banner; colours only on a terminal.
fn init_tracing() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .with_ansi(io::stderr().is_terminal())
        .init();
}

// ---------------------------------------------------------------------------------------------
// The config: the crate's limits, and the demo's own fields.
// ---------------------------------------------------------------------------------------------

/// A config that passed every check, the crate's and the demo's.
#[derive(Debug, Clone)]
struct DemoConfig {
    listen: SocketAddr,
    /// The operator listener's address, if any.
    metrics: Option<SocketAddr>,
    /// The limits: store, routes and their policies.
    limits: RateLimitConfig,
    /// Set by `--no-limiter`, not by the file: serve the routes without any limiter.
    no_limiter: bool,
    /// The file read, reloaded when it changes and on SIGHUP (none for the built-in config).
    file: Option<PathBuf>,
}

/// The top-level fields the demo reads itself (the crate's loader leaves them alone, and serde
/// skips the crate's here).
#[derive(Debug, Deserialize)]
struct DemoFields {
    listen: Option<String>,
    metrics: Option<String>,
}

/// The `[[routes]]` entries of a file the crate has read, as written (to name a field of one).
fn file_routes(text: &str) -> Vec<RouteConfig> {
    toml::from_str::<ConfigFile>(text)
        .map(|file| file.routes)
        .unwrap_or_default()
}

/// Reads and checks a config file: the crate's format, then the demo's own fields and rules. Every
/// error names its field, line and column.
fn load_config(text: &str) -> Result<DemoConfig, ConfigError> {
    let limits = RateLimitConfig::loader()
        .app_fields(["listen", "metrics"])
        .from_toml_str(text)?;
    let fields: DemoFields = toml::from_str(text).map_err(|error| {
        // The crate read the file, so what is wrong is the type of one of the demo's fields.
        let table: toml::Table = text.parse().unwrap_or_default();
        let field = ["listen", "metrics"]
            .into_iter()
            .find(|name| table.get(*name).is_some_and(|value| !value.is_str()))
            .unwrap_or_default();
        ConfigError::new(field, error.message()).locate_in_toml(text)
    })?;
    let error =
        |field: &str, message: String| ConfigError::new(field, message).locate_in_toml(text);
    let listen = fields.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
    let listen = listen.parse().map_err(|_| {
        let message =
            format!("{listen:?} is not an IP address and port such as \"127.0.0.1:3000\"");
        error("listen", message)
    })?;
    let metrics = fields
        .metrics
        .as_deref()
        .map(operator::parse_address)
        .transpose()
        .map_err(|message| error("metrics", message))?;
    // Every path is served (or is the gRPC health service's), so each must be one axum takes.
    for ((index, route), raw) in limits.routes().iter().enumerate().zip(&file_routes(text)) {
        for (at, path) in route.paths().iter().enumerate() {
            let field = match (raw.path.is_some(), at) {
                (true, 0) => format!("routes[{index}].path"),
                (true, at) => format!("routes[{index}].paths[{}]", at - 1),
                (false, at) => format!("routes[{index}].paths[{at}]"),
            };
            check_path(path).map_err(|message| error(&field, message))?;
        }
    }
    Ok(DemoConfig {
        listen,
        metrics,
        limits,
        no_limiter: false,
        file: None,
    })
}

/// The demo serves every configured path, so paths are literal: axum would panic on a malformed
/// `{capture}` or `*wildcard`, and a literal path is all a ping route needs. The allowed
/// characters are those of a policy name minus `*`.
fn check_path(path: &str) -> Result<(), String> {
    let literal = path.starts_with('/')
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~@+=!(),/".contains(&b));
    if !literal {
        return Err(format!(
            "{path:?} must be a literal path: \"/\" then letters, digits and -._~@+=!(),/"
        ));
    }
    if path == HEALTHZ {
        return Err(format!(
            "{path:?} is the demo's health check, which is never limited"
        ));
    }
    Ok(())
}

/// A route's `key` as the banner and the logs show it: `client IP`, `user (x-user-id header)`,
/// `global`, `header x-api-key`, `query parameter token`.
fn key_text(key: &str) -> String {
    match (key, key.split_once(':')) {
        ("ip", _) => "client IP".to_owned(),
        ("user", _) => format!("user ({USER_ID_HEADER} header)"),
        (_, Some(("header", name))) => format!("header {}", name.to_ascii_lowercase()),
        (_, Some(("query", name))) => format!("query parameter {name}"),
        _ => key.to_owned(),
    }
}

// ---------------------------------------------------------------------------------------------
// The server.
// ---------------------------------------------------------------------------------------------

/// The app: every configured path answers `GET` and `POST` with `200 PONG`, `/work` works,
/// `/healthz` answers `200 ok` and the standard gRPC health service (`grpc.health.v1.Health`,
/// SERVING) answers gRPC calls on the same port (h2c), all behind one [`RouteLimitsLayer`] that
/// limits the configured paths (in one store) and nothing else: a route listing
/// `/grpc.health.v1.Health/Check` limits the gRPC health check. Also that layer, for the operator
/// listener; neither with `--no-limiter`.
fn build_app(config: &DemoConfig) -> Result<(Router, Option<RouteLimitsLayer>), BoxError> {
    // The health service as one route of the router, not merged with tonic's `Routes`, whose
    // fallback would answer every unknown HTTP path as a gRPC `UNIMPLEMENTED`.
    let (_reporter, grpc_health) = tonic_health::server::health_reporter();
    let mut app = Router::new()
        .route(HEALTHZ, get(|| async { "ok" }))
        .route(WORK, get(work).post(work))
        .route_service(&format!("{GRPC_HEALTH}/{{*method}}"), grpc_health);
    for route in config.limits.routes() {
        for path in route.paths() {
            if path != WORK && !is_grpc_health(path) {
                app = app.route(path, get(pong).post(pong));
            }
        }
    }
    let limits = match config.no_limiter {
        true => None,
        false => Some(config.limits.route_limits(config.limits.open_store()?)?),
    };
    if let Some(limits) = &limits {
        app = app.route_layer(limits.clone());
    }
    // The outer layer, so the user id is in the request before the limiter reads it.
    let app = app.layer(axum::middleware::map_request(user_id_from_header));
    Ok((app, limits))
}

/// `key = "user"` reads the [`UserId`] request extension; the demo's user id is the `x-user-id`
/// header.
async fn user_id_from_header(mut request: Request) -> Request {
    let id = request
        .headers()
        .get(USER_ID_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(UserId::new);
    if let Some(id) = id {
        request.extensions_mut().insert(id);
    }
    request
}

/// The gRPC health service's path prefix: its methods are `/grpc.health.v1.Health/Check` and
/// `/grpc.health.v1.Health/Watch`.
const GRPC_HEALTH: &str = "/grpc.health.v1.Health";

/// Whether `path` is one of the gRPC health service's methods, which the demo serves as such.
fn is_grpc_health(path: &str) -> bool {
    path.strip_prefix(GRPC_HEALTH)
        .is_some_and(|method| method.starts_with('/'))
}

async fn pong() -> &'static str {
    "PONG"
}

/// The slow endpoint.
const WORK: &str = "/work";

/// The longest `/work` sleeps.
const MAX_WORK_MS: u64 = 10_000;

/// `/work?ms=N`: `200 done` after N ms, N at most 10 000; anything else is a 400.
async fn work(RawQuery(query): RawQuery) -> (StatusCode, &'static str) {
    let mut values = form_urlencoded::parse(query.as_deref().unwrap_or_default().as_bytes())
        .filter(|(name, _)| name == "ms")
        .map(|(_, value)| value.parse::<u64>());
    let ms = match (values.next(), values.next()) {
        (Some(Ok(ms)), None) if ms <= MAX_WORK_MS => ms,
        _ => {
            return (
                StatusCode::BAD_REQUEST,
                "expected /work?ms=N, N from 0 to 10000\n",
            );
        }
    };
    tokio::time::sleep(Duration::from_millis(ms)).await;
    (StatusCode::OK, "done")
}

/// Logs what a Redis store runs on (`RedisStore::probe`), or why it can't be used yet: the demo
/// serves either way, and requests get `on_store_error`'s answer until Redis can be used.
async fn probe_store(limits: &RateLimitConfig) {
    let store = match limits.open_redis_store() {
        Ok(Some(store)) => store,
        Ok(None) => return,
        Err(error) => {
            tracing::error!(%error, "the Redis store can't be opened");
            return;
        }
    };
    match store.probe().await {
        Ok(server) => tracing::info!(%server, "Redis store probed"),
        Err(error) => tracing::error!(
            %error,
            "the Redis store can't be used yet; requests get on_store_error's answer until it can"
        ),
    }
}

/// Serves `config` on `listener` until Ctrl-C, then finishes the requests in flight.
async fn run(config: DemoConfig, listener: TcpListener) -> io::Result<()> {
    let limits = &config.limits;
    for route in limits.routes() {
        tracing::info!(
            path = %route.paths().join(", "),
            policy = route.policy().name(),
            key = %key_text(route.key()),
            algorithm = %route.policy().algorithm(),
            rules = %rules_text(route.policy()),
            "route limited"
        );
    }
    tracing::info!(
        store = %limits.store_spec(),
        store_tls = limits.store_tls().map(tracing::field::display),
        wait_for_replicas = limits.wait_for_replicas(),
        prefix = %limits.prefix(),
        trusted_proxies = ?limits.trusted_proxies(),
        forwarded_header = ?limits.forwarded_header(),
        legacy_headers = limits.legacy_headers(),
        "serving"
    );
    // The recorder goes in before the layers are built and serve their first request.
    let prometheus = match config.metrics {
        Some(_) => Some(operator::install_recorder().map_err(io::Error::other)?),
        None => None,
    };
    if !config.no_limiter {
        probe_store(limits).await;
    }
    let (app, limits) = build_app(&config).map_err(io::Error::other)?;
    if let (Some(layer), Some(file)) = (&limits, &config.file) {
        watch_config(&config, layer, file);
    }
    if let (Some(address), Some(prometheus)) = (config.metrics, prometheus) {
        let listener = TcpListener::bind(address).await.map_err(|error| {
            io::Error::new(
                error.kind(),
                format!("metrics: cannot listen on {address}: {error}"),
            )
        })?;
        tracing::info!(%address, "operator listener: /metrics, /debug/ratelimit/top");
        tokio::spawn(operator::serve(
            listener,
            operator::Operator { prometheus, limits },
        ));
    }
    // The client IP key needs the peer address, which only this kind of make-service provides.
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown_signal())
    .await
}

/// Reloads the limits when `file` changes and on SIGHUP, after the demo's own checks. What only
/// a restart can change (the listen and metrics addresses, the paths served) is logged.
fn watch_config(config: &DemoConfig, layer: &RouteLimitsLayer, file: &Path) {
    let served: Vec<String> = config
        .limits
        .routes()
        .iter()
        .flat_map(|route| route.paths().iter().cloned())
        .collect();
    let (listen, metrics) = (config.listen, config.metrics);
    let loader = RateLimitConfig::loader().app_fields(["listen", "metrics"]);
    ConfigWatcher::new(layer, loader, file)
        .check(move |text, _| {
            let new = load_config(text)?;
            if new.listen != listen || new.metrics != metrics {
                tracing::warn!("listen and metrics change at the next start, not on a reload");
            }
            for path in new.limits.routes().iter().flat_map(|route| route.paths()) {
                if !served.contains(path) && path != WORK && !is_grpc_health(path) {
                    tracing::warn!(
                        path = %path,
                        "a new path is served from the next start: until then it is not limited"
                    );
                }
            }
            Ok(())
        })
        .spawn();
    tracing::info!(file = %file.display(), "limits reload when the file changes and on SIGHUP");
}

async fn shutdown_signal() {
    if tokio::signal::ctrl_c().await.is_err() {
        // No signal handler: run until killed rather than stop at once.
        std::future::pending::<()>().await;
    }
    tracing::info!("Ctrl-C received, shutting down");
}

fn rules_text(policy: &Policy) -> String {
    let rules: Vec<String> = policy.rules().iter().map(Rule::to_string).collect();
    rules.join(" and ")
}

/// What the demo prints at start: where it listens, the routes, and curl commands to try against
/// the first route (one loop that goes two requests past its smallest limit).
fn banner(config: &DemoConfig, addr: SocketAddr) -> String {
    // A wildcard listen address can't be connected to; curl the loopback instead.
    let host = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port())
        }
        _ => addr,
    };
    let limits = &config.limits;
    let tls = match limits.store_tls() {
        Some(tls) => format!(", {tls}"),
        None => String::new(),
    };
    let mut text = format!(
        "tower-redis-ratelimit demo listening on http://{addr} (store: {}{tls}, key prefix \"{}\")\n",
        limits.store_spec(),
        limits.prefix()
    );
    if config.no_limiter {
        text += "  --no-limiter: the routes below are served WITHOUT rate limiting (a load-run baseline)\n";
    }
    for route in limits.routes() {
        let (grpc, http): (Vec<&str>, Vec<&str>) = route
            .paths()
            .iter()
            .map(String::as_str)
            .partition(|path| is_grpc_health(path));
        let served = [
            (!http.is_empty()).then(|| format!("GET|POST {} -> 200 \"PONG\"", http.join(", "))),
            (!grpc.is_empty()).then(|| format!("gRPC {} -> SERVING", grpc.join(", "))),
        ];
        text += &format!(
            "  {}; per {}, {}: {}\n",
            served
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" and "),
            key_text(route.key()),
            route.policy().algorithm(),
            rules_text(route.policy())
        );
    }
    text += &format!("  GET {HEALTHZ} -> 200 \"ok\", never limited\n");

    // The curl loop tries the first route served over plain HTTP.
    let Some((first, first_path)) = limits.routes().iter().find_map(|route| {
        let path = route.paths().iter().find(|path| !is_grpc_health(path))?;
        Some((route, path.as_str()))
    }) else {
        text += "\nOnly gRPC is limited: call grpc.health.v1.Health/Check (h2c) to try it.\n";
        return text;
    };
    let limit = first
        .policy()
        .rules()
        .iter()
        .map(Rule::limit)
        .min()
        .unwrap_or(1);
    let (header, mut query) = match (first.key(), first.key().split_once(':')) {
        ("user", _) => (format!("-H \"{USER_ID_HEADER}: alice\" "), vec![]),
        (_, Some(("header", name))) => (
            format!("-H \"{}: demo-key\" ", name.to_ascii_lowercase()),
            vec![],
        ),
        (_, Some(("query", name))) => (String::new(), vec![format!("{name}=demo-token")]),
        _ => (String::new(), vec![]),
    };
    if first_path == WORK {
        query.push("ms=100".to_owned());
    }
    let url = if query.is_empty() {
        format!("http://{host}{first_path}")
    } else {
        // Quoted: a shell would take `?` and `&` for its own.
        format!("\"http://{host}{first_path}?{}\"", query.join("&"))
    };
    text += &format!(
        "\nTry it: requests 1-{limit} get 200, the next ones 429 (each refusal is logged):\n  \
         for i in $(seq 1 {}); do curl -s -o /dev/null -w \"%{{http_code}}\\n\" {header}{url}; done\n\
         See the headers:\n  curl -i {header}{url}\n\
         Ctrl-C stops the server.\n",
        limit.saturating_add(2)
    );
    text
}

/// The tests' Redis harness: REDIS_URL, or a redis-server of the test's own.
#[cfg(test)]
#[path = "../../tests/it/common/redis_server.rs"]
#[allow(dead_code)]
mod redis_server;

#[cfg(test)]
mod tests;
