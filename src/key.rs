//! Who a request counts against: the [`Key`] kinds, the [`KeyExtractor`] trait for your own, and the
//! [`Identity`] they produce.
//!
//! An identity ends up inside a store key and in log lines, and most identities are user input (a
//! user id, an API key). So an [`Identity`] is always *safe*: short, printable, free of the
//! characters that tag store keys (`{`, `}`), and never a raw secret. Values that are long or contain
//! anything unusual (a `:` among them) are replaced by a hash. The identity is the last part of a
//! store key, so the colons of the `kind:` prefix and of an IPv6 address can't be mistaken for
//! separators.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use http::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

use tower_redis_ratelimit_spec::KeySpec;

use crate::client_ip::ClientIp;

/// The bucket a request counts against, in a form that is safe for store keys and logs.
///
/// Identities look like `ip:203.0.113.7`, `ip:2001:db8:1:2::/64`, `user:42`, `header#<hash>` or
/// `global`. Build your own with [`Identity::new`] (hashed only when odd or long) or
/// [`Identity::secret`] (always hashed, for API keys and tokens).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity(String);

impl Identity {
    /// An identity of `kind` (for example `"tenant"`) for `value`. Values of up to 64 characters made
    /// of letters, digits and `-._~@+=!*(),/` are kept as they are (`tenant:acme`); anything else is
    /// replaced by a hash (`tenant#3f1c…`), so no user-supplied byte can break the key layout.
    pub fn new(kind: &str, value: &str) -> Self {
        let mut out = String::with_capacity(kind.len() + 1 + value.len().min(33));
        push_value(&mut out, kind, value);
        Identity(out)
    }

    /// An identity of `kind` for a secret `value` (an API key, a token): always stored and logged as
    /// a hash (`header#<32 hex digits>`), never as the value itself.
    pub fn secret(kind: &str, value: &[u8]) -> Self {
        let mut out = String::with_capacity(kind.len() + 33);
        push_secret(&mut out, kind, value);
        Identity(out)
    }

    /// The one identity shared by every request.
    pub fn global() -> Self {
        Identity("global".to_owned())
    }

    /// The identity of a client network: `ip:` and the address, with `/len` when the network is
    /// wider than one address (IPv6 clients are grouped by /64 by default).
    pub fn ip(net: ipnet::IpNet) -> Self {
        let mut out = String::with_capacity(48);
        push_ip(&mut out, net);
        Identity(out)
    }

