//! `RateLimitConfig` (feature `config`): the documented defaults of a minimal file, every example
//! config loading, bad files refused naming the field with its line and column, other serde
//! formats, and the policies applied to a router.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use proptest::prelude::*;
use tower::ServiceExt;
use tower_redis_ratelimit::config::{ConfigFile, RateLimitConfig, StoreSpec};
use tower_redis_ratelimit::{Algorithm, Mode, OnStoreError, Rule};

const MINIMAL: &str = r#"
[[routes]]
path = "/api/ping"
rules = [{ limit = 10, period = "1m" }]
"#;

#[test]
fn a_minimal_file_gets_every_documented_default() {
    let config = RateLimitConfig::from_toml_str(MINIMAL).unwrap();
    assert_eq!(config.store_spec(), &StoreSpec::Memory);
    assert_eq!(config.prefix(), "rl");
    assert!(config.trusted_proxies().is_empty());
    assert!(!config.legacy_headers());
    let [route] = config.routes() else {
        panic!("one route")
    };
    assert_eq!((route.path(), route.key()), ("/api/ping", "ip"));
    let policy = route.policy();
    assert_eq!(policy.name(), "/api/ping");
    assert_eq!(policy.prefix(), "rl");
    assert_eq!(policy.key().kind(), "ip");
    assert_eq!(policy.algorithm(), Algorithm::SlidingLog);
    assert_eq!(policy.mode(), Mode::Enforce);
    assert_eq!(policy.on_store_error(), OnStoreError::Allow);
    assert_eq!(policy.rules(), [Rule::per_minute(10)]);
    assert!(policy.block_for().is_none() && policy.concurrency().is_none());
    assert!(policy.quota().is_none());
}

#[test]
fn durations_are_written_as_people_write_them() {
    let text = r#"
        [[routes]]
        path = "/a"
        rules = [{ limit = 1, period = "500ms" }, { limit = 2, period = "1h30m" }, { limit = 3, period = "1d" }]
        block_for = "2m 30s"
    "#;
    let config = RateLimitConfig::from_toml_str(text).unwrap();
    let policy = config.policy("/a").unwrap();
    assert_eq!(
        policy.rules(),
        [
            Rule::new(1, Duration::from_millis(500)),
            Rule::new(2, Duration::from_secs(5400)),
            Rule::per_day(3),
        ]
    );
    assert_eq!(policy.block_for(), Some(Duration::from_secs(150)));
}

#[test]
fn every_example_config_loads() {
    for path in common::example_configs() {
        let path = path.display();
        let text = std::fs::read_to_string(path.to_string()).unwrap();
        let config = RateLimitConfig::loader()
            .app_fields(["listen", "metrics"])
            .from_toml_str(&text)
            .unwrap_or_else(|error| panic!("{path}: {error}"));
        assert!(!config.routes().is_empty(), "{path}");
        // Without the app's fields allowed, they are unknown fields.
        let error = RateLimitConfig::from_toml_str(&text).unwrap_err();
        assert_eq!(error.field(), "listen", "{path}: {error}");
    }
}

/// A file of one route with `line` added to it, and the error it gets.
fn route_error(line: &str) -> String {
    let text = format!(
        "prefix = \"p\"\n\n[[routes]]\npath = \"/a\"\nrules = [{{ limit = 5, period = \"1m\" }}]\n{line}\n"
    );
    RateLimitConfig::from_toml_str(&text)
        .expect_err("the config should be refused")
        .to_string()
}

