//! [`Limiter`]: what a layer (or a [`Limited`](crate::Limited) extractor, or a
//! [`RateLimiter`](crate::RateLimiter) handle) decides with: a request's key and cost, the store's
//! answer, and what to do with it; `answer.rs`: what it answers itself.

mod admission;
mod answer;
pub(crate) mod caller;
mod charge;
mod claim;
mod flow;
mod holding_body;
mod judge;
mod log_budget;
pub(crate) mod metered;
mod operate;
pub(crate) mod outgoing;
mod prefetch;
mod prepare;
pub(crate) mod refusals;
mod settling;
pub(crate) mod slots;
pub(crate) mod store_error_log;
pub(crate) mod telemetry;
pub(crate) mod top_refused;

pub(crate) use admission::{Admission, OnResponse, Told};
pub(crate) use answer::{Answered, Refusal};
pub(crate) use charge::{Charge, Charged};
pub(crate) use flow::{Decided, Deciding, Layered, Resolved};
pub(crate) use prefetch::give_back_unspent;
use settling::Settling;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Body;
use crossbeam_utils::CachePadded;
use http::Response;

use crate::limiter::refusals::{Asking, DEFAULT_REFUSAL_CACHE, Refusals};
use crate::limiter::slots::SlotQueues;
use crate::limiter::store_error_log::StoreErrorLog;
use crate::limiter::telemetry::PolicyMetrics;
use crate::limiter::top_refused::{
    DEFAULT_TOP_REFUSED, DEFAULT_TOP_REFUSED_GENERATION, TopRefused,
};
use crate::operate::HeavyHitter;
use crate::policy::quota::QuotaLookup;
use crate::policy::{
    Applied, Mode, Policy, PolicyError, Rule, StorageKey, StoredAction, StoredOverride,
};
use crate::response::{AnswerPlan, Protocol, TooManyRequests};
use crate::store::{Abilities, CheckRequest, FairRequest, OverrideBook, QuotaRequest, Store};

pub(crate) type RejectHandler = Arc<dyn Fn(&TooManyRequests) -> Response<Body> + Send + Sync>;

