//! What an operator (or a [`RateLimiter`](crate::RateLimiter)'s caller) asks of a running limiter
//! about an identity: its usage of each rule, a peek, a refund, a reset.

use std::sync::Arc;
use std::time::Duration;

use super::Limiter;
use super::prepare::Found;
use super::telemetry;
use crate::PolicyError;
use crate::decision::Decision;
use crate::operate::{OperatorError, OverrideAction, RuleUsage, SetOverride};
use crate::policy::quota::QuotaLookup;
use crate::policy::{
    Applied, Override, OverrideTarget, Rule, StorageKey, StoredAction, Whom, is_storable_identity,
};
use crate::store::{CheckRequest, StoreError};

impl Limiter {
    /// The store key of `identity` under this limiter's policy.
    fn key_of(&self, identity: &str) -> Result<StorageKey, OperatorError> {
        if !is_storable_identity(identity) {
            return Err(OperatorError::BadIdentity(identity.to_owned()));
        }
        self.policy
            .storage_key_of(identity)
            .ok_or_else(|| OperatorError::RouteScoped(self.policy.name().to_owned()))
    }

    /// The policy's counted rules (a duplicate guard is not a count), with their names.
    fn counted_rules(&self) -> (Vec<Rule>, Vec<String>) {
        self.policy
            .rules()
            .iter()
            .zip(self.policy.rule_names())
            .filter(|(rule, _)| !rule.is_duplicate_guard())
            .map(|(rule, name)| (rule.clone(), name.to_string()))
            .unzip()
    }

    /// See [`RateLimitLayer::inspect`](crate::RateLimitLayer::inspect).
    pub(crate) async fn inspect(&self, identity: &str) -> Result<Vec<RuleUsage>, OperatorError> {
        let key = self.key_of(identity)?;
        let (rules, names) = self.counted_rules();
        // A request of cost 0 and no metered units, without guard, block, quota or wait: it
        // fits in every rule and records nothing, so the store answers each rule's state as it
        // is, metered or not.
        let request = CheckRequest::new(key.as_str(), &rules, self.policy.algorithm())
            .identity(key.identity())
            .sharing(self.policy.fair_key())
            .cost(0)
            .units(0);
        let decision = self.store().check(&request).await?;
        if decision.rules.len() != rules.len() {
            return Err(StoreError::Protocol(format!(
                "{} rule states for {} rules",
                decision.rules.len(),
                rules.len()
            ))
            .into());
        }
        Ok(decision
            .rules
            .iter()
            .zip(names)
            .map(|(state, rule)| RuleUsage {
                rule,
                limit: state.limit,
                remaining: state.remaining,
                reset_ms: millis(state.reset),
            })
            .collect())
    }

    /// See [`RateLimitLayer::reset`](crate::RateLimitLayer::reset).
    pub(crate) async fn reset(self: &Arc<Self>, identity: &str) -> Result<(), OperatorError> {
        self.reset_key(&self.key_of(identity)?).await
    }

    /// Forgets the counts and the block of `key`, and its cached refusal here: the policy's
    /// counters, and those of an override's rules that count it apart (a period the policy
    /// lacks).
    pub(crate) async fn reset_key(self: &Arc<Self>, key: &StorageKey) -> Result<(), OperatorError> {
        self.reset_own(key).await?;
        let counting = self.counting_now(key).await?;
        if !Arc::ptr_eq(&counting, self) {
            counting.reset_own(key).await?;
        }
        tracing::info!(
            policy = self.policy.name(),
            key = key.identity(),
            "rate-limit counts reset"
        );
        Ok(())
    }

    /// Forgets the counts and the block of `key` under this limiter's rules.
    async fn reset_own(&self, key: &StorageKey) -> Result<(), OperatorError> {
        // Its concurrency slots too, and the policy's delay: how long the reset's marker lasts.
        let request = CheckRequest::new(key.as_str(), self.policy.rules(), self.policy.algorithm())
            .identity(key.identity())
            .sharing(self.policy.fair_key())
            .block_for(self.policy.block_for())
            .concurrency(self.policy.concurrency())
            .max_delay(self.policy.mode().max_delay());
        self.store().reset(&request).await?;
        self.refusals.forget_key(key.as_str());
        // Units held ahead here go at once (other instances hear of it from the store).
        super::prefetch::forget_key(self, key.as_str());
        Ok(())
    }

