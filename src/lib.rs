//! Declarative multi-rule rate limiting for [axum] and [tower] services.
//!
//! Declare a [`Policy`]: a key (client IP, user id, API key, global or your own), one or more
//! [`Rule`]s that must all pass (10 per minute *and* 100 per hour) and an [`Algorithm`]. Add it with
//! one line, `.layer(RateLimitLayer::new(policy, store))`. Refused requests get a `429 Too Many
//! Requests` with `Retry-After` and an RFC 9457 problem body; every response of a limited route
//! that the store answered carries the IETF `RateLimit-Policy` and `RateLimit` headers (read them
//! back with [`headers::parse`]).
//!
//! A gRPC call (a tonic service behind the same layer) that is refused gets a gRPC answer instead:
//! `RESOURCE_EXHAUSTED` with a retry pushback and (feature `grpc`) a rich status; see [`grpc`].
//!
//! A policy can also be declared as a type next to its handler and required by the [`Limited`]
//! extractor, and can add costs per request ([`Cost`](crate::policy::Cost)), a duplicate guard, a penalty block, and a
//! shadow or delay [`Mode`]; see [`PolicyBuilder`].
//!
//! Operators get metrics through the `metrics` facade (feature `metrics`, on by default), a `debug`
//! span per check, the most refused identities ([`RateLimitLayer::top_refused`]) and one
//! identity's state and reset ([`RateLimitLayer::inspect`], [`RateLimitLayer::reset`]); see the
//! guide's [monitoring](guide::monitoring) chapter.
//!
//! The [`guide`] has a chapter per task: policies and algorithms, keys and proxies, stores,
//! answers, costs, quotas, concurrency and limits from code, outbound calls, config files,
//! monitoring, store failures, performance, and migrating from tower_governor or
//! tower-rate-limit-redis.
//!
//! The [`MemoryStore`] keeps counts in-process; the [`RedisStore`] lets many app instances share one
//! limit. Either checks and records every rule of a request in one atomic step (one function call on
//! Redis), so a refused request consumes nothing. The Redis store runs on Redis 6.2 and later
//! ([`store::MINIMUM_VERSION`]), standalone, under Sentinel or as a Cluster; an older server is
//! refused with [`StoreError::UnsupportedVersion`], and [`RedisStore::probe`] tells an app at
//! start what it runs on.
//!
//! # Example
//!
//! ```
//! use axum::{Router, body::Body, routing::get};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, Rule, UserId, headers};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let policy = Policy::builder("otp")
//!     .key(Key::user())
//!     .rule(Rule::per_minute(2))
//!     .rule(Rule::per_hour(10))
//!     .message("Too many codes requested.")
//!     .build()
//!     .expect("a valid policy");
//! let app = Router::new()
//!     .route("/otp", get(|| async { "code sent" }))
//!     .layer(RateLimitLayer::new(policy, MemoryStore::new()));
//!
//! let request = || {
//!     let mut request = Request::get("/otp").body(Body::empty()).unwrap();
//!     request.extensions_mut().insert(UserId::new("alice"));
//!     request
//! };
//! for _ in 0..2 {
//!     let response = app.clone().oneshot(request()).await.unwrap();
//!     assert_eq!(response.status(), StatusCode::OK);
//! }
//! let refused = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
//!
//! let limits = headers::parse(refused.headers()).unwrap();
//! let minute = limits.status("2-per-60s").unwrap();
//! assert_eq!(minute.remaining, 0);
//! let retry = limits.retry_after.unwrap().delay_from(std::time::SystemTime::now());
//! assert!(retry.as_secs() >= 1 && retry.as_secs() <= 60);
//! # }
//! ```
//!
//! # Keys
//!
//! | [`Key`] | bucket | when it is missing |
//! |---|---|---|
//! | [`Key::ip`] | the client address (IPv6 grouped by /64), see [`ClientIp`](crate::client_ip::ClientIp) | no `ConnectInfo`: 500 (or as [`MissingKey`](crate::policy::MissingKey) says) |
//! | [`Key::user`], [`Key::user_from_fn`] | a [`UserId`] extension or your closure | [`MissingKey`](crate::policy::MissingKey) |
//! | [`Key::header`] | a header value such as an API key, hashed; check it before the limiter | [`MissingKey`](crate::policy::MissingKey) |
//! | [`Key::global`] | one bucket for everyone | never |
//! | [`Key::custom`] | your [`KeyExtractor`](crate::key::KeyExtractor) | [`MissingKey`](crate::policy::MissingKey) |
//!
//! Forwarding headers (`X-Forwarded-For`, `Forwarded`, `X-Real-IP`) are believed only from peers in
//! the trusted-proxy list of [`ClientIp`](crate::client_ip::ClientIp), and then the rightmost address that is not a trusted proxy
//! is the client.
//!
//! [axum]: https://docs.rs/axum
//! [tower]: https://docs.rs/tower
#![warn(missing_docs)]
// docs.rs builds with `--cfg docsrs`: every item a feature gates shows the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod alert;
pub mod client_ip;
pub mod concurrency;
#[cfg(feature = "config")]
pub mod config;
pub mod decision;
pub mod extract;
pub mod fair;
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
pub mod grpc;
pub mod guide;
pub mod headers;
pub mod key;
pub mod layer;
mod limiter;
pub mod meter;
pub mod operate;
pub mod outbound;
pub mod policy;
pub mod quota;
mod rate_limiter;
pub mod response;
mod run_time_overrides;
pub mod store;

pub use decision::Decision;
pub use extract::{LimitPolicy, LimitStore, Limited};
pub use key::{Key, UserId};
pub use layer::RateLimitLayer;
pub use policy::{Algorithm, Mode, OnStoreError, Policy, PolicyBuilder, PolicyError, Rule};
pub use quota::Quota;
pub use rate_limiter::{Admitted, Permit, RateLimiter, Refused};
#[cfg(feature = "redis")]
pub use store::RedisStore;
pub use store::{MemoryStore, Store, StoreError};

#[cfg(feature = "macros")]
pub use tower_redis_ratelimit_macros::LimitPolicy;

// The README's examples are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// What `#[derive(LimitPolicy)]` expands to refers to; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use http::{HeaderName, StatusCode};
}
