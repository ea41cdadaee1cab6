//! What clients get: the 429 for a refused request (RFC 9457 problem details), the 503 when a
//! fail-closed store is down, and the rate-limit headers on every response of a limited route.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use serde::Serialize;

mod interned;
mod limit_headers;
mod plan;
mod recent;

pub(crate) use limit_headers::LimitHeaders;
pub(crate) use plan::AnswerPlan;

use crate::decision::{Decision, ceil_secs};
use crate::grpc;
use crate::headers;
use crate::policy::Policy;

/// What a request speaks, and so how it is answered when the limiter answers it itself: plain
/// HTTP (problem details) or gRPC (a trailers-only status, see [`crate::grpc`]) with the call's
/// own `content-type` (gRPC-Web clients expect theirs back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http,
    /// Boxed: every request's flow carries its protocol from value to value, and most are HTTP.
    Grpc(Box<HeaderValue>),
}

impl Protocol {
    /// The protocol of a request with these headers (one look at its `content-type`).
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        match headers.get(CONTENT_TYPE) {
            Some(content_type) if grpc::is_grpc_content_type(content_type) => {
                Protocol::Grpc(Box::new(content_type.clone()))
            }
            _ => Protocol::Http,
        }
    }
}

/// The media type of problem details (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The problem type the ratelimit-headers draft registers for refused requests.
pub const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The title the draft gives that problem type.
pub const QUOTA_EXCEEDED_TITLE: &str =
    "Request cannot be satisfied as assigned quota has been exceeded";

/// A refused request: everything a custom 429 needs.
///
/// Pass a function of `&TooManyRequests` to
/// [`RateLimitLayer::on_rejected`](crate::RateLimitLayer::on_rejected) to replace the default
/// response; [`TooManyRequests::problem_response`] is the default. A gRPC call always gets
/// [`TooManyRequests::grpc_response`], whatever `on_rejected` says: a body meant for HTTP clients would
/// read to a gRPC client as a broken answer.
#[derive(Debug, Clone)]
pub struct TooManyRequests {
    policy: Policy,
    decision: Decision,
    plan: AnswerPlan,
}

impl TooManyRequests {
    pub(crate) fn new(policy: Policy, decision: Decision, plan: AnswerPlan) -> Self {
        TooManyRequests {
            policy,
            decision,
            plan,
        }
    }

    /// The policy that refused the request.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The store's decision, with the state of every rule.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The names of the rules that refused the request, as in the `RateLimit` header.
    pub fn violated_rules(&self) -> impl Iterator<Item = &str> + '_ {
        violated_names(&self.policy, &self.decision)
    }

    /// The exact time until every refusing rule admits the request.
    pub fn retry_after(&self) -> Duration {
        self.decision.retry_after().unwrap_or_default()
    }

    /// [`TooManyRequests::retry_after`] in whole seconds as `Retry-After` carries it: rounded up, at least 1.
    pub fn retry_after_secs(&self) -> u64 {
        retry_after_secs(&self.decision)
    }

    /// The default response: `429 Too Many Requests` with an `application/problem+json` body naming
    /// the policy's message and the violated rules. (The layer adds `Retry-After` and the
    /// rate-limit headers to whatever response is used.)
    pub fn problem_response(&self) -> Response<Body> {
        refusal_problem(&self.policy, &self.plan, &self.decision)
    }

    /// The answer to a refused gRPC call, which the layer gives gRPC calls in place of the 429:
    /// HTTP 200, trailers-only, `grpc-status: 8` (`RESOURCE_EXHAUSTED`) with the policy's message,
    /// `grpc-retry-pushback-ms` (the wait of `Retry-After`, in milliseconds) and, with the `grpc`
    /// feature, `grpc-status-details-bin` (a `google.rpc.Status` carrying a `RetryInfo` and a
    /// `QuotaFailure` that names the refusing rules). (The layer adds `Retry-After` and the
    /// rate-limit headers, which gRPC clients see as metadata.)
    pub fn grpc_response(&self) -> Response<Body> {
        let message = self.policy.message();
        let retry = self.retry_after();
        let mut response = grpc::trailers_only(grpc::RESOURCE_EXHAUSTED, message);
        let headers = response.headers_mut();
        headers.insert(grpc::GRPC_RETRY_PUSHBACK_MS, grpc::pushback(Some(retry)));
        #[cfg(feature = "grpc")]
        {
            let states = self.decision.rules.len();
            let violations: Vec<grpc::Violation<'_>> = self
                .decision
                .violated()
                .filter_map(|index| {
                    Some(grpc::Violation {
                        subject: self.policy.name(),
                        rule: self.policy.state_name(index, states)?,
                        limit: self.decision.rules[index].limit,
                    })
                })
                .collect();
            headers.insert(
                grpc::GRPC_STATUS_DETAILS_BIN,
                grpc::details(grpc::RESOURCE_EXHAUSTED, message, Some(retry), &violations),
            );
        }
        response
    }
}

