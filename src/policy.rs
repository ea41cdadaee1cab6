//! Policies and rules: what is limited, by which key, and how much.
//!
//! A [`Policy`] is the counterpart of a `@RateLimiter` annotation: a name, a [`Key`], a key prefix, one
//! or more [`Rule`]s (each a `@RateRule`: a limit per period), an [`Algorithm`] and the message for
//! refused requests. Every rule of a policy must pass for a request to be admitted. A policy that
//! can't work is refused by [`PolicyBuilder::build`] with a [`PolicyError`] naming the bad rule.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, StatusCode};

use crate::client_ip::ClientIp;
use crate::concurrency::ConcurrencyLimit;
use crate::headers::{self, PolicyItem, SfName};
use crate::key::{self, Key};
use crate::quota::Quota;

/// The longest period a rule may have: 366 days, enough for yearly quotas, short enough that no
/// store arithmetic on it can overflow.
pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 86_400);

/// The largest limit a rule may have: 2^35 (about 34 billion) units per period. Far above any real
/// quota, and low enough that the Redis scripts, whose numbers are Lua doubles, compute every count
/// exactly (the sliding counter multiplies counts by a 16-bit weight).
pub const MAX_LIMIT: u64 = 1 << 35;

/// One limit: at most `limit` units per `period`.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::Rule;
///
/// assert_eq!(Rule::per_minute(20).name(), "20-per-60s");
/// assert_eq!(Rule::new(5, Duration::from_millis(1500)).name(), "5-per-1500ms");
/// assert_eq!(Rule::per_hour(100).named("hourly").name(), "hourly");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    limit: u64,
    period: Duration,
    name: Option<Cow<'static, str>>,
    burst: Option<u64>,
    duplicate_guard: bool,
}

impl Rule {
    /// At most `limit` units per `period`. Checked when the policy is built: the limit must be at
    /// least 1 and at most [`MAX_LIMIT`], the period a whole, non-zero number of milliseconds, at
    /// most [`MAX_PERIOD`].
    pub const fn new(limit: u64, period: Duration) -> Self {
        Rule {
            limit,
            period,
            name: None,
            burst: None,
            duplicate_guard: false,
        }
    }

    /// `limit` per second.
    pub const fn per_second(limit: u64) -> Self {
        Rule::new(limit, Duration::from_secs(1))
    }

    /// `limit` per minute.
    pub const fn per_minute(limit: u64) -> Self {
        Rule::new(limit, Duration::from_secs(60))
    }

    /// `limit` per hour.
    pub const fn per_hour(limit: u64) -> Self {
        Rule::new(limit, Duration::from_secs(3600))
    }

    /// `limit` per day (86 400 s; a sliding or fixed period, not a calendar day).
    pub const fn per_day(limit: u64) -> Self {
        Rule::new(limit, Duration::from_secs(86_400))
    }

    /// Names the rule in headers and 429 bodies instead of the default `<limit>-per-<period>`. Useful
    /// when two nested layers would otherwise send rules of the same name.
    pub fn named(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The bucket size of a [`Algorithm::TokenBucket`] rule: up to `burst` units at once after a
    /// quiet spell, refilled at `limit` per `period` (default: the limit). Only token buckets have
    /// one; [`PolicyBuilder::build`] refuses a burst under another algorithm.
    ///
    /// ```
    /// use tower_redis_ratelimit::Rule;
    ///
    /// let rule = Rule::per_second(10).burst(50);
    /// assert_eq!((rule.limit(), rule.burst_size()), (10, 50));
    /// assert_eq!(Rule::per_second(10).burst_size(), 10);
    /// ```
    pub const fn burst(mut self, burst: u64) -> Self {
        self.burst = Some(burst);
        self
    }

    /// The same rule over a period longer by `margin` (the outbound layer's safety margin).
    pub(crate) fn widened(&self, margin: Duration) -> Rule {
        Rule {
            period: self.period.saturating_add(margin),
            ..self.clone()
        }
    }

    /// The bucket size: the one given to [`Rule::burst`], else the limit.
    pub fn burst_size(&self) -> u64 {
        self.burst.unwrap_or(self.limit)
    }

    /// Whether this is the rule [`PolicyBuilder::prevent_duplicate`] adds: one request per
    /// period, counted exactly (as a sliding log) whatever the policy's algorithm.
    pub fn is_duplicate_guard(&self) -> bool {
        self.duplicate_guard
    }

    /// The rule's limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The rule's period.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// The period in whole milliseconds, the unit stores work in.
    pub fn period_ms(&self) -> u64 {
        u64::try_from(self.period.as_millis()).unwrap_or(u64::MAX)
    }

    /// The name clients see: the one given to [`Rule::named`], else `<limit>-per-<period>` such as
    /// `20-per-60s` or `5-per-1500ms`.
    pub fn name(&self) -> Cow<'_, str> {
        match &self.name {
            Some(name) => Cow::Borrowed(name),
            None => Cow::Owned(format!("{}-per-{}", self.limit, PeriodText(self.period))),
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} per {}", self.limit, PeriodText(self.period))
    }
}

/// A period as `60s` when it is whole seconds, else `1500ms` (or `1.5µs`-free debug form).
struct PeriodText(Duration);

impl fmt::Display for PeriodText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let period = self.0;
        if period.subsec_nanos() == 0 {
            write!(f, "{}s", period.as_secs())
        } else if period.subsec_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", period.as_millis())
        } else {
            write!(f, "{period:?}")
        }
    }
}

/// How a policy counts requests. Every algorithm checks all rules first and records the request in
/// all of them only if all pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// One counter per rule and window; windows are aligned to the epoch. Cheapest, but a client can
    /// get up to twice the limit across a window edge.
    FixedWindow,
    /// The timestamps of admitted requests; a request is admitted when fewer than `limit` fall in the
    /// last `period`. Exact at any instant; memory grows with the limit.
    #[default]
    SlidingLog,
    /// Two counters per rule, this window's and the last one's; the last one counts in proportion
    /// to how much of it the sliding window still overlaps. Constant memory per key, no 2x burst at
    /// window edges; an estimate that assumes the last window's requests were spread evenly.
    SlidingCounter,
    /// A token bucket, as GCRA: one timestamp per rule. The bucket holds [`Rule::burst_size`] units
    /// (the limit unless set) and refills at `limit` per `period`, one unit at a time, so a client
    /// that was quiet may burst, then gets the steady rate. Constant memory per key, no window
    /// edges at all.
    TokenBucket,
}

impl Algorithm {
    /// The name used in config files: `fixed_window`, `sliding_log`, `sliding_counter` or
    /// `token_bucket`.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::SlidingCounter => "sliding_counter",
            Algorithm::TokenBucket => "token_bucket",
        }
    }

    /// Whether a request that doesn't fit now can reserve its place in the future (the algorithms
    /// [`Mode::Delay`] works with): the token bucket and the sliding log know the exact time a
    /// request fits and can record it for then.
    pub fn can_reserve(self) -> bool {
        matches!(self, Algorithm::SlidingLog | Algorithm::TokenBucket)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error of parsing an unknown algorithm name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown algorithm {0:?}: expected \"fixed_window\", \"sliding_log\", \"sliding_counter\" or \"token_bucket\""
)]
pub struct UnknownAlgorithm(pub String);

