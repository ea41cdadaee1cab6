//! Limiting on the way out: an HTTP client (any tower `Service<http::Request<B>>`) that keeps every
//! instance's calls to a third-party API under its limit, together.
//!
//! Each request asks the store for a slot under the policy's rules, keyed by upstream (the URI's
//! authority, or [`OutboundLayer::key_from_fn`]). The store *reserves* the first slot that fits,
//! as [`Mode::Delay`](crate::Mode::Delay) does, so concurrent callers on every instance are spaced
//! out in the order they asked and none overshoots; the request then waits until its slot and is
//! sent. A request whose slot is further away than [`OutboundLayer::max_wait`] is not sent: it
//! fails at once with [`OutboundError::WouldWait`], which says when to try again.
//!
//! The upstream's own word counts too: when an answer carries `Retry-After` (on a 429 or 503),
//! an IETF `RateLimit` item with `r=0`, `X-RateLimit-Remaining: 0` with a reset, or is a gRPC
//! `RESOURCE_EXHAUSTED` with a pushback or a `RetryInfo` ([`announced_pause`]; the layer wraps a
//! tonic `Channel` as it wraps any HTTP client), the upstream's key is paused in the store until then (at most
//! [`OutboundLayer::pause_cap`]), so every instance holds its requests, not only the one that was
//! told. A request that finds its upstream paused waits for the pause's end and then for a slot,
//! within its maximum wait.
//!
//! That holds for the requests already waiting for their slots too. Before it is sent, a request
//! that waited checks whether its upstream was paused meanwhile, here or on another instance; if
//! so it gives up its slot, waits for the pause's end and takes a new slot after it, behind the
//! others. So the upstream sees nothing during a pause, and no more than the limit in any window
//! after it. The slots given up still count in their windows, as if used: that errs on the safe
//! side, and delays the first requests after a pause by a rule's period at most. A request whose
//! pause and new slot would take it past its maximum wait fails with [`OutboundError::WouldWait`],
//! as one whose slot is too far does.
//!
//! What seeing pauses costs, in store calls per request:
//! - a request sent at once (its check found a slot free now): nothing beyond its check, which
//!   sees a pause in the same call;
//! - a request that waited for its slot: one read ([`Store::pause_left`]; on Redis an `EVALSHA`
//!   of a `PTTL`) just before it is sent, paused or not; none when this instance learnt the pause
//!   itself (it keeps the pauses it learns at hand, so the instance that was told asks nothing);
//! - a request that meets a pause: one more check after the pause's end (and one more read if
//!   its new slot is later still); one that starts while this instance knows of a pause waits
//!   for its end before its first check, without asking the store;
//! - an answer that announces a pause: one call to store it ([`Store::pause`]).
//!
//! With the `reqwest-middleware` feature the layer is also a `reqwest_middleware::Middleware`, for
//! `reqwest` clients (see its impl below [`OutboundLayer`]).
//!
//! A call the upstream refused may be sent again at once: the layer has stored the pause, and the
//! new call waits it out in the layer, as every instance's calls do. [`ObeyRetryAfter`] retries 429s
//! and 503s that way, as a `tower::retry` policy and, with `reqwest-middleware`, as a middleware.
//!
//! A request arrives upstream a little after the instant it was counted (the store's answer, the
//! timer, the network), and not always by the same amount, so an upstream counting arrivals could
//! see a window a hair short. Each rule's period is counted longer by a safety margin
//! ([`OutboundLayer::margin`], 20 ms by default) to absorb that.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::time::Duration;
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_redis_ratelimit::outbound::OutboundLayer;
//! use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Rule};
//!
//! let policy = Policy::builder("partner-api")
//!     .algorithm(Algorithm::SlidingLog)
//!     .rule(Rule::per_second(5))
//!     .build()
//!     .unwrap();
//! // Your HTTP client here (hyper-util's, or a reqwest call in a `service_fn`).
//! let client = service_fn(|_request: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("ok")))
//! });
//! let mut client = ServiceBuilder::new()
//!     .layer(OutboundLayer::new(policy, MemoryStore::new()).max_wait(Duration::from_secs(10)))
//!     .service(client);
//! let request = http::Request::get("https://api.example.com/v1/quote").body(String::new()).unwrap();
//! let response = client.ready().await.unwrap().call(request).await.unwrap();
//! assert_eq!(response.into_body(), "ok");
//! # }
//! ```
//!
//! ## Metered calls: LLM APIs
//!
//! An API that limits tokens as well as requests (OpenAI's and Anthropic's do) is mirrored by a
//! policy with a [metered](crate::Rule::metered) rule and a [`Meter`](crate::meter::Meter). A call
//! then reserves its estimate (a [`meter::Estimate`](crate::meter::Estimate) in the request's
//! extensions, else the meter's function) before it is sent, and only when every rule has room for
//! it now: a call that finds none reserves nothing ahead (a reservation ahead at the estimate would
//! hold room its settle may give back), but keeps its place: it leaves a claim in the store, and
//! calls that ask after it, on every instance, see the room less the units it waits for, so a
//! large call is not starved by small ones that keep taking the room it waits for. It sleeps the
//! store's `retry_after`, or until a call on this instance settles, and asks again, within the
//! maximum wait; a call needing `k` units of a limit of `L` per period waits about `k / L`
//! periods plus what the calls ahead of it need. Its claim goes when it is sent, gives up or is
//! dropped (or, at the latest, when its maximum wait ends). Its answer carries a
//! [`meter::Usage`](crate::meter::Usage) in its extensions: record the units the body reports, and
//! the call settles when the response and the last clone of its `Usage` are dropped, as a
//! [metered route's](crate::meter) does: less than reserved goes back, more is charged on top.
//! Nothing recorded leaves the estimate standing, as does a call sent without an answer (a
//! transport error, a timeout). An answer of 429 or 503 settles to nothing, and a call not sent
//! ([`OutboundError`]) reserved nothing. The meter's
//! [usage header](crate::meter::Meter::usage_header), if the upstream sends one, is read as the
//! answer comes.
//!
//! The vendors' headers say what is left (OpenAI's `x-ratelimit-remaining-{requests,tokens}`
//! with their `-reset-` and `-limit-`, Anthropic's `anthropic-ratelimit-{requests,tokens}-*`).
//! A call that needs more than the last answer to this instance said was left, less what this
//! instance sent since, waits for the missing units to come back. The buckets refill
//! continuously, from what was left to the limit in the reset, so that is
//! `reset × missing / (limit − remaining)` (all of the reset without a limit), never longer than
//! the reset nor [`pause_cap`](OutboundLayer::pause_cap). A vendor announcing a limit below the
//! policy's (its rule whose period is nearest a minute, metered for tokens) is said once, at
//! WARN.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_redis_ratelimit::meter::{Estimate, Meter, Usage};
//! use tower_redis_ratelimit::outbound::OutboundLayer;
//! use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Rule};
//!
//! // The account's limits, as the vendor's console shows them: 500 requests and 30 000 tokens
//! // a minute.
//! let policy = Policy::builder("openai")
//!     .algorithm(Algorithm::SlidingLog)
//!     .rule(Rule::per_minute(500))
//!     .rule(Rule::per_minute(30_000).metered())
//!     .meter(Meter::new("tokens"))
//!     .build()
//!     .unwrap();
//! let api = service_fn(|_request: http::Request<String>| async {
//!     let body = r#"{"usage":{"prompt_tokens":12,"completion_tokens":230,"total_tokens":242}}"#;
//!     Ok::<_, std::convert::Infallible>(http::Response::new(body.to_owned()))
//! });
//! let mut client = ServiceBuilder::new()
//!     .layer(OutboundLayer::new(policy, MemoryStore::new()))
//!     .service(api);
//! let mut request = http::Request::post("https://api.openai.com/v1/chat/completions")
//!     .body(r#"{"max_tokens":1000,"messages":[]}"#.to_owned())
//!     .unwrap();
//! // Its prompt and every token it may write.
//! request.extensions_mut().insert(Estimate(12 + 1_000));
//! let response = client.ready().await.unwrap().call(request).await.unwrap();
//! // No `Usage` if nothing was reserved: a store failure under `OnStoreError::Allow`.
//! if let Some(usage) = response.extensions().get::<Usage>() {
//!     let body: serde_json::Value = serde_json::from_str(response.body()).unwrap();
//!     usage.record(body["usage"]["total_tokens"].as_u64().unwrap());
//! }
//! drop(response); // settled: 1 012 reserved, 242 used, 770 back
//! # }
//! ```
//!
//! ## Even spacing or bursts
//!
//! The algorithm decides how calls are spread within the limit. A
//! [`SlidingLog`](crate::Algorithm::SlidingLog) rule of 5 a second sends the first five calls at
//! once, then waits for the oldest to leave the window: bursts of five, a second apart. An upstream
//! that counts over a shorter window than its documented one (many do) may refuse such a burst.
//! A [`TokenBucket`](crate::Algorithm::TokenBucket) rule with `burst(1)` holds one call's worth
//! of tokens, refilled every `period / limit`, so calls leave evenly spaced, never two closer than
//! that:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::time::{Duration, Instant};
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_redis_ratelimit::outbound::OutboundLayer;
//! use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Rule};
//!
//! let policy = Policy::builder("partner-api")
//!     .algorithm(Algorithm::TokenBucket)
//!     .rule(Rule::per_second(10).burst(1)) // one call every 100 ms, never two at once
//!     .build()
//!     .unwrap();
//! let client = service_fn(|_request: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(Instant::now()))
//! });
//! let mut client = ServiceBuilder::new()
//!     .layer(OutboundLayer::new(policy, MemoryStore::new()))
//!     .service(client);
//! let mut sent = Vec::new();
//! for _ in 0..4 {
//!     let request = http::Request::get("https://api.example.com/v1/quote").body(String::new()).unwrap();
//!     sent.push(client.ready().await.unwrap().call(request).await.unwrap().into_body());
//! }
//! for pair in sent.windows(2) {
//!     assert!(pair[1] - pair[0] >= Duration::from_millis(95)); // evenly spaced, not a burst
//! }
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Request, Response, StatusCode, Uri};
use tokio::time::Instant;
use tower::{BoxError, Layer, Service};

