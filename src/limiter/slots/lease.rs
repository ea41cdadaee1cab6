//! [`Lease`]: a slot held by an admitted request, released when dropped (a response body holds
//! it until it is done: `holding_body.rs`).

use std::sync::Arc;

use super::SlotQueues;
use crate::limiter::store_error_log::StoreErrorLog;
use crate::policy::{Policy, StorageKey};
use crate::store::{CheckRequest, Store};

/// A slot held by an admitted request: released (on every instance, through the store) when this
/// is dropped, which is when the response body has been sent or dropped.
pub(crate) struct Lease {
    store: Arc<dyn Store>,
    policy: Policy,
    key: StorageKey,
    id: u64,
    /// This instance's requests waiting for a slot, woken once the slot is free again.
    waiting: Option<Arc<SlotQueues>>,
    /// The policy's store-failure log: a release fails for every request while the store does.
    errors: Arc<StoreErrorLog>,
    /// Released already ([`Lease::release`]): nothing to do when dropped.
    released: bool,
}

impl Lease {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        policy: Policy,
        key: StorageKey,
        id: u64,
        waiting: Option<Arc<SlotQueues>>,
        errors: Arc<StoreErrorLog>,
    ) -> Self {
        Lease {
            store,
            policy,
            key,
            id,
            waiting,
            errors,
            released: false,
        }
    }

    /// A request naming the lease's key and concurrency limit, for the store.
    fn request(&self) -> CheckRequest<'_> {
        let policy = &self.policy;
        CheckRequest::new(self.key.as_str(), policy.rules(), policy.algorithm())
            .identity(self.key.identity())
            .sharing(policy.fair_key())
            .concurrency(policy.concurrency())
    }

    /// Releases the slot now and waits until the store has freed it.
    pub(crate) async fn release(mut self) -> Result<(), crate::StoreError> {
        self.released = true;
        let result = self.store.release(&self.request(), self.id).await;
        released(
            &result,
            &self.policy,
            &self.key,
            self.waiting.as_deref(),
            &self.errors,
        );
        result
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // An in-process store is done at once; a networked one answers when the release has
        // landed. Without a runtime (a test's teardown) the lease just expires.
        let (policy, key) = (self.policy.clone(), self.key.clone());
        let (waiting, errors) = (self.waiting.take(), self.errors.clone());
        self.store.release_then(
            &self.request(),
            self.id,
            Box::new(move |result| {
                released(&result, &policy, &key, waiting.as_deref(), &errors);
            }),
        );
    }
}

/// Wakes the key's next waiter once the store has freed the slot, or logs why it hasn't.
fn released(
    result: &Result<(), crate::StoreError>,
    policy: &Policy,
    key: &StorageKey,
    waiting: Option<&SlotQueues>,
    errors: &StoreErrorLog,
) {
    match result {
        Ok(()) => {
            if let Some(waiting) = waiting {
                waiting.freed(key.as_str());
            }
        }
        Err(error) => errors.log(
            policy.name(),
            error,
            "could not release a concurrency slot; it frees when its lease expires",
        ),
    }
}
