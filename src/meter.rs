//! Metered limits: tokens (or bytes, or money) reserved when a request is admitted and settled
//! after its response, streamed bodies included.
//!
//! An LLM gateway limits the tokens a caller uses beside its requests, and a call's tokens are
//! known only once it has run, often only at the end of a streamed answer. A policy's
//! [`Rule::metered`](crate::Rule::metered) rules (and a [metered](crate::quota::QuotaBuilder::metered)
//! daily quota) count its [`Meter`]'s units; its other rules count requests, and all are checked
//! together, all or nothing, in one store call:
//!
//! 1. **Reserve.** A request is admitted only if every metered rule has room for its
//!    [estimate](Meter::estimate) (an [`Estimate`] extension wins), and reserves it.
//! 2. **Record.** The handler, or a stream as it ends, records what it used with [`Usage`]; or
//!    the response reports it in the meter's [usage header](Meter::usage_header).
//! 3. **Settle.** When the response's body has ended (or been dropped: the client left) and
//!    the last clone of its `Usage` is gone, the layer settles. Used less than reserved: the
//!    rest goes back to the windows the admission charged. Used more: the difference is charged
//!    on top, to the current windows, past the limit if need be (debt): later requests are
//!    refused, with an honest `Retry-After`, until the windows have room again. Nothing
//!    recorded means the reservation stands. A refused request reserves nothing.
//!
//! **The bound.** Admissions happen only while every metered rule has room for the estimate,
//! so a window is passed by at most what the requests in flight used beyond their estimates,
//! each counted at most up to [`Meter::max_usage`]. With 40 000 tokens a minute, 500 reserved
//! per request and 10 requests in flight that each use 2 500, the minute can end at
//! 40 000 + 10 × 2 000 = 60 000, and the next requests wait until it has room again.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use tower_redis_ratelimit::meter::{Meter, Usage};
//! use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, Rule};
//!
//! async fn complete(usage: Usage) -> &'static str {
//!     usage.record(420); // what the model reported
//!     "…"
//! }
//!
//! let policy = Policy::builder("llm")
//!     .key(Key::header("x-api-key"))
//!     .rule(Rule::per_minute(60))
//!     .rule(Rule::per_minute(40_000).metered())
//!     .meter(Meter::new("tokens").estimate(|_| 500))
//!     .build()
//!     .unwrap();
//! let app: Router = Router::new()
//!     .route("/v1/chat/completions", post(complete))
//!     .layer(RateLimitLayer::new(policy, MemoryStore::new()));
//! ```
//!
//! **Input and output tokens.** One meter per policy: to limit two units on one route (prompt
//! and completion tokens), layer two policies, each with its own meter, and record each with
//! [`Usage::record_unit`].
//!
//! **With other options.** Under `count_only`, a response that doesn't count settles to zero.
//! Delay mode, shadow mode, overrides and tiers work as they do for requests. `prefetch` is
//! refused with a meter when the policy is built: units taken ahead are whole requests'. From
//! code, [`RateLimiter::reserve`](crate::RateLimiter::reserve) reserves and
//! [`Reservation::settle`] settles.

pub use crate::limiter::metered::Usage;
pub use crate::policy::meter::{Estimate, Meter};

use std::fmt;

use crate::decision::Decision;
use crate::limiter::Admission;
use crate::store::StoreError;

/// Metered units reserved for an identity ([`RateLimiter::reserve`](crate::RateLimiter::reserve)), settled with what the
/// work used ([`Reservation::settle`]). Dropped without settling, the reservation stands.
pub struct Reservation {
    admission: Admission,
}

impl Reservation {
    pub(crate) fn new(admission: Admission) -> Self {
        Reservation { admission }
    }

    /// The store's decision when the units were reserved.
    pub fn decision(&self) -> Option<&Decision> {
        self.admission.decision()
    }

    /// Settles the reservation at `used` units, and waits for the store: what was reserved and
    /// not used goes back to the windows the reservation charged; what was used beyond it is
    /// charged on top, to the current windows, past the limit if need be (at most the meter's
    /// `max_usage` counts). Answers what a check of one unit would then find.
    ///
    /// # Errors
    ///
    /// The store's error; the reservation then stands.
    pub async fn settle(self, used: u64) -> Result<Decision, StoreError> {
        self.admission.settle_usage(used).await
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("decision", &self.admission.decision())
            .finish()
    }
}
