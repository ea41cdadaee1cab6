//! [`HoldingBody`]: a response body that holds what its request holds until it has been sent
//! (its last frame read) or dropped (the client went away): a concurrency slot, a meter's
//! reservation.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// A response body holding `held` until the response is done.
    pub(crate) struct HoldingBody<B, H> {
        #[pin]
        body: B,
        held: Option<H>,
    }
}

impl<B, H> HoldingBody<B, H> {
    pub(crate) fn new(body: B, held: H) -> Self {
        HoldingBody {
            body,
            held: Some(held),
        }
    }
}

impl<B: Body, H> Body for HoldingBody<B, H> {
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
            this.held.take();
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

    use std::sync::Arc;
    use std::task::Waker;

    use super::*;
    use crate::limiter::slots::Lease;
    use crate::limiter::store_error_log::StoreErrorLog;
    use crate::store::{CheckRequest, Store};
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
        let held = (Some(lease), None::<crate::limiter::metered::Reserved>);
        let mut body = std::pin::pin!(HoldingBody::new(MessageThenTrailers(0), held));
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
