//! Where counts live: the [`Store`] trait and its implementations.
//!
//! A store answers one question per request, in one call: *check every rule of this policy for this
//! key and, only if all pass, record the request in all of them*. That one call is one `FCALL` (or
//! `EVALSHA`) on Redis and one locked map update in memory, so a request costs one round trip whatever the number
//! of rules. Stores know nothing of HTTP.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::decision::Decision;
use crate::policy::ConcurrencyLimit;
use crate::policy::{Algorithm, Policy, Rule, StoredOverride, Whom};

mod check_future;
mod fair_request;
pub(crate) mod gcra;
mod memory;
pub(crate) mod overrides;
mod quota_request;
#[cfg(feature = "redis")]
pub(crate) mod redis;

pub use self::check_future::CheckFuture;
#[cfg(feature = "redis")]
pub(crate) use self::check_future::{Answered, Deferred};
pub use self::fair_request::FairRequest;
pub use self::memory::{Clock, ManualClock, MemoryStore, MemoryStoreBuilder, SystemClock};
#[doc(hidden)]
pub use self::overrides::{Listed, OverrideBook};
pub use self::quota_request::QuotaRequest;
#[cfg(feature = "tls")]
pub use self::redis::TlsOptions;
#[cfg(feature = "redis")]
pub use self::redis::{
    BatchStats, MINIMUM_VERSION, RedisStore, RedisVersion, ServerInfo, ServerMode, ServerSoftware,
};

/// What a store can do beyond [`Store::check`] ([`Store::abilities`]). A layer, a handle or an
/// outbound layer refuses, when it is built, a policy that needs an ability its store lacks,
/// naming it ([`PolicyError::InvalidOption`](crate::PolicyError::InvalidOption)), rather than
/// failing each request: `count_only`, a meter and `prefetch` need [`GIVE_BACK`](Self::GIVE_BACK)
/// (a meter [`OVERDRAW`](Self::OVERDRAW) too), `max_in_flight` needs [`RELEASE`](Self::RELEASE),
/// a metered outbound layer needs both give-back and overdraw.
///
/// ```
/// use tower_redis_ratelimit::store::Abilities;
///
/// let mine = Abilities::PEEK | Abilities::GIVE_BACK;
/// assert!(mine.contains(Abilities::GIVE_BACK));
/// assert!(!mine.contains(Abilities::GIVE_BACK | Abilities::OVERDRAW));
/// assert!(Abilities::ALL.contains(mine));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Abilities(u8);

impl Abilities {
    /// None beyond `check`: what a store of your own has unless it says more.
    pub const CHECK_ONLY: Abilities = Abilities(0);
    /// [`Store::peek`].
    pub const PEEK: Abilities = Abilities(1);
    /// [`Store::refund`].
    pub const REFUND: Abilities = Abilities(1 << 1);
    /// [`Store::give_back`].
    pub const GIVE_BACK: Abilities = Abilities(1 << 2);
    /// [`Store::overdraw`].
    pub const OVERDRAW: Abilities = Abilities(1 << 3);
    /// [`Store::reset`].
    pub const RESET: Abilities = Abilities(1 << 4);
    /// [`Store::pause`] and [`Store::pause_left`].
    pub const PAUSE: Abilities = Abilities(1 << 5);
    /// [`Store::release`].
    pub const RELEASE: Abilities = Abilities(1 << 6);
    /// Fair shares of a budget ([`CheckRequest::fair`]).
    pub const FAIR_SHARE: Abilities = Abilities(1 << 7);
    /// Every one: the memory store's.
    pub const ALL: Abilities = Abilities(u8::MAX);

    /// These and `other`'s (as `|`, in a `const`).
    pub const fn union(self, other: Abilities) -> Abilities {
        Abilities(self.0 | other.0)
    }

