//! [`RateLimiter`]: a policy's limits called from code, for an identity the code computed (a
//! phone number from a JSON body, a username from a form, a user id in a job), with the same
//! limiter a [`RateLimitLayer`](crate::RateLimitLayer) runs: the prefix, overrides, quota,
//! refusal cache, group commit, metrics, logs and `on_store_error`, and the same answers byte for
//! byte.
//!
//! ```
//! use axum::extract::{Json, State};
//! use axum::{Router, routing::post};
//! use tower_redis_ratelimit::{Admitted, MemoryStore, Policy, RateLimiter, Refused, Rule};
//!
//! #[derive(serde::Deserialize)]
//! struct OtpRequest {
//!     phone: String,
//! }
//!
//! async fn send_otp(
//!     State(limiter): State<RateLimiter>,
//!     Json(request): Json<OtpRequest>,
//! ) -> Result<(Admitted, &'static str), Refused> {
//!     // A refusal is the 429 the layer would send: Retry-After, RateLimit headers, problem body.
//!     let admitted = limiter.check(&request.phone).await?;
//!     Ok((admitted, "code sent"))
//! }
//!
//! let otp = Policy::builder("otp").rule(Rule::per_hour(3)).build().unwrap();
//! let app: Router = Router::new()
//!     .route("/otp", post(send_otp))
//!     .with_state(RateLimiter::new(otp, MemoryStore::new()));
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, IntoResponseParts, ResponseParts};
use http::{HeaderValue, Response, StatusCode};

use crate::concurrency::Lease;
use crate::decision::{Decision, ceil_secs};
use crate::limiter::{Admission, Limiter, Prepared, Refusal, Verdict};
use crate::operate::OperatorError;
use crate::policy::{Policy, PolicyError};
use crate::response::{LimitHeaders, Protocol};
use crate::store::{Store, StoreError};

/// A policy's limits, called from code for an identity the code names. Cheap to clone: clones
/// share one limiter. Two `RateLimiter`s of policies of the same name on one store share their
/// counts, as two app instances do.
///
/// The identity is the app's: the policy's [`Key`](crate::Key) and
/// [`Scope`](crate::Scope) are not used. It is stored under the policy's prefix and name as the
/// layer stores a header's value: verbatim when it is at most 64 bytes of letters, digits and
/// `-._~@+=!*(),/` (a phone number, a username), else as a hash, so no identity can break the key
/// layout or grow a key without bound. An override applies by that identity; a daily quota counts
/// it in its default tier.
#[derive(Clone)]
pub struct RateLimiter {
    limiter: Arc<Limiter>,
}

impl RateLimiter {
    /// Limits by `policy`, counting in `store`.
    ///
    /// # Panics
    ///
    /// When the store can't take the policy's keys in one call, as [`RateLimiter::try_new`]
    /// reports (on Redis Cluster, a quota keyed apart from the policy's rules).
    pub fn new(policy: Policy, store: impl Store) -> Self {
        RateLimiter::try_new(policy, store).unwrap_or_else(|error| panic!("{error}"))
    }

    /// Limits by `policy`, counting in `store`, or says why the store can't take the policy.
    ///
    /// # Errors
    ///
    /// [`PolicyError::QuotaKeyedApart`] when the store needs every key of a check in one Redis
    /// Cluster slot and the policy's quota is keyed apart from its rules.
    pub fn try_new(policy: Policy, store: impl Store) -> Result<Self, PolicyError> {
        Ok(RateLimiter {
            limiter: Arc::new(Limiter::try_new(policy, Arc::new(store))?),
        })
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.limiter.policy
    }

    /// Checks one unit for `identity`: [`RateLimiter::check_n`] of 1.
    ///
    /// # Errors
    ///
    /// See [`RateLimiter::check_n`].
    pub async fn check(&self, identity: &str) -> Result<Admitted, Refused> {
        self.check_n(identity, 1).await
    }

    /// Checks `cost` units for `identity`: either every rule admits them and all are charged, or
    /// nothing is. In delay mode it waits for its reserved time first. Under a fail-open policy
    /// a store failure admits, without headers.
    ///
    /// # Errors
    ///
    /// A [`Refused`]: rate limited (429), a cost no rule could ever admit (413), a `deny`
    /// override (403), the store failed under a fail-closed policy (503), an empty identity (400)
    /// or a cost of 0 (500: it counts nothing, which is the app's mistake).
    pub async fn check_n(&self, identity: &str, cost: u64) -> Result<Admitted, Refused> {
        let limiter = &self.limiter;
        let (limiter, checked) = match limiter.prepare_identity(identity, cost).after_units().await
        {
            Prepared::Check(checked) => (limiter.clone(), checked),
            Prepared::CheckBy(own, checked) => (own, checked),
            Prepared::Unlimited => return Ok(Admitted::unlimited()),
            Prepared::Admit(admission) => return Ok(Admitted::from(admission)),
            Prepared::Respond(answer) => return Err(Refused::new(limiter.clone(), answer.refusal)),
            Prepared::AwaitUnits(_) => unreachable!("a request waits for units in flight once"),
            Prepared::RespondBy(own, answer) => return Err(Refused::new(own, answer.refusal)),
        };
        // (A handle can't see the response: its caller refunds what doesn't count.)
        match limiter.clone().decide(checked).await {
            Verdict::Admit(admission) => Ok(Admitted::from(admission)),
            Verdict::Delay(delay, admission) => {
                tokio::time::sleep(delay).await;
                Ok(Admitted::from(admission))
            }
            Verdict::Respond(answer) => Err(Refused::new(limiter, answer.refusal)),
            Verdict::AwaitSlot | Verdict::Retake => {
                unreachable!("Limiter::decide waits for the slot and asks again")
            }
        }
    }

