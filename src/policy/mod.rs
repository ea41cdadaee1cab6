//! Policies and rules: what is limited, by which key, and how much.
//!
//! A [`Policy`] is what one limit is made of: a name, a [`Key`], a key prefix, one or more
//! [`Rule`]s (each a limit per period), an [`Algorithm`] and the message for refused requests. Every rule of a policy must pass for a request to be admitted. A policy that
//! can't work is refused by [`PolicyBuilder::build`] with a [`PolicyError`] naming the bad rule.
//!
//! The plain parts ([`Rule`], [`Algorithm`], [`Mode`], [`Scope`], [`OnStoreError`], [`PolicyError`])
//! and the checks come from `tower-redis-ratelimit-spec`, which the derive macro shares. Here, one
//! concept per file: `options.rs` (missing key, cost), `builder.rs`, `storage_key.rs` (a request's
//! store key), `footprint.rs` (what a policy's sliding logs may take in Redis), `quota.rs` (a
//! daily quota with tiers and alerts, re-exported as [`crate::quota`]), `concurrency_limit.rs`;
//! this file holds the built [`Policy`].

mod builder;
pub(crate) mod concurrency_limit;
pub(crate) mod fair_share;
mod footprint;
pub(crate) mod meter;
mod options;
mod overrides;
pub(crate) mod quota;
mod storage_key;
#[cfg(test)]
mod tests;

pub use builder::PolicyBuilder;
pub(crate) use concurrency_limit::ConcurrencyLimit;
pub use options::{Cost, CostFn, CountsFn, MissingKey};
pub(crate) use overrides::{Applied, Overrides};
pub use overrides::{Override, OverrideTarget, StoredAction, StoredOverride, Whom};
// The plain parts and the checks, shared with the derive macro.
use storage_key::push_route;
pub(crate) use storage_key::{KeyLookup, StorageKey, is_storable_identity};
pub use tower_redis_ratelimit_spec::{
    Algorithm, DEFAULT_DUPLICATE_WINDOW, InvalidRuleName, InvalidStatus, MAX_LIMIT, MAX_PERIOD,
    Mode, ModeError, OnStoreError, PolicyError, Rule, RulePart, Scope, StatusSet, UnknownAlgorithm,
    UnknownName,
};
// The derive's helpers: public for the code it generates, not a part of the API.
#[doc(hidden)]
pub use tower_redis_ratelimit_spec::{
    ErrorSite, KeySpec, ModeName, check_rule_name, is_valid_name, parse_duration, parse_header_name,
};

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;

use crate::client_ip::ClientIp;
use crate::key::Key;
use meter::Meter;
use quota::Quota;

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
pub struct Policy(pub(super) Arc<Inner>);

pub(super) struct Inner {
    pub(super) name: String,
    pub(super) prefix: String,
    pub(super) key: Key,
    pub(super) rules: Box<[Rule]>,
    pub(super) rule_names: Box<[Box<str>]>,
    pub(super) algorithm: Algorithm,
    pub(super) message: String,
    pub(super) scope: Scope,
    pub(super) missing_key: MissingKey,
    pub(super) on_store_error: OnStoreError,
    pub(super) client_ip: ClientIp,
    pub(super) mode: Mode,
    pub(super) block_for: Option<Duration>,
    pub(super) cost_fn: Option<CostFn>,
    /// Which responses count (`count_only`); every one when `None`.
    pub(super) counts: Option<CountsFn>,
    /// The most units an instance takes ahead per identity (`prefetch`, above 1).
    pub(super) prefetch: Option<u64>,
    pub(super) quota: Option<Quota>,
    /// The concurrency limit and its name.
    pub(super) concurrency: Option<(ConcurrencyLimit, Box<str>)>,
    /// The most a request may cost: the smallest capacity (limit, or burst for a token bucket) of
    /// the counted rules, and the rule that has it.
    pub(super) max_cost: (u64, usize),
    /// The meter, under a policy with metered rules or a metered quota.
    pub(super) metering: Option<Metering>,
    /// `prefix:name:`, the start of every store key of this policy, built once.
    pub(super) key_base: String,
    /// The budget its identities share fairly, if any.
    pub(super) fair_share: Option<Fairness>,
    /// Identities and networks treated apart.
    pub(super) overrides: Overrides,
    /// What the policy of an override set at run time is built from: this policy's builder
    /// (none for such a policy, nor for a policy derived from another).
    pub(super) run_time_base: Option<Box<PolicyBuilder>>,
    /// The limit each rule's counter is kept under, when it differs from the rule's own: a
    /// run-time override's rule shares the counter of the policy's rule of its period.
    pub(super) counted_as: Option<Box<[u64]>>,
    /// Whether a request without its key has been counted by client IP yet: said once, at WARN
    /// (the limiter often runs before the layer that sets the key).
    pub(super) fell_back: std::sync::atomic::AtomicBool,
}

