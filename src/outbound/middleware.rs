//! [`OutboundLayer`] and [`ObeyRetryAfter`] as `reqwest-middleware` [`Middleware`]s: the same slots,
//! waits, pauses and retries for a `reqwest` client as for a tower one, sharing the store with
//! both.

use std::time::SystemTime;

use http::{Extensions, Uri};
use reqwest_middleware::{Error, Middleware, Next};

use super::{ObeyRetryAfter, OutboundError, OutboundLayer};
use crate::meter::Estimate;

/// Limits a `reqwest` client (feature `reqwest-middleware`). A request that is not sent fails
/// with [`reqwest_middleware::Error::Middleware`] holding an [`OutboundError`] (reach it with
/// `downcast_ref`); the upstream's own errors come through untouched.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// use tower_redis_ratelimit::outbound::{OutboundError, OutboundLayer};
/// use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Rule};
///
/// let policy = Policy::builder("partner-api")
///     .algorithm(Algorithm::SlidingLog)
///     .rule(Rule::per_minute(1))
///     .build()
///     .unwrap();
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(OutboundLayer::new(policy, MemoryStore::new()).max_wait(Duration::from_secs(5)))
///     .build();
/// // The first request takes the minute's slot (and fails to connect: nothing listens there);
/// // the second one's slot is a minute away, past the maximum wait, so it is not sent.
/// let _ = client.get("http://127.0.0.1:9/quote").send().await;
/// let error = client.get("http://127.0.0.1:9/quote").send().await.unwrap_err();
/// let reqwest_middleware::Error::Middleware(error) = error else { panic!("{error}") };
/// assert!(matches!(error.downcast_ref(), Some(OutboundError::WouldWait { .. })));
/// # }
/// ```
#[async_trait::async_trait]
impl Middleware for OutboundLayer {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let shared = &self.shared;
        // A `Url` always parses as a `Uri` (reqwest converts the same way); the key is then the
        // one a tower client of the same upstream gets.
        let uri: Uri = request
            .url()
            .as_str()
            .parse()
            .map_err(|_| Error::middleware(OutboundError::BadKey(request.url().to_string())))?;
        let upstream = shared
            .upstream_of(&uri, request.headers())
            .map_err(Error::middleware)?;
        // (The head only when a meter or a fair share reads it.)
        let head = (shared.policy.metering().is_some() || shared.policy.fair_share().is_some())
            .then(|| head_of(&request, uri, extensions));
        let units = match (&head, shared.policy.metering()) {
            (Some(head), Some(_)) => shared.estimate(head),
            _ => 1,
        };
        let caller = head.as_ref().and_then(|head| shared.caller_of(head));
        let reservation = shared
            .admit(&upstream, units, caller)
            .await
            .map_err(Error::middleware)?;
        let mut response = match next.run(request, extensions).await {
            Ok(response) => response,
            Err(error) => {
                let not_sent = matches!(&error, Error::Middleware(inner)
                    if inner.downcast_ref::<OutboundError>().is_some());
                super::not_sent_if(reservation, not_sent);
                return Err(error);
            }
        };
        let status = response.status();
        // The headers are cloned (a map of a few entries) so the extensions can be borrowed
        // mutably beside them: reqwest's response has no `into_parts`.
        let headers = response.headers().clone();
        shared
            .answered(
                &upstream,
                reservation,
                status,
                &headers,
                response.extensions_mut(),
            )
            .await;
        Ok(response)
    }
}

/// The head of `request` (at `uri`) as a meter's estimate reads it, with the
/// [`Estimate`](crate::meter::Estimate) the request was given
/// (`reqwest_middleware::RequestBuilder::with_extension`), if any.
fn head_of(request: &reqwest::Request, uri: Uri, extensions: &Extensions) -> http::request::Parts {
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = request.method().clone();
    parts.uri = uri;
    parts.headers = request.headers().clone();
    if let Some(estimate) = extensions.get::<Estimate>() {
        parts.extensions.insert(*estimate);
    }
    parts
}

/// Retries a `reqwest` request answered 429 or 503 (feature `reqwest-middleware`), as the tower
/// retry policy does: after the upstream's `Retry-After`, within the attempts and total wait,
/// idempotent methods only unless told otherwise. A request whose body can't be cloned (a
/// stream) is sent once.
///
/// Add it before an [`OutboundLayer`] (`reqwest_middleware` runs middlewares in the order they
/// were added), so that each retry takes a slot too. Retrying a refused call *at once* would be
/// correct as well: the refusal's pause is stored, and the retry waits in the layer until it is
/// over, on every instance that shares the store. Waiting here first only keeps the retry from
/// counting against the layer's [`max_wait`](OutboundLayer::max_wait).
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::outbound::{OutboundLayer, ObeyRetryAfter};
/// use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Rule};
///
/// let policy = Policy::builder("partner-api")
///     .algorithm(Algorithm::SlidingLog)
///     .rule(Rule::per_second(5))
///     .build()
///     .unwrap();
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(ObeyRetryAfter::new().attempts(3).max_total_wait(Duration::from_secs(20)))
///     .with(OutboundLayer::new(policy, MemoryStore::new()))
///     .build();
/// # let _ = client;
/// ```
#[async_trait::async_trait]
impl Middleware for ObeyRetryAfter {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        // A copy per request: the configuration's budget of attempts and waiting is each one's.
        let mut budget = self.clone();
        loop {
            let Some(attempt) = request.try_clone() else {
                return next.run(request, extensions).await;
            };
            let response = next.clone().run(attempt, extensions).await?;
            let wait = budget.wait_for(
                request.method(),
                response.status(),
                response.headers(),
                SystemTime::now(),
            );
            let Some(wait) = wait else {
                return Ok(response);
            };
            budget.spend(wait);
            drop(response);
            tokio::time::sleep(wait).await;
        }
    }
}
