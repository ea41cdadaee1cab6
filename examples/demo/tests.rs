//! The demo's tests: its config checks, its routes and answers, its operator listener and its
//! stores, run as `cargo test --all-features --example demo`.

use super::*;

use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use http::{HeaderMap, Method, Request, StatusCode};
use ipnet::IpNet;
use tower::ServiceExt;
use tower_redis_ratelimit::config::StoreSpec;
use tower_redis_ratelimit::{
    Algorithm, Mode, OnStoreError, client_ip::ForwardedHeader, policy::Scope,
};

/// The default config with `from` (which must occur exactly once) replaced by `to`.
fn edited(from: &str, to: &str) -> String {
    assert_eq!(DEFAULT_CONFIG.matches(from).count(), 1, "{from:?}");
    DEFAULT_CONFIG.replacen(from, to, 1)
}

fn error_of(text: &str) -> String {
    load_config(text)
        .expect_err("the config should be refused")
        .to_string()
}

/// Asserts that each config is refused with exactly its message; lists every mismatch.
fn assert_refused<T: AsRef<str>>(cases: &[(String, T)]) {
    let wrong: Vec<String> = cases
        .iter()
        .filter_map(|(text, expected)| {
            let actual = match load_config(text) {
                Ok(_) => "(accepted)".to_owned(),
                Err(error) => error.to_string(),
            };
            let expected = expected.as_ref();
            (actual != expected)
                .then(|| format!("expected: {expected}\n  actual: {actual}\nconfig:\n{text}"))
        })
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
}

fn route_config(key: &str, rules: &str) -> String {
    edited("key = \"ip\"", &format!("key = \"{key}\"")).replacen(
        "rules = [{ limit = 20, period = \"1m\" }, { limit = 100, period = \"1h\" }]",
        &format!("rules = {rules}"),
        1,
    )
}

#[test]
fn shipped_config_parses_to_the_expected_values() {
    let config = load_config(DEFAULT_CONFIG).unwrap();
    assert_eq!(config.listen, SocketAddr::from(([127, 0, 0, 1], 3000)));
    assert_eq!(config.metrics, None);
    assert!(!config.no_limiter);
    let limits = &config.limits;
    assert_eq!(limits.store_spec(), &StoreSpec::Memory);
    assert_eq!(limits.store_tls(), None);
    assert_eq!(limits.wait_for_replicas(), 0);
    assert_eq!(limits.prefix(), "demo");
    assert_eq!(limits.trusted_proxies(), &[] as &[IpNet]);
    assert_eq!(limits.forwarded_header(), None);
    assert!(!limits.legacy_headers());
    let [route] = limits.routes() else {
        panic!("one route expected, got {}", limits.routes().len());
    };
    assert_eq!((route.path(), route.key()), ("/api/ping", "ip"));
    let policy = route.policy();
    assert_eq!(policy.name(), "/api/ping");
    assert_eq!(policy.prefix(), "demo");
    assert_eq!(policy.key().kind(), "ip");
    assert_eq!(policy.algorithm(), Algorithm::SlidingLog);
    assert_eq!(policy.scope(), Scope::Policy);
    assert_eq!(policy.mode(), Mode::Enforce);
    assert_eq!(policy.on_store_error(), OnStoreError::Allow);
    assert_eq!(policy.rules(), [Rule::per_minute(20), Rule::per_hour(100)]);
    assert_eq!(policy.client_ip().trusted_proxies(), &[] as &[IpNet]);
}

#[test]
fn listen_defaults_to_port_3000_on_loopback() {
    let config = load_config(&edited("listen = \"127.0.0.1:3000\"\n", "")).unwrap();
    assert_eq!(config.listen, SocketAddr::from(([127, 0, 0, 1], 3000)));
    // The smallest file: a route and its rules; the rest are the crate's defaults.
    let minimal = "[[routes]]\npath = \"/api/ping\"\nrules = [{ limit = 10, period = \"1m\" }]\n";
    let config = load_config(minimal).unwrap();
    assert_eq!(
        (config.listen, config.metrics),
        (SocketAddr::from(([127, 0, 0, 1], 3000)), None)
    );
    assert_eq!(
        banner(&config, config.listen).lines().next(),
        Some(
            "tower-redis-ratelimit demo listening on http://127.0.0.1:3000 (store: memory, key prefix \"rl\")"
        )
    );
}

