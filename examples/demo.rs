//! A runnable rate-limited server, configured from a small TOML file.
//!
//! ```text
//! cargo run --example demo                                   # the built-in config: examples/demo.toml
//! cargo run --example demo -- --config path/to/my.toml       # your own
//! RUST_LOG=debug cargo run --example demo                    # more logging (default: info)
//! ```
//!
//! With no arguments the demo listens on `127.0.0.1:3000`, counts in the in-memory store and limits
//! `GET`/`POST /api/ping` to 20 requests a minute and 100 an hour per client IP. It prints a `curl`
//! loop to try: requests 1 to 20 get `200 PONG`, the next ones `429 Too Many Requests` with
//! `Retry-After` and the `RateLimit` headers, and each refusal is logged. `GET /healthz` is never
//! limited. Ctrl-C stops the server gracefully.
//!
//! # The config file
//!
//! `examples/demo.toml` is both the documentation of the format and the built-in default (it is
//! embedded with `include_str!`, so the two can't drift). Its fields are required, but for
//! `on_store_error` and `store_timeout`, which default to `"allow"` and `"250ms"`, and the TLS
//! fields of the store; unknown fields are errors. One more optional field may be added at the
//! top level:
//! `forwarded_header = "x-forwarded-for" | "forwarded" | "x-real-ip"` pins the proxy header read
//! from `trusted_proxies` (absent: the first present of the three).
//! `metrics = "127.0.0.1:9091"` starts the operator listener there: Prometheus text at
//! `GET /metrics` and the most refused identities of each route's policy as JSON at
//! `GET /debug/ratelimit/top` (`?n=`, default 10); `GET /debug/ratelimit/{policy}/{identity}`
//! reads one identity's state without counting and `DELETE` on it resets its counts and lifts its
//! block (a policy name's slashes as `%2F`: `/debug/ratelimit/%2Fapi%2Fping/ip:127.0.0.1`). It
//! answers whoever reaches it: bind it to loopback or a private interface. Absent, nothing more
//! listens.
//!
//! - `listen`: an IP address and port (no host names).
//! - `store`: where the counts live. `"memory"`; or Redis, so that several demo instances share one
//!   limit: a `redis://host:port/db` URL (`rediss://` for TLS), a Redis Cluster found from any of
//!   its nodes, `{ cluster = ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"] }`, or the primary
//!   that Redis Sentinel names `master`, `{ sentinel = ["redis://10.0.0.1:26379"], master =
//!   "mymaster" }`. The URLs of a list are all `redis://` or all `rediss://`. Nothing connects at
//!   start: a Redis that is down is a store failure per request.
//! - `tls_ca`, `tls_insecure` (optional, and only with `rediss://` URLs): the path of a PEM file
//!   of CA certificates to trust instead of the system's roots; `true` to check no certificate at
//!   all (tests and private networks only).
//! - `wait_for_replicas` (optional, only with a Redis store): an admission counts only once that
//!   many replicas of its node acknowledged it (default `0`, off); see
//!   `RedisStore::wait_for_replicas`.
//! - `on_store_error`: `"allow"` lets requests through when the store fails, `"deny"` answers 503.
//! - `store_timeout`: how long a store answer may take, as a period (`"250ms"`).
//! - `prefix`: the start of every store key; 1 to 64 letters, digits and `-._~@+=!*(),/`.
//! - `trusted_proxies`: CIDRs such as `"10.0.0.0/8"`; a bare address means that one address.
//! - `routes[].path`: a literal path (no `{captures}` or wildcards); `/healthz` is taken.
//! - `routes[].key`: `ip`, `user` (read from the `x-user-id` header), `global`, `header:<name>` or
//!   `query:<name>` (a query-string parameter, such as a one-time token). A request without the
//!   key (no `x-user-id`, no such header or parameter) counts against its client IP.
//! - `routes[].algorithm`: `fixed_window`, `sliding_log`, `sliding_counter` or `token_bucket`.
//! - `routes[].rules`: `{ limit, period }` pairs that must all pass; a period is a positive whole
//!   number and a unit, `ms`, `s`, `m`, `h` or `d` (`"500ms"`, `"10s"`, `"1m"`, `"1h"`, `"1d"`). A
//!   `token_bucket` rule may add `burst`, the bucket size (default: the limit).
//!
//! Optional per route:
//! - `prevent_duplicate`: `true` refuses a second request within 5 s; `{ period = "2s" }` sets the
//!   window (a `limit`, if given, must be 1).
//! - `block_for`: a period; once a rule refuses a client, it is refused outright that long.
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
//! - `tiers`: a table of tier names and requests per day, `{ free = 100, pro = 5000 }`;
//! - `default_tier`: the tier of requests without a known one (required with several tiers);
//! - `key`: as for routes (default `"user"`); `tier_header`: where the tier is read from (default
//!   `"x-tier"`, the demo's stand-in for a tier lookup);
//! - `alert_at`: thresholds in percent (default `[80, 100]`); `alert_webhook`: an `http://` URL the
//!   alerts are posted to as JSON (absent: they are only logged);
//! - `utc_offset`: where days start, `"+00:00"` (default), `"+05:30"`, `"-08:00"`.
//!
//! Each route is its own [`Policy`], so it counts apart from other routes; `GET` and `POST` on a
//! route share its budget. The policy is named after the path (`/api/ping`, as the
//! logs show it); a path longer than the 64 characters a policy name may have gives `route-<index>`
//! instead.
//!
//! A bad file makes the demo exit with status 2 and a message naming the field, such as
//! `demo.toml: routes[0].rules[1].limit: must be at least 1`.

use std::fmt;
use std::io::{self, IsTerminal};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::RawQuery;
use axum::routing::get;
use http::{HeaderName, StatusCode};
use ipnet::IpNet;
use serde::Deserialize;
use tokio::net::TcpListener;
use tower_redis_ratelimit::alert::WebhookNotifier;
use tower_redis_ratelimit::store::TlsOptions;
use tower_redis_ratelimit::{
    Algorithm, ClientIp, ForwardedHeader, Key, MemoryStore, Mode, OnStoreError, Policy,
    PolicyError, Quota, RateLimitLayer, RedisStore, Rule, Scope, Store, StoreError, policy,
};
use tracing_subscriber::EnvFilter;

#[path = "demo_parts/operator.rs"]
mod operator;

/// The built-in config, also shipped as `examples/demo.toml`.
const DEFAULT_CONFIG: &str = include_str!("demo.toml");

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
    let mut config = match load_config(&text) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("{source}: {error}");
            return ExitCode::from(2);
        }
    };
    config.no_limiter = no_limiter;
    init_tracing();
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
    /// The config's name (for error messages) and text.
    source: String,
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
    let (source, text) = match path {
        None => ("demo.toml (built in)".to_owned(), DEFAULT_CONFIG.to_owned()),
        Some(path) => match std::fs::read_to_string(&path) {
            Ok(text) => (path, text),
            Err(error) => return Err(format!("{path}: cannot read the config file: {error}")),
        },
    };
    Ok(Some(CommandLine {
        source,
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
// The config file as written: raw strings, checked by `load_config`.
// ---------------------------------------------------------------------------------------------

/// The TOML file as serde sees it. Values stay strings here so that `load_config` can say which
/// field is wrong and why, in words, instead of a generic "invalid value".
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    listen: String,
    /// "memory", a URL, or a table `{ cluster = [...] }` or `{ sentinel = [...], master = "..." }`:
    /// kept as TOML so that `check_store` can name the bad key or list entry.
    store: toml::Value,
    prefix: String,
    trusted_proxies: Vec<String>,
    legacy_headers: bool,
    /// Optional: pins the proxy header (absent: the library's default order).
    #[serde(default)]
    forwarded_header: Option<String>,
    /// Optional: "allow" (default) or "deny".
    #[serde(default)]
    on_store_error: Option<String>,
    /// Optional: a period such as "250ms" (default).
    #[serde(default)]
    store_timeout: Option<String>,
    /// Optional, with rediss:// URLs only: a PEM file of CA certificates to trust.
    #[serde(default)]
    tls_ca: Option<String>,
    /// Optional, with rediss:// URLs only: `true` checks no certificate.
    #[serde(default)]
    tls_insecure: Option<bool>,
    /// Optional, with a Redis store only: replicas that must acknowledge an admission (default 0).
    #[serde(default)]
    wait_for_replicas: Option<u32>,
    /// Where the operator listener serves `/metrics` and `/debug/ratelimit/…` (absent: nowhere).
    #[serde(default)]
    metrics: Option<String>,
    routes: Vec<RouteConfig>,
    /// Optional: a daily quota by tier on every limited route.
    #[serde(default)]
    quota: Option<QuotaConfig>,
}

/// The `[quota]` section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaConfig {
    /// Optional: a key kind as for routes (default "user").
    #[serde(default)]
    key: Option<String>,
    /// Optional: the header the tier is read from (default "x-tier").
    #[serde(default)]
    tier_header: Option<String>,
    /// Optional when there is one tier: the tier of requests without a known one.
    #[serde(default)]
    default_tier: Option<String>,
    tiers: std::collections::BTreeMap<String, u64>,
    /// Optional: thresholds in percent (default [80, 100]).
    #[serde(default)]
    alert_at: Option<Vec<u16>>,
    /// Optional: where alerts are posted as JSON (default: only logged).
    #[serde(default)]
    alert_webhook: Option<String>,
    /// Optional: "+HH:MM" or "-HH:MM" (default "+00:00").
    #[serde(default)]
    utc_offset: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteConfig {
    path: String,
    key: String,
    algorithm: String,
    rules: Vec<RuleConfig>,
    /// Optional: `true` (one request per 5 s) or a rule table `{ period = "2s" }`.
    #[serde(default)]
    prevent_duplicate: Option<DuplicateConfig>,
    /// Optional: a period such as "15m".
    #[serde(default)]
    block_for: Option<String>,
    /// Optional: "enforce" (default), "shadow" or "delay".
    #[serde(default)]
    mode: Option<String>,
    /// Optional, and only with mode = "delay" (where it is required): a period such as "2s".
    #[serde(default)]
    max_delay: Option<String>,
    /// Optional: the header a request's cost is read from.
    #[serde(default)]
    cost_header: Option<String>,
    /// Optional: requests of one key in progress at once (requires `lease`).
    #[serde(default)]
    max_in_flight: Option<u64>,
    /// Optional, and only with `max_in_flight` (where it is required): a period such as "30s".
    #[serde(default)]
    lease: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleConfig {
    limit: u64,
    period: String,
    /// Optional, token_bucket only: the bucket size (default: the limit).
    #[serde(default)]
    burst: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum DuplicateConfig {
    On(bool),
    Rule(DuplicateRule),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DuplicateRule {
    /// Optional, and 1 if given: the guard admits one request per period.
    #[serde(default)]
    limit: Option<u64>,
    period: String,
}

// ---------------------------------------------------------------------------------------------
// The checked config.
// ---------------------------------------------------------------------------------------------

/// A config that passed every check: the server can be built from it without further errors.
#[derive(Debug, Clone)]
struct DemoConfig {
    listen: SocketAddr,
    store: StoreKind,
    /// `tls_ca` and `tls_insecure`, if either is given (the store's URLs are then rediss://).
    store_tls: Option<StoreTls>,
    /// Replicas that must acknowledge an admission (0: off).
    wait_for_replicas: u32,
    prefix: String,
    trusted_proxies: Vec<IpNet>,
    forwarded_header: Option<ForwardedHeader>,
    legacy_headers: bool,
    /// The operator listener's address, if any.
    metrics: Option<SocketAddr>,
    routes: Vec<Route>,
    /// Set by `--no-limiter`, not by the file: serve the routes without any limiter.
    no_limiter: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum StoreKind {
    Memory,
    /// One node: a `redis://` or `rediss://` URL, and the store timeout.
    Redis {
        url: String,
        timeout: Duration,
    },
    /// A Redis Cluster, found from any of these node URLs.
    Cluster {
        urls: Vec<String>,
        timeout: Duration,
    },
    /// The primary that the sentinels at `urls` name `master`.
    Sentinel {
        master: String,
        urls: Vec<String>,
        timeout: Duration,
    },
}

impl StoreKind {
    /// Whether the store's URLs are `rediss://`; `None` for the memory store. (A list's URLs all
    /// have the same scheme: `check_urls` sees to it.)
    fn is_tls(&self) -> Option<bool> {
        let url = match self {
            StoreKind::Memory => return None,
            StoreKind::Redis { url, .. } => url,
            StoreKind::Cluster { urls, .. } | StoreKind::Sentinel { urls, .. } => urls.first()?,
        };
        Some(url.starts_with("rediss://"))
    }
}

/// As the startup line shows it: `memory`, the URL, `cluster(3 nodes)`, `sentinel(mymaster)` (a
/// cluster or sentinel list over rediss:// adds `, TLS`).
impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tls = if self.is_tls() == Some(true) {
            ", TLS"
        } else {
            ""
        };
        match self {
            StoreKind::Memory => f.write_str("memory"),
            StoreKind::Redis { url, .. } => f.write_str(url),
            StoreKind::Cluster { urls, .. } => {
                let plural = if urls.len() == 1 { "" } else { "s" };
                write!(f, "cluster({} node{plural}{tls})", urls.len())
            }
            StoreKind::Sentinel { master, .. } => write!(f, "sentinel({master}{tls})"),
        }
    }
}

/// The TLS settings of a Redis store over rediss://, from `tls_ca` and `tls_insecure`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StoreTls {
    /// `tls_ca`: the path as written, and the PEM text read from it while loading (so a file that
    /// can't be read is a config error, not a failure at start).
    ca: Option<(String, Vec<u8>)>,
    /// `tls_insecure`: check no certificate at all.
    insecure: bool,
}

impl StoreTls {
    fn options(&self) -> TlsOptions {
        let options = TlsOptions::new().insecure(self.insecure);
        match &self.ca {
            Some((_, pem)) => options.ca_pem(pem.clone()),
            None => options,
        }
    }
}

/// As the startup line shows it, after the store.
impl fmt::Display for StoreTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.ca, self.insecure) {
            (_, true) => f.write_str("TLS certificates NOT checked"),
            (Some((path, _)), false) => write!(f, "TLS CA {path:?}"),
            (None, false) => f.write_str("TLS CA: the system's roots"),
        }
    }
}

