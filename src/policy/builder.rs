//! [`PolicyBuilder`]: builds a [`Policy`], refusing one that can't work.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use http::request::Parts;

use crate::client_ip::ClientIp;
use crate::key::Key;

use tower_redis_ratelimit_spec::{CheckedParts, PolicyParts, StatusSet};

use super::fair_share::FairShare;
use super::meter::Meter;
use super::overrides::{Override, Overrides};
use super::quota::Quota;
use super::{
    Algorithm, ConcurrencyLimit, CostFn, CountsFn, Inner, MissingKey, Mode, OnStoreError, Policy,
    PolicyError, Rule, Scope,
};

/// Builds a [`Policy`]; see [`Policy::builder`].
#[must_use = "call .build() to get the policy"]
#[derive(Clone)]
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
    counts: Option<CountsFn>,
    prefetch: Option<u64>,
    quota: Option<Quota>,
    max_in_flight: Option<u64>,
    lease: Option<Duration>,
    overrides: Vec<Override>,
    meter: Option<Meter>,
    fair_share: Option<FairShare>,
    /// The rules of the policy whose run-time override this builds: each rule is counted in the
    /// counter of the one of its period there ([`Policy::run_time_policy`]).
    counted_as_of: Option<Box<[Rule]>>,
    /// The limits a run-time override's counters are kept under, as a store that applied it
    /// named them (else worked out from `counted_as_of`).
    counted_as_given: Option<Box<[u64]>>,
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
    /// A builder of a policy named `name`, with every default.
    pub(super) fn new(name: String) -> Self {
        PolicyBuilder {
            name,
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
            counts: None,
            prefetch: None,
            quota: None,
            max_in_flight: None,
            lease: None,
            overrides: Vec::new(),
            meter: None,
            fair_share: None,
            counted_as_of: None,
            counted_as_given: None,
        }
    }

    /// What the policy's metered rules ([`Rule::metered`]) and a metered quota count, how much a
    /// request reserves, and where its response reports what it used: see [`Meter`]. A policy
    /// with a meter needs a metered rule or quota, and one with those needs a meter.
    pub fn meter(mut self, meter: Meter) -> Self {
        self.meter = Some(meter);
        self
    }

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

    /// A duplicate guard: adds a rule named `duplicate` that admits one request per `window` on the
    /// same key (use [`DEFAULT_DUPLICATE_WINDOW`](crate::policy::DEFAULT_DUPLICATE_WINDOW), 5 s, unless you
    /// need another), so a double-clicked submit is refused. It is counted exactly, as a sliding
    /// log, whatever the policy's algorithm, and comes after the policy's own rules.
    pub fn prevent_duplicate(mut self, window: Duration) -> Self {
        self.duplicate_window = Some(window);
        self
    }

    /// How many units a request costs, computed from its head (default: 1). A [`Cost`](crate::policy::Cost) extension on
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

    /// Shares one budget fairly among the identities the policy's key names: counted across
    /// all of them, and, once saturated, each admitted up to its weighted share, what one
    /// leaves going to those who want more (see [`fair`](crate::fair)). The policy's own rules
    /// (and quota) still apply to each identity. Its states come after the concurrency limit's
    /// in a [`Decision`](crate::Decision): the budget's, then the identity's share (named
    /// `<budget>-share`), which the headers describe as the identity's own limit while it
    /// binds. A store must keep fair shares
    /// ([`Abilities::FAIR_SHARE`](crate::store::Abilities::FAIR_SHARE)): the memory store does.
    ///
    /// Refused when built: a budget of limit 0 or of no period, a duplicate guard, a metered
    /// budget without a [`meter`](Self::meter), a budget named as one of the rules, a policy
    /// keyed by [`Key::global`](crate::Key::global) (one identity shares with nobody), or one
    /// that takes units ahead ([`prefetch`](Self::prefetch): they would pass the shares).
    pub fn fair_share(mut self, fair: FairShare) -> Self {
        self.fair_share = Some(fair);
        self
    }

    /// Each request costs the whole number in its `header` (at least 1; absent or anything else:
    /// 1), as config files' `cost_header` says. The header is trusted, as an app trusts what its
    /// own gateway computed; nothing a client sends there panics.
    pub fn cost_from_header(self, header: HeaderName) -> Self {
        self.cost_from_fn(move |parts| header_cost(parts, &header))
    }

    /// Counts only the requests whose response's status `counts` accepts: login failures
    /// (`|status| status == StatusCode::UNAUTHORIZED`), or errors. A request is charged when it is
    /// admitted, as any other, so concurrent requests can never pass the limit; when its response
    /// turns out not to count, the layer gives the charge back ([`Store::give_back`]) in the
    /// background, to the windows it was charged in: a response that ends after its window
    /// rolled gives nothing to the new one, and a sliding log drops the request's own entry. So
    /// while counted requests are in flight, others may be refused that would be admitted once
    /// their responses are known; and a refusal another instance cached may stand up to a second
    /// after a give-back frees room.
    ///
    /// A request whose response never comes keeps its charge: a client that hangs up before
    /// its answer, or a handler that panics. Its outcome is unknown, and the handler's work (an
    /// SMS sent, a password checked) may have run: giving the charge back would let a client
    /// that hangs up escape the limit.
    ///
    /// The layer applies it; the [`Limited`](crate::Limited) extractor and a
    /// [`RateLimiter`](crate::RateLimiter) can't see the response, so their code gives an
    /// admission back itself ([`Admitted::refund`](crate::Admitted::refund)). The duplicate
    /// guard, a block and a concurrency slot are never given back. A policy without rules can't
    /// count only some responses: building it fails.
    ///
    /// [`Store::give_back`]: crate::Store::give_back
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_redis_ratelimit::{Policy, Rule};
    ///
    /// // Five failed logins per 15 minutes; successes don't use the limit up.
    /// let failures = Policy::builder("login-failures")
    ///     .rule(Rule::new(5, std::time::Duration::from_secs(15 * 60)))
    ///     .count_only(|status| status == StatusCode::UNAUTHORIZED)
    ///     .build()
    ///     .unwrap();
    /// assert!(failures.counts(StatusCode::UNAUTHORIZED) && !failures.counts(StatusCode::OK));
    /// ```
    pub fn count_only<F>(mut self, counts: F) -> Self
    where
        F: Fn(http::StatusCode) -> bool + Send + Sync + 'static,
    {
        self.counts = Some(Arc::new(counts));
        self
    }

    /// Lets an instance take up to `units` units of an identity in one store call and spend them
    /// locally, so a hot identity (one tenant at 50 000 requests a second, a global limit)
    /// costs the store one call per batch of units rather than one per request. The units are
    /// charged in the shared counters, in every rule, all or nothing, when they are taken, so the
    /// shared limit is never passed; what can go wrong is only that units sit unused on one
    /// instance while another is refused: at most `instances × units` per window. How many an
    /// instance takes grows with how fast it spends them (doubling while it runs out within
    /// milliseconds), so an identity that isn't hot takes one unit per request, the exact path.
    /// Units expire with their window: a fixed window's or sliding counter's at its end (spent
    /// later they would count in a window that didn't charge them); a token bucket's once time
    /// has repaid their take (the bucket may be full again by then, having forgotten their
    /// charge: spent later, they would pass the burst), or when they sit unused for a second,
    /// and what time has not repaid of them goes back. Units given back (at shutdown, `give_back_prefetched`) go to the window that
    /// charged them, and nowhere once it has rolled.
    ///
    /// A `reset` of an identity reaches the units every instance holds of it: the memory store
    /// tells its limiters inside `reset`; the Redis store publishes the reset, and each
    /// instance's subscription drops the identity's units when the notice arrives, so what a
    /// reset leaves is the units spent between the reset and the notice (a round trip). An
    /// instance takes units ahead only while its subscription is up, and forgets every unit it
    /// holds whenever the subscription drops or comes back (notices sent meanwhile are lost).
    /// Over a pool you built (`RedisStore::new`, `from_cluster_pool`, `from_sentinel_pool`), give
    /// the store a URL to subscribe through (`RedisStore::reset_notices_from`): without one, or
    /// with a store of your own that doesn't implement
    /// [`Store::watch_resets`](crate::Store::watch_resets), there is no notice, and units held
    /// elsewhere stay spendable until their window ends.
    ///
    /// Only where units taken ahead can't let more than a limit through: fixed_window,
    /// sliding_counter and token_bucket, without a duplicate guard, a penalty block, a
    /// concurrency limit or delay mode. Building any other combination fails, naming why.
    /// `prefetch(1)` takes nothing ahead. Config files and the derive write `prefetch = 100`.
    ///
    /// ```
    /// use tower_redis_ratelimit::{Algorithm, Key, Policy, Rule};
    ///
    /// // Protect the database: 3 000 requests every 20 s across every instance.
    /// let global = Policy::builder("db")
    ///     .key(Key::global())
    ///     .algorithm(Algorithm::FixedWindow)
    ///     .rule(Rule::new(3_000, std::time::Duration::from_secs(20)))
    ///     .prefetch(100)
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(global.prefetch(), Some(100));
    /// ```
    pub fn prefetch(mut self, units: u64) -> Self {
        self.prefetch = Some(units);
        self
    }

    /// [`PolicyBuilder::count_only`] the statuses of `set`, as config files' `count_only` and
    /// the derive write them (`[401, 403]`, `["5xx"]`).
    pub fn count_only_statuses(self, set: StatusSet) -> Self {
        self.count_only(move |status| set.contains(status.as_u16()))
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

    /// Adds exceptions for identities or client networks: an allow list
    /// ([`unlimited`](crate::policy::OverrideTarget::unlimited)), a deny list
    /// ([`deny`](crate::policy::OverrideTarget::deny): 403, counted nowhere) or rules of their
    /// own ([`rules`](crate::policy::OverrideTarget::rules)); see [`Override`]. An identity
    /// override wins over a network one; among networks the first that holds the client wins.
    /// [`build`](Self::build) refuses an identity named twice, an identity the key can't yield
    /// (a non-address for [`Key::ip`], any for [`Key::global`]) and override rules the policy's
    /// algorithm can't take.
    pub fn overrides(mut self, overrides: impl IntoIterator<Item = Override>) -> Self {
        self.overrides.extend(overrides);
        self
    }

    /// Checks the policy and builds it.
    ///
    /// A [`Algorithm::SlidingLog`] policy whose logs may take more than 10 KiB of Redis memory
    /// per identity is built with a warning in the log (`tracing`), naming the algorithms whose
    /// memory doesn't grow with the limit. A log keeps one entry per admitted request in its
    /// window, about 20 bytes each up to 128 and 99 bytes past them, so that is any rule above
    /// 128 per period, or smaller rules whose limits add up to about 500.
    pub fn build(self) -> Result<Policy, PolicyError> {
        let policy = self.build_quietly()?;
        super::footprint::warn_if_large(&policy);
        Ok(policy)
    }

    /// [`build`](Self::build) without the warning: an override's policy, whose rules are for the
    /// identities or networks the override names; the warning is about every identity's rules.
    fn build_quietly(mut self) -> Result<Policy, PolicyError> {
        if let Some(name) = self.key.invalid_header() {
            return Err(PolicyError::InvalidKeyHeader {
                policy: self.name.clone(),
                name: name.to_owned(),
            });
        }
        if let Some(name) = self.meter.as_ref().and_then(Meter::invalid_usage_header) {
            return Err(PolicyError::InvalidOption {
                policy: self.name.clone(),
                option: "usage_header",
                reason: if name.is_empty() {
                    "is empty: name the response header that reports the units used"
                } else {
                    "is not a valid header name"
                },
            });
        }
        self.check_fair_share()?;
        let overrides = std::mem::take(&mut self.overrides);
        // What a `rules` override's policy is built from: this one, but for its rules.
        let base = (!overrides.is_empty()).then(|| self.clone());
        // And an override's set at run time (not for such an override's own policy).
        let run_time_base = self.counted_as_of.is_none().then(|| Box::new(self.clone()));
        let CheckedParts {
            rules,
            counted_rules,
            rule_names,
            concurrency,
        } = PolicyParts {
            name: &self.name,
            prefix: &self.prefix,
            rules: std::mem::take(&mut self.rules),
            algorithm: self.algorithm,
            mode: self.mode,
            block_for: self.block_for,
            duplicate_window: self.duplicate_window,
            max_in_flight: self.max_in_flight,
            lease: self.lease,
            quota_name: self.quota.as_ref().map(Quota::name),
            count_only: self.counts.is_some(),
            prefetch: self.prefetch,
            meter_unit: self.meter.as_ref().map(Meter::unit),
            max_usage: self.meter.as_ref().and_then(Meter::max_usage_given),
            quota_metered: self.quota.as_ref().is_some_and(Quota::is_metered),
        }
        .check()?;
        self.rules = rules;
        let counted_as = match self.counted_as_given.take() {
            Some(given) if given.len() == self.rules.len() => Some(given),
            _ => self
                .counted_as_of
                .as_deref()
                .map(|base| counted_as(&self.rules, base)),
        };
        let concurrency = concurrency.map(|(n, lease)| {
            let limit = ConcurrencyLimit::new(n, lease);
            // `<n>-in-flight`: always a valid rule name.
            (limit, limit.name().into_boxed_str())
        });
        let key_base = format!("{}:{}:", self.prefix, self.name);
        let fair_share = self.fair_share.take().map(|fair| super::Fairness {
            key: format!("{key_base}fair").into(),
            budget_name: fair.budget().name().into(),
            share_name: format!("{}-share", fair.budget().name()).into(),
            fair,
        });
        // What one request may cost the rules of requests, and reserve in the metered ones.
        let capacity = |metered: bool| {
            self.rules[..counted_rules]
                .iter()
                .enumerate()
                .filter(|(_, rule)| rule.is_metered() == metered)
                .map(|(index, rule)| (self.capacity(rule), index))
                .min()
        };
        let max_cost = capacity(false).unwrap_or((u64::MAX, 0));
        let max_estimate = capacity(true).map_or(u64::MAX, |(units, _)| units);
        // By default a report counts at most the largest metered limit.
        let max_usage = self.meter.as_ref().map(|meter| {
            meter.max_usage_given().unwrap_or_else(|| {
                let rules = self.rules.iter().filter(|rule| rule.is_metered());
                let quota = self
                    .quota
                    .as_ref()
                    .filter(|quota| quota.is_metered())
                    .map(Quota::largest_limit);
                rules.map(Rule::limit).chain(quota).max().unwrap_or(1)
            })
        });
        let overrides = match base {
            None => Overrides::default(),
            Some(base) => Overrides::build(&overrides, &self.key, |_, rules| {
                let mut own = base.clone();
                own.rules = rules.to_vec();
                own.build_quietly().map_err(|error| error.to_string())
            })
            .map_err(|(index, reason)| PolicyError::InvalidOverride {
                policy: self.name.clone(),
                index,
                reason,
            })?,
        };
        Ok(Policy(Arc::new(Inner {
            name: self.name,
            prefix: self.prefix,
            key: self.key,
            rules: self.rules.into(),
            rule_names: rule_names.into(),
            algorithm: self.algorithm,
            message: self.message,
            scope: self.scope,
            missing_key: self.missing_key,
            on_store_error: self.on_store_error,
            client_ip: self.client_ip,
            mode: self.mode,
            block_for: self.block_for,
            cost_fn: self.cost_fn,
            counts: self.counts,
            prefetch: self.prefetch.filter(|&units| units > 1),
            quota: self.quota,
            concurrency,
            max_cost,
            metering: self
                .meter
                .zip(max_usage)
                .map(|(meter, max_usage)| super::Metering {
                    meter,
                    max_estimate,
                    max_usage,
                    warned_max_usage: Default::default(),
                    warned_header: Default::default(),
                    warned_two_reports: Default::default(),
                }),
            key_base,
            fair_share,
            overrides,
            run_time_base,
            counted_as,
            fell_back: std::sync::atomic::AtomicBool::new(false),
        })))
    }

    /// The error of a fair share this policy can't take (see [`PolicyBuilder::fair_share`]).
    fn check_fair_share(&self) -> Result<(), PolicyError> {
        let Some(fair) = &self.fair_share else {
            return Ok(());
        };
        let budget = fair.budget();
        let refused = if budget.limit() == 0 || budget.period_ms() == 0 {
            Some("has a budget of limit 0 or of no period")
        } else if budget.is_duplicate_guard() {
            Some("has a duplicate guard for its budget: give it a rule")
        } else if budget.is_metered() && self.meter.is_none() {
            Some("has a metered budget without a meter: set the policy's meter")
        } else if self.rules.iter().any(|rule| rule.name() == budget.name()) {
            Some("names its budget as one of the rules: name it apart (Rule::named)")
        } else if self.key.is_global() {
            Some("is keyed by Key::global(): one identity shares its budget with nobody")
        } else if self.prefetch.is_some_and(|units| units > 1) {
            Some("takes units ahead (prefetch), which would pass the shares")
        } else {
            None
        };
        match refused {
            Some(reason) => Err(PolicyError::InvalidOption {
                policy: self.name.clone(),
                option: "fair_share",
                reason,
            }),
            None => Ok(()),
        }
    }

    /// The policy of a run-time override with `rules`, over a policy of `base` rules: see
    /// [`Policy::run_time_policy`].
    pub(super) fn run_time(
        mut self,
        rules: &[Rule],
        base: &[Rule],
        counted: Option<&[u64]>,
    ) -> Result<Policy, PolicyError> {
        self.rules = rules.to_vec();
        self.counted_as_of = Some(base.into());
        self.counted_as_given = counted.map(Into::into);
        self.build_quietly()
    }

    /// The most one request may cost under `rule`.
    fn capacity(&self, rule: &Rule) -> u64 {
        match self.algorithm {
            Algorithm::TokenBucket => rule.burst_size(),
            _ => rule.limit(),
        }
    }
}

