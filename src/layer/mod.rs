//! [`RateLimitLayer`]: the one line users add, with the service it makes ([`RateLimit`]) and
//! that service's [`ResponseFuture`]: the tower triple, as in tower-http.

mod future;
mod service;

pub use future::ResponseFuture;
pub use service::RateLimit;
#[cfg(feature = "config")]
pub(crate) use service::limit_call;

use std::fmt;
use std::sync::Arc;

use axum::response::IntoResponse;
use tower::Layer;

use crate::limiter::{Limiter, RejectHandler};
use crate::operate::HeavyHitter;
use crate::operate::{OperatorError, RuleUsage};
use crate::policy::{Policy, PolicyError};
use crate::response::TooManyRequests;
use crate::store::Store;

/// Applies a rate-limit [`Policy`] to every request of the wrapped service, counting in a [`Store`].
///
/// Admitted requests reach the inner service and their responses get the `RateLimit-Policy` and
/// `RateLimit` headers; refused requests get a 429 at once. The service never fails because of a
/// limit, so no `HandleErrorLayer` is needed.
///
/// ```
/// use axum::{Router, routing::get};
/// use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, Rule};
///
/// let policy = Policy::builder("api")
///     .key(Key::ip())
///     .rule(Rule::per_minute(10))
///     .rule(Rule::per_hour(100))
///     .build()
///     .unwrap();
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(RateLimitLayer::new(policy, MemoryStore::new()).legacy_headers(true));
/// ```
#[derive(Clone)]
pub struct RateLimitLayer {
    pub(crate) limiter: Arc<Limiter>,
}

impl RateLimitLayer {
    /// Limits by `policy`, counting in `store`. Clone a store (they share their counts) or wrap it
    /// in an `Arc` to use it for several layers.
    ///
    /// # Panics
    ///
    /// When the store can't take the policy's keys in one call, as [`RateLimitLayer::try_new`]
    /// reports: on Redis Cluster, a quota keyed apart from the policy's rules. Like a route conflict
    /// in axum, that is a mistake in the app's setup, found when the layer is built rather than as a
    /// store error on every request after a deploy.
    pub fn new(policy: Policy, store: impl Store) -> Self {
        RateLimitLayer::try_new(policy, store).unwrap_or_else(|error| panic!("{error}"))
    }

    /// Limits by `policy`, counting in `store`, or says why the store can't take the policy:
    /// [`PolicyError::QuotaKeyedApart`] when the store needs every key of a check in one Redis
    /// Cluster slot ([`Store::keys_share_one_slot`]) and the policy's quota is keyed apart from
    /// its rules; [`PolicyError::InvalidOption`] naming the option (`count_only`, `meter`,
    /// `prefetch`, `max_in_flight`) when the store lacks an ability it needs
    /// ([`Store::abilities`]).
    pub fn try_new(policy: Policy, store: impl Store) -> Result<Self, PolicyError> {
        Ok(RateLimitLayer {
            limiter: Arc::new(Limiter::try_new(policy, Arc::new(store))?),
        })
    }

    /// The layer of a limiter built elsewhere (a configuration's route).
    #[cfg(feature = "config")]
    pub(crate) fn from_limiter(limiter: Arc<Limiter>) -> Self {
        RateLimitLayer { limiter }
    }

    /// The limiter, to change a setting: this layer's own copy once others share it, with its
    /// override limiters to be made anew from the changed settings.
    fn limiter_mut(&mut self) -> &mut Limiter {
        Arc::make_mut(&mut self.limiter)
    }

    /// Also sends `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (the Unix
    /// time of the reset, in seconds) for the rule closest to running out, as GitHub does.
    pub fn legacy_headers(mut self, enabled: bool) -> Self {
        self.limiter_mut().set_legacy_headers(enabled);
        self
    }

    /// Replaces the default 429 body with what `respond` answers: anything a handler may return
    /// (`impl IntoResponse`). The layer still adds `Retry-After` and the rate-limit headers to
    /// it. It answers HTTP requests: a refused gRPC call (its `content-type` starts with
    /// `application/grpc`) always gets
    /// [`TooManyRequests::grpc_response`](crate::response::TooManyRequests::grpc_response).
    ///
    /// ```
    /// use axum::Json;
    /// use http::StatusCode;
    /// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, Rule};
    ///
    /// let policy = Policy::builder("otp").rule(Rule::per_minute(3)).build().unwrap();
    /// let layer = RateLimitLayer::new(policy, MemoryStore::new()).on_rejected(|rejected| {
    ///     let retry_in = rejected.retry_after_secs();
    ///     let body = serde_json::json!({ "error": "slow down", "retry_in": retry_in });
    ///     (StatusCode::TOO_MANY_REQUESTS, Json(body))
    /// });
    /// ```
    pub fn on_rejected<F, R>(mut self, respond: F) -> Self
    where
        F: Fn(&TooManyRequests) -> R + Send + Sync + 'static,
        R: IntoResponse,
    {
        let handler: RejectHandler = Arc::new(move |rejected| respond(rejected).into_response());
        self.limiter_mut().set_on_rejected(Some(handler));
        self
    }