#[test]
fn optional_and_alternative_values_are_accepted() {
    let text = edited(
        "trusted_proxies = []",
        "trusted_proxies = [\"127.0.0.0/8\", \"::1\"]\nforwarded_header = \"X-Real-IP\"",
    )
    .replacen("legacy_headers = false", "legacy_headers = true", 1)
    .replacen("listen = \"127.0.0.1:3000\"", "listen = \"[::1]:0\"", 1)
    .replacen(
        "algorithm = \"sliding_log\"",
        "algorithm = \"fixed_window\"",
        1,
    )
    .replacen("key = \"ip\"", "key = \"header:X-Api-Key\"", 1)
        + "\n[[routes]]\npath = \"/user\"\nkey = \"user\"\nalgorithm = \"sliding_log\"\n\
           rules = [{ limit = 5, period = \"500ms\" }, { limit = 5, period = \"1d\" }]\n"
        + &format!(
            "\n[[routes]]\npath = \"/{}\"\nkey = \"global\"\nalgorithm = \"sliding_log\"\n\
             rules = [{{ limit = 1, period = \"10s\" }}]\n",
            "x".repeat(64)
        );
    let config = load_config(&text).unwrap();
    assert_eq!(config.listen, "[::1]:0".parse::<SocketAddr>().unwrap());
    let limits = &config.limits;
    let proxies: Vec<IpNet> = vec!["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()];
    assert_eq!(limits.trusted_proxies(), &proxies[..]);
    assert_eq!(limits.forwarded_header(), Some(ForwardedHeader::XRealIp));
    assert!(limits.legacy_headers());
    let [api, user, long] = limits.routes() else {
        panic!("three routes expected, got {}", limits.routes().len());
    };
    assert_eq!(api.key(), "header:X-Api-Key");
    assert_eq!(key_text(api.key()), "header x-api-key");
    assert_eq!(api.policy().key().kind(), "header");
    assert_eq!(api.policy().algorithm(), Algorithm::FixedWindow);
    assert_eq!(api.policy().client_ip().trusted_proxies(), &proxies[..]);
    assert_eq!(key_text(user.key()), "user (x-user-id header)");
    assert_eq!(user.policy().key().kind(), "user");
    assert_eq!(user.policy().name(), "/user");
    assert_eq!(
        user.policy().rules(),
        [Rule::new(5, Duration::from_millis(500)), Rule::per_day(5)]
    );
    // 65 characters: too long to be a policy name, so a hash of its path names it (never its
    // place in the file, which a reload may change).
    assert_eq!(key_text(long.key()), "global");
    assert!(long.policy().name().starts_with("route-"));
    assert_eq!(long.policy().name().len(), "route-".len() + 16);
}

/// The checks that are the demo's own (the crate's are tested in `tests/it/config.rs`), and the
/// crate's that its tests don't cover, as the demo shows them.
#[test]
fn bad_values_are_refused_naming_the_field_line_and_column() {
    let rules = |rules: &str| route_config("ip", rules);
    let cases: Vec<(String, &str)> = vec![
        (
            rules(r#"[{ limit = 20, period = "10" }]"#),
            r#"routes[0].rules[0].period: invalid duration "10" (time unit needed, for example 10sec or 10ms): expected a number and a unit, such as "500ms", "10s", "1m", "1h30m" or "1d" (line 21, column 33)"#,
        ),
        (
            rules(r#"[{ limit = 20, period = "99999999999999999d" }]"#),
            r#"routes[0].rules[0].period: invalid duration "99999999999999999d" (number is too large or cannot be represented without a lack of precision (values below 1ns are not supported)): expected a number and a unit, such as "500ms", "10s", "1m", "1h30m" or "1d" (line 21, column 33)"#,
        ),
        (
            route_config("header:x api", "[{ limit = 1, period = \"1s\" }]"),
            r#"routes[0].key: "x api" is not a valid header name (in "header:x api") (line 19, column 7)"#,
        ),
        (
            route_config("header:", "[{ limit = 1, period = \"1s\" }]"),
            r#"routes[0].key: "" is not a valid header name (in "header:") (line 19, column 7)"#,
        ),
        (
            edited("\"127.0.0.1:3000\"", "\"localhost:3000\""),
            r#"listen: "localhost:3000" is not an IP address and port such as "127.0.0.1:3000" (line 1, column 10)"#,
        ),
        (
            edited("\"127.0.0.1:3000\"", "\"127.0.0.1\""),
            r#"listen: "127.0.0.1" is not an IP address and port such as "127.0.0.1:3000" (line 1, column 10)"#,
        ),
        (
            edited("\"127.0.0.1:3000\"", "3000"),
            "listen: invalid type: integer `3000`, expected a string (line 1, column 10)",
        ),
        (
            edited("store_timeout = \"250ms\"", "store_timeout = \"fast\""),
            r#"store_timeout: invalid duration "fast" (expected number at 0): expected a number and a unit, such as "500ms", "10s", "1m", "1h30m" or "1d" (line 5, column 17)"#,
        ),
        (
            edited("prefix = \"demo\"", "prefix = \"my app\""),
            r#"prefix: "my app" must be 1 to 64 letters, digits and -._~@+=!*(),/ (it starts every store key) (line 3, column 10)"#,
        ),
        (
            edited("prefix = \"demo\"", "prefix = \"\""),
            r#"prefix: "" must be 1 to 64 letters, digits and -._~@+=!*(),/ (it starts every store key) (line 3, column 10)"#,
        ),
        (
            edited(
                "trusted_proxies = []",
                "trusted_proxies = []\nforwarded_header = \"x-forwarded\"",
            ),
            r#"forwarded_header: unknown forwarded header "x-forwarded": expected "x-forwarded-for", "forwarded" or "x-real-ip" (line 7, column 20)"#,
        ),
        (
            edited("path = \"/api/ping\"", "path = \"/healthz\""),
            r#"routes[0].path: "/healthz" is the demo's health check, which is never limited (line 18, column 8)"#,
        ),
        (
            edited("path = \"/api/ping\"", "path = \"api/ping\""),
            r#"routes[0].path: "api/ping" must start with "/" (line 18, column 8)"#,
        ),
        (
            edited("path = \"/api/ping\"", "path = \"/users/{id}\""),
            r#"routes[0].path: "/users/{id}" must be a literal path: "/" then letters, digits and -._~@+=!(),/ (line 18, column 8)"#,
        ),
        (
            edited("path = \"/api/ping\"", "path = \"/files/*rest\""),
            r#"routes[0].path: "/files/*rest" must be a literal path: "/" then letters, digits and -._~@+=!(),/ (line 18, column 8)"#,
        ),
        // Every path of a route is served: each is checked, and named.
        (
            edited(
                "path = \"/api/ping\"",
                "path = \"/api/ping\"\npaths = [\"/x\", \"/healthz\"]",
            ),
            r#"routes[0].paths[1]: "/healthz" is the demo's health check, which is never limited (line 19, column 16)"#,
        ),
    ];
    assert_refused(&cases);
}

/// The default config with `store = "memory"` replaced by `store = <store>` and the top-level
/// `extra` lines (such as `tls_ca = "..."`) added after `store_timeout`.
fn with_store(store: &str, extra: &str) -> String {
    edited("store = \"memory\"", &format!("store = {store}")).replacen(
        "store_timeout = \"250ms\"",
        &format!("store_timeout = \"250ms\"\n{extra}"),
        1,
    )
}

/// A self-signed CA certificate (P-256) for the TLS settings' tests: parsed, never used.
const TEST_CA_PEM: &str = "-----BEGIN CERTIFICATE-----
MIIBhDCCASugAwIBAgIUFrICZEdodkDs5H3epqKEsGMgVI4wCgYIKoZIzj0EAwIw
FzEVMBMGA1UEAwwMZGVtby10ZXN0LWNhMCAXDTI2MTEyMzA3MTgxMFoYDzIxMjYx
MDMwMDcxODEwWjAXMRUwEwYDVQQDDAxkZW1vLXRlc3QtY2EwWTATBgcqhkjOPQIB
BggqhkjOPQMBBwNCAAQTQh9iBLQcQwQxjEQq+tcb3DVQyivJLF8s5moviRN+yV3U
wd3NYxjNA+Rb2AJsJKycW1kHKYwBzuhowVGlTOeQo1MwUTAdBgNVHQ4EFgQUirrf
W9iccgAVbvgbBNFTxhrdy+MwHwYDVR0jBBgwFoAUirrfW9iccgAVbvgbBNFTxhrd
y+MwDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNHADBEAiB2XNG5Kkm+y8vL
Axnh1x4mcY1T2VlA5xFZmFKsGjIi7wIgAzXIBVML1MDMFa0hKbARgPzLkuL/7J5o
QXvkTTxEd9w=
-----END CERTIFICATE-----
";

/// Writes `contents` to a file of this test process in the temp directory; returns its path.
fn temp_file(name: &str, contents: &str) -> String {
    let path = std::env::temp_dir().join(format!(
        "tower-redis-ratelimit-demo-{}-{name}",
        std::process::id()
    ));
    std::fs::write(&path, contents).unwrap();
    path.to_str().unwrap().to_owned()
}

fn urls(list: &[&str]) -> Vec<String> {
    list.iter().map(|url| url.to_string()).collect()
}

#[test]
fn wait_for_replicas_needs_a_redis_store() {
    let config = load_config(&with_store(
        r#"{ cluster = ["redis://127.0.0.1:7000"] }"#,
        "wait_for_replicas = 1",
    ))
    .unwrap();
    assert_eq!(config.limits.wait_for_replicas(), 1);
    assert_eq!(
        error_of(&with_store(
            "\"redis://127.0.0.1:6379/0\"",
            "wait_for_replicas = -1",
        )),
        "wait_for_replicas: invalid value: integer `-1`, expected u32 (line 6, column 21)"
    );
}

#[test]
fn store_tables_become_cluster_and_sentinel_stores() {
    let cases = [
        (
            r#"{ cluster = ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001", "redis://127.0.0.1:7002"] }"#,
            StoreSpec::Cluster {
                urls: urls(&[
                    "redis://127.0.0.1:7000",
                    "redis://127.0.0.1:7001",
                    "redis://127.0.0.1:7002",
                ]),
            },
            "cluster(3 nodes)",
        ),
        (
            r#"{ sentinel = ["redis://127.0.0.1:26379", "redis://127.0.0.1:26380"], master = "mymaster" }"#,
            StoreSpec::Sentinel {
                master: "mymaster".into(),
                urls: urls(&["redis://127.0.0.1:26379", "redis://127.0.0.1:26380"]),
            },
            "sentinel(mymaster)",
        ),
        (
            r#"{ cluster = ["rediss://127.0.0.1:7000"] }"#,
            StoreSpec::Cluster {
                urls: urls(&["rediss://127.0.0.1:7000"]),
            },
            "cluster(1 node, TLS)",
        ),
        (
            r#"{ master = "cache", sentinel = ["rediss://127.0.0.1:26379"] }"#,
            StoreSpec::Sentinel {
                master: "cache".into(),
                urls: urls(&["rediss://127.0.0.1:26379"]),
            },
            "sentinel(cache, TLS)",
        ),
        (
            r#""rediss://127.0.0.1:6380/0""#,
            StoreSpec::Redis {
                url: "rediss://127.0.0.1:6380/0".into(),
            },
            "rediss://127.0.0.1:6380/0",
        ),
    ];
    for (store, spec, shown) in cases {
        let config = load_config(&with_store(store, "")).unwrap();
        assert_eq!(config.limits.store_spec(), &spec, "{store}");
        assert_eq!(config.limits.store_tls(), None, "{store}");
        let text = banner(&config, config.listen);
        assert!(
                text.starts_with(&format!(
                    "tower-redis-ratelimit demo listening on http://127.0.0.1:3000 (store: {shown}, key prefix \"demo\")\n"
                )),
                "{text}"
            );
        // The constructors check the URLs without connecting.
        let _app = build_app(&config).unwrap();
    }
}

#[test]
fn the_commented_store_examples_in_demo_toml_parse() {
    let stores: Vec<&str> = DEFAULT_CONFIG
        .lines()
        .filter_map(|line| line.strip_prefix("# store = "))
        .collect();
    assert_eq!(stores.len(), 3, "{stores:?}");
    for store in &stores {
        let config =
            load_config(&with_store(store, "")).unwrap_or_else(|error| panic!("{store}: {error}"));
        assert_ne!(config.limits.store_spec(), &StoreSpec::Memory);
    }
    let tls_line = |field: &str| {
        DEFAULT_CONFIG
            .lines()
            .find_map(|line| {
                line.strip_prefix("# ")
                    .filter(|rest| rest.starts_with(field))
            })
            .unwrap()
    };
    let rediss = stores[0];
    let config = load_config(&with_store(rediss, tls_line("tls_insecure = "))).unwrap();
    let tls = config.limits.store_tls().expect("TLS settings");
    assert_eq!((tls.ca_path(), tls.insecure()), (None, false));
    // The CA file of the example doesn't exist here; the line itself parses.
    let error = error_of(&with_store(rediss, tls_line("tls_ca = ")));
    assert!(
        error.starts_with("tls_ca: cannot read \"certs/ca.crt\": ")
            && error.ends_with(" (line 6, column 10)"),
        "{error}"
    );
}

#[test]
fn tls_settings_reach_the_store() {
    let ca = temp_file("ca.crt", TEST_CA_PEM);
    let settings = [
        (
            format!("tls_ca = {ca:?}"),
            (Some(ca.as_str()), false),
            format!("TLS CA {ca:?}"),
        ),
        (
            format!("tls_ca = {ca:?}\ntls_insecure = false"),
            (Some(ca.as_str()), false),
            format!("TLS CA {ca:?}"),
        ),
        (
            "tls_insecure = true".to_owned(),
            (None, true),
            "TLS certificates NOT checked".to_owned(),
        ),
        (
            "tls_insecure = false".to_owned(),
            (None, false),
            "TLS CA: the system's roots".to_owned(),
        ),
    ];
    for store in [
        r#""rediss://127.0.0.1:6380/0""#,
        r#"{ cluster = ["rediss://127.0.0.1:7000", "rediss://127.0.0.1:7001"] }"#,
        r#"{ sentinel = ["rediss://127.0.0.1:26379"], master = "mymaster" }"#,
    ] {
        for (extra, expected, shown) in &settings {
            let config = load_config(&with_store(store, extra)).unwrap();
            let tls = config.limits.store_tls().expect("TLS settings");
            assert_eq!(
                (tls.ca_path(), tls.insecure()),
                *expected,
                "{store} {extra}"
            );
            let text = banner(&config, config.listen);
            assert!(
                text.contains(&format!(", {shown}, key prefix \"demo\")\n")),
                "{text}"
            );
            let _app = build_app(&config).unwrap();
        }
    }
    std::fs::remove_file(&ca).unwrap();
}

#[test]
fn bad_store_tables_and_tls_settings_are_refused_naming_the_field() {
    let table = |store: &str| with_store(store, "");
    let rediss = r#""rediss://127.0.0.1:6380/0""#;
    let expected = r#"expected "memory", a URL, or a table with cluster = [...] or sentinel = [...] and master = "...""#;
    let expected_store = format!("store: {expected}");
    let not_pem = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.toml");
    let cases: Vec<(String, String)> = vec![
            (
                table("{ cluster = [] }"),
                "store.cluster: must list at least one node URL (line 2, column 21)".into(),
            ),
            (
                table(r#"{ sentinel = [], master = "mymaster" }"#),
                "store.sentinel: must list at least one sentinel URL (line 2, column 22)".into(),
            ),
            (
                table(r#"{ cluster = ["redis://127.0.0.1:7000", "http://127.0.0.1:7001"] }"#),
                r#"store.cluster[1]: "http://127.0.0.1:7001" is not a redis:// or rediss:// URL (line 2, column 48)"#.into(),
            ),
            (
                table(r#"{ sentinel = ["redis://127.0.0.1:26379", 26380], master = "mymaster" }"#),
                "store.sentinel[1]: invalid type: integer `26380`, expected a string (line 2, column 50)".into(),
            ),
            (
                table(r#"{ cluster = "redis://127.0.0.1:7000" }"#),
                r#"store.cluster: invalid type: string "redis://127.0.0.1:7000", expected a sequence (line 2, column 21)"#.into(),
            ),
            (
                table(r#"{ sentinel = "redis://127.0.0.1:26379", master = "mymaster" }"#),
                r#"store.sentinel: invalid type: string "redis://127.0.0.1:26379", expected a sequence (line 2, column 22)"#.into(),
            ),
            (
                table(r#"{ cluster = ["rediss://127.0.0.1:7000", "redis://127.0.0.1:7001"] }"#),
                r#"store.cluster[1]: "redis://127.0.0.1:7001" and store.cluster[0] differ in TLS: use rediss:// for every URL or for none (line 2, column 49)"#.into(),
            ),
            (
                table(r#"{ sentinel = ["redis://127.0.0.1:26379"] }"#),
                r#"store.master: is required with sentinel = [...]: the name the sentinels know the primary by, such as "mymaster" (line 2, column 9)"#.into(),
            ),
            (
                table(r#"{ sentinel = ["redis://127.0.0.1:26379"], master = "" }"#),
                r#"store.master: expected the name the sentinels know the primary by, such as "mymaster" (line 2, column 60)"#.into(),
            ),
            (
                table(r#"{ sentinel = ["redis://127.0.0.1:26379"], master = 1 }"#),
                "store.master: invalid type: integer `1`, expected a string (line 2, column 60)".into(),
            ),
            (
                table(r#"{ cluster = ["redis://127.0.0.1:7000"], master = "mymaster" }"#),
                "store.master: applies only with sentinel = [...] (a cluster finds its primaries itself) (line 2, column 58)".into(),
            ),
            (
                table(
                    r#"{ cluster = ["redis://127.0.0.1:7000"], sentinel = ["redis://127.0.0.1:26379"] }"#,
                ),
                "store: expected either cluster = [...] or sentinel = [...], not both (line 2, column 9)".into(),
            ),
            (table("{}"), format!("{expected_store} (line 2, column 9)")),
            (
                table(r#"{ master = "mymaster" }"#),
                format!("{expected_store} (line 2, column 9)"),
            ),
            (
                table("6379"),
                format!("store: invalid type: integer `6379`, {expected} (line 2, column 9)"),
            ),
            (
                table(r#"["redis://127.0.0.1:6379"]"#),
                format!("store: invalid type: sequence, {expected} (line 2, column 9)"),
            ),
            (
                with_store(r#""memory""#, r#"tls_ca = "ca.crt""#),
                r#"tls_ca: applies only to a Redis store, not "memory" (line 6, column 10)"#.into(),
            ),
            (
                with_store(r#""memory""#, "tls_insecure = false"),
                r#"tls_insecure: applies only to a Redis store, not "memory" (line 6, column 16)"#
                    .into(),
            ),
            (
                with_store(r#""redis://127.0.0.1:6379/0""#, "tls_insecure = true"),
                "tls_insecure: applies only to rediss:// URLs (TLS), and the store's are redis:// (line 6, column 16)"
                    .into(),
            ),
            (
                with_store(
                    r#"{ cluster = ["redis://127.0.0.1:7000"] }"#,
                    r#"tls_ca = "ca.crt""#,
                ),
                "tls_ca: applies only to rediss:// URLs (TLS), and the store's are redis:// (line 6, column 10)".into(),
            ),
            (
                with_store(rediss, "tls_ca = \"ca.crt\"\ntls_insecure = true"),
                "tls_insecure: true checks no certificate, so tls_ca would go unused: give one or the other (line 7, column 16)".into(),
            ),
            (
                with_store(rediss, &format!("tls_ca = {not_pem:?}")),
                format!("tls_ca: {not_pem:?} holds no PEM certificate (-----BEGIN CERTIFICATE-----) (line 6, column 10)"),
            ),
        ];
    assert_refused(&cases);

    // The rest of these messages comes from the OS or the Redis client.
    let bad_pem = temp_file(
        "bad.crt",
        "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n",
    );
    let starts = [
        (
            with_store(rediss, r#"tls_ca = "/nonexistent/ca.crt""#),
            r#"tls_ca: cannot read "/nonexistent/ca.crt": "#.to_owned(),
            " (line 6, column 10)",
        ),
        (
            with_store(rediss, &format!("tls_ca = {bad_pem:?}")),
            format!("tls_ca: {bad_pem:?}: rate-limit store misconfigured: "),
            " (line 6, column 10)",
        ),
        (
            table(r#"{ cluster = ["redis://127.0.0.1:7000", "redis://127.0.0.1:port"] }"#),
            r#"store.cluster[1]: "redis://127.0.0.1:port": rate-limit store misconfigured: "#
                .to_owned(),
            " (line 2, column 48)",
        ),
    ];
    for (text, start, end) in starts {
        let error = error_of(&text);
        assert!(
            error.starts_with(&start) && error.ends_with(end),
            "{error}\nconfig:\n{text}"
        );
    }
    std::fs::remove_file(&bad_pem).unwrap();
}

/// The shipped route with `extra` lines added to it.
fn with_route_options(extra: &str) -> String {
    edited(
        "algorithm = \"sliding_log\"",
        &format!("algorithm = \"sliding_log\"\n{extra}"),
    )
}

#[test]
fn the_route_options_reach_the_policy() {
    let config = load_config(&with_route_options(
        "prevent_duplicate = true\nblock_for = \"15m\"\nmode = \"delay\"\nmax_delay = \"2s\"\n\
             cost_header = \"x-cost\"",
    ))
    .unwrap();
    let policy = config.limits.routes()[0].policy();
    assert!(policy.rules()[2].is_duplicate_guard());
    assert_eq!(policy.rules()[2].period(), Duration::from_secs(5));
    assert_eq!(policy.block_for(), Some(Duration::from_secs(900)));
    assert_eq!(
        policy.mode(),
        Mode::Delay {
            max_delay: Duration::from_secs(2)
        }
    );
    let bucket = load_config(
        &route_config("ip", r#"[{ limit = 10, period = "1s", burst = 50 }]"#).replacen(
            "algorithm = \"sliding_log\"",
            "algorithm = \"token_bucket\"",
            1,
        ),
    )
    .unwrap();
    let policy = bucket.limits.routes()[0].policy();
    assert_eq!(policy.algorithm(), Algorithm::TokenBucket);
    assert_eq!(policy.rules()[0].burst_size(), 50);
    let guard = load_config(&with_route_options(
        "prevent_duplicate = { limit = 1, period = \"2s\" }\nmode = \"shadow\"",
    ))
    .unwrap();
    let policy = guard.limits.routes()[0].policy();
    assert_eq!(policy.rules()[2].period(), Duration::from_secs(2));
    assert_eq!(policy.mode(), Mode::Shadow);
    let off = load_config(&with_route_options("prevent_duplicate = false")).unwrap();
    assert_eq!(off.limits.routes()[0].policy().rules().len(), 2);
}

#[test]
fn bad_route_options_are_refused_naming_the_field() {
    let cases = [
        (
            with_route_options("max_delay = \"2s\""),
            r#"routes[0].max_delay: applies only with mode = "delay" (line 21, column 13)"#,
        ),
        (
            with_route_options("prevent_duplicate = { limit = 2, period = \"5s\" }"),
            "routes[0].prevent_duplicate.limit: the duplicate guard admits one request per period: leave out the limit or make it 1 (use a rule for more) (line 21, column 31)",
        ),
        (
            route_config("ip", r#"[{ limit = 10, period = "1s", burst = 50 }]"#),
            "routes[0].rules[0].burst: 10 per 1s: a burst applies only to the token_bucket algorithm (line 21, column 47)",
        ),
        (
            edited(
                "algorithm = \"sliding_log\"",
                "algorithm = \"fixed_window\"\nmode = \"delay\"\nmax_delay = \"1s\"",
            ),
            "routes[0].mode: delay mode needs the sliding_log or token_bucket algorithm, which can reserve a request's place in the future (line 21, column 8)",
        ),
    ];
    assert_refused(&cases);
}

#[tokio::test]
async fn a_cost_header_charges_several_units_and_shadow_mode_refuses_nothing() {
    let app = app_for(&with_route_options("cost_header = \"x-cost\""));
    let (status, headers, _) = send(&app, Method::GET, "/api/ping", &[("x-cost", "15")]).await;
    assert_eq!(status, StatusCode::OK);
    let limits = tower_redis_ratelimit::headers::parse(&headers).unwrap();
    assert_eq!(limits.status("20-per-60s").unwrap().remaining, 5);
    // Garbage costs 1; more than the limit could ever admit is a 413.
    let (_, headers, _) = send(&app, Method::GET, "/api/ping", &[("x-cost", "lots")]).await;
    let limits = tower_redis_ratelimit::headers::parse(&headers).unwrap();
    assert_eq!(limits.status("20-per-60s").unwrap().remaining, 4);
    let (status, _, _) = send(&app, Method::GET, "/api/ping", &[("x-cost", "21")]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let (status, _, _) = send(&app, Method::GET, "/api/ping", &[("x-cost", "5")]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);

    let shadow = app_for(&with_route_options("mode = \"shadow\""));
    for _ in 0..25 {
        let (status, _, _) = send(&shadow, Method::GET, "/api/ping", &[]).await;
        assert_eq!(status, StatusCode::OK);
    }
    let (_, headers, _) = send(&shadow, Method::GET, "/api/ping", &[]).await;
    let limits = tower_redis_ratelimit::headers::parse(&headers).unwrap();
    assert_eq!(limits.status("20-per-60s").unwrap().remaining, 0);
}

/// The shipped config with its `[quota]` section turned on, edited by `edit`.
fn with_quota(edit: impl Fn(String) -> String) -> String {
    let on = DEFAULT_CONFIG
        .lines()
        .map(|line| match line.strip_prefix("# ") {
            Some(rest) if rest.starts_with("[quota]") || is_quota_line(rest) => rest,
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n");
    edit(on)
}

fn is_quota_line(line: &str) -> bool {
    [
        "key = \"user\"",
        "tier_header",
        "default_tier",
        "tiers =",
        "alert_at",
        "alert_webhook",
        "utc_offset",
    ]
    .iter()
    .any(|start| line.starts_with(start))
}

#[test]
fn the_quota_section_reaches_every_route() {
    let config = load_config(&with_quota(|text| text)).unwrap();
    let quota = config.limits.routes()[0].policy().quota().expect("a quota");
    assert_eq!(quota.name(), "daily");
    assert_eq!(quota.limit_of("free"), Some(100));
    assert_eq!(quota.limit_of("pro"), Some(5_000));
    assert_eq!(quota.default_tier(), "free");
    assert_eq!(quota.alert_percents(), [80, 100]);
    assert_eq!(quota.utc_offset_minutes(), 0);
    assert_eq!(quota.key().kind(), "user");
    let east = load_config(&with_quota(|text| {
        text.replace("utc_offset = \"+00:00\"", "utc_offset = \"+05:30\"")
    }))
    .unwrap();
    let quota = east.limits.routes()[0].policy().quota().unwrap();
    assert_eq!(quota.utc_offset_minutes(), 330);
}

#[test]
fn bad_quota_values_are_refused_naming_the_field() {
    let cases = [
        (
            with_quota(|text| text.replace("{ free = 100, pro = 5000 }", "{}")),
            "quota.tiers: must name at least one tier, such as { free = 100 } (line 39, column 9)",
        ),
        (
            with_quota(|text| text.replace("free = 100", "free = 0")),
            "quota.tiers.free: must be 1 to 2^35 requests per day (line 39, column 18)",
        ),
        (
            with_quota(|text| text.replace("default_tier = \"free\"", "default_tier = \"gold\"")),
            r#"quota.default_tier: "gold" is not one of the tiers (line 38, column 16)"#,
        ),
        (
            with_quota(|text| text.replace("default_tier = \"free\"\n", "")),
            "quota.default_tier: is required with more than one tier: the tier of requests without a known one (line 35, column 1)",
        ),
        (
            with_quota(|text| text.replace("[80, 100]", "[0, 100]")),
            "quota.alert_at: 0 is not a percent from 1 to 100 (line 40, column 12)",
        ),
        (
            with_quota(|text| text.replace("\"+00:00\"", "\"UTC\"")),
            r#"quota.utc_offset: "UTC" is not an offset such as "+00:00", "+05:30" or "-08:00" (at most 18 hours) (line 42, column 14)"#,
        ),
        (
            with_quota(|text| text.replace("\"+00:00\"", "\"+19:00\"")),
            r#"quota.utc_offset: "+19:00" is not an offset such as "+00:00", "+05:30" or "-08:00" (at most 18 hours) (line 42, column 14)"#,
        ),
        (
            with_quota(|text| text.replace("http://127.0.0.1:9000/alerts", "ftp://x")),
            r#"quota.alert_webhook: "ftp://x" is not an http:// URL (line 41, column 17)"#,
        ),
    ];
    assert_refused(&cases);
}

#[tokio::test]
async fn the_quota_counts_per_user_by_tier_across_requests() {
    let app = app_for(&with_quota(|text| {
        text.replace("free = 100", "free = 3")
            .replace("alert_webhook = \"http://127.0.0.1:9000/alerts\"\n", "")
    }));
    let headers = [("x-user-id", "hana")];
    for _ in 0..3 {
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &headers).await;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, response_headers, body) = send(&app, Method::GET, "/api/ping", &headers).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(body.contains(r#""violated-policies":["daily"]"#), "{body}");
    assert!(
        response_headers["ratelimit-policy"]
            .to_str()
            .unwrap()
            .ends_with("\"daily\";q=3;w=86400")
    );
    // As pro, the same count is under a larger limit.
    let pro = [("x-user-id", "hana"), ("x-tier", "pro")];
    let (status, _, _) = send(&app, Method::GET, "/api/ping", &pro).await;
    assert_eq!(status, StatusCode::OK);
}

/// What toml and serde find (syntax, unknown or missing fields, wrong types), in the words the
/// crate gives them; the cases that `tests/it/config.rs` doesn't cover.
#[test]
fn toml_errors_name_the_field_line_and_column() {
    let cases: Vec<(String, &str)> = vec![
        (
            edited(
                "{ limit = 100, period = \"1h\" }",
                "{ limit = 100, period = \"1h\", colour = 5 }",
            ),
            "routes[0].rules[1].colour: unknown field `colour`, expected one of `limit`, `period`, `burst`, `metered` (line 21, column 71)",
        ),
        (
            edited("path = \"/api/ping\" ", "# no path "),
            "routes[0].path: a route needs a `path` or `paths` (line 17, column 1)",
        ),
        (
            edited("limit = 20,", "limit = \"20\","),
            "routes[0].rules[0].limit: invalid type: string \"20\", expected u64 (line 21, column 20)",
        ),
        (
            edited("prefix = \"demo\"", "prefix = demo"),
            "string values must be quoted, expected literal string (line 3, column 10)",
        ),
        (
            edited(
                "legacy_headers = false",
                "legacy_headers = false\nmetrics = 9091",
            ),
            "metrics: invalid type: integer `9091`, expected a string (line 8, column 11)",
        ),
    ];
    assert_refused(&cases);
}

/// Waits until `limits` counts `applied` and `refused` reloads; fails after ten seconds.
async fn wait_for_reloads(limits: &RouteLimitsLayer, applied: u64, refused: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while limits.reload_counts() != (applied, refused) {
        assert!(
            std::time::Instant::now() < deadline,
            "expected ({applied}, {refused}) reloads, have {:?}",
            limits.reload_counts()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_limits_reload_when_the_file_changes_after_the_demos_own_checks() {
    let path = std::env::temp_dir().join(format!("demo-reload-{}.toml", std::process::id()));
    std::fs::write(&path, DEFAULT_CONFIG).unwrap();
    let config = load_config(DEFAULT_CONFIG).unwrap();
    let (app, limits) = build_app(&config).unwrap();
    let limits = limits.expect("a limiter");
    let app = app.layer(MockConnectInfo(SocketAddr::from(PEER)));
    watch_config(&config, &limits, &path);

    // The crate would take this file; the demo refuses it, and the limits stay.
    std::fs::write(&path, edited("path = \"/api/ping\"", "path = \"/healthz\"")).unwrap();
    wait_for_reloads(&limits, 0, 1).await;
    let rules = "rules = [{ limit = 20, period = \"1m\" }, { limit = 100, period = \"1h\" }]";
    std::fs::write(
        &path,
        edited(rules, "rules = [{ limit = 3, period = \"1m\" }]"),
    )
    .unwrap();
    wait_for_reloads(&limits, 1, 1).await;
    std::fs::remove_file(&path).unwrap();
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let response = app
            .clone()
            .oneshot(Request::get("/api/ping").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), expected);
        assert_eq!(
            response.headers()["ratelimit-policy"],
            "\"3-per-60s\";q=3;w=60"
        );
    }
}

#[tokio::test]
async fn no_limiter_serves_the_routes_unlimited() {
    let mut config = load_config(DEFAULT_CONFIG).unwrap();
    config.no_limiter = true;
    assert!(banner(&config, config.listen).contains("WITHOUT rate limiting"));
    let (app, limits) = build_app(&config).unwrap();
    assert!(limits.is_none());
    let app = app.layer(MockConnectInfo(SocketAddr::from(PEER)));
    for _ in 0..25 {
        let response = app
            .clone()
            .oneshot(Request::get("/api/ping").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(!response.headers().contains_key("ratelimit"));
    }
}

#[test]
fn command_line() {
    let read = |list: &[&str]| read_command_line(list.iter().map(|a| a.to_string()));
    let built_in = |no_limiter| {
        Ok(Some(CommandLine {
            source: "demo.toml (built in)".to_owned(),
            path: None,
            text: DEFAULT_CONFIG.to_owned(),
            no_limiter,
        }))
    };
    assert_eq!(read(&[]), built_in(false));
    assert_eq!(read(&["--no-limiter"]), built_in(true));
    assert_eq!(read(&["--help"]), Ok(None));
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.toml");
    let from_file = |no_limiter| {
        Ok(Some(CommandLine {
            source: shipped.to_owned(),
            path: Some(PathBuf::from(shipped)),
            text: DEFAULT_CONFIG.to_owned(),
            no_limiter,
        }))
    };
    assert_eq!(read(&["--config", shipped]), from_file(false));
    assert_eq!(read(&[&format!("--config={shipped}")]), from_file(false));
    assert_eq!(
        read(&["--no-limiter", "--config", shipped]),
        from_file(true)
    );
    for wrong in [
        &["--config"][..],
        &["--port", "3000"],
        &["--config", shipped, "extra"],
        &["--config", shipped, "--config", shipped],
    ] {
        assert_eq!(read(wrong), Err(USAGE.to_owned()), "{wrong:?}");
    }
    let missing = "/nonexistent/demo.toml";
    let error = read(&["--config", missing]).unwrap_err();
    assert!(
        error.starts_with("/nonexistent/demo.toml: cannot read the config file: "),
        "{error}"
    );
}

#[test]
fn banner_shows_the_routes_and_the_curl_commands() {
    let config = load_config(DEFAULT_CONFIG).unwrap();
    assert_eq!(
        banner(&config, config.listen),
        "tower-redis-ratelimit demo listening on http://127.0.0.1:3000 (store: memory, key prefix \"demo\")\n\
             \x20 GET|POST /api/ping -> 200 \"PONG\"; per client IP, sliding_log: 20 per 60s and 100 per 3600s\n\
             \x20 GET /healthz -> 200 \"ok\", never limited\n\
             \n\
             Try it: requests 1-20 get 200, the next ones 429 (each refusal is logged):\n\
             \x20 for i in $(seq 1 22); do curl -s -o /dev/null -w \"%{http_code}\\n\" http://127.0.0.1:3000/api/ping; done\n\
             See the headers:\n\
             \x20 curl -i http://127.0.0.1:3000/api/ping\n\
             Ctrl-C stops the server.\n"
    );
    // A wildcard address is curled on loopback; a user key needs its header.
    let config = load_config(
        &route_config("user", "[{ limit = 3, period = \"1m\" }]").replacen(
            "127.0.0.1:3000",
            "0.0.0.0:8080",
            1,
        ),
    )
    .unwrap();
    let text = banner(&config, config.listen);
    assert!(text.starts_with("tower-redis-ratelimit demo listening on http://0.0.0.0:8080 "));
    assert!(text.contains(
            "  for i in $(seq 1 5); do curl -s -o /dev/null -w \"%{http_code}\\n\" -H \"x-user-id: alice\" http://127.0.0.1:8080/api/ping; done\n"
        ), "{text}");
}

const PEER: ([u8; 4], u16) = ([127, 0, 0, 1], 40_000);

/// The app of config `text`, its requests coming from `PEER` (axum's `MockConnectInfo`, which
/// the limiter reads as the peer address, as the `ConnectInfo` extractor does).
fn app_for(text: &str) -> Router {
    let config = load_config(text).unwrap();
    let (app, _) = build_app(&config).unwrap();
    app.layer(MockConnectInfo(SocketAddr::from(PEER)))
}

async fn send(
    app: &Router,
    method: Method,
    uri: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, String) {
    let mut request = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (
        parts.status,
        parts.headers,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

fn retry_after(headers: &HeaderMap) -> u64 {
    headers["retry-after"].to_str().unwrap().parse().unwrap()
}

use super::redis_server;

/// The default config with `/work` as its route, keyed by user, one job at a time per user.
fn one_job_per_user(store: &str, prefix: &str) -> String {
    route_config("user", "[{ limit = 100, period = \"1m\" }]")
        .replacen(
            "path = \"/api/ping\"",
            "path = \"/work\"\nmax_in_flight = 1\nlease = \"30s\"",
            1,
        )
        .replacen("store = \"memory\"", &format!("store = {store:?}"), 1)
        .replacen("prefix = \"demo\"", &format!("prefix = {prefix:?}"), 1)
        .replacen("store_timeout = \"250ms\"", "store_timeout = \"2s\"", 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_runs_one_job_per_user_across_two_instances_on_one_redis() {
    let redis = redis_server::TestRedis::shared();
    let prefix = redis_server::unique_prefix("work");
    let text = one_job_per_user(&redis.url, &prefix);
    let instances = [app_for(&text), app_for(&text)];
    let user = [("x-user-id", "ann")];
    let jobs: Vec<_> = (0..10)
        .map(|n| {
            let app = instances[n % 2].clone();
            tokio::spawn(async move {
                send(&app, Method::GET, "/work?ms=1000", &[("x-user-id", "ann")]).await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for job in jobs {
        let (status, headers, body) = job.await.unwrap();
        if status == StatusCode::TOO_MANY_REQUESTS {
            assert!(
                body.contains(r#""violated-policies":["1-in-flight"]"#),
                "{body}"
            );
            assert!(
                headers["ratelimit-policy"]
                    .to_str()
                    .unwrap()
                    .ends_with(r#""1-in-flight";q=1"#),
                "{headers:?}"
            );
        }
        statuses.push(status);
    }
    let admitted = statuses.iter().filter(|&&s| s == StatusCode::OK).count();
    let refused = statuses
        .iter()
        .filter(|&&s| s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((admitted, refused), (1, 9), "{statuses:?}");
    // Done: the next job of the user is admitted, on either instance, as soon as the slot's
    // release reaches Redis (it runs after the last job's body was sent, so a request right
    // behind it may still find the slot taken): within 2 s, long before the 30 s lease
    // expires. Another user was never held.
    for app in &instances {
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let (status, _, body) = send(app, Method::POST, "/work?ms=0", &user).await;
            if status == StatusCode::OK || std::time::Instant::now() > deadline {
                assert_eq!((status, body.as_str()), (StatusCode::OK, "done"));
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let (status, _, _) = send(
        &instances[0],
        Method::GET,
        "/work?ms=0",
        &[("x-user-id", "bob")],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn work_sleeps_as_asked_and_refuses_anything_else() {
    // Unlimited when not listed in the routes.
    let app = app_for(DEFAULT_CONFIG);
    let started = std::time::Instant::now();
    let (status, headers, body) = send(&app, Method::GET, "/work?ms=150", &[]).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "done"));
    assert!(started.elapsed() >= Duration::from_millis(150));
    assert!(!headers.contains_key("ratelimit"));
    let (status, _, _) = send(&app, Method::POST, "/work?ms=0", &[]).await;
    assert_eq!(status, StatusCode::OK);
    for bad in [
        "/work",
        "/work?ms=",
        "/work?ms=-1",
        "/work?ms=10001",
        "/work?ms=1.5",
        "/work?ms=1&ms=2",
        "/work?n=3",
    ] {
        let (status, _, body) = send(&app, Method::GET, bad, &[]).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    let (status, _, _) = send(&app, Method::GET, "/work?ms=10000&x=1", &[]).await;
    assert_eq!(status, StatusCode::OK);
}

#[test]
fn max_in_flight_and_lease_go_together() {
    let route = |extra: &str| {
        edited(
            "path = \"/api/ping\"",
            &format!("path = \"/work\"\n{extra}"),
        )
    };
    let config = load_config(&route("max_in_flight = 2\nlease = \"30s\"")).unwrap();
    let limit = config.limits.routes()[0].policy().concurrency().unwrap();
    assert_eq!(
        (limit.max_in_flight(), limit.lease()),
        (2, Duration::from_secs(30))
    );
    let cases = [
        (
            route("lease = \"30s\""),
            "routes[0].lease: applies only with max_in_flight (line 19, column 9)",
        ),
        (
            route("max_in_flight = 0\nlease = \"30s\""),
            "routes[0].max_in_flight: must be at least 1 (line 19, column 17)",
        ),
        (
            route("max_in_flight = 1\nlease = \"soon\""),
            r#"routes[0].lease: invalid duration "soon" (expected number at 0): expected a number and a unit, such as "500ms", "10s", "1m", "1h30m" or "1d" (line 20, column 9)"#,
        ),
        (
            route("max_in_flight = -1\nlease = \"1s\""),
            "routes[0].max_in_flight: invalid value: integer `-1`, expected u64 (line 19, column 17)",
        ),
    ];
    assert_refused(&cases);
}

#[tokio::test]
async fn a_query_key_counts_each_token_once() {
    let text = route_config("query:token", "[{ limit = 1, period = \"1h\" }]");
    let config = load_config(&text).unwrap();
    assert_eq!(config.limits.routes()[0].key(), "query:token");
    assert_eq!(
        key_text(config.limits.routes()[0].key()),
        "query parameter token"
    );
    let app = app_for(&text);
    let (first, _, _) = send(&app, Method::GET, "/api/ping?token=abc", &[]).await;
    let (again, _, _) = send(&app, Method::GET, "/api/ping?token=abc", &[]).await;
    let (other, _, _) = send(&app, Method::GET, "/api/ping?token=xyz", &[]).await;
    assert_eq!(
        [first, again, other],
        [
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::OK
        ]
    );
    assert_eq!(
        error_of(&route_config("query:", "[{ limit = 1, period = \"1h\" }]")),
        r#"routes[0].key: "query:" names no query parameter (line 19, column 7)"#
    );
}

#[tokio::test]
async fn a_redis_store_limits_with_keys_under_the_prefix() {
    let redis = redis_server::TestRedis::shared();
    let prefix = redis_server::unique_prefix("demo");
    let text = DEFAULT_CONFIG
        .replace("store = \"memory\"", &format!("store = {:?}", redis.url))
        .replace("prefix = \"demo\"", &format!("prefix = {prefix:?}"))
        .replace("on_store_error = \"allow\"", "on_store_error = \"deny\"")
        .replace("store_timeout = \"250ms\"", "store_timeout = \"2s\"");
    let config = load_config(&text).unwrap();
    assert_eq!(
        config.limits.store_spec(),
        &StoreSpec::Redis {
            url: redis.url.clone()
        }
    );
    let policy = config.limits.routes()[0].policy();
    assert_eq!(policy.on_store_error(), OnStoreError::Deny);
    let app = app_for(&text);
    for i in 1..=20 {
        let (status, _, body) = send(&app, Method::GET, "/api/ping", &[]).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::OK, "PONG"),
            "request {i}"
        );
    }
    let (status, headers, _) = send(&app, Method::GET, "/api/ping", &[]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!((1..=60).contains(&retry_after(&headers)));

    // Every key the demo wrote starts with the prefix and expires.
    let mut client = redis.client();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query(&mut client)
        .unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in keys {
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut client).unwrap();
        assert!(ttl > 0, "{key}: {ttl}");
    }
}

#[tokio::test]
async fn the_default_app_limits_ping_but_not_healthz() {
    let app = app_for(DEFAULT_CONFIG);
    for i in 1..=20 {
        let (status, headers, body) = send(&app, Method::GET, "/api/ping", &[]).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::OK, "PONG"),
            "request {i}"
        );
        assert!(headers.contains_key("ratelimit"), "request {i}");
        assert!(!headers.contains_key("x-ratelimit-limit"), "request {i}");
    }
    let (status, headers, body) = send(&app, Method::GET, "/api/ping", &[]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!((59..=60).contains(&retry_after(&headers)), "{headers:?}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(
        body.contains(r#""violated-policies":["20-per-60s"]"#),
        "{body}"
    );

    for _ in 0..3 {
        let (status, headers, body) = send(&app, Method::GET, "/healthz", &[]).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
        assert!(!headers.contains_key("ratelimit"));
    }
    // GET and POST share the route's budget.
    let (status, _, _) = send(&app, Method::POST, "/api/ping", &[]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let (status, _, _) = send(&app, Method::GET, "/nowhere", &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn user_keys_fall_back_to_the_client_ip() {
    let app = app_for(&route_config("user", "[{ limit = 2, period = \"1m\" }]"));
    let alice = [(USER_ID_HEADER, "alice")];
    let bob = [(USER_ID_HEADER, "bob")];
    let expected = [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ];
    for who in [&alice[..], &bob[..], &[]] {
        for (i, want) in expected.iter().enumerate() {
            let (status, _, _) = send(&app, Method::GET, "/api/ping", who).await;
            assert_eq!(status, *want, "{who:?} request {}", i + 1);
        }
    }
}

#[tokio::test]
async fn header_and_global_keys_and_legacy_headers() {
    let text = route_config("header:x-api-key", "[{ limit = 1, period = \"1m\" }]").replacen(
        "legacy_headers = false",
        "legacy_headers = true",
        1,
    ) + "\n[[routes]]\npath = \"/global\"\nkey = \"global\"\nalgorithm = \"fixed_window\"\n\
               rules = [{ limit = 1, period = \"1h\" }]\n";
    let app = app_for(&text);
    let (status, headers, _) = send(&app, Method::GET, "/api/ping", &[("x-api-key", "k1")]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-ratelimit-limit"], "1");
    assert_eq!(headers["x-ratelimit-remaining"], "0");
    let (status, _, _) = send(&app, Method::GET, "/api/ping", &[("x-api-key", "k1")]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let (status, _, _) = send(&app, Method::GET, "/api/ping", &[("x-api-key", "k2")]).await;
    assert_eq!(status, StatusCode::OK);

    let (status, _, _) = send(&app, Method::GET, "/global", &[("x-api-key", "k3")]).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = send(&app, Method::GET, "/global", &[(USER_ID_HEADER, "x")]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn trusted_proxies_make_forwarded_clients_count_apart() {
    let one_per_minute = route_config("ip", "[{ limit = 1, period = \"1m\" }]");
    let forwarded = |client| [("x-forwarded-for", client)];
    let expected_behind_proxy = [
        ("127.0.0.2", StatusCode::OK),
        ("127.0.0.3", StatusCode::OK),
        ("127.0.0.2", StatusCode::TOO_MANY_REQUESTS),
    ];
    let app = app_for(&one_per_minute.replacen(
        "trusted_proxies = []",
        "trusted_proxies = [\"127.0.0.1/32\"]\nforwarded_header = \"x-forwarded-for\"",
        1,
    ));
    for (client, want) in expected_behind_proxy {
        let (status, _, _) = send(&app, Method::GET, "/api/ping", &forwarded(client)).await;
        assert_eq!(status, want, "{client}");
    }
    // Without trusted proxies the header is ignored: both are the peer, 127.0.0.1.
    let app = app_for(&one_per_minute);
    let (status, _, _) = send(&app, Method::GET, "/api/ping", &forwarded("127.0.0.2")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = send(&app, Method::GET, "/api/ping", &forwarded("127.0.0.3")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
}

#[test]
fn the_metrics_listener_is_an_address_or_absent() {
    let config = load_config(DEFAULT_CONFIG).unwrap();
    assert_eq!(config.metrics, None);
    let with = |value: &str| {
        DEFAULT_CONFIG.replacen(
            "legacy_headers = false",
            &format!("legacy_headers = false\nmetrics = {value}"),
            1,
        )
    };
    let config = load_config(&with("\"127.0.0.1:9091\"")).unwrap();
    assert_eq!(
        config.metrics,
        Some(SocketAddr::from(([127, 0, 0, 1], 9091)))
    );
    assert_eq!(
        error_of(&with("\"localhost:9091\"")),
        r#"metrics: "localhost:9091" is not an IP address and port such as "127.0.0.1:9091" (line 8, column 11)"#
    );
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The sum of the series `name` whose labels include all of `labels`, in Prometheus text.
fn scraped(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            let matches = metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            matches.then(|| value.parse::<f64>().unwrap())
        })
        .sum()
}

/// The metric names in the `expr` of every panel of the shipped Grafana dashboard.
fn dashboard_metrics() -> std::collections::BTreeSet<String> {
    let text = include_str!("../grafana/ratelimit.json");
    let dashboard: serde_json::Value = serde_json::from_str(text).unwrap();
    let mut names = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(at) = rest.find("ratelimit_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                names.insert(name);
            }
        }
    }
    names
}

/// Serves alerts: 200 for the one at 80 %, 500 for any other (the notifier retries, then
/// gives up: a failed alert).
async fn alert_webhook() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route(
        "/alerts",
        axum::routing::post(|body: axum::body::Bytes| async move {
            let alert: serde_json::Value = serde_json::from_slice(&body).unwrap();
            if alert["percent"] == 80 {
                StatusCode::OK
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Starts the demo on a free port; its address.
async fn start(text: String) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(run(load_config(&text).unwrap(), listener));
    addr
}

/// The one test of this binary that installs the Prometheus recorder (a process has one): a
/// known mix of traffic, then every counter of `/metrics` is what was sent, the top refused
/// identities are who was refused, and every metric the Grafana dashboard queries is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_listener_counts_a_known_traffic_mix_exactly() {
    let metrics_port = free_port();
    let hook = alert_webhook().await;
    let main = start(format!(
        r#"listen = "127.0.0.1:0"
store = "memory"
prefix = "ops"
trusted_proxies = []
legacy_headers = false
metrics = "127.0.0.1:{metrics_port}"

[[routes]]
path = "/two-rules"
key = "user"
algorithm = "sliding_log"
rules = [{{ limit = 2, period = "1s" }}, {{ limit = 3, period = "1h" }}]
cost_header = "x-cost"

[[routes]]
path = "/shadow"
key = "user"
algorithm = "sliding_log"
rules = [{{ limit = 1, period = "1m" }}]
mode = "shadow"

[[routes]]
path = "/delay"
key = "user"
algorithm = "sliding_log"
rules = [{{ limit = 1, period = "1s" }}]
mode = "delay"
max_delay = "5s"

[[routes]]
path = "/quota"
key = "user"
algorithm = "sliding_log"
rules = [{{ limit = 100, period = "1m" }}]

[quota]
tiers = {{ free = 5 }}
alert_at = [80, 100]
alert_webhook = "http://{hook}/alerts"
"#
    ))
    .await;
    // Two more instances on a Redis that isn't there: one fails open, one closed. Their layers
    // record into the same process's recorder.
    let down = free_port();
    let outage = |path: &str, on_error: &str| {
        format!(
            r#"listen = "127.0.0.1:0"
store = "redis://127.0.0.1:{down}/0"
prefix = "ops"
on_store_error = "{on_error}"
trusted_proxies = []
legacy_headers = false

[[routes]]
path = "{path}"
key = "ip"
algorithm = "fixed_window"
rules = [{{ limit = 10, period = "1m" }}]
"#
        )
    };
    let open = start(outage("/down-open", "allow")).await;
    let closed = start(outage("/down-closed", "deny")).await;

    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let get = |addr: SocketAddr, path: &str, user: &str, cost: &str| {
        let request = client
            .get(format!("http://{addr}{path}"))
            .header("x-user-id", user)
            .header("x-cost", cost);
        async move { request.send().await.unwrap().status().as_u16() }
    };
    // Two admitted, the third refused by the per-second rule alone; a second later one more
    // admitted (the hour's last) and the next refused by the hour's rule alone; then a cost
    // no rule admits.
    let mut two_rules = Vec::new();
    for _ in 0..3 {
        two_rules.push(get(main, "/two-rules", "alice", "1").await);
    }
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    for _ in 0..2 {
        two_rules.push(get(main, "/two-rules", "alice", "1").await);
    }
    two_rules.push(get(main, "/two-rules", "alice", "100").await);
    assert_eq!(two_rules, [200, 200, 429, 200, 429, 413]);
    let mut shadow = Vec::new();
    for _ in 0..3 {
        shadow.push(get(main, "/shadow", "sam", "1").await);
    }
    assert_eq!(shadow, [200; 3]);
    let delay = [
        get(main, "/delay", "dora", "1").await,
        get(main, "/delay", "dora", "1").await,
    ];
    assert_eq!(delay, [200, 200]);
    let mut quota = Vec::new();
    for _ in 0..6 {
        quota.push(get(main, "/quota", "quinn", "1").await);
    }
    assert_eq!(quota, [200, 200, 200, 200, 200, 429]);
    for _ in 0..2 {
        assert_eq!(get(open, "/down-open", "x", "1").await, 200);
        assert_eq!(get(closed, "/down-closed", "x", "1").await, 503);
    }

    let metrics_url = format!("http://127.0.0.1:{metrics_port}/metrics");
    let alerts = [
        ("quota", "daily"),
        ("percent", "100"),
        ("outcome", "failed"),
    ];
    let mut text = String::new();
    // The alert at 100 % fails after the notifier's retries (100 + 200 + 400 ms).
    for _ in 0..100 {
        text = client
            .get(&metrics_url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if scraped(&text, "ratelimit_quota_alerts_total", &alerts) == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let requests = |policy: &str, outcome: &str| {
        scraped(
            &text,
            "ratelimit_requests_total",
            &[("policy", policy), ("outcome", outcome)],
        )
    };
    let expected = [
        ("/two-rules", "allowed", 3.0),
        ("/two-rules", "refused", 2.0),
        ("/two-rules", "too_costly", 1.0),
        ("/shadow", "allowed", 1.0),
        ("/shadow", "shadow_refused", 2.0),
        ("/delay", "allowed", 1.0),
        ("/delay", "delayed", 1.0),
        ("/quota", "allowed", 5.0),
        ("/quota", "refused", 1.0),
        ("/down-open", "store_error_allowed", 2.0),
        ("/down-closed", "store_error_denied", 2.0),
    ];
    for (policy, outcome, count) in expected {
        assert_eq!(
            requests(policy, outcome),
            count,
            "{policy} {outcome}\n{text}"
        );
    }
    // Nothing else was counted for these policies (other tests of this process may count
    // under their own).
    let policies: std::collections::BTreeSet<&str> =
        expected.iter().map(|(policy, _, _)| *policy).collect();
    for policy in policies {
        let sent: f64 = expected
            .iter()
            .filter(|(name, _, _)| *name == policy)
            .map(|(_, _, count)| count)
            .sum();
        let counted = scraped(&text, "ratelimit_requests_total", &[("policy", policy)]);
        assert_eq!(counted, sent, "{policy}\n{text}");
    }
    let rule = |metric: &str, policy: &str, rule: &str| {
        scraped(&text, metric, &[("policy", policy), ("rule", rule)])
    };
    let refusals = "ratelimit_rule_refusals_total";
    // The too-costly request counts against the rule with the smallest limit.
    assert_eq!(rule(refusals, "/two-rules", "2-per-1s"), 2.0);
    assert_eq!(rule(refusals, "/two-rules", "3-per-3600s"), 1.0);
    assert_eq!(rule(refusals, "/shadow", "1-per-60s"), 2.0);
    assert_eq!(rule(refusals, "/quota", "daily"), 1.0);
    let refused_here: f64 = ["/two-rules", "/shadow", "/quota", "/delay"]
        .iter()
        .map(|policy| scraped(&text, refusals, &[("policy", policy)]))
        .sum();
    assert_eq!(refused_here, 6.0, "{text}");
    let near = "ratelimit_near_limit_total";
    assert_eq!(rule(near, "/two-rules", "2-per-1s"), 1.0);
    assert_eq!(rule(near, "/two-rules", "3-per-3600s"), 1.0);
    assert_eq!(rule(near, "/quota", "daily"), 1.0);
    let quota_alert = |percent: &str, outcome: &str| {
        let labels = [
            ("quota", "daily"),
            ("percent", percent),
            ("outcome", outcome),
        ];
        scraped(&text, "ratelimit_quota_alerts_total", &labels)
    };
    assert_eq!(quota_alert("80", "sent"), 1.0);
    assert_eq!(quota_alert("100", "failed"), 1.0);
    assert_eq!(scraped(&text, "ratelimit_quota_alerts_total", &[]), 2.0);
    let redis = [("store", "redis")];
    assert_eq!(scraped(&text, "ratelimit_store_errors_total", &redis), 4.0);
    let failed_calls = [("store", "redis"), ("outcome", "error")];
    let timed_out = [("store", "redis"), ("outcome", "timeout")];
    let count = "ratelimit_store_duration_seconds_count";
    assert_eq!(
        scraped(&text, count, &failed_calls) + scraped(&text, count, &timed_out),
        4.0
    );
    let delays = [("policy", "/delay")];
    assert_eq!(
        scraped(&text, "ratelimit_delay_seconds_count", &delays),
        1.0
    );
    assert!(
        !text.contains("alice") && !text.contains("quinn"),
        "identities in labels"
    );

    // Every metric the dashboard queries is exported.
    let names = dashboard_metrics();
    assert!(names.len() >= 7, "{names:?}");
    for name in &names {
        let exported = text
            .lines()
            .any(|line| !line.starts_with('#') && line.starts_with(&format!("{name}{{")));
        assert!(
            exported,
            "the dashboard queries {name}, which /metrics lacks:\n{text}"
        );
    }

    // The most refused identities, per policy.
    let top: serde_json::Value = client
        .get(format!(
            "http://127.0.0.1:{metrics_port}/debug/ratelimit/top?n=5"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let alice = &top["/two-rules"][0];
    assert_eq!(alice["identity"], "user:alice", "{top}");
    assert_eq!(
        (alice["count"].as_u64(), alice["error"].as_u64()),
        (Some(3), Some(0))
    );
    assert_eq!(top["/quota"][0]["identity"], "user:quinn", "{top}");
    assert_eq!(top["/shadow"][0]["count"], 2, "{top}");
    assert_eq!(top["/delay"], serde_json::json!([]), "{top}");

    // One identity: inspected (nothing counted), reset, admitted again.
    let one = |identity: &str| {
        format!("http://127.0.0.1:{metrics_port}/debug/ratelimit/%2Ftwo-rules/{identity}")
    };
    let inspect = || async {
        let response = client.get(one("user:alice")).send().await.unwrap();
        assert_eq!(response.status(), reqwest::StatusCode::OK);
        response.json::<serde_json::Value>().await.unwrap()
    };
    let state = inspect().await;
    let remaining = |state: &serde_json::Value| [0, 1].map(|i| state[i]["remaining"].clone());
    assert_eq!(
        remaining(&state),
        remaining(&inspect().await),
        "inspection counts nothing"
    );
    assert_eq!(state[1]["rule"], "3-per-3600s", "{state}");
    assert_eq!(
        (state[1]["limit"].as_u64(), state[1]["remaining"].as_u64()),
        (Some(3), Some(0))
    );
    assert_eq!(get(main, "/two-rules", "alice", "1").await, 429);
    let deleted = client.delete(one("user:alice")).send().await.unwrap();
    assert_eq!(deleted.status(), reqwest::StatusCode::NO_CONTENT);
    assert_eq!(inspect().await[1]["remaining"], 3);
    assert_eq!(get(main, "/two-rules", "alice", "1").await, 200);
    let unknown = format!("http://127.0.0.1:{metrics_port}/debug/ratelimit/%2Fnope/user:alice");
    let status = |url: String| {
        let request = client.get(url);
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(status(unknown).await, 404);
    assert_eq!(status(one("user:%7Bx%7D")).await, 400);
}

/// The demo serves the gRPC health service on its listen port, next to HTTP; a route that
/// lists the health check beside an HTTP path limits both from one budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_grpc_health_next_to_http_and_a_route_limits_both() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = load_config(
        "[[routes]]\npaths = [\"/api/ping\", \"/grpc.health.v1.Health/Check\"]\n\
             rules = [{ limit = 2, period = \"1m\" }]\n",
    )
    .unwrap();
    let server = tokio::spawn(run(config, listener));
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("h2c on the listen port");
    let mut grpc = HealthClient::new(channel);
    let check = || HealthCheckRequest {
        service: String::new(),
    };
    let serving = grpc.check(check()).await.expect("the first of 2");
    assert_eq!(serving.into_inner().status(), ServingStatus::Serving);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let ping = format!("http://{addr}/api/ping");
    assert_eq!(client.get(&ping).send().await.unwrap().status(), 200);
    let refused = grpc.check(check()).await.expect_err("the third");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert_eq!(client.get(&ping).send().await.unwrap().status(), 429);
    // Unknown HTTP paths are still HTTP 404s.
    let unknown = client
        .get(format!("http://{addr}/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    server.abort();
}

#[tokio::test]
async fn run_serves_the_curl_loop_over_tcp() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(run(load_config(DEFAULT_CONFIG).unwrap(), listener));
    // Proxy settings from the environment must not divert loopback requests.
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let url = format!("http://{addr}/api/ping");
    for i in 1..=22 {
        let response = client.get(&url).send().await.unwrap();
        let status = response.status();
        if i <= 20 {
            assert_eq!(status, reqwest::StatusCode::OK, "request {i}");
            assert_eq!(response.text().await.unwrap(), "PONG", "request {i}");
        } else {
            assert_eq!(
                status,
                reqwest::StatusCode::TOO_MANY_REQUESTS,
                "request {i}"
            );
            let retry: u64 = response.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                (1..=60).contains(&retry),
                "request {i}: Retry-After {retry}"
            );
        }
    }
    let health = client
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), reqwest::StatusCode::OK);
    assert_eq!(health.text().await.unwrap(), "ok");

    assert!(!server.is_finished());
    server.abort();
    assert!(server.await.unwrap_err().is_cancelled());
}