/// A policy's fair share of a budget, with what its build made of it once.
pub(crate) struct Fairness {
    pub(crate) fair: fair_share::FairShare,
    /// The budget's store key (`prefix:name:fair`).
    pub(crate) key: Box<str>,
    /// The budget's state's name (the budget rule's), and the share's (`<budget>-share`).
    pub(crate) budget_name: Box<str>,
    pub(crate) share_name: Box<str>,
}

impl Fairness {
    /// The same, its budget's period longer by `margin` (the outbound layer's counting).
    fn widened(&self, margin: Duration) -> Fairness {
        Fairness {
            fair: self.fair.widened(margin),
            key: self.key.clone(),
            budget_name: self.budget_name.clone(),
            share_name: self.share_name.clone(),
        }
    }
}

/// A policy's meter, with the bounds its build found.
pub(crate) struct Metering {
    pub(crate) meter: Meter,
    /// The most a request may reserve: the smallest capacity of the metered rules (`u64::MAX`
    /// with none: a metered quota alone).
    pub(crate) max_estimate: u64,
    /// The most one report counts.
    pub(crate) max_usage: u64,
    /// Whether a report above `max_usage` was said yet (once, at WARN).
    pub(crate) warned_max_usage: std::sync::atomic::AtomicBool,
    /// Whether a usage header that isn't a number was said yet (once, at WARN).
    pub(crate) warned_header: std::sync::atomic::AtomicBool,
    /// Whether a request that both recorded its usage and had it in the usage header was said
    /// yet (once, at WARN: the record wins).
    pub(crate) warned_two_reports: std::sync::atomic::AtomicBool,
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
    /// The budget shared fairly.
    Budget,
    /// The identity's share of it.
    Share,
}

