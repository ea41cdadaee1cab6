//! Preparing a request: its key (found in the request, or the identity a
//! [`RateLimiter`](crate::RateLimiter) names), an override, a cost no rule admits, units in hand,
//! a cached refusal; what [`flow`](super::flow) starts from.

use super::{Ask, Decided, Layered, Limiter, OnResponse, Prepared, Price, Refusal, flow, prefetch};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use http::StatusCode;

use crate::limiter::refusals::Asking;
use crate::limiter::telemetry::Outcome;
use crate::policy::quota::QuotaLookup;
use crate::policy::{Applied, KeyLookup, Mode, StateOf, StorageKey, StoredAction, StoredOverride};
use crate::response::Protocol;

/// The override a request falls under: one of the policy's (its index, what it does), one set
/// at run time, or one set at run time that the check carries to the store, which applies it
/// unless the identity has its own ([`Limiter::carrying_limiter`]).
pub(super) enum Found<'a> {
    Static(usize, &'a Applied),
    RunTime(Arc<StoredOverride>),
    Carried(Arc<StoredOverride>),
}

/// What an override does to a request.
pub(super) enum Overridden {
    /// Lets it through unlimited.
    Unlimited,
    /// Refuses it (403).
    Denied,
    /// Hands it to the limiter of its own rules.
    By(Arc<Limiter>),
    /// Nothing (an override with rules the limiter can't find).
    No,
}

impl Limiter {
    /// Decides about a request: everything from its key to its resolved outcome (see
    /// [`flow`]), carried as far as it goes without waiting.
    pub(crate) fn decide(self: &Arc<Self>, parts: &http::request::Parts) -> Decided {
        flow::start(self, self.prepare(parts))
    }

    /// [`Limiter::decide`] for a layer, which turns an admission at once into what its response
    /// gets (a meter's `Usage` going into the request's `extensions`) and a refusal into its
    /// answer. Under a plain policy (decided when the limiter was built: none of the options the
    /// flow has steps for), an admission the store gives at once is counted and made here,
    /// without the flow's general steps; anything else (a refusal, a remembered one, a cost no
    /// rule admits, a store that answers later or fails) goes on in the flow from where it is.
    pub(crate) fn decide_layered(self: &Arc<Self>, parts: &mut http::request::Parts) -> Layered {
        // An override set at run time makes any policy's request go the whole way while it is.
        if !self.plain || self.run_time_overrides().is_some() || self.mirrored_overrides().is_some()
        {
            return Layered::of(self.decide(parts), &mut parts.extensions);
        }
        // A plain policy's preparation: its key, its cost (one no rule admits, and a request
        // without a key, go the whole way), a refusal the cache remembers.
        let policy = &self.policy;
        let KeyLookup::Found(key) = policy.storage_key(parts) else {
            return Layered::of(self.decide(parts), &mut parts.extensions);
        };
        let cost = policy.cost(parts);
        if policy.too_costly(cost).is_some() {
            let protocol = Protocol::of(&parts.headers);
            let prepared = self.prepare_found(key, Price::new(cost, 1), None, protocol, false);
            return Layered::of(flow::start(self, prepared), &mut parts.extensions);
        }
        // The store is asked before the request's `Ask` is made: an admission at once needs
        // none. The protocol matters only to the limiter's own answer, read when one is given.
        let price = Price::new(cost, 1);
        let asking = Asking {
            key: key.as_str(),
            cost,
            units: price.units,
            quota: None,
        };
        if let Some(refusal) = self.remembered_refusal(&key, asking) {
            return Layered::Answer(refusal.respond(self, &Protocol::of(&parts.headers)));
        }
        let started = self.remote.then(Instant::now);
        let mut check = self.check_of(&key, None, price, policy.mode().max_delay());
        let result = check.take_ready();
        match result {
            // Whole (a state per rule: a plain policy has no quota, no slot), admitted at once,
            // holding no lease.
            Some(Ok(decision))
                if decision.allowed
                    && decision.delay.is_zero()
                    && decision.lease.is_none()
                    && decision.run_time_override.is_none()
                    && decision.rules.len() == self.policy.rules().len() =>
            {
                let span = self.check_span(&key);
                self.count_store_call(Ok(()), started, &span);
                self.count_admission(&decision, asking, &span, Duration::ZERO);
                Layered::Call(OnResponse::with_headers(self.limit_headers(&decision)))
            }
            Some(result) => {
                let ask = self.asked(key, price, Protocol::of(&parts.headers), started);
                Layered::of(flow::judged(self, ask, result), &mut parts.extensions)
            }
            None => {
                let ask = self.asked(key, price, Protocol::of(&parts.headers), started);
                Layered::Wait(flow::awaiting(self, ask, check))
            }
        }
    }