    /// Whether every ability of `other` is among these.
    pub const fn contains(self, other: Abilities) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Abilities {
    type Output = Abilities;

    fn bitor(self, other: Abilities) -> Abilities {
        Abilities(self.0 | other.0)
    }
}

/// How long a check of a networked store may take by default before it counts as a store
/// failure (the Redis store's, and a config file's `[redis] timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// One request to check: the key, the rules (all must pass), the algorithm and the request's cost,
/// and what the policy asks for beyond plain counting (a reservation, a penalty block).
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::CheckRequest;
/// use tower_redis_ratelimit::{Algorithm, Rule};
///
/// let rules = [Rule::per_second(10)];
/// let request = CheckRequest::new("rl:api:global", &rules, Algorithm::TokenBucket)
///     .cost(3)
///     .max_delay(Duration::from_millis(500));
/// assert_eq!(request.cost, 3);
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct CheckRequest<'a> {
    /// The key of the bucket, as built by the policy (`prefix:policy:identity`): it starts with the
    /// policy's prefix and a colon, and has no braces, so a store may wrap it in a hash tag.
    pub key: &'a str,
    /// The identity at the end of `key` (`user:alice`): the keys of one identity, a quota's
    /// included, may be stored together (the Redis store makes it the hash tag, so they share a
    /// Redis Cluster slot). [`CheckRequest::new`] takes the whole key.
    pub identity: &'a str,
    /// The rules, every one of which must admit the request.
    pub rules: &'a [Rule],
    /// How to count.
    pub algorithm: Algorithm,
    /// How many units the request uses in every rule (1 for a plain request). The duplicate guard
    /// ([`Rule::is_duplicate_guard`]) counts requests, so it always charges 1.
    pub cost: u64,
    /// How many metered units the request uses in every metered rule ([`Rule::is_metered`]) and
    /// a metered quota ([`QuotaRequest::metered`]): a request's estimate when it is checked, the
    /// units a settle gives back or charges on top. 1 unless set; no other rule reads it.
    pub units: u64,
    /// How long the request may wait to be admitted ([`Mode::Delay`](crate::Mode::Delay)): if
    /// the rules would admit it within this time, the store records it at that time and answers
    /// `allowed` with the [`Decision::delay`] to wait. Zero: refuse what doesn't fit now. Only
    /// algorithms that [can reserve](Algorithm::can_reserve) delay; others ignore it.
    pub max_delay: Duration,
    /// A penalty block ([`PolicyBuilder::block_for`](crate::PolicyBuilder::block_for)): when a
    /// rule other than the duplicate guard refuses the request, refuse the key outright for this
    /// long.
    pub block_for: Option<Duration>,
    /// A daily quota ([`Quota`](crate::Quota)), checked and recorded with the rules; its state is
    /// reported after the rules'.
    pub quota: Option<QuotaRequest<'a>>,
    /// A concurrency limit ([`PolicyBuilder::max_in_flight`](crate::PolicyBuilder::max_in_flight)):
    /// an admitted request also takes one of its slots, leased, and is refused when none is free
    /// (all or nothing with the rules). Its state is reported after the quota's, and the lease's id
    /// is [`Decision::lease`]: give it to [`Store::release`] when the request is done.
    pub concurrency: Option<ConcurrencyLimit>,
    /// A budget shared fairly by the identities of the policy
    /// ([`PolicyBuilder::fair_share`](crate::PolicyBuilder::fair_share)), checked and recorded
    /// with the rules; its states (the budget's, then the identity's share) are reported after
    /// the concurrency limit's. A store without [`Abilities::FAIR_SHARE`] is never sent one.
    pub fair: Option<FairRequest<'a>>,
    /// What the store does with the request: check it (and record it), peek, refund or give
    /// back.
    pub(crate) call: Call<'a>,
    /// A metered call's place in the line of calls waiting for room ([`Claim`]); none for every
    /// other check.
    pub(crate) claim: Option<Claim>,
    /// A claim's peek of the units ahead and its own: a token bucket answers, past its burst,
    /// when they will have gone one after another, not "never" (`lua/claims.lua`).
    pub(crate) past_burst: bool,
    /// The limit each rule's counter is kept under, by rule, when it differs from the rule's own
    /// (a run-time override's rule shares the counter of the policy's rule of its period): the
    /// counter's key names it, the check counts by the rule's own limit.
    pub(crate) counted_as: Option<&'a [u64]>,
    /// How a check or a peek reads its identity's override set at run time in its own call
    /// (a store that keeps them so: [`Store::override_lookup`]); none when the limiter finds it
    /// before asking, or under an override's own rules.
    pub(crate) override_lookup: Option<&'a str>,
    /// The key of the budget the identity shares fairly, for a call that doesn't check it (a
    /// reset, an inspection, a lease's release): the store keeps the identity's counts where the
    /// budget's checks do (on Redis, under the budget's hash tag).
    pub(crate) sharing: Option<&'a str>,
}

/// A metered call's place in the line of calls waiting for room (`src/limiter/claim.rs`), which
/// a check carries: the check fits only if the room left holds the units of the live claims
/// made before this one (every claim when this call has none yet) and its own. A check so
/// refused leaves its claim in the store (made once, lasting `lasting_ms` from then), so calls
/// asking later, on any instance, see the room less its units; an admission takes the claim away.
/// `lua/claims.lua` keeps them on Redis, `src/store/memory/claims.rs` in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    /// Its id, unique among the claims of a key.
    pub(crate) id: u64,
    /// How long a claim made by this check lasts (ms), at most: the call's time left to wait. 0:
    /// take the claim away and answer as a peek (the call gave up).
    pub(crate) lasting_ms: u64,
}

/// What a store call does with a [`CheckRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call<'a> {
    /// Check every rule, and record the request in all of them if all admit it
    /// ([`Store::check`]).
    Check,
    /// Decide as a check would, and record nothing ([`Store::peek`]).
    Peek,
    /// Give back `cost` units to the current windows, then answer as a peek of cost 1
    /// ([`Store::refund`]).
    Refund,
    /// Give back `cost` units to the windows this admission (the store's answer to it) charged,
    /// and nowhere else, then answer as a peek of cost 1 ([`Store::give_back`]).
    GiveBack(&'a Decision),
    /// Charge `cost` and `units` to the current windows without checking, past the limits if
    /// need be, then answer as a peek of cost 1 ([`Store::overdraw`]).
    Overdraw,
}

