//! A policy's options: [`Scope`], [`MissingKey`], [`OnStoreError`], [`Mode`] and [`Cost`].

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http::request::Parts;

/// Which requests share a bucket, besides having the same identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Scope {
    /// One bucket per identity for every route the layer covers.
    #[default]
    Policy,
    /// One bucket per identity, method and route: the seed's `class-method` suffix. The route is
    /// axum's `MatchedPath` (so `/users/{id}` is one route), which is set when the layer is added
    /// with `Router::layer` or `route_layer`. Requests without it (a 404, a layer outside the router)
    /// share one `unmatched` route, so made-up paths can't mint fresh buckets; so do methods other
    /// than the standard nine.
    Route,
}

/// What happens when a request has no key (no user id, no header) or no client IP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Count the request against its client IP instead (default). When even the client IP is unknown
    /// (the server was not started with `into_make_service_with_connect_info`), the request is
    /// refused with 500 and an error is logged: a limiter that silently stops limiting is worse.
    #[default]
    ClientIp,
    /// Let the request through without limiting it.
    Allow,
    /// Refuse the request with this status (for example 401 for a missing user).
    Reject(StatusCode),
}

/// What happens when the store fails: an outage (Redis down, a timeout) or a fault (a script
/// error, a key of the wrong type, Redis out of memory; see [`StoreError::is_fault`]). Never a
/// 429: a store error is not a rate limit. Either way the failure is logged (an outage at `warn`,
/// a fault at `error`, a few lines a second per policy and kind at most) and counted.
///
/// [`StoreError::is_fault`]: crate::StoreError::is_fault
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Let the request through, without rate-limit headers (fail open, default).
    #[default]
    Allow,
    /// Refuse the request with 503 and a problem+json body (fail closed).
    Deny,
}

/// What a policy does with a request that its rules refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Mode {
    /// Refuse it with 429 (default).
    #[default]
    Enforce,
    /// Let it through anyway, log it (`would be rate limited`) and count it
    /// ([`RateLimitLayer::shadow_refusals`](crate::RateLimitLayer::shadow_refusals)). The
    /// rate-limit headers still tell the truth, so a limit can be rolled out and watched before it
    /// bites. A request the rules refuse is recorded in none of them, as in enforce mode.
    Shadow,
    /// Hold it until the rules admit it, if that is at most `max_delay` away; a longer wait gets the
    /// 429 at once. The store reserves the request's place at the time it will fit, so waiting
    /// requests are admitted in order, exactly the limit per period, never polling. Needs an
    /// algorithm that can reserve ([`Algorithm::can_reserve`](crate::policy::Algorithm::can_reserve)). A request refused for want of a
    /// concurrency slot ([`PolicyBuilder::max_in_flight`](crate::policy::PolicyBuilder::max_in_flight)) waits for one up to `max_delay`, first
    /// come first served (see [`concurrency`](crate::concurrency)).
    Delay {
        /// The longest a request is held.
        max_delay: Duration,
    },
}

impl Mode {
    /// The longest a refused request may wait to be admitted: zero unless [`Mode::Delay`].
    pub fn max_delay(self) -> Duration {
        match self {
            Mode::Delay { max_delay } => max_delay,
            Mode::Enforce | Mode::Shadow => Duration::ZERO,
        }
    }
}

/// How many units a request costs, as a request extension: set it in an earlier layer or
/// middleware (for example from the size of a batch) and the limiter charges that much in every
/// rule. It wins over the policy's [`PolicyBuilder::cost_from_fn`](crate::policy::PolicyBuilder::cost_from_fn); without either a request costs 1.
///
/// A request that costs more than a rule could ever admit (its limit, or its burst for a token
/// bucket) is refused with `413 Content Too Large` and a problem body that says so, rather than
/// told to retry.
///
/// ```
/// use http::Request;
/// use tower_redis_ratelimit::Cost;
///
/// let mut request = Request::new(());
/// request.extensions_mut().insert(Cost(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cost(pub u64);

/// The cost of a request as a policy computes it.
pub type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

/// The window of the duplicate guard when none is given: one request per 5 seconds.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(5);