use crate::limiter::Limiter;
use crate::limiter::caller::Caller;
use crate::limiter::metered::{Reserved, Tab, Usage};
use crate::limiter::outgoing::{self, NotSent, Upstream};
use crate::policy::{KeyLookup, Policy, PolicyError, StorageKey, is_storable_identity};
use crate::store::{Store, StoreError};

mod announced;
#[cfg(feature = "reqwest-middleware")]
mod middleware;
mod pause;
mod retry;
mod vendor;

use announced::Announced;
use pause::LocalPauses;
pub use pause::announced_pause;
pub use retry::ObeyRetryAfter;

/// How long a request may wait for its slot by default.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(30);

/// How much longer each rule's period is counted by default (see the module documentation).
pub const DEFAULT_MARGIN: Duration = Duration::from_millis(20);

/// The longest pause an upstream's headers can set by default.
pub const DEFAULT_PAUSE_CAP: Duration = Duration::from_secs(600);

/// The block every outbound check carries, so that it sees a pause; what a refusal past the
/// maximum wait starts is this short.
const SEES_PAUSES: Option<Duration> = Some(Duration::from_millis(1));

type KeyFn = dyn Fn(&Uri, &HeaderMap) -> String + Send + Sync;

/// Why an outbound request was not sent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboundError {
    /// Its slot is further away than the layer's maximum wait: try again after `retry_after`.
    #[error(
        "the rate limit of {upstream:?} has no slot within the maximum wait; retry in {retry_after:?}"
    )]
    WouldWait {
        /// The upstream's key.
        upstream: String,
        /// When a request could be sent, at the earliest (the store's estimate).
        retry_after: Duration,
    },
    /// The key (from the URI or your closure) can't be a store key: empty, too long, or with
    /// braces or control characters.
    #[error("{0:?} can't key an outbound limit")]
    BadKey(String),
    /// The store failed and the policy fails closed
    /// ([`OnStoreError::Deny`](crate::OnStoreError::Deny)).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Limits the requests of an HTTP client service: see the [module documentation](self).
