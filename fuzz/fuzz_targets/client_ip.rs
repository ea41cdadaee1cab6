//! The client-IP chain: `X-Forwarded-For`, `Forwarded` or `X-Real-IP` behind trusted proxies.
//! Property: the address found is the peer's or one written in the header's values (an
//! IPv4-mapped IPv6 address counting as the IPv4 address it maps).
#![no_main]

use std::net::{IpAddr, SocketAddr};

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;
use libfuzzer_sys::fuzz_target;
use tower_redis_ratelimit::client_ip::{ClientIp, ForwardedHeader};

#[derive(Debug, Arbitrary)]
struct Input {
    peer: IpAddr,
    trusted: Vec<(IpAddr, u8)>,
    header: u8,
    values: Vec<Vec<u8>>,
}

/// Every address written in `text`: between separators, bare, bracketed, or with a port.
fn addresses(text: &str) -> Vec<IpAddr> {
    text.split([',', ';', ' ', '\t', '"', '='])
        .filter(|token| !token.is_empty())
        .filter_map(|token| {
            token
                .parse::<IpAddr>()
                .ok()
                .or_else(|| token.parse::<SocketAddr>().ok().map(|addr| addr.ip()))
                .or_else(|| {
                    let inner = token.strip_prefix('[')?;
                    let inner = inner.split(']').next()?;
                    inner.parse().ok()
                })
        })
        .collect()
}

fuzz_target!(|input: Input| {
    let header = match input.header % 3 {
        0 => ForwardedHeader::XForwardedFor,
        1 => ForwardedHeader::Forwarded,
        _ => ForwardedHeader::XRealIp,
    };
    let trusted = input
        .trusted
        .iter()
        .filter_map(|&(addr, len)| IpNet::new(addr, len % 129).ok());
    let client_ip = ClientIp::new()
        .trust_proxies(trusted)
        .forwarded_header(header);
    let name = header.as_str();
    let mut headers = HeaderMap::new();
    let mut written = Vec::new();
    for value in &input.values {
        if let Ok(value) = HeaderValue::from_bytes(value) {
            written.extend(addresses(&String::from_utf8_lossy(value.as_bytes())));
            headers.append(name, value);
        }
    }
    // (An IPv4-mapped IPv6 address is found as the IPv4 address it maps.)
    let found = client_ip
        .client_addr_from(input.peer, &headers)
        .to_canonical();
    assert!(
        found == input.peer.to_canonical()
            || written.iter().any(|addr| addr.to_canonical() == found),
        "{found} is neither the peer {} nor in {headers:?}",
        input.peer
    );
});
