//! [`Charge`]: an admitted request's units under a `count_only` policy, given back when its
//! response turns out not to count.

use std::sync::Arc;

use http::StatusCode;

use super::Limiter;
use crate::policy::StorageKey;
use crate::quota::QuotaLookup;

/// The units one admitted request was charged, and where.
pub(crate) struct Charge {
    limiter: Arc<Limiter>,
    key: StorageKey,
    cost: u64,
    quota: Option<QuotaLookup>,
}

impl Charge {
    pub(crate) fn new(
        limiter: Arc<Limiter>,
        key: StorageKey,
        cost: u64,
        quota: Option<QuotaLookup>,
    ) -> Self {
        Charge {
            limiter,
            key,
            cost,
            quota,
        }
    }

    /// Keeps the charge if a response of `status` counts, else gives it back: at once with an
    /// in-process store, in a task of its own with a networked one (the response doesn't wait).
    /// A refund that fails is logged; the units then count, on the safe side.
    pub(crate) fn settle(self, status: StatusCode) {
        let limiter = &self.limiter;
        if limiter.policy.counts(status) {
            return;
        }
        let request = limiter
            .store_request(&self.key, self.quota.as_ref())
            .cost(self.cost);
        let mut refund = limiter.store().refund(&request);
        match refund.take_ready() {
            Some(result) => self.refunded(result.map(|_| ())),
            None => {
                // Without a runtime (a test's teardown) the units just count.
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move {
                        let result = refund.await.map(|_| ());
                        self.refunded(result);
                    });
                }
            }
        }
    }

    fn refunded(&self, result: Result<(), crate::StoreError>) {
        let limiter = &self.limiter;
        match result {
            // A refusal cached here may stand no more: the units are back.
            Ok(()) => limiter.refusals.forget_key(self.key.as_str()),
            Err(error) => limiter.store_errors.log(
                limiter.policy.name(),
                &error,
                "could not give back the charge of a response that doesn't count; it counts",
            ),
        }
    }
}
