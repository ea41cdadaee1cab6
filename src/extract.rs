//! [`Limited`]: a policy declared next to the handler, as an extractor the handler takes, so its
//! signature says how it is limited.
//!
//! A policy is a type implementing [`LimitPolicy`] (by hand, as below, or with
//! `#[derive(LimitPolicy)]` and the `macros` feature); a handler that takes `Limited<ThatPolicy>` is
//! limited by it. The count is kept in the store the app gives as a [`LimitStore`] extension, and a
//! refused request gets the same 429 (or delay, or shadow pass) as from [`RateLimitLayer`], with the
//! same headers. Return the `Limited` value in the response, as in `(limited, body)`, to send the
//! rate-limit headers on admitted responses too.
//!
//! ```
//! use axum::{Extension, Router, routing::post};
//! use tower_redis_ratelimit::{Key, LimitPolicy, LimitStore, Limited, MemoryStore, Policy, PolicyError, Rule};
//!
//! struct LoginPolicy;
//!
//! impl LimitPolicy for LoginPolicy {
//!     fn policy() -> Result<Policy, PolicyError> {
//!         Policy::builder("login")
//!             .key(Key::ip())
//!             .rule(Rule::per_minute(5))
//!             .rule(Rule::per_hour(20))
//!             .build()
//!     }
//! }
//!
//! async fn login(limited: Limited<LoginPolicy>) -> (Limited<LoginPolicy>, &'static str) {
//!     (limited, "welcome")
//! }
//!
//! let app: Router = Router::new()
//!     .route("/login", post(login))
//!     .layer(Extension(LimitStore::new(MemoryStore::new())));
//! ```
//!
//! [`RateLimitLayer`]: crate::RateLimitLayer

use std::any::TypeId;
use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, PoisonError, RwLock};

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use http::StatusCode;
use http::request::Parts;

use crate::limiter::{Admission, Limiter, Resolved};
use crate::operate::HeavyHitter;
use crate::policy::{Policy, PolicyError};
use crate::store::Store;

/// A rate-limit policy as a type, for [`Limited`]. Its policy is built once per [`LimitStore`], on
/// the first request that needs it (or by [`LimitStore::check`] when the app starts).
///
/// Implement it by hand with a builder chain, or, with the `macros` feature, derive it from a
/// `#[rate_limit(...)]` attribute that takes what a config file's route takes and is checked when
/// the app compiles:
///
/// ```
/// # #[cfg(feature = "macros")] {
/// use tower_redis_ratelimit::LimitPolicy;
///
/// #[derive(LimitPolicy)]
/// #[rate_limit(name = "login", key = "ip", rule(limit = 10, period = "60s"), prevent_duplicate)]
/// struct LoginPolicy;
///
/// let policy = LoginPolicy::policy().unwrap();
/// assert_eq!(policy.rule_names().len(), 2); // the rule and the duplicate guard
/// # }
/// ```
pub trait LimitPolicy: Send + Sync + 'static {
    /// Builds the policy. An error is logged and answered with 500 on every request of the
    /// handler, so a bad policy is loud rather than silently unlimited.
    fn policy() -> Result<Policy, PolicyError>;
}

/// The store [`Limited`] counts in, given to the app as a request extension:
/// `.layer(Extension(LimitStore::new(store)))`. Cheap to clone; clones share the store and the
/// policies built for it.
#[derive(Clone)]
pub struct LimitStore(Arc<Shared>);

struct Shared {
    store: Arc<dyn Store>,
    /// One limiter per policy type, built on first use.
    limiters: RwLock<HashMap<TypeId, Result<Arc<Limiter>, PolicyError>>>,
}

impl LimitStore {
    /// Counts in `store` (share one with layers by cloning it, or wrapping it in an `Arc`).
    pub fn new(store: impl Store) -> Self {
        LimitStore(Arc::new(Shared {
            store: Arc::new(store),
            limiters: RwLock::new(HashMap::new()),
        }))
    }

    /// The `n` identities the policy `P` refused most recently, as
    /// [`RateLimitLayer::top_refused`](crate::RateLimitLayer::top_refused) counts them.
    pub fn top_refused<P: LimitPolicy>(&self, n: usize) -> Vec<HeavyHitter> {
        self.limiter::<P>()
            .map_or_else(|_| Vec::new(), |limiter| limiter.top_refused(n))
    }