#[derive(Clone)]
pub struct OutboundLayer {
    shared: Arc<Shared>,
}

#[derive(Clone)]
struct Shared {
    policy: Policy,
    store: Arc<dyn Store>,
    /// What counts and decides the calls ([`outgoing`]): the policy with its rules widened by
    /// the margin, in the store; with it the store-failure log (a failing store fails every
    /// request), the metrics, and what settles a metered call's reservation.
    limiter: Arc<Limiter>,
    max_wait: Duration,
    pause_cap: Duration,
    key: Option<Arc<KeyFn>>,
    /// The pauses this instance learnt (shared by the layers built from one, which share the
    /// store too).
    paused: Arc<LocalPauses>,
    /// What the upstreams' last answers to this instance announced is left.
    announced: Arc<Announced>,
}

impl OutboundLayer {
    /// Limits by `policy`, counting in `store` (share a Redis store between instances to share the
    /// limit).
    ///
    /// # Panics
    ///
    /// Where [`OutboundLayer::try_new`] fails (a policy whose algorithm can't reserve a slot), at
    /// the caller's line.
    #[track_caller]
    pub fn new(policy: Policy, store: impl Store) -> Self {
        match OutboundLayer::try_new(policy, store) {
            Ok(layer) => layer,
            Err(error) => panic!("{error}"),
        }
    }