#[derive(Debug, Clone)]
struct Route {
    path: String,
    key: KeyKind,
    /// Built (and so checked) while loading, with the config's prefix and client-IP settings.
    policy: Policy,
}

/// The `key` of a route, kept besides the [`Key`] it becomes because a `Key` can't be compared or
/// printed in full.
#[derive(Debug, Clone, PartialEq, Eq)]
enum KeyKind {
    Ip,
    User,
    Global,
    Header(HeaderName),
    Query(String),
}

impl KeyKind {
    fn parse(text: &str) -> Result<Self, String> {
        match text {
            "ip" => Ok(KeyKind::Ip),
            "user" => Ok(KeyKind::User),
            "global" => Ok(KeyKind::Global),
            _ => match (text.strip_prefix("header:"), text.strip_prefix("query:")) {
                (Some(name), _) => name
                    .parse()
                    .map(KeyKind::Header)
                    .map_err(|_| format!("{name:?} is not a valid header name (in {text:?})")),
                (_, Some("")) => Err(format!("{text:?} names no query parameter")),
                (_, Some(name)) => Ok(KeyKind::Query(name.to_owned())),
                (None, None) => Err(format!(
                    "unknown key {text:?}: expected \"ip\", \"user\", \"global\", \
                     \"header:<name>\" or \"query:<name>\""
                )),
            },
        }
    }

    fn to_key(&self) -> Key {
        match self {
            KeyKind::Ip => Key::ip(),
            KeyKind::User => Key::user_from_fn(|parts| {
                let id = parts.headers.get(USER_ID_HEADER)?.to_str().ok()?;
                Some(id.to_owned())
            }),
            KeyKind::Global => Key::global(),
            KeyKind::Header(name) => Key::header(name.clone()),
            KeyKind::Query(name) => Key::query(name.as_str()),
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyKind::Ip => f.write_str("client IP"),
            KeyKind::User => write!(f, "user ({USER_ID_HEADER} header)"),
            KeyKind::Global => f.write_str("global"),
            KeyKind::Header(name) => write!(f, "header {name}"),
            KeyKind::Query(name) => write!(f, "query parameter {name}"),
        }
    }
}

/// Why a config file was refused. The `Display` text is what the user sees after the file name.
#[derive(Debug)]
enum ConfigError {
    /// Syntax, unknown or missing field, wrong type: toml's message already names the key and line.
    Toml(toml::de::Error),
    /// A value that parsed but makes no sense; `field` is its path, such as `routes[0].rules[1].limit`.
    Field { field: String, message: String },
}

impl ConfigError {
    fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Field {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Toml(error) => write!(f, "{}", error.to_string().trim_end()),
            ConfigError::Field { field, message } => write!(f, "{field}: {message}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Parses and checks a config file.
fn load_config(text: &str) -> Result<DemoConfig, ConfigError> {
    let raw: Config = toml::from_str(text).map_err(ConfigError::Toml)?;
    check_config(raw)
}

/// Turns the raw config into a checked one, naming the first bad field.
fn check_config(raw: Config) -> Result<DemoConfig, ConfigError> {
    let listen: SocketAddr = raw.listen.parse().map_err(|_| {
        ConfigError::field(
            "listen",
            format!(
                "{:?} is not an IP address and port such as \"127.0.0.1:3000\"",
                raw.listen
            ),
        )
    })?;
    let store_timeout = match raw.store_timeout.as_deref() {
        None => tower_redis_ratelimit::store::DEFAULT_TIMEOUT,
        Some(text) => {
            parse_period(text).map_err(|message| ConfigError::field("store_timeout", message))?
        }
    };
    let store = check_store(&raw.store, store_timeout)?;
    let metrics = raw
        .metrics
        .as_deref()
        .map(operator::parse_address)
        .transpose()
        .map_err(|message| ConfigError::field("metrics", message))?;
    let store_tls = check_tls(raw.tls_ca.as_deref(), raw.tls_insecure, &store)?;
    let wait_for_replicas = match raw.wait_for_replicas {
        Some(replicas) if replicas > 0 && store == StoreKind::Memory => {
            return Err(ConfigError::field(
                "wait_for_replicas",
                "applies only to a Redis store, not \"memory\"",
            ));
        }
        replicas => replicas.unwrap_or(0),
    };
    let on_store_error = match raw.on_store_error.as_deref() {
        None | Some("allow") => OnStoreError::Allow,
        Some("deny") => OnStoreError::Deny,
        Some(other) => {
            return Err(ConfigError::field(
                "on_store_error",
                format!("unknown value {other:?}: expected \"allow\" or \"deny\""),
            ));
        }
    };
    if !policy::is_valid_name(&raw.prefix) {
        return Err(ConfigError::field(
            "prefix",
            format!(
                "{:?} must be 1 to 64 letters, digits and -._~@+=!*(),/ (it starts every store key)",
                raw.prefix
            ),
        ));
    }
    let mut trusted_proxies = Vec::with_capacity(raw.trusted_proxies.len());
    for (index, text) in raw.trusted_proxies.iter().enumerate() {
        let net = parse_cidr(text).ok_or_else(|| {
            ConfigError::field(
                format!("trusted_proxies[{index}]"),
                format!("{text:?} is not a CIDR such as \"10.0.0.0/8\" or \"fd00::/8\""),
            )
        })?;
        trusted_proxies.push(net);
    }
    let forwarded_header = raw
        .forwarded_header
        .as_deref()
        .map(str::parse::<ForwardedHeader>)
        .transpose()
        .map_err(|error| ConfigError::field("forwarded_header", error.to_string()))?;

    let mut client_ip = ClientIp::new().trust_proxies(trusted_proxies.iter().copied());
    if let Some(header) = forwarded_header {
        client_ip = client_ip.forwarded_header(header);
    }
    if raw.routes.is_empty() {
        return Err(ConfigError::field("routes", "must list at least one route"));
    }
    let quota = raw
        .quota
        .map(|quota| check_quota(quota, &raw.prefix))
        .transpose()?;
    let mut routes: Vec<Route> = Vec::with_capacity(raw.routes.len());
    for (index, route) in raw.routes.into_iter().enumerate() {
        let route = check_route(
            index,
            route,
            &raw.prefix,
            &client_ip,
            on_store_error,
            quota.as_ref(),
        )?;
        if let Some(first) = routes.iter().position(|earlier| earlier.path == route.path) {
            return Err(ConfigError::field(
                format!("routes[{index}].path"),
                format!("{:?} is already used by routes[{first}]", route.path),
            ));
        }
        routes.push(route);
    }
    Ok(DemoConfig {
        listen,
        store,
        store_tls,
        wait_for_replicas,
        prefix: raw.prefix,
        trusted_proxies,
        forwarded_header,
        legacy_headers: raw.legacy_headers,
        metrics,
        routes,
        no_limiter: false,
    })
}

fn check_route(
    index: usize,
    raw: RouteConfig,
    prefix: &str,
    client_ip: &ClientIp,
    on_store_error: OnStoreError,
    quota: Option<&Quota>,
) -> Result<Route, ConfigError> {
    let field = |name: &str| format!("routes[{index}].{name}");
    check_path(&raw.path).map_err(|message| ConfigError::field(field("path"), message))?;
    let key =
        KeyKind::parse(&raw.key).map_err(|message| ConfigError::field(field("key"), message))?;
    let algorithm: Algorithm = raw.algorithm.parse().map_err(
        |error: tower_redis_ratelimit::policy::UnknownAlgorithm| {
            ConfigError::field(field("algorithm"), error.to_string())
        },
    )?;
    if raw.rules.is_empty() {
        return Err(ConfigError::field(
            field("rules"),
            "must list at least one rule",
        ));
    }
    let mut rules = Vec::with_capacity(raw.rules.len());
    for (i, rule) in raw.rules.iter().enumerate() {
        // Checked here rather than left to `PolicyBuilder::build` so the message names the field.
        if rule.limit == 0 {
            return Err(ConfigError::field(
                field(&format!("rules[{i}].limit")),
                "must be at least 1",
            ));
        }
        let period = parse_period(&rule.period)
            .map_err(|message| ConfigError::field(field(&format!("rules[{i}].period")), message))?;
        let mut parsed = Rule::new(rule.limit, period);
        if let Some(burst) = rule.burst {
            parsed = parsed.burst(burst);
        }
        rules.push(parsed);
    }
    let mut builder = Policy::builder(policy_name(&raw.path, index))
        .prefix(prefix)
        .key(key.to_key())
        .rules(rules)
        .algorithm(algorithm)
        // A policy per route already keeps routes apart; GET and POST share the route's budget.
        .scope(Scope::Policy)
        .client_ip(client_ip.clone())
        .on_store_error(on_store_error);
    let period_field = |name: &str, text: &str| {
        parse_period(text).map_err(|message| ConfigError::field(field(name), message))
    };
    match raw.prevent_duplicate {
        None | Some(DuplicateConfig::On(false)) => {}
        Some(DuplicateConfig::On(true)) => {
            builder = builder.prevent_duplicate(policy::DEFAULT_DUPLICATE_WINDOW);
        }
        Some(DuplicateConfig::Rule(rule)) => {
            if rule.limit.is_some_and(|limit| limit != 1) {
                return Err(ConfigError::field(
                    field("prevent_duplicate.limit"),
                    "the duplicate guard admits one request per period: leave out the limit or \
                     make it 1 (use a rule for more)",
                ));
            }
            builder =
                builder.prevent_duplicate(period_field("prevent_duplicate.period", &rule.period)?);
        }
    }
    if let Some(text) = &raw.block_for {
        builder = builder.block_for(period_field("block_for", text)?);
    }
    let mode = match (raw.mode.as_deref(), &raw.max_delay) {
        (None | Some("enforce"), None) => Mode::Enforce,
        (Some("shadow"), None) => Mode::Shadow,
        (Some("delay"), Some(text)) => Mode::Delay {
            max_delay: period_field("max_delay", text)?,
        },
        (Some("delay"), None) => {
            return Err(ConfigError::field(
                field("max_delay"),
                "is required with mode = \"delay\": the longest a request may wait, such as \"2s\"",
            ));
        }
        (None | Some("enforce" | "shadow"), Some(_)) => {
            return Err(ConfigError::field(
                field("max_delay"),
                "applies only with mode = \"delay\"",
            ));
        }
        (Some(other), _) => {
            return Err(ConfigError::field(
                field("mode"),
                format!("unknown mode {other:?}: expected \"enforce\", \"shadow\" or \"delay\""),
            ));
        }
    };
    builder = builder.mode(mode);
    if let Some(name) = &raw.cost_header {
        let header = HeaderName::try_from(name.as_str()).map_err(|_| {
            ConfigError::field(
                field("cost_header"),
                format!("{name:?} is not a header name"),
            )
        })?;
        builder = builder.cost_from_fn(move |parts| request_cost(parts, &header));
    }
    match (raw.max_in_flight, &raw.lease) {
        (None, None) => {}
        (Some(0), _) => {
            return Err(ConfigError::field(
                field("max_in_flight"),
                "must be at least 1",
            ));
        }
        (Some(n), Some(text)) => {
            builder = builder.max_in_flight(n).lease(period_field("lease", text)?);
        }
        (Some(_), None) => {
            return Err(ConfigError::field(
                field("lease"),
                "is required with max_in_flight: the longest a request holds its slot, such as \
                 \"30s\" (a crashed instance must not hold one for ever)",
            ));
        }
        (None, Some(_)) => {
            return Err(ConfigError::field(
                field("lease"),
                "applies only with max_in_flight",
            ));
        }
    }
    if let Some(quota) = quota {
        builder = builder.quota(quota.clone());
    }
    let policy = builder
        .build()
        .map_err(|error| policy_error(index, error))?;
    Ok(Route {
        path: raw.path,
        key,
        policy,
    })
}

/// The tier header when none is configured.
const DEFAULT_TIER_HEADER: &str = "x-tier";

/// Checks the `[quota]` section and builds the quota every limited route shares.
fn check_quota(raw: QuotaConfig, prefix: &str) -> Result<Quota, ConfigError> {
    let key = KeyKind::parse(raw.key.as_deref().unwrap_or("user"))
        .map_err(|message| ConfigError::field("quota.key", message))?;
    let tier_header = raw.tier_header.as_deref().unwrap_or(DEFAULT_TIER_HEADER);
    let tier_header = HeaderName::try_from(tier_header).map_err(|_| {
        ConfigError::field(
            "quota.tier_header",
            format!("{tier_header:?} is not a header name"),
        )
    })?;
    if raw.tiers.is_empty() {
        return Err(ConfigError::field(
            "quota.tiers",
            "must name at least one tier, such as { free = 100 }",
        ));
    }
    let mut builder = Quota::builder("daily").prefix(prefix).key(key.to_key());
    for (tier, limit) in &raw.tiers {
        if *limit == 0 || *limit > policy::MAX_LIMIT {
            return Err(ConfigError::field(
                format!("quota.tiers.{tier}"),
                "must be 1 to 2^35 requests per day",
            ));
        }
        builder = builder.tier(tier.clone(), *limit);
    }
    match (&raw.default_tier, raw.tiers.len()) {
        (Some(tier), _) if !raw.tiers.contains_key(tier) => {
            return Err(ConfigError::field(
                "quota.default_tier",
                format!("{tier:?} is not one of the tiers"),
            ));
        }
        (Some(tier), _) => builder = builder.default_tier(tier.clone()),
        (None, 1) => {}
        (None, _) => {
            return Err(ConfigError::field(
                "quota.default_tier",
                "is required with more than one tier: the tier of requests without a known one",
            ));
        }
    }
    if let Some(percents) = raw.alert_at {
        if let Some(bad) = percents.iter().find(|p| !(1..=100).contains(*p)) {
            return Err(ConfigError::field(
                "quota.alert_at",
                format!("{bad} is not a percent from 1 to 100"),
            ));
        }
        builder = builder.alert_at(percents);
    }
    if let Some(text) = &raw.utc_offset {
        let minutes = parse_utc_offset(text)
            .ok_or_else(|| ConfigError::field("quota.utc_offset", format!(
                "{text:?} is not an offset such as \"+00:00\", \"+05:30\" or \"-08:00\" (at most 18 hours)"
            )))?;
        builder = builder.utc_offset_minutes(minutes);
    }
    if let Some(url) = &raw.alert_webhook {
        if !url.starts_with("http://") {
            return Err(ConfigError::field(
                "quota.alert_webhook",
                format!("{url:?} is not an http:// URL"),
            ));
        }
        builder = builder.notifier(WebhookNotifier::new(url.clone()));
    }
    builder = builder.tier_from_fn(move |parts| {
        let tier = parts.headers.get(&tier_header)?.to_str().ok()?;
        Some(tier.trim().to_owned())
    });
    builder
        .build()
        .map_err(|error| ConfigError::field("quota", error.to_string()))
}

/// `+HH:MM` or `-HH:MM` as minutes east of UTC, at most 18 hours.
fn parse_utc_offset(text: &str) -> Option<i32> {
    let (sign, rest) = match text.as_bytes().first()? {
        b'+' => (1, &text[1..]),
        b'-' => (-1, &text[1..]),
        _ => return None,
    };
    let (hours, minutes) = rest.split_once(':')?;
    if hours.len() != 2 || minutes.len() != 2 {
        return None;
    }
    let (hours, minutes): (i32, i32) = (hours.parse().ok()?, minutes.parse().ok()?);
    let total = hours * 60 + minutes;
    (minutes < 60 && total <= 18 * 60).then_some(sign * total)
}

/// The cost of a request from the route's `cost_header`: a whole number of at least 1; a request
/// without the header, or with anything else in it, costs 1. The demo trusts the header, as a real
/// app would trust a value its own gateway computed; it never panics on what a client sends.
fn request_cost(parts: &http::request::Parts, header: &HeaderName) -> u64 {
    parts
        .headers
        .get(header)
        .and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok())
        .filter(|&cost| cost >= 1)
        .unwrap_or(1)
}

/// Rephrases an error of `PolicyBuilder::build` for route `index` so it names the field. The rules
/// the demo can't produce (zero limits and periods, rule names) keep the library's wording.
fn policy_error(index: usize, error: PolicyError) -> ConfigError {
    match error {
        PolicyError::InvalidBurst {
            index: rule,
            rule: text,
            reason,
            ..
        } => {
            // Most reasons are about the burst; a rate above one unit per microsecond is about the
            // limit and period.
            let field = if reason.contains("burst") {
                format!("routes[{index}].rules[{rule}].burst")
            } else {
                format!("routes[{index}].rules[{rule}]")
            };
            ConfigError::field(field, format!("{text}: {reason}"))
        }
        PolicyError::InvalidOption { option, reason, .. } => {
            ConfigError::field(format!("routes[{index}].{option}"), reason)
        }
        PolicyError::DuplicateRule {
            index: rule,
            first,
            rule: text,
            ..
        } => ConfigError::field(
            format!("routes[{index}].rules[{rule}]"),
            format!("{text} is the same rule as rules[{first}]"),
        ),
        PolicyError::InvalidName {
            what: "key prefix", ..
        } => ConfigError::field("prefix", error.to_string()),
        other => ConfigError::field(format!("routes[{index}]"), other.to_string()),
    }
}

/// What `store` may be, for a value that is neither a string nor a table of one of the two kinds.
const STORE_EXPECTED: &str = "expected \"memory\", a URL, or a table with cluster = [...] or \
                              sentinel = [...] and master = \"...\"";

/// The `store` value: `"memory"` or a URL (`parse_store`), or a cluster or sentinel table.
fn check_store(value: &toml::Value, timeout: Duration) -> Result<StoreKind, ConfigError> {
    match value {
        toml::Value::String(text) => {
            parse_store(text, timeout).map_err(|message| ConfigError::field("store", message))
        }
        toml::Value::Table(table) => check_store_table(table, timeout),
        _ => Err(ConfigError::field("store", STORE_EXPECTED)),
    }
}

/// `{ cluster = [...] }` or `{ sentinel = [...], master = "..." }`. The keys are checked by hand
/// rather than by serde so that each message names its key or list entry.
fn check_store_table(table: &toml::Table, timeout: Duration) -> Result<StoreKind, ConfigError> {
    if let Some(key) = table
        .keys()
        .find(|key| !matches!(key.as_str(), "cluster" | "sentinel" | "master"))
    {
        return Err(ConfigError::field(
            format!("store.{key}"),
            "unknown key: a store table takes cluster = [...], or sentinel = [...] and master = \"...\"",
        ));
    }
    match (
        table.get("cluster"),
        table.get("sentinel"),
        table.get("master"),
    ) {
        (Some(_), Some(_), _) => Err(ConfigError::field(
            "store",
            "expected either cluster = [...] or sentinel = [...], not both",
        )),
        (Some(_), None, Some(_)) => Err(ConfigError::field(
            "store.master",
            "applies only with sentinel = [...] (a cluster finds its primaries itself)",
        )),
        (Some(list), None, None) => {
            let urls = check_urls("store.cluster", list, "node", 7000)?;
            RedisStore::cluster(&urls)
                .map_err(|error| ConfigError::field("store.cluster", error.to_string()))?;
            Ok(StoreKind::Cluster { urls, timeout })
        }
        (None, Some(list), master) => {
            let urls = check_urls("store.sentinel", list, "sentinel", 26379)?;
            let master = match master {
                Some(toml::Value::String(name)) if !name.is_empty() => name.clone(),
                Some(_) => {
                    return Err(ConfigError::field(
                        "store.master",
                        "expected the name the sentinels know the primary by, such as \"mymaster\"",
                    ));
                }
                None => {
                    return Err(ConfigError::field(
                        "store.master",
                        "is required with sentinel = [...]: the name the sentinels know the \
                         primary by, such as \"mymaster\"",
                    ));
                }
            };
            RedisStore::sentinel(&master, &urls)
                .map_err(|error| ConfigError::field("store.sentinel", error.to_string()))?;
            Ok(StoreKind::Sentinel {
                master,
                urls,
                timeout,
            })
        }
        (None, None, _) => Err(ConfigError::field("store", STORE_EXPECTED)),
    }
}

/// The URL list at `field` (`store.cluster`, `store.sentinel`): at least one, each a `redis://` or
/// `rediss://` URL, all with the same scheme (the library takes the TLS mode of the first).
fn check_urls(
    field: &str,
    value: &toml::Value,
    what: &str,
    port: u16,
) -> Result<Vec<String>, ConfigError> {
    let toml::Value::Array(items) = value else {
        return Err(ConfigError::field(
            field,
            format!("expected a list of {what} URLs such as [\"redis://127.0.0.1:{port}\"]"),
        ));
    };
    if items.is_empty() {
        return Err(ConfigError::field(
            field,
            format!("must list at least one {what} URL"),
        ));
    }
    let mut urls: Vec<String> = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let entry = format!("{field}[{index}]");
        let url = match item {
            toml::Value::String(url)
                if url.starts_with("redis://") || url.starts_with("rediss://") =>
            {
                url
            }
            toml::Value::String(other) => {
                return Err(ConfigError::field(
                    entry,
                    format!("{other:?} is not a redis:// or rediss:// URL"),
                ));
            }
            other => {
                return Err(ConfigError::field(
                    entry,
                    format!("{other} is not a redis:// or rediss:// URL"),
                ));
            }
        };
        if let Some(first) = urls.first()
            && first.starts_with("rediss://") != url.starts_with("rediss://")
        {
            return Err(ConfigError::field(
                entry,
                format!(
                    "{url:?} and {field}[0] differ in TLS: use rediss:// for every URL or for none"
                ),
            ));
        }
        // Checks the URL without connecting, as for a single node.
        RedisStore::from_url(url)
            .map_err(|error| ConfigError::field(entry, format!("{url:?}: {error}")))?;
        urls.push(url.clone());
    }
    Ok(urls)
}

/// `tls_ca` and `tls_insecure`: only with a Redis store over rediss://, and not both (an insecure
/// client checks no certificate, so a CA would go unused).
fn check_tls(
    ca: Option<&str>,
    insecure: Option<bool>,
    store: &StoreKind,
) -> Result<Option<StoreTls>, ConfigError> {
    let given = match (ca, insecure) {
        (None, None) => return Ok(None),
        (Some(_), _) => "tls_ca",
        (None, Some(_)) => "tls_insecure",
    };
    match store.is_tls() {
        None => {
            return Err(ConfigError::field(
                given,
                "applies only to a Redis store, not \"memory\"",
            ));
        }
        Some(false) => {
            return Err(ConfigError::field(
                given,
                "applies only to rediss:// URLs (TLS), and the store's are redis://",
            ));
        }
        Some(true) => {}
    }
    let insecure = insecure.unwrap_or(false);
    if insecure && ca.is_some() {
        return Err(ConfigError::field(
            "tls_insecure",
            "true checks no certificate, so tls_ca would go unused: give one or the other",
        ));
    }
    let ca = match ca {
        None => None,
        Some(path) => {
            let pem = std::fs::read(path).map_err(|error| {
                ConfigError::field("tls_ca", format!("cannot read {path:?}: {error}"))
            })?;
            // Text without a certificate is no error to the TLS library, just no CA at all.
            if !pem
                .windows(CERTIFICATE_PEM.len())
                .any(|window| window == CERTIFICATE_PEM.as_bytes())
            {
                return Err(ConfigError::field(
                    "tls_ca",
                    format!("{path:?} holds no PEM certificate ({CERTIFICATE_PEM})"),
                ));
            }
            Some((path.to_owned(), pem))
        }
    };
    let tls = StoreTls { ca, insecure };
    // Builds the store's clients with these settings (still without connecting), which parses
    // the certificates.
    open_store(store, Some(&tls), 0).map_err(|error| match &tls.ca {
        Some((path, _)) => ConfigError::field("tls_ca", format!("{path:?}: {error}")),
        None => ConfigError::field(given, error.to_string()),
    })?;
    Ok(Some(tls))
}

/// How a PEM certificate starts.
const CERTIFICATE_PEM: &str = "-----BEGIN CERTIFICATE-----";

fn parse_store(text: &str, timeout: Duration) -> Result<StoreKind, String> {
    if text == "memory" {
        Ok(StoreKind::Memory)
    } else if text.starts_with("redis://") || text.starts_with("rediss://") {
        // Checks the URL without connecting: a Redis that is down is a store failure per request.
        RedisStore::from_url(text).map_err(|error| format!("{text:?}: {error}"))?;
        Ok(StoreKind::Redis {
            url: text.to_owned(),
            timeout,
        })
    } else {
        Err(format!(
            "unknown store {text:?}: expected \"memory\" or a URL such as \"redis://127.0.0.1:6379/0\""
        ))
    }
}

/// A CIDR, or a bare address meaning just that address.
fn parse_cidr(text: &str) -> Option<IpNet> {
    text.parse::<IpNet>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from))
}