impl FromStr for Algorithm {
    type Err = UnknownAlgorithm;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "fixed_window" => Ok(Algorithm::FixedWindow),
            "sliding_log" => Ok(Algorithm::SlidingLog),
            "sliding_counter" => Ok(Algorithm::SlidingCounter),
            "token_bucket" => Ok(Algorithm::TokenBucket),
            other => Err(UnknownAlgorithm(other.to_owned())),
        }
    }
}

/// Which requests share a bucket, besides having the same identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Scope {
    /// One bucket per identity for every route the layer covers.
    #[default]
    Policy,
    /// One bucket per identity, method and route: the seed's `class-method` suffix. The route is
    /// axum's `MatchedPath` (so `/users/{id}` is one route), which is set when the layer is added
    /// with `Router::layer` or `route_layer`. Requests without it (a 404, a layer outside the router)
    /// share one `unmatched` route, so made-up paths can't mint fresh buckets; so do methods other
    /// than the standard nine.
    Route,
}

/// What happens when a request has no key (no user id, no header) or no client IP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Count the request against its client IP instead (default). When even the client IP is unknown
    /// (the server was not started with `into_make_service_with_connect_info`), the request is
    /// refused with 500 and an error is logged: a limiter that silently stops limiting is worse.
    #[default]
    ClientIp,
    /// Let the request through without limiting it.
    Allow,
    /// Refuse the request with this status (for example 401 for a missing user).
    Reject(StatusCode),
}

/// What happens when the store fails (Redis down, a timeout). Never a 429: a store error is not a
/// rate limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through and log a warning (fail open, default).
    #[default]
    Allow,
    /// Refuse the request with 503 and a problem+json body (fail closed).
    Deny,
}

/// What a policy does with a request that its rules refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Mode {
    /// Refuse it with 429 (default).
    #[default]
    Enforce,
    /// Let it through anyway, log it (`would be rate limited`) and count it
    /// ([`RateLimitLayer::shadow_refusals`](crate::RateLimitLayer::shadow_refusals)). The
    /// rate-limit headers still tell the truth, so a limit can be rolled out and watched before it
    /// bites. A request the rules refuse is recorded in none of them, as in enforce mode.
    Shadow,
    /// Hold it until the rules admit it, if that is at most `max_delay` away; a longer wait gets the
    /// 429 at once. The store reserves the request's place at the time it will fit, so waiting
    /// requests are admitted in order, exactly the limit per period, never polling. Needs an
    /// algorithm that can reserve ([`Algorithm::can_reserve`]). A request refused for want of a
    /// concurrency slot ([`PolicyBuilder::max_in_flight`]) waits for one up to `max_delay`, first
    /// come first served (see [`concurrency`](crate::concurrency)).
    Delay {
        /// The longest a request is held.
        max_delay: Duration,
    },
}

impl Mode {
    /// The longest a refused request may wait to be admitted: zero unless [`Mode::Delay`].
    pub fn max_delay(self) -> Duration {
        match self {
            Mode::Delay { max_delay } => max_delay,
            Mode::Enforce | Mode::Shadow => Duration::ZERO,
        }
    }
}

/// How many units a request costs, as a request extension: set it in an earlier layer or
/// middleware (for example from the size of a batch) and the limiter charges that much in every
/// rule. It wins over the policy's [`PolicyBuilder::cost_from_fn`]; without either a request costs 1.
///
/// A request that costs more than a rule could ever admit (its limit, or its burst for a token
/// bucket) is refused with `413 Content Too Large` and a problem body that says so, rather than
/// told to retry.
///
/// ```
/// use http::Request;
/// use tower_redis_ratelimit::Cost;
///
/// let mut request = Request::new(());
/// request.extensions_mut().insert(Cost(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cost(pub u64);

/// The cost of a request as a policy computes it.
pub type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

/// The window of the duplicate guard when none is given: one request per 5 seconds.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(5);

/// Why a policy was refused when it was built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The policy has no rules.
    #[error("policy {policy:?} has no rules")]
    NoRules {
        /// The policy's name.
        policy: String,
    },
    /// A rule's limit is zero.
    #[error("policy {policy:?}, rules[{index}] ({rule}): the limit must be at least 1")]
    ZeroLimit {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// A rule's limit is above [`MAX_LIMIT`].
    #[error(
        "policy {policy:?}, rules[{index}] ({rule}): the limit must be at most 2^35 (34359738368)"
    )]
    LimitTooLarge {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// A rule's period is zero.
    #[error("policy {policy:?}, rules[{index}] ({rule}): the period must be longer than zero")]
    ZeroPeriod {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// A rule's period is not a whole number of milliseconds.
    #[error(
        "policy {policy:?}, rules[{index}] ({rule}): the period must be a whole number of milliseconds"
    )]
    SubMillisecondPeriod {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// A rule's period is longer than [`MAX_PERIOD`].
    #[error("policy {policy:?}, rules[{index}] ({rule}): the period must be at most 366 days")]
    PeriodTooLong {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// Two rules have the same limit and period.
    #[error("policy {policy:?}, rules[{index}] ({rule}) is the same rule as rules[{first}]")]
    DuplicateRule {
        /// The policy's name.
        policy: String,
        /// The duplicate's position (from 0).
        index: usize,
        /// The position of the rule it repeats.
        first: usize,
        /// The rule as text.
        rule: String,
    },
    /// Two rules have the same name, so clients couldn't tell them apart (`index` is one past the
    /// rules when the daily quota has the name of a rule).
    #[error("policy {policy:?}, rules[{index}] has the name {name:?} of rules[{first}]")]
    DuplicateRuleName {
        /// The policy's name.
        policy: String,
        /// The duplicate's position (from 0).
        index: usize,
        /// The position of the rule whose name it repeats.
        first: usize,
        /// The shared name.
        name: String,
    },
    /// A rule name that can't be sent in a header.
    #[error("policy {policy:?}, rules[{index}]: {source}")]
    InvalidRuleName {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// What is wrong with the name.
        source: headers::InvalidRuleName,
    },
    /// A rule's token-bucket settings can't work.
    #[error("policy {policy:?}, rules[{index}] ({rule}): {reason}")]
    InvalidBurst {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A policy option (`block_for`, `max_delay`, `prevent_duplicate`) can't work.
    #[error("policy {policy:?}, {option}: {reason}")]
    InvalidOption {
        /// The policy's name.
        policy: String,
        /// The option.
        option: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// A policy name or key prefix that would break the store key layout.
    #[error(
        "{what} {value:?} must be 1 to 64 characters of letters, digits and -._~@+=!*(),/ (it is part of every store key)"
    )]
    InvalidName {
        /// `"policy name"` or `"key prefix"`.
        what: &'static str,
        /// The refused value.
        value: String,
    },
    /// Over a store whose checks reach one place ([`Store::keys_share_one_slot`]: Redis
    /// Cluster), the policy's quota is keyed apart from its rules, so one request's keys would be
    /// in different hash slots. Key the quota with a clone of the policy's [`Key`].
    ///
    /// [`Store::keys_share_one_slot`]: crate::Store::keys_share_one_slot
    #[error(
        "policy {policy:?} is keyed by {key} but its quota {quota:?} by {quota_key}: on Redis \
         Cluster all keys of a request must share one hash slot, so key the quota with a clone \
         of the policy's own Key"
    )]
    QuotaKeyedApart {
        /// The policy's name.
        policy: String,
        /// The policy's key, as `Key::ip`, `Key::header("x-api-key")`, ….
        key: String,
        /// The quota's name.
        quota: String,
        /// The quota's key.
        quota_key: String,
    },
}