    /// Limits by `policy`, counting in `store`; refuses a policy whose algorithm can't reserve a
    /// slot (only [`SlidingLog`](crate::Algorithm::SlidingLog) and
    /// [`TokenBucket`](crate::Algorithm::TokenBucket) know the exact time a request fits), and a
    /// metered policy on a store that can't give back or overdraw ([`Store::abilities`]: a call
    /// settles after its response).
    pub fn try_new(policy: Policy, store: impl Store) -> Result<Self, PolicyError> {
        if !policy.algorithm().can_reserve() {
            return Err(PolicyError::InvalidOption {
                policy: policy.name().to_owned(),
                option: "algorithm",
                reason: "outbound limiting waits for a reserved slot: it needs the sliding_log or \
                         token_bucket algorithm",
            });
        }
        // A metered call settles after its response (give_back, overdraw); a pause the upstream
        // announces is asked for at run time, and logged if the store can't keep it.
        if policy.meter().is_some() {
            crate::limiter::store_can_do(&policy, &store)?;
        }
        let store: Arc<dyn Store> = Arc::new(store);
        Ok(OutboundLayer {
            shared: Arc::new(Shared {
                limiter: counting(&policy, &store, DEFAULT_MARGIN),
                policy,
                store,
                max_wait: DEFAULT_MAX_WAIT,
                pause_cap: DEFAULT_PAUSE_CAP,
                key: None,
                paused: Arc::default(),
                announced: Arc::default(),
            }),
        })
    }

    /// The longest a request waits for its slot (default 30 s); one whose slot is further away
    /// fails at once with [`OutboundError::WouldWait`].
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        Arc::make_mut(&mut self.shared).max_wait = max_wait;
        self
    }

    /// The longest an upstream's headers can pause its key (default 10 minutes): a malformed or
    /// hostile `Retry-After` of a year stops nobody for longer.
    pub fn pause_cap(mut self, cap: Duration) -> Self {
        Arc::make_mut(&mut self.shared).pause_cap = cap;
        self
    }

    /// How much longer each rule's period is counted than the policy says (default 20 ms), so
    /// that arrivals upstream, a little later and not all equally, still fit the upstream's
    /// windows. Zero counts exactly the policy's periods.
    pub fn margin(mut self, margin: Duration) -> Self {
        let shared = Arc::make_mut(&mut self.shared);
        shared.limiter = counting(&shared.policy, &shared.store, margin);
        self
    }

    /// Keys requests by what `key` returns for their URI and headers (e.g. the API key of ours
    /// they carry) instead of by the URI's authority (or `Host`; for a gRPC call that names
    /// neither, as those through a tonic `Channel` don't, the policy's name: one upstream per
    /// layer).
    pub fn key_from_fn<F>(mut self, key: F) -> Self
    where
        F: Fn(&Uri, &HeaderMap) -> String + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.shared).key = Some(Arc::new(key));
        self
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.shared.policy
    }
}

