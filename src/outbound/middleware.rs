//! [`OutboundLayer`] as a `reqwest-middleware` [`Middleware`]: the same slots, waits and pauses
//! for a `reqwest` client as for a tower one, sharing the store with both.

use http::{Extensions, Uri};
use reqwest_middleware::{Error, Middleware, Next};

use super::{OutboundError, OutboundLayer};

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
        shared
            .wait_for_slot(&upstream)
            .await
            .map_err(Error::middleware)?;
        let response = next.run(request, extensions).await?;
        shared
            .learn(&upstream, response.status(), response.headers())
            .await;
        Ok(response)
    }
}
