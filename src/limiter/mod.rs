//! [`Limiter`]: what a layer (or a [`Limited`](crate::Limited) extractor, or a
//! [`RateLimiter`](crate::RateLimiter) handle) decides with: a request's key and cost, the store's
//! answer, and what to do with it; `answer.rs`: what it answers itself.

mod admission;
mod answer;
mod charge;
mod flow;
mod named;
mod operate;
mod prefetch;

use prefetch::Spent;

pub(crate) use admission::{Admission, OnResponse};
pub(crate) use answer::{Answer, Answered, Refusal};
pub(crate) use charge::{Charge, Charged};
pub(crate) use flow::{Decided, Deciding, Settled};

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Response, StatusCode};

use crate::concurrency::{Lease, SlotQueues};
use crate::decision::{Decision, RuleState};
use crate::policy::quota::QuotaLookup;
use crate::policy::{
    Applied, KeyLookup, Mode, OnStoreError, Policy, PolicyError, StateOf, StorageKey,
};
use crate::refusals::{Asking, DEFAULT_REFUSAL_CACHE, Refusals};
use crate::response::{AnswerPlan, LimitHeaders, Protocol, TooManyRequests};
use crate::store::{CheckRequest, QuotaRequest, Store, StoreError};
use crate::store_error_log::StoreErrorLog;
use crate::telemetry::{Outcome, PolicyMetrics};
use crate::top_refused::{DEFAULT_TOP_REFUSED, DEFAULT_TOP_REFUSED_GENERATION, TopRefused};

/// The first pause of a request polling for a concurrency slot; it doubles up to [`MAX_SLOT_POLL`].
const FIRST_SLOT_POLL: Duration = Duration::from_millis(5);

/// The longest pause of a request polling for a concurrency slot released by another instance.
const MAX_SLOT_POLL: Duration = Duration::from_millis(100);

pub(crate) type RejectHandler = Arc<dyn Fn(&TooManyRequests) -> Response<Body> + Send + Sync>;

/// Everything a layer decides with, shared by all its services.
#[derive(Clone)]
pub(crate) struct Limiter {
    pub(crate) policy: Policy,
    store: Arc<dyn Store>,
    pub(crate) legacy_headers: bool,
    pub(crate) on_rejected: Option<RejectHandler>,
    /// The wire side's parts of every answer, prepared once from the policy.
    answers: AnswerPlan,
    /// Requests a shadow-mode policy would have refused; shared by the clones of a layer.
    pub(crate) shadow_refusals: Arc<AtomicU64>,
    /// Refused identities answered without the store, and the refusal log's budget.
    pub(crate) refusals: Arc<Refusals>,
    /// The most refused identities, recently.
    pub(crate) top_refused: Arc<TopRefused>,
    /// The store-failure log and its budget per kind (shared with the override limiters: they
    /// are the same policy).
    store_errors: Arc<StoreErrorLog>,
    /// Metric handles, registered at the first request (see [`crate::telemetry`]).
    metrics: Arc<OnceLock<PolicyMetrics>>,
    /// Requests waiting for a concurrency slot (delay mode).
    slot_queues: Arc<SlotQueues>,
    /// The limiter of each `rules` override of the policy (by override index), made at the first
    /// request from this limiter's settings; a change of settings forgets them
    /// ([`Limiter::settings_changed`]), so a layer's setters reach them.
    overriding: OnceLock<Box<[Option<Arc<Limiter>>]>>,
    /// Units taken ahead for hot identities, under a policy that prefetches.
    prefetched: Option<Arc<prefetch::Prefetched>>,
}

/// A request ready for the store: its key, cost and daily quota.
#[derive(Debug, Clone)]
pub(crate) struct Checked {
    pub(crate) key: StorageKey,
    pub(crate) cost: u64,
    pub(crate) quota: Option<QuotaLookup>,
    /// How the limiter's own answers reach the client: HTTP or gRPC.
    protocol: Protocol,
    /// The check's span (`rate_limit`, at `debug`): policy, key kind, outcome, store latency.
    span: tracing::Span,
    /// When the store was asked.
    started: Instant,
    /// Units asked for ahead, beyond the cost (a prefetching policy's hot identity).
    extra: u64,
}

