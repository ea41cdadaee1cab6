//! [`RateLimit`]: the service, where a request, a store and a response meet.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use tower::{BoxError, Service};

use super::future::ResponseFuture;
use crate::limiter::{Layered, Limiter};
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
    let (mut parts, body) = request.into_parts();
    // Decided at once (an in-process store, units in hand, an answer): no clone of the inner
    // service, no state to wait in.
    match limiter.decide_layered(&mut parts) {
        Layered::Call(on_response) => {
            let request = Request::from_parts(parts, body);
            ResponseFuture::inner(inner.call(request), on_response)
        }
        Layered::Answer(response) => ResponseFuture::respond(response),
        Layered::Wait(deciding) => {
            // The service that was polled ready goes with the request; a fresh clone stays.
            let fresh = inner.clone();
            let service = std::mem::replace(inner, fresh);
            ResponseFuture::deciding(deciding, service, Request::from_parts(parts, body))
        }
    }
}