/// A rate-limit policy: build one with [`Policy::builder`]. Cheap to clone.
///
/// ```
/// use tower_redis_ratelimit::{Algorithm, Key, Policy, Rule};
///
/// let policy = Policy::builder("login")
///     .key(Key::ip())
///     .rule(Rule::per_minute(10))
///     .rule(Rule::per_hour(100))
///     .algorithm(Algorithm::SlidingLog)
///     .message("Too many login attempts, try again later.")
///     .build()
///     .expect("a valid policy");
/// assert_eq!(policy.rules().len(), 2);
///
/// // A policy that can't work is refused, naming the rule.
/// let error = Policy::builder("bad").rule(Rule::per_minute(0)).build().unwrap_err();
/// assert!(error.to_string().contains("rules[0] (0 per 60s)"));
/// ```
#[derive(Clone)]
pub struct Policy(Arc<Inner>);

struct Inner {
    name: String,
    prefix: String,
    key: Key,
    rules: Box<[Rule]>,
    rule_names: Box<[Box<str>]>,
    /// The rule names serialised for headers, built once.
    sf_names: Box<[SfName]>,
    algorithm: Algorithm,
    message: String,
    scope: Scope,
    missing_key: MissingKey,
    on_store_error: OnStoreError,
    client_ip: ClientIp,
    mode: Mode,
    block_for: Option<Duration>,
    cost_fn: Option<CostFn>,
    quota: Option<Quota>,
    /// The concurrency limit, its name and its `RateLimit-Policy` item (`"1-in-flight";q=1`).
    concurrency: Option<(ConcurrencyLimit, Box<str>, SfName, Box<str>)>,
    /// The most a request may cost: the smallest capacity (limit, or burst for a token bucket) of
    /// the counted rules, and the rule that has it.
    max_cost: (u64, usize),
    /// `prefix:name:`, the start of every store key of this policy, built once.
    key_base: String,
    /// The `RateLimit-Policy` header value, built once.
    policy_header: HeaderValue,
    /// The `RateLimit-Policy` value of a request without a quota: the rules' items, then the
    /// concurrency limit's, built once.
    policy_header_with_concurrency: HeaderValue,
    /// The 429 body of a refusal by one rule, per rule (then the quota's, the concurrency
    /// limit's), built once.
    refusal_bodies: Box<[Bytes]>,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("name", &self.0.name)
            .field("prefix", &self.0.prefix)
            .field("key", &self.0.key)
            .field("rules", &self.0.rules)
            .field("algorithm", &self.0.algorithm)
            .field("scope", &self.0.scope)
            .field("missing_key", &self.0.missing_key)
            .field("on_store_error", &self.0.on_store_error)
            .field("mode", &self.0.mode)
            .field("block_for", &self.0.block_for)
            .field("cost_fn", &self.0.cost_fn.is_some())
            .field("quota", &self.0.quota)
            .finish_non_exhaustive()
    }
}

/// What one state of a [`Decision`](crate::Decision) describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateOf {
    /// The policy's rule at this index.
    Rule(usize),
    /// The daily quota.
    Quota,
    /// The concurrency limit.
    Concurrency,
}

/// The store key of one request and who it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StorageKey {
    key: String,
    identity_at: usize,
    kind: &'static str,
}

impl StorageKey {
    /// The whole key: `prefix:policy:identity`, or `prefix:policy:route:identity` for a route-scoped
    /// policy. It contains no braces, so a store may wrap it in a hash tag.
    pub(crate) fn as_str(&self) -> &str {
        &self.key
    }

    /// The identity part, safe to log.
    pub(crate) fn identity(&self) -> &str {
        &self.key[self.identity_at..]
    }

    /// The kind of key that produced it (`ip`, `user`, …): the policy's, or `ip` after a fallback.
    pub(crate) fn kind(&self) -> &'static str {
        self.kind
    }
}

/// The result of looking up a request's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyLookup {
    /// Count the request against this key.
    Found(StorageKey),
    /// No key: let the request through unlimited ([`MissingKey::Allow`]).
    Unlimited,
    /// No key: refuse the request with this status ([`MissingKey::Reject`]).
    Refuse(StatusCode),
    /// Neither a key nor a client IP to fall back to: the server lacks `ConnectInfo`.
    NoClientIp,
}

impl Policy {
    /// Starts a policy named `name`. The name is part of every store key, so two policies never
    /// share a bucket; it must be 1 to 64 characters of letters, digits and `-._~@+=!*(),/`.
    pub fn builder(name: impl Into<String>) -> PolicyBuilder {
        PolicyBuilder {
            name: name.into(),
            prefix: "rl".to_owned(),
            key: Key::ip(),
            rules: Vec::new(),
            algorithm: Algorithm::default(),
            message: "Too many requests, please try again later.".to_owned(),
            scope: Scope::default(),
            missing_key: MissingKey::default(),
            on_store_error: OnStoreError::default(),
            client_ip: ClientIp::default(),
            mode: Mode::default(),
            block_for: None,
            duplicate_window: None,
            cost_fn: None,
            quota: None,
            max_in_flight: None,
            lease: None,
        }
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The prefix of every store key of this policy.
    pub fn prefix(&self) -> &str {
        &self.0.prefix
    }

    /// What the policy is keyed by.
    pub fn key(&self) -> &Key {
        &self.0.key
    }

    /// The rules, all of which must pass.
    pub fn rules(&self) -> &[Rule] {
        &self.0.rules
    }

    /// The rule names as clients see them, in rule order.
    pub fn rule_names(&self) -> &[Box<str>] {
        &self.0.rule_names
    }

    /// The counting algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.0.algorithm
    }

    /// The message for refused requests (the `detail` of the 429 body).
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// Which requests share a bucket.
    pub fn scope(&self) -> Scope {
        self.0.scope
    }

    /// What happens to requests without a key.
    pub fn missing_key(&self) -> MissingKey {
        self.0.missing_key
    }

    /// What happens when the store fails.
    pub fn on_store_error(&self) -> OnStoreError {
        self.0.on_store_error
    }

    /// How the client IP is found.
    pub fn client_ip(&self) -> &ClientIp {
        &self.0.client_ip
    }

    /// What happens to requests the rules refuse.
    pub fn mode(&self) -> Mode {
        self.0.mode
    }