impl Checked {
    /// The charge of this request's cost, answered `charged`: its key and quota move into it
    /// (the request is settled, and asks nothing more).
    fn take_charge(&mut self, limiter: Arc<Limiter>, charged: Charged) -> Charge {
        let key = std::mem::take(&mut self.key);
        Charge::new(limiter, key, self.cost, self.quota.take(), charged)
    }

    /// This request asking for its cost alone, after a take of units ahead was refused.
    pub(crate) fn exact(&mut self) {
        self.extra = 0;
        self.started = Instant::now();
    }

    /// The request as the refusal cache knows it.
    fn asking(&self) -> Asking<'_> {
        Asking {
            key: self.key.as_str(),
            cost: self.cost,
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
    Check(Checked),
    /// Check it with this limiter: a `rules` override's.
    CheckBy(Arc<Limiter>, Checked),
    /// Let it through unlimited (no key, and the policy allows that).
    Unlimited,
    /// Admitted at once, from units taken ahead.
    Admit(Admission),
    /// Answer at once (no key and the policy refuses, no client IP, a cost no rule admits).
    Respond(Answer),
    /// Answer at once, as this limiter (a `rules` override's) answers.
    RespondBy(Arc<Limiter>, Answer),
    /// Wait for units a take in flight brings (a prefetching policy's hot identity), then do
    /// what the future says: never this again.
    AwaitUnits(UnitsWait),
}

/// A request's wait for a take in flight, then what to do with it ([`Prepared::AwaitUnits`]);
/// boxed, as only such requests pay for it.
type UnitsWait = std::pin::Pin<Box<dyn std::future::Future<Output = Prepared> + Send>>;

/// What an override does to a request.
enum Overridden {
    /// Lets it through unlimited.
    Unlimited,
    /// Refuses it (403).
    Denied,
    /// Hands it to the limiter of its own rules.
    By(Arc<Limiter>),
    /// Nothing (an override with rules the limiter can't find).
    No,
}

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
    /// Wait for a concurrency slot ([`Limiter::wait_for_slot`]): only the slot was missing, and the
    /// policy's mode lets the request wait.
    AwaitSlot,
    /// Answer at once.
    Respond(Answer),
    /// A take of units ahead was refused: ask again for the request's cost alone.
    Retake,
}

impl Limiter {
    /// A limiter of `policy` in `store`, unless the store can't take the policy's keys in one call
    /// (a quota keyed apart from the rules, on Redis Cluster).
    pub(crate) fn try_new(policy: Policy, store: Arc<dyn Store>) -> Result<Self, PolicyError> {
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
        Limiter {
            answers: AnswerPlan::new(&policy),
            policy,
            store,
            legacy_headers: false,
            on_rejected: None,
            shadow_refusals: Arc::new(AtomicU64::new(0)),
            refusals: Arc::new(Refusals::new(cache)),
            top_refused: Arc::new(TopRefused::new(
                DEFAULT_TOP_REFUSED,
                DEFAULT_TOP_REFUSED_GENERATION,
            )),
            store_errors: Arc::default(),
            metrics: Arc::default(),
            slot_queues: Arc::default(),
            overriding: OnceLock::new(),
            prefetched,
        }
    }

    /// The limiter of a `rules` override's `policy`: this one's store, settings, shadow count,
    /// top refused and slot queues, with metric handles and a refusal cache of its own (its rules
    /// differ, and a request of the same key may fall outside a network override).
    fn with_policy(&self, policy: Policy) -> Limiter {
        let prefetched = prefetch::Prefetched::of(&policy);
        Limiter {
            answers: AnswerPlan::new(&policy),
            policy,
            store: self.store.clone(),
            legacy_headers: self.legacy_headers,
            on_rejected: self.on_rejected.clone(),
            shadow_refusals: self.shadow_refusals.clone(),
            refusals: Arc::new(Refusals::new(self.refusals.capacity())),
            top_refused: self.top_refused.clone(),
            store_errors: self.store_errors.clone(),
            metrics: Arc::default(),
            slot_queues: self.slot_queues.clone(),
            overriding: OnceLock::new(),
            prefetched,
        }
    }

    /// The same limiter answering HTTP refusals with `handler`: its counts (in the store), refusal
    /// cache, units taken ahead, metrics and logs go on (they are shared); the limiters of its
    /// `rules` overrides are made afresh, with their own refusal caches and units.
    #[cfg(feature = "config")]
    pub(crate) fn answering_with(&self, handler: RejectHandler) -> Limiter {
        let mut limiter = self.clone();
        limiter.on_rejected = Some(handler);
        limiter.settings_changed();
        limiter
    }