#[test]
fn bad_route_fields_are_refused_naming_the_field_line_and_column() {
    let cases = [
        (
            "algoritm = \"fixed_window\"",
            "routes[0].algoritm: unknown field `algoritm`, expected one of `path`, `paths`, `name`, `key`, \
             `algorithm`, `rules`, `prevent_duplicate`, `block_for`, `mode`, `max_delay`, \
             `cost_header`, `count_only`, `prefetch`, `max_in_flight`, `lease`, `overrides`, \
             `meter` (line 6, column 1)",
        ),
        (
            "algorithm = \"token\"",
            "routes[0].algorithm: unknown algorithm \"token\": expected \"fixed_window\", \
             \"sliding_log\", \"sliding_counter\" or \"token_bucket\" (line 6, column 13)",
        ),
        (
            "key = \"cookie\"",
            "routes[0].key: unknown key \"cookie\": expected \"ip\", \"user\", \"global\", \
             \"header:<name>\" or \"query:<name>\" (line 6, column 7)",
        ),
        (
            "key = 3",
            "routes[0].key: invalid type: integer `3`, expected a string (line 6, column 7)",
        ),
        (
            "block_for = \"soon\"",
            "routes[0].block_for: invalid duration \"soon\" (expected number at 0): expected a \
             number and a unit, such as \"500ms\", \"10s\", \"1m\", \"1h30m\" or \"1d\" (line \
             6, column 13)",
        ),
        (
            "block_for = \"0s\"",
            "routes[0].block_for: \"0s\" must be longer than zero (line 6, column 13)",
        ),
        (
            "mode = \"delay\"",
            "routes[0].max_delay: is required with mode = \"delay\": the longest a request may \
             wait, such as \"2s\" (line 3, column 1)",
        ),
        (
            "mode = \"later\"",
            "routes[0].mode: unknown value \"later\": expected \"enforce\", \"shadow\" or \
             \"delay\" (line 6, column 8)",
        ),
        (
            "max_in_flight = 1",
            "routes[0].lease: is required with max_in_flight: the longest a request holds its \
             slot, such as \"30s\" (a crashed instance must not hold one for ever) (line 3, \
             column 1)",
        ),
        (
            "cost_header = \"x cost\"",
            "routes[0].cost_header: \"x cost\" is not a header name (line 6, column 15)",
        ),
        (
            "count_only = [401, 700]",
            "routes[0].count_only[1]: 700 is not an HTTP status: write a code from 100 to 599 \
             (401) or a class (\"1xx\" to \"5xx\") (line 6, column 20)",
        ),
        (
            "count_only = [\"6xx\"]",
            "routes[0].count_only[0]: \"6xx\" is not an HTTP status: write a code from 100 to \
             599 (401) or a class (\"1xx\" to \"5xx\") (line 6, column 15)",
        ),
        (
            "count_only = []",
            "routes[0].count_only: lists no status: name the ones that count, such as [401, 403] \
             or [\"5xx\"] (line 6, column 14)",
        ),
        (
            "count_only = [true]",
            "routes[0].count_only[0]: invalid type: boolean `true`, expected a status code (401) \
             or a class (\"4xx\") (line 6, column 15)",
        ),
        (
            "name = \"a b\"",
            "routes[0].name: policy name \"a b\" must be 1 to 64 characters of letters, digits \
             and -._~@+=!*(),/ (it is part of every store key) (line 6, column 8)",
        ),
    ];
    for (line, expected) in cases {
        assert_eq!(route_error(line), expected, "with {line:?}");
    }
}