impl Call<'_> {
    /// Whether the call records the request (a check does; a peek, a refund and a give-back
    /// answer as a peek).
    pub(crate) fn records(self) -> bool {
        self == Call::Check
    }

    /// The call's number in the script's options (`lua/entry.lua`).
    #[cfg(feature = "redis")]
    pub(crate) fn code(self) -> u64 {
        match self {
            Call::Check => 0,
            Call::Peek => 1,
            Call::Refund => 2,
            Call::GiveBack(_) => 3,
            Call::Overdraw => 4,
        }
    }
}

impl<'a> CheckRequest<'a> {
    /// A request of cost 1, refused when it doesn't fit now, without a penalty block.
    pub fn new(key: &'a str, rules: &'a [Rule], algorithm: Algorithm) -> Self {
        CheckRequest {
            key,
            identity: key,
            rules,
            algorithm,
            cost: 1,
            units: 1,
            max_delay: Duration::ZERO,
            block_for: None,
            quota: None,
            concurrency: None,
            fair: None,
            call: Call::Check,
            claim: None,
            past_burst: false,
            counted_as: None,
            override_lookup: None,
            sharing: None,
        }
    }

    /// Keeps its identity's counts where the checks of the budget of key `budget` do (see
    /// [`CheckRequest::sharing`]).
    pub(crate) fn sharing(mut self, budget: Option<&'a str>) -> Self {
        self.sharing = budget;
        self
    }

    /// The key of the budget its identity shares fairly, checked or not.
    pub(crate) fn shared_budget(&self) -> Option<&'a str> {
        self.fair.map(|fair| fair.key).or(self.sharing)
    }

    /// Keeps each rule's counter under the limit of the same index in `counted_as` (see
    /// [`CheckRequest::counted_as`]).
    pub(crate) fn counted_as(mut self, counted_as: Option<&'a [u64]>) -> Self {
        self.counted_as = counted_as.filter(|limits| limits.len() == self.rules.len());
        self
    }

    /// Reads its identity's run-time override in the store's call, as `lookup` says (see
    /// [`Store::override_lookup`]).
    pub(crate) fn override_lookup(mut self, lookup: Option<&'a str>) -> Self {
        self.override_lookup = lookup;
        self
    }

    /// The limit the counter of rule `index` (`rule`) is kept under.
    pub(crate) fn counted_limit(&self, index: usize, rule: &Rule) -> u64 {
        self.counted_as
            .and_then(|limits| limits.get(index).copied())
            .unwrap_or_else(|| rule.limit())
    }

    /// This check as a metered call that waits its turn: see [`Claim`].
    pub(crate) fn claiming(mut self, claim: Claim) -> Self {
        debug_assert_eq!(self.call, Call::Check, "a claim rides on a check");
        self.claim = Some(claim);
        self
    }

    /// This request as a peek: decided as a check, recorded nowhere.
    pub(crate) fn peeking(mut self) -> Self {
        debug_assert_eq!(self.call, Call::Check, "a store call is one thing");
        self.call = Call::Peek;
        self
    }

    /// This request as a refund of its cost.
    pub(crate) fn refunding(mut self) -> Self {
        debug_assert_eq!(self.call, Call::Check, "a store call is one thing");
        self.call = Call::Refund;
        self
    }

    /// This request as a give-back of its cost to where the admission `charged` was charged.
    pub(crate) fn giving_back(mut self, charged: &'a Decision) -> Self {
        debug_assert_eq!(self.call, Call::Check, "a store call is one thing");
        self.call = Call::GiveBack(charged);
        self
    }

    /// This request as an overdraw: its cost and units charged past the limits if need be.
    pub(crate) fn overdrawing(mut self) -> Self {
        debug_assert_eq!(self.call, Call::Check, "a store call is one thing");
        self.call = Call::Overdraw;
        self
    }

    /// Sets the identity at the end of the key.
    pub fn identity(mut self, identity: &'a str) -> Self {
        self.identity = identity;
        self
    }

    /// Sets the cost.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = cost;
        self
    }

    /// Sets the metered units.
    pub fn units(mut self, units: u64) -> Self {
        self.units = units;
        self
    }

    /// What the request costs `rule`: 1 in the duplicate guard (it counts requests), its units in
    /// a metered rule, else its cost.
    pub(crate) fn cost_in(&self, rule: &Rule) -> u64 {
        if rule.is_duplicate_guard() {
            1
        } else if rule.is_metered() {
            self.units
        } else {
            self.cost
        }
    }

    /// What the request costs its daily quota: its units in a metered one, else its cost.
    pub(crate) fn quota_cost(&self) -> u64 {
        match self.quota {
            Some(quota) if quota.metered => self.units,
            _ => self.cost,
        }
    }

    /// Whether a rule or the quota counts metered units.
    pub(crate) fn is_metered(&self) -> bool {
        self.rules.iter().any(Rule::is_metered) || self.quota.is_some_and(|quota| quota.metered)
    }

    /// This request at one unit of every kind: what a refund's, a give-back's or an
    /// overdraw's answer peeks at.
    pub(crate) fn one_unit(self) -> Self {
        CheckRequest {
            cost: 1,
            units: 1,
            call: Call::Peek,
            ..self
        }
    }

    /// Sets how long the request may wait to be admitted.
    pub fn max_delay(mut self, max_delay: Duration) -> Self {
        self.max_delay = max_delay;
        self
    }

    /// Sets the penalty block.
    pub fn block_for(mut self, block_for: Option<Duration>) -> Self {
        self.block_for = block_for;
        self
    }

    /// Sets the budget shared fairly.
    #[must_use]
    pub fn fair(mut self, fair: Option<FairRequest<'a>>) -> Self {
        self.fair = fair;
        self
    }

    /// Sets the daily quota.
    pub fn quota(mut self, quota: Option<QuotaRequest<'a>>) -> Self {
        self.quota = quota;
        self
    }

    /// Sets the concurrency limit.
    pub fn concurrency(mut self, concurrency: Option<ConcurrencyLimit>) -> Self {
        self.concurrency = concurrency;
        self
    }
}