    /// Forgets the override limiters made from the settings before a change.
    pub(crate) fn settings_changed(&mut self) {
        self.overriding = OnceLock::new();
    }

    /// The limiter of override `index`, when it has rules.
    pub(super) fn overriding(&self, index: usize) -> Option<Arc<Limiter>> {
        let limiters = self.overriding.get_or_init(|| {
            let applied = self.policy.overrides().applied();
            applied
                .iter()
                .map(|applied| match applied {
                    Applied::Rules(policy) => Some(Arc::new(self.with_policy(policy.clone()))),
                    Applied::Unlimited | Applied::Deny => None,
                })
                .collect()
        });
        limiters.get(index)?.clone()
    }

    /// The store.
    pub(crate) fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// The layer's metric handles.
    pub(super) fn metrics(&self) -> &PolicyMetrics {
        self.metrics
            .get_or_init(|| PolicyMetrics::new(&self.policy, self.store.name()))
    }

    /// Counts a refusal (or, in shadow mode, what would have been one) of `key` by `rules`.
    fn count_refusal(
        &self,
        outcome: Outcome,
        key: &StorageKey,
        rules: impl Iterator<Item = usize>,
    ) {
        let metrics = self.metrics();
        metrics.request(outcome);
        metrics.rule_refusals(rules);
        self.top_refused
            .record(key.kind(), key.identity(), tokio::time::Instant::now());
    }

    /// Decides about a request: everything from its key to its settled outcome (see
    /// [`flow`]), carried as far as it goes without waiting.
    pub(crate) fn decide(self: &Arc<Self>, parts: &http::request::Parts) -> Decided {
        flow::start(self, self.prepare(parts))
    }

    /// Finds a request's key and cost, or what to do without a store check.
    fn prepare(self: &Arc<Self>, parts: &http::request::Parts) -> Prepared {
        let policy = &self.policy;
        let protocol = Protocol::of(&parts.headers);
        let key = match policy.storage_key(parts) {
            KeyLookup::Found(key) => key,
            KeyLookup::Unlimited => {
                self.metrics().request(Outcome::NoKey);
                return Prepared::Unlimited;
            }
            KeyLookup::Refuse(status) => {
                self.metrics().request(Outcome::NoKey);
                return Prepared::Respond(Answer::new(Refusal::NoKey(status), &protocol));
            }
            KeyLookup::NoClientIp => {
                self.metrics().request(Outcome::NoKey);
                tracing::error!(
                    policy = policy.name(),
                    "no client IP to rate-limit by: serve with \
                     `into_make_service_with_connect_info::<SocketAddr>()`"
                );
                let refusal = Refusal::NoKey(StatusCode::INTERNAL_SERVER_ERROR);
                return Prepared::Respond(Answer::new(refusal, &protocol));
            }
        };
        let overrides = policy.overrides();
        if !overrides.is_empty()
            && let Some(found) = overrides.find(key.identity(), parts, policy.client_ip())
        {
            let by_override =
                self.prepare_overridden(found, &key, &protocol, |own| own.prepare(parts));
            if let Some(prepared) = by_override {
                return prepared;
            }
        }
        let cost = policy.cost(parts);
        let quota = policy
            .quota()
            .and_then(|quota| quota.lookup(parts, policy.client_ip()));
        self.prepare_found(key, cost, quota, protocol)
    }

    /// What an override found for `key` makes of the request, if anything: let through, denied,
    /// or prepared by the limiter of its own rules (`prepare_by`), which then answers for it.
    fn prepare_overridden(
        &self,
        found: (usize, &Applied),
        key: &StorageKey,
        protocol: &Protocol,
        prepare_by: impl FnOnce(&Arc<Limiter>) -> Prepared,
    ) -> Option<Prepared> {
        match self.overridden(found, key) {
            Overridden::Unlimited => Some(Prepared::Unlimited),
            Overridden::Denied => Some(Prepared::Respond(Answer::new(Refusal::Denied, protocol))),
            Overridden::By(own) => Some(match prepare_by(&own) {
                Prepared::Check(checked) => Prepared::CheckBy(own, checked),
                Prepared::Respond(answer) => Prepared::RespondBy(own, answer),
                other => other,
            }),
            Overridden::No => None,
        }
    }

