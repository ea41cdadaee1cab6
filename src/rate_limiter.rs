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

use crate::decision::Decision;
use crate::limiter::{Admission, Limiter, Price, Refusal, Resolved};
use crate::meter::Reservation;
use crate::operate::OperatorError;
use crate::policy::{Policy, PolicyError};
use crate::response::Protocol;
use crate::store::{Store, StoreError};

/// A policy's limits, called from code for an identity the code names. Cheap to clone: clones
/// share one limiter. Two `RateLimiter`s of policies of the same name on one store share their
/// counts, as two app instances do.
///
/// The identity is the app's, stored as the policy's [`Key`](crate::Key) stores the value it
/// reads from a request, so a layer and a handle of one policy given the same value share one
/// bucket:
///
/// | the policy's key | the handle's identity is stored as |
/// |---|---|
/// | `Key::header`, `Key::query` | its hash (`header#…`, `query#…`), in keys, logs and the top refused alike: never the value |
/// | `Key::user`, `Key::user_from_fn` | `user:` and the id, verbatim when it is at most 64 bytes of letters, digits and `-._~@+=!*(),/`, else its hash |
/// | `Key::ip` (the default) | an IP address as the layer stores a client's (grouped by the policy's `client_ip` prefixes, an IPv6 address by its /64) |
/// | `Key::global` | the one global bucket, whatever the identity |
///
/// An identity the key can't read (a name, such as a username, given to a policy keyed by
/// client IP) and any identity under a `Key::custom` key (only its extractor knows how it stores
/// a value) is stored as it is, verbatim when short and plain as above, else as its hash, and
/// never refused for its form. So to keep a phone number or an email out of keys and logs,
/// key the policy by a header (`Key::header("x-phone")`): the handle then stores its hash. No
/// identity can break the key layout or grow a key without bound. A route-scoped policy's
/// handle names no route: it counts apart from the layer's routes, in one bucket per identity.
/// An override applies by the identity as stored; a daily quota counts it as the quota's key
/// stores it, in its default tier.
#[derive(Clone)]
pub struct RateLimiter {
    pub(crate) limiter: Arc<Limiter>,
}

impl RateLimiter {
    /// Limits by `policy`, counting in `store`.
    ///
    /// # Panics
    ///
    /// When the store can't take the policy, as [`RateLimiter::try_new`] reports (on Redis
    /// Cluster, a quota keyed apart from the policy's rules; a store lacking an ability the
    /// policy needs).
    pub fn new(policy: Policy, store: impl Store) -> Self {
        RateLimiter::try_new(policy, store).unwrap_or_else(|error| panic!("{error}"))
    }

    /// Limits by `policy`, counting in `store`, or says why the store can't take the policy.
    ///
    /// # Errors
    ///
    /// [`PolicyError::QuotaKeyedApart`] when the store needs every key of a check in one Redis
    /// Cluster slot and the policy's quota is keyed apart from its rules;
    /// [`PolicyError::InvalidOption`] naming the option (`count_only`, `meter`, `prefetch`,
    /// `max_in_flight`) when the store lacks an ability it needs ([`Store::abilities`]).
    pub fn try_new(policy: Policy, store: impl Store) -> Result<Self, PolicyError> {
        Ok(RateLimiter {
            limiter: Arc::new(Limiter::try_new(policy, Arc::new(store))?),
        })
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        self.limiter.policy()
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
        // (A handle can't see the response: its caller refunds what doesn't count.)
        let admission = self.decide(identity, Price::new(cost, 1)).await?;
        Ok(Admitted { admission })
    }

    /// The limiter's decision for `identity` at `price`.
    async fn decide(&self, identity: &str, price: Price) -> Result<Admission, Refused> {
        match self.limiter.decide_named(identity, price).outcome().await {
            Resolved::Admitted(admission) => Ok(admission),
            Resolved::Answered(answered) => {
                let (limiter, refusal) = answered.into_refusal();
                Err(Refused { limiter, refusal })
            }
        }
    }

