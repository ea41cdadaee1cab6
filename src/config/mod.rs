//! Limits from a configuration file (feature `config`): [`RateLimitConfig`].
//!
//! The format is the one `examples/demo.toml` shows. Every field with an obvious default may be
//! left out, so the smallest file is one route with its rules:
//!
//! ```toml
//! [[routes]]
//! path = "/api/ping"
//! rules = [{ limit = 10, period = "1m" }, { limit = 100, period = "1h" }]
//! ```
//!
//! | field | default |
//! |---|---|
//! | `store` | `"memory"`; or a `redis://` / `rediss://` URL, `{ cluster = [...] }`, `{ sentinel = [...], master = "..." }` |
//! | `prefix` | `"rl"` |
//! | `on_store_error` | `"allow"` (or `"deny"`: 503) |
//! | `store_timeout` | `"250ms"` |
//! | `trusted_proxies` | none |
//! | `forwarded_header` | the first present of `x-forwarded-for`, `forwarded`, `x-real-ip` |
//! | `legacy_headers` | `false` |
//! | `tls_ca`, `tls_insecure`, `wait_for_replicas` | none, `false`, `0` (Redis only) |
//! | `routes[].path`, `routes[].paths` | at least one path in all: `path`, `paths` or both; several paths (`paths = ["/api/ping", "/grpc.health.v1.Health/Check"]`) share one policy and one count per identity |
//! | `routes[].name` | the (first) path, or `route-` and a hash of it when the path can't be a policy name (a template such as `/users/{id}`, a `:`, `%` or space, over 64 bytes): never the route's place in the file, so reordering routes or inserting one keeps every count |
//! | `routes[].key` | `"ip"`; or `"user"` ([`UserId`](crate::UserId)), `"global"`, `"header:<name>"`, `"query:<name>"` |
//! | `routes[].algorithm` | `"sliding_log"`; or `"fixed_window"`, `"sliding_counter"`, `"token_bucket"` |
//! | `routes[].mode` | `"enforce"`; or `"shadow"`, `"delay"` (with `max_delay`) |
//! | `routes[].prevent_duplicate`, `block_for`, `cost_header`, `max_in_flight` + `lease` | off |
//! | `routes[].prefetch` | off; units an instance takes ahead per identity ([`PolicyBuilder::prefetch`](crate::PolicyBuilder::prefetch)) |
//! | `routes[].count_only` | every admitted request counts; or the statuses that do: `[401, 403]`, `["5xx"]` ([`PolicyBuilder::count_only`](crate::PolicyBuilder::count_only)) |
//! | `routes[].overrides` | none; entries `{ identity = "..." }` or `{ cidr = "..." }` with one of `rules = [...]`, `unlimited = true`, `deny = true` ([`Override`](crate::policy::Override)) |
//! | `[quota]` | none; `key` `"user"`, `tier_header` `"x-tier"`, `alert_at` `[80, 100]`, `utc_offset` `"+00:00"` |
//!
//! Durations are written as people write them, `"500ms"`, `"10s"`, `"1m"`, `"1h30m"`, `"1d"`
//! (parsed by `humantime`). Unknown fields are errors, so a typo can't silently disable a limit,
//! and every error names its field and, for a file read here, its line and column:
//! `routes[0].rules[1].limit: must be at least 1 (line 5, column 50)`. A bad file is refused
//! whole.
//!
//! [`RouteLimitsLayer::reload`] swaps a running layer's policies at once, and a [`ConfigWatcher`]
//! does it when the file changes or on `SIGHUP`. [`json_schema`] gives the format as a JSON
//! Schema, for editors and checks; the repository ships it as
//! `schema/ratelimit-config.schema.json`.
//!
//! ```
//! use axum::{Router, routing::get};
//! use tower_redis_ratelimit::config::RateLimitConfig;
//!
//! let config = RateLimitConfig::from_toml_str(r#"
//!     [[routes]]
//!     path = "/api/ping"
//!     rules = [{ limit = 10, period = "1m" }]
//! "#).unwrap();
//! let app: Router = config
//!     .apply(Router::new().route("/api/ping", get(|| async { "PONG" })))
//!     .unwrap();
//! assert_eq!(config.policy("/api/ping").unwrap().rules()[0].limit(), 10);
//!
//! let error = RateLimitConfig::from_toml_str("[[routes]]\npath = \"/a\"\nrules = [{ limit = 0, period = \"1m\" }]")
//!     .unwrap_err();
//! assert_eq!(error.to_string(), "routes[0].rules[0].limit: must be at least 1 (line 3, column 20)");
//! ```

