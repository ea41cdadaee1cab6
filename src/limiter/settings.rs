//! The limiter's settings, changed by its owner (a layer's builder methods, a config reload)
//! before it serves, and what its owner reads back (the policy, heavy hitters, shadow refusals).
//! Every change forgets the override limiters made from the settings before it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::refusals::Refusals;
use super::top_refused::{DEFAULT_TOP_REFUSED_GENERATION, TopRefused};
use super::{Limiter, RejectHandler};
use crate::operate::HeavyHitter;
use crate::policy::Policy;

impl Limiter {
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

    /// Counts its give-backs and settles on their way to the store in `settling`.
    pub(crate) fn track_settles(&mut self, settling: Arc<super::Settling>) {
        self.settling = Some(settling);
        self.settings_changed();
    }

    /// Its store-failure log.
    pub(crate) fn store_errors(&self) -> &super::store_error_log::StoreErrorLog {
        &self.store_errors
    }

    /// The `n` identities refused most recently.
    pub(crate) fn top_refused(&self, n: usize) -> Vec<HeavyHitter> {
        self.top_refused.top(n, tokio::time::Instant::now())
    }

    /// How many requests it let through in shadow mode that its policy refused.
    pub(crate) fn shadow_refusals(&self) -> u64 {
        self.shadow_refusals.load(Ordering::Relaxed)
    }
}