    /// Reserves `estimate` metered units for `identity` ([`Meter`](crate::meter::Meter)), with a
    /// check of cost 1 against the rules that count requests: every rule admits, and all are
    /// charged, or nothing is. Settle the reservation with what the work really used
    /// ([`Reservation::settle`]); one dropped without settling stands. An estimate above what a
    /// metered rule holds reserves that much. Under a policy without a meter it is a check whose
    /// settle changes nothing.
    ///
    /// ```
    /// use tower_redis_ratelimit::meter::Meter;
    /// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimiter, Rule};
    ///
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let policy = Policy::builder("llm-jobs")
    ///     .rule(Rule::per_hour(10_000).metered())
    ///     .meter(Meter::new("tokens"))
    ///     .build()
    ///     .unwrap();
    /// let limiter = RateLimiter::new(policy, MemoryStore::new());
    /// let reservation = limiter.reserve("tenant-7", 500).await.unwrap();
    /// // The job ran and used 120 tokens: 380 go back.
    /// let after = reservation.settle(120).await.unwrap();
    /// assert_eq!(after.rules[0].remaining, 9_880);
    /// # });
    /// ```
    ///
    /// # Errors
    ///
    /// As [`RateLimiter::check_n`].
    pub async fn reserve(&self, identity: &str, estimate: u64) -> Result<Reservation, Refused> {
        let price = Price::new(1, estimate);
        let admission = self.decide(identity, price).await?;
        Ok(Reservation::new(admission))
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

    /// An operator's override: gives back `cost` units of `identity` in the *current* windows
    /// of every rule and in the day's quota (not the duplicate guard, a block or a concurrency
    /// slot): a fixed window's or sliding counter's current count goes down, a token bucket
    /// refills, a sliding log drops its newest units. Never below zero. Answers what
    /// [`RateLimiter::peek`] then finds. Another instance may answer a refusal it cached for the
    /// identity for up to a second more.
    ///
    /// It can't know which admission the units were charged by: units charged in a window that
    /// has rolled since come out of the current one, so a refund can let a window pass its
    /// limit (three admitted before a roll, three after, a refund of the first three: six in
    /// one window). To give back one admission's units, where they were charged and nowhere
    /// else, use its receipt: [`Admitted::refund`].
    ///
    /// # Errors
    ///
    /// The store's error ([`StoreError::Config`] for an empty identity).
    pub async fn refund(&self, identity: &str, cost: u64) -> Result<Decision, StoreError> {
        self.limiter.refund_named(identity, cost).await
    }

    /// Gives back the units this handle took ahead ([`PolicyBuilder::prefetch`]) and didn't
    /// spend, and waits for the store: call it when the instance shuts down, so that others
    /// can use them. Each take's units go back where it charged them: a fixed window's or
    /// sliding counter's only while their window lasts, a token bucket's only as far as time has
    /// not refilled the bucket already.
    ///
    /// [`PolicyBuilder::prefetch`]: crate::PolicyBuilder::prefetch
    pub async fn give_back_prefetched(&self) {
        crate::limiter::give_back_unspent(&self.limiter).await;
    }

    /// Forgets `identity`'s counts and lifts its penalty block, on every instance sharing the
    /// store (a refusal another instance cached stands at most a second more). Units taken ahead
    /// of it ([`PolicyBuilder::prefetch`](crate::PolicyBuilder::prefetch)) go too: here at once,
    /// on other instances when the store's notice reaches them (see `prefetch` for the bound).
    ///
    /// # Errors
    ///
    /// [`OperatorError::BadIdentity`] for an empty identity, or the store's error.
    pub async fn reset(&self, identity: &str) -> Result<(), OperatorError> {
        if identity.is_empty() {
            return Err(OperatorError::BadIdentity(String::new()));
        }
        let key = self.limiter.policy().named_key(identity);
        self.limiter.reset_key(&key).await
    }
}

impl fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimiter")
            .field("policy", &self.limiter.policy().name())
            .finish_non_exhaustive()
    }
}

