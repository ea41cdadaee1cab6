//! The configuration format as written: what serde reads from TOML (or YAML, JSON, …), before
//! [`RateLimitConfig`](super::RateLimitConfig) checks it.
//!
//! Values that need words when they are wrong (keys, algorithms, durations, addresses) stay
//! strings here, so the check can say which field is wrong and why. Every field with an obvious
//! default may be left out; unknown fields are errors, so a typo can't silently disable a limit.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
pub struct ConfigFile {
    /// Where the counts live: `"memory"` (default), a `redis://` / `rediss://` URL, or a table
    /// `{ cluster = [...] }` or `{ sentinel = [...], master = "..." }`.
    #[serde(default)]
    pub store: StoreConfig,
    /// The start of every store key (default `"rl"`).
    #[serde(default)]
    pub prefix: Option<String>,
    /// `"allow"` (default) lets requests through when the store fails, `"deny"` answers 503.
    #[serde(default)]
    pub on_store_error: Option<String>,
    /// How long a store answer may take (default `"250ms"`).
    #[serde(default)]
    pub store_timeout: Option<String>,
    /// CIDRs (or bare addresses) of proxies whose forwarding headers are believed (default none).
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// Pins the forwarding header read from trusted proxies: `"x-forwarded-for"`, `"forwarded"`
    /// or `"x-real-ip"` (default: the first present of the three).
    #[serde(default)]
    pub forwarded_header: Option<String>,
    /// Also send `X-RateLimit-*` headers (default false).
    #[serde(default)]
    pub legacy_headers: bool,
    /// With `rediss://` URLs only: a PEM file of CA certificates to trust.
    #[serde(default)]
    pub tls_ca: Option<String>,
    /// With `rediss://` URLs only: `true` checks no certificate (tests and private networks).
    #[serde(default)]
    pub tls_insecure: Option<bool>,
    /// With a Redis store only: replicas that must acknowledge an admission (default 0, off).
    #[serde(default)]
    pub wait_for_replicas: Option<u32>,
    /// The limited routes.
    pub routes: Vec<RouteConfig>,
    /// A daily quota by tier on every route, on top of its rules.
    #[serde(default)]
    pub quota: Option<QuotaConfig>,
    /// Top-level fields this crate doesn't know: refused, unless the app that loads the file
    /// takes them ([`ConfigLoader::app_fields`](super::ConfigLoader::app_fields)).
    #[serde(flatten)]
    pub(crate) other: BTreeMap<String, IgnoredAny>,
}

/// A `[[routes]]` entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The route's path, as given to axum's `Router::route`.
    pub path: String,
    /// The policy's name (default: the path, or `route-<index>` when the path can't be a name).
    #[serde(default)]
    pub name: Option<String>,
    /// `ip` (default), `user`, `global`, `header:<name>` or `query:<name>`.
    #[serde(default)]
    pub key: Option<String>,
    /// `sliding_log` (default), `fixed_window`, `sliding_counter` or `token_bucket`.
    #[serde(default)]
    pub algorithm: Option<String>,
    /// `{ limit, period }` pairs that must all pass.
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    /// `true` refuses a second request within 5 s; `{ period = "2s" }` sets the window.
    #[serde(default)]
    pub prevent_duplicate: Option<DuplicateConfig>,
    /// Once a rule refuses a client, refuse it outright this long.
    #[serde(default)]
    pub block_for: Option<String>,
    /// `"enforce"` (default), `"shadow"` or `"delay"` (which requires `max_delay`).
    #[serde(default)]
    pub mode: Option<String>,
    /// With `mode = "delay"`: the longest a request waits.
    #[serde(default)]
    pub max_delay: Option<String>,
    /// A header whose whole number is the request's cost (default: every request costs 1).
    #[serde(default)]
    pub cost_header: Option<String>,
    /// At most this many requests of one key in progress at once (requires `lease`).
    #[serde(default)]
    pub max_in_flight: Option<u64>,
    /// With `max_in_flight`: the longest a request holds its slot.
    #[serde(default)]
    pub lease: Option<String>,
    /// Identities or client networks treated apart: unlimited, denied, or with rules of their
    /// own.
    #[serde(default)]
    pub overrides: Vec<OverrideConfig>,
}

/// An `overrides` entry: `identity` or `cidr`, and exactly one of `rules`, `unlimited = true` or
/// `deny = true`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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

/// One rule: at most `limit` per `period`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// Requests (or cost units) per period.
    pub limit: u64,
    /// The period: `"500ms"`, `"10s"`, `"1m"`, `"1h30m"`, `"1d"`.
    pub period: String,
    /// `token_bucket` only: the bucket size (default: the limit).
    #[serde(default)]
    pub burst: Option<u64>,
}

/// `prevent_duplicate`: `true`/`false`, or a table with the window.
#[derive(Debug, Clone, PartialEq)]
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
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DuplicateRule {
    /// 1 if given: the guard admits one request per period.
    #[serde(default)]
    pub limit: Option<u64>,
    /// The window.
    pub period: String,
}

/// The `[quota]` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    /// As for routes (default `"user"`).
    #[serde(default)]
    pub key: Option<String>,
    /// The header the tier is read from (default `"x-tier"`); set it in a layer you trust.
    #[serde(default)]
    pub tier_header: Option<String>,
    /// The tier of requests without a known one (required with several tiers).
    #[serde(default)]
    pub default_tier: Option<String>,
    /// Tier names and requests per day, `{ free = 100, pro = 5000 }`.
    pub tiers: BTreeMap<String, u64>,
    /// Alert thresholds in percent (default `[80, 100]`).
    #[serde(default)]
    pub alert_at: Option<Vec<u16>>,
    /// An `http://` URL alerts are posted to as JSON (feature `webhook`; default: only logged).
    #[serde(default)]
    pub alert_webhook: Option<String>,
    /// Where days start: `"+00:00"` (default), `"+05:30"`, `"-08:00"`.
    #[serde(default)]
    pub utc_offset: Option<String>,
}

/// The `store` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// `"memory"` or a URL.
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
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreTable {
    /// Node URLs of a Redis Cluster.
    #[serde(default)]
    pub cluster: Option<Vec<String>>,
    /// Sentinel URLs.
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