    /// Finds a request's key and cost, or what to do without a store check.
    pub(super) fn prepare(self: &Arc<Self>, parts: &http::request::Parts) -> Prepared {
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
                return Prepared::Respond(Refusal::NoKey(status), protocol.clone());
            }
            KeyLookup::NoClientIp => {
                self.metrics().request(Outcome::NoKey);
                tracing::error!(
                    policy = policy.name(),
                    "no client IP to rate-limit by: serve with \
                     `into_make_service_with_connect_info::<SocketAddr>()`"
                );
                let refusal = Refusal::NoKey(StatusCode::INTERNAL_SERVER_ERROR);
                return Prepared::Respond(refusal, protocol.clone());
            }
        };
        if (self.run_time_overrides().is_some()
            || self.mirrored_overrides().is_some()
            || !policy.overrides().is_empty())
            && let Some(found) = self.find_override(key.identity(), Some(parts))
        {
            // (A carried override's limiter goes on from the key: the override is found.)
            let carried = matches!(found, Found::Carried(_));
            let by_override = self.prepare_overridden(found, &key, &protocol, |own| {
                if carried {
                    own.prepare_keyed(parts, key.clone(), protocol.clone())
                } else {
                    own.prepare(parts)
                }
            });
            if let Some(prepared) = by_override {
                return prepared;
            }
        }
        self.prepare_keyed(parts, key, protocol)
    }

    /// The rest of [`Limiter::prepare`] once the request's key and override are found: its
    /// price and quota.
    fn prepare_keyed(
        self: &Arc<Self>,
        parts: &http::request::Parts,
        key: StorageKey,
        protocol: Protocol,
    ) -> Prepared {
        let policy = &self.policy;
        let mut price = Price::new(policy.cost(parts), policy.estimate(parts));
        if let Some(fairness) = policy.fair_share() {
            price = price.weighing(fairness.fair.weight(parts));
        }
        let quota = policy
            .quota()
            .and_then(|quota| quota.lookup(parts, policy.client_ip()));
        // From a request, a charge goes back only under count_only, when the response doesn't
        // count (the layer's; the extractor, which never sees the response, drops it), and
        // under a meter, when its usage settles.
        let receipt = policy.counts_only_some() || policy.metering().is_some();
        self.prepare_found(key, price, quota, protocol, receipt)
    }

    /// What an override found for `key` makes of the request, if anything: let through, denied,
    /// or prepared by the limiter of its own rules (`prepare_by`), which then answers for it.
    pub(super) fn prepare_overridden(
        &self,
        found: Found<'_>,
        key: &StorageKey,
        protocol: &Protocol,
        prepare_by: impl FnOnce(&Arc<Limiter>) -> Prepared,
    ) -> Option<Prepared> {
        match self.overridden(found, key) {
            Overridden::Unlimited => Some(Prepared::Unlimited),
            Overridden::Denied => Some(Prepared::Respond(Refusal::Denied, protocol.clone())),
            Overridden::By(own) => Some(match prepare_by(&own) {
                Prepared::Check(ask) => Prepared::CheckBy(own, ask),
                Prepared::Respond(refusal, protocol) => Prepared::RespondBy(own, refusal, protocol),
                other => other,
            }),
            Overridden::No => None,
        }
    }

    /// What an override found for `key` does: decides the request (unlimited, denied), hands it
    /// to the limiter of its own rules (a run-time override's counting in the counters its
    /// store fixed, if it did), or nothing.
    pub(super) fn overridden(&self, found: Found<'_>, key: &StorageKey) -> Overridden {
        let policy = &self.policy;
        let (deny, unlimited) = match &found {
            Found::Static(_, applied) => (
                matches!(applied, Applied::Deny),
                matches!(applied, Applied::Unlimited),
            ),
            Found::RunTime(over) => {
                self.metrics().override_applied();
                (
                    matches!(over.action(), StoredAction::Deny),
                    matches!(over.action(), StoredAction::Unlimited),
                )
            }
            // (The store decides, after the identity's own.)
            Found::Carried(_) => (false, false),
        };
        match found {
            _ if unlimited => {
                self.metrics().request(Outcome::OverrideUnlimited);
                Overridden::Unlimited
            }
            // Shadow mode refuses nothing, a deny list included: it says what it would do.
            _ if deny && policy.mode() == Mode::Shadow => {
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
            _ if deny => {
                self.metrics().request(Outcome::OverrideDenied);
                tracing::debug!(
                    policy = policy.name(),
                    key_kind = key.kind(),
                    key = key.identity(),
                    "request denied by an override"
                );
                Overridden::Denied
            }
            Found::Static(index, _) => self
                .overriding(index)
                .map_or(Overridden::No, Overridden::By),
            Found::RunTime(over) => match over.action() {
                StoredAction::Rules(rules) => self
                    .run_time_limiter(rules, over.counted_as())
                    .map_or(Overridden::No, Overridden::By),
                StoredAction::Unlimited | StoredAction::Deny => Overridden::No,
            },
            Found::Carried(over) => self
                .carrying_limiter(&over)
                .map_or(Overridden::No, Overridden::By),
        }
    }

    /// The override of a request whose key yielded `identity` (as store keys hold it; `parts`:
    /// the request, `None` for an identity a handle names, matched by that identity alone).
    /// Precedence, stated once: an identity (or client address) before a network; for each, an
    /// override set at run time before the policy's own. (One the store's copy holds goes with
    /// the check, where the identity's own, set at run time, wins over it.)
    pub(super) fn find_override(
        &self,
        identity: &str,
        parts: Option<&http::request::Parts>,
    ) -> Option<Found<'_>> {
        let policy = &self.policy;
        let statics = policy.overrides();
        let run_time = self.run_time_overrides();
        let address = || {
            parts
                .and_then(|parts| policy.client_ip().client_addr(parts))
                .map(|address| address.to_canonical())
        };
        let mirror = self.mirrored_overrides();
        if let Some(over) = run_time.and_then(|book| book.find_exact(identity, address)) {
            return Some(Found::RunTime(over));
        }
        if let Some(over) = mirror.and_then(|mirror| mirror.find_exact(identity, address)) {
            return Some(Found::Carried(over));
        }
        if let Some((index, applied)) = statics.find_exact(identity, parts, policy.client_ip()) {
            return Some(Found::Static(index, applied));
        }
        let parts = parts?;
        if let Some(over) = run_time
            .filter(|book| book.has_networks())
            .and_then(|book| book.find_network(address))
        {
            return Some(Found::RunTime(over));
        }
        if let Some(over) = mirror
            .filter(|mirror| mirror.has_networks())
            .and_then(|mirror| mirror.find_network(address))
        {
            return Some(Found::Carried(over));
        }
        statics
            .find_network(parts, policy.client_ip())
            .map(|(index, applied)| Found::Static(index, applied))
    }

    /// The rest of [`Limiter::prepare`] once the key is known: a cost no rule admits, a cached
    /// refusal, or a check to make.
    pub(super) fn prepare_found(
        self: &Arc<Self>,
        key: StorageKey,
        price: Price,
        quota: Option<QuotaLookup>,
        protocol: Protocol,
        receipt: bool,
    ) -> Prepared {
        let policy = &self.policy;
        let cost = price.cost;
        // A request no rule (nor the day's quota) could ever admit: waiting won't help. (A
        // metered quota counts the request's estimate.)
        let quota_cost = match policy.quota() {
            Some(quota) if quota.is_metered() => price.units,
            _ => cost,
        };
        let too_costly = match (policy.too_costly(cost), &quota) {
            (Some(rule), _) => Some((rule, &*policy.rule_names()[rule], policy.max_cost(), cost)),
            // The quota's state comes after the rules'.
            (None, Some(lookup)) if quota_cost > lookup.limit => policy
                .quota()
                .map(|quota| (policy.rules().len(), quota.name(), lookup.limit, quota_cost)),
            _ => None,
        };
        if let Some((index, rule, at_most, cost)) = too_costly {
            let outcome = if policy.mode() == Mode::Shadow {
                Outcome::ShadowRefused
            } else {
                Outcome::TooCostly
            };
            // (`index` past the rules is the quota's.)
            let state = if index < policy.rules().len() {
                StateOf::Rule(index)
            } else {
                StateOf::Quota
            };
            self.count_refusal(outcome, &key, std::iter::once(state));
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
            return Prepared::Respond(refusal, protocol.clone());
        }
        // Units in hand admit at once: no store call, no span.
        prefetch::prepare(self, key, price, quota, protocol, receipt)
    }

    /// A request about to ask the store for its cost and `extra` units ahead: answered from the
    /// refusal cache, or a check to make.
    pub(super) fn prepare_ask(
        self: &Arc<Self>,
        key: StorageKey,
        price: Price,
        quota: Option<QuotaLookup>,
        protocol: Protocol,
        extra: u64,
        receipt: bool,
    ) -> Prepared {
        let mut ask = Ask {
            span: self.check_span(&key),
            key,
            price,
            quota,
            protocol,
            started: None,
            extra,
            receipt,
        };
        if let Some(refusal) = self.remembered_refusal(&ask.key, ask.asking()) {
            prefetch::untake(self, &ask);
            return Prepared::Respond(refusal, ask.protocol.clone());
        }
        ask.started = self.remote.then(Instant::now);
        Prepared::Check(ask)
    }

    /// A plain policy's request (of a layer: no receipt), which asked the store at `started`.
    fn asked(
        &self,
        key: StorageKey,
        price: Price,
        protocol: Protocol,
        started: Option<Instant>,
    ) -> Ask {
        Ask {
            span: self.check_span(&key),
            key,
            price,
            quota: None,
            protocol,
            started,
            extra: 0,
            receipt: false,
        }
    }

    /// The span of a check of `key` (`rate_limit`, at `debug`).
    fn check_span(&self, key: &StorageKey) -> tracing::Span {
        tracing::debug_span!(
            "rate_limit",
            policy = self.policy.name(),
            key_kind = key.kind(),
            outcome = tracing::field::Empty,
            store_latency_us = tracing::field::Empty,
        )
    }

    /// The refusal the refusal cache remembers for `asking` (of `key`), counted, if one stands.
    fn remembered_refusal(&self, key: &StorageKey, asking: Asking<'_>) -> Option<Refusal> {
        // Shadow mode asks the store every time: it counts what it lets through.
        if self.policy.mode() == Mode::Shadow {
            return None;
        }
        let decision = self.refusals.answer(asking)?;
        self.refusals.count_unlogged();
        self.count_refusal(Outcome::CachedRefusal, key, self.refused_states(&decision));
        Some(Refusal::Limited(decision))
    }

    /// [`Limiter::decide`] for an identity the app names (a [`RateLimiter`](crate::RateLimiter)'s
    /// check of `price.cost` requests, reserving `price.units` in the metered rules).
    pub(crate) fn decide_named(self: &Arc<Self>, identity: &str, price: Price) -> Decided {
        flow::start(self, self.prepare_identity(identity, price))
    }

    /// [`Limiter::prepare`] for an identity the app names (a [`RateLimiter`](crate::RateLimiter)'s
    /// check): its key is the identity under the policy's prefix and name, whatever the policy's
    /// `Key` and scope; an override applies by that identity, a quota by it too, in its default
    /// tier.
    fn prepare_identity(self: &Arc<Self>, identity: &str, price: Price) -> Prepared {
        let policy = &self.policy;
        let cost = price.cost;
        let protocol = Protocol::Http;
        if identity.is_empty() {
            self.metrics().request(Outcome::NoKey);
            let refusal = Refusal::NoKey(StatusCode::BAD_REQUEST);
            return Prepared::Respond(refusal, protocol.clone());
        }
        if cost == 0 {
            tracing::error!(
                policy = policy.name(),
                "a rate-limit check of cost 0 counts nothing: ask for a cost of at least 1"
            );
            return Prepared::Respond(Refusal::ZeroCost, protocol.clone());
        }
        let key = policy.named_key(identity);
        if (self.run_time_overrides().is_some()
            || self.mirrored_overrides().is_some()
            || !policy.overrides().is_empty())
            && let Some(found) = self.find_override(key.identity(), None)
        {
            let by_override = self.prepare_overridden(found, &key, &protocol, |own| {
                own.prepare_identity(identity, price)
            });
            if let Some(prepared) = by_override {
                return prepared;
            }
        }
        let quota = policy.quota().map(|quota| quota.lookup_identity(identity));
        // A handle's caller may give an admission back by its receipt.
        let price = match policy.metering() {
            Some(metering) => Price::new(price.cost, price.estimate.min(metering.max_estimate)),
            None => price,
        };
        self.prepare_found(key, price, quota, protocol, true)
    }
}
