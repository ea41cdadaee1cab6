//! Finding the client IP address of a request, safely behind reverse proxies.
//!
//! The peer address of the TCP connection comes from axum's
//! [`ConnectInfo<SocketAddr>`](axum::extract::ConnectInfo) request extension
//! (installed by `into_make_service_with_connect_info::<SocketAddr>()`, or by
//! `MockConnectInfo` in tests).
//!
//! # The trusted-proxy rule
//!
//! Proxy headers (`X-Forwarded-For`, `Forwarded`, `X-Real-IP`) are plain
//! request headers: any client can send them with any content. They are
//! believed **only** when the peer is one of the configured trusted proxies,
//! and even then only partly.
//!
//! Each proxy *appends* the address it received the connection from, so the
//! chain `header entries, left to right, then the peer` is written from the
//! right by hops of decreasing trustworthiness. [`ClientIp`] walks it from the
//! right, skipping addresses that are themselves trusted proxies; the first
//! untrusted address is the client. Everything to the left of it was written
//! by that client (or by proxies it chose) and may be forged, which is why the
//! leftmost entry is never used, unless every hop in the chain is trusted.
//! An entry that is not an IP address (`unknown`, an obfuscated `_hidden`
//! identifier, garbage) ends the walk: the nearest trusted hop seen so far is
//! then taken as the client, since nothing beyond it can be attributed.
//!
//! With no trusted proxies configured (the default) headers are never read at
//! all and the client is the peer.
//!
//! Work is bounded: at most [`MAX_CHAIN`] entries of the chain (the peer and
//! the nearest header entries) are examined, however long the header is.
//!
//! # Buckets
//!
//! For rate limiting, IPv6 clients are grouped by prefix (`/64` by default):
//! a single host usually owns a whole `/64` and could otherwise spread its
//! requests over 2^64 buckets. IPv4 addresses are not grouped by default
//! (`/32`). IPv4-mapped IPv6 addresses (`::ffff:192.0.2.1`) are treated as
//! the IPv4 addresses they are.
//!
//! # Example
//!
//! ```
//! use std::net::SocketAddr;
//!
//! use axum::extract::ConnectInfo;
//! use tower_redis_ratelimit::client_ip::ClientIp;
//!
//! // Our load balancers live in 10.0.0.0/8.
//! let client_ip = ClientIp::new().trust_proxy("10.0.0.0/8".parse().unwrap());
//!
//! // The client claims to be 198.51.100.1; the load balancer at 10.0.0.2
//! // appended the address it really saw, 203.0.113.7.
//! let mut request = http::Request::builder()
//!     .header("x-forwarded-for", "198.51.100.1, 203.0.113.7, 10.0.0.2")
//!     .body(())
//!     .unwrap();
//! request
//!     .extensions_mut()
//!     .insert(ConnectInfo(SocketAddr::from(([10, 0, 0, 1], 443))));
//! let (parts, ()) = request.into_parts();
//!
//! assert_eq!(
//!     client_ip.client_addr(&parts),
//!     Some("203.0.113.7".parse().unwrap())
//! );
//! assert_eq!(
//!     client_ip.client_net(&parts),
//!     Some("203.0.113.7/32".parse().unwrap())
//! );
//! ```

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::ConnectInfo;
use axum::extract::connect_info::MockConnectInfo;
use http::HeaderMap;
use http::header::FORWARDED;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// The peer address as axum's `ConnectInfo` extractor finds it: the real
/// `ConnectInfo`, else the `MockConnectInfo` a test router installed.
fn peer_addr(parts: &http::request::Parts) -> Option<SocketAddr> {
    if let Some(ConnectInfo(peer)) = parts.extensions.get::<ConnectInfo<SocketAddr>>() {
        return Some(*peer);
    }
    let MockConnectInfo(peer) = parts.extensions.get::<MockConnectInfo<SocketAddr>>()?;
    Some(*peer)
}

/// The most chain entries (the peer included) looked at for one request.
///
/// Bounds the work an attacker can cause with a long header. When every one
/// of these entries is a trusted proxy, the leftmost of them is the client.
/// (A `Forwarded` header is still scanned once, end to end, to find its
/// element boundaries, since quoted values may contain commas; only its last
/// `MAX_CHAIN - 1` elements are kept and parsed as addresses.)
pub const MAX_CHAIN: usize = 64;

const X_FORWARDED_FOR: &str = "x-forwarded-for";
const X_REAL_IP: &str = "x-real-ip";

/// Which proxy header carries the forwarded chain.
///
/// By default [`ClientIp`] reads the first present of `X-Forwarded-For`,
/// `Forwarded` and `X-Real-IP`. Pin the one your proxy actually sets with
/// [`ClientIp::forwarded_header`]: a proxy that sets only `X-Real-IP` passes a
/// client's forged `X-Forwarded-For` through untouched, and the default order
/// would then read the forgery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (de facto standard).
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239); the `for=` parameters.
    Forwarded,
    /// `X-Real-IP: client` (a single address, as set by e.g. nginx).
    XRealIp,
}

impl ForwardedHeader {
    /// The header name, lower case, as accepted by [`FromStr`].
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            ForwardedHeader::XForwardedFor => X_FORWARDED_FOR,
            ForwardedHeader::Forwarded => "forwarded",
            ForwardedHeader::XRealIp => X_REAL_IP,
        }
    }
}

impl fmt::Display for ForwardedHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names none of the [`ForwardedHeader`]s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown forwarded header {0:?}: expected \"x-forwarded-for\", \"forwarded\" or \"x-real-ip\""
)]
pub struct ParseForwardedHeaderError(String);

