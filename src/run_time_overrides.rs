//! Overrides set at run time, on the handle and the layer: an operator raises, lowers or blocks
//! one identity's limits, and every instance sharing the store applies it at its next check of
//! that identity (see the guide's [run-time overrides](crate::guide::policies)). What they do is
//! the limiter's (`src/limiter/operate.rs`); where they are kept, the store's
//! (`src/store/overrides.rs`).

use std::time::Duration;

use crate::layer::RateLimitLayer;
use crate::operate::{OperatorError, SetOverride};
use crate::policy::{Override, OverrideTarget};
use crate::rate_limiter::RateLimiter;

impl RateLimiter {
    /// Sets `over` from now on, in place of an override set before for the same target, until
    /// [`remove_override`](Self::remove_override): kept in the store, so every instance, layer
    /// and handle sharing it applies it at its next check of that identity (the memory store
    /// keeps it itself, shared by every layer and handle over it). What the identity has used
    /// carries over: a rule of the override counts in the counter of the policy's rule of the
    /// same period (and metering), so raising 5 to 20 per minute after 3 leaves 17; a rule of a
    /// period the policy lacks starts afresh. It wins over the policy's own override of the same
    /// target, and an identity's over a network's. A refusal another instance cached stands at
    /// most one second more. (On Redis, an address or a network under a policy not keyed by
    /// client address, or on a Cluster, reaches other instances within a notice's round trip,
    /// or within 10 seconds on a store that hears no notices: see the guide.)
    /// See the guide's
    /// [run-time overrides](crate::guide::policies#changing-one-identitys-limits-at-run-time).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::{policy::Override, Key, MemoryStore, Policy, RateLimiter, Rule};
    ///
    /// let store = MemoryStore::new();
    /// let policy = Policy::builder("api").key(Key::user()).rule(Rule::per_minute(5)).build()?;
    /// let (one, other) = (RateLimiter::new(policy.clone(), store.clone()), RateLimiter::new(policy, store));
    /// for _ in 0..3 {
    ///     one.check("alice").await?;
    /// }
    /// one.set_override(Override::identity("alice").rules([Rule::per_minute(20)])).await?;
    /// assert_eq!(other.peek("alice").await?.rules[0].remaining, 17);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`OperatorError::InvalidOverride`] for rules the policy refuses or a target its key
    /// can't yield, [`OperatorError::BadIdentity`] for an empty identity (nothing is stored
    /// then), or the store's error: [`StoreError::Config`](crate::StoreError::Config) from a
    /// store that keeps no run-time overrides, or from the Redis store for a policy with a
    /// duplicate guard.
    pub async fn set_override(&self, over: Override) -> Result<(), OperatorError> {
        self.limiter.set_override(over, None).await
    }

    /// [`set_override`](Self::set_override) lasting `lasting`: a temporary raise or block that
    /// ends by itself (the store forgets it then). Setting the same target again replaces it.
    ///
    /// # Errors
    ///
    /// As [`set_override`](Self::set_override).
    pub async fn set_override_for(
        &self,
        over: Override,
        lasting: Duration,
    ) -> Result<(), OperatorError> {
        self.limiter.set_override(over, Some(lasting)).await
    }

    /// Removes the override set at run time for `target` (the policy's own overrides stay):
    /// every instance counts the identity by what applied before at its next check, with what
    /// it has used meanwhile. Removing what is not set does nothing.
    ///
    /// # Errors
    ///
    /// As [`set_override`](Self::set_override).
    pub async fn remove_override(&self, target: OverrideTarget) -> Result<(), OperatorError> {
        self.limiter.remove_override(target).await
    }

    /// The overrides set at run time for this policy that still last: identities and addresses
    /// in order, then networks in the order they were set.
    ///
    /// # Errors
    ///
    /// The store's error.
    pub async fn overrides(&self) -> Result<Vec<SetOverride>, OperatorError> {
        self.limiter.overrides().await
    }
}

impl RateLimitLayer {
    /// As [`RateLimiter::set_override`], for this layer's policy.
    ///
    /// # Errors
    ///
    /// As [`RateLimiter::set_override`].
    pub async fn set_override(&self, over: Override) -> Result<(), OperatorError> {
        self.limiter.set_override(over, None).await
    }

    /// As [`RateLimiter::set_override_for`], for this layer's policy.
    ///
    /// # Errors
    ///
    /// As [`RateLimiter::set_override`].
    pub async fn set_override_for(
        &self,
        over: Override,
        lasting: Duration,
    ) -> Result<(), OperatorError> {
        self.limiter.set_override(over, Some(lasting)).await
    }

    /// As [`RateLimiter::remove_override`], for this layer's policy.
    ///
    /// # Errors
    ///
    /// As [`RateLimiter::set_override`].
    pub async fn remove_override(&self, target: OverrideTarget) -> Result<(), OperatorError> {
        self.limiter.remove_override(target).await
    }

    /// As [`RateLimiter::overrides`], for this layer's policy.
    ///
    /// # Errors
    ///
    /// The store's error.
    pub async fn overrides(&self) -> Result<Vec<SetOverride>, OperatorError> {
        self.limiter.overrides().await
    }
}