    /// How long an identity is refused outright once a rule refused it, if the policy blocks.
    pub fn block_for(&self) -> Option<Duration> {
        self.0.block_for
    }

    /// The daily quota the policy checks with its rules, if any.
    pub fn quota(&self) -> Option<&Quota> {
        self.0.quota.as_ref()
    }

    /// The cost of a request: its [`Cost`] extension, else the policy's cost function, else 1.
    pub fn cost(&self, parts: &Parts) -> u64 {
        if let Some(Cost(cost)) = parts.extensions.get::<Cost>() {
            return *cost;
        }
        self.0.cost_fn.as_ref().map_or(1, |cost| cost(parts))
    }

    /// When a request of `cost` can never be admitted (it costs more than some rule's limit, or a
    /// token bucket's burst), the index of the rule that admits the least at once (the first of
    /// them on a tie).
    pub fn too_costly(&self, cost: u64) -> Option<usize> {
        let (max_cost, rule) = self.0.max_cost;
        (cost > max_cost).then_some(rule)
    }

    /// The most a request of this policy may cost.
    pub fn max_cost(&self) -> u64 {
        self.0.max_cost.0
    }

    /// The rule names serialised as structured-field strings, in rule order.
    pub(crate) fn sf_names(&self) -> &[SfName] {
        &self.0.sf_names
    }

    /// The `RateLimit-Policy` header value of this policy.
    pub fn policy_header(&self) -> &HeaderValue {
        &self.0.policy_header
    }

    /// The concurrency limit, if the policy has one.
    pub fn concurrency(&self) -> Option<ConcurrencyLimit> {
        self.0.concurrency.as_ref().map(|(limit, ..)| *limit)
    }

    /// What the state at `index` of a decision of `states` states describes (see
    /// [`Decision`](crate::Decision)): a rule, the quota, or the concurrency limit.
    pub(crate) fn state_of(&self, index: usize, states: usize) -> StateOf {
        if index < self.0.rules.len() {
            StateOf::Rule(index)
        } else if self.0.concurrency.is_some() && index + 1 == states {
            StateOf::Concurrency
        } else {
            StateOf::Quota
        }
    }

    /// The name clients see of the state at `index` of a decision of `states` states.
    pub(crate) fn state_name(&self, index: usize, states: usize) -> Option<&str> {
        match self.state_of(index, states) {
            StateOf::Rule(index) => self.0.rule_names.get(index).map(|name| &**name),
            StateOf::Quota => self.quota().map(Quota::name),
            StateOf::Concurrency => self.0.concurrency.as_ref().map(|(_, name, ..)| &**name),
        }
    }

    /// The `RateLimit-Policy` value of a request without a quota: the rules', then the concurrency
    /// limit's item.
    pub(crate) fn policy_header_with_concurrency(&self) -> &HeaderValue {
        &self.0.policy_header_with_concurrency
    }

    /// The concurrency limit's name serialised for headers, and its `RateLimit-Policy` item.
    pub(crate) fn concurrency_items(&self) -> Option<(&SfName, &str)> {
        self.0
            .concurrency
            .as_ref()
            .map(|(_, _, sf_name, item)| (sf_name, &**item))
    }

    /// The ready 429 body of a refusal by the state at `index` alone, of a decision of `states`.
    pub(crate) fn refusal_body(&self, index: usize, states: usize) -> Option<&Bytes> {
        let at = match self.state_of(index, states) {
            StateOf::Rule(index) => index,
            StateOf::Quota => self.0.rules.len(),
            StateOf::Concurrency => self.0.rules.len() + usize::from(self.0.quota.is_some()),
        };
        self.0.refusal_bodies.get(at)
    }

    /// The store key of a request, or what to do when it has none.
    pub(crate) fn storage_key(&self, parts: &Parts) -> KeyLookup {
        self.storage_key_behind(parts, &self.0.client_ip)
    }

    /// The store key of a request whose client address `client_ip` finds (a quota's key takes its
    /// policy's proxy settings, so both see the same client).
    pub(crate) fn storage_key_behind(&self, parts: &Parts, client_ip: &ClientIp) -> KeyLookup {
        let inner = &self.0;
        let mut key = String::with_capacity(inner.key_base.len() + 64);
        key.push_str(&inner.key_base);
        if inner.scope == Scope::Route {
            push_route(&mut key, parts);
            key.push(':');
        }
        let identity_at = key.len();
        let kind = if inner.key.push_identity(parts, client_ip, &mut key) {
            inner.key.kind()
        } else {
            match inner.missing_key {
                MissingKey::Allow => return KeyLookup::Unlimited,
                MissingKey::Reject(status) => return KeyLookup::Refuse(status),
                MissingKey::ClientIp => {
                    // The client IP is the fallback, so an IP key has nothing to fall back to.
                    if inner.key.is_ip() || !Key::ip().push_identity(parts, client_ip, &mut key) {
                        return KeyLookup::NoClientIp;
                    }
                    "ip"
                }
            }
        };
        KeyLookup::Found(StorageKey {
            key,
            identity_at,
            kind,
        })
    }

    /// The store key of `identity` as the logs show it (`user:alice`), for an operator: `None`
    /// for a route-scoped policy, whose keys also name a route.
    pub(crate) fn storage_key_of(&self, identity: &str) -> Option<StorageKey> {
        (self.0.scope != Scope::Route).then(|| self.unscoped_key_of(identity))
    }

    /// The store key of `identity` under this policy, whatever its scope: `prefix:policy:identity`.
    pub(crate) fn unscoped_key_of(&self, identity: &str) -> StorageKey {
        let inner = &self.0;
        let kind = match identity.split_once(':') {
            Some(("ip", _)) => "ip",
            _ => inner.key.kind(),
        };
        StorageKey {
            key: format!("{}{identity}", inner.key_base),
            identity_at: inner.key_base.len(),
            kind,
        }
    }
}

/// The longest identity an operator or an outbound key may name, in bytes.
const MAX_NAMED_IDENTITY_LEN: usize = 512;

/// Whether `identity`, named from outside a request (an operator's, an outbound upstream's), can
/// be part of a store key: not empty, at most 512 bytes, no braces (store keys wrap identities in
/// a hash tag) and no control characters.
pub(crate) fn is_storable_identity(identity: &str) -> bool {
    !identity.is_empty()
        && identity.len() <= MAX_NAMED_IDENTITY_LEN
        && !identity
            .chars()
            .any(|c| c == '{' || c == '}' || c.is_control())
}

/// Appends the route component: method and matched path, hashed when odd (paths with `{param}`).
/// Only values the app defines get through: unmatched paths and non-standard methods, which a
/// client can make up at will, collapse into one bucket each.
fn push_route(key: &mut String, parts: &Parts) {
    let path = parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |matched| matched.as_str());
    let method = match parts.method {
        Method::GET
        | Method::POST
        | Method::PUT
        | Method::DELETE
        | Method::PATCH
        | Method::HEAD
        | Method::OPTIONS
        | Method::CONNECT
        | Method::TRACE => parts.method.as_str(),
        _ => "OTHER",
    };
    let mut route = String::with_capacity(method.len() + path.len());
    route.push_str(method);
    route.push_str(path);
    key::push_component(key, &route);
}