/// `Retry-After` of a refusal: whole seconds until every refusing rule admits, rounded up, at
/// least 1.
pub(crate) fn retry_after_secs(decision: &Decision) -> u64 {
    ceil_secs(decision.retry_after().unwrap_or_default()).max(1)
}

/// [`TooManyRequests::problem_response`] of `decision` by `policy`, whose answers `plan` holds.
pub(crate) fn refusal_problem(
    policy: &Policy,
    plan: &AnswerPlan,
    decision: &Decision,
) -> Response<Body> {
    // The common refusal, by one rule, has its body ready from when the limiter was built.
    let mut violated = decision.violated();
    if let (Some(index), None) = (violated.next(), violated.next())
        && let Some(body) = plan.body(policy, index, decision.rules.len())
    {
        return problem_response(StatusCode::TOO_MANY_REQUESTS, body.clone());
    }
    let violated: Vec<&str> = violated_names(policy, decision).collect();
    problem_response(
        StatusCode::TOO_MANY_REQUESTS,
        refusal_body(policy.message(), &violated),
    )
}

/// The names of the rules (or quota, or concurrency limit) that refused `decision`, as in the
/// `RateLimit` header.
fn violated_names<'a>(policy: &'a Policy, decision: &'a Decision) -> impl Iterator<Item = &'a str> {
    let states = decision.rules.len();
    decision
        .violated()
        .filter_map(move |index| policy.state_name(index, states))
}

/// The problem body of a refusal by `violated` rules with the policy's `message`.
pub(crate) fn refusal_body(message: &str, violated: &[&str]) -> Bytes {
    problem_bytes(&Problem {
        kind: QUOTA_EXCEEDED_TYPE,
        title: QUOTA_EXCEEDED_TITLE,
        status: StatusCode::TOO_MANY_REQUESTS,
        detail: message,
        violated_policies: Some(violated),
    })
}

#[derive(Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    title: &'a str,
    #[serde(serialize_with = "status_number")]
    status: StatusCode,
    detail: &'a str,
    #[serde(rename = "violated-policies", skip_serializing_if = "Option::is_none")]
    violated_policies: Option<&'a [&'a str]>,
}

/// Problem details carry the status as a JSON number.
fn status_number<S: serde::Serializer>(status: &StatusCode, out: S) -> Result<S::Ok, S::Error> {
    out.serialize_u16(status.as_u16())
}

/// A problem as `protocol` answers it: problem details, or a gRPC status of its detail.
fn problem(problem: &Problem<'_>, protocol: &Protocol) -> Response<Body> {
    match protocol {
        Protocol::Http => problem_response(problem.status, problem_bytes(problem)),
        Protocol::Grpc(content_type) => grpc::answered_as(
            grpc::trailers_only(grpc::code_of(problem.status), problem.detail),
            content_type,
        ),
    }
}

fn problem_bytes(problem: &Problem<'_>) -> Bytes {
    // Serialising plain strings and numbers can't fail.
    serde_json::to_vec(problem).unwrap_or_default().into()
}

fn problem_response(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    response
}

/// The 503 of a fail-closed policy whose store is down (`UNAVAILABLE` to a gRPC call).
pub(crate) fn store_unavailable(protocol: &Protocol) -> Response<Body> {
    problem(
        &Problem {
            kind: "about:blank",
            title: "Service Unavailable",
            status: StatusCode::SERVICE_UNAVAILABLE,
            detail: "The rate limiter cannot reach its store.",
            violated_policies: None,
        },
        protocol,
    )
}