impl FromStr for ForwardedHeader {
    type Err = ParseForwardedHeaderError;

    /// Parses `x-forwarded-for`, `forwarded` or `x-real-ip`, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            ForwardedHeader::XForwardedFor,
            ForwardedHeader::Forwarded,
            ForwardedHeader::XRealIp,
        ]
        .into_iter()
        .find(|h| s.eq_ignore_ascii_case(h.as_str()))
        .ok_or_else(|| ParseForwardedHeaderError(s.to_owned()))
    }
}

/// An invalid [`ClientIp`] setting.
#[derive(Debug, thiserror::Error)]
pub enum ClientIpError {
    /// The IPv6 grouping prefix must be in `1..=128`.
    #[error("IPv6 prefix length {0} is out of range 1..=128")]
    Ipv6Prefix(u8),
    /// The IPv4 grouping prefix must be in `1..=32`.
    #[error("IPv4 prefix length {0} is out of range 1..=32")]
    Ipv4Prefix(u8),
}

/// How to find the client address of a request.
///
/// A configuration value, cheap to clone. The [`Default`] trusts no proxies
/// (headers are ignored and the client is the peer), groups IPv6 clients by
/// `/64` and does not group IPv4 clients (`/32`). See the
/// [module documentation](self) for the rule applied to proxy headers.
///
/// # Example
///
/// ```
/// use std::net::{IpAddr, SocketAddr};
///
/// use axum::extract::ConnectInfo;
/// use http::HeaderMap;
/// use tower_redis_ratelimit::client_ip::{ClientIp, ForwardedHeader};
///
/// let client_ip = ClientIp::new()
///     .trust_proxies(["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()])
///     .forwarded_header(ForwardedHeader::Forwarded)
///     .ipv6_prefix(56)
///     .unwrap();
///
/// // Lower level: an explicit peer and headers.
/// let mut headers = HeaderMap::new();
/// headers.insert(
///     "forwarded",
///     r#"for="[2001:db8:1:2::7]:4711";proto=https"#.parse().unwrap(),
/// );
/// let peer: IpAddr = "10.1.2.3".parse().unwrap();
/// let client = client_ip.client_addr_from(peer, &headers);
/// assert_eq!(client, "2001:db8:1:2::7".parse::<IpAddr>().unwrap());
/// assert_eq!(client_ip.group(client).to_string(), "2001:db8:1::/56");
///
/// // From a request: the peer comes from axum's `ConnectInfo`.
/// let mut request = http::Request::builder()
///     .header("forwarded", "for=192.0.2.60")
///     .body(())
///     .unwrap();
/// request
///     .extensions_mut()
///     .insert(ConnectInfo(SocketAddr::from(([10, 0, 0, 1], 8080))));
/// let (parts, ()) = request.into_parts();
/// assert_eq!(
///     client_ip.client_net(&parts),
///     Some("192.0.2.60/32".parse().unwrap())
/// );
///
/// // An untrusted peer's headers are ignored.
/// let stranger: IpAddr = "198.51.100.9".parse().unwrap();
/// assert_eq!(client_ip.client_addr_from(stranger, &headers), stranger);
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    /// Shared so that cloning the config (per service, per request) is cheap.
    trusted: Arc<[IpNet]>,
    header: Option<ForwardedHeader>,
    ipv6_prefix: u8,
    ipv4_prefix: u8,
}

impl Default for ClientIp {
    fn default() -> Self {
        ClientIp {
            trusted: Arc::new([]),
            header: None,
            ipv6_prefix: 64,
            ipv4_prefix: 32,
        }
    }
}

impl ClientIp {
    /// The default configuration: no trusted proxies, IPv6 `/64`, IPv4 `/32`.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the given networks to the trusted proxies.
    ///
    /// Proxy headers are read only when the peer is inside one of them, and
    /// addresses inside them are skipped when walking the chain. IPv4-mapped
    /// IPv6 networks (`::ffff:10.0.0.0/104`) are stored as the IPv4 networks
    /// they denote, since addresses are compared in their canonical form.
    #[must_use]
    pub fn trust_proxies(mut self, cidrs: impl IntoIterator<Item = IpNet>) -> Self {
        let mut trusted = self.trusted.to_vec();
        trusted.extend(cidrs.into_iter().map(canonical_net));
        self.trusted = trusted.into();
        self
    }

    /// Adds one network to the trusted proxies; see [`trust_proxies`](Self::trust_proxies).
    #[must_use]
    pub fn trust_proxy(self, cidr: IpNet) -> Self {
        self.trust_proxies([cidr])
    }

    /// Reads only `header`, instead of the first present of
    /// `X-Forwarded-For`, `Forwarded` and `X-Real-IP`.
    ///
    /// Pin the header your proxy sets: one that sets only `X-Real-IP` passes
    /// a forged `X-Forwarded-For` from the client through, and the default
    /// order would believe it.
    #[must_use]
    pub fn forwarded_header(mut self, header: ForwardedHeader) -> Self {
        self.header = Some(header);
        self
    }

    /// Groups IPv6 clients into buckets of this prefix length (default 64).
    ///
    /// # Errors
    ///
    /// [`ClientIpError::Ipv6Prefix`] unless `len` is in `1..=128`.
    pub fn ipv6_prefix(mut self, len: u8) -> Result<Self, ClientIpError> {
        if !(1..=128).contains(&len) {
            return Err(ClientIpError::Ipv6Prefix(len));
        }
        self.ipv6_prefix = len;
        Ok(self)
    }

