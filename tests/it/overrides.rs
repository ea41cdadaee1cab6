//! Per-identity overrides: an allow list, a deny list, identities and client networks with rules
//! of their own, in code and from a config file, on the memory store and Redis.

use crate::common;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use common::redis_server::{TestRedis, unique_prefix};
use common::{assert_refused, from_user, json, request_from, send};
use http::{Response, StatusCode};
use tower_redis_ratelimit::{
    Key, MemoryStore, Policy, PolicyBuilder, PolicyError, RateLimitLayer, RedisStore, Rule, Store,
    UserId, policy::Override,
};

fn app(layer: &RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer.clone())
}

fn has_limit_headers(response: &Response<Body>) -> bool {
    response.headers().contains_key("ratelimit-policy")
        || response.headers().contains_key("ratelimit")
}

fn by_user(prefix: &str) -> PolicyBuilder {
    Policy::builder("ovr")
        .prefix(prefix)
        .key(Key::user())
        .rule(Rule::per_minute(1))
}

async fn overrides_apply(store: Arc<dyn Store>, prefix: &str) {
    let policy = by_user(prefix)
        .overrides([
            Override::identity("vip").unlimited(),
            Override::identity("big").rules([Rule::per_minute(3)]),
            Override::identity("evil").deny(),
        ])
        .build()
        .unwrap();
    let layer = RateLimitLayer::try_new(policy, store).unwrap();
    let app = app(&layer);

    // The allow list: never limited, no headers, nothing counted.
    for _ in 0..5 {
        let response = send(&app, from_user("vip")).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(!has_limit_headers(&response));
    }
    assert_eq!(layer.inspect("user:vip").await.unwrap()[0].remaining, 1);

    // The deny list: 403 with a problem body, no rate-limit headers, counted nowhere.
    for _ in 0..3 {
        let response = send(&app, from_user("evil")).await;
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        assert!(!has_limit_headers(&response));
        assert!(response.headers().get("retry-after").is_none());
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        let body = json(response).await;
        assert_eq!(
            (body["status"].as_u64(), body["title"].as_str()),
            (Some(403), Some("Forbidden"))
        );
    }
    assert_eq!(layer.inspect("user:evil").await.unwrap()[0].remaining, 1);
    assert!(layer.top_refused(10).is_empty());

    // Rules of its own: three a minute, and its headers say so.
    for left in [2, 1, 0] {
        let response = send(&app, from_user("big")).await;
        assert_eq!(response.status(), StatusCode::OK);
        let limits = common::limits(&response);
        assert_eq!(limits.policy("3-per-60s").unwrap().quota, 3);
        assert_eq!(limits.status("3-per-60s").unwrap().remaining, left);
    }
    assert_refused(send(&app, from_user("big")).await, &["3-per-60s"]).await;

    // Everyone else: the policy's one a minute.
    assert_eq!(send(&app, from_user("ann")).await.status(), StatusCode::OK);
    assert_refused(send(&app, from_user("ann")).await, &["1-per-60s"]).await;
    let top = layer.top_refused(10);
    let identities: Vec<&str> = top.iter().map(|entry| entry.identity.as_str()).collect();
    assert_eq!(identities.len(), 2, "{identities:?}");
    assert!(identities.contains(&"user:big") && identities.contains(&"user:ann"));
}

#[tokio::test]
async fn an_allow_list_a_deny_list_and_own_rules_in_memory() {
    overrides_apply(Arc::new(MemoryStore::new()), "rl").await;
}

#[tokio::test]
async fn an_allow_list_a_deny_list_and_own_rules_in_redis() {
    let redis = TestRedis::shared();
    let store = RedisStore::from_url(&redis.url).unwrap();
    overrides_apply(Arc::new(store), &unique_prefix("overrides")).await;
}

#[tokio::test]
async fn a_network_gets_its_own_rules_and_an_address_is_matched_exactly() {
    let policy = Policy::builder("ovr-net")
        .key(Key::ip())
        .rule(Rule::per_minute(1))
        .overrides([
            Override::identity("10.9.9.9").deny(),
            Override::cidr("10.0.0.0/8".parse().unwrap()).rules([Rule::per_minute(3)]),
            // An IPv6 client counts by its /64, but an override names its own address.
            Override::identity("2001:db8::1").unlimited(),
        ])
        .build()
        .unwrap();
    let app = app(&RateLimitLayer::new(policy, MemoryStore::new()));
    let get_from = |peer: &str| send(&app, request_from(peer, "/"));

    // Two clients of the network: each has three a minute of its own.
    for peer in ["10.1.2.3:1", "10.200.0.1:1"] {
        for _ in 0..3 {
            assert_eq!(get_from(peer).await.status(), StatusCode::OK);
        }
        assert_refused(get_from(peer).await, &["3-per-60s"]).await;
    }
    // The exact address wins over the network holding it.
    assert_eq!(get_from("10.9.9.9:1").await.status(), StatusCode::FORBIDDEN);
    // Outside the network: the policy's rule.
    assert_eq!(get_from("192.0.2.1:1").await.status(), StatusCode::OK);
    assert_refused(get_from("192.0.2.1:1").await, &["1-per-60s"]).await;
    // The IPv6 address is unlimited; its /64 neighbour is not.
    for _ in 0..3 {
        assert_eq!(get_from("[2001:db8::1]:1").await.status(), StatusCode::OK);
    }
    assert_eq!(get_from("[2001:db8::2]:1").await.status(), StatusCode::OK);
    assert_refused(get_from("[2001:db8::2]:1").await, &["1-per-60s"]).await;
}