    /// How many requests the policy `P` let through in shadow mode that it would have refused.
    pub fn shadow_refusals<P: LimitPolicy>(&self) -> u64 {
        self.limiter::<P>()
            .map_or(0, |limiter| limiter.shadow_refusals())
    }

    /// Builds `P`'s policy now, as the first request through `Limited<P>` would, and says whether
    /// it can work: call it when the app starts, for each policy its handlers use, so that a bad
    /// hand-written [`LimitPolicy`] stops the app rather than answering 500 to every request.
    /// (A policy from `#[derive(LimitPolicy)]` was checked when the app compiled; over Redis
    /// Cluster this also checks that its quota shares its keys' slot.) The limiter it builds is
    /// the one requests then use.
    ///
    /// ```
    /// use tower_redis_ratelimit::{LimitPolicy, LimitStore, MemoryStore, Policy, PolicyError, Rule};
    ///
    /// struct Broken;
    ///
    /// impl LimitPolicy for Broken {
    ///     fn policy() -> Result<Policy, PolicyError> {
    ///         Policy::builder("broken").rule(Rule::per_minute(0)).build()
    ///     }
    /// }
    ///
    /// let store = LimitStore::new(MemoryStore::new());
    /// let error = store.check::<Broken>().unwrap_err();
    /// assert!(error.to_string().contains("the limit must be at least 1"));
    /// ```
    ///
    /// # Errors
    ///
    /// The [`PolicyError`] every request through `Limited<P>` would otherwise log.
    pub fn check<P: LimitPolicy>(&self) -> Result<(), PolicyError> {
        self.limiter::<P>().map(|_| ())
    }

    fn limiter<P: LimitPolicy>(&self) -> Result<Arc<Limiter>, PolicyError> {
        let id = TypeId::of::<P>();
        let limiters = &self.0.limiters;
        if let Some(built) = limiters
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
        {
            return built.clone();
        }
        let mut limiters = limiters.write().unwrap_or_else(PoisonError::into_inner);
        limiters
            .entry(id)
            .or_insert_with(|| {
                P::policy()
                    .and_then(|policy| Limiter::try_new(policy, self.0.store.clone()))
                    .map(Arc::new)
            })
            .clone()
    }
}

impl fmt::Debug for LimitStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitStore").finish_non_exhaustive()
    }
}

/// An extractor that admits the request under the policy `P`, or rejects it with the policy's 429.
///
/// Put it among the handler's arguments; return it with the response (`(limited, body)`) to add the
/// `RateLimit-Policy` and `RateLimit` headers. See the [module docs](self).
///
/// Under a policy with a concurrency limit it holds the request's slot: the slot is released when
/// the `Limited` value is dropped (when the handler returns, or when the response takes its
/// headers), not when the body has been sent as with the layer.
pub struct Limited<P> {
    /// The rate-limit headers and the concurrency slot held, if the policy has a concurrency
    /// limit.
    admission: Admission,
    policy: PhantomData<fn() -> P>,
}

impl<P> fmt::Debug for Limited<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limited")
            .field("holds_slot", &self.admission.holds_slot())
            .finish()
    }
}

impl<S, P> FromRequestParts<S> for Limited<P>
where
    S: Send + Sync,
    P: LimitPolicy,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let Some(store) = parts.extensions.get::<LimitStore>() else {
            tracing::error!(
                policy = std::any::type_name::<P>(),
                "no LimitStore for Limited<_>: add `.layer(Extension(LimitStore::new(store)))`"
            );
            return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
        };
        let limiter = match store.limiter::<P>() {
            Ok(limiter) => limiter,
            Err(error) => {
                tracing::error!(%error, "the policy of a Limited<_> extractor can't be built");
                return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
            }
        };
        // (The extractor can't see the response: a count_only charge stays, and a meter's
        // reservation settles once the request's `Usage` is gone.)
        match limiter.decide(parts).outcome().await {
            Resolved::Admitted(mut admission) => {
                admission.meter_into(&mut parts.extensions);
                Ok(Limited {
                    admission,
                    policy: PhantomData,
                })
            }
            Resolved::Answered(answered) => Err(answered.response()),
        }
    }
}

impl<P> IntoResponseParts for Limited<P> {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Self::Error> {
        let mut admission = self.admission;
        admission.apply_headers(parts.headers_mut());
        Ok(parts)
    }
}