    /// What an override found for `key` does: decides the request (unlimited, denied), hands it
    /// to the limiter of its own rules, or nothing.
    fn overridden(&self, (index, applied): (usize, &Applied), key: &StorageKey) -> Overridden {
        let policy = &self.policy;
        match applied {
            Applied::Unlimited => {
                self.metrics().request(Outcome::OverrideUnlimited);
                Overridden::Unlimited
            }
            // Shadow mode refuses nothing, a deny list included: it says what it would do.
            Applied::Deny if policy.mode() == Mode::Shadow => {
                self.metrics().request(Outcome::ShadowRefused);
                self.shadow_refusals.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    policy = policy.name(),
                    key_kind = key.kind(),
                    key = key.identity(),
                    "request would be denied by an override (shadow mode)"
                );
                Overridden::Unlimited
            }
            Applied::Deny => {
                self.metrics().request(Outcome::OverrideDenied);
                tracing::debug!(
                    policy = policy.name(),
                    key_kind = key.kind(),
                    key = key.identity(),
                    "request denied by an override"
                );
                Overridden::Denied
            }
            Applied::Rules(_) => self
                .overriding(index)
                .map_or(Overridden::No, Overridden::By),
        }
    }

    /// The rest of [`Limiter::prepare`] once the key is known: a cost no rule admits, a cached
    /// refusal, or a check to make.
    fn prepare_found(
        self: &Arc<Self>,
        key: StorageKey,
        cost: u64,
        quota: Option<QuotaLookup>,
        protocol: Protocol,
    ) -> Prepared {
        let policy = &self.policy;
        // A request no rule (nor the day's quota) could ever admit: waiting won't help.
        let too_costly = match (policy.too_costly(cost), &quota) {
            (Some(rule), _) => Some((rule, &*policy.rule_names()[rule], policy.max_cost())),
            // The quota's state comes after the rules'.
            (None, Some(lookup)) if cost > lookup.limit => policy
                .quota()
                .map(|quota| (policy.rules().len(), quota.name(), lookup.limit)),
            _ => None,
        };
        if let Some((index, rule, at_most)) = too_costly {
            let outcome = if policy.mode() == Mode::Shadow {
                Outcome::ShadowRefused
            } else {
                Outcome::TooCostly
            };
            self.count_refusal(outcome, &key, std::iter::once(index));
            if policy.mode() == Mode::Shadow {
                // Shadow mode refuses nothing, not even this; the store has nothing to say about it.
                self.shadow_refusals.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    policy = policy.name(),
                    rule,
                    cost,
                    key_kind = key.kind(),
                    key = key.identity(),
                    "request would be refused as too costly (shadow mode)"
                );
                return Prepared::Unlimited;
            }
            let refusal = Refusal::TooCostly {
                index,
                cost,
                at_most,
            };
            return Prepared::Respond(Answer::new(refusal, &protocol));
        }
        // Units in hand admit at once: no store call, no span.
        match self.spend_prefetched(&key, cost, quota.as_ref(), true) {
            Spent::Admit(admission, charged) => {
                Prepared::Admit(admission.charging(self.clone(), key, cost, quota, charged))
            }
            Spent::Ask(extra) => self.prepare_ask(key, cost, quota, protocol, extra),
            Spent::Wait(landed, certain) => {
                let limiter = self.clone();
                let deadline = tokio::time::Instant::now() + prefetch::WAIT_AT_MOST;
                Prepared::AwaitUnits(Box::pin(async move {
                    let (mut landed, mut certain) = (landed, certain);
                    // Until units are in hand, or no take is in flight, or the wait is too long:
                    // a take in flight may bring fewer units than those waiting want. (A take
                    // in the background lands for certain: no timer.)
                    let extra = loop {
                        if certain {
                            landed.await;
                        } else {
                            let _ = tokio::time::timeout_at(deadline, landed).await;
                        }
                        let may_wait = tokio::time::Instant::now() < deadline;
                        match limiter.spend_prefetched(&key, cost, quota.as_ref(), may_wait) {
                            Spent::Admit(admission, charged) => {
                                let own = limiter.clone();
                                let admission = admission.charging(own, key, cost, quota, charged);
                                return Prepared::Admit(admission);
                            }
                            Spent::Wait(next, sure) => (landed, certain) = (next, sure),
                            Spent::Ask(extra) => break extra,
                        }
                    };
                    // Told as this limiter's, which may be an override's.
                    match limiter.prepare_ask(key, cost, quota, protocol, extra) {
                        Prepared::Check(checked) => Prepared::CheckBy(limiter, checked),
                        Prepared::Respond(answer) => Prepared::RespondBy(limiter, answer),
                        other => other,
                    }
                }))
            }
        }
    }

    /// A request about to ask the store for its cost and `extra` units ahead: answered from the
    /// refusal cache, or a check to make.
    fn prepare_ask(
        self: &Arc<Self>,
        key: StorageKey,
        cost: u64,
        quota: Option<QuotaLookup>,
        protocol: Protocol,
        extra: u64,
    ) -> Prepared {
        let policy = &self.policy;
        let span = tracing::debug_span!(
            "rate_limit",
            policy = policy.name(),
            key_kind = key.kind(),
            outcome = tracing::field::Empty,
            store_latency_us = tracing::field::Empty,
        );
        let checked = Checked {
            key,
            cost,
            quota,
            protocol,
            span,
            started: Instant::now(),
            extra,
        };
        // Shadow mode asks the store every time: it counts what it lets through.
        if policy.mode() != Mode::Shadow
            && let Some(decision) = self.refusals.answer(checked.asking())
        {
            self.refusals.count_unlogged();
            self.count_refusal(Outcome::CachedRefusal, &checked.key, decision.violated());
            self.untake(&checked);
            return Prepared::Respond(Answer::new(Refusal::Limited(decision), &checked.protocol));
        }
        Prepared::Check(checked)
    }

    /// Asks the store about a request: the policy's rules, algorithm, reservation and block.
    pub(crate) fn check(&self, checked: &Checked) -> crate::store::CheckFuture {
        self.check_within(checked, self.policy.mode().max_delay())
    }

    /// [`Limiter::check`], reserving at most `max_delay` ahead.
    fn check_within(&self, checked: &Checked, max_delay: Duration) -> crate::store::CheckFuture {
        let request = self
            .store_request(&checked.key, checked.quota.as_ref())
            .cost(checked.cost + checked.extra)
            .max_delay(max_delay);
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
        });
        CheckRequest::new(key.as_str(), policy.rules(), policy.algorithm())
            .identity(key.identity())
            .block_for(policy.block_for())
            .quota(quota)
            .concurrency(policy.concurrency())
    }

    /// What to do with a request, given the store's answer.
    /// An admission takes `checked`'s key and quota along (into its charge): the request is
    /// settled.
    fn settle(
        self: &Arc<Self>,
        result: Result<Decision, StoreError>,
        checked: &mut Checked,
    ) -> Verdict {
        self.settle_after(
            result,
            checked,
            self.policy.mode().max_delay(),
            Duration::ZERO,
        )
    }

    /// [`Limiter::settle`] for a request that has `waited` for a slot and may wait `budget` more.
    fn settle_after(
        self: &Arc<Self>,
        result: Result<Decision, StoreError>,
        checked: &mut Checked,
        budget: Duration,
        waited: Duration,
    ) -> Verdict {
        let took = checked.started.elapsed();
        // The refusal log and the alerts below belong to the check's span.
        let span = checked.span.clone();
        let _entered = span.enter();
        let expected_states = self.policy.rules().len()
            + usize::from(checked.quota.is_some())
            + usize::from(self.policy.concurrency().is_some());
        // A store must answer for every rule; anything else is a broken store, not a decision.
        let result = result.and_then(|decision| {
            if decision.rules.len() == expected_states {
                Ok(decision)
            } else {
                Err(StoreError::Protocol(format!(
                    "{} rule states for a policy of {} rules",
                    decision.rules.len(),
                    expected_states
                )))
            }
        });
        let metrics = self.metrics();
        metrics.store_call(took, result.as_ref().map(|_| ()));
        span.record("store_latency_us", took.as_micros() as u64);
        // A take of units ahead: in hand if admitted; if not, ask for the cost alone. The charge
        // of an admission is answered by its decision, or the take's.
        let (result, charged) = match self.settle_take(result, checked) {
            Some((result, Some((taken, after)))) => (result, Charged::Taken(taken, after)),
            Some((result, None)) => (result, Charged::Told),
            None => return Verdict::Retake,
        };
        let key = &checked.key;
        let outcome = |outcome: Outcome| {
            span.record("outcome", outcome.label());
            outcome
        };
        match result {
            Ok(decision) => {
                if !decision.quota_alerts.is_empty()
                    && let (Some(quota), Some(lookup), Some(state)) = (
                        self.policy.quota(),
                        checked.quota.as_ref(),
                        decision.rules.last(),
                    )
                {
                    quota.alert(
                        lookup,
                        &decision.quota_alerts,
                        state.remaining,
                        decision.now_unix_ms,
                        crate::telemetry::quota_alert,
                    );
                }
                if decision.allowed {
                    // An admission (of another cost) used quota: a refusal cached before it may
                    // now have to wait longer.
                    self.refusals.forget(checked.asking());
                    metrics.admitted(&decision);
                    let headers = LimitHeaders::new(
                        &self.answers,
                        &self.policy,
                        &decision,
                        self.legacy_headers,
                    );
                    let waiting = self.may_wait_for_slots().then(|| self.slot_queues.clone());
                    let lease = decision.lease.map(|id| {
                        let (store, policy) = (self.store.clone(), self.policy.clone());
                        let errors = self.store_errors.clone();
                        Lease::new(store, policy, key.clone(), id, waiting, errors)
                    });
                    if !(decision.delay + waited).is_zero() {
                        metrics.request(outcome(Outcome::Delayed));
                        metrics.delay(decision.delay + waited);
                    } else {
                        metrics.request(outcome(Outcome::Allowed));
                    }
                    // Given back by the caller (a handle's), or under count_only if the response
                    // doesn't count (a shadow pass or a store failure charged nothing).
                    let charge = Some(checked.take_charge(self.clone(), charged));
                    let admission = Admission {
                        headers: Some(headers),
                        lease,
                        decision: None,
                        charge,
                    };
                    if !decision.delay.is_zero() {
                        let delay = decision.delay;
                        return Verdict::Delay(
                            delay,
                            Admission {
                                decision: Some(decision),
                                ..admission
                            },
                        );
                    }
                    return Verdict::Admit(Admission {
                        decision: Some(decision),
                        ..admission
                    });
                }
                if !budget.is_zero() && self.only_slot_missing(&decision, budget) {
                    return Verdict::AwaitSlot;
                }
                if self.policy.mode() == Mode::Shadow {
                    self.shadow_refusals.fetch_add(1, Ordering::Relaxed);
                    self.count_refusal(outcome(Outcome::ShadowRefused), key, decision.violated());
                    let headers = LimitHeaders::new(
                        &self.answers,
                        &self.policy,
                        &decision,
                        self.legacy_headers,
                    );
                    let rejected = TooManyRequests::new(
                        self.policy.clone(),
                        decision.clone(),
                        self.answers.clone(),
                    );
                    self.log_rejection(
                        &rejected,
                        key,
                        "request would be rate limited (shadow mode)",
                    );
                    return Verdict::Admit(Admission {
                        headers: Some(headers),
                        decision: Some(decision),
                        ..Admission::unchecked()
                    });
                }
                // A penalty block's refusals are not cached: the property test shows the store's
                // later answers under a block may wait longer than a cached one would say. Nor
                // are refusals for want of a concurrency slot: one frees when a request ends,
                // long before the lease's expiry that a cached refusal would wait for.
                let slot_refused = self.policy.concurrency().is_some()
                    && decision.rules.last().is_some_and(RuleState::refused);
                if self.policy.block_for().is_none() && !slot_refused {
                    let max_delay = self.policy.mode().max_delay();
                    self.refusals
                        .remember(checked.asking(), &decision, max_delay);
                }
                self.count_refusal(outcome(Outcome::Refused), key, decision.violated());
                if self.refusals.may_log() {
                    let rejected = TooManyRequests::new(
                        self.policy.clone(),
                        decision.clone(),
                        self.answers.clone(),
                    );
                    self.log_rejection(&rejected, key, "request rate limited");
                }
                Verdict::Respond(Answer::new(Refusal::Limited(decision), &checked.protocol))
            }
            Err(error) => match self.policy.on_store_error() {
                OnStoreError::Allow => {
                    metrics.request(outcome(Outcome::StoreErrorAllowed));
                    self.store_errors.log(
                        self.policy.name(),
                        &error,
                        "letting the request through",
                    );
                    Verdict::Admit(Admission::unchecked())
                }
                OnStoreError::Deny => {
                    metrics.request(outcome(Outcome::StoreErrorDenied));
                    self.store_errors
                        .log(self.policy.name(), &error, "refusing the request");
                    Verdict::Respond(Answer::new(Refusal::StoreUnavailable, &checked.protocol))
                }
            },
        }
    }

    /// Whether a request refused for want of a concurrency slot may wait for one: the policy has a
    /// concurrency limit, in delay mode.
    fn may_wait_for_slots(&self) -> bool {
        self.policy.concurrency().is_some() && !self.policy.mode().max_delay().is_zero()
    }

    /// Whether `decision` refused for want of a slot alone: every other state admits, or is a rate
    /// rule that would within `budget` (a reservation, once a slot is free). A refusal by the
    /// quota or the duplicate guard is final however long one waits for a slot.
    fn only_slot_missing(&self, decision: &Decision, budget: Duration) -> bool {
        let states = decision.rules.len();
        self.may_wait_for_slots()
            && decision.rules.last().is_some_and(RuleState::refused)
            && decision.rules.iter().enumerate().all(|(index, state)| {
                match (self.policy.state_of(index, states), state.retry_after) {
                    (_, None) | (StateOf::Concurrency, _) => true,
                    (StateOf::Rule(rule), Some(retry)) => {
                        !self.policy.rules()[rule].is_duplicate_guard() && retry <= budget
                    }
                    (StateOf::Quota, Some(_)) => false,
                }
            })
    }

    /// Whether a request should queue behind others of its key waiting for a slot, rather than
    /// ask the store before them (first come, first served).
    fn queues_first(&self, checked: &Checked) -> bool {
        self.may_wait_for_slots() && self.slot_queues.is_waiting(checked.key.as_str())
    }

    /// Waits for a concurrency slot, up to the policy's `max_delay` from the request's arrival,
    /// first come first served among this instance's requests of the key: the head of the key's
    /// queue asks the store again when this instance releases a slot of the key, and otherwise
    /// polls (every [`FIRST_SLOT_POLL`], doubling up to [`MAX_SLOT_POLL`]) for slots released
    /// elsewhere or by a lease's expiry. `just_refused` says the store has just refused the
    /// request, so the head waits before asking again.
    async fn wait_for_slot(
        self: Arc<Self>,
        mut checked: Checked,
        just_refused: bool,
    ) -> (Verdict, Checked) {
        let arrived = tokio::time::Instant::now() - checked.started.elapsed();
        let deadline = arrived + self.policy.mode().max_delay();
        let place = self.slot_queues.join(checked.key.as_str());
        let (_turn, mut wait_first) = match place.try_turn() {
            Some(turn) => (turn, just_refused),
            None => match tokio::time::timeout_at(deadline, place.turn()).await {
                // The requests ahead have asked the store since: ask at once.
                Ok(turn) => (turn, false),
                // Out of time in the queue: one last look (it may admit, without a delay).
                Err(_) => {
                    checked.started = Instant::now();
                    let result = self.check_within(&checked, Duration::ZERO).await;
                    let waited = arrived.elapsed();
                    let verdict = self.settle_after(result, &mut checked, Duration::ZERO, waited);
                    return (verdict, checked);
                }
            },
        };
        let mut poll = FIRST_SLOT_POLL;
        loop {
            if wait_first {
                let pause =
                    poll.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
                // Woken by a release here, or polling for one elsewhere.
                let _ = tokio::time::timeout(pause, place.freed()).await;
                poll = (poll * 2).min(MAX_SLOT_POLL);
            }
            wait_first = true;
            let budget = deadline.saturating_duration_since(tokio::time::Instant::now());
            checked.started = Instant::now();
            let result = self.check_within(&checked, budget).await;
            match self.settle_after(result, &mut checked, budget, arrived.elapsed()) {
                Verdict::AwaitSlot => continue,
                verdict => return (verdict, checked),
            }
        }
    }

    /// Logs a refusal at `info`, with the count of refusals not logged since the last line.
    fn log_rejection(&self, rejected: &TooManyRequests, key: &StorageKey, message: &str) {
        let rules: Vec<&str> = rejected.violated_rules().collect();
        tracing::info!(
            policy = self.policy.name(),
            rule = %rules.join(", "),
            key_kind = key.kind(),
            key = key.identity(),
            retry_after_s = rejected.retry_after_secs(),
            unlogged_refusals = self.refusals.take_unlogged(),
            "{message}"
        );
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