/// How long a reset's marker must last (ms): as long as a receipt of an admission before the
/// reset can still give something back, so that none gives back to the counts after it. A
/// sliding counter's charged window weighs for two periods; a token bucket's charge is unrepaid
/// until its full time, at most its tolerance (and a reservation's delay) away; a sliding log's
/// entry lasts a period (a reservation's, its delay more).
pub(crate) fn reset_marker_ms(request: &CheckRequest<'_>) -> u64 {
    let delay = u64::try_from(request.max_delay.as_millis()).unwrap_or(u64::MAX);
    request
        .rules
        .iter()
        .map(|rule| {
            let period = rule.period_ms();
            let tolerance = gcra::Bucket::new(rule.limit(), period, rule.burst_size()).tolerance;
            period
                .saturating_mul(2)
                .max(period.saturating_add(tolerance.div_ceil(1_000)))
        })
        .max()
        .unwrap_or(0)
        .saturating_add(delay)
}

/// A rate-limit store.
///
/// `check` must be atomic: it checks every rule and records the request in all of them only if all
/// admit it; a refused request changes nothing. It returns a [`CheckFuture`]: an in-process store
/// answers with [`CheckFuture::ready`] (no allocation, no task switch), a networked one with
/// [`CheckFuture::from_future`].
///
/// The trait is object safe, so stores can be shared as `Arc<dyn Store>`.
pub trait Store: Send + Sync + 'static {
    /// Checks and, if every rule admits it, records one request.
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture;

    /// Reads what [`Store::check`] would answer for `request` now, and records nothing: no
    /// charge, no key created, no expiry moved, no block started, no lease taken. Each rule's
    /// `remaining` is what it has left now; `allowed` and the retries say whether the check would
    /// be admitted (without waiting: a peek reserves nothing). The stores of this crate can;
    /// another store answers [`StoreError::Config`] unless it says how.
    fn peek(&self, request: &CheckRequest<'_>) -> CheckFuture {
        let _ = request;
        CheckFuture::ready(Err(StoreError::Config(format!(
            "the {} store can't peek at a key",
            self.name()
        ))))
    }

    /// Gives back `request.cost` units charged earlier in the current windows of every counted
    /// rule and the day's quota (not the duplicate guard, a block or a slot): a fixed window's or
    /// sliding counter's current count goes down, a token bucket's debt, a sliding log drops its
    /// newest units. Never below zero; units of a window that has rolled are not given back.
    /// Answers what a [`Store::peek`] would then find. The stores of this crate can; another
    /// store answers [`StoreError::Config`] unless it says how.
    ///
    /// An operator's tool: it can't know which admission the units were charged by, so it can
    /// give back units another admission charged to the current window, and let that window pass
    /// its limit. Give back an admission's own units with [`Store::give_back`].
    fn refund(&self, request: &CheckRequest<'_>) -> CheckFuture {
        let _ = request;
        CheckFuture::ready(Err(StoreError::Config(format!(
            "the {} store can't refund",
            self.name()
        ))))
    }

    /// Gives back `request.cost` units of the admission whose answer was `charged` (what
    /// [`Store::check`] answered for it, `allowed`), to the windows it charged and nowhere else,
    /// and only what they still hold of it: every counted rule and the day's quota (not the
    /// duplicate guard, a block or a slot). A fixed window gets them back while the charged
    /// window is the current one; a sliding counter in the charged window's count, while it is
    /// the current or the previous one (it still weighs in the estimate); a sliding log from the
    /// entries admitted at or before the charge's time, newest first (its own, or older ones,
    /// which leave no later); a token bucket only what time has not repaid yet (of a charge of
    /// `k` units that moved the bucket's full time to `T`, `min(k, (T - now) / interval)`), never
    /// past full; the quota while the charged day lasts. A rolled window gets nothing. Answers
    /// what a [`Store::peek`] would then find. The stores of this crate can; another store
    /// answers [`StoreError::Config`] unless it says how.
    fn give_back(&self, request: &CheckRequest<'_>, charged: &Decision) -> CheckFuture {
        let _ = (request, charged);
        CheckFuture::ready(Err(StoreError::Config(format!(
            "the {} store can't give back an admission's units",
            self.name()
        ))))
    }

    /// Charges `request.cost` units to every counted rule counting requests and `request.units`
    /// to every metered one ([`Rule::is_metered`]) and the day's quota (as it counts), in their
    /// current windows, without checking: past their limits if need be, each by at most its
    /// limit (a token bucket's burst). A settle's debt: the units an admitted request used
    /// beyond its reservation. Later checks are refused, with an honest retry time, until the
    /// windows have room again. Never the duplicate guard, a block or a slot. Answers what a
    /// [`Store::peek`] would then find. The stores of this crate can; another store answers
    /// [`StoreError::Config`] unless it says how.
    fn overdraw(&self, request: &CheckRequest<'_>) -> CheckFuture {
        let _ = request;
        CheckFuture::ready(Err(StoreError::Config(format!(
            "the {} store can't charge units past a limit",
            self.name()
        ))))
    }

    /// Whether every key of one check must be in one place: on Redis Cluster one script call
    /// reaches one hash slot, so a request's keys must share their hash tag, its identity. A layer
    /// over such a store refuses a policy whose quota is keyed apart from its rules
    /// ([`PolicyError::QuotaKeyedApart`](crate::PolicyError::QuotaKeyedApart)). `false` by
    /// default.
    fn keys_share_one_slot(&self) -> bool {
        false
    }

    /// Whether a check costs a round trip (a networked store): then a layer caches refused
    /// identities by default ([`RateLimitLayer::refusal_cache`](crate::RateLimitLayer::refusal_cache)),
    /// measuring their retry times on the local monotonic clock. `false` by default: an in-process
    /// store answers as fast as the cache would, and may run on a clock of its own.
    fn is_remote(&self) -> bool {
        false
    }

    /// What the store can do beyond [`Store::check`]: the methods it implements. A layer refuses,
    /// when it is built, a policy that needs one it lacks (see [`Abilities`]).
    /// [`Abilities::CHECK_ONLY`] by default: a store of your own that implements `give_back`,
    /// `release` or the others says so here.
    fn abilities(&self) -> Abilities {
        Abilities::CHECK_ONLY
    }

    /// Whether the store keeps the claims of metered outbound calls waiting for room, so that
    /// calls asking later see the room less what earlier ones wait for (the crate's stores do).
    /// A store that doesn't answers the checks of waiting calls as any other check, and is never
    /// sent a claim's withdrawal. `false` by default.
    #[doc(hidden)]
    fn keeps_claims(&self) -> bool {
        false
    }

    /// Forgets what `request.key` has counted under `request.rules` (every counter, reservation and
    /// duplicate guard of them) and lifts its penalty block (with `request.block_for` set), as if
    /// it had never been seen. A daily quota is left alone: it is often what a customer pays for,
    /// and may be shared with other policies. Nothing is counted.
    ///
    /// The default refuses with [`StoreError::Config`]: a store of your own resets only if it
    /// says how.
    fn reset(&self, request: &CheckRequest<'_>) -> ActionFuture {
        let _ = request;
        Box::pin(std::future::ready(Err(StoreError::Config(format!(
            "the {} store can't reset a key",
            self.name()
        )))))
    }

    /// Registers `listener` to hear of every key reset ([`Store::reset`]) by any instance
    /// sharing the store, and of every moment notices may have been missed; an instance holding
    /// units of a key ahead ([`PolicyBuilder::prefetch`](crate::PolicyBuilder::prefetch)) drops
    /// them, so a reset reaches them. Returns whether notices are heard now
    /// ([`ResetWatch::is_live`]: the instance takes units ahead only then), or `None` when the
    /// store can't tell its instances of resets: the default. Listeners that are gone (the
    /// `Weak` no longer upgrades) are forgotten.
    ///
    /// The memory store tells its listeners at once, inside `reset`. The Redis store publishes
    /// each reset on a channel (`tower-redis-ratelimit:resets`) from the reset's own script, and
    /// a subscription of its own (made at the first listener) tells its listeners; over a pool
    /// you built (`RedisStore::new`, `from_cluster_pool`, `from_sentinel_pool`) it subscribes
    /// through the URL given to `RedisStore::reset_notices_from`, and answers `None` without.
    fn watch_resets(&self, listener: Weak<dyn ResetListener>) -> Option<ResetWatch> {
        let _ = listener;
        None
    }

    /// Pauses `request.key` for `pause`: until then every check of it with a `block_for` (the
    /// outbound layer's) is refused with the pause's end as its retry time, on every instance.
    /// A pause never shortens one already longer. For an upstream that announced its own limit
    /// (`Retry-After`, `RateLimit: r=0`).
    ///
    /// The default refuses with [`StoreError::Config`].
    fn pause(&self, request: &CheckRequest<'_>, pause: Duration) -> ActionFuture {
        let _ = (request, pause);
        Box::pin(std::future::ready(Err(StoreError::Config(format!(
            "the {} store can't pause a key",
            self.name()
        )))))
    }

    /// How long the pause ([`Store::pause`]) or penalty block of `request.key` has left, if one
    /// is on, read without counting anything: for a call of the outbound layer that waited for
    /// its reserved slot, to see before it is sent whether its upstream was paused meanwhile, on
    /// any instance. The memory store reads its entry; the Redis store reads the block key's
    /// time to live (`lua/pause_left.lua`), one round trip.
    ///
    /// The default asks [`Store::check`] a request of cost 0 without duplicate guard, quota,
    /// concurrency limit or wait (it fits every rule and records nothing, as an operator's
    /// inspection does): a refusal's retry time is the pause's end.
    fn pause_left(&self, request: &CheckRequest<'_>) -> PauseFuture {
        let rules: Vec<Rule> = request
            .rules
            .iter()
            .filter(|rule| !rule.is_duplicate_guard())
            .cloned()
            .collect();
        let inspection = CheckRequest {
            rules: &rules,
            cost: 0,
            max_delay: Duration::ZERO,
            quota: None,
            concurrency: None,
            // (Nor a budget shared fairly: an inspection is not a tenant's demand.)
            fair: None,
            counted_as: None,
            ..*request
        }
        .sharing(request.shared_budget());
        let check = self.check(&inspection);
        Box::pin(async move {
            let decision = check.await?;
            Ok(if decision.allowed {
                None
            } else {
                decision.retry_after().filter(|left| !left.is_zero())
            })
        })
    }

    /// Releases the slot that lease `lease` ([`Decision::lease`]) holds under `request.key`'s
    /// concurrency limit (`request.concurrency`), before its lease expires. Releasing a lease that
    /// expired or was released already does nothing.
    ///
    /// The default refuses with [`StoreError::Config`]: a store of your own that takes
    /// concurrency limits says how to release them.
    fn release(&self, request: &CheckRequest<'_>, lease: u64) -> ActionFuture {
        let _ = (request, lease);
        Box::pin(std::future::ready(Err(StoreError::Config(format!(
            "the {} store can't release a concurrency slot",
            self.name()
        )))))
    }

    /// Releases as [`Store::release`] does, without the caller waiting: `released` gets the
    /// answer, run wherever the store reads it (the crate's Redis store: from the task that sends
    /// the batch the release rides). The default polls [`Store::release`] once, then waits for it
    /// in a task of its own; without a runtime (a test's teardown) it gives up, and the lease
    /// expires.
    #[doc(hidden)]
    fn release_then(&self, request: &CheckRequest<'_>, lease: u64, released: Released) {
        let mut release = self.release(request, lease);
        match release
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
        {
            std::task::Poll::Ready(result) => released(result),
            std::task::Poll::Pending => {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move { released(release.await) });
                }
            }
        }
    }

    /// The store's name in the crate's metrics (the `store` label): `memory`, `redis`, or, unless
    /// a store of your own says otherwise, `custom`.
    fn name(&self) -> &'static str {
        "custom"
    }

    /// The overrides set at run time for the policy whose keys start with `policy`
    /// (`prefix:name:`), which a limiter reads before each check; `None` (the default): the
    /// store keeps none.
    #[doc(hidden)]
    fn override_book(&self, policy: &str) -> Option<Arc<OverrideBook>> {
        let _ = policy;
        None
    }

    /// How a check of `policy` reads its identity's override set at run time in the store's own
    /// call ([`CheckRequest::override_lookup`]), for a store that keeps them so (the Redis
    /// store: the ending of the check's shape, see `lua/overrides.lua`); `None` (the default):
    /// the limiter finds them before it asks ([`Store::override_book`]), or there are none.
    /// `networks`: whether overrides of addresses and networks apply too (not to the requests
    /// of an identity the policy itself overrides: an identity wins over a network).
    #[doc(hidden)]
    fn override_lookup(&self, policy: &Policy, networks: bool) -> Option<Box<str>> {
        let _ = (policy, networks);
        None
    }

    /// A copy of the addresses and networks set at run time for `policy`, which a limiter
    /// matches a request's client address against before its check when the store's call
    /// can't (the Redis store: under a key other than the client address, or on a Cluster),
    /// and whose override the check then carries ([`Store::override_lookup_carrying`]);
    /// `None` (the default): the store matches them itself, or keeps none.
    #[doc(hidden)]
    fn override_mirror(&self, policy: &Policy) -> Option<Arc<OverrideBook>> {
        let _ = policy;
        None
    }

    /// [`Store::override_lookup`] for a check of `policy` whose client address falls under
    /// `over` in the store's copy ([`Store::override_mirror`]): the store applies the
    /// identity's own override, or else `over`. `None` (the default): none applies.
    #[doc(hidden)]
    fn override_lookup_carrying(&self, policy: &Policy, over: &StoredOverride) -> Option<Box<str>> {
        let _ = (policy, over);
        None
    }

    /// Sets `over` for `policy`, lasting `lasting` (`None`: until removed), for every instance
    /// sharing the store. The default refuses with [`StoreError::Config`].
    #[doc(hidden)]
    fn set_override(
        &self,
        policy: &Policy,
        over: StoredOverride,
        lasting: Option<Duration>,
    ) -> ActionFuture {
        let _ = (policy, over, lasting);
        Box::pin(std::future::ready(Err(no_overrides(self.name()))))
    }

    /// Removes the override of `whom` under `policy`. The default refuses with
    /// [`StoreError::Config`].
    #[doc(hidden)]
    fn remove_override(&self, policy: &Policy, whom: &Whom) -> ActionFuture {
        let _ = (policy, whom);
        Box::pin(std::future::ready(Err(no_overrides(self.name()))))
    }

    /// The overrides set under the policy whose keys start with `policy`. The default refuses
    /// with [`StoreError::Config`].
    #[doc(hidden)]
    fn list_overrides(&self, policy: &str) -> ListFuture {
        let _ = policy;
        Box::pin(std::future::ready(Err(no_overrides(self.name()))))
    }
}

