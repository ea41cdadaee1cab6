//! [`Answered`]: what the limiter answers a request itself, why ([`Refusal`]), in which protocol
//! and as which limiter (a 429, a 413, a 403, a 503), kept as
//! data until it is sent, so that every door (the layer, [`Limited`](crate::Limited), the
//! [`RateLimiter`](crate::RateLimiter) handle) answers alike, byte for byte.

use std::fmt;
use std::sync::Arc;

use axum::body::Body;
use http::{Response, StatusCode};

use super::Limiter;
use crate::decision::{Decision, ceil_secs};
use crate::response::{self, LimitHeaders, Protocol, TooManyRequests};

/// Why the limiter answers a request itself.
#[derive(Debug, Clone)]
pub(crate) enum Refusal {
    /// The store (or the refusal cache) refused it: 429 with `Retry-After`.
    Limited(Decision),
    /// It costs more than state `index` (a rule, or the quota after the rules) could ever admit:
    /// 413, since no wait would help.
    TooCostly {
        index: usize,
        cost: u64,
        at_most: u64,
    },
    /// A `deny` override: 403.
    Denied,
    /// No key to count it by: this status (the policy's `MissingKey::Reject`, 500 without a
    /// client address, 400 for an empty identity given to a handle).
    NoKey(StatusCode),
    /// A handle asked for a cost of 0, which counts nothing: the app's mistake, 500.
    ZeroCost,
    /// The store failed and the policy fails closed: 503.
    StoreUnavailable,
}

/// The limiter's own answer to a request, and the limiter that gives it (a `rules` override's
/// may differ from the one asked).
pub(crate) struct Answered {
    pub(super) by: Arc<Limiter>,
    pub(super) refusal: Refusal,
    /// How it reaches the client: HTTP or gRPC.
    pub(super) protocol: Protocol,
}

impl Answered {
    /// The response, in the request's protocol.
    pub(crate) fn response(self) -> Response<Body> {
        self.refusal.respond(&self.by, &self.protocol)
    }

    /// The limiter that answers, and why (a handle's [`Refused`](crate::Refused)).
    pub(crate) fn into_refusal(self) -> (Arc<Limiter>, Refusal) {
        (self.by, self.refusal)
    }
}

impl Refusal {
    /// The status of the answer.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Refusal::Limited(_) => StatusCode::TOO_MANY_REQUESTS,
            Refusal::TooCostly { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::Denied => StatusCode::FORBIDDEN,
            Refusal::NoKey(status) => *status,
            Refusal::ZeroCost => StatusCode::INTERNAL_SERVER_ERROR,
            Refusal::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Says why `policy` answered, for a log line or an error's message.
    pub(crate) fn describe(&self, policy: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
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
            Refusal::StoreUnavailable => write!(
                f,
                "policy {policy:?} fails closed and its store is unavailable"
            ),
        }
    }
}

/// The responses: a refusal answered as `by` (a limiter's settings: its policy, the wire parts of
/// its answers, legacy headers, the app's own 429) answers.
impl Refusal {
    /// The response in `protocol` (its decision moves into the 429: nothing copied).
    pub(crate) fn respond(self, by: &Limiter, protocol: &Protocol) -> Response<Body> {
        match self {
            Refusal::Limited(decision) => limited(by, decision, protocol),
            other => other.respond_in(by, protocol),
        }
    }

    /// The response in `protocol`, the refusal kept.
    pub(crate) fn respond_in(&self, by: &Limiter, protocol: &Protocol) -> Response<Body> {
        let policy = &by.policy;
        match self {
            Refusal::Limited(decision) => limited(by, decision.clone(), protocol),
            Refusal::TooCostly {
                index,
                cost,
                at_most,
            } => {
                let rule = match policy.rule_names().get(*index) {
                    Some(name) => &**name,
                    None => policy.quota().map_or("quota", |quota| quota.name()),
                };
                response::too_costly(policy, &by.answers, *cost, rule, *at_most, protocol)
            }
            Refusal::Denied => response::denied(protocol),
            Refusal::NoKey(status) => response::key_unavailable(*status, protocol),
            Refusal::ZeroCost => response::zero_cost(protocol),
            Refusal::StoreUnavailable => response::store_unavailable(protocol),
        }
    }
}

/// The 429 `by` answers for `decision`: the problem body (or the app's own), `Retry-After` and the
/// headers. A gRPC call gets its gRPC answer ([`TooManyRequests::grpc_response`]), never a body
/// meant for HTTP clients.
fn limited(by: &Limiter, decision: Decision, protocol: &Protocol) -> Response<Body> {
    let headers = LimitHeaders::new(&by.answers, &by.policy, &decision, by.legacy_headers);
    let retry_after_secs = response::retry_after_secs(&decision);
    let rejected = |decision| {
        let (policy, answers) = (by.policy.clone(), by.answers.clone());
        TooManyRequests::new(policy, decision, answers)
    };
    let response = match (protocol, &by.on_rejected) {
        // The default answer needs no `TooManyRequests`, nor the two shared counts it takes.
        (Protocol::Http, None) => response::refusal_problem(&by.policy, &by.answers, &decision),
        (Protocol::Http, Some(respond)) => respond(&rejected(decision)),
        (Protocol::Grpc(content_type), _) => {
            crate::grpc::answered_as(rejected(decision).grpc_response(), content_type)
        }
    };
    response::finish_rejection(response, retry_after_secs, headers)
}
