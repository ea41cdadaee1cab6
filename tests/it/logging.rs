//! A refused request is logged with its policy, rule, key kind and a non-secret form of the key,
//! and neither a refusal flood nor a store failing for every request is a log flood.

use crate::common;

use std::time::Duration;

use common::capture::Captured;
use common::{DownStore, app, request_from, send};
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_redis_ratelimit::outbound::OutboundLayer;
use tower_redis_ratelimit::store::{Abilities, CheckFuture, CheckRequest};
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, RateLimitLayer, Rule, Store, policy::Override,
};

#[tokio::test]
async fn a_rejection_is_logged_without_the_raw_api_key() {
    let (captured, _guard) = Captured::install();

    let app = app(
        Policy::builder("partner-api")
            .key(Key::header(HeaderName::from_static("x-api-key")))
            .rule(Rule::per_hour(1))
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    let request = || {
        let mut request = request_from("203.0.113.10:4000", "/");
        request.headers_mut().insert(
            "x-api-key",
            HeaderValue::from_static("sk_live_very_secret_key"),
        );
        request
    };
    assert_eq!(send(&app, request()).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, request()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    let log = captured.text();
    let line = log
        .lines()
        .find(|line| line.contains("request rate limited"))
        .unwrap_or_else(|| panic!("no rejection logged in:\n{log}"));
    assert!(line.contains("policy=\"partner-api\""), "{line}");
    assert!(line.contains("rule=1-per-3600s"), "{line}");
    assert!(line.contains("key_kind=\"header\""), "{line}");
    assert!(line.contains("key=\"header#"), "{line}");
    assert!(!log.contains("sk_live_very_secret_key"), "{log}");
    // Exactly one rejection, one line.
    assert_eq!(log.matches("request rate limited").count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_refusal_flood_is_not_a_log_flood() {
    let (captured, _guard) = Captured::install();

    let policy = Policy::builder("login")
        .rule(Rule::per_hour(1))
        .build()
        .unwrap();
    // Without the cache every refusal reaches the log budget: 1 000 identities, one second.
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(RateLimitLayer::new(policy, MemoryStore::new()).refusal_cache(0));
    let mut refused = 0;
    for n in 0..1_000u32 {
        let peer = format!("10.{}.{}.1:1000", n / 250, n % 250);
        for _ in 0..2 {
            let response = send(&app, request_from(&peer, "/")).await;
            refused += usize::from(response.status() == StatusCode::TOO_MANY_REQUESTS);
        }
    }
    assert_eq!(refused, 1_000);
    let log = captured.text();
    let lines = log.matches("request rate limited").count();
    assert_eq!(lines, 16, "{log}");

    // The next second's first line says how many went unlogged.
    tokio::time::advance(Duration::from_secs(1)).await;
    let response = send(&app, request_from("10.9.9.9:1", "/")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let response = send(&app, request_from("10.9.9.9:1", "/")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let log = captured.text();
    let last = log
        .lines()
        .rfind(|line| line.contains("request rate limited"))
        .unwrap();
    assert!(last.contains("unlogged_refusals=984"), "{last}");
}

#[tokio::test]
async fn each_check_has_a_span_with_its_policy_outcome_and_store_latency() {
    let (captured, _guard) = Captured::install_at(tracing::Level::DEBUG);
    let app = app(
        Policy::builder("spanned")
            .key(Key::ip())
            .rule(Rule::per_minute(1))
            .build()
            .unwrap(),
        MemoryStore::new(),
    );
    for status in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let response = send(&app, request_from("198.51.100.4:1", "/")).await;
        assert_eq!(response.status(), status);
    }
    let text = captured.text();
    let closed: Vec<&str> = text.lines().filter(|line| line.contains("close")).collect();
    assert_eq!(closed.len(), 2, "{text}");
    for (line, outcome) in closed.iter().zip(["allowed", "refused"]) {
        assert!(
            line.contains("rate_limit{policy=\"spanned\" key_kind=\"ip\""),
            "{line}"
        );
        assert!(line.contains(&format!("outcome=\"{outcome}\"")), "{line}");
        assert!(line.contains("store_latency_us="), "{line}");
        // The identity is only in the refusal's log line, as before.
        assert!(!line.contains("198.51.100.4"), "{line}");
    }
    // The refusal is logged inside the check's span.
    let refusal = text
        .lines()
        .find(|line| line.contains("request rate limited"))
        .expect("a refusal line");
    assert!(
        refusal.contains("rate_limit{policy=\"spanned\""),
        "{refusal}"
    );
}

/// A memory store that says it releases concurrency slots but can't (a store of one's own whose
/// release is broken: the trait's default refuses with a `Config` error), so every admitted
/// request fails once its response is done. (One that doesn't say so is refused when the layer
/// is built: `a_store_lacking_an_ability_a_policy_needs_is_refused_when_built`.)
struct NoRelease(MemoryStore);

impl Store for NoRelease {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.0.check(request)
    }

    fn abilities(&self) -> Abilities {
        Abilities::RELEASE
    }
}

#[tokio::test(start_paused = true)]
async fn a_release_failing_for_every_request_is_a_few_error_lines() {
    let (captured, _guard) = Captured::install();
    let policy = Policy::builder("releases")
        .max_in_flight(1_000)
        .lease(Duration::from_secs(60))
        .build()
        .unwrap();
    let app = app(policy, NoRelease(MemoryStore::new()));
    for _ in 0..100 {
        let response = send(&app, request_from("198.51.100.1:1", "/")).await;
        assert_eq!(response.status(), StatusCode::OK);
        // The body read to its end: the request is done, its slot released (or not).
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
    }
    let lines = captured.lines_with("could not release a concurrency slot");
    // The first at once, then the budget of its second (paused time: one second).
    assert_eq!(lines.len(), 2, "{lines:#?}");
    for line in &lines {
        // A store that can't do what the policy needs is a fault, not an outage.
        assert!(line.contains("ERROR"), "{line}");
        assert!(line.contains("kind=\"config\""), "{line}");
        assert!(line.contains("policy=\"releases\""), "{line}");
    }
    tokio::time::advance(Duration::from_secs(1)).await;
    let response = send(&app, request_from("198.51.100.1:1", "/")).await;
    drop(response);
    let last = captured.lines_with("could not release a concurrency slot");
    assert_eq!(last.len(), 3);
    assert!(last[2].contains("unlogged_store_errors=98"), "{}", last[2]);
}

#[tokio::test(start_paused = true)]
async fn an_outbound_client_on_a_failing_store_warns_a_few_times() {
    let (captured, _guard) = Captured::install();
    let policy = Policy::builder("partner")
        .algorithm(Algorithm::SlidingLog)
        .rule(Rule::per_second(5))
        .build()
        .unwrap();
    let mut client = ServiceBuilder::new()
        .layer(OutboundLayer::new(policy, DownStore))
        .service(service_fn(|_: Request<String>| async {
            Ok::<_, BoxError>(Response::new(String::new()))
        }));
    for _ in 0..100 {
        let request = Request::get("https://api.example.com/")
            .body(String::new())
            .unwrap();
        // Fail open: sent anyway.
        client.ready().await.unwrap().call(request).await.unwrap();
    }
    let lines = captured.lines_with("sending the outbound request anyway");
    assert_eq!(lines.len(), 2, "{lines:#?}");
    for line in &lines {
        // An outage, not a fault.
        assert!(line.contains("WARN"), "{line}");
        assert!(line.contains("kind=\"timeout\""), "{line}");
    }
}

#[test]
fn a_policy_with_large_sliding_logs_is_built_with_one_warning() {
    let (captured, _guard) = Captured::install();
    const WARNING: &str = "keeps an entry per admitted request";

    // Issue 28's two rules: up to 1 100 entries per identity. An override's rules don't add a
    // warning of their own.
    Policy::builder("history")
        .key(Key::user())
        .rule(Rule::per_minute(100))
        .rule(Rule::per_hour(1_000))
        .overrides([Override::identity("big").rules([Rule::per_hour(10_000)])])
        .build()
        .unwrap();
    let lines = captured.lines_with(WARNING);
    let [line] = &lines[..] else {
        panic!("one warning expected: {lines:#?}")
    };
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("policy=history"), "{line}");
    assert!(line.contains("entries_per_identity=1100"), "{line}");
    let bytes: u64 = line
        .split_once("bytes_per_identity=")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no bytes_per_identity in {line}"));
    // About 2.2 KB for the minute's log (compact), 102 KB for the hour's (a skiplist).
    assert!((100_000..110_000).contains(&bytes), "{line}");
    for algorithm in ["sliding_counter", "fixed_window", "token_bucket"] {
        assert!(line.contains(algorithm), "{line}");
    }
    // The size in words, and what to choose instead.
    let kb = (bytes as f64 / 1024.0).round();
    assert!(line.contains(&format!("up to about {kb} KB")), "{line}");
    assert!(line.contains("choose Algorithm::SlidingCounter"), "{line}");

    // Small logs, and large limits under the algorithms that don't grow, are quiet.
    Policy::builder("login")
        .rule(Rule::per_minute(10))
        .rule(Rule::per_hour(100))
        .build()
        .unwrap();
    for algorithm in [
        Algorithm::SlidingCounter,
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
    ] {
        Policy::builder("quiet")
            .algorithm(algorithm)
            .rule(Rule::per_hour(100_000))
            .build()
            .unwrap();
    }
    assert_eq!(captured.lines_with(WARNING).len(), 1);

    // A configuration file's policies are built by the same builder: one warning per route.
    #[cfg(feature = "config")]
    {
        let config = tower_redis_ratelimit::config::RateLimitConfig::from_toml_str(
            "[[routes]]\npath = \"/export\"\nrules = [{ limit = 5000, period = \"1h\" }]\n\n\
             [[routes]]\npath = \"/login\"\nrules = [{ limit = 10, period = \"1m\" }]\n",
        )
        .unwrap();
        assert_eq!(config.routes().len(), 2);
        let lines = captured.lines_with(WARNING);
        assert_eq!(lines.len(), 2, "{lines:#?}");
        assert!(lines[1].contains("policy=/export"), "{}", lines[1]);
        assert!(
            lines[1].contains("entries_per_identity=5000"),
            "{}",
            lines[1]
        );
    }
}

/// A user-keyed limiter added so that it runs before the auth layer sees no user id: each request
/// is counted by client IP, and the log says so once, with the likely cause and the fix. In the
/// right order nothing is said.
#[tokio::test]
async fn a_key_that_falls_back_to_the_client_ip_is_said_once_with_the_likely_cause() {
    use axum::Router;
    use axum::extract::Request as AxumRequest;
    use axum::middleware::{self, Next};
    use axum::routing::get;
    use tower_redis_ratelimit::UserId;

    async fn auth(mut request: AxumRequest, next: Next) -> axum::response::Response {
        request.extensions_mut().insert(UserId::new("alice"));
        next.run(request).await
    }
    let (captured, _guard) = Captured::install();
    let limited = |name: &str| {
        let policy = Policy::builder(name)
            .key(Key::user())
            .rule(Rule::per_minute(10))
            .build()
            .unwrap();
        RateLimitLayer::new(policy, MemoryStore::new())
    };
    // The layer added last runs first: here the limiter, before auth.
    let wrong = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(middleware::from_fn(auth))
        .layer(limited("wrong-order"));
    for _ in 0..3 {
        assert_eq!(
            send(&wrong, request_from("203.0.113.7:1", "/"))
                .await
                .status(),
            StatusCode::OK
        );
    }
    let said = captured.lines_with("runs before the layer that sets it");
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("WARN") && said[0].contains("wrong-order"),
        "{}",
        said[0]
    );
    assert!(
        said[0].contains(".layer(rate_limit).layer(auth)"),
        "{}",
        said[0]
    );
    let right = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(limited("right-order"))
        .layer(middleware::from_fn(auth));
    for _ in 0..3 {
        assert_eq!(
            send(&right, request_from("203.0.113.7:1", "/"))
                .await
                .status(),
            StatusCode::OK
        );
    }
    assert!(captured.lines_with("right-order").is_empty());
}

/// A store of one's own that implements only `check` (and says no more).
struct OnlyChecks(MemoryStore);

impl Store for OnlyChecks {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.0.check(request)
    }
}

/// Issue 60: a policy that needs what a store can't do is refused when the layer, the handle or
/// the outbound layer is built, naming the option and the ability, rather than failing each
/// request; a plain policy is taken.
#[test]
fn a_store_lacking_an_ability_a_policy_needs_is_refused_when_built() {
    use tower_redis_ratelimit::meter::Meter;
    use tower_redis_ratelimit::{PolicyError, RateLimiter};
    let plain = || Policy::builder("needs").rule(Rule::per_minute(10));
    let cases = [
        (
            plain().count_only(|status| status.is_client_error()),
            "count_only",
            "give_back",
        ),
        (
            Policy::builder("needs")
                .rule(Rule::per_minute(1_000).metered())
                .meter(Meter::new("tokens")),
            "meter",
            "give_back",
        ),
        (
            plain().max_in_flight(2).lease(Duration::from_secs(30)),
            "max_in_flight",
            "release",
        ),
        (
            plain().algorithm(Algorithm::FixedWindow).prefetch(10),
            "prefetch",
            "give_back",
        ),
    ];
    for (builder, option, ability) in cases {
        let policy = builder.build().unwrap();
        let refusals = [
            RateLimitLayer::try_new(policy.clone(), OnlyChecks(MemoryStore::new())).err(),
            RateLimiter::try_new(policy.clone(), OnlyChecks(MemoryStore::new())).err(),
        ];
        for refused in refusals {
            match refused {
                Some(PolicyError::InvalidOption {
                    option: named,
                    reason,
                    ..
                }) => {
                    assert_eq!(named, option);
                    assert!(reason.contains(ability), "{option}: {reason}");
                }
                other => panic!("{option}: {other:?}"),
            }
        }
        // The crate's store has every ability.
        assert!(RateLimitLayer::try_new(policy, MemoryStore::new()).is_ok());
    }
    assert!(
        RateLimitLayer::try_new(plain().build().unwrap(), OnlyChecks(MemoryStore::new())).is_ok()
    );
    assert!(RateLimiter::try_new(plain().build().unwrap(), OnlyChecks(MemoryStore::new())).is_ok());
    // Outbound: metered needs give_back and overdraw; plain is taken (a pause the upstream
    // announces is asked for at run time, and logged if the store can't keep it).
    let outbound = |metered: bool| {
        let rule = Rule::per_minute(1_000);
        let builder = Policy::builder("vendor").algorithm(Algorithm::SlidingLog);
        let policy = if metered {
            builder.rule(rule.metered()).meter(Meter::new("tokens"))
        } else {
            builder.rule(rule)
        };
        OutboundLayer::try_new(policy.build().unwrap(), OnlyChecks(MemoryStore::new())).err()
    };
    assert!(
        matches!(
            outbound(true),
            Some(PolicyError::InvalidOption {
                option: "meter",
                ..
            })
        ),
        "{:?}",
        outbound(true)
    );
    assert!(outbound(false).is_none());
}
