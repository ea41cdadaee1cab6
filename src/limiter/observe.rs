//! What the limiter says about itself: metric handles, refusals counted, refusals logged.

use super::Limiter;

use crate::limiter::telemetry::{Outcome, PolicyMetrics};
use crate::policy::StorageKey;
use crate::response::TooManyRequests;
use crate::store::Store;

impl Limiter {
    /// The layer's metric handles.
    pub(super) fn metrics(&self) -> &PolicyMetrics {
        self.metrics
            .get_or_init(|| PolicyMetrics::new(&self.policy, self.store.name()))
    }

    /// Counts `units` reserved by a metered admission made outside the flow (an outbound call).
    pub(crate) fn count_reserved(&self, units: u64) {
        self.metrics().metered("reserved", units);
    }

    /// Counts a refusal (or, in shadow mode, what would have been one) of `key` by `rules`; the
    /// time it read, for the caller to share.
    pub(super) fn count_refusal(
        &self,
        outcome: Outcome,
        key: &StorageKey,
        rules: impl Iterator<Item = usize>,
    ) -> tokio::time::Instant {
        let metrics = self.metrics();
        metrics.request(outcome);
        metrics.rule_refusals(rules);
        let now = tokio::time::Instant::now();
        self.top_refused.record(key.kind(), key.identity(), now);
        now
    }

    /// Logs a refusal at `info`, with the count of refusals not logged since the last line.
    pub(super) fn log_rejection(
        &self,
        rejected: &TooManyRequests,
        key: &StorageKey,
        message: &str,
    ) {
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
