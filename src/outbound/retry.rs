//! [`ObeyRetryAfter`]: a `tower::retry::Policy` that retries a 429 or 503 when the upstream said to,
//! after the time it said.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use http::{Method, Request, Response, StatusCode};

use crate::headers::{self, RetryAfter as Announced};

/// Retries answers of 429 and 503 after the upstream's `Retry-After` (delay-seconds or an
/// HTTP-date; a `fallback` wait without one), for idempotent methods only unless told otherwise,
/// at most `attempts` times and never waiting more than `max_total_wait` in all. Use it with
/// `tower::retry::RetryLayer` (tower's `retry` feature), inside or outside an
/// [`OutboundLayer`](super::OutboundLayer): inside, the retried call waits for a slot too.
///
/// ```
/// use std::time::Duration;
/// use tower::retry::RetryLayer;
/// use tower_redis_ratelimit::outbound::ObeyRetryAfter;
///
/// let retry = RetryLayer::new(ObeyRetryAfter::new().attempts(3).max_total_wait(Duration::from_secs(20)));
/// # let _ = retry;
/// ```
#[derive(Debug, Clone)]
pub struct ObeyRetryAfter {
    attempts: u32,
    max_total_wait: Duration,
    fallback: Duration,
    any_method: bool,
    /// Waited so far for this request (a clone per request starts at zero).
    waited: Duration,
}

impl Default for ObeyRetryAfter {
    fn default() -> Self {
        ObeyRetryAfter::new()
    }
}

impl ObeyRetryAfter {
    /// Up to 2 retries, 30 s of waiting in all, 1 s when the upstream gives no `Retry-After`,
    /// idempotent methods only.
    pub fn new() -> Self {
        ObeyRetryAfter {
            attempts: 2,
            max_total_wait: Duration::from_secs(30),
            fallback: Duration::from_secs(1),
            any_method: false,
            waited: Duration::ZERO,
        }
    }

    /// How many times a request is retried at most (0: never).
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }

    /// The most a request waits between its attempts, in all: an answer asking for longer than
    /// what is left is returned as it is.
    pub fn max_total_wait(mut self, max_total_wait: Duration) -> Self {
        self.max_total_wait = max_total_wait;
        self
    }

    /// The wait when a 429 or 503 carries no usable `Retry-After`.
    pub fn fallback(mut self, fallback: Duration) -> Self {
        self.fallback = fallback;
        self
    }

    /// Retries requests of every method, `POST` and `PATCH` included: only when the upstream is
    /// known not to have acted on a refused request.
    pub fn any_method(mut self, any_method: bool) -> Self {
        self.any_method = any_method;
        self
    }

    /// How long to wait before retrying a request of `method` answered `response`, if at all.
    pub(super) fn wait_for(
        &self,
        method: &Method,
        status: StatusCode,
        headers: &http::HeaderMap,
        now: SystemTime,
    ) -> Option<Duration> {
        if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
            return None;
        }
        if self.attempts == 0 || !(self.any_method || is_idempotent(method)) {
            return None;
        }
        let mut retry_after = http::HeaderMap::new();
        for value in headers.get_all(http::header::RETRY_AFTER) {
            retry_after.append(http::header::RETRY_AFTER, value.clone());
        }
        let wait = match headers::parse(&retry_after)
            .ok()
            .and_then(|parsed| parsed.retry_after)
        {
            Some(Announced::Delay(delay)) => delay,
            Some(date) => date.delay_from(now),
            None => self.fallback,
        };
        (self.waited.saturating_add(wait) <= self.max_total_wait).then_some(wait)
    }
}

impl ObeyRetryAfter {
    /// Counts one retry after `wait`.
    pub(super) fn spend(&mut self, wait: Duration) {
        self.attempts -= 1;
        self.waited = self.waited.saturating_add(wait);
    }
}

/// The methods RFC 9110 calls idempotent.
fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

impl<B: Clone, T, E> tower::retry::Policy<Request<B>, Response<T>, E> for ObeyRetryAfter {
    type Future = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn retry(
        &mut self,
        request: &mut Request<B>,
        result: &mut Result<Response<T>, E>,
    ) -> Option<Self::Future> {
        let response = result.as_ref().ok()?;
        let wait = self.wait_for(
            request.method(),
            response.status(),
            response.headers(),
            SystemTime::now(),
        )?;
        self.spend(wait);
        Some(Box::pin(tokio::time::sleep(wait)))
    }

    fn clone_request(&mut self, request: &Request<B>) -> Option<Request<B>> {
        // Extensions don't clone; method, URI, version, headers and body do.
        let mut clone = Request::new(request.body().clone());
        *clone.method_mut() = request.method().clone();
        *clone.uri_mut() = request.uri().clone();
        *clone.version_mut() = request.version();
        *clone.headers_mut() = request.headers().clone();
        Some(clone)
    }
}