#[tokio::test]
async fn a_header_key_matches_the_value_it_hashes() {
    let policy = Policy::builder("ovr-header")
        .key(Key::header("x-api-key"))
        .rule(Rule::per_minute(1))
        .overrides([Override::identity("partner-key").unlimited()])
        .build()
        .unwrap();
    let app = app(&RateLimitLayer::new(policy, MemoryStore::new()));
    let with_key = |key: &str| {
        let mut request = request_from("192.0.2.1:1", "/");
        request
            .headers_mut()
            .insert("x-api-key", key.parse().unwrap());
        send(&app, request)
    };
    for _ in 0..3 {
        assert_eq!(with_key("partner-key").await.status(), StatusCode::OK);
    }
    assert_eq!(with_key("other-key").await.status(), StatusCode::OK);
    assert_eq!(
        with_key("other-key").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[test]
fn overrides_that_cannot_work_are_refused_when_built() {
    let refused = |overrides: Vec<Override>, key: Key| {
        let error = Policy::builder("p")
            .key(key)
            .rule(Rule::per_minute(1))
            .overrides(overrides)
            .build()
            .unwrap_err();
        match &error {
            PolicyError::InvalidOverride { index, .. } => (*index, error.to_string()),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        refused(
            vec![
                Override::identity("a").deny(),
                Override::identity("a").unlimited()
            ],
            Key::user()
        ),
        (
            1,
            "policy \"p\", overrides[1]: identity \"a\" is already overridden by overrides[0]"
                .to_owned()
        )
    );
    assert_eq!(
        refused(vec![Override::identity("alice").deny()], Key::ip()).1,
        "policy \"p\", overrides[0]: identity \"alice\" is not an IP address (the policy is keyed \
         by client IP; name a network with cidr)"
    );
    assert_eq!(
        refused(vec![Override::identity("x").deny()], Key::global()).0,
        0
    );
    let zero = refused(
        vec![
            Override::identity("x").unlimited(),
            Override::identity("y").rules([Rule::per_minute(0)]),
        ],
        Key::user(),
    );
    assert_eq!(zero.0, 1);
    assert!(
        zero.1.contains("the limit must be at least 1"),
        "{}",
        zero.1
    );
}

#[cfg(feature = "config")]
mod from_a_file {
    use super::*;
    use tower_redis_ratelimit::config::RateLimitConfig;

    /// The issue's example, on a route keyed by user.
    const FILE: &str = r#"
[[routes]]
path = "/"
key = "user"
rules = [{ limit = 1, period = "1m" }]
overrides = [{ identity = "vip", unlimited = true }, { identity = "big", rules = [{ limit = 4, period = "1m" }] },
             { identity = "evil", deny = true }, { cidr = "10.0.0.0/8", rules = [{ limit = 1000, period = "1m" }] }]
"#;

    #[tokio::test]
    async fn overrides_come_from_the_config_file() {
        let config = RateLimitConfig::from_toml_str(FILE).unwrap();
        let app = config
            .apply(Router::new().route("/", get(|| async { "hello" })))
            .unwrap();
        for _ in 0..3 {
            assert_eq!(send(&app, from_user("vip")).await.status(), StatusCode::OK);
        }
        assert_eq!(
            send(&app, from_user("evil")).await.status(),
            StatusCode::FORBIDDEN
        );
        for _ in 0..4 {
            assert_eq!(send(&app, from_user("big")).await.status(), StatusCode::OK);
        }
        assert_refused(send(&app, from_user("big")).await, &["4-per-60s"]).await;
        // A user on the internal network: its thousand a minute.
        let mut internal = request_from("10.0.0.5:1", "/");
        internal.extensions_mut().insert(UserId::new("ann"));
        let response = send(&app, internal).await;
        assert_eq!(
            common::limits(&response)
                .policy("1000-per-60s")
                .unwrap()
                .quota,
            1000
        );
        assert_eq!(send(&app, from_user("ann")).await.status(), StatusCode::OK);
        assert_refused(send(&app, from_user("ann")).await, &["1-per-60s"]).await;
    }

    #[test]
    fn a_bad_override_names_its_field() {
        let cases = [
            (
                r#"{ identity = "a" }"#,
                "routes[0].overrides[0]: says nothing to do: give rules = [...], unlimited = true or deny = true (line 5, column 14)",
            ),
            (
                r#"{ identity = "a", deny = true, unlimited = true }"#,
                "routes[0].overrides[0]: may give only one of rules = [...], unlimited = true and deny = true (line 5, column 14)",
            ),
            (
                r#"{ deny = true }"#,
                "routes[0].overrides[0]: names no one: give identity = \"...\" or cidr = \"...\" (line 5, column 14)",
            ),
            (
                r#"{ identity = "a", cidr = "10.0.0.0/8", deny = true }"#,
                "routes[0].overrides[0]: names both identity and cidr: an override is for one or the other (line 5, column 14)",
            ),
            (
                r#"{ cidr = "10.0.0.0/33", deny = true }"#,
                "routes[0].overrides[0].cidr: \"10.0.0.0/33\" is not a CIDR such as \"10.0.0.0/8\" or \"fd00::/8\" (line 5, column 23)",
            ),
            (
                r#"{ identity = "a", unlimited = false }"#,
                "routes[0].overrides[0].unlimited: unlimited = false does nothing: leave it out (line 5, column 44)",
            ),
            (
                r#"{ identity = "a", rules = [] }"#,
                "routes[0].overrides[0].rules: must list at least one rule (line 5, column 40)",
            ),
            (
                r#"{ identity = "a", rules = [{ limit = 0, period = "1m" }] }"#,
                "routes[0].overrides[0].rules[0].limit: must be at least 1 (line 5, column 51)",
            ),
            (
                r#"{ identity = "a", rules = [{ limit = 2, period = "soon" }] }"#,
                "routes[0].overrides[0].rules[0].period: invalid duration \"soon\" (expected number at 0): expected a number and a unit, such as \"500ms\", \"10s\", \"1m\", \"1h30m\" or \"1d\" (line 5, column 63)",
            ),
            (
                r#"{ identity = "a", deny = true }, { identity = "a", unlimited = true }"#,
                "routes[0].overrides[1]: identity \"a\" is already overridden by overrides[0] (line 5, column 47)",
            ),
            (
                r#"{ identity = "a", denied = true }"#,
                "routes[0].overrides[0].denied: unknown field `denied`, expected one of `identity`, `cidr`, `rules`, `unlimited`, `deny` (line 5, column 32)",
            ),
        ];
        for (overrides, expected) in cases {
            let text = format!(
                "[[routes]]\npath = \"/\"\nkey = \"user\"\nrules = [{{ limit = 1, period = \"1m\" }}]\noverrides = [{overrides}]\n"
            );
            let error = RateLimitConfig::from_toml_str(&text)
                .unwrap_err()
                .to_string();
            assert_eq!(error, expected, "{overrides}");
        }
    }
}

#[tokio::test]
async fn an_address_override_wins_over_an_earlier_network() {
    let policy = Policy::builder("ovr-order")
        .key(Key::ip())
        .rule(Rule::per_minute(1))
        .overrides([
            Override::cidr("10.0.0.0/8".parse().unwrap()).deny(),
            // Written as an IPv4-mapped IPv6 address: the same client.
            Override::identity("::ffff:10.1.2.3").unlimited(),
        ])
        .build()
        .unwrap();
    let app = app(&RateLimitLayer::new(policy, MemoryStore::new()));
    for _ in 0..3 {
        let response = send(&app, request_from("10.1.2.3:1", "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    let neighbour = send(&app, request_from("10.1.2.4:1", "/")).await;
    assert_eq!(neighbour.status(), StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn shadow_mode_lets_a_denied_identity_through_and_counts_it() {
    let policy = by_user("rl")
        .mode(tower_redis_ratelimit::Mode::Shadow)
        .overrides([Override::identity("evil").deny()])
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(policy, MemoryStore::new());
    let app = app(&layer);
    assert_eq!(send(&app, from_user("evil")).await.status(), StatusCode::OK);
    assert_eq!(layer.shadow_refusals(), 1);
}

#[tokio::test]
async fn a_layer_setter_after_serving_reaches_the_override_rules() {
    let policy = by_user("rl")
        .overrides([Override::identity("big").rules([Rule::per_minute(3)])])
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(policy, MemoryStore::new());
    let first = send(&app(&layer), from_user("big")).await;
    assert!(first.headers().get("x-ratelimit-limit").is_none());
    // A setter clones the limiter, whose override limiters were made by the first request.
    let legacy = layer.legacy_headers(true);
    let second = send(&app(&legacy), from_user("big")).await;
    assert_eq!(
        second.headers()["x-ratelimit-limit"],
        "3",
        "{:?}",
        second.headers()
    );
}