    /// How many refused identities the layer remembers (default 10 000 over a networked store such
    /// as Redis, none over the memory store, which answers as fast; `0` turns the cache off). After the store refuses a request, the same identity is refused without asking the
    /// store until that refusal's retry time, for the same cost and the same quota tier (not
    /// for a policy with a penalty block, whose refusals always ask the store). In
    /// [delay mode](crate::Mode::Delay) only until the wait is down to `max_delay`: from then on
    /// the store holds the request and admits it. That is exact, not an estimate: other instances
    /// can only make the wait longer, and a refused request counts nowhere. So a refusal flood
    /// costs no store calls, and logs one line per identity and window; the rest are counted in
    /// the next line's `unlogged_refusals`.
    pub fn refusal_cache(mut self, capacity: usize) -> Self {
        self.limiter_mut().set_refusal_cache(capacity);
        self
    }

    /// How many identities [`RateLimitLayer::top_refused`] tracks (default 64; 0 turns it off).
    /// Memory is fixed by it: about 100 bytes per identity plus the identity itself.
    pub fn top_refused_capacity(mut self, capacity: usize) -> Self {
        self.limiter_mut().set_top_refused_capacity(capacity);
        self
    }

    /// The `n` identities this layer refused most in the last five to ten minutes (two five-minute
    /// generations), most refused first: the abusers to look at. Counts come from a Space-Saving
    /// summary in fixed memory, so they are approximate: each is an upper bound, at most its
    /// `error` above the true count, and every identity refused more than 1/64 of the time (1 in
    /// [`top_refused_capacity`](Self::top_refused_capacity)) is listed. Shadow-mode refusals count
    /// too. An API key appears only as its hash, as in the logs. Clones of the layer share it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use axum::{Router, body::Body, routing::get};
    /// use tower::ServiceExt;
    /// use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, Rule, UserId};
    ///
    /// let policy = Policy::builder("otp").key(Key::user()).rule(Rule::per_minute(1)).build().unwrap();
    /// let layer = RateLimitLayer::new(policy, MemoryStore::new());
    /// let app = Router::new().route("/otp", get(|| async { "sent" })).layer(layer.clone());
    /// for _ in 0..3 {
    ///     let mut request = http::Request::get("/otp").body(Body::empty()).unwrap();
    ///     request.extensions_mut().insert(UserId::new("mallory"));
    ///     app.clone().oneshot(request).await.unwrap();
    /// }
    /// let top = layer.top_refused(10);
    /// assert_eq!((top[0].identity.as_str(), top[0].count), ("user:mallory", 2));
    /// # }
    /// ```
    pub fn top_refused(&self, n: usize) -> Vec<HeavyHitter> {
        self.limiter.top_refused(n)
    }

    /// Forgets what `identity` (as the logs and [`top_refused`](Self::top_refused) show it,
    /// `user:alice`) has counted under this layer's policy, and lifts its penalty block: on every
    /// instance that shares the store at once (a refusal another instance cached stands at most
    /// one second more). For support unblocking a customer locked out of an OTP flow. The daily
    /// quota is left alone. Fails for a route-scoped policy, a malformed identity, or a store
    /// without [`Store::reset`].
    pub async fn reset(&self, identity: &str) -> Result<(), OperatorError> {
        self.limiter.reset(identity).await
    }

    /// The state of each counted rule of this layer's policy for `identity` (remaining and reset),
    /// read without counting a request. The duplicate guard, a penalty block and the daily quota
    /// are not shown.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, Rule};
    ///
    /// let policy = Policy::builder("otp").key(Key::user()).rule(Rule::per_minute(5)).build().unwrap();
    /// let layer = RateLimitLayer::new(policy, MemoryStore::new());
    /// let state = layer.inspect("user:alice").await.unwrap();
    /// assert_eq!((state[0].rule.as_str(), state[0].remaining), ("5-per-60s", 5));
    /// # }
    /// ```
    pub async fn inspect(&self, identity: &str) -> Result<Vec<RuleUsage>, OperatorError> {
        self.limiter.inspect(identity).await
    }

    /// Gives back the units this layer took ahead ([`PolicyBuilder::prefetch`]) and didn't
    /// spend, and waits for the store: call it when the instance shuts down (after the server
    /// stops taking requests), so that other instances can use them. A fixed window's or sliding
    /// counter's units come back only while their window lasts.
    ///
    /// [`PolicyBuilder::prefetch`]: crate::PolicyBuilder::prefetch
    pub async fn give_back_prefetched(&self) {
        crate::limiter::give_back_unspent(&self.limiter).await;
    }

    /// How many requests this layer let through that its policy refused, in
    /// [`Mode::Shadow`](crate::Mode::Shadow) (zero in other modes). Clones of the layer share the
    /// count.
    pub fn shadow_refusals(&self) -> u64 {
        self.limiter.shadow_refusals()
    }

    /// The policy this layer applies.
    pub fn policy(&self) -> &Policy {
        self.limiter.policy()
    }
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.limiter)
            .finish()
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_parts(inner, self.limiter.clone())
    }
}