/// Everything a layer decides with, shared by all its services.
///
/// Aligned to its own cache lines: every request's clone of the service writes the count of the
/// `Arc` it lives in, and the fields every request reads must not share that line.
#[derive(Clone)]
#[repr(align(128))]
pub(crate) struct Limiter {
    policy: Policy,
    store: Arc<dyn Store>,
    legacy_headers: bool,
    on_rejected: Option<RejectHandler>,
    /// The wire side's parts of every answer, prepared once from the policy.
    answers: AnswerPlan,
    /// Requests a shadow-mode policy would have refused; shared by the clones of a layer.
    shadow_refusals: Arc<AtomicU64>,
    /// Refused identities answered without the store, and the refusal log's budget.
    refusals: Arc<Refusals>,
    /// The most refused identities, recently.
    top_refused: Arc<TopRefused>,
    /// The store-failure log and its budget per kind (shared with the override limiters: they
    /// are the same policy).
    store_errors: Arc<StoreErrorLog>,
    /// Under a budget shared fairly: the window the latest decision saw, for the saturation
    /// metric.
    saturation: Arc<telemetry::SaturationWatch>,
    /// Metric handles, registered at the first request (see [`crate::limiter::telemetry`]).
    /// Padded: every request reads it, and a line shared with a neighbour written by another
    /// core would miss on each read.
    metrics: Arc<CachePadded<OnceLock<PolicyMetrics>>>,
    /// Requests waiting for a concurrency slot (delay mode).
    slot_queues: Arc<SlotQueues>,
    /// The limiter of each `rules` override of the policy (by override index), made at the first
    /// request from this limiter's settings; a change of settings forgets them
    /// ([`Limiter::settings_changed`]), so a layer's setters reach them.
    overriding: OnceLock<Box<[Option<Arc<Limiter>>]>>,
    /// The overrides set at run time for its policy, as its store keeps them (none for an
    /// override's own limiter, or a store that keeps none).
    book: Option<Arc<OverrideBook>>,
    /// The store's copy of the addresses and networks set at run time for its policy, when its
    /// checks can't match a client's address in the store's own call
    /// ([`Store::override_mirror`]): the override found there goes with the check.
    mirror: Option<Arc<OverrideBook>>,
    /// The limiter of each override a check carries (a network's, found in `mirror`), made at
    /// its first request (forgotten, as `overriding` is, when the settings change).
    carrying: Arc<Mutex<CarryingLimiters>>,
    /// How its checks read their identity's run-time override in the store's own call (the
    /// Redis store's; [`Store::override_lookup`]); none under a run-time override's own rules.
    override_lookup: Option<Box<str>>,
    /// The limiter of each rule set a run-time override counts by, made at its first request
    /// (forgotten, as `overriding` is, when the settings change).
    run_time: Arc<Mutex<RunTimeLimiters>>,
    /// Units taken ahead for hot identities, under a policy that prefetches.
    prefetched: Option<Arc<prefetch::Prefetched>>,
    /// Whether its policy is plain: none of the options a request's flow has steps for beyond
    /// the store's check (an override, a quota, a meter, units taken ahead, a concurrency limit,
    /// a fair share, `count_only`, a mode other than enforce). Decided when it is built, so a layer's
    /// admission under it skips those steps ([`Limiter::decide_layered`]).
    plain: bool,
    /// Whether its store is remote ([`Store::is_remote`]): only a remote store's checks are
    /// timed.
    remote: bool,
    /// Its give-backs and settles on their way to the store, under an outgoing door (whose
    /// calls waiting for room listen: [`outgoing`]).
    settling: Option<Arc<Settling>>,
}

/// The limiters of the overrides checks carry, by what they do and where they count.
type CarryingLimiters = HashMap<(StoredAction, Option<Box<[u64]>>), Arc<Limiter>>;

/// The limiters of the rule sets run-time overrides count by, by rules, then by the limits their
/// counters are kept under (when a store fixed them).
type RunTimeLimiters = HashMap<Box<[Rule]>, Vec<(Option<Box<[u64]>>, Arc<Limiter>)>>;

/// What a request costs: requests in the rules that count them, units in the metered ones.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Price {
    /// The request's cost ([`Policy::cost`](crate::Policy::cost)).
    pub(crate) cost: u64,
    /// What it charges in the metered rules and quota: its meter's estimate, or one unit for an
    /// estimate of 0, so that only room for a unit admits it (1 without a meter: nothing reads
    /// it then).
    pub(crate) units: u64,
    /// Its meter's estimate: what its reservation stands at when nothing reports its usage.
    pub(crate) estimate: u64,
    /// Its identity's weight in a budget shared fairly (1 without one).
    pub(crate) weight: u32,
}

impl Price {
    /// The price of a request of `cost` whose meter estimates `estimate` units. Every metered
    /// admission needs room: an estimate of 0 reserves nothing, but is charged a unit at
    /// admission (given back when it settles), so a window without room refuses it.
    pub(crate) fn new(cost: u64, estimate: u64) -> Price {
        Price {
            cost,
            units: estimate.max(1),
            estimate,
            weight: 1,
        }
    }

    /// This price, for an identity of `weight` in a budget shared fairly.
    pub(crate) fn weighing(self, weight: u32) -> Price {
        Price { weight, ..self }
    }

    /// Exactly `units` (a give-back's, an overdraw's, units taken ahead): nothing rounded up.
    pub(crate) fn exactly(cost: u64, units: u64) -> Price {
        Price {
            cost,
            units,
            estimate: units,
            weight: 1,
        }
    }
}