    /// The identity as it appears in store keys and logs.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Appends `kind:value`, or `kind#hash` when the value is odd or long.
fn push_value(out: &mut String, kind: &str, value: &str) {
    push_component(out, kind);
    if is_verbatim(value) {
        out.push(':');
        out.push_str(value);
    } else {
        push_hash(out, value.as_bytes());
    }
}

/// Appends `kind#hash`.
fn push_secret(out: &mut String, kind: &str, value: &[u8]) {
    push_component(out, kind);
    push_hash(out, value);
}

/// Appends `ip:` and the address, with `/len` when the network is wider than one address. IPv4 is
/// written digit by digit: `Display` for addresses pads through a scratch buffer, and this runs on
/// every request.
fn push_ip(out: &mut String, net: ipnet::IpNet) {
    out.push_str("ip:");
    match net {
        ipnet::IpNet::V4(v4) if v4.prefix_len() == 32 => {
            // Bytes on the stack, appended once: a `String`'s push checks its room per char.
            let mut text = arrayvec::ArrayString::<15>::new();
            for (index, octet) in v4.addr().octets().into_iter().enumerate() {
                if index > 0 {
                    text.push('.');
                }
                if octet >= 100 {
                    text.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    text.push(char::from(b'0' + octet / 10 % 10));
                }
                text.push(char::from(b'0' + octet % 10));
            }
            out.push_str(&text);
        }
        net if net.prefix_len() == net.max_prefix_len() => {
            let _ = write!(out, "{}", net.addr());
        }
        net => {
            let _ = write!(out, "{net}");
        }
    }
}

/// Whether `value` can go into a key as it is: what a policy name may be, too.
pub(crate) fn is_verbatim(value: &str) -> bool {
    tower_redis_ratelimit_spec::is_valid_name(value)
}

/// Pushes `value` verbatim when safe, else as `#` and a hash. The `#` can't appear in a verbatim
/// value, so the two forms never collide.
pub(crate) fn push_component(out: &mut String, value: &str) {
    if is_verbatim(value) {
        out.push_str(value);
    } else {
        push_hash(out, value.as_bytes());
    }
}

/// `#` and the first 128 bits of SHA-256 in hex: short, stable across processes and versions (app
/// instances must agree on keys), and not reversible for secrets with real entropy.
fn push_hash(out: &mut String, value: &[u8]) {
    let digest = Sha256::digest(value);
    out.push('#');
    for byte in &digest[..16] {
        let _ = write!(out, "{byte:02x}");
    }
}

/// A user id that an authentication layer put into the request extensions, read by [`Key::user`].
///
/// ```
/// use tower_redis_ratelimit::UserId;
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(UserId::new("42"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UserId(pub String);

impl UserId {
    /// Wraps a user id.
    pub fn new(id: impl Into<String>) -> Self {
        UserId(id.into())
    }
}

/// Your own way to pick the bucket of a request.
///
/// Return `None` when the request carries no key; the policy's
/// [`MissingKey`](crate::policy::MissingKey) setting decides what happens then. Closures of the right shape
/// implement this trait.
///
/// ```
/// use http::request::Parts;
/// use tower_redis_ratelimit::{key::Identity, Key};
///
/// // One bucket per tenant, from a subdomain.
/// let key = Key::custom(|parts: &Parts| {
///     let host = parts.headers.get(http::header::HOST)?.to_str().ok()?;
///     let tenant = host.split('.').next()?;
///     Some(Identity::new("tenant", tenant))
/// });
/// assert_eq!(key.kind(), "custom");
/// ```
pub trait KeyExtractor: Send + Sync + 'static {
    /// The identity of this request, or `None` when it has none.
    fn extract(&self, parts: &Parts) -> Option<Identity>;
}

impl<F> KeyExtractor for F
where
    F: Fn(&Parts) -> Option<Identity> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Option<Identity> {
        self(parts)
    }
}

type UserFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// What a policy keys its limits by.
#[derive(Clone)]
pub struct Key(Source);

#[derive(Clone)]
enum Source {
    Ip,
    Global,
    Header(HeaderName),
    /// `Key::header` of a name no header can have: refused when the policy is built.
    InvalidHeader(Arc<str>),
    Query(Arc<str>),
    UserExtension,
    UserFn(Arc<UserFn>),
    Custom(Arc<dyn KeyExtractor>),
}

/// A key as config files and the derive's attribute write it (`"ip"`, `"header:x-api-key"`).
impl From<KeySpec> for Key {
    fn from(spec: KeySpec) -> Self {
        match spec {
            KeySpec::Ip => Key::ip(),
            KeySpec::User => Key::user(),
            KeySpec::Global => Key::global(),
            KeySpec::Header(name) => Key::header(name),
            KeySpec::Query(name) => Key::query(name),
        }
    }
}

impl Key {
    /// The client IP address, found by the policy's [`ClientIp`] settings (peer address, trusted
    /// proxies, IPv6 grouping).
    pub fn ip() -> Self {
        Key(Source::Ip)
    }

    /// One bucket for all requests.
    pub fn global() -> Self {
        Key(Source::Global)
    }

    /// The value of a request header, such as an API key. The value is hashed before it reaches a
    /// store key or a log line; an absent or empty header is a missing key. The name is a string
    /// (any case) or a [`HeaderName`]; one no header can have is refused when the policy (or
    /// quota) is built, naming it.
    ///
    /// ```
    /// use tower_redis_ratelimit::{client_ip::ClientIp, Key, Policy, Rule};
    ///
    /// let key = Key::header("X-Api-Key");
    /// let parts = http::Request::get("/").header("x-api-key", "k1").body(()).unwrap().into_parts().0;
    /// assert!(key.extract(&parts, &ClientIp::default()).is_some());
    ///
    /// let bad = Policy::builder("api").key(Key::header("x api key")).rule(Rule::per_minute(5)).build();
    /// assert!(bad.unwrap_err().to_string().contains("\"x api key\""));
    /// ```
    pub fn header(name: impl AsRef<[u8]>) -> Self {
        let name = name.as_ref();
        Key(match HeaderName::from_bytes(name) {
            Ok(name) => Source::Header(name),
            Err(_) => Source::InvalidHeader(String::from_utf8_lossy(name).into()),
        })
    }

