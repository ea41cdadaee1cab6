//! A policy's options that depend on requests: [`MissingKey`] and [`Cost`]. (The rest, `Scope`,
//! `OnStoreError` and `Mode`, are plain values and live in `tower-redis-ratelimit-spec`.)

use std::sync::Arc;

use http::StatusCode;
use http::request::Parts;

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
/// use tower_redis_ratelimit::policy::Cost;
///
/// let mut request = Request::new(());
/// request.extensions_mut().insert(Cost(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cost(pub u64);

/// The cost of a request as a policy computes it.
pub type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

/// Which responses count under [`PolicyBuilder::count_only`](crate::PolicyBuilder::count_only).
pub type CountsFn = Arc<dyn Fn(http::StatusCode) -> bool + Send + Sync>;