/// The 500 of a handle's check of cost 0, which counts nothing: the app's mistake.
pub(crate) fn zero_cost(protocol: &Protocol) -> Response<Body> {
    problem(
        &Problem {
            kind: "about:blank",
            title: "Internal Server Error",
            status: StatusCode::INTERNAL_SERVER_ERROR,
            detail: "The rate limiter was asked to count a cost of 0.",
            violated_policies: None,
        },
        protocol,
    )
}

/// The response for a request whose rate-limit key can't be found.
pub(crate) fn key_unavailable(status: StatusCode, protocol: &Protocol) -> Response<Body> {
    problem(
        &Problem {
            kind: "about:blank",
            title: status.canonical_reason().unwrap_or("Error"),
            status,
            detail: "The request carries no rate-limit key.",
            violated_policies: None,
        },
        protocol,
    )
}

/// The 403 of a request a `deny` override refuses: no rate-limit headers, since no limit was
/// checked, and no `Retry-After`, since waiting won't help.
pub(crate) fn denied(protocol: &Protocol) -> Response<Body> {
    problem(
        &Problem {
            kind: "about:blank",
            title: "Forbidden",
            status: StatusCode::FORBIDDEN,
            detail: "This client may not use this resource.",
            violated_policies: None,
        },
        protocol,
    )
}

/// The 413 for a request that costs more than a rule (or the daily quota) could ever admit:
/// waiting won't help, so it gets no `Retry-After`, and the body says what it costs and what the
/// rule allows.
///
/// A gRPC call gets `RESOURCE_EXHAUSTED`, the code of a limit, with `grpc-retry-pushback-ms: -1`,
/// which tells a gRPC client's retry policy not to retry (gRFC A6): no wait would help. (Not
/// `INVALID_ARGUMENT`: the call is valid, it is the limit that can't take it.)
// The policy names the subject of a gRPC `QuotaFailure`, written with the `grpc` feature only.
#[cfg_attr(not(feature = "grpc"), allow(unused_variables))]
pub(crate) fn too_costly(
    policy: &Policy,
    plan: &AnswerPlan,
    cost: u64,
    rule: &str,
    at_most: u64,
    protocol: &Protocol,
) -> Response<Body> {
    let detail = format!(
        "This request costs {cost} units; rule \"{rule}\" admits at most {at_most} at once."
    );
    let mut response = problem(
        &Problem {
            kind: "about:blank",
            title: "Request costs more than the rate limit allows",
            status: StatusCode::PAYLOAD_TOO_LARGE,
            detail: &detail,
            violated_policies: Some(&[rule]),
        },
        protocol,
    );
    let headers = response.headers_mut();
    if let Protocol::Grpc(_) = protocol {
        headers.insert(grpc::GRPC_RETRY_PUSHBACK_MS, grpc::pushback(None));
        #[cfg(feature = "grpc")]
        headers.insert(
            grpc::GRPC_STATUS_DETAILS_BIN,
            grpc::details(
                grpc::RESOURCE_EXHAUSTED,
                &detail,
                None,
                &[grpc::Violation {
                    subject: policy.name(),
                    rule,
                    limit: at_most,
                }],
            ),
        );
    }
    headers.insert(headers::RATELIMIT_POLICY, plan.rules_policy().clone());
    response
}

/// `n` as a header value, in one allocation (`HeaderValue::from(u64)` takes two).
pub(crate) fn decimal(n: u64) -> HeaderValue {
    let mut digits = itoa::Buffer::new();
    HeaderValue::from_bytes(digits.format(n).as_bytes()).unwrap_or_else(|_| HeaderValue::from(n))
}

/// Finishes a refusal: the chosen response plus `Retry-After` and the rate-limit headers.
pub(crate) fn finish_rejection(
    mut response: Response<Body>,
    retry_after_secs: u64,
    headers: LimitHeaders,
) -> Response<Body> {
    let map = response.headers_mut();
    map.insert(
        RETRY_AFTER,
        recent::retry_after_value(retry_after_secs, decimal),
    );
    headers.apply(map);
    response
}