    /// Takes one of the policy's concurrency slots for `identity` ([`PolicyBuilder::max_in_flight`]),
    /// with a check of cost 1 against its rules: a job or a worker that must not run twice at
    /// once for one user, across every instance sharing the store. The slot is held until the
    /// [`Permit`] is dropped (released in the background, as the layer releases a request's), or
    /// [`Permit::release`]d, or its lease ends (the holder crashed). In delay mode it waits for a
    /// slot up to `max_delay`. Under a policy without `max_in_flight` it is a check whose permit
    /// holds no slot.
    ///
    /// [`PolicyBuilder::max_in_flight`]: crate::PolicyBuilder::max_in_flight
    ///
    /// # Errors
    ///
    /// As [`RateLimiter::check`]: a 429 when every slot is held (or a rule refuses), with the
    /// time until the earliest lease ends.
    pub async fn acquire(&self, identity: &str) -> Result<Permit, Refused> {
        let admitted = self.check(identity).await?;
        Ok(Permit { admitted })
    }

    /// What a check of cost 1 for `identity` would find now, charging nothing and writing
    /// nothing (no key created, no expiry moved): each rule's `remaining` now, and whether the
    /// check would be admitted (`allowed`, and each refusing rule's `retry_after`). For a
    /// "3 attempts left" in a form, or to skip work that would be refused.
    ///
    /// # Errors
    ///
    /// The store's error ([`StoreError::Config`] for an empty identity).
    pub async fn peek(&self, identity: &str) -> Result<Decision, StoreError> {
        self.limiter.peek_named(identity).await
    }

    /// Gives back `cost` units charged to `identity` in the current windows of every rule and in
    /// the day's quota (not the duplicate guard, a block or a concurrency slot): a fixed
    /// window's or sliding counter's count goes down, a token bucket refills, a sliding log drops
    /// its newest units. Never below zero; a refund after a window rolled gives nothing back in
    /// it. Answers what [`RateLimiter::peek`] then finds. Another instance may answer a refusal
    /// it cached for the identity for up to a second more.
    ///
    /// For the OTP whose second rule refused: give back what the first one charged. A refund
    /// undoes any charge, so give back only what was charged.
    ///
    /// # Errors
    ///
    /// The store's error ([`StoreError::Config`] for an empty identity).
    pub async fn refund(&self, identity: &str, cost: u64) -> Result<Decision, StoreError> {
        self.limiter.refund_named(identity, cost).await
    }

    /// Gives back the units this handle took ahead ([`PolicyBuilder::prefetch`]) and didn't
    /// spend, and waits for the store: call it when the instance shuts down, so that others
    /// can use them. A fixed window's or sliding counter's units come back only while their
    /// window lasts.
    ///
    /// [`PolicyBuilder::prefetch`]: crate::PolicyBuilder::prefetch
    pub async fn give_back_prefetched(&self) {
        self.limiter.give_back_prefetched().await;
    }

    /// Forgets `identity`'s counts and lifts its penalty block, on every instance sharing the
    /// store (a refusal another instance cached stands at most a second more).
    ///
    /// # Errors
    ///
    /// [`OperatorError::BadIdentity`] for an empty identity, or the store's error.
    pub async fn reset(&self, identity: &str) -> Result<(), OperatorError> {
        if identity.is_empty() {
            return Err(OperatorError::BadIdentity(String::new()));
        }
        let key = self.limiter.policy.named_key(identity);
        self.limiter.reset_key(&key).await
    }
}

impl fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimiter")
            .field("policy", &self.limiter.policy.name())
            .finish_non_exhaustive()
    }
}

/// An admission by a [`RateLimiter`]: return it with the response (`(admitted, body)`) to send
/// the `RateLimit-Policy` and `RateLimit` headers the layer would. Under a policy with a
/// concurrency limit it holds the slot until it is dropped (or turned into response parts).
pub struct Admitted {
    /// `None` when no limit was checked (an `unlimited` override) or the store failed open.
    headers: Option<LimitHeaders>,
    lease: Option<Lease>,
    decision: Option<Decision>,
}

impl Admitted {
    fn unlimited() -> Self {
        Admitted::from(Admission::unchecked())
    }