/// An ask: a request ready for the store, its key, cost, units and daily quota.
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    pub(crate) key: StorageKey,
    /// Its cost, and the units it reserves in the metered rules and quota.
    pub(crate) price: Price,
    pub(crate) quota: Option<QuotaLookup>,
    /// How the limiter's own answers reach the client: HTTP or gRPC.
    protocol: Protocol,
    /// The check's span (`rate_limit`, at `debug`): policy, key kind, outcome, store latency.
    span: tracing::Span,
    /// When the store was asked; None when it is in-process (it answers at once: a clock read
    /// saved per request).
    started: Option<Instant>,
    /// Units asked for ahead, beyond the cost (a prefetching policy's hot identity).
    extra: u64,
    /// Whether an admission keeps its charge (its receipt): for a handle's caller, and under
    /// `count_only` for the response; otherwise nothing gives it back, so none is made.
    receipt: bool,
}

impl Ask {
    /// The charge of this request's cost, which admitted it with `decision` (`charged` says
    /// where its units went): its key and quota move into it (the request is resolved, and asks
    /// nothing more).
    fn take_charge(
        &mut self,
        limiter: Arc<Limiter>,
        decision: crate::Decision,
        charged: Charged,
    ) -> Charge {
        let key = std::mem::take(&mut self.key);
        Charge::new(
            limiter,
            key,
            self.price,
            self.quota.take(),
            decision,
            charged,
        )
    }

    /// This request asking for its cost alone, after a take of units ahead was refused.
    pub(crate) fn exact(&mut self) {
        self.extra = 0;
        self.asked_again();
    }

    /// The store is asked again now (its call is timed only when it is remote).
    pub(crate) fn asked_again(&mut self) {
        if self.started.is_some() {
            self.started = Some(Instant::now());
        }
    }

    /// The request as the refusal cache knows it.
    fn asking(&self) -> Asking<'_> {
        Asking {
            key: self.key.as_str(),
            cost: self.price.cost,
            units: self.price.units,
            quota: self.quota.as_ref().map(|quota| (quota.tier, quota.limit)),
        }
    }
}

/// What to do with a request before asking the store.
#[allow(
    clippy::large_enum_variant,
    reason = "returned at once and taken apart: boxing the admission would allocate per request"
)]
enum Prepared {
    /// Check it.
    Check(Ask),
    /// Check it with this limiter: a `rules` override's.
    CheckBy(Arc<Limiter>, Ask),
    /// Let it through unlimited (no key, and the policy allows that).
    Unlimited,
    /// Admitted at once, from units taken ahead.
    Admit(Admission),
    /// Answer at once (no key and the policy refuses, no client IP, a cost no rule admits).
    Respond(Refusal, Protocol),
    /// Answer at once, as this limiter (a `rules` override's) answers.
    RespondBy(Arc<Limiter>, Refusal, Protocol),
    /// Wait for units a take in flight brings (a prefetching policy's hot identity), then do
    /// what the future says: never this again.
    AwaitUnits(UnitsWait),
}

/// A request's wait for a take in flight, then what to do with it ([`Prepared::AwaitUnits`]);
/// boxed, as only such requests pay for it.
type UnitsWait = std::pin::Pin<Box<dyn std::future::Future<Output = Prepared> + Send>>;

/// What to do with a request once its check is known.
#[allow(
    clippy::large_enum_variant,
    reason = "returned at once and taken apart: boxing the admission would allocate per request"
)]
enum Verdict {
    /// Call the inner service, with what the admission holds.
    Admit(Admission),
    /// Wait this long (a reserved admission), then as `Admit`.
    Delay(Duration, Admission),
    /// Wait for a concurrency slot ([`flow`]'s wait for one): only the slot was missing, and the
    /// policy's mode lets the request wait.
    AwaitSlot,
    /// Answer at once.
    Respond(Refusal, Protocol),
    /// Answer at once, as the limiter of an override's rules (which the store applied).
    RespondBy(Arc<Limiter>, Refusal, Protocol),
    /// A take of units ahead was refused: ask again for the request's cost alone.
    Retake,
}