mod check;
mod error;
mod file;
mod layer;
mod store;
mod watch;

use std::path::Path;
use std::sync::Arc;

use axum::Router;
use ipnet::IpNet;
use serde::{Deserialize, Deserializer};

pub use error::ConfigError;
pub use file::{
    ConfigFile, DuplicateConfig, DuplicateRule, MeterConfig, OverrideConfig, QuotaConfig,
    RouteConfig, RuleConfig, StatusItem, StoreConfig, StoreTable,
};
pub use layer::{ReloadSummary, RouteLimits, RouteLimitsLayer};
pub use store::{StoreSpec, StoreTls};
pub use watch::{ConfigWatcher, DEFAULT_POLL_INTERVAL};

use crate::RateLimitLayer;
use crate::client_ip::ForwardedHeader;
use crate::policy::Policy;
#[cfg(feature = "redis")]
use crate::store::RedisStore;
use crate::store::{Store, StoreError};
use store::RedisSettings;

/// The key prefix when the file names none.
pub const DEFAULT_PREFIX: &str = "rl";

/// The `$id` of [`json_schema`]: a name for the format, not a place to fetch it from.
const SCHEMA_ID: &str = "urn:tower-redis-ratelimit:config";

/// The configuration format as a JSON Schema (draft 7), generated from [`ConfigFile`] and the
/// types it holds, titled "tower-redis-ratelimit configuration", its `$id`
/// `urn:tower-redis-ratelimit:config` (a name, not a place to fetch it from).
///
/// The repository ships it as `schema/ratelimit-config.schema.json`: point an editor at it (with
/// Taplo or Even Better TOML, a comment `#:schema <path or URL>` at the top of the TOML file) to
/// get completion, each field's description and default on hover, and typos underlined. It is
/// draft 7 rather than 2020-12 so that editors' TOML tooling reads it (Taplo validates with
/// drafts 4 to 7).
///
/// The schema gives the shape of a file: types, required fields, the known values of `algorithm`,
/// `mode` and `on_store_error`, and tables that take only their own fields, except the top level,
/// which stays open for the app's own fields ([`ConfigLoader::app_fields`]; the loader refuses
/// those the app doesn't name). The loader checks more than the schema can say (durations, URLs
/// and CIDRs parse; `max_delay` only with `mode = "delay"`; an override names one of `identity`
/// and `cidr`), so a file the schema accepts can still be refused, naming its field.
///
/// ```
/// let schema = tower_redis_ratelimit::config::json_schema();
/// assert_eq!(schema["title"], "tower-redis-ratelimit configuration");
/// let route = &schema["definitions"]["RouteConfig"];
/// assert_eq!(route["additionalProperties"], false);
/// // A route names a `path`, several `paths`, or both.
/// assert_eq!(
///     route["anyOf"],
///     serde_json::json!([{ "required": ["path"] }, { "required": ["paths"] }])
/// );
/// ```
pub fn json_schema() -> serde_json::Value {
    use schemars::transform::{RecursiveTransform, Transform};

    let mut schema = schemars::generate::SchemaSettings::draft07()
        .into_generator()
        .into_root_schema_for::<ConfigFile>();
    RecursiveTransform(|schema: &mut schemars::Schema| {
        // An `Option` field's serde default is `None`, which says nothing: the fields whose
        // default means something say it themselves.
        if schema
            .get("default")
            .is_some_and(serde_json::Value::is_null)
        {
            schema.remove("default");
        }
        // Doc comments are wrapped at 100 columns; a description is one line per paragraph.
        if let Some(serde_json::Value::String(text)) = schema.get_mut("description") {
            *text = text
                .split("\n\n")
                .map(|paragraph| paragraph.replace('\n', " "))
                .collect::<Vec<_>>()
                .join("\n\n");
        }
    })
    .transform(&mut schema);
    schema.insert("$id".to_owned(), SCHEMA_ID.into());
    schema.to_value()
}