impl Policy {
    /// Starts a policy named `name`. The name is part of every store key, so two policies never
    /// share a bucket; it must be 1 to 64 characters of letters, digits and `-._~@+=!*(),/`.
    pub fn builder(name: impl Into<String>) -> PolicyBuilder {
        PolicyBuilder::new(name.into())
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

    /// Whether a response of `status` counts ([`PolicyBuilder::count_only`]): always, unless the
    /// policy counts only some.
    pub fn counts(&self, status: http::StatusCode) -> bool {
        self.0.counts.as_ref().is_none_or(|counts| counts(status))
    }

    /// The most units an instance takes ahead per identity ([`PolicyBuilder::prefetch`]); `None`
    /// when it takes none (`prefetch(1)` included).
    pub fn prefetch(&self) -> Option<u64> {
        self.0.prefetch
    }

    /// Whether only some responses count ([`PolicyBuilder::count_only`]).
    pub fn counts_only_some(&self) -> bool {
        self.0.counts.is_some()
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

    /// The policy's meter, if it has metered rules or a metered quota
    /// ([`PolicyBuilder::meter`]).
    pub fn meter(&self) -> Option<&Meter> {
        self.0.metering.as_ref().map(|metering| &metering.meter)
    }

    /// This policy as an outbound layer counts it: its rules alone (no quota, no concurrency
    /// limit), each over a period longer by `margin`, and a block of `block_for` started by each
    /// refusal (what makes a check see a pause). Its store keys are this policy's.
    pub(crate) fn counted_outbound(&self, margin: Duration, block_for: Option<Duration>) -> Policy {
        let inner = &self.0;
        Policy(Arc::new(Inner {
            name: inner.name.clone(),
            prefix: inner.prefix.clone(),
            key: inner.key.clone(),
            rules: inner
                .rules
                .iter()
                .map(|rule| rule.widened(margin))
                .collect(),
            rule_names: inner.rule_names.clone(),
            algorithm: inner.algorithm,
            message: inner.message.clone(),
            scope: inner.scope,
            missing_key: inner.missing_key,
            on_store_error: inner.on_store_error,
            client_ip: inner.client_ip.clone(),
            mode: inner.mode,
            block_for,
            cost_fn: inner.cost_fn.clone(),
            counts: inner.counts.clone(),
            prefetch: inner.prefetch,
            quota: None,
            concurrency: None,
            fair_share: inner
                .fair_share
                .as_ref()
                .map(|fairness| fairness.widened(margin)),
            max_cost: inner.max_cost,
            metering: inner.metering.as_ref().map(|metering| Metering {
                meter: metering.meter.clone(),
                max_estimate: metering.max_estimate,
                max_usage: metering.max_usage,
                warned_max_usage: Default::default(),
                warned_header: Default::default(),
                warned_two_reports: Default::default(),
            }),
            key_base: inner.key_base.clone(),
            overrides: inner.overrides.clone(),
            run_time_base: None,
            counted_as: inner.counted_as.clone(),
            fell_back: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// The meter and its bounds.
    pub(crate) fn metering(&self) -> Option<&Metering> {
        self.0.metering.as_ref()
    }

    /// The units a request reserves: its meter's estimate, at most what every metered rule
    /// holds; 1 without a meter (no rule reads it then).
    pub(crate) fn estimate(&self, parts: &Parts) -> u64 {
        self.metering().map_or(1, |metering| {
            metering.meter.estimate_of(parts).min(metering.max_estimate)
        })
    }

    /// The concurrency limit, if the policy has one.
    pub fn concurrency(&self) -> Option<ConcurrencyLimit> {
        self.0.concurrency.as_ref().map(|(limit, _)| *limit)
    }

    /// What the state at `index` of a decision of `states` states describes (see
    /// [`Decision`](crate::Decision)): a rule, the quota, or the concurrency limit.
    pub(crate) fn state_of(&self, index: usize, states: usize) -> StateOf {
        let fair = if self.0.fair_share.is_some() { 2 } else { 0 };
        if index < self.0.rules.len() {
            StateOf::Rule(index)
        } else if fair > 0 && index + 2 == states {
            StateOf::Budget
        } else if fair > 0 && index + 1 == states {
            StateOf::Share
        } else if self.0.concurrency.is_some() && index + 1 + fair == states {
            StateOf::Concurrency
        } else {
            StateOf::Quota
        }
    }

    /// The index of the concurrency limit's state in a decision of `states` states, if the
    /// policy has one.
    pub(crate) fn concurrency_state(&self, states: usize) -> Option<usize> {
        let fair = if self.0.fair_share.is_some() { 2 } else { 0 };
        self.0
            .concurrency
            .as_ref()
            .and_then(|_| states.checked_sub(1 + fair))
    }

    /// How many states a decision of this policy has after its quota's: the concurrency
    /// limit's, the budget's and the share's, as it has them.
    pub(crate) fn states_after_quota(&self) -> usize {
        usize::from(self.0.concurrency.is_some()) + if self.0.fair_share.is_some() { 2 } else { 0 }
    }

    /// The budget its identities share fairly, if any.
    pub(crate) fn fair_share(&self) -> Option<&Fairness> {
        self.0.fair_share.as_ref()
    }

    /// The store key of the budget its identities share fairly, if any.
    pub(crate) fn fair_key(&self) -> Option<&str> {
        self.fair_share().map(|fairness| &*fairness.key)
    }

    /// The name clients see of the state at `index` of a decision of `states` states.
    pub(crate) fn state_name(&self, index: usize, states: usize) -> Option<&str> {
        match self.state_of(index, states) {
            StateOf::Rule(index) => self.0.rule_names.get(index).map(|name| &**name),
            StateOf::Quota => self.quota().map(Quota::name),
            StateOf::Concurrency => self.0.concurrency.as_ref().map(|(_, name)| &**name),
            StateOf::Budget => self.fair_share().map(|fair| &*fair.budget_name),
            StateOf::Share => self.fair_share().map(|fair| &*fair.share_name),
        }
    }

    /// The identities and networks this policy treats apart.
    pub(crate) fn overrides(&self) -> &Overrides {
        &self.0.overrides
    }

    /// `prefix:name:`, the start of every store key of this policy: what a store keeps its
    /// run-time overrides under.
    pub(crate) fn key_base(&self) -> &str {
        &self.0.key_base
    }

    /// The policy of an override set at run time with `rules`: this one with `rules` instead of
    /// its own, each rule counted in the counter of this policy's rule of the same period (and
    /// metering) when there is one, so that what an identity has used carries over. Refused as
    /// [`build`](PolicyBuilder::build) refuses bad rules. `counted`: the limits its counters are
    /// kept under as the store that applied it named them, when it did (the Redis store's
    /// script charged those, whatever this policy's rules are now).
    pub(crate) fn run_time_policy(
        &self,
        rules: &[Rule],
        counted: Option<&[u64]>,
    ) -> Result<Policy, PolicyError> {
        let Some(base) = self.0.run_time_base.as_deref() else {
            return Err(PolicyError::InvalidOverride {
                policy: self.name().to_owned(),
                index: 0,
                reason: "this policy is an override's own: set overrides on the policy".to_owned(),
            });
        };
        base.clone().run_time(rules, &self.0.rules, counted)
    }

    /// Whether overrides may be set for it at run time: not for an outbound layer's policy,
    /// nor for an override's own.
    pub(crate) fn takes_run_time_overrides(&self) -> bool {
        self.0.run_time_base.is_some()
    }

    /// The limits the counters of the rules are kept under (see [`Policy::run_time_policy`]),
    /// when they differ from the rules' own.
    pub(crate) fn counted_as(&self) -> Option<&[u64]> {
        self.0.counted_as.as_deref()
    }

    /// The store key of a request, or what to do when it has none.
    pub(crate) fn storage_key(&self, parts: &Parts) -> KeyLookup {
        self.storage_key_behind(parts, &self.0.client_ip)
    }

    /// The store key of a request whose client address `client_ip` finds (a quota's key takes its
    /// policy's proxy settings, so both see the same client).
    pub(crate) fn storage_key_behind(&self, parts: &Parts, client_ip: &ClientIp) -> KeyLookup {
        let inner = &self.0;
        // Written in a reused buffer, then kept in the key itself when short: no allocation.
        storage_key::in_scratch(|key| {
            key.push_str(&inner.key_base);
            if inner.scope == Scope::Route {
                push_route(key, parts);
                key.push(':');
            }
            let identity_at = key.len();
            let kind = if inner.key.push_identity(parts, client_ip, key) {
                inner.key.kind()
            } else {
                match inner.missing_key {
                    MissingKey::Allow => return KeyLookup::Unlimited,
                    MissingKey::Reject(status) => return KeyLookup::Refuse(status),
                    MissingKey::ClientIp => {
                        // The client IP is the fallback, so an IP key has nothing to fall back to.
                        if inner.key.is_ip() || !Key::ip().push_identity(parts, client_ip, key) {
                            return KeyLookup::NoClientIp;
                        }
                        self.warn_of_fallback();
                        "ip"
                    }
                }
            };
            KeyLookup::Found(StorageKey::new(key, identity_at, kind))
        })
    }

    /// Says, once, that a request without this policy's key was counted by client IP: with a
    /// user key behind an auth layer that ran after the limiter, every request is.
    fn warn_of_fallback(&self) {
        let inner = &self.0;
        if inner
            .fell_back
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        tracing::warn!(
            policy = %inner.name,
            key_kind = inner.key.kind(),
            "a request without the policy's {} key was limited by client IP instead \
             (MissingKey::ClientIp). If every request should carry one, the rate limiter probably \
             runs before the layer that sets it: with Router::layer the layer added last runs \
             first, so add the RateLimitLayer before the auth layer (`.layer(rate_limit)\
             .layer(auth)`), or after it in a ServiceBuilder. To refuse such requests instead, \
             use .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED)). Said once per policy.",
            inner.key.kind()
        );
    }

    /// The store key of `identity` as the logs show it (`user:alice`), for an operator: `None`
    /// for a route-scoped policy, whose keys also name a route.
    pub(crate) fn storage_key_of(&self, identity: &str) -> Option<StorageKey> {
        (self.0.scope != Scope::Route).then(|| self.unscoped_key_of(identity))
    }

    /// The store key a layer's request from client `address` is counted under (its group, for a
    /// policy keyed by client address), unless the key names the route too.
    pub(crate) fn storage_key_of_address(&self, address: std::net::IpAddr) -> Option<StorageKey> {
        (self.0.scope != Scope::Route).then(|| self.named_key(&address.to_string()))
    }

    /// The store key of an identity the app names (a [`RateLimiter`](crate::RateLimiter)'s):
    /// `prefix:policy:identity`, whatever the policy's scope, the identity stored as the policy's
    /// key stores the value it reads (see [`Key::push_named`]), so a layer and a handle of one
    /// policy share a bucket; an identity the key can't read, verbatim or hashed, of kind
    /// `named`.
    pub(crate) fn named_key(&self, identity: &str) -> StorageKey {
        let inner = &self.0;
        // Room for any stored form: `user:` and 64 bytes, a hash, an IPv6 network.
        storage_key::in_scratch(|key| {
            key.push_str(&inner.key_base);
            let kind = inner.key.push_named(identity, &inner.client_ip, key);
            StorageKey::new(key, inner.key_base.len(), kind)
        })
    }

    /// The store key of `identity` under this policy, whatever its scope: `prefix:policy:identity`.
    pub(crate) fn unscoped_key_of(&self, identity: &str) -> StorageKey {
        let inner = &self.0;
        let kind = match identity.split_once(':') {
            Some(("ip", _)) => "ip",
            _ => inner.key.kind(),
        };
        storage_key::in_scratch(|key| {
            key.push_str(&inner.key_base);
            key.push_str(identity);
            StorageKey::new(key, inner.key_base.len(), kind)
        })
    }
}