impl Limiter {
    /// A limiter of `policy` in `store`, unless the store can't take the policy's keys in one call
    /// (a quota keyed apart from the rules, on Redis Cluster).
    pub(crate) fn try_new(policy: Policy, store: Arc<dyn Store>) -> Result<Self, PolicyError> {
        store_can_do(&policy, &*store)?;
        if store.keys_share_one_slot()
            && let Some(quota) = policy.quota()
            && !quota.key().same_identity_as(policy.key())
        {
            return Err(PolicyError::QuotaKeyedApart {
                policy: policy.name().to_owned(),
                key: format!("{:?}", policy.key()),
                quota: quota.name().to_owned(),
                quota_key: format!("{:?}", quota.key()),
            });
        }
        Ok(Limiter::new(policy, store))
    }

    pub(crate) fn new(policy: Policy, store: Arc<dyn Store>) -> Self {
        let cache = if store.is_remote() {
            DEFAULT_REFUSAL_CACHE
        } else {
            0
        };
        let prefetched = prefetch::Prefetched::of(&policy);
        let book = store.override_book(policy.key_base());
        // (A copy costs a read and a subscription: only where overrides may be set.)
        let mirror = policy
            .takes_run_time_overrides()
            .then(|| store.override_mirror(&policy))
            .flatten();
        let override_lookup = store.override_lookup(&policy, true);
        Limiter {
            answers: AnswerPlan::new(&policy),
            plain: is_plain(&policy, prefetched.is_some()),
            remote: store.is_remote(),
            policy,
            store,
            book,
            mirror,
            carrying: Arc::default(),
            override_lookup,
            run_time: Arc::default(),
            legacy_headers: false,
            on_rejected: None,
            shadow_refusals: Arc::new(AtomicU64::new(0)),
            refusals: Arc::new(Refusals::new(cache)),
            top_refused: Arc::new(TopRefused::new(
                DEFAULT_TOP_REFUSED,
                DEFAULT_TOP_REFUSED_GENERATION,
            )),
            store_errors: Arc::default(),
            saturation: Arc::default(),
            metrics: Arc::default(),
            slot_queues: Arc::default(),
            overriding: OnceLock::new(),
            prefetched,
            settling: None,
        }
    }

    /// The limiter of a `rules` override's `policy`: this one's store, settings, shadow count,
    /// top refused and slot queues, with metric handles and a refusal cache of its own (its rules
    /// differ, and a request of the same key may fall outside a network override).
    fn with_policy(&self, policy: Policy) -> Limiter {
        let prefetched = prefetch::Prefetched::of(&policy);
        let override_lookup = self.store.override_lookup(&policy, true);
        Limiter {
            answers: AnswerPlan::new(&policy),
            plain: is_plain(&policy, prefetched.is_some()),
            remote: self.remote,
            policy,
            store: self.store.clone(),
            book: None,
            mirror: None,
            carrying: Arc::default(),
            override_lookup,
            run_time: Arc::default(),
            legacy_headers: self.legacy_headers,
            on_rejected: self.on_rejected.clone(),
            shadow_refusals: self.shadow_refusals.clone(),
            refusals: Arc::new(Refusals::new(self.refusals.capacity())),
            top_refused: self.top_refused.clone(),
            store_errors: self.store_errors.clone(),
            saturation: self.saturation.clone(),
            metrics: Arc::default(),
            slot_queues: self.slot_queues.clone(),
            overriding: OnceLock::new(),
            prefetched,
            settling: self.settling.clone(),
        }
    }

    /// The same limiter answering HTTP refusals with `handler`: its counts (in the store), refusal
    /// cache, units taken ahead, metrics and logs go on (they are shared); the limiters of its
    /// `rules` overrides are made afresh, with their own refusal caches and units.
    #[cfg(feature = "config")]
    pub(crate) fn answering_with(&self, handler: RejectHandler) -> Limiter {
        let mut limiter = self.clone();
        limiter.set_on_rejected(Some(handler));
        limiter
    }

