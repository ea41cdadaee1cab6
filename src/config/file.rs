//! The configuration format as written: what serde reads from TOML (or YAML, JSON, …), before
//! [`RateLimitConfig`](super::RateLimitConfig) checks it.
//!
//! Values that need words when they are wrong (keys, algorithms, durations, addresses) stay
//! strings here, so the check can say which field is wrong and why. Every field with an obvious
//! default may be left out; unknown fields are errors, so a typo can't silently disable a limit.
//!
//! Every type here is also a [`JsonSchema`]: [`json_schema`](super::json_schema) gives the
//! format as a JSON Schema, whose descriptions are these doc comments.

use std::collections::BTreeMap;
use std::fmt;

use schemars::JsonSchema;
use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::policy::MAX_LIMIT;

/// The whole file.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[schemars(
    title = "tower-redis-ratelimit configuration",
    description = "Rate limits of an axum app (tower-redis-ratelimit, feature `config`): where the \
                   counts live, how clients are told apart, the limited `routes` and an optional \
                   daily `quota`. Durations are written as people write them: \"500ms\", \"10s\", \
                   \"1m\", \"1h30m\", \"1d\". Every table below the top level takes only the fields \
                   listed. The top level is open: the app that loads the file may keep fields of \
                   its own there (the demo's `listen` and `metrics`), which it names to the \
                   loader (`ConfigLoader::app_fields`); the loader refuses any other unknown \
                   top-level field."
)]
pub struct ConfigFile {
    /// Where the counts live: `"memory"` (default), a `redis://` / `rediss://` URL, or a table
    /// `{ cluster = [...] }` or `{ sentinel = [...], master = "..." }`.
    #[serde(default)]
    #[schemars(extend("default" = "memory"))]
    pub store: StoreConfig,
    /// The start of every store key: 1 to 64 letters, digits and `-._~@+=!*(),/` (default `"rl"`).
    #[serde(default)]
    #[schemars(extend("default" = "rl"))]
    pub prefix: Option<String>,
    /// `"allow"` (default) lets requests through when the store fails, `"deny"` answers 503.
    #[serde(default)]
    #[schemars(extend("enum" = ["allow", "deny", null], "default" = "allow"))]
    pub on_store_error: Option<String>,
    /// How long a store answer may take before it counts as a store failure: a duration
    /// (default `"250ms"`).
    #[serde(default)]
    #[schemars(extend("examples" = ["250ms", "1s"], "default" = "250ms"))]
    pub store_timeout: Option<String>,
    /// CIDRs (or bare addresses) of proxies whose forwarding headers are believed (default none).
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// Pins the forwarding header read from trusted proxies: `"x-forwarded-for"`, `"forwarded"`
    /// or `"x-real-ip"`, in any case (default: the first present of the three).
    #[serde(default)]
    pub forwarded_header: Option<String>,
    /// Also send `X-RateLimit-*` headers (default false).
    #[serde(default)]
    pub legacy_headers: bool,
    /// With `rediss://` URLs only: a PEM file of CA certificates to trust (default: the
    /// system's roots).
    #[serde(default)]
    pub tls_ca: Option<String>,
    /// With `rediss://` URLs only: `true` checks no certificate (tests and private networks;
    /// default false).
    #[serde(default)]
    pub tls_insecure: Option<bool>,
    /// With a Redis store only: replicas that must acknowledge an admission (default 0, off).
    #[serde(default)]
    #[schemars(extend("default" = 0))]
    pub wait_for_replicas: Option<u32>,
    /// The limited routes (at least one).
    #[schemars(length(min = 1))]
    pub routes: Vec<RouteConfig>,
    /// A daily quota by tier on every route, on top of its rules (default none).
    #[serde(default)]
    pub quota: Option<QuotaConfig>,
    /// Top-level fields this crate doesn't know: refused, unless the app that loads the file
    /// takes them ([`ConfigLoader::app_fields`](super::ConfigLoader::app_fields)).
    #[serde(flatten)]
    #[schemars(skip)]
    pub(crate) other: BTreeMap<String, IgnoredAny>,
}