impl fmt::Debug for OutboundLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundLayer")
            .field("policy", &self.shared.policy.name())
            .field("max_wait", &self.shared.max_wait)
            .field("custom_key", &self.shared.key.is_some())
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for OutboundLayer {
    type Service = Outbound<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Outbound {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The client service made by [`OutboundLayer`].
#[derive(Clone)]
pub struct Outbound<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: fmt::Debug> fmt::Debug for Outbound<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbound")
            .field("inner", &self.inner)
            .field("policy", &self.shared.policy.name())
            .finish_non_exhaustive()
    }
}

/// The future of an [`Outbound`] call.
pub type OutboundFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send + 'static>>;

impl<S, B, T> Service<Request<B>> for Outbound<S>
where
    S: Service<Request<B>, Response = Response<T>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Send + 'static,
    T: Send + 'static,
{
    type Response = Response<T>;
    type Error = BoxError;
    type Future = OutboundFuture<Response<T>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service that was polled ready goes with this request; a fresh clone stays.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let shared = self.shared.clone();
        let upstream = shared.upstream_of(request.uri(), request.headers());
        let (parts, body) = request.into_parts();
        let units = shared.estimate(&parts);
        let caller = shared.caller_of(&parts);
        let request = Request::from_parts(parts, body);
        Box::pin(async move {
            let upstream = upstream?;
            // A metered call's reservation: held until the answer (a call sent without one
            // keeps it), then handed to the response.
            let reservation = shared.admit(&upstream, units, caller).await?;
            let response = match inner.call(request).await {
                Ok(response) => response,
                Err(error) => {
                    let error = error.into();
                    not_sent_if(reservation, error.downcast_ref::<OutboundError>().is_some());
                    return Err(error);
                }
            };
            let (mut parts, body) = response.into_parts();
            let (status, headers) = (parts.status, &parts.headers);
            shared
                .answered(
                    &upstream,
                    reservation,
                    status,
                    headers,
                    &mut parts.extensions,
                )
                .await;
            Ok(Response::from_parts(parts, body))
        })
    }
}

/// What counts an outbound layer's calls: `policy` over periods longer by `margin`, with a block
/// that makes each check see a pause, in `store`.
fn counting(policy: &Policy, store: &Arc<dyn Store>, margin: Duration) -> Arc<Limiter> {
    let policy = policy.counted_outbound(margin, SEES_PAUSES);
    Arc::new(Limiter::outgoing(policy, store.clone()))
}

/// Gives a metered call's reservation back when the call was `not_sent` (an outbound layer
/// inside this one held it back); else it stands (a call sent without an answer).
fn not_sent_if(reservation: Option<Tab>, not_sent: bool) {
    if let Some(tab) = reservation
        && not_sent
    {
        tab.nothing_used();
    }
}

/// Settles a metered call's reservation by its answer: to nothing on a 429 or a 503 (the upstream
/// refused it), else by the meter's usage header, if the upstream sent one; the rest is the
/// caller's, who records what the body says.
fn answered(reserved: &Reserved, status: StatusCode, headers: &HeaderMap) {
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        reserved.nothing_used();
    } else {
        reserved.answered_with(status, headers);
    }
}

impl Shared {
    /// The key of a request's upstream.
    fn upstream_of(&self, uri: &Uri, headers: &HeaderMap) -> Result<String, OutboundError> {
        let key = match &self.key {
            Some(key) => key(uri, headers),
            None => uri
                .authority()
                .map(|authority| authority.as_str().to_ascii_lowercase())
                .or_else(|| {
                    let host = headers.get(http::header::HOST)?.to_str().ok()?;
                    Some(host.to_ascii_lowercase())
                })
                // A tonic `Channel` adds its origin inside, so the calls a layer around it sees
                // name none: they all go to the one upstream the channel was built for, which the
                // policy's name stands for.
                .or_else(|| crate::grpc::is_grpc(headers).then(|| self.policy.name().to_owned()))
                .unwrap_or_default(),
        };
        if is_storable_identity(&key) {
            Ok(key)
        } else {
            Err(OutboundError::BadKey(key))
        }
    }