    /// Forgets the override limiters made from the settings before a change.
    fn settings_changed(&mut self) {
        self.overriding = OnceLock::new();
        self.run_time = Arc::default();
        self.carrying = Arc::default();
    }

    /// The limiter of a run-time override counting by `rules`: made at its first use, from
    /// this limiter's settings; `None` when its rules don't make a policy (refused when it was
    /// set, so only a store written by another version could hold them). `counted`: the limits
    /// its counters are kept under, as the store that applied it named them (see
    /// [`Policy::run_time_policy`]).
    pub(super) fn run_time_limiter(
        &self,
        rules: &[Rule],
        counted: Option<&[u64]>,
    ) -> Option<Arc<Limiter>> {
        /// At most this many rule sets are kept: more are made again.
        const KEPT: usize = 1024;
        let mut made = self.run_time.lock().unwrap_or_else(PoisonError::into_inner);
        // (Found without a key made: an overridden request allocates nothing here.)
        let found = made.get(rules).and_then(|by_counters| {
            by_counters
                .iter()
                .find(|(made_counted, _)| made_counted.as_deref() == counted)
        });
        if let Some((_, limiter)) = found {
            return Some(limiter.clone());
        }
        match self.policy.run_time_policy(rules, counted) {
            Ok(policy) => {
                if made.len() >= KEPT {
                    made.clear();
                }
                let mut limiter = self.with_policy(policy);
                // (Its rules are the override's already.)
                limiter.override_lookup = None;
                let limiter = Arc::new(limiter);
                made.entry(rules.into())
                    .or_default()
                    .push((counted.map(Into::into), limiter.clone()));
                Some(limiter)
            }
            Err(error) => {
                tracing::error!(
                    policy = self.policy.name(),
                    %error,
                    "an override set at run time has rules this policy can't take: ignored"
                );
                None
            }
        }
    }

    /// The limiter of a check that carries `over`, found for its client's address in the
    /// store's copy of the networks ([`Limiter::mirror`]): this policy's rules, checked by
    /// `over`'s unless the identity has an override of its own, which the store reads in the
    /// same call. Made at its first use; `None` when the store can't carry it.
    pub(super) fn carrying_limiter(&self, over: &StoredOverride) -> Option<Arc<Limiter>> {
        /// At most this many are kept: more are made again.
        const KEPT: usize = 1024;
        let mut made = self.carrying.lock().unwrap_or_else(PoisonError::into_inner);
        let made_of = (over.action().clone(), over.counted_as().map(Into::into));
        if let Some(limiter) = made.get(&made_of) {
            return Some(limiter.clone());
        }
        let lookup = self.store.override_lookup_carrying(&self.policy, over)?;
        // (Its requests' overrides are found: it looks none up, see `Limiter::prepare`.)
        let mut limiter = self.with_policy(self.policy.clone());
        limiter.override_lookup = Some(lookup);
        let limiter = Arc::new(limiter);
        if made.len() >= KEPT {
            made.clear();
        }
        made.insert(made_of, limiter.clone());
        Some(limiter)
    }

    /// The overrides set at run time for its policy, when any is set.
    pub(super) fn run_time_overrides(&self) -> Option<&OverrideBook> {
        self.book.as_deref().filter(|book| !book.is_empty())
    }

    /// The store's copy of the networks set at run time for its policy, when any is set.
    pub(super) fn mirrored_overrides(&self) -> Option<&OverrideBook> {
        self.mirror.as_deref().filter(|mirror| !mirror.is_empty())
    }