/// The rule the library applies to policy names and key prefixes (both are part of every store
/// key): 1 to 64 characters of letters, digits and `-._~@+=!*(),/`.
/// A route's policy name: its path, which reads well in logs, when that passes the
/// policy-name rule; else `route-<index>` (paths start with `/`, so the two forms never clash).
fn policy_name(path: &str, index: usize) -> String {
    if policy::is_valid_name(path) {
        path.to_owned()
    } else {
        format!("route-{index}")
    }
}

/// Paths are literal: axum would panic on a malformed `{capture}` or `*wildcard`, and a literal path
/// is all a ping route needs. The allowed characters are those of a policy name minus `*`.
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

/// Parses a period: a positive whole number, then `ms`, `s`, `m`, `h` or `d`, nothing else.
fn parse_period(text: &str) -> Result<Duration, String> {
    let invalid = || {
        format!(
            "invalid period {text:?}: expected a positive whole number and a unit (ms, s, m, h or d), such as \"500ms\", \"10s\" or \"1m\""
        )
    };
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(invalid()),
    };
    let count: u64 = digits.parse().map_err(|_| invalid())?;
    if count == 0 {
        return Err(invalid());
    }
    let ms = count
        .checked_mul(unit_ms)
        .ok_or_else(|| format!("period {text:?} is too long"))?;
    Ok(Duration::from_millis(ms))
}

// ---------------------------------------------------------------------------------------------
// The server.
// ---------------------------------------------------------------------------------------------

/// The store of `kind`, with `tls` settings for its rediss:// URLs, counting an admission once
/// `wait_for_replicas` replicas have it. Nothing connects yet.
fn open_store(
    kind: &StoreKind,
    tls: Option<&StoreTls>,
    wait_for_replicas: u32,
) -> Result<Arc<dyn Store>, StoreError> {
    let (store, timeout) = match kind {
        StoreKind::Memory => return Ok(Arc::new(MemoryStore::new())),
        StoreKind::Redis { url, timeout } => (RedisStore::from_url(url)?, *timeout),
        StoreKind::Cluster { urls, timeout } => (RedisStore::cluster(urls)?, *timeout),
        StoreKind::Sentinel {
            master,
            urls,
            timeout,
        } => (RedisStore::sentinel(master, urls)?, *timeout),
    };
    let store = match tls {
        Some(tls) => store.with_tls(tls.options())?,
        None => store,
    };
    Ok(Arc::new(
        store.timeout(timeout).wait_for_replicas(wait_for_replicas),
    ))
}

/// The app: every configured route answers `GET` and `POST` with `200 PONG` behind its own limit,
/// and `/healthz` answers `200 ok`, unlimited. All routes count in one shared store.
#[cfg(test)]
fn build_app(config: &DemoConfig) -> Result<Router, StoreError> {
    build_app_with_layers(config).map(|(app, _)| app)
}