    /// Groups IPv4 clients into buckets of this prefix length (default 32,
    /// i.e. no grouping).
    ///
    /// # Errors
    ///
    /// [`ClientIpError::Ipv4Prefix`] unless `len` is in `1..=32`.
    pub fn ipv4_prefix(mut self, len: u8) -> Result<Self, ClientIpError> {
        if !(1..=32).contains(&len) {
            return Err(ClientIpError::Ipv4Prefix(len));
        }
        self.ipv4_prefix = len;
        Ok(self)
    }

    /// The trusted proxy networks, in the order they were added.
    pub fn trusted_proxies(&self) -> &[IpNet] {
        &self.trusted
    }

    /// The client address (not grouped) from the peer and headers; `None`
    /// when the request has neither a `ConnectInfo<SocketAddr>` nor a
    /// `MockConnectInfo<SocketAddr>` extension.
    pub fn client_addr(&self, parts: &http::request::Parts) -> Option<IpAddr> {
        Some(self.client_addr_from(peer_addr(parts)?.ip(), &parts.headers))
    }

    /// Lower-level: the client address from an explicit peer address and
    /// header map (for tests and custom servers).
    ///
    /// The result is always the (canonical) peer or an address parsed from
    /// the chosen header.
    pub fn client_addr_from(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = peer.to_canonical();
        // Checked first so that the common, proxy-less setup never reads headers.
        if !self.is_trusted(peer) {
            return peer;
        }
        let Some(header) = self.header.or_else(|| first_present(headers)) else {
            return peer;
        };
        match header {
            ForwardedHeader::XForwardedFor => {
                let hops = headers
                    .get_all(X_FORWARDED_FOR)
                    .iter()
                    .rev()
                    .flat_map(|line| line.as_bytes().rsplit(|&b| b == b','))
                    .map(Hop::from_entry);
                self.walk(peer, hops)
            }
            ForwardedHeader::XRealIp => {
                // One address per line; several lines form a chain like XFF.
                let hops = headers
                    .get_all(X_REAL_IP)
                    .iter()
                    .rev()
                    .map(|line| Hop::from_entry(line.as_bytes()));
                self.walk(peer, hops)
            }
            ForwardedHeader::Forwarded => {
                // Quoted strings may hide commas, so elements are found by a
                // forward scan; only the nearest ones are kept.
                let mut tail = Tail::new();
                for line in headers.get_all(FORWARDED) {
                    parse_forwarded(line.as_bytes(), &mut tail);
                }
                self.walk(peer, tail.iter_rev())
            }
        }
    }

    /// The rate-limit bucket of the client: its address truncated to the
    /// configured prefix (e.g. `2001:db8:1:2::/64`, `203.0.113.7/32`);
    /// `None` when the request has no `ConnectInfo<SocketAddr>` extension.
    pub fn client_net(&self, parts: &http::request::Parts) -> Option<IpNet> {
        self.client_addr(parts).map(|addr| self.group(addr))
    }

    /// The bucket of `addr`: the address (IPv4-mapped IPv6 taken as IPv4)
    /// truncated to the configured IPv4 or IPv6 prefix.
    pub fn group(&self, addr: IpAddr) -> IpNet {
        // The prefixes were range-checked by the setters, so `new` cannot fail.
        match addr.to_canonical() {
            IpAddr::V4(a) => Ipv4Net::new(a, self.ipv4_prefix)
                .expect("IPv4 prefix validated")
                .trunc()
                .into(),
            IpAddr::V6(a) => Ipv6Net::new(a, self.ipv6_prefix)
                .expect("IPv6 prefix validated")
                .trunc()
                .into(),
        }
    }

    fn is_trusted(&self, addr: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&addr))
    }

    /// Walks the chain from the right, `peer` (already known trusted) first,
    /// then `hops` nearest first.
    fn walk<'a>(&self, peer: IpAddr, hops: impl Iterator<Item = Hop<'a>>) -> IpAddr {
        let mut nearest_trusted = peer;
        for hop in hops.take(MAX_CHAIN - 1) {
            let addr = match hop {
                Hop::Empty => continue,
                Hop::Unknown => return nearest_trusted,
                Hop::Node(raw) => match parse_node(raw) {
                    Some(addr) => addr,
                    None => return nearest_trusted,
                },
            };
            if !self.is_trusted(addr) {
                return addr;
            }
            nearest_trusted = addr;
        }
        nearest_trusted
    }
}

/// The default header choice: the first present, in a fixed order.
fn first_present(headers: &HeaderMap) -> Option<ForwardedHeader> {
    if headers.contains_key(X_FORWARDED_FOR) {
        Some(ForwardedHeader::XForwardedFor)
    } else if headers.contains_key(FORWARDED) {
        Some(ForwardedHeader::Forwarded)
    } else if headers.contains_key(X_REAL_IP) {
        Some(ForwardedHeader::XRealIp)
    } else {
        None
    }
}

/// Stores `::ffff:a.b.c.d/n` (n >= 96) as `a.b.c.d/(n-96)`, to match
/// canonicalised addresses.
fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net
        && v6.prefix_len() >= 96
        && let Some(v4) = v6.addr().to_ipv4_mapped()
        && let Ok(v4net) = Ipv4Net::new(v4, v6.prefix_len() - 96)
    {
        return v4net.into();
    }
    net
}