    /// What a check of cost 1 for `identity` would find now, recording nothing (see
    /// [`Store::peek`](crate::Store::peek)), under the rules that count it.
    pub(crate) async fn peek_named(
        self: &Arc<Self>,
        identity: &str,
    ) -> Result<Decision, StoreError> {
        let (limiter, key, quota) = self.named(identity)?;
        let request = limiter.store_request(&key, quota.as_ref());
        limiter.store().peek(&request).await
    }

    /// Gives back `cost` units charged to `identity` (see [`Store::refund`](crate::Store::refund)),
    /// and forgets the refusal this instance cached for it: the units may admit it now.
    pub(crate) async fn refund_named(
        self: &Arc<Self>,
        identity: &str,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        let (limiter, key, quota) = self.named(identity)?;
        // Where its checks charge: by an override the store keeps and applies in its own call.
        let limiter = limiter.counting_now(&key).await?;
        let request = limiter.store_request(&key, quota.as_ref()).cost(cost);
        let decision = limiter.store().refund(&request).await?;
        limiter.refusals.forget_key(key.as_str());
        Ok(decision)
    }

    /// The limiter that counts `key`: a `rules` override's (set at run time or the policy's),
    /// or this one. Of the overrides set at run time, those the limiter reads before its check
    /// (the memory store's book) only: see [`Limiter::counting_now`].
    fn counting(self: &Arc<Self>, key: &StorageKey) -> Arc<Limiter> {
        let own = match self.find_override(key.identity(), None) {
            Some(Found::Static(index, Applied::Rules(_))) => self.overriding(index),
            Some(Found::RunTime(over)) => match over.action() {
                StoredAction::Rules(rules) => self.run_time_limiter(rules, over.counted_as()),
                StoredAction::Unlimited | StoredAction::Deny => None,
            },
            _ => None,
        };
        own.unwrap_or_else(|| self.clone())
    }

    /// [`Limiter::counting`] by what the store applies now: where a store reads an identity's
    /// run-time override in its check's own call (the Redis store), a peek asks it (one round
    /// trip, for an operator's call), and the limiter of the override it applied counts the key
    /// (by the counters the store named).
    async fn counting_now(self: &Arc<Self>, key: &StorageKey) -> Result<Arc<Limiter>, StoreError> {
        let limiter = self.counting(key);
        if limiter.override_lookup.is_none() {
            return Ok(limiter);
        }
        let decision = limiter
            .store()
            .peek(&limiter.store_request(key, None))
            .await?;
        let own = decision.run_time_override.and_then(|applied| {
            let counted = applied.counted_as();
            match applied.action()? {
                StoredAction::Rules(rules) => limiter.run_time_limiter(&rules, counted.as_deref()),
                StoredAction::Unlimited | StoredAction::Deny => None,
            }
        });
        Ok(own.unwrap_or(limiter))
    }

    /// See [`RateLimiter::set_override`](crate::RateLimiter::set_override): checked, then kept
    /// in the store, lasting `lasting` (`None`: until removed).
    pub(crate) async fn set_override(
        &self,
        over: Override,
        lasting: Option<Duration>,
    ) -> Result<(), OperatorError> {
        let policy = &self.policy;
        if over.names_empty_identity() {
            return Err(OperatorError::BadIdentity(String::new()));
        }
        let stored = over
            .stored(policy.key())
            .map_err(|reason| self.invalid_override(reason))?;
        if let Whom::Identity(identity) = stored.whom()
            && !is_storable_identity(identity)
        {
            return Err(OperatorError::BadIdentity(identity.clone()));
        }
        if let StoredAction::Rules(rules) = stored.action() {
            // Refused as the policy refuses bad rules, before anything is stored.
            policy
                .run_time_policy(rules, None)
                .map_err(OperatorError::InvalidOverride)?;
        }
        let whom = stored.whom().clone();
        let action = shown_action(stored.action());
        self.store().set_override(policy, stored, lasting).await?;
        self.forget_refusals_of(&whom);
        telemetry::override_changed(policy.name(), "set");
        tracing::info!(
            policy = policy.name(),
            target = whom.shown(),
            action,
            lasting_ms = lasting.map(millis),
            "rate-limit override set"
        );
        Ok(())
    }