/// What a store that keeps no run-time overrides answers.
fn no_overrides(store: &str) -> StoreError {
    StoreError::Config(format!(
        "the {store} store can't keep overrides set at run time"
    ))
}

/// What [`Store::list_overrides`] answers.
#[doc(hidden)]
pub type ListFuture =
    Pin<Box<dyn Future<Output = Result<Vec<Listed>, StoreError>> + Send + 'static>>;

impl<S: Store + ?Sized> Store for Arc<S> {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        (**self).check(request)
    }

    fn peek(&self, request: &CheckRequest<'_>) -> CheckFuture {
        (**self).peek(request)
    }

    fn refund(&self, request: &CheckRequest<'_>) -> CheckFuture {
        (**self).refund(request)
    }

    fn give_back(&self, request: &CheckRequest<'_>, charged: &Decision) -> CheckFuture {
        (**self).give_back(request, charged)
    }

    fn overdraw(&self, request: &CheckRequest<'_>) -> CheckFuture {
        (**self).overdraw(request)
    }

    fn keys_share_one_slot(&self) -> bool {
        (**self).keys_share_one_slot()
    }

    fn is_remote(&self) -> bool {
        (**self).is_remote()
    }

    fn keeps_claims(&self) -> bool {
        (**self).keeps_claims()
    }

    fn abilities(&self) -> Abilities {
        (**self).abilities()
    }

    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn reset(&self, request: &CheckRequest<'_>) -> ActionFuture {
        (**self).reset(request)
    }

    fn watch_resets(&self, listener: Weak<dyn ResetListener>) -> Option<ResetWatch> {
        (**self).watch_resets(listener)
    }

    fn pause(&self, request: &CheckRequest<'_>, pause: Duration) -> ActionFuture {
        (**self).pause(request, pause)
    }

    fn pause_left(&self, request: &CheckRequest<'_>) -> PauseFuture {
        (**self).pause_left(request)
    }

    fn release(&self, request: &CheckRequest<'_>, lease: u64) -> ActionFuture {
        (**self).release(request, lease)
    }

    fn release_then(&self, request: &CheckRequest<'_>, lease: u64, released: Released) {
        (**self).release_then(request, lease, released);
    }

    fn override_book(&self, policy: &str) -> Option<Arc<OverrideBook>> {
        (**self).override_book(policy)
    }

    fn override_lookup(&self, policy: &Policy, networks: bool) -> Option<Box<str>> {
        (**self).override_lookup(policy, networks)
    }

    fn override_mirror(&self, policy: &Policy) -> Option<Arc<OverrideBook>> {
        (**self).override_mirror(policy)
    }

    fn override_lookup_carrying(&self, policy: &Policy, over: &StoredOverride) -> Option<Box<str>> {
        (**self).override_lookup_carrying(policy, over)
    }

    fn set_override(
        &self,
        policy: &Policy,
        over: StoredOverride,
        lasting: Option<Duration>,
    ) -> ActionFuture {
        (**self).set_override(policy, over, lasting)
    }

    fn remove_override(&self, policy: &Policy, whom: &Whom) -> ActionFuture {
        (**self).remove_override(policy, whom)
    }

    fn list_overrides(&self, policy: &str) -> ListFuture {
        (**self).list_overrides(policy)
    }
}