    fn from(admission: Admission) -> Self {
        Admitted {
            headers: admission.headers,
            lease: admission.lease,
            decision: admission.decision,
        }
    }

    /// The store's decision: the state of every rule after this admission. `None` when no limit
    /// was checked (an `unlimited` override) or the store failed and the policy let it through.
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }
}

impl fmt::Debug for Admitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admitted")
            .field("decision", &self.decision)
            .field("holds_slot", &self.lease.is_some())
            .finish()
    }
}

impl IntoResponseParts for Admitted {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Self::Error> {
        if let Some(headers) = self.headers {
            headers.apply(parts.headers_mut());
        }
        Ok(parts)
    }
}

/// A concurrency slot held for an identity ([`RateLimiter::acquire`]): released when dropped,
/// by [`Permit::release`], or when its lease ends.
pub struct Permit {
    admitted: Admitted,
}

impl Permit {
    /// The store's decision when the slot was taken (`None` when the store failed and the policy
    /// let the work through without a slot).
    pub fn decision(&self) -> Option<&Decision> {
        self.admitted.decision()
    }

    /// Whether it holds a slot: not when the policy has no concurrency limit, nor when the store
    /// failed and the policy let the work through.
    pub fn holds_slot(&self) -> bool {
        self.admitted.lease.is_some()
    }

    /// Releases the slot now and waits until the store has freed it, so that the next
    /// [`RateLimiter::acquire`] anywhere finds it free. (Dropping the permit releases it too,
    /// without waiting.)
    ///
    /// # Errors
    ///
    /// The store's error; the slot then frees when its lease ends.
    pub async fn release(mut self) -> Result<(), StoreError> {
        match self.admitted.lease.take() {
            Some(lease) => lease.release().await,
            None => Ok(()),
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("holds_slot", &self.holds_slot())
            .finish()
    }
}

/// A refusal by a [`RateLimiter`], answered exactly as the layer answers it: return it from a
/// handler (it is an [`IntoResponse`] and an [`Error`](std::error::Error), so `?` works).
#[derive(Clone)]
pub struct Refused {
    limiter: Arc<Limiter>,
    refusal: Refusal,
}

impl Refused {
    fn new(limiter: Arc<Limiter>, refusal: Refusal) -> Self {
        Refused { limiter, refusal }
    }

    /// The response's status: 429 when rate limited, 413 for a cost no rule admits, 403 for a
    /// `deny` override, 503 when the store failed under a fail-closed policy, 400 for an empty
    /// identity, 500 for a cost of 0.
    pub fn status(&self) -> StatusCode {
        match &self.refusal {
            Refusal::Limited(_) => StatusCode::TOO_MANY_REQUESTS,
            Refusal::TooCostly { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::Denied => StatusCode::FORBIDDEN,
            Refusal::NoKey(status) => *status,
            Refusal::ZeroCost => StatusCode::INTERNAL_SERVER_ERROR,
            Refusal::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The time until every refusing rule admits the identity, when it was rate limited (the
    /// exact time; `Retry-After` carries it in whole seconds, rounded up).
    pub fn retry_after(&self) -> Option<Duration> {
        self.decision().and_then(Decision::retry_after)
    }

    /// The store's decision, when it was rate limited.
    pub fn decision(&self) -> Option<&Decision> {
        match &self.refusal {
            Refusal::Limited(decision) => Some(decision),
            _ => None,
        }
    }

    /// The answer for a gRPC call: as the layer answers one (`RESOURCE_EXHAUSTED` with
    /// `grpc-retry-pushback-ms`, `UNAVAILABLE` for a store failure), trailers-only, in HTTP 200.
    pub fn grpc_response(&self) -> Response<Body> {
        let grpc = Protocol::Grpc(HeaderValue::from_static("application/grpc"));
        self.limiter.respond_in(&self.refusal, &grpc)
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> axum::response::Response {
        self.limiter.respond_in(&self.refusal, &Protocol::Http)
    }
}

impl fmt::Debug for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refused")
            .field("policy", &self.limiter.policy.name())
            .field("refusal", &self.refusal)
            .finish()
    }
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let policy = self.limiter.policy.name();
        match &self.refusal {
            Refusal::Limited(decision) => {
                let wait = ceil_secs(decision.retry_after().unwrap_or_default()).max(1);
                write!(f, "rate limited by policy {policy:?}: retry in {wait} s")
            }
            Refusal::TooCostly { cost, at_most, .. } => write!(
                f,
                "a cost of {cost} is more than policy {policy:?} ever admits at once ({at_most})"
            ),
            Refusal::Denied => write!(f, "denied by an override of policy {policy:?}"),
            Refusal::NoKey(_) => write!(f, "no identity to rate-limit by under policy {policy:?}"),
            Refusal::ZeroCost => write!(
                f,
                "a check of cost 0 under policy {policy:?}: it counts nothing"
            ),
            Refusal::StoreUnavailable => {
                write!(
                    f,
                    "policy {policy:?} fails closed and its store is unavailable"
                )
            }
        }
    }
}

impl std::error::Error for Refused {}