    /// The limiter of override `index`, when it has rules.
    pub(super) fn overriding(&self, index: usize) -> Option<Arc<Limiter>> {
        let limiters = self.overriding.get_or_init(|| {
            let applied = self.policy.overrides().applied();
            let overrides = self.policy.overrides();
            applied
                .iter()
                .enumerate()
                .map(|(index, applied)| match applied {
                    Applied::Rules(policy) => {
                        let mut limiter = self.with_policy(policy.clone());
                        // A request of an identity the policy overrides: a network set at run
                        // time doesn't apply to it (an identity wins over a network).
                        if !overrides.is_network(index) {
                            limiter.override_lookup = self.store.override_lookup(policy, false);
                        }
                        Some(Arc::new(limiter))
                    }
                    Applied::Unlimited | Applied::Deny => None,
                })
                .collect()
        });
        limiters.get(index)?.clone()
    }

    /// The policy it applies.
    pub(crate) fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Sends GitHub's `X-RateLimit-*` headers too.
    pub(crate) fn set_legacy_headers(&mut self, enabled: bool) {
        self.legacy_headers = enabled;
        self.settings_changed();
    }

    /// Answers HTTP refusals with `handler` (`None`: the problem body).
    pub(crate) fn set_on_rejected(&mut self, handler: Option<RejectHandler>) {
        self.on_rejected = handler;
        self.settings_changed();
    }

    /// Remembers at most `capacity` refused identities (a cache of its own from now on).
    pub(crate) fn set_refusal_cache(&mut self, capacity: usize) {
        self.refusals = Arc::new(Refusals::new(capacity));
        self.settings_changed();
    }

    /// Tracks at most `capacity` heavy hitters (a summary of its own from now on).
    pub(crate) fn set_top_refused_capacity(&mut self, capacity: usize) {
        self.top_refused = Arc::new(TopRefused::new(capacity, DEFAULT_TOP_REFUSED_GENERATION));
        self.settings_changed();
    }

    /// The limiter of a door that waits rather than refuses ([`outgoing`]): it counts its
    /// give-backs and settles on their way to the store, so that its calls waiting for room ask
    /// again as each lands.
    pub(crate) fn outgoing(policy: Policy, store: Arc<dyn Store>) -> Self {
        Limiter {
            settling: Some(Arc::default()),
            ..Limiter::new(policy, store)
        }
    }

    /// The `n` identities refused most recently.
    pub(crate) fn top_refused(&self, n: usize) -> Vec<HeavyHitter> {
        self.top_refused.top(n, tokio::time::Instant::now())
    }

    /// How many requests it let through in shadow mode that its policy refused.
    pub(crate) fn shadow_refusals(&self) -> u64 {
        self.shadow_refusals.load(Ordering::Relaxed)
    }

    /// The layer's metric handles.
    pub(super) fn metrics(&self) -> &PolicyMetrics {
        self.metrics
            .get_or_init(|| PolicyMetrics::new(&self.policy, self.store.name()))
    }

    /// Counts `units` reserved by a metered admission made outside the flow (an outbound call).
    pub(crate) fn count_reserved(&self, units: u64) {
        self.metrics().metered("reserved", units);
    }

    /// The store.
    pub(crate) fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// Asks the store about a request: the policy's rules, algorithm, reservation and block.
    pub(crate) fn check(&self, ask: &Ask) -> crate::store::CheckFuture {
        self.check_within(ask, self.policy.mode().max_delay())
    }

    /// [`Limiter::check`], reserving at most `max_delay` ahead.
    fn check_within(&self, ask: &Ask, max_delay: Duration) -> crate::store::CheckFuture {
        let price = Price {
            cost: ask.price.cost + ask.extra,
            ..ask.price
        };
        self.check_of(&ask.key, ask.quota.as_ref(), price, max_delay)
    }

    /// Asks the store about a request of `price` for `key` and the day's `quota`, reserving at most `max_delay` ahead.
    fn check_of(
        &self,
        key: &StorageKey,
        quota: Option<&QuotaLookup>,
        price: Price,
        max_delay: Duration,
    ) -> crate::store::CheckFuture {
        let mut request = self
            .store_request(key, quota)
            .cost(price.cost)
            .units(price.units)
            .max_delay(max_delay);
        request.fair = request.fair.map(|fair| fair.weight(price.weight));
        self.store.check(&request)
    }