/// Hears of the keys reset on a store by any instance sharing it ([`Store::watch_resets`]).
pub trait ResetListener: Send + Sync + 'static {
    /// `key` (as [`CheckRequest::key`] names it) was reset: forget what is held of it.
    fn key_reset(&self, key: &str);

    /// Notices may have been missed (the store's subscription dropped or came back): forget
    /// everything held.
    fn notices_lost(&self);
}

/// Whether a store's reset notices are heard now ([`Store::watch_resets`]).
#[derive(Debug, Clone)]
pub struct ResetWatch(Arc<AtomicBool>);

impl ResetWatch {
    /// Notices heard while `live` holds `true`.
    pub fn new(live: Arc<AtomicBool>) -> Self {
        ResetWatch(live)
    }

    /// Notices always heard (an in-process store tells its listeners itself).
    pub fn always() -> Self {
        ResetWatch(Arc::new(AtomicBool::new(true)))
    }

    /// Whether notices are heard now.
    pub fn is_live(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// What [`Store::reset`], [`Store::pause`] and [`Store::release`] return: done, or why not.
pub type ActionFuture = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'static>>;

/// What [`Store::release_then`] does with a release's answer.
#[doc(hidden)]
pub type Released = Box<dyn FnOnce(Result<(), StoreError>) + Send + 'static>;

/// What [`Store::pause_left`] returns: the time a pause has left (`None`: not paused), or why it
/// could not be read.
pub type PauseFuture =
    Pin<Box<dyn Future<Output = Result<Option<Duration>, StoreError>> + Send + 'static>>;

/// Why a store could not answer. Never a rate limit: the policy's
/// [`OnStoreError`](crate::OnStoreError) decides what the request gets.
///
/// Two families ([`StoreError::is_fault`]): *outages* ([`Unavailable`](StoreError::Unavailable),
/// [`Timeout`](StoreError::Timeout), [`NotReplicated`](StoreError::NotReplicated)) end when the
/// store is back; *faults* (the others: a script error, a key of the wrong type, a Redis out of
/// memory, a reply the crate can't read, a Redis too old, a misconfiguration) go on until someone
/// mends them.
/// Each has its own [`kind`](StoreError::kind), the `kind` label of
/// `ratelimit_store_errors_total`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached (connection refused, pool exhausted, I/O error).
    #[error("rate-limit store unavailable: {0}")]
    Unavailable(#[source] Box<dyn StdError + Send + Sync>),
    /// The store did not answer within the configured time.
    #[error("rate-limit store did not answer within {0:?}")]
    Timeout(Duration),
    /// The store answered something the crate can't read (a malformed or unexpected reply: a
    /// script of another version, or another program, under the store's name).
    #[error("rate-limit store answered unexpectedly: {0}")]
    Protocol(String),
    /// The store's script failed (a Lua error, or a command in it that Redis answered with
    /// `ERR`), in Redis's words.
    #[error("rate-limit store script failed: {0}")]
    Script(String),
    /// A key the store uses holds a value of another type (Redis's `WRONGTYPE`, in its words):
    /// something else writes under the policy's prefix.
    #[error("rate-limit store key of the wrong type: {0}")]
    WrongType(String),
    /// The store refused to write for want of memory (Redis's `OOM` at `maxmemory` under the
    /// `noeviction` policy, in its words).
    #[error("rate-limit store out of memory: {0}")]
    OutOfMemory(String),
    /// The store can't be set up as asked (a malformed URL, a CA file that isn't PEM, a request
    /// whose keys a Redis Cluster can't take in one call).
    #[error("rate-limit store misconfigured: {0}")]
    Config(String),
    /// Fewer replicas than [`RedisStore::wait_for_replicas`] asks for acknowledged the check's
    /// writes in time: it is recorded on the primary but could be lost in a failover.
    #[error("rate-limit check reached {acknowledged} of the {wanted} replicas it waits for")]
    NotReplicated {
        /// Replicas the store waits for.
        wanted: u32,
        /// Replicas that acknowledged in time.
        acknowledged: u32,
    },
    /// The Redis server is older than the store runs on (see
    /// [`MINIMUM_VERSION`]): its scripts would fail. Logged at
    /// ERROR when first seen; the store asks the server again at most once a second, so an
    /// upgrade is picked up without a restart.
    #[error("Redis {found} is too old for the rate limiter: it needs Redis {minimum} or later")]
    UnsupportedVersion {
        /// The server's version, as it reports it.
        found: String,
        /// The oldest version the store runs on.
        minimum: &'static str,
    },
}

impl StoreError {
    /// What kind of failure this is, as the `kind` label of `ratelimit_store_errors_total` and
    /// the `kind` field of the log line name it: `unavailable`, `timeout`, `not_replicated`
    /// (outages), `protocol`, `script`, `wrong_type`, `out_of_memory`, `unsupported_version`,
    /// `config` (faults).
    ///
    /// ```
    /// use tower_redis_ratelimit::StoreError;
    ///
    /// let error = StoreError::WrongType("WRONGTYPE Operation against a key".into());
    /// assert_eq!(error.kind(), "wrong_type");
    /// assert!(error.is_fault());
    /// ```
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Timeout(_) => "timeout",
            StoreError::NotReplicated { .. } => "not_replicated",
            StoreError::Protocol(_) => "protocol",
            StoreError::Script(_) => "script",
            StoreError::WrongType(_) => "wrong_type",
            StoreError::OutOfMemory(_) => "out_of_memory",
            StoreError::Config(_) => "config",
            StoreError::UnsupportedVersion { .. } => "unsupported_version",
        }
    }

    /// Whether this is a fault rather than an outage: something no wait or retry mends (a script
    /// error, a key of the wrong type, a Redis out of memory, a reply the crate can't read, a
    /// misconfiguration), which an operator must. Faults are logged at `error`, outages (the
    /// store unreachable, slow, or short of replicas) at `warn`; both are answered by the
    /// policy's [`OnStoreError`](crate::OnStoreError).
    pub fn is_fault(&self) -> bool {
        match self {
            StoreError::Unavailable(_)
            | StoreError::Timeout(_)
            | StoreError::NotReplicated { .. } => false,
            StoreError::Protocol(_)
            | StoreError::Script(_)
            | StoreError::WrongType(_)
            | StoreError::OutOfMemory(_)
            | StoreError::Config(_)
            | StoreError::UnsupportedVersion { .. } => true,
        }
    }
}