    /// The store key and identity of `upstream`.
    fn key_of(&self, upstream: &str) -> StorageKey {
        self.policy.unscoped_key_of(&format!("upstream:{upstream}"))
    }

    /// A metered call's estimate (1 without a meter: nothing reads it then).
    fn estimate(&self, parts: &http::request::Parts) -> u64 {
        self.policy.estimate(parts)
    }

    /// Under a budget shared fairly, whose share a call of `parts` is of: its caller, named by
    /// the policy's key on the outgoing request (`-` when it names none), and its weight.
    fn caller_of(&self, parts: &http::request::Parts) -> Option<Caller> {
        let fairness = self.policy.fair_share()?;
        let weight = fairness.fair.weight(parts);
        Some(match self.policy.storage_key(parts) {
            KeyLookup::Found(key) => Caller::new(key.identity(), weight),
            _ => Caller::new("-", weight),
        })
    }

    /// Waits until a call of `units` to `upstream` may go (the one door's admission, for the
    /// tower service and the reqwest middleware alike): `Ok` with a metered call's reservation,
    /// which [`Shared::answered`] hands to the response.
    async fn admit(
        &self,
        upstream: &str,
        units: u64,
        caller: Option<Caller>,
    ) -> Result<Option<Tab>, OutboundError> {
        let key = self.key_of(upstream);
        outgoing::send_when_free(&self.limiter, key, units, self.max_wait, self, caller)
            .await
            .map_err(|not_sent| match not_sent {
                NotSent::WouldWait(retry_after) => OutboundError::WouldWait {
                    upstream: upstream.to_owned(),
                    retry_after,
                },
                NotSent::Store(error) => OutboundError::Store(error),
            })
    }

    /// What follows an answer of `status` and `headers` from `upstream` (both doors): the pause
    /// it announces, stored, and what it says is left, kept; a metered call's `reservation`
    /// handed to the response (`extensions`) and settled by the answer as far as it tells.
    async fn answered(
        &self,
        upstream: &str,
        reservation: Option<Tab>,
        status: StatusCode,
        headers: &HeaderMap,
        extensions: &mut http::Extensions,
    ) {
        self.learn(upstream, status, headers).await;
        if let Some(tab) = reservation {
            let reserved = Usage::of(extensions).hold(tab);
            answered(&reserved, status, headers);
        }
    }

    /// Pauses `upstream` on every instance when its answer announces a pause (at most the cap),
    /// and keeps what the answer announces is left, for this instance's next calls.
    async fn learn(&self, upstream: &str, status: StatusCode, headers: &HeaderMap) {
        let now = SystemTime::now();
        let announcement = vendor::announcement(headers, now);
        if announcement != vendor::Announcement::default() {
            self.announced
                .compare(&self.policy, upstream, &announcement);
            let key = self.key_of(upstream);
            self.announced
                .learn(key.as_str(), announcement, Instant::now(), self.pause_cap);
        }
        if let Some(pause) = announced_pause(status, headers, now) {
            self.pause(upstream, pause.min(self.pause_cap)).await;
        }
    }

    /// Pauses `upstream` for `pause` on every instance; a store failure is only logged (the
    /// response is the caller's either way).
    async fn pause(&self, upstream: &str, pause: Duration) {
        let key = self.key_of(upstream);
        // Held here at once, before the store has it (and even if the store fails).
        self.paused.set(key.as_str(), Instant::now() + pause);
        outgoing::pause(&self.limiter, &key, upstream, pause).await;
    }
}

impl Upstream for Shared {
    fn known_wait(&self, key: &str, units: Option<u64>) -> Option<Duration> {
        let announced = self.announced.wait(key, units, Instant::now());
        self.paused.left(key).max(announced)
    }

    fn paused(&self, key: &str) -> Option<Duration> {
        self.paused.left(key)
    }

    fn sent(&self, key: &str, units: Option<u64>) {
        self.announced.sent(key, units);
    }
}