#[test]
fn bad_rules_and_top_level_fields_are_refused_naming_the_field() {
    let with_rules = |rules: &str| {
        let text = format!("[[routes]]\npath = \"/a\"\nrules = {rules}\n");
        RateLimitConfig::from_toml_str(&text)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        with_rules("[{ limit = 5, period = \"1m\" }, { limit = 0, period = \"1h\" }]"),
        "routes[0].rules[1].limit: must be at least 1 (line 3, column 50)"
    );
    assert_eq!(
        with_rules("[{ limit = 5 }]"),
        "routes[0].rules[0]: missing field `period` (line 3, column 10)"
    );
    assert_eq!(
        with_rules("[{ limit = -5, period = \"1m\" }]"),
        "routes[0].rules[0].limit: invalid value: integer `-5`, expected u64 (line 3, column 20)"
    );
    assert_eq!(
        with_rules("[{ limit = 5, period = \"1m\" }, { limit = 5, period = \"60s\" }]"),
        "routes[0].rules[1]: 5 per 60s is the same rule as rules[0] (line 3, column 40)"
    );
    assert_eq!(
        with_rules("[]"),
        "routes[0].rules: must list at least one rule (line 3, column 9)"
    );
    let top = |line: &str| {
        RateLimitConfig::from_toml_str(&format!("{line}\n{MINIMAL}"))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        top("prefx = \"app\""),
        "prefx: unknown field: expected store, prefix, on_store_error, store_timeout, \
         trusted_proxies, forwarded_header, legacy_headers, tls_ca, tls_insecure, \
         wait_for_replicas, routes or quota (line 1, column 9)"
    );
    assert_eq!(
        top("store = \"disk\""),
        "store: unknown store \"disk\": expected \"memory\" or a URL such as \
         \"redis://127.0.0.1:6379/0\" (line 1, column 9)"
    );
    assert_eq!(
        top("store = { clustr = [] }"),
        "store.clustr: unknown field `clustr`, expected one of `cluster`, `sentinel`, `master` \
         (line 1, column 11)"
    );
    assert_eq!(
        top("trusted_proxies = [\"10.0.0.0/8\", \"proxy\"]"),
        "trusted_proxies[1]: \"proxy\" is not a CIDR such as \"10.0.0.0/8\" or \"fd00::/8\" \
         (line 1, column 34)"
    );
    assert_eq!(
        top("on_store_error = \"maybe\""),
        "on_store_error: unknown value \"maybe\": expected \"allow\" or \"deny\" (line 1, column 18)"
    );
    assert_eq!(
        top("legacy_headers = \"yes\""),
        "legacy_headers: invalid type: string \"yes\", expected a boolean (line 1, column 18)"
    );
    assert_eq!(
        top("wait_for_replicas = 1"),
        "wait_for_replicas: applies only to a Redis store, not \"memory\" (line 1, column 21)"
    );
    let duplicate = format!("{MINIMAL}{MINIMAL}");
    assert_eq!(
        RateLimitConfig::from_toml_str(&duplicate)
            .unwrap_err()
            .to_string(),
        "routes[1].path: \"/api/ping\" is already used by routes[0] (line 7, column 8)"
    );
    assert_eq!(
        RateLimitConfig::from_toml_str("routes = []")
            .unwrap_err()
            .to_string(),
        "routes: must list at least one route (line 1, column 10)"
    );
    assert_eq!(
        RateLimitConfig::from_toml_str("").unwrap_err().to_string(),
        "missing field `routes` (line 1, column 1)"
    );
    let syntax = RateLimitConfig::from_toml_str("[[routes]\npath = 1").unwrap_err();
    assert_eq!(syntax.location(), Some((1, 10)), "{syntax}");
}

/// The file of a bad-field case: `R` adds the line to a route, `T` to the top level, `Q` to a
/// `[quota]` section; `N` is a whole file.
fn case_file(kind: &str, line: &str) -> String {
    const ROUTE: &str = "[[routes]]\npath = \"/a\"\nrules = [{ limit = 5, period = \"1m\" }]\n";
    match kind {
        "R" => format!("{ROUTE}{line}\n"),
        "T" => format!("{line}\n{ROUTE}"),
        "Q" => format!("{ROUTE}[quota]\n{line}\n"),
        _ => line.to_owned(),
    }
}

