//! What a [`RateLimiter`](crate::RateLimiter) asks of the limiter: checks, peeks and refunds for
//! an identity the app names rather than one found in a request.

use std::sync::Arc;

use http::StatusCode;

use super::{Decided, Limiter, Prepared, Price, Refusal};
use crate::decision::Decision;
use crate::limiter::telemetry::Outcome;
use crate::policy::quota::QuotaLookup;
use crate::policy::{Applied, StorageKey};
use crate::response::Protocol;
use crate::store::StoreError;

impl Limiter {
    /// [`Limiter::decide`] for an identity the app names (a [`RateLimiter`](crate::RateLimiter)'s
    /// check of `price.cost` requests, reserving `price.units` in the metered rules).
    pub(crate) fn decide_named(self: &Arc<Self>, identity: &str, price: Price) -> Decided {
        super::flow::start(self, self.prepare_identity(identity, price))
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
        let overrides = policy.overrides();
        if !overrides.is_empty()
            && let Some(found) = overrides.find_identity(key.identity())
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

    /// The limiter that counts `identity`: a `rules` override's, or this one.
    fn counting(self: &Arc<Self>, identity: &str) -> Arc<Limiter> {
        let overrides = self.policy.overrides();
        if !overrides.is_empty()
            && let Some((index, Applied::Rules(_))) =
                overrides.find_identity(self.policy.named_key(identity).identity())
            && let Some(own) = self.overriding(index)
        {
            return own;
        }
        self.clone()
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
        let request = limiter.store_request(&key, quota.as_ref()).cost(cost);
        let decision = limiter.store().refund(&request).await?;
        limiter.refusals.forget_key(key.as_str());
        Ok(decision)
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
        let limiter = self.counting(identity);
        let policy = &limiter.policy;
        let key = policy.named_key(identity);
        let quota = policy.quota().map(|quota| quota.lookup_identity(identity));
        Ok((limiter, key, quota))
    }
}