    /// The store's request of cost 1 for `key` (and the day's quota, `quota`) under this policy:
    /// its rules, algorithm, block and concurrency limit; refused when it doesn't fit now.
    pub(crate) fn store_request<'a>(
        &'a self,
        key: &'a StorageKey,
        quota: Option<&'a QuotaLookup>,
    ) -> CheckRequest<'a> {
        let policy = &self.policy;
        let quota = policy.quota().zip(quota).map(|(quota, lookup)| {
            QuotaRequest::new(
                lookup.key.as_str(),
                lookup.limit,
                quota.day_ms(),
                quota.day_start_offset_ms(),
                quota.thresholds(lookup.tier),
            )
            .identity(lookup.key.identity())
            .metered(quota.is_metered())
        });
        CheckRequest::new(key.as_str(), policy.rules(), policy.algorithm())
            .identity(key.identity())
            .block_for(policy.block_for())
            .quota(quota)
            .concurrency(policy.concurrency())
            .fair(
                policy
                    .fair_share()
                    .map(|fairness| FairRequest::new(&fairness.key, fairness.fair.budget())),
            )
            .counted_as(policy.counted_as())
            .override_lookup(self.override_lookup.as_deref())
    }
}

/// Whether `policy` (which takes units ahead: `prefetches`) is plain (see [`Limiter`]'s
/// `plain`).
fn is_plain(policy: &Policy, prefetches: bool) -> bool {
    policy.overrides().is_empty()
        && policy.quota().is_none()
        && policy.meter().is_none()
        && !prefetches
        && policy.concurrency().is_none()
        && policy.fair_share().is_none()
        && !policy.counts_only_some()
        && policy.mode() == Mode::Enforce
}

/// Refuses `policy` when it needs an ability `store` lacks ([`Abilities`]), naming the option
/// that needs it and the ability.
pub(crate) fn store_can_do(policy: &Policy, store: &dyn Store) -> Result<(), PolicyError> {
    let needs: [(bool, &'static str, Abilities, &'static str); 5] = [
        (
            policy.counts_only_some(),
            "count_only",
            Abilities::GIVE_BACK,
            "gives a response's unit back after it: the store lacks give_back (Store::abilities)",
        ),
        (
            policy.meter().is_some(),
            "meter",
            Abilities::GIVE_BACK.union(Abilities::OVERDRAW),
            "settles each request's units after its response: the store lacks give_back or \
             overdraw (Store::abilities)",
        ),
        (
            policy.prefetch().is_some(),
            "prefetch",
            Abilities::GIVE_BACK,
            "gives units taken ahead back: the store lacks give_back (Store::abilities)",
        ),
        (
            policy.concurrency().is_some(),
            "max_in_flight",
            Abilities::RELEASE,
            "frees a request's slot when it ends: the store lacks release (Store::abilities)",
        ),
        (
            policy.fair_share().is_some(),
            "fair_share",
            Abilities::FAIR_SHARE,
            "shares a budget fairly: the store keeps no fair shares (Store::abilities; the \
             crate's stores do)",
        ),
    ];
    let has = store.abilities();
    match needs
        .into_iter()
        .find(|(needed, _, ability, _)| *needed && !has.contains(*ability))
    {
        Some((_, option, _, reason)) => Err(PolicyError::InvalidOption {
            policy: policy.name().to_owned(),
            option,
            reason,
        }),
        None => Ok(()),
    }
}

impl fmt::Debug for Limiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("policy", &self.policy)
            .field("legacy_headers", &self.legacy_headers)
            .field("custom_rejection", &self.on_rejected.is_some())
            .finish_non_exhaustive()
    }
}