/// A `[[routes]]` entry.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("anyOf" = [{ "required": ["path"] }, { "required": ["paths"] }]))]
pub struct RouteConfig {
    /// The route's path, as given to axum's `Router::route` (or a request's own path, such as a
    /// gRPC method's `/package.Service/Method`); it starts with `/`. A route names `path`,
    /// `paths` or both.
    #[serde(default)]
    #[schemars(regex(pattern = "^/"))]
    pub path: Option<String>,
    /// More paths that share the route's policy and one count per identity: one budget across
    /// routes or transports, e.g. `["/api/ping", "/grpc.health.v1.Health/Check"]`.
    #[serde(default)]
    #[schemars(transform = no_default, length(min = 1), inner(regex(pattern = "^/")))]
    pub paths: Vec<String>,
    /// The policy's name (default: the path, or `route-<index>` when the path can't be a name).
    #[serde(default)]
    pub name: Option<String>,
    /// How clients are told apart: `"ip"` (default), `"user"`, `"global"`, `"header:<name>"` or
    /// `"query:<name>"`.
    #[serde(default)]
    #[schemars(
        regex(pattern = "^(ip|user|global|header:.+|query:.+)$"),
        extend("default" = "ip")
    )]
    pub key: Option<String>,
    /// `"sliding_log"` (default), `"fixed_window"`, `"sliding_counter"` or `"token_bucket"`.
    #[serde(default)]
    #[schemars(extend(
        "enum" = ["sliding_log", "fixed_window", "sliding_counter", "token_bucket", null],
        "default" = "sliding_log",
    ))]
    pub algorithm: Option<String>,
    /// `{ limit, period }` rules that must all pass (at least one, unless `max_in_flight` is set).
    #[serde(default)]
    #[schemars(transform = no_default)]
    pub rules: Vec<RuleConfig>,
    /// `true` refuses a second request within 5 s; `{ period = "2s" }` sets the window (default
    /// off).
    #[serde(default)]
    #[schemars(extend("default" = false))]
    pub prevent_duplicate: Option<DuplicateConfig>,
    /// Once a rule refuses a client, refuse it outright this long: a duration (default off).
    #[serde(default)]
    #[schemars(extend("examples" = ["15m", "1h"]))]
    pub block_for: Option<String>,
    /// `"enforce"` (default), `"shadow"` (log and count, never refuse) or `"delay"` (wait for a
    /// slot; requires `max_delay`).
    #[serde(default)]
    #[schemars(extend("enum" = ["enforce", "shadow", "delay", null], "default" = "enforce"))]
    pub mode: Option<String>,
    /// With `mode = "delay"` (required there): the longest a request waits, a duration.
    #[serde(default)]
    #[schemars(extend("examples" = ["2s"]))]
    pub max_delay: Option<String>,
    /// A header whose whole number is the request's cost (default: every request costs 1).
    #[serde(default)]
    pub cost_header: Option<String>,
    /// Only responses of these statuses count: codes (`401`) and classes (`"5xx"`), such as
    /// `[401, 403]` for failed logins (default: every admitted request counts).
    #[serde(default)]
    #[schemars(length(min = 1), extend("examples" = [[401, 403], ["5xx"]]))]
    pub count_only: Option<Vec<StatusItem>>,
    /// Up to this many units of an identity taken ahead per instance, spent without asking the
    /// store (default off): `fixed_window`, `sliding_counter` or `token_bucket` only.
    #[serde(default)]
    #[schemars(range(min = 1, max = MAX_LIMIT))]
    pub prefetch: Option<u64>,
    /// At most this many requests of one key in progress at once (requires `lease`; default
    /// off).
    #[serde(default)]
    #[schemars(range(min = 1, max = MAX_LIMIT))]
    pub max_in_flight: Option<u64>,
    /// With `max_in_flight` (required there): the longest a request holds its slot, a duration.
    #[serde(default)]
    #[schemars(extend("examples" = ["30s"]))]
    pub lease: Option<String>,
    /// Identities or client networks treated apart: unlimited, denied, or with rules of their
    /// own (default none).
    #[serde(default)]
    pub overrides: Vec<OverrideConfig>,
    /// What the route's `metered = true` rules (and a metered `[quota]`) count, such as
    /// `{ unit = "tokens", estimate = 500, usage_header = "x-usage-tokens" }` (default none).
    #[serde(default)]
    pub meter: Option<MeterConfig>,
}