/// One entry of a forwarded chain, not yet parsed.
#[derive(Debug, Clone, Copy)]
enum Hop<'a> {
    /// An empty list element; HTTP list syntax allows these, they carry no hop.
    Empty,
    /// A hop that says nothing usable (a `Forwarded` element without a valid
    /// `for=`).
    Unknown,
    /// A node: an address, maybe with a port, or `unknown`, `_hidden`, garbage.
    Node(&'a [u8]),
}

impl<'a> Hop<'a> {
    fn from_entry(raw: &'a [u8]) -> Self {
        let raw = raw.trim_ascii();
        if raw.is_empty() {
            Hop::Empty
        } else {
            Hop::Node(raw)
        }
    }
}

/// Longer than any address with a port (`[v6 with embedded v4]:65535` is 53).
const MAX_NODE_LEN: usize = 64;

/// Parses `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]`,
/// `[2001:db8::1]:80` (also with an obfuscated `_port`) into a canonical address.
fn parse_node(raw: &[u8]) -> Option<IpAddr> {
    if raw.len() > MAX_NODE_LEN {
        return None;
    }
    let s = std::str::from_utf8(raw).ok()?;
    let addr = if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        IpAddr::V6(host.parse::<Ipv6Addr>().ok()?)
    } else if let Ok(addr) = s.parse::<IpAddr>() {
        addr
    } else {
        // A bare IPv6 address with a port would be ambiguous, so only IPv4
        // takes the `host:port` form without brackets.
        let (host, port) = s.rsplit_once(':')?;
        if !is_port(port) {
            return None;
        }
        IpAddr::V4(host.parse::<Ipv4Addr>().ok()?)
    };
    Some(addr.to_canonical())
}

