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

fn parts_with(peer: Option<SocketAddr>, pairs: &[(&'static str, &str)]) -> http::request::Parts {
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

fn check_result(c: &ClientIp, name: &'static str, values: &[Vec<u8>]) -> Result<(), TestCaseError> {
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
