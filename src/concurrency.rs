//! Concurrency limits: at most `n` requests of one identity in progress at once, on every instance
//! together ([`PolicyBuilder::max_in_flight`](crate::PolicyBuilder::max_in_flight)).
//!
//! A request admitted under a concurrency limit holds a *lease*: a slot taken by the store in the
//! same step as the policy's rate rules (all or nothing), released when the response body has been
//! sent or dropped (a client that disconnects releases it too), and otherwise when the lease
//! expires, so a crashed instance can't hold a slot for ever. Leases are not renewed: the lease is
//! the longest a request may hold its slot (the seed's "limited worker lifetime"). A request that
//! outlives it keeps running, but its slot is free for another; choose a lease longer than the
//! slowest request you serve.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::policy::{Policy, StorageKey};
use crate::store::{CheckRequest, Store};

/// A concurrency limit: at most `max_in_flight` requests of one identity in progress at once, each
/// holding its slot at most `lease`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyLimit {
    max_in_flight: u64,
    lease: Duration,
}

impl ConcurrencyLimit {
    /// At most `max_in_flight` requests in progress at once, each slot held at most `lease`.
    pub fn new(max_in_flight: u64, lease: Duration) -> Self {
        ConcurrencyLimit {
            max_in_flight,
            lease,
        }
    }

    /// How many requests of one identity may be in progress at once.
    pub fn max_in_flight(&self) -> u64 {
        self.max_in_flight
    }

    /// The longest a request holds its slot.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The limit's name in headers and 429 bodies: `<n>-in-flight`.
    pub fn name(&self) -> String {
        format!("{}-in-flight", self.max_in_flight)
    }
}

/// A slot held by an admitted request: released (on every instance, through the store) when this
/// is dropped, which is when the response body has been sent or dropped.
pub(crate) struct Lease {
    store: Arc<dyn Store>,
    policy: Policy,
    key: StorageKey,
    id: u64,
}

impl Lease {
    pub(crate) fn new(store: Arc<dyn Store>, policy: Policy, key: StorageKey, id: u64) -> Self {
        Lease {
            store,
            policy,
            key,
            id,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let policy = &self.policy;
        let request = CheckRequest::new(self.key.as_str(), policy.rules(), policy.algorithm())
            .identity(self.key.identity())
            .concurrency(policy.concurrency());
        let mut release = self.store.release(&request, self.id);
        // An in-process store is done at once; a networked one finishes in a task of its own.
        // Without a runtime (a test's teardown) the lease just expires.
        match release
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(result) => log_failure(result, policy),
            Poll::Pending => {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let policy = policy.clone();
                    runtime.spawn(async move { log_failure(release.await, &policy) });
                }
            }
        }
    }
}

fn log_failure(result: Result<(), crate::StoreError>, policy: &Policy) {
    if let Err(error) = result {
        tracing::warn!(
            policy = policy.name(),
            %error,
            "could not release a concurrency slot; it frees when its lease expires"
        );
    }
}

pin_project! {
    /// A response body that holds its request's concurrency slot until it has been sent (its last
    /// frame read) or dropped (the client went away).
    pub(crate) struct LeasedBody<B> {
        #[pin]
        body: B,
        lease: Option<Lease>,
    }
}

impl<B> LeasedBody<B> {
    pub(crate) fn new(body: B, lease: Lease) -> Self {
        LeasedBody {
            body,
            lease: Some(lease),
        }
    }
}

impl<B: Body> Body for LeasedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.body.poll_frame(cx));
        if !matches!(frame, Some(Ok(_))) {
            // The end, or an error that ends it: the request is done.
            this.lease.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