/// A decimal port, or an RFC 7239 obfuscated port (`_` then token chars).
fn is_port(p: &str) -> bool {
    match p.strip_prefix('_') {
        Some(obf) => {
            !obf.is_empty()
                && obf
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        }
        None => (1..=5).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// The last `MAX_CHAIN - 1` hops of a `Forwarded` header, in a fixed buffer
/// so that no allocation is needed.
struct Tail<'a> {
    buf: [Hop<'a>; MAX_CHAIN - 1],
    /// Hops pushed in total; the newest is at `(pushed - 1) % len`.
    pushed: usize,
}

impl<'a> Tail<'a> {
    fn new() -> Self {
        Tail {
            buf: [Hop::Empty; MAX_CHAIN - 1],
            pushed: 0,
        }
    }

    fn push(&mut self, hop: Hop<'a>) {
        let len = self.buf.len();
        self.buf[self.pushed % len] = hop;
        self.pushed += 1;
    }

    /// Newest first.
    fn iter_rev(&self) -> impl Iterator<Item = Hop<'a>> + '_ {
        let len = self.buf.len();
        (0..self.pushed.min(len)).map(move |i| self.buf[(self.pushed - 1 - i) % len])
    }
}

/// Splits one `Forwarded` header line into elements and records each one's
/// `for=` value (RFC 7239 section 4). Lenient where that is harmless (spaces
/// around `;` and `,`, unquoted brackets); anything else makes the element
/// [`Hop::Unknown`], which stops the walk. Quoted values are taken raw: an IP
/// address never needs a backslash escape.
fn parse_forwarded<'a>(s: &'a [u8], tail: &mut Tail<'a>) {
    let mut i = 0;
    loop {
        let (hop, next) = parse_forwarded_element(s, i);
        tail.push(hop);
        match next {
            Some(n) => i = n,
            None => return,
        }
    }
}

/// Parses the element starting at `i`; returns it and the index after its
/// closing comma, or `None` at the end of the line.
fn parse_forwarded_element(s: &[u8], mut i: usize) -> (Hop<'_>, Option<usize>) {
    let mut any = false;
    let mut bad = false;
    let mut for_value: Option<&[u8]> = None;
    loop {
        i = skip_ows(s, i);
        match s.get(i) {
            None | Some(b',') => break,
            Some(b';') => {
                any = true;
                i += 1;
                continue;
            }
            Some(_) => any = true,
        }
        let name_start = i;
        while s.get(i).is_some_and(|&b| is_tchar(b)) {
            i += 1;
        }
        let name = &s[name_start..i];
        if name.is_empty() || s.get(i) != Some(&b'=') {
            bad = true;
            i = skip_to_comma(s, i);
            break;
        }
        i += 1;
        let value = if s.get(i) == Some(&b'"') {
            let start = i + 1;
            let Some(end) = closing_quote(s, start) else {
                // Unterminated quoted string: the rest of the line is this element.
                return (Hop::Unknown, None);
            };
            i = end + 1;
            &s[start..end]
        } else {
            let start = i;
            while s
                .get(i)
                .is_some_and(|&b| !matches!(b, b';' | b',' | b' ' | b'\t'))
            {
                i += 1;
            }
            &s[start..i]
        };
        if name.eq_ignore_ascii_case(b"for") {
            // RFC 7239: a parameter must not occur twice in one element.
            bad |= for_value.replace(value).is_some();
        }
        i = skip_ows(s, i);
        match s.get(i) {
            None | Some(b',') => break,
            Some(b';') => i += 1,
            Some(_) => {
                bad = true;
                i = skip_to_comma(s, i);
                break;
            }
        }
    }
    let hop = match (any, bad, for_value) {
        (false, _, _) => Hop::Empty,
        (true, false, Some(value)) => Hop::Node(value.trim_ascii()),
        _ => Hop::Unknown,
    };
    let next = (i < s.len()).then_some(i + 1);
    (hop, next)
}

fn skip_ows(s: &[u8], mut i: usize) -> usize {
    while matches!(s.get(i), Some(b' ' | b'\t')) {
        i += 1;
    }
    i
}

/// The index of the quote closing a quoted string whose content starts at `i`.
fn closing_quote(s: &[u8], mut i: usize) -> Option<usize> {
    while i < s.len() {
        match s[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// The index of the next comma outside quoted strings, or the end.
fn skip_to_comma(s: &[u8], mut i: usize) -> usize {
    while let Some(&b) = s.get(i) {
        match b {
            b',' => return i,
            b'"' => match closing_quote(s, i + 1) {
                Some(end) => i = end + 1,
                None => return s.len(),
            },
            _ => i += 1,
        }
    }
    i
}

/// RFC 9110 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for &(name, value) in pairs {
            map.append(name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    /// Trusts 10.0.0.0/8 and fd00::/8.
    fn behind_proxy() -> ClientIp {
        ClientIp::new().trust_proxies([net("10.0.0.0/8"), net("fd00::/8")])
    }

    const PROXY: &str = "10.0.0.1";

    #[test]
    fn defaults() {
        let c = ClientIp::default();
        assert!(c.trusted_proxies().is_empty());
        assert_eq!(
            c.group(ip("2001:db8:1:2:3:4:5:6")),
            net("2001:db8:1:2::/64")
        );
        assert_eq!(c.group(ip("203.0.113.7")), net("203.0.113.7/32"));
    }

    #[test]
    fn no_trusted_proxies_ignores_headers() {
        let h = headers(&[("x-forwarded-for", "1.2.3.4"), ("x-real-ip", "5.6.7.8")]);
        assert_eq!(ClientIp::new().client_addr_from(ip(PROXY), &h), ip(PROXY));
    }

    #[test]
    fn untrusted_peer_with_spoofed_xff_is_peer() {
        let h = headers(&[("x-forwarded-for", "1.2.3.4, 10.0.0.5")]);
        let peer = ip("198.51.100.20");
        assert_eq!(behind_proxy().client_addr_from(peer, &h), peer);
    }

    #[test]
    fn trusted_peer_rightmost_untrusted_wins() {
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 203.0.113.7")]);
        assert_eq!(
            behind_proxy().client_addr_from(ip(PROXY), &h),
            ip("203.0.113.7")
        );
    }

    #[test]
    fn chain_of_two_trusted_proxies() {
        // client -> 10.0.0.9 -> 10.0.0.1 (peer)
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.0.0.9")]);
        assert_eq!(
            behind_proxy().client_addr_from(ip(PROXY), &h),
            ip("203.0.113.7")
        );
    }

    #[test]
    fn all_hops_trusted_gives_leftmost() {
        let h = headers(&[("x-forwarded-for", "10.9.9.9, 10.0.0.9")]);
        assert_eq!(
            behind_proxy().client_addr_from(ip(PROXY), &h),
            ip("10.9.9.9")
        );
    }

    #[test]
    fn garbage_entry_stops_at_nearest_trusted_hop() {
        let c = behind_proxy();
        let h = headers(&[("x-forwarded-for", "203.0.113.7, garbage, 10.0.0.9")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("10.0.0.9"));
        let h = headers(&[("x-forwarded-for", "203.0.113.7, not-an-ip")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
        let h = headers(&[("x-forwarded-for", "unknown")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
        // Garbage left of the client is never reached.
        let h = headers(&[("x-forwarded-for", "%%%, 203.0.113.7")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.7"));
    }

    #[test]
    fn empty_list_elements_are_skipped() {
        let c = behind_proxy();
        let h = headers(&[("x-forwarded-for", "203.0.113.7, ,10.0.0.9,")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.7"));
        let h = headers(&[("x-forwarded-for", "")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
    }

    #[test]
    fn ports_are_stripped() {
        let c = behind_proxy();
        let h = headers(&[("x-forwarded-for", "203.0.113.7:5678")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.7"));
        let h = headers(&[("x-forwarded-for", "[2001:db8::1]:80, 10.0.0.9:443")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("2001:db8::1"));
        let h = headers(&[("x-forwarded-for", "[2001:db8::2]")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("2001:db8::2"));
        let h = headers(&[("x-forwarded-for", "2001:db8::3")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("2001:db8::3"));
        // Bad ports make the entry garbage.
        let h = headers(&[("x-forwarded-for", "203.0.113.7:123456")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
        let h = headers(&[("x-forwarded-for", "[2001:db8::1]x")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
    }

    #[test]
    fn forwarded_quoted_ipv6_with_port() {
        let h = headers(&[("forwarded", r#"for="[2001:db8:cafe::17]:4711""#)]);
        assert_eq!(
            behind_proxy().client_addr_from(ip(PROXY), &h),
            ip("2001:db8:cafe::17")
        );
    }

    #[test]
    fn forwarded_multiple_elements_and_params() {
        let c = behind_proxy();
        let h = headers(&[(
            "forwarded",
            "for=192.0.2.60;proto=http;by=203.0.113.43, For=198.51.100.17;Proto=https",
        )]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("198.51.100.17"));
        // Trusted hops are skipped; param name case is ignored; spaces tolerated.
        let h = headers(&[(
            "forwarded",
            r#"for=192.0.2.60 ; proto=http, FOR="10.0.0.9:8080";by=_lb"#,
        )]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("192.0.2.60"));
        // A comma inside a quoted value does not split the element.
        let h = headers(&[(
            "forwarded",
            r#"for=192.0.2.60;ext="a,b;for=6.6.6.6", for=10.0.0.9"#,
        )]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("192.0.2.60"));
    }

    #[test]
    fn forwarded_multiple_lines() {
        let h = headers(&[
            ("forwarded", "for=6.6.6.6, for=192.0.2.60"),
            ("forwarded", "for=10.0.0.9"),
        ]);
        assert_eq!(
            behind_proxy().client_addr_from(ip(PROXY), &h),
            ip("192.0.2.60")
        );
    }

    #[test]
    fn forwarded_unknown_and_obfuscated_stop_the_walk() {
        let c = behind_proxy();
        let h = headers(&[("forwarded", "for=192.0.2.60, for=unknown")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
        let h = headers(&[("forwarded", "for=192.0.2.60, for=_hidden, for=10.0.0.9")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("10.0.0.9"));
        // An obfuscated port is fine.
        let h = headers(&[("forwarded", r#"for="[2001:db8::5]:_p1""#)]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("2001:db8::5"));
        // An element without `for=`, with a repeated `for=`, or malformed.
        for value in [
            "for=192.0.2.60, proto=https",
            "for=192.0.2.60, for=198.51.100.1;for=198.51.100.2",
            "for=192.0.2.60, for",
            "for=192.0.2.60, for=\"198.51.100.1",
            "for=192.0.2.60, for=198.51.100.1 junk",
        ] {
            let h = headers(&[("forwarded", value)]);
            assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY), "{value}");
        }
    }

    #[test]
    fn x_real_ip() {
        let c = behind_proxy();
        let h = headers(&[("x-real-ip", " 203.0.113.7 ")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.7"));
        let h = headers(&[("x-real-ip", "203.0.113.7, 198.51.100.1")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
    }

    #[test]
    fn default_order_prefers_xff_then_forwarded() {
        let c = behind_proxy();
        let h = headers(&[
            ("x-real-ip", "203.0.113.3"),
            ("forwarded", "for=203.0.113.2"),
            ("x-forwarded-for", "203.0.113.1"),
        ]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.1"));
        let h = headers(&[
            ("x-real-ip", "203.0.113.3"),
            ("forwarded", "for=203.0.113.2"),
        ]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.2"));
    }

    #[test]
    fn pinned_header_ignores_forged_others() {
        // The proxy sets only X-Real-IP and passes the client's forged XFF on.
        let c = behind_proxy().forwarded_header(ForwardedHeader::XRealIp);
        let h = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("forwarded", "for=2.2.2.2"),
            ("x-real-ip", "203.0.113.7"),
        ]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.7"));
        // Pinned header absent: the peer, never a fallback to the others.
        let h = headers(&[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
        let c = behind_proxy().forwarded_header(ForwardedHeader::Forwarded);
        let h = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("forwarded", "for=203.0.113.8"),
        ]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.8"));
    }

    #[test]
    fn multiple_xff_lines_are_concatenated() {
        let c = behind_proxy();
        let h = headers(&[
            ("x-forwarded-for", "6.6.6.6, 203.0.113.7"),
            ("x-forwarded-for", "10.0.0.8, 10.0.0.9"),
        ]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.7"));
        let h = headers(&[
            ("x-forwarded-for", "203.0.113.7"),
            ("x-forwarded-for", "198.51.100.1"),
        ]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("198.51.100.1"));
    }

    #[test]
    fn ipv4_mapped_is_ipv4() {
        let c = behind_proxy();
        // Mapped peer inside an IPv4 trusted network.
        let h = headers(&[(
            "x-forwarded-for",
            "::ffff:203.0.113.7, [::ffff:10.0.0.9]:80",
        )]);
        let got = c.client_addr_from(ip("::ffff:10.0.0.1"), &h);
        assert_eq!(got, ip("203.0.113.7"));
        assert!(got.is_ipv4());
        assert_eq!(c.group(ip("::ffff:203.0.113.7")), net("203.0.113.7/32"));
        // An untrusted mapped peer comes back canonical too.
        let peer = c.client_addr_from(ip("::ffff:198.51.100.1"), &h);
        assert_eq!(peer, IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1)));
        // Mapped trusted networks are stored as IPv4.
        let c = ClientIp::new().trust_proxy(net("::ffff:10.0.0.0/104"));
        assert_eq!(c.trusted_proxies(), &[net("10.0.0.0/8")]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.7"));
    }

    #[test]
    fn ipv6_grouped_by_64() {
        let c = ClientIp::new();
        let a = c.group(ip("2001:db8:1:2::1"));
        let b = c.group(ip("2001:db8:1:2:ffff:ffff:ffff:ffff"));
        let other = c.group(ip("2001:db8:1:3::1"));
        assert_eq!(a, b);
        assert_ne!(a, other);
        assert_eq!(a.to_string(), "2001:db8:1:2::/64");
        // IPv4 is not grouped by default.
        assert_ne!(c.group(ip("203.0.113.7")), c.group(ip("203.0.113.8")));
    }

    #[test]
    fn configured_prefixes() {
        let c = ClientIp::new()
            .ipv6_prefix(48)
            .unwrap()
            .ipv4_prefix(24)
            .unwrap();
        assert_eq!(c.group(ip("2001:db8:1:2::1")), net("2001:db8:1::/48"));
        assert_eq!(c.group(ip("203.0.113.7")), net("203.0.113.0/24"));
        let c = ClientIp::new()
            .ipv6_prefix(128)
            .unwrap()
            .ipv4_prefix(1)
            .unwrap();
        assert_eq!(c.group(ip("2001:db8::1")), net("2001:db8::1/128"));
        assert_eq!(c.group(ip("203.0.113.7")), net("128.0.0.0/1"));
        assert!(ClientIp::new().ipv6_prefix(1).is_ok());
    }

    #[test]
    fn prefix_config_errors() {
        for len in [0, 129, 255] {
            let err = ClientIp::new().ipv6_prefix(len).unwrap_err();
            assert!(matches!(err, ClientIpError::Ipv6Prefix(l) if l == len));
        }
        for len in [0, 33, 128] {
            let err = ClientIp::new().ipv4_prefix(len).unwrap_err();
            assert!(matches!(err, ClientIpError::Ipv4Prefix(l) if l == len));
        }
        assert_eq!(
            ClientIp::new().ipv6_prefix(0).unwrap_err().to_string(),
            "IPv6 prefix length 0 is out of range 1..=128"
        );
        assert_eq!(
            ClientIp::new().ipv4_prefix(33).unwrap_err().to_string(),
            "IPv4 prefix length 33 is out of range 1..=32"
        );
    }

    #[test]
    fn non_utf8_header_bytes_do_not_panic() {
        let c = behind_proxy();
        for name in [X_FORWARDED_FOR, "forwarded", X_REAL_IP] {
            let mut h = HeaderMap::new();
            h.insert(
                name,
                HeaderValue::from_bytes(b"\xff\xfe1.2.3.4, \x80for=\"\xc3\x28").unwrap(),
            );
            assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY), "{name}");
        }
        // Non-UTF-8 left of the client is never looked at.
        let mut h = HeaderMap::new();
        h.insert(
            X_FORWARDED_FOR,
            HeaderValue::from_bytes(b"\xff, 203.0.113.7").unwrap(),
        );
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip("203.0.113.7"));
    }

    #[test]
    fn huge_headers_are_bounded() {
        let c = behind_proxy();
        // 1000 trusted hops: only the nearest MAX_CHAIN - 1 are examined, and
        // the leftmost of those is taken as the client.
        let hops: Vec<String> = (0..1000)
            .map(|i| format!("10.1.{}.{}", i / 256, i % 256))
            .collect();
        let expected = ip(&hops[1000 - (MAX_CHAIN - 1)]);
        let xff = format!("203.0.113.7, {}", hops.join(", "));
        let h = headers(&[("x-forwarded-for", &xff)]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), expected);
        let fwd: Vec<String> = hops.iter().map(|h| format!("for={h}")).collect();
        let h = headers(&[("forwarded", &fwd.join(", "))]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), expected);
        // One long entry is garbage, not a slow parse.
        let long = "1".repeat(100_000);
        let h = headers(&[("x-forwarded-for", &long)]);
        assert_eq!(c.client_addr_from(ip(PROXY), &h), ip(PROXY));
    }

    fn parts_with(
        peer: Option<SocketAddr>,
        pairs: &[(&'static str, &str)],
    ) -> http::request::Parts {
        let mut builder = http::Request::builder();
        for &(name, value) in pairs {
            builder = builder.header(name, value);
        }
        let mut parts = builder.body(()).unwrap().into_parts().0;
        if let Some(peer) = peer {
            parts.extensions.insert(ConnectInfo(peer));
        }
        parts
    }

    #[test]
    fn no_connect_info_is_none() {
        let parts = parts_with(None, &[("x-forwarded-for", "203.0.113.7")]);
        assert_eq!(behind_proxy().client_addr(&parts), None);
        assert_eq!(behind_proxy().client_net(&parts), None);
    }

    #[test]
    fn from_request_parts() {
        let c = behind_proxy();
        let peer = SocketAddr::from(([10, 0, 0, 1], 40000));
        let parts = parts_with(Some(peer), &[("x-forwarded-for", "2001:db8:1:2::99")]);
        assert_eq!(c.client_addr(&parts), Some(ip("2001:db8:1:2::99")));
        assert_eq!(c.client_net(&parts), Some(net("2001:db8:1:2::/64")));
        let parts = parts_with(Some("[2001:db8::7]:1234".parse().unwrap()), &[]);
        assert_eq!(c.client_addr(&parts), Some(ip("2001:db8::7")));
        assert_eq!(c.client_net(&parts), Some(net("2001:db8::/64")));
        let parts = parts_with(Some("203.0.113.7:1".parse().unwrap()), &[]);
        assert_eq!(c.client_net(&parts), Some(net("203.0.113.7/32")));
    }

    #[test]
    fn builder_accumulates_trusted_proxies() {
        let c = ClientIp::new()
            .trust_proxy(net("10.0.0.0/8"))
            .trust_proxies([net("192.168.0.0/16"), net("fd00::/8")]);
        assert_eq!(
            c.trusted_proxies(),
            &[net("10.0.0.0/8"), net("192.168.0.0/16"), net("fd00::/8")]
        );
        let h = headers(&[("x-forwarded-for", "203.0.113.7, 192.168.1.1")]);
        assert_eq!(c.client_addr_from(ip("fd00::1"), &h), ip("203.0.113.7"));
    }

    #[test]
    fn forwarded_header_from_str() {
        assert_eq!(
            "x-forwarded-for".parse(),
            Ok(ForwardedHeader::XForwardedFor)
        );
        assert_eq!(
            "X-Forwarded-For".parse(),
            Ok(ForwardedHeader::XForwardedFor)
        );
        assert_eq!("FORWARDED".parse(), Ok(ForwardedHeader::Forwarded));
        assert_eq!("x-real-ip".parse(), Ok(ForwardedHeader::XRealIp));
        let err = "x-forwarded".parse::<ForwardedHeader>().unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"unknown forwarded header "x-forwarded": expected "x-forwarded-for", "forwarded" or "x-real-ip""#
        );
        for h in [
            ForwardedHeader::XForwardedFor,
            ForwardedHeader::Forwarded,
            ForwardedHeader::XRealIp,
        ] {
            assert_eq!(h.to_string().parse(), Ok(h));
        }
    }

    /// Header values made of address-like pieces, separators and junk.
    fn header_value() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            any::<Ipv4Addr>().prop_map(|a| a.to_string()),
            any::<Ipv6Addr>().prop_map(|a| a.to_string()),
            any::<Ipv6Addr>().prop_map(|a| format!("[{a}]:443")),
            any::<Ipv4Addr>().prop_map(|a| format!("{a}:80")),
            any::<Ipv4Addr>().prop_map(|a| format!("::ffff:{a}")),
            (0u8..=255).prop_map(|b| format!("10.0.0.{b}")),
            Just("fd00::1".to_owned()),
            Just("for=".to_owned()),
            Just("\"".to_owned()),
            Just("unknown".to_owned()),
            Just("_hidden".to_owned()),
            Just(", ".to_owned()),
            Just(";".to_owned()),
            "[ -~]{0,8}",
        ];
        prop_oneof![
            proptest::collection::vec(piece, 0..12).prop_map(|p| p.concat().into_bytes()),
            proptest::collection::vec(any::<u8>(), 0..200),
        ]
    }

    fn check_result(
        c: &ClientIp,
        name: &'static str,
        values: &[Vec<u8>],
    ) -> Result<(), TestCaseError> {
        // Drop bytes a HeaderValue cannot hold (controls other than tab).
        let values: Vec<Vec<u8>> = values
            .iter()
            .map(|v| {
                v.iter()
                    .copied()
                    .filter(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
                    .collect()
            })
            .collect();
        let mut h = HeaderMap::new();
        for v in &values {
            h.append(name, HeaderValue::from_bytes(v).unwrap());
        }
        let peer = ip(PROXY);
        let got = c.client_addr_from(peer, &h);
        if got != peer {
            let text = got.to_string();
            // Either its canonical text is in the header, or some run of
            // address characters there spells it differently
            // (`fd00::10.0.0.0` is `fd00::a00:0`, `::ffff:1.2.3.4` is `1.2.3.4`).
            let found = values.iter().any(|v| {
                v.windows(text.len()).any(|w| w == text.as_bytes())
                    || v.split(|b| !(b.is_ascii_hexdigit() || matches!(b, b'.' | b':')))
                        .filter_map(|run| std::str::from_utf8(run).ok()?.parse::<IpAddr>().ok())
                        .any(|a| a.to_canonical() == got)
            });
            prop_assert!(found, "{got} is neither the peer nor in the header");
        }
        Ok(())
    }

    /// A chain hop: a trusted proxy (10/8) or a public address.
    fn hop() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<u32>().prop_map(|n| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | (n & 0xff_ffff)))),
            (1u32..0x0a00_0000).prop_map(|n| IpAddr::V4(Ipv4Addr::from(n))),
            any::<u128>()
                .prop_map(|n| IpAddr::V6(Ipv6Addr::from((0x2001_0db8_u128 << 96) | (n >> 32)))),
        ]
    }

    proptest! {
        /// Model check: the result is the rightmost untrusted hop, or the
        /// leftmost hop when all are trusted, whichever header carries the chain.
        #[test]
        fn chain_model(chain in proptest::collection::vec(hop(), 1..20)) {
            let c = behind_proxy();
            let expected = chain
                .iter()
                .rev()
                .find(|a| !c.is_trusted(**a))
                .copied()
                .unwrap_or(chain[0]);
            let xff: Vec<String> = chain
                .iter()
                .map(|a| match a {
                    IpAddr::V4(a) => format!("{a}:1234"),
                    IpAddr::V6(a) => format!("[{a}]:1234"),
                })
                .collect();
            let h = headers(&[("x-forwarded-for", &xff.join(","))]);
            prop_assert_eq!(c.client_addr_from(ip(PROXY), &h), expected);
            let fwd: Vec<String> = chain
                .iter()
                .map(|a| match a {
                    IpAddr::V4(a) => format!("for={a};proto=https"),
                    IpAddr::V6(a) => format!("for=\"[{a}]\""),
                })
                .collect();
            let h = headers(&[("forwarded", &fwd.join(", "))]);
            prop_assert_eq!(c.client_addr_from(ip(PROXY), &h), expected);
            // The same chain behind an untrusted peer changes nothing.
            let stranger = ip("198.51.100.200");
            prop_assert_eq!(c.client_addr_from(stranger, &h), stranger);
        }

        #[test]
        fn arbitrary_headers_never_panic(
            values in proptest::collection::vec(header_value(), 0..3),
            which in 0usize..3,
            pinned in any::<bool>(),
        ) {
            let name = [X_FORWARDED_FOR, "forwarded", X_REAL_IP][which];
            let mut c = behind_proxy();
            if pinned {
                c = c.forwarded_header(
                    [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded, ForwardedHeader::XRealIp][which],
                );
            }
            check_result(&c, name, &values)?;
        }
    }
}
