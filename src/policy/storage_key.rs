//! [`StorageKey`]: the store key of one request, and the checks of identities named from outside.

use arrayvec::ArrayString;
use http::request::Parts;
use http::{Method, StatusCode};

use crate::key;

/// Keys up to this many bytes live inside their [`StorageKey`], without an allocation: a
/// policy's `prefix:name:` with a client address, a user id or a hashed API key, as most are.
const INLINE: usize = 46;

/// The store key of one request and who it belongs to.
#[derive(Clone, Default, PartialEq, Eq)]
pub(crate) struct StorageKey {
    key: KeyText,
    identity_at: usize,
    kind: &'static str,
}

/// A key's text: in place when short, else on the heap.
#[derive(Clone)]
enum KeyText {
    Inline(ArrayString<INLINE>),
    Heap(Box<str>),
}

impl KeyText {
    fn of(text: &str) -> Self {
        match ArrayString::from(text) {
            Ok(inline) => KeyText::Inline(inline),
            Err(_) => KeyText::Heap(text.into()),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            KeyText::Inline(text) => text,
            KeyText::Heap(text) => text,
        }
    }
}

impl Default for KeyText {
    fn default() -> Self {
        KeyText::Inline(ArrayString::new())
    }
}

impl PartialEq for KeyText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for KeyText {}

impl std::fmt::Debug for StorageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageKey")
            .field("key", &self.as_str())
            .field("identity_at", &self.identity_at)
            .field("kind", &self.kind)
            .finish()
    }
}

thread_local! {
    /// Where a request's key is written before it is copied into its `StorageKey`: its capacity
    /// stays, so writing a key allocates nothing.
    static SCRATCH: std::cell::RefCell<String> = std::cell::RefCell::new(String::with_capacity(128));
}

/// Calls `write` with an empty buffer to write a key in: this thread's scratch buffer (or a new
/// one, if a key is written while another is, as a key closure that builds a key could).
pub(super) fn in_scratch<R>(write: impl FnOnce(&mut String) -> R) -> R {
    SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut buffer) => {
            buffer.clear();
            let written = write(&mut buffer);
            // A key past the usual size doesn't keep its memory for the thread's lifetime.
            if buffer.capacity() > 1024 {
                *buffer = String::with_capacity(128);
            }
            written
        }
        Err(_) => write(&mut String::new()),
    })
}

impl StorageKey {
    /// The key `key`, whose identity starts at byte `identity_at`, of a key of `kind`.
    pub(super) fn new(key: &str, identity_at: usize, kind: &'static str) -> Self {
        StorageKey {
            key: KeyText::of(key),
            identity_at,
            kind,
        }
    }

    /// The whole key: `prefix:policy:identity`, or `prefix:policy:route:identity` for a route-scoped
    /// policy. It contains no braces, so a store may wrap it in a hash tag.
    pub(crate) fn as_str(&self) -> &str {
        self.key.as_str()
    }

    /// The identity part, safe to log.
    pub(crate) fn identity(&self) -> &str {
        self.as_str().get(self.identity_at..).unwrap_or_default()
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

#[cfg(test)]
mod key_text_tests {
    use super::*;

    /// A key is read back whole whether it lives in place or on the heap, and a key written
    /// while another is (a key closure building a key) gets a buffer of its own.
    #[test]
    fn keys_read_back_whole_inline_or_not_and_scratch_nests() {
        for len in [0, 1, INLINE - 1, INLINE, INLINE + 1, 300] {
            let text: String = "k".repeat(len);
            let key = StorageKey::new(&text, len.min(3), "ip");
            assert_eq!(key.as_str(), text);
            assert_eq!(key.identity(), &text[len.min(3)..]);
            assert_eq!(key.clone(), key);
            assert_eq!(key.kind(), "ip");
        }
        let outer = in_scratch(|buffer| {
            buffer.push_str("rl:outer:");
            let inner = in_scratch(|nested| {
                nested.push_str("rl:inner:x");
                StorageKey::new(nested, 9, "user")
            });
            buffer.push_str("ip:1");
            (StorageKey::new(buffer, 9, "ip"), inner)
        });
        assert_eq!(outer.0.as_str(), "rl:outer:ip:1");
        assert_eq!(outer.1.as_str(), "rl:inner:x");
        assert_eq!(outer.1.identity(), "x");
        // A non-ASCII identity survives the copy.
        let key = StorageKey::new("rl:p:user:zoë", 5, "user");
        assert_eq!(key.identity(), "user:zoë");
    }
}