/// A checked configuration: a policy per route, and the store they count in.
///
/// Build it with [`RateLimitConfig::from_toml_str`] or [`RateLimitConfig::from_path`], or
/// deserialize it with any serde format (YAML, JSON, …): the same checks run, and a bad value is
/// refused naming its field (without a line and column, which only this crate's TOML reading
/// adds).
#[derive(Debug, Clone)]
pub struct RateLimitConfig {
    store: StoreSpec,
    redis: RedisSettings,
    prefix: String,
    trusted_proxies: Vec<IpNet>,
    forwarded_header: Option<ForwardedHeader>,
    legacy_headers: bool,
    routes: Vec<RouteLimit>,
}

/// One `[[routes]]` entry, checked: its path and the policy built for it.
#[derive(Debug, Clone)]
pub struct RouteLimit {
    path: String,
    paths: Vec<String>,
    key: String,
    policy: Policy,
    source: RouteSource,
}

/// What a route's policy was built from: its entry as written and the file's settings that
/// every policy takes (not its place in the file: nothing of the policy depends on it). Two
/// equal sources build the same policy, so a reload keeps that route's limiter (and its caches)
/// as it is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RouteSource {
    route: file::RouteConfig,
    settings: Arc<SharedSettings>,
}

/// The top-level fields that go into every route's policy.
#[derive(Debug, PartialEq)]
pub(crate) struct SharedSettings {
    prefix: String,
    on_store_error: Option<String>,
    trusted_proxies: Vec<String>,
    forwarded_header: Option<String>,
    legacy_headers: bool,
    quota: Option<file::QuotaConfig>,
}

impl RouteLimit {
    /// The route's path, as axum's `MatchedPath` gives it: its first, when it lists several.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Every path of the route (`path`, then `paths`): they share its policy and its counts.
    pub fn paths(&self) -> &[String] {
        &self.paths
    }

    /// The route's `key` as written (`"ip"` when left out).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The route's policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

impl RateLimitConfig {
    /// Reads and checks a TOML configuration.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        ConfigLoader::new().from_toml_str(text)
    }