    /// The name `Key::header` was given, if no header can have it.
    pub(crate) fn invalid_header(&self) -> Option<&str> {
        match &self.0 {
            Source::InvalidHeader(name) => Some(name),
            _ => None,
        }
    }

    /// The value of a query-string parameter, such as a one-time token (`?token=…`), decoded as
    /// forms are. Like a header's, the value is hashed before it reaches a store key or a log line
    /// (`query#<hash>`): it is untrusted input and often a secret. An absent or empty parameter is
    /// a missing key; when it appears twice, the first counts.
    ///
    /// ```
    /// use tower_redis_ratelimit::{client_ip::ClientIp, Key};
    ///
    /// let key = Key::query("token");
    /// let parts = http::Request::get("/spawn_vm?token=a1b2").body(()).unwrap().into_parts().0;
    /// let identity = key.extract(&parts, &ClientIp::default()).unwrap();
    /// assert!(identity.as_str().starts_with("query#"));
    /// ```
    pub fn query(name: impl Into<String>) -> Self {
        Key(Source::Query(name.into().into()))
    }

    /// The [`UserId`] an authentication layer inserted into the request extensions.
    pub fn user() -> Self {
        Key(Source::UserExtension)
    }

    /// A user id computed from the request parts, for example from your own auth extension:
    /// `Key::user_from_fn(|parts| parts.extensions.get::<Session>().map(|s| s.user_id.to_string()))`.
    pub fn user_from_fn<F>(user_id: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        Key(Source::UserFn(Arc::new(user_id)))
    }

    /// Your own [`KeyExtractor`].
    pub fn custom(extractor: impl KeyExtractor) -> Self {
        Key(Source::Custom(Arc::new(extractor)))
    }

    /// A short name of the key kind for logs: `ip`, `global`, `header`, `query`, `user` or
    /// `custom`.
    pub fn kind(&self) -> &'static str {
        match self.0 {
            Source::Ip => "ip",
            Source::Global => "global",
            Source::Header(_) | Source::InvalidHeader(_) => "header",
            Source::Query(_) => "query",
            Source::UserExtension | Source::UserFn(_) => "user",
            Source::Custom(_) => "custom",
        }
    }

