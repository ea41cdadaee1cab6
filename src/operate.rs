//! What an operator does to one identity: read its state ([`RateLimitLayer::inspect`]) without
//! counting a request, or forget it ([`RateLimitLayer::reset`]) when support unblocks a customer.
//!
//! [`RateLimitLayer::inspect`]: crate::RateLimitLayer::inspect
//! [`RateLimitLayer::reset`]: crate::RateLimitLayer::reset

use serde::Serialize;

use crate::PolicyError;
use crate::store::StoreError;

/// Why an operator's action on an identity failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperatorError {
    /// The identity can't be a key of this policy: empty, too long, or with braces or control
    /// characters.
    #[error("{0:?} is not an identity (the form the logs show, such as \"user:alice\")")]
    BadIdentity(String),
    /// The policy counts per route too ([`Scope::Route`](crate::policy::Scope::Route)): an identity alone
    /// doesn't name its keys.
    #[error("policy {0:?} counts per route: an identity alone doesn't name its keys")]
    RouteScoped(String),
    /// An override can't be set: its rules are refused as the policy refuses bad rules, or it
    /// names what the policy's key can't yield (a non-address under `Key::ip`, an identity under
    /// `Key::global`). Nothing was stored.
    #[error("override refused: {0}")]
    InvalidOverride(#[source] PolicyError),
    /// The store failed, or can't do this.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// An override set at run time, as
/// [`RateLimiter::overrides`](crate::RateLimiter::overrides) lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SetOverride {
    /// Whom it is for, as the logs show it: an identity as the policy's key stores it
    /// (`user:alice`; a header's or query's value only as its hash, `header#…`), a client
    /// address, or a network (`10.0.0.0/8`).
    pub target: String,
    /// What it does.
    pub action: OverrideAction,
    /// How long it has left, in milliseconds (`None`: until removed).
    pub left_ms: Option<u64>,
}

/// What an override set at run time does (see [`SetOverride`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OverrideAction {
    /// Lets the requests through, counted nowhere.
    Unlimited,
    /// Refuses them (403), counted nowhere.
    Deny,
    /// Counts them by these rules, named as in the `RateLimit-Policy` header (`20-per-60s`).
    Rules(Vec<String>),
}

/// One rule's state for one identity, as [`RateLimitLayer::inspect`](crate::RateLimitLayer::inspect)
/// reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RuleUsage {
    /// The rule's name, as in the `RateLimit-Policy` header (`10-per-60s`).
    pub rule: String,
    /// Its limit.
    pub limit: u64,
    /// What a request of cost 1 would find left now.
    pub remaining: u64,
    /// Until the rule has more quota than now, in milliseconds (0: nothing in use).
    pub reset_ms: u64,
}

/// One identity among the most refused, with its approximate count.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct HeavyHitter {
    /// The kind of key that produced it (`ip`, `user`, `header`, `global`, `custom`, ...).
    pub key_kind: &'static str,
    /// The identity as the crate logs it, kind first (`user:alice`, `ip:192.0.2.7`; an API key
    /// only ever as its hash).
    pub identity: String,
    /// Refusals counted for it: an upper bound, at most `error` above the true count.
    pub count: u64,
    /// How much `count` may overcount: the true count is in `count - error ..= count`.
    pub error: u64,
}
