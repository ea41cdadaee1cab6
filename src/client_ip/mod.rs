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
mod tests;