    /// Whether this key gives every request the same identity as `other`: the same built-in kind
    /// (and header), or a clone of the same closure or extractor.
    pub fn same_identity_as(&self, other: &Key) -> bool {
        match (&self.0, &other.0) {
            (Source::Ip, Source::Ip)
            | (Source::Global, Source::Global)
            | (Source::UserExtension, Source::UserExtension) => true,
            (Source::Header(a), Source::Header(b)) => a == b,
            (Source::Query(a), Source::Query(b)) => a == b,
            (Source::UserFn(a), Source::UserFn(b)) => Arc::ptr_eq(a, b),
            (Source::Custom(a), Source::Custom(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Whether this key is the client IP (then there is nothing to fall back to).
    pub(crate) fn is_ip(&self) -> bool {
        matches!(self.0, Source::Ip)
    }

    /// Whether this key is one bucket for all requests ([`Key::global`]).
    pub(crate) fn is_global(&self) -> bool {
        matches!(self.0, Source::Global)
    }

    /// The identity of a request under this key, or `None` when the request has none.
    pub fn extract(&self, parts: &Parts, client_ip: &ClientIp) -> Option<Identity> {
        let mut out = String::new();
        self.push_identity(parts, client_ip, &mut out)
            .then_some(Identity(out))
    }

    /// Appends the identity of a request to `out` (a store key being built, so the hot path
    /// allocates once); `false`, with `out` unchanged, when the request has none.
    pub(crate) fn push_identity(
        &self,
        parts: &Parts,
        client_ip: &ClientIp,
        out: &mut String,
    ) -> bool {
        match &self.0 {
            Source::Ip => match client_ip.client_net(parts) {
                Some(net) => push_ip(out, net),
                None => return false,
            },
            Source::Global => out.push_str("global"),
            Source::Header(name) => match parts.headers.get(name) {
                Some(value) if !value.is_empty() => push_secret(out, "header", value.as_bytes()),
                _ => return false,
            },
            Source::InvalidHeader(_) => return false,
            Source::Query(name) => {
                let value = parts.uri.query().and_then(|query| {
                    form_urlencoded::parse(query.as_bytes())
                        .find(|(key, _)| **key == **name)
                        .map(|(_, value)| value)
                });
                match value {
                    Some(value) if !value.is_empty() => {
                        push_secret(out, "query", value.as_bytes());
                    }
                    _ => return false,
                }
            }
            Source::UserExtension => match parts.extensions.get::<UserId>() {
                Some(user) if !user.0.is_empty() => push_value(out, "user", &user.0),
                _ => return false,
            },
            Source::UserFn(user_id) => match user_id(parts) {
                Some(id) if !id.is_empty() => push_value(out, "user", &id),
                _ => return false,
            },
            Source::Custom(extractor) => match extractor.extract(parts) {
                Some(identity) => out.push_str(identity.as_str()),
                None => return false,
            },
        }
        true
    }
}

impl Key {
    /// Appends the identity an app names (a [`RateLimiter`](crate::RateLimiter)'s) as this key
    /// stores the value it reads from a request, so that a layer and a handle of one policy given
    /// the same value share one bucket: a header's or a query parameter's value as its hash, a
    /// user id as the layer stores it, a client IP address grouped as `client_ip` groups the
    /// layer's (an IPv6 address by its /64), the one `global` bucket. Returns the key's kind.
    ///
    /// A value this key can't read (a name for a client-IP key) and a custom key's, which only
    /// its extractor knows how to store, keep the handle's own form: the identity verbatim when
    /// short and plain, else its hash, of kind `named`.
    pub(crate) fn push_named(
        &self,
        identity: &str,
        client_ip: &ClientIp,
        out: &mut String,
    ) -> &'static str {
        match &self.0 {
            Source::Ip => match identity.parse::<std::net::IpAddr>() {
                Ok(address) => push_ip(out, client_ip.group(address.to_canonical())),
                Err(_) => {
                    push_component(out, identity);
                    return "named";
                }
            },
            Source::Global => out.push_str("global"),
            Source::Header(_) => push_secret(out, "header", identity.as_bytes()),
            Source::Query(_) => push_secret(out, "query", identity.as_bytes()),
            Source::UserExtension | Source::UserFn(_) => push_value(out, "user", identity),
            Source::InvalidHeader(_) | Source::Custom(_) => {
                push_component(out, identity);
                return "named";
            }
        }
        self.kind()
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::Header(name) => f.debug_tuple("Key::header").field(name).finish(),
            Source::InvalidHeader(name) => f.debug_tuple("Key::header").field(name).finish(),
            Source::Query(name) => f.debug_tuple("Key::query").field(name).finish(),
            _ => write!(f, "Key::{}", self.kind()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use tower_redis_ratelimit_spec::MAX_VERBATIM_LEN;

    use axum::extract::ConnectInfo;

    fn parts(build: impl FnOnce(http::request::Builder) -> http::request::Builder) -> Parts {
        build(http::Request::builder())
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn plain_values_stay_readable() {
        assert_eq!(Identity::new("user", "42").as_str(), "user:42");
        assert_eq!(
            Identity::new("user", "alice@example.com").as_str(),
            "user:alice@example.com"
        );
    }

    #[test]
    fn separators_braces_and_long_values_are_hashed() {
        for odd in [
            "a:b",
            "x}{y",
            "{tag}",
            "with space",
            "",
            "#abc",
            "100%",
            "é",
        ] {
            let identity = Identity::new("user", odd);
            let text = identity.as_str();
            assert!(text.starts_with("user#"), "{odd:?} gave {text}");
            assert_eq!(text.len(), "user#".len() + 32);
            assert!(!text.contains(['{', '}']));
        }
        let long = "a".repeat(MAX_VERBATIM_LEN + 1);
        assert!(Identity::new("user", &long).as_str().starts_with("user#"));
        let limit = "a".repeat(MAX_VERBATIM_LEN);
        assert_eq!(
            Identity::new("user", &limit).as_str(),
            format!("user:{limit}")
        );
    }

    #[test]
    fn hashing_is_stable_and_distinguishes_values() {
        let a = Identity::new("user", "a:b");
        assert_eq!(a, Identity::new("user", "a:b"));
        assert_ne!(a, Identity::new("user", "a:c"));
        // Known SHA-256 prefix, so keys agree across processes and versions.
        assert_eq!(
            Identity::secret("header", b"abc").as_str(),
            "header#ba7816bf8f01cfea414140de5dae2223"
        );
    }

    #[test]
    fn secrets_never_appear_verbatim() {
        let identity = Identity::secret("header", b"sk_live_123");
        assert!(!identity.as_str().contains("sk_live_123"));
    }

    #[test]
    fn an_odd_kind_is_hashed_too() {
        assert!(Identity::new("a:b", "x").as_str().starts_with('#'));
    }

    #[test]
    fn ip_identity_shows_the_group() {
        for address in ["203.0.113.7", "0.10.100.255", "1.2.3.4", "99.100.199.200"] {
            let net: ipnet::IpNet = format!("{address}/32").parse().unwrap();
            assert_eq!(Identity::ip(net).as_str(), format!("ip:{address}"));
        }
        let v4: ipnet::IpNet = "203.0.113.0/24".parse().unwrap();
        assert_eq!(Identity::ip(v4).as_str(), "ip:203.0.113.0/24");
        let v6: ipnet::IpNet = "2001:db8:1:2::/64".parse().unwrap();
        assert_eq!(Identity::ip(v6).as_str(), "ip:2001:db8:1:2::/64");
    }

    #[test]
    fn each_kind_extracts_its_identity() {
        let client_ip = ClientIp::new();
        let peer: SocketAddr = "198.51.100.9:5000".parse().unwrap();
        let parts = parts(|b| {
            b.header("x-api-key", "secret-key")
                .extension(ConnectInfo(peer))
                .extension(UserId::new("7"))
        });

        let ip = Key::ip().extract(&parts, &client_ip).unwrap();
        assert_eq!(ip.as_str(), "ip:198.51.100.9");
        assert_eq!(
            Key::global().extract(&parts, &client_ip).unwrap().as_str(),
            "global"
        );
        let header = Key::header(HeaderName::from_static("x-api-key"))
            .extract(&parts, &client_ip)
            .unwrap();
        assert!(header.as_str().starts_with("header#"));
        assert_eq!(
            Key::user().extract(&parts, &client_ip).unwrap().as_str(),
            "user:7"
        );
        let from_fn = Key::user_from_fn(|p| {
            p.headers
                .get("x-api-key")
                .map(|v| v.to_str().unwrap().len().to_string())
        });
        assert_eq!(
            from_fn.extract(&parts, &client_ip).unwrap().as_str(),
            "user:10"
        );
    }

    #[test]
    fn absent_or_empty_values_are_missing() {
        let client_ip = ClientIp::new();
        let empty = parts(|b| b.header("x-api-key", "").extension(UserId::new("")));
        assert_eq!(
            Key::header(HeaderName::from_static("x-api-key")).extract(&empty, &client_ip),
            None
        );
        assert_eq!(Key::user().extract(&empty, &client_ip), None);
        // No ConnectInfo: no peer address.
        assert_eq!(Key::ip().extract(&empty, &client_ip), None);
        assert_eq!(
            Key::user_from_fn(|_| Some(String::new())).extract(&empty, &client_ip),
            None
        );
    }
}