    /// See [`RateLimiter::remove_override`](crate::RateLimiter::remove_override).
    pub(crate) async fn remove_override(
        &self,
        target: OverrideTarget,
    ) -> Result<(), OperatorError> {
        let policy = &self.policy;
        if target.is_empty_identity() {
            return Err(OperatorError::BadIdentity(String::new()));
        }
        let whom = target
            .stored(policy.key())
            .map_err(|reason| self.invalid_override(reason))?;
        self.store().remove_override(policy, &whom).await?;
        self.forget_refusals_of(&whom);
        telemetry::override_changed(policy.name(), "removed");
        tracing::info!(
            policy = policy.name(),
            target = whom.shown(),
            "rate-limit override removed"
        );
        Ok(())
    }

    /// See [`RateLimiter::overrides`](crate::RateLimiter::overrides).
    pub(crate) async fn overrides(&self) -> Result<Vec<SetOverride>, OperatorError> {
        let listed = self.store().list_overrides(self.policy.key_base()).await?;
        Ok(listed
            .iter()
            .map(|listed| SetOverride {
                target: listed.whom().shown(),
                action: match listed.action() {
                    StoredAction::Unlimited => OverrideAction::Unlimited,
                    StoredAction::Deny => OverrideAction::Deny,
                    StoredAction::Rules(rules) => OverrideAction::Rules(
                        rules.iter().map(|rule| rule.name().into_owned()).collect(),
                    ),
                },
                left_ms: listed.left().map(millis),
            })
            .collect())
    }

    /// An override this policy refuses, and why.
    fn invalid_override(&self, reason: String) -> OperatorError {
        OperatorError::InvalidOverride(PolicyError::InvalidOverride {
            policy: self.policy.name().to_owned(),
            index: 0,
            reason,
        })
    }

    /// Forgets what this instance remembers of `whom` (its cached refusal, units held ahead):
    /// its next check asks the store, under its new limits. A network's identities are not
    /// known here: their cached refusals stand until they expire.
    fn forget_refusals_of(&self, whom: &Whom) {
        let key = match whom {
            Whom::Identity(identity) => self.policy.storage_key_of(identity),
            Whom::Address(address) => self.policy.storage_key_of_address(*address),
            Whom::Network(_) => None,
        };
        let Some(key) = key else {
            return;
        };
        // Its own, and those of the limiters of the policy's overrides, which answer for the
        // identities they override.
        let overriding = self.overriding.get().into_iter().flatten().flatten();
        for limiter in std::iter::once(self).chain(overriding.map(|limiter| &**limiter)) {
            limiter.refusals.forget_key(key.as_str());
            super::prefetch::forget_key(limiter, key.as_str());
        }
    }

    /// The limiter that counts `identity`, its key and its quota.
    fn named(
        self: &Arc<Self>,
        identity: &str,
    ) -> Result<(Arc<Limiter>, StorageKey, Option<QuotaLookup>), StoreError> {
        if identity.is_empty() {
            return Err(StoreError::Config(
                "an empty identity names no rate-limit key".into(),
            ));
        }
        let limiter = self.counting(&self.policy.named_key(identity));
        let policy = &limiter.policy;
        let key = policy.named_key(identity);
        let quota = policy.quota().map(|quota| quota.lookup_identity(identity));
        Ok((limiter, key, quota))
    }
}

/// What an override does, for its log line.
fn shown_action(action: &StoredAction) -> String {
    match action {
        StoredAction::Unlimited => "unlimited".to_owned(),
        StoredAction::Deny => "deny".to_owned(),
        StoredAction::Rules(rules) => rules
            .iter()
            .map(|rule| rule.name().into_owned())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