/// The limit each of `rules` is counted under: the limit of the rule of `base` of the same period
/// and metering (one that is exactly the same first, each of `base` taken once), or its own.
fn counted_as(rules: &[Rule], base: &[Rule]) -> Box<[u64]> {
    let mut taken = vec![false; base.len()];
    let mut counted: Vec<Option<u64>> = vec![None; rules.len()];
    let same_period = |rule: &Rule, other: &Rule| {
        !rule.is_duplicate_guard()
            && !other.is_duplicate_guard()
            && rule.period_ms() == other.period_ms()
            && rule.is_metered() == other.is_metered()
    };
    for exact in [true, false] {
        for (index, rule) in rules.iter().enumerate() {
            if counted[index].is_some() {
                continue;
            }
            let found = base.iter().enumerate().position(|(at, other)| {
                !taken[at] && same_period(rule, other) && (!exact || rule.limit() == other.limit())
            });
            if let Some(at) = found {
                taken[at] = true;
                counted[index] = Some(base[at].limit());
            }
        }
    }
    rules
        .iter()
        .zip(counted)
        .map(|(rule, counted)| counted.unwrap_or(rule.limit()))
        .collect()
}

/// A request's cost from a header: a whole number of at least 1; absent or anything else: 1.
/// The header is trusted, as an app trusts what its own gateway computed; it never panics on what
/// a client sends.
fn header_cost(parts: &Parts, header: &HeaderName) -> u64 {
    parts
        .headers
        .get(header)
        .and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok())
        .filter(|&cost| cost >= 1)
        .unwrap_or(1)
}
