//! [`StorageKey`]: the store key of one request, and the checks of identities named from outside.

use http::request::Parts;
use http::{Method, StatusCode};

use crate::key;

/// The store key of one request and who it belongs to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StorageKey {
    key: String,
    identity_at: usize,
    kind: &'static str,
}

impl StorageKey {
    /// The key `key`, whose identity starts at byte `identity_at`, of a key of `kind`.
    pub(super) fn new(key: String, identity_at: usize, kind: &'static str) -> Self {
        StorageKey {
            key,
            identity_at,
            kind,
        }
    }

    /// The whole key: `prefix:policy:identity`, or `prefix:policy:route:identity` for a route-scoped
    /// policy. It contains no braces, so a store may wrap it in a hash tag.
    pub(crate) fn as_str(&self) -> &str {
        &self.key
    }

    /// The identity part, safe to log.
    pub(crate) fn identity(&self) -> &str {
        &self.key[self.identity_at..]
    }

    /// The kind of key that produced it (`ip`, `user`, …): the policy's, or `ip` after a fallback.
    pub(crate) fn kind(&self) -> &'static str {
        self.kind
    }
}

/// The result of looking up a request's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyLookup {
    /// Count the request against this key.
    Found(StorageKey),
    /// No key: let the request through unlimited ([`MissingKey::Allow`]).
    Unlimited,
    /// No key: refuse the request with this status ([`MissingKey::Reject`]).
    Refuse(StatusCode),
    /// Neither a key nor a client IP to fall back to: the server lacks `ConnectInfo`.
    NoClientIp,
}

/// The longest identity an operator or an outbound key may name, in bytes.
const MAX_NAMED_IDENTITY_LEN: usize = 512;

/// Whether `identity`, named from outside a request (an operator's, an outbound upstream's), can
/// be part of a store key: not empty, at most 512 bytes, no braces (store keys wrap identities in
/// a hash tag) and no control characters.
pub(crate) fn is_storable_identity(identity: &str) -> bool {
    !identity.is_empty()
        && identity.len() <= MAX_NAMED_IDENTITY_LEN
        && !identity
            .chars()
            .any(|c| c == '{' || c == '}' || c.is_control())
}

/// Appends the route component: method and matched path, hashed when odd (paths with `{param}`).
/// Only values the app defines get through: unmatched paths and non-standard methods, which a
/// client can make up at will, collapse into one bucket each.
pub(super) fn push_route(key: &mut String, parts: &Parts) {
    let path = parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |matched| matched.as_str());
    let method = match parts.method {
        Method::GET
        | Method::POST
        | Method::PUT
        | Method::DELETE
        | Method::PATCH
        | Method::HEAD
        | Method::OPTIONS
        | Method::CONNECT
        | Method::TRACE => parts.method.as_str(),
        _ => "OTHER",
    };
    let mut route = String::with_capacity(method.len() + path.len());
    route.push_str(method);
    route.push_str(path);
    key::push_component(key, &route);
}
