//! [`RateLimit`]: the service, where a request, a store and a response meet.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use tower::{BoxError, Service};

use crate::future::ResponseFuture;
use crate::limiter::{Admission, Limiter, Prepared, Verdict};
use crate::policy::Policy;
use crate::store::Store;

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    limiter: Arc<Limiter>,
}

impl<S> RateLimit<S> {
    /// Wraps `inner`, limiting by `policy` and counting in `store`.
    pub fn new(inner: S, policy: Policy, store: impl Store) -> Self {
        let limiter =
            Limiter::try_new(policy, Arc::new(store)).unwrap_or_else(|error| panic!("{error}"));
        RateLimit::from_parts(inner, Arc::new(limiter))
    }

    pub(crate) fn from_parts(inner: S, limiter: Arc<Limiter>) -> Self {
        RateLimit { inner, limiter }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug> fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("limiter", &self.limiter)
            .finish()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        limit_call(&self.limiter, &mut self.inner, request)
    }
}

/// Limits one request by `limiter`, calling `inner` (which was polled ready) if it is admitted.
pub(crate) fn limit_call<S, ReqBody, ResBody>(
    limiter: &Arc<Limiter>,
    inner: &mut S,
    request: Request<ReqBody>,
) -> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    // The service that was polled ready goes with a request that calls it later; a fresh clone
    // stays.
    let take_ready_service = |inner: &mut S| {
        let fresh = inner.clone();
        std::mem::replace(inner, fresh)
    };
    let (parts, body) = request.into_parts();
    let prepared = limiter.prepare(&parts);
    let request = Request::from_parts(parts, body);
    let overriding;
    let (limiter, mut checked) = match prepared {
        Prepared::Check(checked) => (limiter, checked),
        Prepared::CheckBy(own, checked) => {
            overriding = own;
            (&overriding, checked)
        }
        Prepared::Unlimited => {
            return ResponseFuture::inner(inner.call(request), Admission::unchecked());
        }
        Prepared::Admit(admission) => return ResponseFuture::inner(inner.call(request), admission),
        Prepared::Respond(answer) => return ResponseFuture::respond(limiter.respond(&answer)),
        Prepared::RespondBy(own, answer) => return ResponseFuture::respond(own.respond(&answer)),
        Prepared::AwaitUnits(wait) => {
            let service = take_ready_service(inner);
            return ResponseFuture::awaiting_units(wait, service, request, limiter.clone());
        }
    };
    if limiter.queues_first(&checked) {
        let wait = Box::pin(limiter.clone().wait_for_slot(checked, false));
        let service = take_ready_service(inner);
        return ResponseFuture::waiting_for_slot(wait, service, request, limiter.clone());
    }
    loop {
        let mut check = limiter.check(&checked);
        // In-process stores answer at once: no clone of the inner service, no extra state.
        let Some(result) = check.take_ready() else {
            let service = take_ready_service(inner);
            return ResponseFuture::checking(check, service, request, limiter.clone(), checked);
        };
        return match limiter.settle(result, &mut checked) {
            Verdict::Admit(admission) => ResponseFuture::inner(inner.call(request), admission),
            Verdict::Delay(delay, admission) => {
                ResponseFuture::delaying(delay, take_ready_service(inner), request, admission)
            }
            Verdict::Respond(answer) => ResponseFuture::respond(limiter.respond(&answer)),
            Verdict::AwaitSlot => ResponseFuture::waiting_for_slot(
                Box::pin(limiter.clone().wait_for_slot(checked, true)),
                take_ready_service(inner),
                request,
                limiter.clone(),
            ),
            // A take of units ahead was refused: ask for the cost alone.
            Verdict::Retake => {
                checked.exact();
                continue;
            }
        };
    }
}
