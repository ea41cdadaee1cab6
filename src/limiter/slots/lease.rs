//! [`Lease`]: a slot held by an admitted request, and [`LeasedBody`], which holds it until the
//! response body is done.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

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
        let policy = &self.policy;
        let mut release = self.store.release(&self.request(), self.id);
        // An in-process store is done at once; a networked one finishes in a task of its own.
        // Without a runtime (a test's teardown) the lease just expires.
        match release
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(result) => released(
                &result,
                policy,
                &self.key,
                self.waiting.as_deref(),
                &self.errors,
            ),
            Poll::Pending => {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let policy = policy.clone();
                    let key = self.key.clone();
                    let waiting = self.waiting.take();
                    let errors = self.errors.clone();
                    runtime.spawn(async move {
                        released(&release.await, &policy, &key, waiting.as_deref(), &errors);
                    });
                }
            }
        }
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
        let mut this = self.project();
        let frame = ready!(this.body.as_mut().poll_frame(cx));
        // The end, an error that ends it, or a stream's trailers (a gRPC stream ends with them,
        // and hyper polls no further once it has sent them): the request is done.
        let ended = match &frame {
            Some(Ok(frame)) => frame.is_trailers() || this.body.is_end_stream(),
            _ => true,
        };
        if ended {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::HeaderMap;

    use super::*;
    use crate::{MemoryStore, Policy};

    /// A response body that sends one message, then its trailers, then never ends: as a gRPC
    /// stream looks to the layer once hyper has sent the trailers and polls no more.
    struct MessageThenTrailers(u8);

    impl Body for MessageThenTrailers {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0 += 1;
            match self.0 {
                1 => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"message"))))),
                2 => Poll::Ready(Some(Ok(Frame::trailers(HeaderMap::new())))),
                _ => Poll::Pending,
            }
        }
    }

    #[tokio::test]
    async fn a_streams_slot_is_free_once_its_trailers_are_read_before_the_body_is_dropped() {
        let policy = Policy::builder("stream")
            .max_in_flight(1)
            .lease(Duration::from_secs(600))
            .build()
            .unwrap();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let key = policy.unscoped_key_of("caller");
        let take_slot = || {
            let request = CheckRequest::new(key.as_str(), policy.rules(), policy.algorithm())
                .identity(key.identity())
                .concurrency(policy.concurrency());
            store.check(&request)
        };
        let lease = take_slot().await.unwrap().lease.expect("the one slot");
        assert!(!take_slot().await.unwrap().allowed, "the slot is held");

        let lease = Lease::new(
            store.clone(),
            policy.clone(),
            key.clone(),
            lease,
            None,
            Arc::new(StoreErrorLog::default()),
        );
        let mut body = std::pin::pin!(LeasedBody::new(MessageThenTrailers(0), lease));
        let mut cx = Context::from_waker(Waker::noop());
        let frame = body.as_mut().poll_frame(&mut cx);
        assert!(matches!(frame, Poll::Ready(Some(Ok(ref f))) if f.is_data()));
        assert!(
            !take_slot().await.unwrap().allowed,
            "held while the stream runs"
        );
        let frame = body.as_mut().poll_frame(&mut cx);
        assert!(matches!(frame, Poll::Ready(Some(Ok(ref f))) if f.is_trailers()));
        // The body is still alive (hyper drops it later): the trailers alone freed the slot.
        assert!(
            take_slot().await.unwrap().allowed,
            "free after the trailers"
        );
    }
}