/// Whether `name` may be a policy name or key prefix: 1 to 64 characters of letters, digits and
/// `-._~@+=!*(),/`, the rule [`PolicyBuilder::build`] applies (names are part of every store key).
pub fn is_valid_name(name: &str) -> bool {
    key::is_verbatim(name)
}

/// Builds a [`Policy`]; see [`Policy::builder`].
#[must_use = "call .build() to get the policy"]
pub struct PolicyBuilder {
    name: String,
    prefix: String,
    key: Key,
    rules: Vec<Rule>,
    algorithm: Algorithm,
    message: String,
    scope: Scope,
    missing_key: MissingKey,
    on_store_error: OnStoreError,
    client_ip: ClientIp,
    mode: Mode,
    block_for: Option<Duration>,
    duplicate_window: Option<Duration>,
    cost_fn: Option<CostFn>,
    quota: Option<Quota>,
    max_in_flight: Option<u64>,
    lease: Option<Duration>,
}

impl fmt::Debug for PolicyBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyBuilder")
            .field("name", &self.name)
            .field("rules", &self.rules)
            .field("algorithm", &self.algorithm)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl PolicyBuilder {
    /// What to key the limit by (default: the client IP).
    pub fn key(mut self, key: Key) -> Self {
        self.key = key;
        self
    }

    /// The prefix of every store key (default `rl`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Adds a rule.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Adds several rules.
    pub fn rules(mut self, rules: impl IntoIterator<Item = Rule>) -> Self {
        self.rules.extend(rules);
        self
    }

    /// The counting algorithm (default: [`Algorithm::SlidingLog`]).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// The message for refused requests, sent as the `detail` of the 429 body.
    pub fn message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    /// Which requests share a bucket (default: [`Scope::Policy`]).
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// What happens to requests without a key (default: [`MissingKey::ClientIp`]).
    pub fn on_missing_key(mut self, missing_key: MissingKey) -> Self {
        self.missing_key = missing_key;
        self
    }

    /// What happens when the store fails (default: [`OnStoreError::Allow`]).
    pub fn on_store_error(mut self, on_store_error: OnStoreError) -> Self {
        self.on_store_error = on_store_error;
        self
    }

    /// How the client IP is found: trusted proxies, IPv6 grouping.
    pub fn client_ip(mut self, client_ip: ClientIp) -> Self {
        self.client_ip = client_ip;
        self
    }

    /// What happens to requests the rules refuse (default: [`Mode::Enforce`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// A penalty block: once any rule refuses an identity, refuse it outright for `duration`,
    /// whatever its counts say; `Retry-After` counts to the end of the block. The OTP case: a client
    /// that hits the limit waits 15 minutes, not the rest of the window. The block is one more key
    /// in the store, set in the same atomic step as the check, expiring on its own. The duplicate
    /// guard's refusals don't start a block (a double click is not abuse).
    pub fn block_for(mut self, duration: Duration) -> Self {
        self.block_for = Some(duration);
        self
    }

    /// A duplicate guard, the seed's `preventDuplicate`: adds a rule named `duplicate` that admits
    /// one request per `window` on the same key (use [`DEFAULT_DUPLICATE_WINDOW`], 5 s, unless you
    /// need another), so a double-clicked submit is refused. It is counted exactly, as a sliding
    /// log, whatever the policy's algorithm, and comes after the policy's own rules.
    pub fn prevent_duplicate(mut self, window: Duration) -> Self {
        self.duplicate_window = Some(window);
        self
    }

    /// How many units a request costs, computed from its head (default: 1). A [`Cost`] extension on
    /// the request wins over it.
    ///
    /// ```
    /// use tower_redis_ratelimit::{Policy, Rule};
    ///
    /// // A batch endpoint: each item of `?items=` counts.
    /// let policy = Policy::builder("batch")
    ///     .rule(Rule::per_minute(100))
    ///     .cost_from_fn(|parts| {
    ///         parts.uri.query()
    ///             .and_then(|query| query.strip_prefix("items="))
    ///             .and_then(|items| items.parse().ok())
    ///             .unwrap_or(1)
    ///     })
    ///     .build()
    ///     .unwrap();
    /// let parts = http::Request::get("/batch?items=7").body(()).unwrap().into_parts().0;
    /// assert_eq!(policy.cost(&parts), 7);
    /// ```
    pub fn cost_from_fn<F>(mut self, cost: F) -> Self
    where
        F: Fn(&Parts) -> u64 + Send + Sync + 'static,
    {
        self.cost_fn = Some(Arc::new(cost));
        self
    }

    /// A daily quota by tier, checked and recorded with the policy's rules in the same atomic step
    /// (one call on Redis). It is keyed by its own key, so one quota given to several policies (routes)
    /// caps their sum. On Redis Cluster every key of a check must hash to one slot: there, key the
    /// quota like the policy, or the check fails with a cross-slot error.
    pub fn quota(mut self, quota: Quota) -> Self {
        self.quota = Some(quota);
        self
    }

    /// A concurrency limit: at most `n` requests of one identity in progress at once, across every
    /// instance sharing the store, each holding its slot for at most its [`lease`](Self::lease)
    /// (required with it). The slot is taken in the same store step as the rate rules, all or
    /// nothing, and released when the response body has been sent or dropped; see
    /// [`concurrency`](crate::concurrency). A policy with a concurrency limit needs no rate rule.
    /// In [`Mode::Delay`] a request waits for a slot, up to `max_delay`, first come first served.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::{Key, Policy};
    ///
    /// // One report at a time per user, none held longer than five minutes.
    /// let policy = Policy::builder("reports")
    ///     .key(Key::user())
    ///     .max_in_flight(1)
    ///     .lease(Duration::from_secs(300))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policy.concurrency().unwrap().max_in_flight(), 1);
    /// ```
    pub fn max_in_flight(mut self, n: u64) -> Self {
        self.max_in_flight = Some(n);
        self
    }

    /// The longest a request holds its concurrency slot
    /// ([`max_in_flight`](Self::max_in_flight)): past it the slot is free again even if the
    /// request never ended (a crashed instance, a hung handler).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Checks the policy and builds it.
    pub fn build(mut self) -> Result<Policy, PolicyError> {
        for (what, value) in [("policy name", &self.name), ("key prefix", &self.prefix)] {
            if !is_valid_name(value) {
                return Err(PolicyError::InvalidName {
                    what,
                    value: value.clone(),
                });
            }
        }
        let policy = || self.name.clone();
        if self.rules.is_empty() && self.max_in_flight.is_none() {
            return Err(PolicyError::NoRules { policy: policy() });
        }
        let option = |option, reason| PolicyError::InvalidOption {
            policy: policy(),
            option,
            reason,
        };
        let durations = [
            ("block_for", self.block_for),
            ("prevent_duplicate", self.duplicate_window),
            (
                "max_delay",
                match self.mode {
                    Mode::Delay { max_delay } => Some(max_delay),
                    Mode::Enforce | Mode::Shadow => None,
                },
            ),
        ];
        for (name, duration) in durations {
            if let Some(duration) = duration
                && let Err(reason) = check_duration(duration)
            {
                return Err(option(name, reason));
            }
        }
        let concurrency = match (self.max_in_flight, self.lease) {
            (None, None) => None,
            (Some(_), None) => {
                return Err(option(
                    "lease",
                    "max_in_flight needs a lease: how long a request may hold its slot before \
                     it is free again (a crashed instance must not hold one for ever)",
                ));
            }
            (None, Some(_)) => {
                return Err(option("lease", "a lease only goes with max_in_flight"));
            }
            (Some(0), Some(_)) => {
                return Err(option("max_in_flight", "must be at least 1"));
            }
            (Some(n), Some(lease)) => {
                if let Err(reason) = check_duration(lease) {
                    return Err(option("lease", reason));
                }
                if n > MAX_LIMIT {
                    return Err(option("max_in_flight", "is larger than any rule may be"));
                }
                let limit = ConcurrencyLimit::new(n, lease);
                let name = limit.name();
                let sf_name =
                    SfName::new(&name).map_err(|source| PolicyError::InvalidRuleName {
                        policy: policy(),
                        index: self.rules.len(),
                        source,
                    })?;
                let item = format!("{};q={n}", sf_name.as_str());
                Some((limit, name.into_boxed_str(), sf_name, item.into_boxed_str()))
            }
        };
        if matches!(self.mode, Mode::Delay { .. }) && !self.algorithm.can_reserve() {
            return Err(option(
                "mode",
                "delay mode needs the sliding_log or token_bucket algorithm, which can reserve a \
                 request's place in the future",
            ));
        }
        let counted_rules = self.rules.len();
        if let Some(window) = self.duplicate_window {
            let mut guard = Rule::new(1, window).named("duplicate");
            guard.duplicate_guard = true;
            self.rules.push(guard);
        }
        let mut rule_names: Vec<Box<str>> = Vec::with_capacity(self.rules.len());
        let mut sf_names = Vec::with_capacity(self.rules.len());
        for (index, rule) in self.rules.iter().enumerate() {
            let text = || rule.to_string();
            if rule.limit == 0 {
                return Err(PolicyError::ZeroLimit {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if rule.limit > MAX_LIMIT {
                return Err(PolicyError::LimitTooLarge {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if rule.period.is_zero() {
                return Err(PolicyError::ZeroPeriod {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if !rule.period.subsec_nanos().is_multiple_of(1_000_000) {
                return Err(PolicyError::SubMillisecondPeriod {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if rule.period > MAX_PERIOD {
                return Err(PolicyError::PeriodTooLong {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if let Err(reason) = check_burst(self.algorithm, rule) {
                return Err(PolicyError::InvalidBurst {
                    policy: policy(),
                    index,
                    rule: text(),
                    reason,
                });
            }
            if let Some(first) = self.rules[..index]
                .iter()
                .position(|earlier| earlier.limit == rule.limit && earlier.period == rule.period)
            {
                return Err(PolicyError::DuplicateRule {
                    policy: policy(),
                    index,
                    first,
                    rule: text(),
                });
            }
            let name = rule.name();
            if let Some(first) = rule_names.iter().position(|earlier| **earlier == *name) {
                return Err(PolicyError::DuplicateRuleName {
                    policy: policy(),
                    index,
                    first,
                    name: name.into_owned(),
                });
            }
            let sf_name = SfName::new(&name).map_err(|source| PolicyError::InvalidRuleName {
                policy: policy(),
                index,
                source,
            })?;
            sf_names.push(sf_name);
            rule_names.push(name.into());
        }
        if let Some(quota) = &self.quota
            && let Some(first) = rule_names.iter().position(|name| **name == *quota.name())
        {
            // Clients tell the quota's header item from the rules' by name.
            return Err(PolicyError::DuplicateRuleName {
                policy: policy(),
                index: self.rules.len(),
                first,
                name: quota.name().to_owned(),
            });
        }
        let items: Vec<PolicyItem<'_>> = self
            .rules
            .iter()
            .zip(&sf_names)
            .map(|(rule, name)| PolicyItem {
                name,
                quota: rule.limit,
                window_secs: crate::decision::ceil_secs(rule.period),
            })
            .collect();
        let policy_header = headers::policy_header_value(&items);
        let policy_header_with_concurrency = match &concurrency {
            None => policy_header.clone(),
            Some((.., item)) => {
                let rules = policy_header.to_str().unwrap_or_default();
                let joined = if rules.is_empty() {
                    item.to_string()
                } else {
                    format!("{rules}, {item}")
                };
                HeaderValue::try_from(joined).unwrap_or_else(|_| policy_header.clone())
            }
        };
        let key_base = format!("{}:{}:", self.prefix, self.name);
        let refusal_bodies = rule_names
            .iter()
            .map(|name| &**name)
            .chain(self.quota.as_ref().map(Quota::name))
            .chain(concurrency.as_ref().map(|(_, name, _, _)| &**name))
            .map(|name| crate::response::refusal_body(&self.message, &[name]))
            .collect();
        let max_cost = self.rules[..counted_rules]
            .iter()
            .enumerate()
            .map(|(index, rule)| (self.capacity(rule), index))
            .min()
            .unwrap_or((u64::MAX, 0));
        Ok(Policy(Arc::new(Inner {
            name: self.name,
            prefix: self.prefix,
            key: self.key,
            rules: self.rules.into(),
            rule_names: rule_names.into(),
            sf_names: sf_names.into(),
            algorithm: self.algorithm,
            message: self.message,
            scope: self.scope,
            missing_key: self.missing_key,
            on_store_error: self.on_store_error,
            client_ip: self.client_ip,
            mode: self.mode,
            block_for: self.block_for,
            cost_fn: self.cost_fn,
            quota: self.quota,
            concurrency,
            max_cost,
            key_base,
            policy_header,
            policy_header_with_concurrency,
            refusal_bodies,
        })))
    }

    /// The most one request may cost under `rule`.
    fn capacity(&self, rule: &Rule) -> u64 {
        match self.algorithm {
            Algorithm::TokenBucket => rule.burst_size(),
            _ => rule.limit,
        }
    }
}

/// Whether a policy option's duration can work: whole milliseconds, more than zero, at most
/// [`MAX_PERIOD`].
fn check_duration(duration: Duration) -> Result<(), &'static str> {
    if duration.is_zero() {
        Err("must be longer than zero")
    } else if !duration.subsec_nanos().is_multiple_of(1_000_000) {
        Err("must be a whole number of milliseconds")
    } else if duration > MAX_PERIOD {
        Err("must be at most 366 days")
    } else {
        Ok(())
    }
}

/// Whether a rule's burst can work under `algorithm`.
fn check_burst(algorithm: Algorithm, rule: &Rule) -> Result<(), &'static str> {
    if algorithm != Algorithm::TokenBucket {
        return match rule.burst {
            Some(_) => Err("a burst applies only to the token_bucket algorithm"),
            None => Ok(()),
        };
    }
    if rule.duplicate_guard {
        return Ok(());
    }
    if rule.burst == Some(0) {
        return Err("the burst must be at least 1");
    }
    let period_us = u128::from(rule.period_ms()) * 1_000;
    if u128::from(rule.limit) > period_us {
        return Err("a token bucket refills at most one unit per microsecond");
    }
    let interval = period_us.div_ceil(u128::from(rule.limit));
    if u128::from(rule.burst_size()) * interval > MAX_PERIOD.as_micros() {
        return Err("the bucket must refill from empty within 366 days (burst × period / limit)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    use axum::extract::ConnectInfo;

    fn build(rules: Vec<Rule>) -> Result<Policy, PolicyError> {
        Policy::builder("p").rules(rules).build()
    }

    #[test]
    fn rule_constructors_and_names() {
        assert_eq!(Rule::per_second(2).period(), Duration::from_secs(1));
        assert_eq!(Rule::per_minute(10).name(), "10-per-60s");
        assert_eq!(Rule::per_hour(100).name(), "100-per-3600s");
        assert_eq!(Rule::per_day(1).name(), "1-per-86400s");
        assert_eq!(
            Rule::new(20, Duration::from_secs(120)).to_string(),
            "20 per 120s"
        );
        assert_eq!(Rule::new(3, Duration::from_millis(250)).period_ms(), 250);
    }

    #[test]
    fn bad_rules_are_refused_with_their_position() {
        assert_eq!(
            build(vec![]).unwrap_err(),
            PolicyError::NoRules { policy: "p".into() }
        );
        assert!(matches!(
            build(vec![Rule::per_minute(5), Rule::per_second(0)]).unwrap_err(),
            PolicyError::ZeroLimit { index: 1, .. }
        ));
        assert!(matches!(
            build(vec![Rule::new(5, Duration::ZERO)]).unwrap_err(),
            PolicyError::ZeroPeriod { index: 0, .. }
        ));
        let error = build(vec![Rule::new(5, Duration::from_micros(1500))]).unwrap_err();
        assert!(matches!(
            error,
            PolicyError::SubMillisecondPeriod { index: 0, .. }
        ));
        assert!(matches!(
            build(vec![Rule::new(5, Duration::from_nanos(10))]).unwrap_err(),
            PolicyError::SubMillisecondPeriod { .. }
        ));
        assert!(build(vec![Rule::per_second(MAX_LIMIT)]).is_ok());
        assert!(matches!(
            build(vec![Rule::per_second(1), Rule::per_minute(MAX_LIMIT + 1)]).unwrap_err(),
            PolicyError::LimitTooLarge { index: 1, .. }
        ));
        assert!(build(vec![Rule::new(5, MAX_PERIOD)]).is_ok());
        assert!(matches!(
            build(vec![Rule::new(5, MAX_PERIOD + Duration::from_millis(1))]).unwrap_err(),
            PolicyError::PeriodTooLong { index: 0, .. }
        ));
        let error = build(vec![
            Rule::per_minute(10),
            Rule::per_hour(5),
            Rule::new(10, Duration::from_secs(60)),
        ])
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "policy \"p\", rules[2] (10 per 60s) is the same rule as rules[0]"
        );
        assert!(matches!(
            build(vec![
                Rule::per_minute(10).named("x"),
                Rule::per_hour(5).named("x")
            ])
            .unwrap_err(),
            PolicyError::DuplicateRuleName {
                index: 1,
                first: 0,
                ..
            }
        ));
        assert!(matches!(
            build(vec![Rule::per_minute(10).named("tab\there")]).unwrap_err(),
            PolicyError::InvalidRuleName { index: 0, .. }
        ));
    }

    #[test]
    fn token_bucket_rules_and_options_are_checked() {
        let bucket = |rule: Rule| {
            Policy::builder("p")
                .algorithm(Algorithm::TokenBucket)
                .rule(rule)
                .build()
        };
        assert!(bucket(Rule::per_second(10).burst(100)).is_ok());
        let reason = |error: PolicyError| match error {
            PolicyError::InvalidBurst { reason, .. } => reason,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            reason(bucket(Rule::per_second(10).burst(0)).unwrap_err()),
            "the burst must be at least 1"
        );
        assert!(bucket(Rule::new(1_000, Duration::from_millis(1))).is_ok());
        assert_eq!(
            reason(bucket(Rule::new(1_001, Duration::from_millis(1))).unwrap_err()),
            "a token bucket refills at most one unit per microsecond"
        );
        assert!(
            reason(bucket(Rule::per_day(1).burst(367)).unwrap_err()).contains("within 366 days")
        );
        let error = build(vec![Rule::per_second(10).burst(20)]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "policy \"p\", rules[0] (10 per 1s): a burst applies only to the token_bucket algorithm"
        );

        let option = |builder: PolicyBuilder| match builder.rule(Rule::per_second(1)).build() {
            Err(PolicyError::InvalidOption { option, reason, .. }) => (option, reason),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            option(Policy::builder("p").block_for(Duration::ZERO)),
            ("block_for", "must be longer than zero")
        );
        assert_eq!(
            option(Policy::builder("p").prevent_duplicate(Duration::from_micros(1_500))),
            (
                "prevent_duplicate",
                "must be a whole number of milliseconds"
            )
        );
        let delay = Mode::Delay {
            max_delay: Duration::from_secs(1),
        };
        assert!(
            Policy::builder("p")
                .mode(delay)
                .rule(Rule::per_second(1))
                .build()
                .is_ok()
        );
        assert_eq!(
            option(
                Policy::builder("p")
                    .algorithm(Algorithm::FixedWindow)
                    .mode(delay)
            )
            .0,
            "mode"
        );
    }

    #[test]
    fn the_duplicate_guard_is_the_last_rule_and_costs_stay_within_the_rules() {
        let policy = Policy::builder("p")
            .rule(Rule::per_minute(10))
            .rule(Rule::per_hour(4))
            .prevent_duplicate(DEFAULT_DUPLICATE_WINDOW)
            .build()
            .unwrap();
        let guard = &policy.rules()[2];
        assert!(guard.is_duplicate_guard());
        assert_eq!((guard.limit(), guard.name()), (1, "duplicate".into()));
        assert_eq!(
            policy.policy_header(),
            "\"10-per-60s\";q=10;w=60, \"4-per-3600s\";q=4;w=3600, \"duplicate\";q=1;w=5"
        );
        // The guard counts requests, not units: the cheapest counted rule caps the cost.
        assert_eq!(policy.max_cost(), 4);
        assert_eq!(policy.too_costly(4), None);
        assert_eq!(policy.too_costly(5), Some(1));
        let bucket = Policy::builder("b")
            .algorithm(Algorithm::TokenBucket)
            .rule(Rule::per_minute(10).burst(30))
            .build()
            .unwrap();
        assert_eq!(bucket.max_cost(), 30);
        // A guard that repeats a rule is refused like any duplicate rule.
        assert!(matches!(
            Policy::builder("p")
                .rule(Rule::new(1, Duration::from_secs(5)))
                .prevent_duplicate(DEFAULT_DUPLICATE_WINDOW)
                .build(),
            Err(PolicyError::DuplicateRule { index: 1, .. })
        ));
    }

    #[test]
    fn a_quota_named_like_a_rule_is_refused() {
        let quota = Quota::builder("hourly").tier("free", 10).build().unwrap();
        let error = Policy::builder("p")
            .rule(Rule::per_minute(5))
            .rule(Rule::per_hour(50).named("hourly"))
            .quota(quota)
            .build()
            .unwrap_err();
        assert!(matches!(
            error,
            PolicyError::DuplicateRuleName {
                index: 2,
                first: 1,
                ..
            }
        ));
        // Any offset is checked, the extremes of i32 included.
        for minutes in [i32::MIN, i32::MAX, 18 * 60 + 1, -18 * 60 - 1] {
            assert!(
                Quota::builder("q")
                    .tier("free", 1)
                    .utc_offset_minutes(minutes)
                    .build()
                    .is_err()
            );
        }
        assert!(
            Quota::builder("q")
                .tier("free", 1)
                .utc_offset_minutes(-18 * 60)
                .build()
                .is_ok()
        );
    }

    #[test]
    fn the_cost_comes_from_the_extension_else_the_function_else_one() {
        let policy = Policy::builder("p")
            .rule(Rule::per_minute(10))
            .cost_from_fn(|parts| if parts.method == Method::POST { 3 } else { 1 })
            .build()
            .unwrap();
        let post = request("/", Method::POST, None);
        assert_eq!(policy.cost(&post), 3);
        assert_eq!(policy.cost(&request("/", Method::GET, None)), 1);
        let mut weighed = request("/", Method::POST, None);
        weighed.extensions.insert(Cost(7));
        assert_eq!(policy.cost(&weighed), 7);
        let plain = build(vec![Rule::per_minute(10)]).unwrap();
        assert_eq!(plain.cost(&post), 1);
    }

    #[test]
    fn names_that_break_keys_are_refused() {
        for bad in ["", "a:b", "{x}", "with space"] {
            let error = Policy::builder(bad)
                .rule(Rule::per_second(1))
                .build()
                .unwrap_err();
            assert!(matches!(
                error,
                PolicyError::InvalidName {
                    what: "policy name",
                    ..
                }
            ));
            let error = Policy::builder("ok")
                .prefix(bad)
                .rule(Rule::per_second(1))
                .build()
                .unwrap_err();
            assert!(matches!(
                error,
                PolicyError::InvalidName {
                    what: "key prefix",
                    ..
                }
            ));
        }
    }

    #[test]
    fn policy_header_lists_every_rule() {
        let policy = build(vec![Rule::per_minute(20), Rule::per_hour(100)]).unwrap();
        assert_eq!(
            policy.policy_header(),
            "\"20-per-60s\";q=20;w=60, \"100-per-3600s\";q=100;w=3600"
        );
        // A sub-second window is sent as one whole second.
        let policy = build(vec![Rule::new(5, Duration::from_millis(1500))]).unwrap();
        assert_eq!(policy.policy_header(), "\"5-per-1500ms\";q=5;w=2");
    }

    fn request(path: &str, method: http::Method, peer: Option<&str>) -> Parts {
        let mut builder = http::Request::builder().uri(path).method(method);
        if let Some(peer) = peer {
            let peer: SocketAddr = peer.parse().unwrap();
            builder = builder.extension(ConnectInfo(peer));
        }
        builder.body(()).unwrap().into_parts().0
    }

    fn found(lookup: KeyLookup) -> StorageKey {
        match lookup {
            KeyLookup::Found(key) => key,
            other => panic!("expected a key, got {other:?}"),
        }
    }

    #[test]
    fn storage_keys_separate_policies_and_routes() {
        let peer = Some("192.0.2.1:1000");
        let a = Policy::builder("a")
            .prefix("demo")
            .rule(Rule::per_second(1))
            .build()
            .unwrap();
        let key = found(a.storage_key(&request("/x", http::Method::GET, peer)));
        assert_eq!(key.as_str(), "demo:a:ip:192.0.2.1");
        assert_eq!(key.identity(), "ip:192.0.2.1");
        assert_eq!(key.kind(), "ip");

        let routed = Policy::builder("a")
            .prefix("demo")
            .scope(Scope::Route)
            .rule(Rule::per_second(1))
            .build()
            .unwrap();
        // Without axum's MatchedPath (tested through a router in tests/layer.rs) paths are made up
        // by the client, so they share one bucket rather than minting new ones.
        let get = found(routed.storage_key(&request("/x", http::Method::GET, peer)));
        let other_path = found(routed.storage_key(&request("/y", http::Method::GET, peer)));
        let post = found(routed.storage_key(&request("/x", http::Method::POST, peer)));
        assert_eq!(get.as_str(), "demo:a:GETunmatched:ip:192.0.2.1");
        assert_eq!(get, other_path);
        assert_ne!(get, post);
        assert_eq!(get.identity(), post.identity());
        let made_up =
            |method: &str| found(routed.storage_key(&request("/x", method.parse().unwrap(), peer)));
        assert_eq!(made_up("FOO"), made_up("BAR"));
        assert_eq!(
            made_up("FOO").as_str(),
            "demo:a:OTHERunmatched:ip:192.0.2.1"
        );
    }

    #[test]
    fn missing_keys_follow_the_policy() {
        let user = |missing| {
            Policy::builder("u")
                .key(Key::user())
                .on_missing_key(missing)
                .rule(Rule::per_second(1))
                .build()
                .unwrap()
        };
        let anonymous = request("/", http::Method::GET, Some("192.0.2.1:1"));
        let fallback = found(user(MissingKey::ClientIp).storage_key(&anonymous));
        assert_eq!(fallback.as_str(), "rl:u:ip:192.0.2.1");
        assert_eq!(fallback.kind(), "ip");
        assert_eq!(
            user(MissingKey::Allow).storage_key(&anonymous),
            KeyLookup::Unlimited
        );
        assert_eq!(
            user(MissingKey::Reject(StatusCode::UNAUTHORIZED)).storage_key(&anonymous),
            KeyLookup::Refuse(StatusCode::UNAUTHORIZED)
        );
        let no_peer = request("/", http::Method::GET, None);
        assert_eq!(
            user(MissingKey::ClientIp).storage_key(&no_peer),
            KeyLookup::NoClientIp
        );
    }

    #[test]
    fn algorithm_names_round_trip() {
        for algorithm in [
            Algorithm::FixedWindow,
            Algorithm::SlidingLog,
            Algorithm::SlidingCounter,
            Algorithm::TokenBucket,
        ] {
            assert_eq!(algorithm.as_str().parse::<Algorithm>(), Ok(algorithm));
        }
        assert_eq!(
            "token".parse::<Algorithm>(),
            Err(UnknownAlgorithm("token".into()))
        );
    }
}
