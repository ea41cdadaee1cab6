//! [`RouteLimitsLayer`]: the policies of a configuration on the routes they name, as one
//! `route_layer` that picks each request's policy by its matched path.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::MatchedPath;
use bytes::Bytes;
use http::{Request, Response};
use tower::{BoxError, Layer, Service};

use crate::RateLimitLayer;
use crate::future::ResponseFuture;
use crate::limiter::Limiter;
use crate::service::limit_call;

/// Limits each request by the policy of its route (axum's [`MatchedPath`]); a route without one
/// is not limited. Made by [`RateLimitConfig::apply`](super::RateLimitConfig::apply); add it
/// with `Router::route_layer`, which runs it after routing.
#[derive(Clone)]
pub struct RouteLimitsLayer {
    limiters: Arc<HashMap<String, Arc<Limiter>>>,
}

impl RouteLimitsLayer {
    pub(super) fn new(limiters: HashMap<String, Arc<Limiter>>) -> Self {
        RouteLimitsLayer {
            limiters: Arc::new(limiters),
        }
    }
}

impl RouteLimitsLayer {
    /// A [`RateLimitLayer`] for each route's policy, sharing the route's counts, its
    /// [`top_refused`](RateLimitLayer::top_refused) summary and its shadow count: for operator
    /// endpoints ([`inspect`](RateLimitLayer::inspect), [`reset`](RateLimitLayer::reset)). Sorted
    /// by path.
    pub fn layers(&self) -> Vec<RateLimitLayer> {
        let mut routes: Vec<(&String, &Arc<Limiter>)> = self.limiters.iter().collect();
        routes.sort_by(|a, b| a.0.cmp(b.0));
        routes
            .into_iter()
            .map(|(_, limiter)| RateLimitLayer::from_limiter(limiter.clone()))
            .collect()
    }
}

impl fmt::Debug for RouteLimitsLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut paths: Vec<&String> = self.limiters.keys().collect();
        paths.sort();
        f.debug_struct("RouteLimitsLayer")
            .field("paths", &paths)
            .finish()
    }
}

impl<S> Layer<S> for RouteLimitsLayer {
    type Service = RouteLimits<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RouteLimits {
            inner,
            limiters: self.limiters.clone(),
        }
    }
}

/// The service of [`RouteLimitsLayer`].
#[derive(Clone)]
pub struct RouteLimits<S> {
    inner: S,
    limiters: Arc<HashMap<String, Arc<Limiter>>>,
}

impl<S: fmt::Debug> fmt::Debug for RouteLimits<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteLimits")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RouteLimits<S>
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
        let limiter = request
            .extensions()
            .get::<MatchedPath>()
            .and_then(|path| self.limiters.get(path.as_str()));
        match limiter {
            Some(limiter) => limit_call(limiter, &mut self.inner, request),
            None => ResponseFuture::inner(self.inner.call(request), None, None),
        }
    }
}