/// A route's `meter`: metered units reserved when a request is admitted and settled from what
/// its response reports.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MeterConfig {
    /// The units counted, a word of ASCII letters, digits and `_`: `"tokens"`.
    #[schemars(regex(pattern = "^[A-Za-z0-9_]+$"), extend("examples" = ["tokens"]))]
    pub unit: String,
    /// The units a request reserves when it is admitted (default 1).
    #[serde(default)]
    #[schemars(range(min = 0, max = MAX_LIMIT), extend("default" = 1))]
    pub estimate: Option<u64>,
    /// A request header whose whole number is the request's estimate (set by a layer you
    /// trust); without it, or not a number, `estimate` applies.
    #[serde(default)]
    pub estimate_header: Option<String>,
    /// The response header that reports the units used, a whole number (default: the handler
    /// records them with `Usage`).
    #[serde(default)]
    pub usage_header: Option<String>,
    /// The most one report counts (default: the largest metered limit).
    #[serde(default)]
    #[schemars(range(min = 1, max = MAX_LIMIT))]
    pub max_usage: Option<u64>,
}

/// An `overrides` entry: `identity` or `cidr`, and exactly one of `rules`, `unlimited = true` or
/// `deny = true`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OverrideConfig {
    /// The identity the route's key yields: a user id, a header or query value, a client
    /// address.
    #[serde(default)]
    pub identity: Option<String>,
    /// A client network, `"10.0.0.0/8"` (or a bare address).
    #[serde(default)]
    pub cidr: Option<String>,
    /// Rules instead of the route's.
    #[serde(default)]
    pub rules: Option<Vec<RuleConfig>>,
    /// `true`: not limited, not counted.
    #[serde(default)]
    pub unlimited: Option<bool>,
    /// `true`: refused with 403, counted nowhere.
    #[serde(default)]
    pub deny: Option<bool>,
}

/// A status in `count_only`: a code (`401`) or a class (`"4xx"`).
#[derive(Debug, Clone, PartialEq, JsonSchema)]
#[schemars(untagged)]
pub enum StatusItem {
    /// A status code, 100 to 599.
    Code(#[schemars(range(min = 100, max = 599))] i64),
    /// A class, `"1xx"` to `"5xx"` (or a code as a string).
    Written(#[schemars(regex(pattern = "^([1-5][xX][xX]|[1-5][0-9][0-9])$"))] String),
}

impl<'de> Deserialize<'de> for StatusItem {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Item;

        impl serde::de::Visitor<'_> for Item {
            type Value = StatusItem;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a status code (401) or a class (\"4xx\")")
            }

            fn visit_i64<E>(self, code: i64) -> Result<StatusItem, E> {
                Ok(StatusItem::Code(code))
            }

            fn visit_u64<E: serde::de::Error>(self, code: u64) -> Result<StatusItem, E> {
                i64::try_from(code)
                    .map(StatusItem::Code)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(code), &self))
            }

            fn visit_str<E>(self, text: &str) -> Result<StatusItem, E> {
                Ok(StatusItem::Written(text.to_owned()))
            }
        }

        deserializer.deserialize_any(Item)
    }
}

/// One rule: at most `limit` per `period`.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// Requests (or cost units) per period, 1 to 2^35.
    #[schemars(range(min = 1, max = MAX_LIMIT))]
    pub limit: u64,
    /// The period, a duration: `"500ms"`, `"10s"`, `"1m"`, `"1h30m"`, `"1d"`.
    #[schemars(extend("examples" = ["1s", "1m", "1h30m", "1d"]))]
    pub period: String,
    /// `token_bucket` only: the bucket size (default: the limit).
    #[serde(default)]
    pub burst: Option<u64>,
    /// `true`: the rule counts the route's metered units (its `meter`) rather than requests
    /// (default `false`).
    #[serde(default)]
    #[schemars(extend("default" = false))]
    pub metered: bool,
}

/// `prevent_duplicate`: `true`/`false`, or a table with the window.
#[derive(Debug, Clone, PartialEq, JsonSchema)]
// Deserialize is written by hand below (for its errors): the schema says untagged itself.
#[schemars(untagged)]
pub enum DuplicateConfig {
    /// `true` (a 5-second window) or `false` (off).
    On(bool),
    /// `{ period = "2s" }`.
    Rule(DuplicateRule),
}

/// A boolean or a table, each with its own errors (an untagged enum would only say that nothing
/// matched).
impl<'de> Deserialize<'de> for DuplicateConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DuplicateVisitor;

        impl<'de> Visitor<'de> for DuplicateVisitor {
            type Value = DuplicateConfig;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("true, false, or a table such as { period = \"2s\" }")
            }

            fn visit_bool<E: de::Error>(self, on: bool) -> Result<DuplicateConfig, E> {
                Ok(DuplicateConfig::On(on))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<DuplicateConfig, A::Error> {
                DuplicateRule::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(DuplicateConfig::Rule)
            }
        }

        deserializer.deserialize_any(DuplicateVisitor)
    }
}