/// [`build_app`], and the layer of each limited route (for the operator listener).
fn build_app_with_layers(config: &DemoConfig) -> Result<(Router, Vec<RateLimitLayer>), StoreError> {
    // One store for every route, as one app would share it.
    let store = open_store(
        &config.store,
        config.store_tls.as_ref(),
        config.wait_for_replicas,
    )?;
    let mut app = Router::new().route(HEALTHZ, get(|| async { "ok" }));
    if !config.routes.iter().any(|route| route.path == WORK) {
        app = app.route(WORK, get(work).post(work));
    }
    let mut layers = Vec::new();
    for route in &config.routes {
        let handler = if route.path == WORK {
            get(work).post(work)
        } else {
            get(pong).post(pong)
        };
        if config.no_limiter {
            app = app.route(&route.path, handler);
            continue;
        }
        let limit = RateLimitLayer::new(route.policy.clone(), store.clone())
            .legacy_headers(config.legacy_headers);
        layers.push(limit.clone());
        // The layer sits on the route's method router, so it covers this route only.
        app = app.route(&route.path, handler.layer(limit));
    }
    Ok((app, layers))
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

/// Serves `config` on `listener` until Ctrl-C, then finishes the requests in flight.
async fn run(config: DemoConfig, listener: TcpListener) -> io::Result<()> {
    for route in &config.routes {
        tracing::info!(
            path = %route.path,
            policy = route.policy.name(),
            key = %route.key,
            algorithm = %route.policy.algorithm(),
            rules = %rules_text(&route.policy),
            "route limited"
        );
    }
    tracing::info!(
        store = %config.store,
        store_tls = config.store_tls.as_ref().map(tracing::field::display),
        wait_for_replicas = config.wait_for_replicas,
        prefix = %config.prefix,
        trusted_proxies = ?config.trusted_proxies,
        forwarded_header = ?config.forwarded_header,
        legacy_headers = config.legacy_headers,
        "serving"
    );
    // The recorder goes in before the layers are built and serve their first request.
    let prometheus = match config.metrics {
        Some(_) => Some(operator::install_recorder().map_err(io::Error::other)?),
        None => None,
    };
    let (app, layers) = build_app_with_layers(&config).map_err(io::Error::other)?;
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
            operator::Operator { prometheus, layers },
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
    let tls = match &config.store_tls {
        Some(tls) => format!(", {tls}"),
        None => String::new(),
    };
    let mut text = format!(
        "tower-redis-ratelimit demo listening on http://{addr} (store: {}{tls}, key prefix \"{}\")\n",
        config.store, config.prefix
    );
    if config.no_limiter {
        text += "  --no-limiter: the routes below are served WITHOUT rate limiting (a load-run baseline)\n";
    }
    for route in &config.routes {
        text += &format!(
            "  GET|POST {} -> 200 \"PONG\"; per {}, {}: {}\n",
            route.path,
            route.key,
            route.policy.algorithm(),
            rules_text(&route.policy)
        );
    }
    text += &format!("  GET {HEALTHZ} -> 200 \"ok\", never limited\n");

    let first = &config.routes[0];
    let limit = first
        .policy
        .rules()
        .iter()
        .map(Rule::limit)
        .min()
        .unwrap_or(1);
    let (header, mut query) = match &first.key {
        KeyKind::User => (format!("-H \"{USER_ID_HEADER}: alice\" "), vec![]),
        KeyKind::Header(name) => (format!("-H \"{name}: demo-key\" "), vec![]),
        KeyKind::Query(name) => (String::new(), vec![format!("{name}=demo-token")]),
        KeyKind::Ip | KeyKind::Global => (String::new(), vec![]),
    };
    if first.path == WORK {
        query.push("ms=100".to_owned());
    }
    let url = if query.is_empty() {
        format!("http://{host}{}", first.path)
    } else {
        // Quoted: a shell would take `?` and `&` for its own.
        format!("\"http://{host}{}?{}\"", first.path, query.join("&"))
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
#[path = "../tests/common/redis_server.rs"]
#[allow(dead_code)]
mod redis_server;

#[cfg(test)]
mod tests {
    use super::*;

    use axum::body::Body;
    use axum::extract::connect_info::MockConnectInfo;
    use http::{HeaderMap, Method, Request, StatusCode};
    use tower::ServiceExt;

    /// The default config with `from` (which must occur exactly once) replaced by `to`.
    fn edited(from: &str, to: &str) -> String {
        assert_eq!(DEFAULT_CONFIG.matches(from).count(), 1, "{from:?}");
        DEFAULT_CONFIG.replacen(from, to, 1)
    }

    fn error_of(text: &str) -> String {
        load_config(text)
            .expect_err("the config should be refused")
            .to_string()
    }

    fn route_config(key: &str, rules: &str) -> String {
        edited("key = \"ip\"", &format!("key = \"{key}\"")).replacen(
            "rules = [{ limit = 20, period = \"1m\" }, { limit = 100, period = \"1h\" }]",
            &format!("rules = {rules}"),
            1,
        )
    }

    #[test]
    fn shipped_config_parses_to_the_expected_values() {
        let config = load_config(DEFAULT_CONFIG).unwrap();
        assert_eq!(config.listen, SocketAddr::from(([127, 0, 0, 1], 3000)));
        assert_eq!(config.store, StoreKind::Memory);
        assert_eq!(config.prefix, "demo");
        assert_eq!(config.trusted_proxies, Vec::<IpNet>::new());
        assert_eq!(config.forwarded_header, None);
        assert!(!config.legacy_headers);
        assert_eq!(config.routes.len(), 1);
        let route = &config.routes[0];
        assert_eq!(route.path, "/api/ping");
        assert_eq!(route.key, KeyKind::Ip);
        let policy = &route.policy;
        assert_eq!(policy.name(), "/api/ping");
        assert_eq!(policy.prefix(), "demo");
        assert_eq!(policy.key().kind(), "ip");
        assert_eq!(policy.algorithm(), Algorithm::SlidingLog);
        assert_eq!(policy.scope(), Scope::Policy);
        assert_eq!(policy.rules(), [Rule::per_minute(20), Rule::per_hour(100)]);
        assert_eq!(policy.client_ip().trusted_proxies(), &[] as &[IpNet]);
    }

    #[test]
    fn optional_and_alternative_values_are_accepted() {
        let text = edited(
            "trusted_proxies = []",
            "trusted_proxies = [\"127.0.0.0/8\", \"::1\"]\nforwarded_header = \"X-Real-IP\"",
        )
        .replacen("legacy_headers = false", "legacy_headers = true", 1)
        .replacen("listen = \"127.0.0.1:3000\"", "listen = \"[::1]:0\"", 1)
        .replacen(
            "algorithm = \"sliding_log\"",
            "algorithm = \"fixed_window\"",
            1,
        )
        .replacen("key = \"ip\"", "key = \"header:X-Api-Key\"", 1)
            + "\n[[routes]]\npath = \"/user\"\nkey = \"user\"\nalgorithm = \"sliding_log\"\n\
           rules = [{ limit = 5, period = \"500ms\" }, { limit = 5, period = \"1d\" }]\n"
            + &format!(
                "\n[[routes]]\npath = \"/{}\"\nkey = \"global\"\nalgorithm = \"sliding_log\"\n\
             rules = [{{ limit = 1, period = \"10s\" }}]\n",
                "x".repeat(64)
            );
        let config = load_config(&text).unwrap();
        assert_eq!(config.listen, "[::1]:0".parse::<SocketAddr>().unwrap());
        let proxies: Vec<IpNet> = vec!["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()];
        assert_eq!(config.trusted_proxies, proxies);
        assert_eq!(config.forwarded_header, Some(ForwardedHeader::XRealIp));
        assert!(config.legacy_headers);
        let [api, user, long] = &config.routes[..] else {
            panic!("three routes expected, got {}", config.routes.len());
        };
        assert_eq!(
            api.key,
            KeyKind::Header(HeaderName::from_static("x-api-key"))
        );
        assert_eq!(api.policy.key().kind(), "header");
        assert_eq!(api.policy.algorithm(), Algorithm::FixedWindow);
        assert_eq!(api.policy.client_ip().trusted_proxies(), &proxies[..]);
        assert_eq!(user.key, KeyKind::User);
        assert_eq!(user.policy.key().kind(), "user");
        assert_eq!(user.policy.name(), "/user");
        assert_eq!(
            user.policy.rules(),
            [Rule::new(5, Duration::from_millis(500)), Rule::per_day(5)]
        );
        // 65 characters: too long to be a policy name, so the route's index names it.
        assert_eq!(long.key, KeyKind::Global);
        assert_eq!(long.policy.name(), "route-2");
    }

    #[test]
    fn bad_values_are_refused_naming_the_field() {
        let rules = |rules: &str| route_config("ip", rules);
        let cases: Vec<(String, &str)> = vec![
            (
                rules(r#"[{ limit = 20, period = "1m" }, { limit = 0, period = "1h" }]"#),
                "routes[0].rules[1].limit: must be at least 1",
            ),
            (
                rules(r#"[{ limit = 20, period = "1 m" }]"#),
                r#"routes[0].rules[0].period: invalid period "1 m": expected a positive whole number and a unit (ms, s, m, h or d), such as "500ms", "10s" or "1m""#,
            ),
            (
                rules(r#"[{ limit = 20, period = "99999999999999999d" }]"#),
                r#"routes[0].rules[0].period: period "99999999999999999d" is too long"#,
            ),
            (
                rules(r#"[{ limit = 20, period = "1m" }, { limit = 20, period = "60s" }]"#),
                "routes[0].rules[1]: 20 per 60s is the same rule as rules[0]",
            ),
            (rules("[]"), "routes[0].rules: must list at least one rule"),
            (
                edited("algorithm = \"sliding_log\"", "algorithm = \"token\""),
                r#"routes[0].algorithm: unknown algorithm "token": expected "fixed_window", "sliding_log", "sliding_counter" or "token_bucket""#,
            ),
            (
                route_config("cookie", "[{ limit = 1, period = \"1s\" }]"),
                r#"routes[0].key: unknown key "cookie": expected "ip", "user", "global", "header:<name>" or "query:<name>""#,
            ),
            (
                route_config("header:x api", "[{ limit = 1, period = \"1s\" }]"),
                r#"routes[0].key: "x api" is not a valid header name (in "header:x api")"#,
            ),
            (
                route_config("header:", "[{ limit = 1, period = \"1s\" }]"),
                r#"routes[0].key: "" is not a valid header name (in "header:")"#,
            ),
            (
                edited(
                    "trusted_proxies = []",
                    r#"trusted_proxies = ["10.0.0.0/8", "10.0.0.0/33"]"#,
                ),
                r#"trusted_proxies[1]: "10.0.0.0/33" is not a CIDR such as "10.0.0.0/8" or "fd00::/8""#,
            ),
            (
                edited(
                    "trusted_proxies = []",
                    r#"trusted_proxies = ["proxy.local"]"#,
                ),
                r#"trusted_proxies[0]: "proxy.local" is not a CIDR such as "10.0.0.0/8" or "fd00::/8""#,
            ),
            (
                edited("\"127.0.0.1:3000\"", "\"localhost:3000\""),
                r#"listen: "localhost:3000" is not an IP address and port such as "127.0.0.1:3000""#,
            ),
            (
                edited("\"127.0.0.1:3000\"", "\"127.0.0.1\""),
                r#"listen: "127.0.0.1" is not an IP address and port such as "127.0.0.1:3000""#,
            ),
            (
                edited("store = \"memory\"", "store = \"disk\""),
                r#"store: unknown store "disk": expected "memory" or a URL such as "redis://127.0.0.1:6379/0""#,
            ),
            (
                edited("on_store_error = \"allow\"", "on_store_error = \"maybe\""),
                r#"on_store_error: unknown value "maybe": expected "allow" or "deny""#,
            ),
            (
                edited("store_timeout = \"250ms\"", "store_timeout = \"fast\""),
                r#"store_timeout: invalid period "fast": expected a positive whole number and a unit (ms, s, m, h or d), such as "500ms", "10s" or "1m""#,
            ),
            (
                edited("prefix = \"demo\"", "prefix = \"my app\""),
                r#"prefix: "my app" must be 1 to 64 letters, digits and -._~@+=!*(),/ (it starts every store key)"#,
            ),
            (
                edited("prefix = \"demo\"", "prefix = \"\""),
                r#"prefix: "" must be 1 to 64 letters, digits and -._~@+=!*(),/ (it starts every store key)"#,
            ),
            (
                edited(
                    "trusted_proxies = []",
                    "trusted_proxies = []\nforwarded_header = \"x-forwarded\"",
                ),
                r#"forwarded_header: unknown forwarded header "x-forwarded": expected "x-forwarded-for", "forwarded" or "x-real-ip""#,
            ),
            (
                format!(
                    "{DEFAULT_CONFIG}\n[[routes]]\npath = \"/api/ping\"\nkey = \"ip\"\nalgorithm = \"sliding_log\"\nrules = [{{ limit = 1, period = \"1s\" }}]\n"
                ),
                r#"routes[1].path: "/api/ping" is already used by routes[0]"#,
            ),
            (
                edited("path = \"/api/ping\"", "path = \"/healthz\""),
                r#"routes[0].path: "/healthz" is the demo's health check, which is never limited"#,
            ),
            (
                edited("path = \"/api/ping\"", "path = \"api/ping\""),
                r#"routes[0].path: "api/ping" must be a literal path: "/" then letters, digits and -._~@+=!(),/"#,
            ),
            (
                edited("path = \"/api/ping\"", "path = \"/users/{id}\""),
                r#"routes[0].path: "/users/{id}" must be a literal path: "/" then letters, digits and -._~@+=!(),/"#,
            ),
            (
                format!(
                    "{}routes = []\n",
                    DEFAULT_CONFIG.split("[[routes]]").next().unwrap()
                ),
                "routes: must list at least one route",
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(error_of(&text), expected, "config:\n{text}");
        }
    }

    /// The default config with `store = "memory"` replaced by `store = <store>` and the top-level
    /// `extra` lines (such as `tls_ca = "..."`) added after `store_timeout`.
    fn with_store(store: &str, extra: &str) -> String {
        edited("store = \"memory\"", &format!("store = {store}")).replacen(
            "store_timeout = \"250ms\"",
            &format!("store_timeout = \"250ms\"\n{extra}"),
            1,
        )
    }

    /// A self-signed CA certificate (P-256) for the TLS settings' tests: parsed, never used.
    const TEST_CA_PEM: &str = "-----BEGIN CERTIFICATE-----
MIIBhDCCASugAwIBAgIUFrICZEdodkDs5H3epqKEsGMgVI4wCgYIKoZIzj0EAwIw
FzEVMBMGA1UEAwwMZGVtby10ZXN0LWNhMCAXDTI2MTEyMzA3MTgxMFoYDzIxMjYx
MDMwMDcxODEwWjAXMRUwEwYDVQQDDAxkZW1vLXRlc3QtY2EwWTATBgcqhkjOPQIB
BggqhkjOPQMBBwNCAAQTQh9iBLQcQwQxjEQq+tcb3DVQyivJLF8s5moviRN+yV3U
wd3NYxjNA+Rb2AJsJKycW1kHKYwBzuhowVGlTOeQo1MwUTAdBgNVHQ4EFgQUirrf
W9iccgAVbvgbBNFTxhrdy+MwHwYDVR0jBBgwFoAUirrfW9iccgAVbvgbBNFTxhrd
y+MwDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNHADBEAiB2XNG5Kkm+y8vL
Axnh1x4mcY1T2VlA5xFZmFKsGjIi7wIgAzXIBVML1MDMFa0hKbARgPzLkuL/7J5o
QXvkTTxEd9w=
-----END CERTIFICATE-----
";

    /// Writes `contents` to a file of this test process in the temp directory; returns its path.
    fn temp_file(name: &str, contents: &str) -> String {
        let path = std::env::temp_dir().join(format!(
            "tower-redis-ratelimit-demo-{}-{name}",
            std::process::id()
        ));
        std::fs::write(&path, contents).unwrap();
        path.to_str().unwrap().to_owned()
    }

    fn urls(list: &[&str]) -> Vec<String> {
        list.iter().map(|url| url.to_string()).collect()
    }

    #[test]
    fn wait_for_replicas_needs_a_redis_store() {
        let config = load_config(&with_store(
            r#"{ cluster = ["redis://127.0.0.1:7000"] }"#,
            "wait_for_replicas = 1",
        ))
        .unwrap();
        assert_eq!(config.wait_for_replicas, 1);
        assert_eq!(load_config(DEFAULT_CONFIG).unwrap().wait_for_replicas, 0);
        assert_eq!(
            error_of(&with_store("\"memory\"", "wait_for_replicas = 1")),
            r#"wait_for_replicas: applies only to a Redis store, not "memory""#
        );
        let negative = error_of(&with_store(
            "\"redis://127.0.0.1:6379/0\"",
            "wait_for_replicas = -1",
        ));
        assert!(negative.contains("wait_for_replicas"), "{negative}");
    }

    #[test]
    fn store_tables_become_cluster_and_sentinel_stores() {
        let timeout = Duration::from_millis(250);
        let cases = [
            (
                r#"{ cluster = ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001", "redis://127.0.0.1:7002"] }"#,
                StoreKind::Cluster {
                    urls: urls(&[
                        "redis://127.0.0.1:7000",
                        "redis://127.0.0.1:7001",
                        "redis://127.0.0.1:7002",
                    ]),
                    timeout,
                },
                "cluster(3 nodes)",
            ),
            (
                r#"{ sentinel = ["redis://127.0.0.1:26379", "redis://127.0.0.1:26380"], master = "mymaster" }"#,
                StoreKind::Sentinel {
                    master: "mymaster".into(),
                    urls: urls(&["redis://127.0.0.1:26379", "redis://127.0.0.1:26380"]),
                    timeout,
                },
                "sentinel(mymaster)",
            ),
            (
                r#"{ cluster = ["rediss://127.0.0.1:7000"] }"#,
                StoreKind::Cluster {
                    urls: urls(&["rediss://127.0.0.1:7000"]),
                    timeout,
                },
                "cluster(1 node, TLS)",
            ),
            (
                r#"{ master = "cache", sentinel = ["rediss://127.0.0.1:26379"] }"#,
                StoreKind::Sentinel {
                    master: "cache".into(),
                    urls: urls(&["rediss://127.0.0.1:26379"]),
                    timeout,
                },
                "sentinel(cache, TLS)",
            ),
            (
                r#""rediss://127.0.0.1:6380/0""#,
                StoreKind::Redis {
                    url: "rediss://127.0.0.1:6380/0".into(),
                    timeout,
                },
                "rediss://127.0.0.1:6380/0",
            ),
        ];
        for (store, kind, shown) in cases {
            let config = load_config(&with_store(store, "")).unwrap();
            assert_eq!(config.store, kind, "{store}");
            assert_eq!(config.store_tls, None, "{store}");
            let text = banner(&config, config.listen);
            assert!(
                text.starts_with(&format!(
                    "tower-redis-ratelimit demo listening on http://127.0.0.1:3000 (store: {shown}, key prefix \"demo\")\n"
                )),
                "{text}"
            );
            // The constructors check the URLs without connecting.
            let _app = build_app(&config).unwrap();
        }
        // The store timeout reaches the tables' stores too.
        let config = load_config(
            &with_store(r#"{ cluster = ["redis://127.0.0.1:7000"] }"#, "").replacen(
                "store_timeout = \"250ms\"",
                "store_timeout = \"2s\"",
                1,
            ),
        )
        .unwrap();
        assert_eq!(
            config.store,
            StoreKind::Cluster {
                urls: urls(&["redis://127.0.0.1:7000"]),
                timeout: Duration::from_secs(2),
            }
        );
    }

    #[test]
    fn the_commented_store_examples_in_demo_toml_parse() {
        let stores: Vec<&str> = DEFAULT_CONFIG
            .lines()
            .filter_map(|line| line.strip_prefix("# store = "))
            .collect();
        assert_eq!(stores.len(), 3, "{stores:?}");
        for store in &stores {
            let config = load_config(&with_store(store, ""))
                .unwrap_or_else(|error| panic!("{store}: {error}"));
            assert_ne!(config.store, StoreKind::Memory);
        }
        let tls_line = |field: &str| {
            DEFAULT_CONFIG
                .lines()
                .find_map(|line| {
                    line.strip_prefix("# ")
                        .filter(|rest| rest.starts_with(field))
                })
                .unwrap()
        };
        let rediss = stores[0];
        let config = load_config(&with_store(rediss, tls_line("tls_insecure = "))).unwrap();
        assert_eq!(
            config.store_tls,
            Some(StoreTls {
                ca: None,
                insecure: false
            })
        );
        // The CA file of the example doesn't exist here; the line itself parses.
        let error = error_of(&with_store(rediss, tls_line("tls_ca = ")));
        assert!(
            error.starts_with("tls_ca: cannot read \"certs/ca.crt\": "),
            "{error}"
        );
    }

    #[test]
    fn tls_settings_reach_the_store() {
        let ca = temp_file("ca.crt", TEST_CA_PEM);
        let with_ca = StoreTls {
            ca: Some((ca.clone(), TEST_CA_PEM.as_bytes().to_vec())),
            insecure: false,
        };
        let insecure = StoreTls {
            ca: None,
            insecure: true,
        };
        let system_roots = StoreTls {
            ca: None,
            insecure: false,
        };
        let settings = [
            (
                format!("tls_ca = {ca:?}"),
                &with_ca,
                format!("TLS CA {ca:?}"),
            ),
            (
                format!("tls_ca = {ca:?}\ntls_insecure = false"),
                &with_ca,
                format!("TLS CA {ca:?}"),
            ),
            (
                "tls_insecure = true".to_owned(),
                &insecure,
                "TLS certificates NOT checked".to_owned(),
            ),
            (
                "tls_insecure = false".to_owned(),
                &system_roots,
                "TLS CA: the system's roots".to_owned(),
            ),
        ];
        for store in [
            r#""rediss://127.0.0.1:6380/0""#,
            r#"{ cluster = ["rediss://127.0.0.1:7000", "rediss://127.0.0.1:7001"] }"#,
            r#"{ sentinel = ["rediss://127.0.0.1:26379"], master = "mymaster" }"#,
        ] {
            for (extra, expected, shown) in &settings {
                let config = load_config(&with_store(store, extra)).unwrap();
                assert_eq!(
                    config.store_tls.as_ref(),
                    Some(*expected),
                    "{store} {extra}"
                );
                let text = banner(&config, config.listen);
                assert!(
                    text.contains(&format!(", {shown}, key prefix \"demo\")\n")),
                    "{text}"
                );
                let _app = build_app(&config).unwrap();
            }
        }
        std::fs::remove_file(&ca).unwrap();
    }

    #[test]
    fn bad_store_tables_and_tls_settings_are_refused_naming_the_field() {
        let table = |store: &str| with_store(store, "");
        let rediss = r#""rediss://127.0.0.1:6380/0""#;
        let expected_store = r#"store: expected "memory", a URL, or a table with cluster = [...] or sentinel = [...] and master = "...""#;
        let not_pem = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.toml");
        let cases: Vec<(String, String)> = vec![
            (
                table(r#"{ cluster = ["redis://127.0.0.1:7000"], colour = "blue" }"#),
                r#"store.colour: unknown key: a store table takes cluster = [...], or sentinel = [...] and master = "...""#.into(),
            ),
            (
                table("{ cluster = [] }"),
                "store.cluster: must list at least one node URL".into(),
            ),
            (
                table(r#"{ sentinel = [], master = "mymaster" }"#),
                "store.sentinel: must list at least one sentinel URL".into(),
            ),
            (
                table(r#"{ cluster = ["redis://127.0.0.1:7000", "http://127.0.0.1:7001"] }"#),
                r#"store.cluster[1]: "http://127.0.0.1:7001" is not a redis:// or rediss:// URL"#.into(),
            ),
            (
                table(r#"{ sentinel = ["redis://127.0.0.1:26379", 26380], master = "mymaster" }"#),
                "store.sentinel[1]: 26380 is not a redis:// or rediss:// URL".into(),
            ),
            (
                table(r#"{ cluster = "redis://127.0.0.1:7000" }"#),
                r#"store.cluster: expected a list of node URLs such as ["redis://127.0.0.1:7000"]"#.into(),
            ),
            (
                table(r#"{ sentinel = "redis://127.0.0.1:26379", master = "mymaster" }"#),
                r#"store.sentinel: expected a list of sentinel URLs such as ["redis://127.0.0.1:26379"]"#.into(),
            ),
            (
                table(r#"{ cluster = ["rediss://127.0.0.1:7000", "redis://127.0.0.1:7001"] }"#),
                r#"store.cluster[1]: "redis://127.0.0.1:7001" and store.cluster[0] differ in TLS: use rediss:// for every URL or for none"#.into(),
            ),
            (
                table(r#"{ sentinel = ["redis://127.0.0.1:26379"] }"#),
                r#"store.master: is required with sentinel = [...]: the name the sentinels know the primary by, such as "mymaster""#.into(),
            ),
            (
                table(r#"{ sentinel = ["redis://127.0.0.1:26379"], master = "" }"#),
                r#"store.master: expected the name the sentinels know the primary by, such as "mymaster""#.into(),
            ),
            (
                table(r#"{ sentinel = ["redis://127.0.0.1:26379"], master = 1 }"#),
                r#"store.master: expected the name the sentinels know the primary by, such as "mymaster""#.into(),
            ),
            (
                table(r#"{ cluster = ["redis://127.0.0.1:7000"], master = "mymaster" }"#),
                "store.master: applies only with sentinel = [...] (a cluster finds its primaries itself)".into(),
            ),
            (
                table(
                    r#"{ cluster = ["redis://127.0.0.1:7000"], sentinel = ["redis://127.0.0.1:26379"] }"#,
                ),
                "store: expected either cluster = [...] or sentinel = [...], not both".into(),
            ),
            (table("{}"), expected_store.into()),
            (table(r#"{ master = "mymaster" }"#), expected_store.into()),
            (table("6379"), expected_store.into()),
            (table(r#"["redis://127.0.0.1:6379"]"#), expected_store.into()),
            (
                with_store(r#""memory""#, r#"tls_ca = "ca.crt""#),
                r#"tls_ca: applies only to a Redis store, not "memory""#.into(),
            ),
            (
                with_store(r#""memory""#, "tls_insecure = false"),
                r#"tls_insecure: applies only to a Redis store, not "memory""#.into(),
            ),
            (
                with_store(r#""redis://127.0.0.1:6379/0""#, "tls_insecure = true"),
                "tls_insecure: applies only to rediss:// URLs (TLS), and the store's are redis://"
                    .into(),
            ),
            (
                with_store(
                    r#"{ cluster = ["redis://127.0.0.1:7000"] }"#,
                    r#"tls_ca = "ca.crt""#,
                ),
                "tls_ca: applies only to rediss:// URLs (TLS), and the store's are redis://".into(),
            ),
            (
                with_store(rediss, "tls_ca = \"ca.crt\"\ntls_insecure = true"),
                "tls_insecure: true checks no certificate, so tls_ca would go unused: give one or the other".into(),
            ),
            (
                with_store(rediss, &format!("tls_ca = {not_pem:?}")),
                format!("tls_ca: {not_pem:?} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(error_of(&text), expected, "config:\n{text}");
        }

        // The rest of these messages comes from the OS or the Redis client.
        let bad_pem = temp_file(
            "bad.crt",
            "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n",
        );
        let starts = [
            (
                with_store(rediss, r#"tls_ca = "/nonexistent/ca.crt""#),
                r#"tls_ca: cannot read "/nonexistent/ca.crt": "#.to_owned(),
            ),
            (
                with_store(rediss, &format!("tls_ca = {bad_pem:?}")),
                format!("tls_ca: {bad_pem:?}: rate-limit store misconfigured: "),
            ),
            (
                table(r#"{ cluster = ["redis://127.0.0.1:7000", "redis://127.0.0.1:port"] }"#),
                r#"store.cluster[1]: "redis://127.0.0.1:port": rate-limit store misconfigured: "#
                    .to_owned(),
            ),
        ];
        for (text, start) in starts {
            let error = error_of(&text);
            assert!(error.starts_with(&start), "{error}\nconfig:\n{text}");
        }
        std::fs::remove_file(&bad_pem).unwrap();
    }

    /// The shipped route with `extra` lines added to it.
    fn with_route_options(extra: &str) -> String {
        edited(
            "algorithm = \"sliding_log\"",
            &format!("algorithm = \"sliding_log\"\n{extra}"),
        )
    }

    #[test]
    fn the_route_options_reach_the_policy() {
        let config = load_config(&with_route_options(
            "prevent_duplicate = true\nblock_for = \"15m\"\nmode = \"delay\"\nmax_delay = \"2s\"\n\
             cost_header = \"x-cost\"",
        ))
        .unwrap();
        let policy = &config.routes[0].policy;
        assert!(policy.rules()[2].is_duplicate_guard());
        assert_eq!(policy.rules()[2].period(), Duration::from_secs(5));
        assert_eq!(policy.block_for(), Some(Duration::from_secs(900)));
        assert_eq!(
            policy.mode(),
            Mode::Delay {
                max_delay: Duration::from_secs(2)
            }
        );
        let bucket = load_config(
            &route_config("ip", r#"[{ limit = 10, period = "1s", burst = 50 }]"#).replacen(
                "algorithm = \"sliding_log\"",
                "algorithm = \"token_bucket\"",
                1,
            ),
        )
        .unwrap();
        let policy = &bucket.routes[0].policy;
        assert_eq!(policy.algorithm(), Algorithm::TokenBucket);
        assert_eq!(policy.rules()[0].burst_size(), 50);
        let guard = load_config(&with_route_options(
            "prevent_duplicate = { limit = 1, period = \"2s\" }\nmode = \"shadow\"",
        ))
        .unwrap();
        let policy = &guard.routes[0].policy;
        assert_eq!(policy.rules()[2].period(), Duration::from_secs(2));
        assert_eq!(policy.mode(), Mode::Shadow);
        let off = load_config(&with_route_options("prevent_duplicate = false")).unwrap();
        assert_eq!(off.routes[0].policy.rules().len(), 2);
    }

    #[test]
    fn bad_route_options_are_refused_naming_the_field() {
        let cases = [
            (
                with_route_options("mode = \"delay\""),
                r#"routes[0].max_delay: is required with mode = "delay": the longest a request may wait, such as "2s""#,
            ),
            (
                with_route_options("max_delay = \"2s\""),
                r#"routes[0].max_delay: applies only with mode = "delay""#,
            ),
            (
                with_route_options("mode = \"loud\""),
                r#"routes[0].mode: unknown mode "loud": expected "enforce", "shadow" or "delay""#,
            ),
            (
                with_route_options("block_for = \"soon\""),
                r#"routes[0].block_for: invalid period "soon": expected a positive whole number and a unit (ms, s, m, h or d), such as "500ms", "10s" or "1m""#,
            ),
            (
                with_route_options("prevent_duplicate = { limit = 2, period = \"5s\" }"),
                "routes[0].prevent_duplicate.limit: the duplicate guard admits one request per period: leave out the limit or make it 1 (use a rule for more)",
            ),
            (
                with_route_options("cost_header = \"x cost\""),
                r#"routes[0].cost_header: "x cost" is not a header name"#,
            ),
            (
                route_config("ip", r#"[{ limit = 10, period = "1s", burst = 50 }]"#),
                "routes[0].rules[0].burst: 10 per 1s: a burst applies only to the token_bucket algorithm",
            ),
            (
                edited(
                    "algorithm = \"sliding_log\"",
                    "algorithm = \"fixed_window\"\nmode = \"delay\"\nmax_delay = \"1s\"",
                ),
                "routes[0].mode: delay mode needs the sliding_log or token_bucket algorithm, which can reserve a request's place in the future",
            ),
        ];
        for (config, expected) in cases {
            assert_eq!(error_of(&config), expected, "config:\n{config}");
        }
    }

    #[tokio::test]
    async fn a_cost_header_charges_several_units_and_shadow_mode_refuses_nothing() {
        let app = app_for(&with_route_options("cost_header = \"x-cost\""));
        let (status, headers, _) = send(&app, Method::GET, "/api/ping", &[("x-cost", "15")]).await;
        assert_eq!(status, StatusCode::OK);
        let limits = tower_redis_ratelimit::headers::parse(&headers).unwrap();
        assert_eq!(limits.status("20-per-60s").unwrap().remaining, 5);
        // Garbage costs 1; more than the limit could ever admit is a 413.
        let (_, headers, _) = send(&app, Method::GET, "/api/ping", &[("x-cost", "lots")]).await;
        let limits = tower_redis_ratelimit::headers::parse(&headers).unwrap();
        assert_eq!(limits.status("20-per-60s").unwrap().remaining, 4);
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &[("x-cost", "21")]).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &[("x-cost", "5")]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);

        let shadow = app_for(&with_route_options("mode = \"shadow\""));
        for _ in 0..25 {
            let (status, _, _) = send(&shadow, Method::GET, "/api/ping", &[]).await;
            assert_eq!(status, StatusCode::OK);
        }
        let (_, headers, _) = send(&shadow, Method::GET, "/api/ping", &[]).await;
        let limits = tower_redis_ratelimit::headers::parse(&headers).unwrap();
        assert_eq!(limits.status("20-per-60s").unwrap().remaining, 0);
    }

    /// The shipped config with its `[quota]` section turned on, edited by `edit`.
    fn with_quota(edit: impl Fn(String) -> String) -> String {
        let on = DEFAULT_CONFIG
            .lines()
            .map(|line| match line.strip_prefix("# ") {
                Some(rest) if rest.starts_with("[quota]") || is_quota_line(rest) => rest,
                _ => line,
            })
            .collect::<Vec<_>>()
            .join("\n");
        edit(on)
    }

    fn is_quota_line(line: &str) -> bool {
        [
            "key = \"user\"",
            "tier_header",
            "default_tier",
            "tiers =",
            "alert_at",
            "alert_webhook",
            "utc_offset",
        ]
        .iter()
        .any(|start| line.starts_with(start))
    }

    #[test]
    fn the_quota_section_reaches_every_route() {
        let config = load_config(&with_quota(|text| text)).unwrap();
        let quota = config.routes[0].policy.quota().expect("a quota");
        assert_eq!(quota.name(), "daily");
        assert_eq!(quota.limit_of("free"), Some(100));
        assert_eq!(quota.limit_of("pro"), Some(5_000));
        assert_eq!(quota.default_tier(), "free");
        assert_eq!(quota.alert_percents(), [80, 100]);
        assert_eq!(quota.utc_offset_minutes(), 0);
        assert_eq!(quota.key().kind(), "user");
        let east = load_config(&with_quota(|text| {
            text.replace("utc_offset = \"+00:00\"", "utc_offset = \"+05:30\"")
        }))
        .unwrap();
        assert_eq!(
            east.routes[0].policy.quota().unwrap().utc_offset_minutes(),
            330
        );
    }

    #[test]
    fn bad_quota_values_are_refused_naming_the_field() {
        let cases = [
            (
                with_quota(|text| text.replace("{ free = 100, pro = 5000 }", "{}")),
                "quota.tiers: must name at least one tier, such as { free = 100 }",
            ),
            (
                with_quota(|text| text.replace("free = 100", "free = 0")),
                "quota.tiers.free: must be 1 to 2^35 requests per day",
            ),
            (
                with_quota(|text| {
                    text.replace("default_tier = \"free\"", "default_tier = \"gold\"")
                }),
                r#"quota.default_tier: "gold" is not one of the tiers"#,
            ),
            (
                with_quota(|text| text.replace("default_tier = \"free\"\n", "")),
                "quota.default_tier: is required with more than one tier: the tier of requests without a known one",
            ),
            (
                with_quota(|text| text.replace("[80, 100]", "[0, 100]")),
                "quota.alert_at: 0 is not a percent from 1 to 100",
            ),
            (
                with_quota(|text| text.replace("\"+00:00\"", "\"UTC\"")),
                r#"quota.utc_offset: "UTC" is not an offset such as "+00:00", "+05:30" or "-08:00" (at most 18 hours)"#,
            ),
            (
                with_quota(|text| text.replace("\"+00:00\"", "\"+19:00\"")),
                r#"quota.utc_offset: "+19:00" is not an offset such as "+00:00", "+05:30" or "-08:00" (at most 18 hours)"#,
            ),
            (
                with_quota(|text| text.replace("http://127.0.0.1:9000/alerts", "ftp://x")),
                r#"quota.alert_webhook: "ftp://x" is not an http:// URL"#,
            ),
        ];
        for (config, expected) in cases {
            assert_eq!(error_of(&config), expected, "config:\n{config}");
        }
    }

    #[tokio::test]
    async fn the_quota_counts_per_user_by_tier_across_requests() {
        let app = app_for(&with_quota(|text| {
            text.replace("free = 100", "free = 3")
                .replace("alert_webhook = \"http://127.0.0.1:9000/alerts\"\n", "")
        }));
        let headers = [("x-user-id", "hana")];
        for _ in 0..3 {
            let (status, _, _) = send(&app, Method::GET, "/api/ping", &headers).await;
            assert_eq!(status, StatusCode::OK);
        }
        let (status, response_headers, body) = send(&app, Method::GET, "/api/ping", &headers).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(body.contains(r#""violated-policies":["daily"]"#), "{body}");
        assert!(
            response_headers["ratelimit-policy"]
                .to_str()
                .unwrap()
                .ends_with("\"daily\";q=3;w=86400")
        );
        // As pro, the same count is under a larger limit.
        let pro = [("x-user-id", "hana"), ("x-tier", "pro")];
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &pro).await;
        assert_eq!(status, StatusCode::OK);
    }

    #[test]
    fn toml_errors_name_the_field_and_line() {
        // (config, where toml points, toml's last line: the field and what is wrong with it)
        let cases: Vec<(String, &str, &str)> = vec![
            (
                format!("colour = \"blue\"\n{DEFAULT_CONFIG}"),
                "line 1, column 1",
                "unknown field `colour`, expected one of `listen`, `store`, `prefix`, \
                 `trusted_proxies`, `legacy_headers`, `forwarded_header`, `on_store_error`, \
                 `store_timeout`, `tls_ca`, `tls_insecure`, `wait_for_replicas`, `metrics`, `routes`, \
                 `quota`",
            ),
            (
                edited("key = \"ip\"", "methods = [\"GET\"]"),
                "line 19, column 1",
                "unknown field `methods`, expected one of `path`, `key`, `algorithm`, `rules`, \
                 `prevent_duplicate`, `block_for`, `mode`, `max_delay`, `cost_header`, `max_in_flight`, `lease`",
            ),
            (
                edited(
                    "{ limit = 100, period = \"1h\" }",
                    "{ limit = 100, period = \"1h\", colour = 5 }",
                ),
                "line 21, column 71",
                "unknown field `colour`, expected one of `limit`, `period`, `burst`",
            ),
            (
                edited("listen = \"127.0.0.1:3000\"\n", ""),
                "line 1, column 1",
                "missing field `listen`",
            ),
            (
                edited("path = \"/api/ping\" ", "# no path "),
                "line 17, column 1",
                "missing field `path`",
            ),
            (
                edited("{ limit = 100, period = \"1h\" }", "{ limit = 100 }"),
                "line 21, column 41",
                "missing field `period`",
            ),
            (
                edited("limit = 20,", "limit = \"20\","),
                "line 21, column 20",
                "invalid type: string \"20\", expected u64",
            ),
            (
                edited("limit = 20,", "limit = -1,"),
                "line 21, column 20",
                "invalid value: integer `-1`, expected u64",
            ),
            (
                edited("legacy_headers = false", "legacy_headers = \"no\""),
                "line 7, column 18",
                "invalid type: string \"no\", expected a boolean",
            ),
            (
                edited("prefix = \"demo\"", "prefix = demo"),
                "line 3, column 10",
                "string values must be quoted, expected literal string",
            ),
        ];
        for (text, position, problem) in cases {
            let message = error_of(&text);
            assert!(
                message.starts_with(&format!("TOML parse error at {position}\n")),
                "{message}"
            );
            assert_eq!(message.lines().last(), Some(problem), "{message}");
        }
    }

    #[test]
    fn periods_are_a_positive_integer_and_a_unit() {
        for (text, expected) in [
            ("500ms", Duration::from_millis(500)),
            ("1ms", Duration::from_millis(1)),
            ("10s", Duration::from_secs(10)),
            ("1m", Duration::from_secs(60)),
            ("1h", Duration::from_secs(3_600)),
            ("1d", Duration::from_secs(86_400)),
            ("90m", Duration::from_secs(5_400)),
        ] {
            assert_eq!(parse_period(text), Ok(expected), "{text:?}");
        }
        for bad in [
            "", "0s", "0ms", "1.5s", "10", "5w", "-1s", "+1s", "s", " 1s", "1s ", "1 s", "1S",
            "1sec", "1m1s", "١s",
        ] {
            let error = parse_period(bad).expect_err(bad);
            assert_eq!(
                error,
                format!(
                    "invalid period {bad:?}: expected a positive whole number and a unit (ms, s, m, h or d), such as \"500ms\", \"10s\" or \"1m\""
                )
            );
        }
    }

    #[test]
    fn policy_names_follow_the_store_key_rule() {
        assert_eq!(policy_name("/api/ping", 0), "/api/ping");
        let longest = format!("/{}", "a".repeat(63));
        assert_eq!(policy_name(&longest, 3), longest);
        assert_eq!(policy_name(&format!("/{}", "a".repeat(64)), 3), "route-3");
        assert!(policy::is_valid_name("a-Z_0.~@+=!*(),/"));
        for bad in ["", "a:b", "a b", "{x}", "é"] {
            assert!(!policy::is_valid_name(bad), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn no_limiter_serves_the_routes_unlimited() {
        let mut config = load_config(DEFAULT_CONFIG).unwrap();
        config.no_limiter = true;
        assert!(banner(&config, config.listen).contains("WITHOUT rate limiting"));
        let app = build_app(&config)
            .unwrap()
            .layer(MockConnectInfo(SocketAddr::from(PEER)));
        for _ in 0..25 {
            let response = app
                .clone()
                .oneshot(Request::get("/api/ping").body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            assert!(!response.headers().contains_key("ratelimit"));
        }
    }

    #[test]
    fn command_line() {
        let read = |list: &[&str]| read_command_line(list.iter().map(|a| a.to_string()));
        let built_in = |no_limiter| {
            Ok(Some(CommandLine {
                source: "demo.toml (built in)".to_owned(),
                text: DEFAULT_CONFIG.to_owned(),
                no_limiter,
            }))
        };
        assert_eq!(read(&[]), built_in(false));
        assert_eq!(read(&["--no-limiter"]), built_in(true));
        assert_eq!(read(&["--help"]), Ok(None));
        let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.toml");
        let from_file = |no_limiter| {
            Ok(Some(CommandLine {
                source: shipped.to_owned(),
                text: DEFAULT_CONFIG.to_owned(),
                no_limiter,
            }))
        };
        assert_eq!(read(&["--config", shipped]), from_file(false));
        assert_eq!(read(&[&format!("--config={shipped}")]), from_file(false));
        assert_eq!(
            read(&["--no-limiter", "--config", shipped]),
            from_file(true)
        );
        for wrong in [
            &["--config"][..],
            &["--port", "3000"],
            &["--config", shipped, "extra"],
            &["--config", shipped, "--config", shipped],
        ] {
            assert_eq!(read(wrong), Err(USAGE.to_owned()), "{wrong:?}");
        }
        let missing = "/nonexistent/demo.toml";
        let error = read(&["--config", missing]).unwrap_err();
        assert!(
            error.starts_with("/nonexistent/demo.toml: cannot read the config file: "),
            "{error}"
        );
    }

    #[test]
    fn banner_shows_the_routes_and_the_curl_commands() {
        let config = load_config(DEFAULT_CONFIG).unwrap();
        assert_eq!(
            banner(&config, config.listen),
            "tower-redis-ratelimit demo listening on http://127.0.0.1:3000 (store: memory, key prefix \"demo\")\n\
             \x20 GET|POST /api/ping -> 200 \"PONG\"; per client IP, sliding_log: 20 per 60s and 100 per 3600s\n\
             \x20 GET /healthz -> 200 \"ok\", never limited\n\
             \n\
             Try it: requests 1-20 get 200, the next ones 429 (each refusal is logged):\n\
             \x20 for i in $(seq 1 22); do curl -s -o /dev/null -w \"%{http_code}\\n\" http://127.0.0.1:3000/api/ping; done\n\
             See the headers:\n\
             \x20 curl -i http://127.0.0.1:3000/api/ping\n\
             Ctrl-C stops the server.\n"
        );
        // A wildcard address is curled on loopback; a user key needs its header.
        let config = load_config(
            &route_config("user", "[{ limit = 3, period = \"1m\" }]").replacen(
                "127.0.0.1:3000",
                "0.0.0.0:8080",
                1,
            ),
        )
        .unwrap();
        let text = banner(&config, config.listen);
        assert!(text.starts_with("tower-redis-ratelimit demo listening on http://0.0.0.0:8080 "));
        assert!(text.contains(
            "  for i in $(seq 1 5); do curl -s -o /dev/null -w \"%{http_code}\\n\" -H \"x-user-id: alice\" http://127.0.0.1:8080/api/ping; done\n"
        ), "{text}");
    }

    const PEER: ([u8; 4], u16) = ([127, 0, 0, 1], 40_000);

    /// The app of config `text`, its requests coming from `PEER` (axum's `MockConnectInfo`, which
    /// the limiter reads as the peer address, as the `ConnectInfo` extractor does).
    fn app_for(text: &str) -> Router {
        let config = load_config(text).unwrap();
        build_app(&config)
            .unwrap()
            .layer(MockConnectInfo(SocketAddr::from(PEER)))
    }

    async fn send(
        app: &Router,
        method: Method,
        uri: &str,
        headers: &[(&str, &str)],
    ) -> (StatusCode, HeaderMap, String) {
        let mut request = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = app
            .clone()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let (parts, body) = response.into_parts();
        let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        (
            parts.status,
            parts.headers,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    }

    fn retry_after(headers: &HeaderMap) -> u64 {
        headers["retry-after"].to_str().unwrap().parse().unwrap()
    }

    use super::redis_server;

    /// The default config with `/work` as its route, keyed by user, one job at a time per user.
    fn one_job_per_user(store: &str, prefix: &str) -> String {
        route_config("user", "[{ limit = 100, period = \"1m\" }]")
            .replacen(
                "path = \"/api/ping\"",
                "path = \"/work\"\nmax_in_flight = 1\nlease = \"30s\"",
                1,
            )
            .replacen("store = \"memory\"", &format!("store = {store:?}"), 1)
            .replacen("prefix = \"demo\"", &format!("prefix = {prefix:?}"), 1)
            .replacen("store_timeout = \"250ms\"", "store_timeout = \"2s\"", 1)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn max_in_flight_runs_one_job_per_user_across_two_instances_on_one_redis() {
        let redis = redis_server::TestRedis::shared();
        let prefix = redis_server::unique_prefix("work");
        let text = one_job_per_user(&redis.url, &prefix);
        let instances = [app_for(&text), app_for(&text)];
        let user = [("x-user-id", "ann")];
        let jobs: Vec<_> = (0..10)
            .map(|n| {
                let app = instances[n % 2].clone();
                tokio::spawn(async move {
                    send(&app, Method::GET, "/work?ms=1000", &[("x-user-id", "ann")]).await
                })
            })
            .collect();
        let mut statuses = Vec::new();
        for job in jobs {
            let (status, headers, body) = job.await.unwrap();
            if status == StatusCode::TOO_MANY_REQUESTS {
                assert!(
                    body.contains(r#""violated-policies":["1-in-flight"]"#),
                    "{body}"
                );
                assert!(
                    headers["ratelimit-policy"]
                        .to_str()
                        .unwrap()
                        .ends_with(r#""1-in-flight";q=1"#),
                    "{headers:?}"
                );
            }
            statuses.push(status);
        }
        let admitted = statuses.iter().filter(|&&s| s == StatusCode::OK).count();
        let refused = statuses
            .iter()
            .filter(|&&s| s == StatusCode::TOO_MANY_REQUESTS)
            .count();
        assert_eq!((admitted, refused), (1, 9), "{statuses:?}");
        // Done: the next job of the user is admitted at once, on either instance; another user
        // was never held.
        for app in &instances {
            let (status, _, body) = send(app, Method::POST, "/work?ms=0", &user).await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "done"));
        }
        let (status, _, _) = send(
            &instances[0],
            Method::GET,
            "/work?ms=0",
            &[("x-user-id", "bob")],
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn work_sleeps_as_asked_and_refuses_anything_else() {
        // Unlimited when not listed in the routes.
        let app = app_for(DEFAULT_CONFIG);
        let started = std::time::Instant::now();
        let (status, headers, body) = send(&app, Method::GET, "/work?ms=150", &[]).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "done"));
        assert!(started.elapsed() >= Duration::from_millis(150));
        assert!(!headers.contains_key("ratelimit"));
        let (status, _, _) = send(&app, Method::POST, "/work?ms=0", &[]).await;
        assert_eq!(status, StatusCode::OK);
        for bad in [
            "/work",
            "/work?ms=",
            "/work?ms=-1",
            "/work?ms=10001",
            "/work?ms=1.5",
            "/work?ms=1&ms=2",
            "/work?n=3",
        ] {
            let (status, _, body) = send(&app, Method::GET, bad, &[]).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
        }
        let (status, _, _) = send(&app, Method::GET, "/work?ms=10000&x=1", &[]).await;
        assert_eq!(status, StatusCode::OK);
    }

    #[test]
    fn max_in_flight_and_lease_go_together() {
        let route = |extra: &str| {
            edited(
                "path = \"/api/ping\"",
                &format!("path = \"/work\"\n{extra}"),
            )
        };
        let config = load_config(&route("max_in_flight = 2\nlease = \"30s\"")).unwrap();
        let limit = config.routes[0].policy.concurrency().unwrap();
        assert_eq!(
            (limit.max_in_flight(), limit.lease()),
            (2, Duration::from_secs(30))
        );
        assert!(
            error_of(&route("max_in_flight = 1"))
                .contains("routes[0].lease: is required with max_in_flight"),
            "{}",
            error_of(&route("max_in_flight = 1"))
        );
        assert!(
            error_of(&route("lease = \"30s\""))
                .contains("routes[0].lease: applies only with max_in_flight")
        );
        assert!(
            error_of(&route("max_in_flight = 0\nlease = \"30s\""))
                .contains("routes[0].max_in_flight: must be at least 1")
        );
        assert!(
            error_of(&route("max_in_flight = 1\nlease = \"soon\"")).contains("routes[0].lease")
        );
        assert!(error_of(&route("max_in_flight = -1\nlease = \"1s\"")).contains("max_in_flight"));
    }

    #[tokio::test]
    async fn a_query_key_counts_each_token_once() {
        let text = route_config("query:token", "[{ limit = 1, period = \"1h\" }]");
        let config = load_config(&text).unwrap();
        assert_eq!(config.routes[0].key, KeyKind::Query("token".into()));
        let app = app_for(&text);
        let (first, _, _) = send(&app, Method::GET, "/api/ping?token=abc", &[]).await;
        let (again, _, _) = send(&app, Method::GET, "/api/ping?token=abc", &[]).await;
        let (other, _, _) = send(&app, Method::GET, "/api/ping?token=xyz", &[]).await;
        assert_eq!(
            [first, again, other],
            [
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::OK
            ]
        );
        assert!(
            error_of(&route_config("query:", "[{ limit = 1, period = \"1h\" }]"))
                .contains("routes[0].key")
        );
    }

    #[tokio::test]
    async fn a_redis_store_limits_with_keys_under_the_prefix() {
        let redis = redis_server::TestRedis::shared();
        let prefix = redis_server::unique_prefix("demo");
        let text = DEFAULT_CONFIG
            .replace("store = \"memory\"", &format!("store = {:?}", redis.url))
            .replace("prefix = \"demo\"", &format!("prefix = {prefix:?}"))
            .replace("on_store_error = \"allow\"", "on_store_error = \"deny\"")
            .replace("store_timeout = \"250ms\"", "store_timeout = \"2s\"");
        let config = load_config(&text).unwrap();
        assert_eq!(
            config.store,
            StoreKind::Redis {
                url: redis.url.clone(),
                timeout: Duration::from_secs(2),
            }
        );
        assert_eq!(config.routes[0].policy.on_store_error(), OnStoreError::Deny);
        let app = app_for(&text);
        for i in 1..=20 {
            let (status, _, body) = send(&app, Method::GET, "/api/ping", &[]).await;
            assert_eq!(
                (status, body.as_str()),
                (StatusCode::OK, "PONG"),
                "request {i}"
            );
        }
        let (status, headers, _) = send(&app, Method::GET, "/api/ping", &[]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!((1..=60).contains(&retry_after(&headers)));

        // Every key the demo wrote starts with the prefix and expires.
        let mut client = redis.client();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query(&mut client)
            .unwrap();
        assert_eq!(keys.len(), 2, "{keys:?}");
        for key in keys {
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut client).unwrap();
            assert!(ttl > 0, "{key}: {ttl}");
        }
    }

    #[tokio::test]
    async fn the_default_app_limits_ping_but_not_healthz() {
        let app = app_for(DEFAULT_CONFIG);
        for i in 1..=20 {
            let (status, headers, body) = send(&app, Method::GET, "/api/ping", &[]).await;
            assert_eq!(
                (status, body.as_str()),
                (StatusCode::OK, "PONG"),
                "request {i}"
            );
            assert!(headers.contains_key("ratelimit"), "request {i}");
            assert!(!headers.contains_key("x-ratelimit-limit"), "request {i}");
        }
        let (status, headers, body) = send(&app, Method::GET, "/api/ping", &[]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!((59..=60).contains(&retry_after(&headers)), "{headers:?}");
        assert_eq!(headers["content-type"], "application/problem+json");
        assert!(
            body.contains(r#""violated-policies":["20-per-60s"]"#),
            "{body}"
        );

        for _ in 0..3 {
            let (status, headers, body) = send(&app, Method::GET, "/healthz", &[]).await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
            assert!(!headers.contains_key("ratelimit"));
        }
        // GET and POST share the route's budget.
        let (status, _, _) = send(&app, Method::POST, "/api/ping", &[]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        let (status, _, _) = send(&app, Method::GET, "/nowhere", &[]).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn user_keys_fall_back_to_the_client_ip() {
        let app = app_for(&route_config("user", "[{ limit = 2, period = \"1m\" }]"));
        let alice = [(USER_ID_HEADER, "alice")];
        let bob = [(USER_ID_HEADER, "bob")];
        let expected = [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
        ];
        for who in [&alice[..], &bob[..], &[]] {
            for (i, want) in expected.iter().enumerate() {
                let (status, _, _) = send(&app, Method::GET, "/api/ping", who).await;
                assert_eq!(status, *want, "{who:?} request {}", i + 1);
            }
        }
    }

    #[tokio::test]
    async fn header_and_global_keys_and_legacy_headers() {
        let text = route_config("header:x-api-key", "[{ limit = 1, period = \"1m\" }]").replacen(
            "legacy_headers = false",
            "legacy_headers = true",
            1,
        ) + "\n[[routes]]\npath = \"/global\"\nkey = \"global\"\nalgorithm = \"fixed_window\"\n\
               rules = [{ limit = 1, period = \"1h\" }]\n";
        let app = app_for(&text);
        let (status, headers, _) =
            send(&app, Method::GET, "/api/ping", &[("x-api-key", "k1")]).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["x-ratelimit-limit"], "1");
        assert_eq!(headers["x-ratelimit-remaining"], "0");
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &[("x-api-key", "k1")]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &[("x-api-key", "k2")]).await;
        assert_eq!(status, StatusCode::OK);

        let (status, _, _) = send(&app, Method::GET, "/global", &[("x-api-key", "k3")]).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _, _) = send(&app, Method::GET, "/global", &[(USER_ID_HEADER, "x")]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    }

    #[tokio::test]
    async fn trusted_proxies_make_forwarded_clients_count_apart() {
        let one_per_minute = route_config("ip", "[{ limit = 1, period = \"1m\" }]");
        let forwarded = |client| [("x-forwarded-for", client)];
        let expected_behind_proxy = [
            ("127.0.0.2", StatusCode::OK),
            ("127.0.0.3", StatusCode::OK),
            ("127.0.0.2", StatusCode::TOO_MANY_REQUESTS),
        ];
        let app = app_for(&one_per_minute.replacen(
            "trusted_proxies = []",
            "trusted_proxies = [\"127.0.0.1/32\"]\nforwarded_header = \"x-forwarded-for\"",
            1,
        ));
        for (client, want) in expected_behind_proxy {
            let (status, _, _) = send(&app, Method::GET, "/api/ping", &forwarded(client)).await;
            assert_eq!(status, want, "{client}");
        }
        // Without trusted proxies the header is ignored: both are the peer, 127.0.0.1.
        let app = app_for(&one_per_minute);
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &forwarded("127.0.0.2")).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &forwarded("127.0.0.3")).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    }

    #[test]
    fn the_metrics_listener_is_an_address_or_absent() {
        let config = load_config(DEFAULT_CONFIG).unwrap();
        assert_eq!(config.metrics, None);
        let with = |value: &str| {
            DEFAULT_CONFIG.replacen(
                "legacy_headers = false",
                &format!("legacy_headers = false\nmetrics = {value}"),
                1,
            )
        };
        let config = load_config(&with("\"127.0.0.1:9091\"")).unwrap();
        assert_eq!(
            config.metrics,
            Some(SocketAddr::from(([127, 0, 0, 1], 9091)))
        );
        let error = load_config(&with("\"localhost:9091\""))
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("metrics: \"localhost:9091\" is not an IP address and port"),
            "{error}"
        );
    }

    /// A port nothing listens on right now.
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// The sum of the series `name` whose labels include all of `labels`, in Prometheus text.
    fn scraped(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
        text.lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
                let matches = metric == name
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
                matches.then(|| value.parse::<f64>().unwrap())
            })
            .sum()
    }

    /// The metric names in the `expr` of every panel of the shipped Grafana dashboard.
    fn dashboard_metrics() -> std::collections::BTreeSet<String> {
        let text = include_str!("grafana/ratelimit.json");
        let dashboard: serde_json::Value = serde_json::from_str(text).unwrap();
        let mut names = std::collections::BTreeSet::new();
        for panel in dashboard["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                let expr = target["expr"].as_str().unwrap();
                let mut rest = expr;
                while let Some(at) = rest.find("ratelimit_") {
                    let name: String = rest[at..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    rest = &rest[at + name.len()..];
                    names.insert(name);
                }
            }
        }
        names
    }

    /// Serves alerts: 200 for the one at 80 %, 500 for any other (the notifier retries, then
    /// gives up: a failed alert).
    async fn alert_webhook() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route(
            "/alerts",
            axum::routing::post(|body: axum::body::Bytes| async move {
                let alert: serde_json::Value = serde_json::from_slice(&body).unwrap();
                if alert["percent"] == 80 {
                    StatusCode::OK
                } else {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    }

    /// Starts the demo on a free port; its address.
    async fn start(text: String) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(run(load_config(&text).unwrap(), listener));
        addr
    }

    /// The one test of this binary that installs the Prometheus recorder (a process has one): a
    /// known mix of traffic, then every counter of `/metrics` is what was sent, the top refused
    /// identities are who was refused, and every metric the Grafana dashboard queries is there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_operator_listener_counts_a_known_traffic_mix_exactly() {
        let metrics_port = free_port();
        let hook = alert_webhook().await;
        let main = start(format!(
            r#"listen = "127.0.0.1:0"
store = "memory"
prefix = "ops"
trusted_proxies = []
legacy_headers = false
metrics = "127.0.0.1:{metrics_port}"

[[routes]]
path = "/two-rules"
key = "user"
algorithm = "sliding_log"
rules = [{{ limit = 2, period = "1s" }}, {{ limit = 3, period = "1h" }}]
cost_header = "x-cost"

[[routes]]
path = "/shadow"
key = "user"
algorithm = "sliding_log"
rules = [{{ limit = 1, period = "1m" }}]
mode = "shadow"

[[routes]]
path = "/delay"
key = "user"
algorithm = "sliding_log"
rules = [{{ limit = 1, period = "1s" }}]
mode = "delay"
max_delay = "5s"

[[routes]]
path = "/quota"
key = "user"
algorithm = "sliding_log"
rules = [{{ limit = 100, period = "1m" }}]

[quota]
tiers = {{ free = 5 }}
alert_at = [80, 100]
alert_webhook = "http://{hook}/alerts"
"#
        ))
        .await;
        // Two more instances on a Redis that isn't there: one fails open, one closed. Their layers
        // record into the same process's recorder.
        let down = free_port();
        let outage = |path: &str, on_error: &str| {
            format!(
                r#"listen = "127.0.0.1:0"
store = "redis://127.0.0.1:{down}/0"
prefix = "ops"
on_store_error = "{on_error}"
trusted_proxies = []
legacy_headers = false

[[routes]]
path = "{path}"
key = "ip"
algorithm = "fixed_window"
rules = [{{ limit = 10, period = "1m" }}]
"#
            )
        };
        let open = start(outage("/down-open", "allow")).await;
        let closed = start(outage("/down-closed", "deny")).await;

        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let get = |addr: SocketAddr, path: &str, user: &str, cost: &str| {
            let request = client
                .get(format!("http://{addr}{path}"))
                .header("x-user-id", user)
                .header("x-cost", cost);
            async move { request.send().await.unwrap().status().as_u16() }
        };
        // Two admitted, the third refused by the per-second rule alone; a second later one more
        // admitted (the hour's last) and the next refused by the hour's rule alone; then a cost
        // no rule admits.
        let mut two_rules = Vec::new();
        for _ in 0..3 {
            two_rules.push(get(main, "/two-rules", "alice", "1").await);
        }
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        for _ in 0..2 {
            two_rules.push(get(main, "/two-rules", "alice", "1").await);
        }
        two_rules.push(get(main, "/two-rules", "alice", "100").await);
        assert_eq!(two_rules, [200, 200, 429, 200, 429, 413]);
        let mut shadow = Vec::new();
        for _ in 0..3 {
            shadow.push(get(main, "/shadow", "sam", "1").await);
        }
        assert_eq!(shadow, [200; 3]);
        let delay = [
            get(main, "/delay", "dora", "1").await,
            get(main, "/delay", "dora", "1").await,
        ];
        assert_eq!(delay, [200, 200]);
        let mut quota = Vec::new();
        for _ in 0..6 {
            quota.push(get(main, "/quota", "quinn", "1").await);
        }
        assert_eq!(quota, [200, 200, 200, 200, 200, 429]);
        for _ in 0..2 {
            assert_eq!(get(open, "/down-open", "x", "1").await, 200);
            assert_eq!(get(closed, "/down-closed", "x", "1").await, 503);
        }

        let metrics_url = format!("http://127.0.0.1:{metrics_port}/metrics");
        let alerts = [
            ("quota", "daily"),
            ("percent", "100"),
            ("outcome", "failed"),
        ];
        let mut text = String::new();
        // The alert at 100 % fails after the notifier's retries (100 + 200 + 400 ms).
        for _ in 0..100 {
            text = client
                .get(&metrics_url)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if scraped(&text, "ratelimit_quota_alerts_total", &alerts) == 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let requests = |policy: &str, outcome: &str| {
            scraped(
                &text,
                "ratelimit_requests_total",
                &[("policy", policy), ("outcome", outcome)],
            )
        };
        let expected = [
            ("/two-rules", "allowed", 3.0),
            ("/two-rules", "refused", 2.0),
            ("/two-rules", "too_costly", 1.0),
            ("/shadow", "allowed", 1.0),
            ("/shadow", "shadow_refused", 2.0),
            ("/delay", "allowed", 1.0),
            ("/delay", "delayed", 1.0),
            ("/quota", "allowed", 5.0),
            ("/quota", "refused", 1.0),
            ("/down-open", "store_error_allowed", 2.0),
            ("/down-closed", "store_error_denied", 2.0),
        ];
        for (policy, outcome, count) in expected {
            assert_eq!(
                requests(policy, outcome),
                count,
                "{policy} {outcome}\n{text}"
            );
        }
        // Nothing else was counted for these policies (other tests of this process may count
        // under their own).
        let policies: std::collections::BTreeSet<&str> =
            expected.iter().map(|(policy, _, _)| *policy).collect();
        for policy in policies {
            let sent: f64 = expected
                .iter()
                .filter(|(name, _, _)| *name == policy)
                .map(|(_, _, count)| count)
                .sum();
            let counted = scraped(&text, "ratelimit_requests_total", &[("policy", policy)]);
            assert_eq!(counted, sent, "{policy}\n{text}");
        }
        let rule = |metric: &str, policy: &str, rule: &str| {
            scraped(&text, metric, &[("policy", policy), ("rule", rule)])
        };
        let refusals = "ratelimit_rule_refusals_total";
        // The too-costly request counts against the rule with the smallest limit.
        assert_eq!(rule(refusals, "/two-rules", "2-per-1s"), 2.0);
        assert_eq!(rule(refusals, "/two-rules", "3-per-3600s"), 1.0);
        assert_eq!(rule(refusals, "/shadow", "1-per-60s"), 2.0);
        assert_eq!(rule(refusals, "/quota", "daily"), 1.0);
        let refused_here: f64 = ["/two-rules", "/shadow", "/quota", "/delay"]
            .iter()
            .map(|policy| scraped(&text, refusals, &[("policy", policy)]))
            .sum();
        assert_eq!(refused_here, 6.0, "{text}");
        let near = "ratelimit_near_limit_total";
        assert_eq!(rule(near, "/two-rules", "2-per-1s"), 1.0);
        assert_eq!(rule(near, "/two-rules", "3-per-3600s"), 1.0);
        assert_eq!(rule(near, "/quota", "daily"), 1.0);
        let quota_alert = |percent: &str, outcome: &str| {
            let labels = [
                ("quota", "daily"),
                ("percent", percent),
                ("outcome", outcome),
            ];
            scraped(&text, "ratelimit_quota_alerts_total", &labels)
        };
        assert_eq!(quota_alert("80", "sent"), 1.0);
        assert_eq!(quota_alert("100", "failed"), 1.0);
        assert_eq!(scraped(&text, "ratelimit_quota_alerts_total", &[]), 2.0);
        let redis = [("store", "redis")];
        assert_eq!(scraped(&text, "ratelimit_store_errors_total", &redis), 4.0);
        let failed_calls = [("store", "redis"), ("outcome", "error")];
        let timed_out = [("store", "redis"), ("outcome", "timeout")];
        let count = "ratelimit_store_duration_seconds_count";
        assert_eq!(
            scraped(&text, count, &failed_calls) + scraped(&text, count, &timed_out),
            4.0
        );
        let delays = [("policy", "/delay")];
        assert_eq!(
            scraped(&text, "ratelimit_delay_seconds_count", &delays),
            1.0
        );
        assert!(
            !text.contains("alice") && !text.contains("quinn"),
            "identities in labels"
        );

        // Every metric the dashboard queries is exported.
        let names = dashboard_metrics();
        assert!(names.len() >= 7, "{names:?}");
        for name in &names {
            let exported = text
                .lines()
                .any(|line| !line.starts_with('#') && line.starts_with(&format!("{name}{{")));
            assert!(
                exported,
                "the dashboard queries {name}, which /metrics lacks:\n{text}"
            );
        }

        // The most refused identities, per policy.
        let top: serde_json::Value = client
            .get(format!(
                "http://127.0.0.1:{metrics_port}/debug/ratelimit/top?n=5"
            ))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let alice = &top["/two-rules"][0];
        assert_eq!(alice["identity"], "user:alice", "{top}");
        assert_eq!(
            (alice["count"].as_u64(), alice["error"].as_u64()),
            (Some(3), Some(0))
        );
        assert_eq!(top["/quota"][0]["identity"], "user:quinn", "{top}");
        assert_eq!(top["/shadow"][0]["count"], 2, "{top}");
        assert_eq!(top["/delay"], serde_json::json!([]), "{top}");

        // One identity: inspected (nothing counted), reset, admitted again.
        let one = |identity: &str| {
            format!("http://127.0.0.1:{metrics_port}/debug/ratelimit/%2Ftwo-rules/{identity}")
        };
        let inspect = || async {
            let response = client.get(one("user:alice")).send().await.unwrap();
            assert_eq!(response.status(), reqwest::StatusCode::OK);
            response.json::<serde_json::Value>().await.unwrap()
        };
        let state = inspect().await;
        let remaining = |state: &serde_json::Value| [0, 1].map(|i| state[i]["remaining"].clone());
        assert_eq!(
            remaining(&state),
            remaining(&inspect().await),
            "inspection counts nothing"
        );
        assert_eq!(state[1]["rule"], "3-per-3600s", "{state}");
        assert_eq!(
            (state[1]["limit"].as_u64(), state[1]["remaining"].as_u64()),
            (Some(3), Some(0))
        );
        assert_eq!(get(main, "/two-rules", "alice", "1").await, 429);
        let deleted = client.delete(one("user:alice")).send().await.unwrap();
        assert_eq!(deleted.status(), reqwest::StatusCode::NO_CONTENT);
        assert_eq!(inspect().await[1]["remaining"], 3);
        assert_eq!(get(main, "/two-rules", "alice", "1").await, 200);
        let unknown = format!("http://127.0.0.1:{metrics_port}/debug/ratelimit/%2Fnope/user:alice");
        let status = |url: String| {
            let request = client.get(url);
            async move { request.send().await.unwrap().status().as_u16() }
        };
        assert_eq!(status(unknown).await, 404);
        assert_eq!(status(one("user:%7Bx%7D")).await, 400);
    }

    #[tokio::test]
    async fn run_serves_the_curl_loop_over_tcp() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(run(load_config(DEFAULT_CONFIG).unwrap(), listener));
        // Proxy settings from the environment must not divert loopback requests.
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let url = format!("http://{addr}/api/ping");
        for i in 1..=22 {
            let response = client.get(&url).send().await.unwrap();
            let status = response.status();
            if i <= 20 {
                assert_eq!(status, reqwest::StatusCode::OK, "request {i}");
                assert_eq!(response.text().await.unwrap(), "PONG", "request {i}");
            } else {
                assert_eq!(
                    status,
                    reqwest::StatusCode::TOO_MANY_REQUESTS,
                    "request {i}"
                );
                let retry: u64 = response.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(
                    (1..=60).contains(&retry),
                    "request {i}: Retry-After {retry}"
                );
            }
        }
        let health = client
            .get(format!("http://{addr}/healthz"))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status(), reqwest::StatusCode::OK);
        assert_eq!(health.text().await.unwrap(), "ok");

        assert!(!server.is_finished());
        server.abort();
        assert!(server.await.unwrap_err().is_cancelled());
    }
}