/// An admission by a [`RateLimiter`]: return it with the response (`(admitted, body)`) to send
/// the `RateLimit-Policy` and `RateLimit` headers the layer would. Under a policy with a
/// concurrency limit it holds the slot until it is dropped (or turned into response parts).
pub struct Admitted {
    /// Its headers, slot, decision, and what was charged and where (the receipt
    /// [`Admitted::refund`] gives back by).
    admission: Admission,
}

impl Admitted {
    /// The store's decision: the state of every rule after this admission. `None` when no limit
    /// was checked (an `unlimited` override) or the store failed and the policy let it through.
    pub fn decision(&self) -> Option<&Decision> {
        self.admission.decision()
    }

    /// Gives back exactly what this admission charged, to the windows it charged (every rule's
    /// and the day's quota's), and waits for the store: a receipt, for work that turned out not
    /// to count (the SMS that could not be sent, the login that failed for a reason of yours).
    /// A window that has rolled since gets nothing (its units went with it); a sliding log drops
    /// this admission's own units, not the newest; a token bucket gets back only what time has
    /// not repaid yet. So, unlike [`RateLimiter::refund`], no window ever passes its limit by
    /// it. A concurrency slot this admission holds is released as when it is dropped.
    ///
    /// Answers what [`RateLimiter::peek`] then finds. An admission that charged nothing (an
    /// `unlimited` override, a store failure let through) gives nothing back and answers an
    /// admitting decision without rules.
    ///
    /// ```
    /// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimiter, Rule};
    ///
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let otp = Policy::builder("otp").rule(Rule::per_hour(3)).build().unwrap();
    /// let limiter = RateLimiter::new(otp, MemoryStore::new());
    /// let admitted = limiter.check("+15550100").await.unwrap();
    /// // The SMS gateway failed: the code was never sent, so it doesn't count.
    /// let after = admitted.refund().await.unwrap();
    /// assert_eq!(after.rules[0].remaining, 3);
    /// # });
    /// ```
    ///
    /// # Errors
    ///
    /// The store's error; the units then stay charged (on the safe side).
    pub async fn refund(self) -> Result<Decision, StoreError> {
        self.admission.refund().await
    }
}

impl fmt::Debug for Admitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admitted")
            .field("decision", &self.admission.decision())
            .field("holds_slot", &self.admission.holds_slot())
            .finish()
    }
}

impl IntoResponseParts for Admitted {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Self::Error> {
        let mut admission = self.admission;
        admission.apply_headers(parts.headers_mut());
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
        self.admitted.admission.holds_slot()
    }

    /// Releases the slot now and waits until the store has freed it, so that the next
    /// [`RateLimiter::acquire`] anywhere finds it free. (Dropping the permit releases it too,
    /// without waiting.)
    ///
    /// # Errors
    ///
    /// The store's error; the slot then frees when its lease ends.
    pub async fn release(mut self) -> Result<(), StoreError> {
        self.admitted.admission.release_slot().await
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
    /// The response's status: 429 when rate limited, 413 for a cost no rule admits, 403 for a
    /// `deny` override, 503 when the store failed under a fail-closed policy, 400 for an empty
    /// identity, 500 for a cost of 0.
    pub fn status(&self) -> StatusCode {
        self.refusal.status()
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
        let grpc = Protocol::Grpc(Box::new(HeaderValue::from_static("application/grpc")));
        self.refusal.respond_in(&self.limiter, &grpc)
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> axum::response::Response {
        self.refusal.respond_in(&self.limiter, &Protocol::Http)
    }
}

impl fmt::Debug for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refused")
            .field("policy", &self.limiter.policy().name())
            .field("refusal", &self.refusal)
            .finish()
    }
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.refusal.describe(self.limiter.policy().name(), f)
    }
}

impl std::error::Error for Refused {}