/// The duplicate guard's window.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DuplicateRule {
    /// 1 if given: the guard admits one request per period.
    #[serde(default)]
    #[schemars(range(min = 1, max = 1))]
    pub limit: Option<u64>,
    /// The window, a duration.
    #[schemars(extend("examples" = ["2s"]))]
    pub period: String,
}

/// The `[quota]` section.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    /// How clients are told apart, as for routes (default `"user"`).
    #[serde(default)]
    #[schemars(
        regex(pattern = "^(ip|user|global|header:.+|query:.+)$"),
        extend("default" = "user")
    )]
    pub key: Option<String>,
    /// The header the tier is read from (default `"x-tier"`); set it in a layer you trust.
    #[serde(default)]
    #[schemars(extend("default" = "x-tier"))]
    pub tier_header: Option<String>,
    /// The tier of requests without a known one (required with several tiers).
    #[serde(default)]
    pub default_tier: Option<String>,
    /// Tier names and requests per day (1 to 2^35), `{ free = 100, pro = 5000 }`; at least one.
    #[schemars(extend(
        "minProperties" = 1,
        "additionalProperties" = { "type": "integer", "minimum": 1, "maximum": MAX_LIMIT },
    ))]
    pub tiers: BTreeMap<String, u64>,
    /// Alert thresholds in percent, 1 to 100 (default `[80, 100]`).
    #[serde(default)]
    #[schemars(inner(range(min = 1, max = 100)), extend("default" = [80, 100]))]
    pub alert_at: Option<Vec<u16>>,
    /// An `http://` URL alerts are posted to as JSON (feature `webhook`; default: only logged).
    #[serde(default)]
    pub alert_webhook: Option<String>,
    /// Where days start: `"+00:00"` (default), `"+05:30"`, `"-08:00"`.
    #[serde(default)]
    #[schemars(extend("default" = "+00:00"))]
    pub utc_offset: Option<String>,
    /// `true`: the quota counts metered units ("2 million tokens a day"), on the routes with a
    /// `meter`; routes without one are not counted by it (default `false`: it counts requests
    /// on every route).
    #[serde(default)]
    #[schemars(extend("default" = false))]
    pub metered: bool,
}

/// Leaves a field's default out of its schema: `rules = []` is the serde default, but the
/// loader refuses it on most routes.
fn no_default(schema: &mut schemars::Schema) {
    schema.remove("default");
}

/// The `store` value.
// Its schema says what the hand-written `Deserialize` below reads: a string or a `StoreTable`.
#[derive(Debug, Clone, PartialEq, Eq, JsonSchema)]
#[schemars(untagged)]
pub enum StoreConfig {
    /// `"memory"` (counts in this process) or a `redis://` / `rediss://` URL.
    #[schemars(extend("examples" = ["memory", "redis://127.0.0.1:6379/0"]))]
    Named(String),
    /// `{ cluster = [...] }` or `{ sentinel = [...], master = "..." }`.
    Table(StoreTable),
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Named("memory".to_owned())
    }
}

/// A Redis Cluster or Sentinel store.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StoreTable {
    /// Node URLs of a Redis Cluster.
    #[serde(default)]
    pub cluster: Option<Vec<String>>,
    /// Sentinel URLs (with `master`).
    #[serde(default)]
    pub sentinel: Option<Vec<String>>,
    /// The name the sentinels know the primary by.
    #[serde(default)]
    pub master: Option<String>,
}

/// A string or a table, each deserialised with its own errors (an untagged enum would only say
/// that nothing matched).
impl<'de> Deserialize<'de> for StoreConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StoreVisitor;

        impl<'de> Visitor<'de> for StoreVisitor {
            type Value = StoreConfig;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "\"memory\", a URL, or a table with cluster = [...] or sentinel = [...] and \
                     master = \"...\"",
                )
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<StoreConfig, E> {
                Ok(StoreConfig::Named(text.to_owned()))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<StoreConfig, A::Error> {
                StoreTable::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(StoreConfig::Table)
            }
        }

        deserializer.deserialize_any(StoreVisitor)
    }
}