    /// Reads and checks the TOML file at `path`.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        ConfigLoader::new().from_path(path)
    }

    /// Checks a file already read (in any serde format).
    pub fn from_file(file: &ConfigFile) -> Result<Self, ConfigError> {
        check::check_file(file, &[])
    }

    /// A loader that lets an app keep fields of its own at the top level of the file.
    pub fn loader() -> ConfigLoader {
        ConfigLoader::new()
    }

    /// The checked routes, in file order.
    pub fn routes(&self) -> &[RouteLimit] {
        &self.routes
    }

    /// The policy named `name` (a route's `name`, by default its path).
    pub fn policy(&self, name: &str) -> Option<&Policy> {
        self.routes
            .iter()
            .map(|route| &route.policy)
            .find(|policy| policy.name() == name)
    }

    /// Where the counts live.
    pub fn store_spec(&self) -> &StoreSpec {
        &self.store
    }

    /// The start of every store key.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The proxies whose forwarding headers are believed.
    pub fn trusted_proxies(&self) -> &[IpNet] {
        &self.trusted_proxies
    }

    /// The forwarding header pinned by `forwarded_header`; `None`: the first present of
    /// `X-Forwarded-For`, `Forwarded` and `X-Real-IP`.
    pub fn forwarded_header(&self) -> Option<ForwardedHeader> {
        self.forwarded_header
    }

    /// The TLS settings of a store over `rediss://`, when `tls_ca` or `tls_insecure` is given.
    pub fn store_tls(&self) -> Option<&StoreTls> {
        self.redis.tls.as_ref()
    }

    /// How many replicas must acknowledge an admission (`wait_for_replicas`; 0: off).
    pub fn wait_for_replicas(&self) -> u32 {
        self.redis.wait_for_replicas
    }

    /// Whether responses also carry `X-RateLimit-*`.
    pub fn legacy_headers(&self) -> bool {
        self.legacy_headers
    }

    /// Opens the configured store (a Redis store connects at its first check, so a Redis that is
    /// down is a store failure per request, handled as `on_store_error` says).
    pub fn open_store(&self) -> Result<Arc<dyn Store>, StoreError> {
        self.store.open(&self.redis)
    }

    /// The configured Redis store, as [`RateLimitConfig::open_store`] opens it, for what only a
    /// Redis store does ([`RedisStore::probe`] at start, say); `None` when the file names the
    /// memory store.
    #[cfg(feature = "redis")]
    pub fn open_redis_store(&self) -> Result<Option<RedisStore>, StoreError> {
        self.store.open_redis(&self.redis)
    }

    /// The layer of the policy named `name`, counting in `store`; `None` for an unknown name.
    pub fn layer(&self, name: &str, store: Arc<dyn Store>) -> Option<RateLimitLayer> {
        let policy = self.policy(name)?.clone();
        Some(RateLimitLayer::new(policy, store).legacy_headers(self.legacy_headers))
    }

    /// The layer that limits every route of the file by its policy, picking each request's by
    /// its matched path, counting in `store`; it can [reload](RouteLimitsLayer::reload) later.
    pub fn route_limits(&self, store: Arc<dyn Store>) -> Result<RouteLimitsLayer, ConfigError> {
        RouteLimitsLayer::build(self, store)
    }

    /// Adds each route's policy to `router`'s route of that path, counting in the configured
    /// store ([`RateLimitConfig::open_store`]). Routes the file doesn't name stay unlimited; a
    /// path the router lacks limits nothing. Call it after the routes are added (like
    /// `Router::route_layer`, which it uses).
    pub fn apply<S>(&self, router: Router<S>) -> Result<Router<S>, ConfigError>
    where
        S: Clone + Send + Sync + 'static,
    {
        let store = self
            .open_store()
            .map_err(|error| ConfigError::new("store", error.to_string()))?;
        Ok(router.route_layer(self.route_limits(store)?))
    }
}

/// Reads a configuration, optionally leaving top-level fields to the app that loads it.
#[derive(Debug, Clone, Default)]
pub struct ConfigLoader {
    app_fields: Vec<String>,
}

impl ConfigLoader {
    /// A loader that refuses every field it doesn't know.
    pub fn new() -> Self {
        ConfigLoader::default()
    }

    /// Accepts these top-level fields without reading them: the app reads them itself (the demo's
    /// `listen` and `metrics`).
    pub fn app_fields<I, F>(mut self, fields: I) -> Self
    where
        I: IntoIterator<Item = F>,
        F: Into<String>,
    {
        self.app_fields.extend(fields.into_iter().map(Into::into));
        self
    }

    /// Reads and checks a TOML configuration.
    pub fn from_toml_str(&self, text: &str) -> Result<RateLimitConfig, ConfigError> {
        let document = toml::Deserializer::parse(text)
            .map_err(|error| ConfigError::new("", error.message()).at_span(text, error.span()))?;
        let file: ConfigFile = serde_path_to_error::deserialize(document).map_err(|error| {
            let path = error.path().to_string();
            let path = if path == "." { String::new() } else { path };
            let inner = error.into_inner();
            ConfigError::new(path, inner.message()).at_span(text, inner.span())
        })?;
        let fields: Vec<&str> = self.app_fields.iter().map(String::as_str).collect();
        check::check_file(&file, &fields).map_err(|error| error.locate_in_toml(text))
    }

    /// Reads and checks the TOML file at `path`.
    pub fn from_path(&self, path: impl AsRef<Path>) -> Result<RateLimitConfig, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|error| {
            ConfigError::new("", format!("cannot read {}: {error}", path.display()))
        })?;
        self.from_toml_str(&text)
    }
}

/// Deserializes the file format, then checks it (a bad value is a custom error naming its field).
impl<'de> Deserialize<'de> for RateLimitConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let file = ConfigFile::deserialize(deserializer)?;
        RateLimitConfig::from_file(&file).map_err(serde::de::Error::custom)
    }
}