#[test]
fn each_field_wrong_in_each_way_is_refused_naming_it() {
    let cases = [
        (
            "R",
            "prevent_duplicate = { limit = 2, period = \"2s\" }",
            "routes[0].prevent_duplicate.limit: the duplicate guard admits one request per period: leave out the limit or make it 1 (use a rule for more) (line 4, column 31)",
        ),
        (
            "R",
            "prevent_duplicate = \"yes\"",
            "routes[0].prevent_duplicate: invalid type: string \"yes\", expected true, false, or a table such as { period = \"2s\" } (line 4, column 21)",
        ),
        (
            "R",
            "prevent_duplicate = { period = \"never\" }",
            "routes[0].prevent_duplicate.period: invalid duration \"never\" (expected number at 0): expected a number and a unit, such as \"500ms\", \"10s\", \"1m\", \"1h30m\" or \"1d\" (line 4, column 32)",
        ),
        (
            "R",
            "max_delay = \"1s\"",
            "routes[0].max_delay: applies only with mode = \"delay\" (line 4, column 13)",
        ),
        (
            "R",
            "lease = \"30s\"",
            "routes[0].lease: applies only with max_in_flight (line 4, column 9)",
        ),
        (
            "R",
            "max_in_flight = 0",
            "routes[0].max_in_flight: must be at least 1 (line 4, column 17)",
        ),
        (
            "N",
            "[[routes]]\npath = \"/a\"\nalgorithm = \"fixed_window\"\nrules = [{ limit = 5, period = \"1m\", burst = 9 }]",
            "routes[0].rules[0].burst: 5 per 60s: a burst applies only to the token_bucket algorithm (line 4, column 46)",
        ),
        (
            "N",
            "[[routes]]\npath = \"/a\"\nname = \"x\"\nrules = [{ limit = 5, period = \"1m\" }]\n[[routes]]\npath = \"/b\"\nname = \"x\"\nrules = [{ limit = 5, period = \"1m\" }]",
            "routes[1].name: \"x\" is already the name of routes[0] (line 7, column 8)",
        ),
        (
            "T",
            "store_timeout = \"fast\"",
            "store_timeout: invalid duration \"fast\" (expected number at 0): expected a number and a unit, such as \"500ms\", \"10s\", \"1m\", \"1h30m\" or \"1d\" (line 1, column 17)",
        ),
        (
            "T",
            "forwarded_header = \"via\"",
            "forwarded_header: unknown forwarded header \"via\": expected \"x-forwarded-for\", \"forwarded\" or \"x-real-ip\" (line 1, column 20)",
        ),
        (
            "T",
            "prefix = \"a b\"",
            "prefix: \"a b\" must be 1 to 64 letters, digits and -._~@+=!*(),/ (it starts every store key) (line 1, column 10)",
        ),
        (
            "T",
            "tls_ca = \"ca.pem\"",
            "tls_ca: applies only to a Redis store, not \"memory\" (line 1, column 10)",
        ),
        (
            "T",
            "tls_insecure = true",
            "tls_insecure: applies only to a Redis store, not \"memory\" (line 1, column 16)",
        ),
        (
            "T",
            "store = 5",
            "store: invalid type: integer `5`, expected \"memory\", a URL, or a table with cluster = [...] or sentinel = [...] and master = \"...\" (line 1, column 9)",
        ),
        (
            "T",
            "store = { cluster = [] }",
            "store.cluster: must list at least one node URL (line 1, column 21)",
        ),
        (
            "T",
            "store = { cluster = [\"http://x:1\"] }",
            "store.cluster[0]: \"http://x:1\" is not a redis:// or rediss:// URL (line 1, column 22)",
        ),
        (
            "T",
            "store = { sentinel = [\"redis://127.0.0.1:26379\"] }",
            "store.master: is required with sentinel = [...]: the name the sentinels know the primary by, such as \"mymaster\" (line 1, column 9)",
        ),
        (
            "T",
            "store = { cluster = [\"redis://a:1\"], sentinel = [\"redis://b:1\"] }",
            "store: expected either cluster = [...] or sentinel = [...], not both (line 1, column 9)",
        ),
        (
            "T",
            "store = { cluster = [\"redis://a:1\", \"rediss://b:1\"] }",
            "store.cluster[1]: \"rediss://b:1\" and store.cluster[0] differ in TLS: use rediss:// for every URL or for none (line 1, column 37)",
        ),
        (
            "T",
            "store = { cluster = [\"redis://a:1\"], master = \"m\" }",
            "store.master: applies only with sentinel = [...] (a cluster finds its primaries itself) (line 1, column 47)",
        ),
        (
            "Q",
            "tiers = {}",
            "quota.tiers: must name at least one tier, such as { free = 100 } (line 5, column 9)",
        ),
        (
            "Q",
            "tiers = { free = 0 }",
            "quota.tiers.free: must be 1 to 2^35 requests per day (line 5, column 18)",
        ),
        (
            "Q",
            "tiers = { free = 10, pro = 100 }",
            "quota.default_tier: is required with more than one tier: the tier of requests without a known one (line 4, column 1)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\ndefault_tier = \"gold\"",
            "quota.default_tier: \"gold\" is not one of the tiers (line 6, column 16)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\nalert_at = [0, 100]",
            "quota.alert_at: 0 is not a percent from 1 to 100 (line 6, column 12)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\nalert_at = [101]",
            "quota.alert_at: 101 is not a percent from 1 to 100 (line 6, column 12)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\nutc_offset = \"++5:00\"",
            "quota.utc_offset: \"++5:00\" is not an offset such as \"+00:00\", \"+05:30\" or \"-08:00\" (at most 18 hours) (line 6, column 14)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\nutc_offset = \"+25:00\"",
            "quota.utc_offset: \"+25:00\" is not an offset such as \"+00:00\", \"+05:30\" or \"-08:00\" (at most 18 hours) (line 6, column 14)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\nalert_webhook = \"https://hooks.example/x\"",
            "quota.alert_webhook: \"https://hooks.example/x\" is not an http:// URL (line 6, column 17)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\nkey = \"cookie\"",
            "quota.key: unknown key \"cookie\": expected \"ip\", \"user\", \"global\", \"header:<name>\" or \"query:<name>\" (line 6, column 7)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\ntier_header = \"x tier\"",
            "quota.tier_header: \"x tier\" is not a header name (line 6, column 15)",
        ),
        (
            "Q",
            "tiers = { free = 10 }\ncolour = 1",
            "quota.colour: unknown field `colour`, expected one of `key`, `tier_header`, `default_tier`, `tiers`, `alert_at`, `alert_webhook`, `utc_offset`, `metered` (line 6, column 1)",
        ),
    ];
    let wrong: Vec<String> = cases
        .iter()
        .filter_map(|(kind, line, expected)| {
            let actual = match RateLimitConfig::from_toml_str(&case_file(kind, line)) {
                Ok(_) => "(accepted)".to_owned(),
                Err(error) => error.to_string(),
            };
            (actual != *expected)
                .then(|| format!("{line}\n  expected {expected}\n  actual   {actual}"))
        })
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn other_serde_formats_get_the_same_checks() {
    let json = serde_json::json!({
        "prefix": "app",
        "routes": [{ "path": "/a", "key": "user", "rules": [{ "limit": 3, "period": "1s" }] }],
    });
    let config: RateLimitConfig = serde_json::from_value(json).unwrap();
    assert_eq!(config.policy("/a").unwrap().key().kind(), "user");
    assert_eq!(config.prefix(), "app");
    let bad = serde_json::json!({ "routes": [{ "path": "/a", "rules": [{ "limit": 0, "period": "1s" }] }] });
    let error = serde_json::from_value::<RateLimitConfig>(bad).unwrap_err();
    assert_eq!(
        error.to_string(),
        "routes[0].rules[0].limit: must be at least 1"
    );
    // The file format itself, for tools that edit it.
    let file: ConfigFile = toml::from_str(MINIMAL).unwrap();
    assert_eq!(file.routes[0].path.as_deref(), Some("/api/ping"));
}

async fn status(app: &Router, path: &str) -> StatusCode {
    let request = Request::get(path).body(Body::empty()).unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

#[tokio::test]
async fn apply_limits_each_route_by_its_policy_and_leaves_the_others_alone() {
    let config = RateLimitConfig::from_toml_str(
        r#"
        legacy_headers = true
        [[routes]]
        path = "/two"
        rules = [{ limit = 2, period = "1m" }]
        [[routes]]
        path = "/users/{id}"
        key = "global"
        rules = [{ limit = 1, period = "1m" }]
        "#,
    )
    .unwrap();
    let router = Router::new()
        .route("/two", get(|| async { "two" }))
        .route("/users/{id}", get(|| async { "user" }))
        .route("/free", get(|| async { "free" }));
    let app = config
        .apply(router)
        .unwrap()
        .layer(MockConnectInfo(SocketAddr::from(([127, 0, 0, 1], 4000))));
    assert_eq!(status(&app, "/two").await, StatusCode::OK);
    let request = Request::get("/two").body(Body::empty()).unwrap();
    let second = app.clone().oneshot(request).await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(second.headers()["x-ratelimit-remaining"], "0");
    assert_eq!(status(&app, "/two").await, StatusCode::TOO_MANY_REQUESTS);
    // A templated path: every user shares the one global count of its route.
    assert_eq!(status(&app, "/users/1").await, StatusCode::OK);
    assert_eq!(
        status(&app, "/users/2").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    for _ in 0..5 {
        assert_eq!(status(&app, "/free").await, StatusCode::OK);
    }
}

#[tokio::test]
async fn a_route_of_several_paths_gives_them_one_policy_and_one_budget() {
    let config = RateLimitConfig::from_toml_str(
        r#"
        [[routes]]
        paths = ["/ping", "/users/{id}"]
        key = "global"
        rules = [{ limit = 3, period = "1m" }]
        [[routes]]
        path = "/a"
        paths = ["/b"]
        rules = [{ limit = 1, period = "1m" }]
        "#,
    )
    .unwrap();
    let routes = config.routes();
    assert_eq!(routes[0].path(), "/ping");
    assert_eq!(routes[0].paths(), ["/ping", "/users/{id}"]);
    // Named by its first path.
    assert_eq!(routes[0].policy().name(), "/ping");
    assert_eq!(routes[1].paths(), ["/a", "/b"]);

    let router = Router::new()
        .route("/ping", get(|| async { "pong" }))
        .route("/users/{id}", get(|| async { "user" }))
        .route("/a", get(|| async { "a" }))
        .route("/b", get(|| async { "b" }));
    let app = config
        .apply(router)
        .unwrap()
        .layer(MockConnectInfo(SocketAddr::from(([127, 0, 0, 1], 4000))));
    for path in ["/ping", "/users/1", "/ping"] {
        assert_eq!(status(&app, path).await, StatusCode::OK, "{path}");
    }
    assert_eq!(
        status(&app, "/users/2").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(status(&app, "/ping").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status(&app, "/b").await, StatusCode::OK);
    assert_eq!(status(&app, "/a").await, StatusCode::TOO_MANY_REQUESTS);
}

/// An HTTP request is limited by the route axum matched, never by a file path that merely equals
/// its own (only gRPC calls are found by their own path).
#[tokio::test]
async fn an_http_request_is_limited_by_its_matched_route_only() {
    let config = RateLimitConfig::from_toml_str(
        "[[routes]]\npath = \"/users/me\"\nrules = [{ limit = 1, period = \"1m\" }]\n",
    )
    .unwrap();
    let router = Router::new().route("/users/{id}", get(|| async { "user" }));
    let app = config
        .apply(router)
        .unwrap()
        .layer(MockConnectInfo(SocketAddr::from(([127, 0, 0, 1], 4000))));
    for _ in 0..3 {
        assert_eq!(status(&app, "/users/me").await, StatusCode::OK);
    }
}

#[test]
fn a_route_needs_a_path_and_no_path_is_limited_twice() {
    let refused = |routes: &str| {
        let error = RateLimitConfig::from_toml_str(routes).expect_err("refused");
        (error.field().to_owned(), error.message().to_owned())
    };
    let rules = "rules = [{ limit = 1, period = \"1m\" }]";
    assert_eq!(
        refused(&format!("[[routes]]\n{rules}\n")),
        (
            "routes[0].path".to_owned(),
            "a route needs a `path` or `paths`".to_owned()
        )
    );
    assert_eq!(
        refused(&format!("[[routes]]\npaths = [\"/a\", \"b\"]\n{rules}\n")),
        (
            "routes[0].paths[1]".to_owned(),
            "\"b\" must start with \"/\"".to_owned()
        )
    );
    assert_eq!(
        refused(&format!(
            "[[routes]]\npath = \"/a\"\n{rules}\n[[routes]]\npaths = [\"/b\", \"/a\"]\n{rules}\n"
        )),
        (
            "routes[1].paths[1]".to_owned(),
            "\"/a\" is already used by routes[0]".to_owned()
        )
    );
    assert_eq!(
        refused(&format!(
            "[[routes]]\npath = \"/a\"\npaths = [\"/a\"]\n{rules}\n"
        )),
        (
            "routes[0].paths[0]".to_owned(),
            "\"/a\" is already used by this route".to_owned()
        )
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the text, the loader answers (a config or an error), never panics.
    #[test]
    fn random_text_never_panics_the_loader(text in "\\PC{0,200}") {
        let _ = RateLimitConfig::from_toml_str(&text);
    }

    /// Nor does TOML that is well formed but says anything at all in the known fields.
    #[test]
    fn random_values_in_known_fields_never_panic_the_loader(
        limit in prop_oneof![Just("0".to_owned()), Just("-1".to_owned()), "[0-9]{1,20}", Just("\"x\"".to_owned())],
        period in prop_oneof![Just("\"1m\"".to_owned()), "\"[0-9a-zµ ]{0,12}\"", Just("5".to_owned())],
        key in prop_oneof![Just("\"ip\"".to_owned()), "\"(header|query):[ -~]{0,8}\"", "\"[a-z]{0,6}\""],
        extra in prop_oneof![
            Just(String::new()),
            "block_for = \"[0-9a-z]{0,6}\"",
            "mode = \"(delay|shadow|x)\"",
            "max_in_flight = [0-9]{1,3}",
            "lease = \"[0-9]{1,3}(ms|s|d)\"",
            "burst = [0-9]{1,3}",
        ],
    ) {
        let text = format!(
            "[[routes]]\npath = \"/a\"\nkey = {key}\nalgorithm = \"token_bucket\"\n{extra}\nrules = [{{ limit = {limit}, period = {period} }}]\n"
        );
        let _ = RateLimitConfig::from_toml_str(&text);
    }
}

/// A route with a meter (issue 48): `metered = true` rules count the units its meter reserves
/// (a fixed estimate, or a request header's) and settles from the response's usage header; a
/// metered `[quota]` counts them too, on routes with a meter only.
#[tokio::test]
async fn a_metered_route_reserves_and_settles_from_its_usage_header() {
    let config = RateLimitConfig::from_toml_str(
        r#"
        [quota]
        key = "header:x-api-key"
        tiers = { free = 100000 }
        metered = true
        [[routes]]
        path = "/v1/complete"
        key = "header:x-api-key"
        algorithm = "fixed_window"
        rules = [{ limit = 60, period = "1m" }, { limit = 1000, period = "1m", metered = true }]
        meter = { unit = "tokens", estimate = 500, estimate_header = "x-estimated-tokens", usage_header = "x-usage-tokens", max_usage = 1000000 }
        [[routes]]
        path = "/plain"
        key = "header:x-api-key"
        rules = [{ limit = 5, period = "1m" }]
        "#,
    )
    .unwrap();
    let [metered, plain] = config.routes() else {
        panic!("two routes")
    };
    let names: Vec<&str> = metered.policy().rule_names().iter().map(|n| &**n).collect();
    assert_eq!(names, ["60-per-60s", "1000-tokens-per-60s"]);
    assert_eq!(metered.policy().meter().unwrap().unit(), "tokens");
    assert!(metered.policy().quota().unwrap().is_metered());
    // The metered quota leaves the route without a meter alone.
    assert!(plain.policy().quota().is_none());
    let router = Router::new().route(
        "/v1/complete",
        get(|| async { ([("x-usage-tokens", "120")], "done") }),
    );
    let app = config.apply(router).unwrap();
    let call = |estimate: Option<&str>| {
        let mut request = Request::get("/v1/complete")
            .header("x-api-key", "k1")
            .body(Body::empty())
            .unwrap();
        if let Some(estimate) = estimate {
            request
                .headers_mut()
                .insert("x-estimated-tokens", estimate.parse().unwrap());
        }
        app.clone().oneshot(request)
    };
    let first = call(None).await.unwrap();
    let headers = common::limits(&first);
    assert_eq!(
        headers.status("1000-tokens-per-60s").unwrap().remaining,
        500
    );
    // The day's quota counts the 500 tokens reserved, not the request.
    assert_eq!(headers.status("daily").unwrap().remaining, 99_500);
    axum::body::to_bytes(first.into_body(), usize::MAX)
        .await
        .unwrap();
    // 120 settled; the header's estimate of 800 is reserved.
    let second = call(Some("800")).await.unwrap();
    let headers = common::limits(&second);
    assert_eq!(headers.status("1000-tokens-per-60s").unwrap().remaining, 80);
    assert_eq!(headers.status("60-per-60s").unwrap().remaining, 58);
    assert_eq!(
        headers.status("daily").unwrap().remaining,
        100_000 - 120 - 800
    );
    axum::body::to_bytes(second.into_body(), usize::MAX)
        .await
        .unwrap();
    // 240 used: an estimate of 800 doesn't fit, 700 does.
    let refused = call(Some("800")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(call(Some("700")).await.unwrap().status(), StatusCode::OK);
}

#[test]
fn bad_meters_are_refused_naming_the_field() {
    let rules = "rules = [{ limit = 1000, period = \"1m\", metered = true }]";
    let case = |route: &str| {
        let text = format!("[[routes]]\npath = \"/a\"\n{route}\n");
        RateLimitConfig::from_toml_str(&text)
            .expect_err("the config should be refused")
            .field()
            .to_owned()
    };
    assert_eq!(case(rules), "routes[0].meter");
    assert_eq!(
        case("rules = [{ limit = 10, period = \"1m\" }]\nmeter = { unit = \"tokens\" }"),
        "routes[0].meter"
    );
    assert_eq!(
        case(&format!("{rules}\nmeter = {{ unit = \"to kens\" }}")),
        "routes[0].meter"
    );
    assert_eq!(
        case(&format!(
            "{rules}\nmeter = {{ unit = \"tokens\", usage_header = \"bad header\" }}"
        )),
        "routes[0].meter.usage_header"
    );
    assert_eq!(
        case(&format!(
            "{rules}\nmeter = {{ unit = \"tokens\", estimate_header = \"bad header\" }}"
        )),
        "routes[0].meter.estimate_header"
    );
    assert_eq!(
        case(&format!(
            "{rules}\nmeter = {{ unit = \"tokens\", max_usage = 0 }}"
        )),
        "routes[0].meter.max_usage"
    );
    assert_eq!(
        case(&format!(
            "{rules}\nmeter = {{ unit = \"tokens\", units = 3 }}"
        )),
        "routes[0].meter.units"
    );
    assert_eq!(
        case(&format!(
            "{rules}\nmeter = {{ unit = \"tokens\" }}\nprefetch = 10\nalgorithm = \"fixed_window\""
        )),
        "routes[0].prefetch"
    );
}
