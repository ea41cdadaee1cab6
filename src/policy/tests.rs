use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::ConnectInfo;
use http::{Method, StatusCode};

use super::*;

fn build(rules: Vec<Rule>) -> Result<Policy, PolicyError> {
    Policy::builder("p").rules(rules).build()
}

#[test]
fn rule_constructors_and_names() {
    assert_eq!(Rule::per_second(2).period(), Duration::from_secs(1));
    assert_eq!(Rule::per_minute(10).name(), "10-per-60s");
    assert_eq!(Rule::per_hour(100).name(), "100-per-3600s");
    assert_eq!(Rule::per_day(1).name(), "1-per-86400s");
    assert_eq!(
        Rule::new(20, Duration::from_secs(120)).to_string(),
        "20 per 120s"
    );
    assert_eq!(Rule::new(3, Duration::from_millis(250)).period_ms(), 250);
}

#[test]
fn bad_rules_are_refused_with_their_position() {
    assert_eq!(
        build(vec![]).unwrap_err(),
        PolicyError::NoRules { policy: "p".into() }
    );
    assert!(matches!(
        build(vec![Rule::per_minute(5), Rule::per_second(0)]).unwrap_err(),
        PolicyError::ZeroLimit { index: 1, .. }
    ));
    assert!(matches!(
        build(vec![Rule::new(5, Duration::ZERO)]).unwrap_err(),
        PolicyError::ZeroPeriod { index: 0, .. }
    ));
    let error = build(vec![Rule::new(5, Duration::from_micros(1500))]).unwrap_err();
    assert!(matches!(
        error,
        PolicyError::SubMillisecondPeriod { index: 0, .. }
    ));
    assert!(matches!(
        build(vec![Rule::new(5, Duration::from_nanos(10))]).unwrap_err(),
        PolicyError::SubMillisecondPeriod { .. }
    ));
    assert!(build(vec![Rule::per_second(MAX_LIMIT)]).is_ok());
    assert!(matches!(
        build(vec![Rule::per_second(1), Rule::per_minute(MAX_LIMIT + 1)]).unwrap_err(),
        PolicyError::LimitTooLarge { index: 1, .. }
    ));
    assert!(build(vec![Rule::new(5, MAX_PERIOD)]).is_ok());
    assert!(matches!(
        build(vec![Rule::new(5, MAX_PERIOD + Duration::from_millis(1))]).unwrap_err(),
        PolicyError::PeriodTooLong { index: 0, .. }
    ));
    let error = build(vec![
        Rule::per_minute(10),
        Rule::per_hour(5),
        Rule::new(10, Duration::from_secs(60)),
    ])
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "policy \"p\", rules[2] (10 per 60s) is the same rule as rules[0]"
    );
    assert!(matches!(
        build(vec![
            Rule::per_minute(10).named("x"),
            Rule::per_hour(5).named("x")
        ])
        .unwrap_err(),
        PolicyError::DuplicateRuleName {
            index: 1,
            first: 0,
            ..
        }
    ));
    assert!(matches!(
        build(vec![Rule::per_minute(10).named("tab\there")]).unwrap_err(),
        PolicyError::InvalidRuleName { index: 0, .. }
    ));
}

#[test]
fn token_bucket_rules_and_options_are_checked() {
    let bucket = |rule: Rule| {
        Policy::builder("p")
            .algorithm(Algorithm::TokenBucket)
            .rule(rule)
            .build()
    };
    assert!(bucket(Rule::per_second(10).burst(100)).is_ok());
    let reason = |error: PolicyError| match error {
        PolicyError::InvalidBurst { reason, .. } => reason,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        reason(bucket(Rule::per_second(10).burst(0)).unwrap_err()),
        "the burst must be at least 1"
    );
    assert!(bucket(Rule::new(1_000, Duration::from_millis(1))).is_ok());
    assert_eq!(
        reason(bucket(Rule::new(1_001, Duration::from_millis(1))).unwrap_err()),
        "a token bucket refills at most one unit per microsecond"
    );
    assert!(reason(bucket(Rule::per_day(1).burst(367)).unwrap_err()).contains("within 366 days"));
    let error = build(vec![Rule::per_second(10).burst(20)]).unwrap_err();
    assert_eq!(
        error.to_string(),
        "policy \"p\", rules[0] (10 per 1s): a burst applies only to the token_bucket algorithm"
    );

    let option = |builder: PolicyBuilder| match builder.rule(Rule::per_second(1)).build() {
        Err(PolicyError::InvalidOption { option, reason, .. }) => (option, reason),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        option(Policy::builder("p").block_for(Duration::ZERO)),
        ("block_for", "must be longer than zero")
    );
    assert_eq!(
        option(Policy::builder("p").prevent_duplicate(Duration::from_micros(1_500))),
        (
            "prevent_duplicate",
            "must be a whole number of milliseconds"
        )
    );
    let delay = Mode::Delay {
        max_delay: Duration::from_secs(1),
    };
    assert!(
        Policy::builder("p")
            .mode(delay)
            .rule(Rule::per_second(1))
            .build()
            .is_ok()
    );
    assert_eq!(
        option(
            Policy::builder("p")
                .algorithm(Algorithm::FixedWindow)
                .mode(delay)
        )
        .0,
        "mode"
    );
}

#[test]
fn the_duplicate_guard_is_the_last_rule_and_costs_stay_within_the_rules() {
    let policy = Policy::builder("p")
        .rule(Rule::per_minute(10))
        .rule(Rule::per_hour(4))
        .prevent_duplicate(DEFAULT_DUPLICATE_WINDOW)
        .build()
        .unwrap();
    let guard = &policy.rules()[2];
    assert!(guard.is_duplicate_guard());
    assert_eq!((guard.limit(), guard.name()), (1, "duplicate".into()));
    assert_eq!(
        policy
            .rule_names()
            .iter()
            .map(|name| &**name)
            .collect::<Vec<_>>(),
        ["10-per-60s", "4-per-3600s", "duplicate"]
    );
    // The guard counts requests, not units: the cheapest counted rule caps the cost.
    assert_eq!(policy.max_cost(), 4);
    assert_eq!(policy.too_costly(4), None);
    assert_eq!(policy.too_costly(5), Some(1));
    let bucket = Policy::builder("b")
        .algorithm(Algorithm::TokenBucket)
        .rule(Rule::per_minute(10).burst(30))
        .build()
        .unwrap();
    assert_eq!(bucket.max_cost(), 30);
    // A guard that repeats a rule is refused like any duplicate rule.
    assert!(matches!(
        Policy::builder("p")
            .rule(Rule::new(1, Duration::from_secs(5)))
            .prevent_duplicate(DEFAULT_DUPLICATE_WINDOW)
            .build(),
        Err(PolicyError::DuplicateRule { index: 1, .. })
    ));
}

#[test]
fn a_quota_named_like_a_rule_is_refused() {
    let quota = Quota::builder("hourly").tier("free", 10).build().unwrap();
    let error = Policy::builder("p")
        .rule(Rule::per_minute(5))
        .rule(Rule::per_hour(50).named("hourly"))
        .quota(quota)
        .build()
        .unwrap_err();
    assert!(matches!(
        error,
        PolicyError::DuplicateRuleName {
            index: 2,
            first: 1,
            ..
        }
    ));
    // Any offset is checked, the extremes of i32 included.
    for minutes in [i32::MIN, i32::MAX, 18 * 60 + 1, -18 * 60 - 1] {
        assert!(
            Quota::builder("q")
                .tier("free", 1)
                .utc_offset_minutes(minutes)
                .build()
                .is_err()
        );
    }
    assert!(
        Quota::builder("q")
            .tier("free", 1)
            .utc_offset_minutes(-18 * 60)
            .build()
            .is_ok()
    );
}

#[test]
fn the_cost_comes_from_the_extension_else_the_function_else_one() {
    let policy = Policy::builder("p")
        .rule(Rule::per_minute(10))
        .cost_from_fn(|parts| if parts.method == Method::POST { 3 } else { 1 })
        .build()
        .unwrap();
    let post = request("/", Method::POST, None);
    assert_eq!(policy.cost(&post), 3);
    assert_eq!(policy.cost(&request("/", Method::GET, None)), 1);
    let mut weighed = request("/", Method::POST, None);
    weighed.extensions.insert(Cost(7));
    assert_eq!(policy.cost(&weighed), 7);
    let plain = build(vec![Rule::per_minute(10)]).unwrap();
    assert_eq!(plain.cost(&post), 1);
}

#[test]
fn names_that_break_keys_are_refused() {
    for bad in ["", "a:b", "{x}", "with space"] {
        let error = Policy::builder(bad)
            .rule(Rule::per_second(1))
            .build()
            .unwrap_err();
        assert!(matches!(
            error,
            PolicyError::InvalidName {
                what: "policy name",
                ..
            }
        ));
        let error = Policy::builder("ok")
            .prefix(bad)
            .rule(Rule::per_second(1))
            .build()
            .unwrap_err();
        assert!(matches!(
            error,
            PolicyError::InvalidName {
                what: "key prefix",
                ..
            }
        ));
    }
}

fn request(path: &str, method: http::Method, peer: Option<&str>) -> Parts {
    let mut builder = http::Request::builder().uri(path).method(method);
    if let Some(peer) = peer {
        let peer: SocketAddr = peer.parse().unwrap();
        builder = builder.extension(ConnectInfo(peer));
    }
    builder.body(()).unwrap().into_parts().0
}

fn found(lookup: KeyLookup) -> StorageKey {
    match lookup {
        KeyLookup::Found(key) => key,
        other => panic!("expected a key, got {other:?}"),
    }
}

#[test]
fn storage_keys_separate_policies_and_routes() {
    let peer = Some("192.0.2.1:1000");
    let a = Policy::builder("a")
        .prefix("demo")
        .rule(Rule::per_second(1))
        .build()
        .unwrap();
    let key = found(a.storage_key(&request("/x", http::Method::GET, peer)));
    assert_eq!(key.as_str(), "demo:a:ip:192.0.2.1");
    assert_eq!(key.identity(), "ip:192.0.2.1");
    assert_eq!(key.kind(), "ip");

    let routed = Policy::builder("a")
        .prefix("demo")
        .scope(Scope::Route)
        .rule(Rule::per_second(1))
        .build()
        .unwrap();
    // Without axum's MatchedPath (tested through a router in tests/it/keys.rs) paths are made up
    // by the client, so they share one bucket rather than minting new ones.
    let get = found(routed.storage_key(&request("/x", http::Method::GET, peer)));
    let other_path = found(routed.storage_key(&request("/y", http::Method::GET, peer)));
    let post = found(routed.storage_key(&request("/x", http::Method::POST, peer)));
    assert_eq!(get.as_str(), "demo:a:GETunmatched:ip:192.0.2.1");
    assert_eq!(get, other_path);
    assert_ne!(get, post);
    assert_eq!(get.identity(), post.identity());
    let made_up =
        |method: &str| found(routed.storage_key(&request("/x", method.parse().unwrap(), peer)));
    assert_eq!(made_up("FOO"), made_up("BAR"));
    assert_eq!(
        made_up("FOO").as_str(),
        "demo:a:OTHERunmatched:ip:192.0.2.1"
    );
}

#[test]
fn missing_keys_follow_the_policy() {
    let user = |missing| {
        Policy::builder("u")
            .key(Key::user())
            .on_missing_key(missing)
            .rule(Rule::per_second(1))
            .build()
            .unwrap()
    };
    let anonymous = request("/", http::Method::GET, Some("192.0.2.1:1"));
    let fallback = found(user(MissingKey::ClientIp).storage_key(&anonymous));
    assert_eq!(fallback.as_str(), "rl:u:ip:192.0.2.1");
    assert_eq!(fallback.kind(), "ip");
    assert_eq!(
        user(MissingKey::Allow).storage_key(&anonymous),
        KeyLookup::Unlimited
    );
    assert_eq!(
        user(MissingKey::Reject(StatusCode::UNAUTHORIZED)).storage_key(&anonymous),
        KeyLookup::Refuse(StatusCode::UNAUTHORIZED)
    );
    let no_peer = request("/", http::Method::GET, None);
    assert_eq!(
        user(MissingKey::ClientIp).storage_key(&no_peer),
        KeyLookup::NoClientIp
    );
}

#[test]
fn algorithm_names_round_trip() {
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ] {
        assert_eq!(algorithm.as_str().parse::<Algorithm>(), Ok(algorithm));
    }
    assert_eq!(
        "token".parse::<Algorithm>(),
        Err(UnknownAlgorithm("token".into()))
    );
}

/// Policy `p` of `algorithm` and `rules`, which must build.
fn policy(algorithm: Algorithm, rules: Vec<Rule>) -> Policy {
    Policy::builder("p")
        .algorithm(algorithm)
        .rules(rules)
        .build()
        .unwrap()
}

#[test]
fn sliding_log_memory_is_estimated_from_the_bench() {
    use super::footprint::sliding_log_bytes_per_identity;
    // The bench's figures: 181 B for a one-entry log, 2 709 B at 128 entries (compact), 16 015 B
    // at 129 and 102 397 B at 1 000 (a skiplist); the estimate stays within 2 % of them.
    for (limit, measured) in [(1, 181), (128, 2_709), (129, 16_015), (1_000, 102_397)] {
        let sliding = policy(Algorithm::SlidingLog, vec![Rule::per_hour(limit)]);
        let (entries, bytes) = sliding_log_bytes_per_identity(&sliding).unwrap();
        assert_eq!(entries, limit);
        assert!(
            bytes.abs_diff(measured) * 50 <= measured,
            "{limit}: {bytes}"
        );
    }
    // Every rule's log counts, the duplicate guard's one entry too.
    let login = Policy::builder("login")
        .rules([Rule::per_minute(10), Rule::per_hour(100)])
        .prevent_duplicate(DEFAULT_DUPLICATE_WINDOW)
        .build()
        .unwrap();
    assert_eq!(
        sliding_log_bytes_per_identity(&login),
        Some((111, (161 + 200) + (161 + 2_000) + (161 + 20)))
    );
    // A metered rule's log holds an entry per admission, whatever its units: at most what the
    // rules of requests admit in its period (20 a minute: 20 in its minute), else its limit.
    let metered = Policy::builder("llm")
        .rules([Rule::per_minute(20), Rule::per_minute(40_000).metered()])
        .meter(crate::meter::Meter::new("tokens"))
        .build()
        .unwrap();
    assert_eq!(sliding_log_bytes_per_identity(&metered).unwrap().0, 40);
    let hourly = Policy::builder("llm")
        .rules([Rule::per_minute(20), Rule::per_hour(40_000).metered()])
        .meter(crate::meter::Meter::new("tokens"))
        .build()
        .unwrap();
    assert_eq!(
        sliding_log_bytes_per_identity(&hourly).unwrap().0,
        20 + 1_200
    );
    let alone = Policy::builder("llm")
        .rule(Rule::per_minute(50).metered())
        .meter(crate::meter::Meter::new("tokens"))
        .build()
        .unwrap();
    assert_eq!(sliding_log_bytes_per_identity(&alone).unwrap().0, 50);
    // The other algorithms don't grow with the limit.
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ] {
        let large = policy(algorithm, vec![Rule::per_hour(100_000)]);
        assert_eq!(sliding_log_bytes_per_identity(&large), None, "{algorithm}");
    }
}

#[test]
fn only_large_sliding_logs_are_worth_a_warning() {
    use super::footprint::large_sliding_logs;
    // Issue 28's policy: up to 1 100 entries, about 105 KB per identity.
    let issue = vec![Rule::per_minute(100), Rule::per_hour(1_000)];
    let (entries, bytes) =
        large_sliding_logs(&policy(Algorithm::SlidingLog, issue.clone())).unwrap();
    assert_eq!(entries, 1_100);
    assert!((100_000..110_000).contains(&bytes), "{bytes}");
    // One log past Redis's compact encoding is enough; so are several compact ones adding up.
    assert!(
        large_sliding_logs(&policy(Algorithm::SlidingLog, vec![Rule::per_minute(129)])).is_some()
    );
    let compact = |limits: &[u64]| {
        limits
            .iter()
            .enumerate()
            .map(|(i, &limit)| Rule::new(limit, Duration::from_secs(60 + i as u64)))
            .collect::<Vec<_>>()
    };
    assert!(large_sliding_logs(&policy(Algorithm::SlidingLog, compact(&[128; 4]))).is_some());
    // The README's and the tests' everyday policies stay quiet.
    for small in [
        vec![Rule::per_minute(10), Rule::per_hour(100)],
        vec![Rule::per_minute(128)],
        compact(&[128; 3]),
        vec![Rule::per_second(20)],
        vec![Rule::per_minute(60)],
    ] {
        assert_eq!(
            large_sliding_logs(&policy(Algorithm::SlidingLog, small.clone())),
            None,
            "{small:?}"
        );
    }
    // Whatever the limits, the other algorithms are never warned about.
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ] {
        assert_eq!(large_sliding_logs(&policy(algorithm, issue.clone())), None);
    }
}

#[test]
fn a_key_header_is_named_by_a_string_or_a_header_name_and_checked_when_built() {
    use crate::Key;
    use crate::client_ip::ClientIp;
    let parts = |name: &str| {
        http::Request::get("/")
            .header(name, "k1")
            .body(())
            .unwrap()
            .into_parts()
            .0
    };
    for key in [
        Key::header("X-Api-Key"),
        Key::header(String::from("x-api-key")),
        Key::header(http::HeaderName::from_static("x-api-key")),
    ] {
        let identity = key.extract(&parts("x-api-key"), &ClientIp::default());
        assert!(identity.is_some(), "{key:?}");
        assert!(key.same_identity_as(&Key::header("x-api-key")), "{key:?}");
    }
    let error = Policy::builder("api")
        .key(Key::header("x api key"))
        .rule(Rule::per_minute(5))
        .build()
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "policy \"api\": the key's header name \"x api key\" is not a valid header name"
    );
    assert_eq!(error.site(), ErrorSite::Option("key"));
    let error = Quota::builder("daily")
        .key(Key::header("bad:name"))
        .tier("free", 10)
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("\"bad:name\""), "{error}");
}

#[test]
fn a_run_time_overrides_rules_are_counted_as_the_policys_rule_of_their_period() {
    let policy = build(vec![Rule::per_minute(5), Rule::per_hour(100)]).unwrap();
    assert_eq!(policy.counted_as(), None);
    let raised = policy
        .run_time_policy(&[Rule::per_minute(20), Rule::per_day(1000)], None)
        .unwrap();
    // The minute's counter is the policy's; a day has none, so it starts afresh under its own.
    assert_eq!(raised.counted_as(), Some(&[5, 1000][..]));
    // An exactly equal rule takes its own counter first; each counter is taken once, so two
    // rules of one period never count in one counter.
    let two = policy
        .run_time_policy(
            &[
                Rule::per_minute(9),
                Rule::per_minute(5),
                Rule::per_minute(7),
            ],
            None,
        )
        .unwrap();
    assert_eq!(two.counted_as(), Some(&[9, 5, 7][..]));
    // Bad rules are refused as the policy refuses them (a metered rule needs the policy's
    // meter); an override's own policy takes none.
    let metered = policy.run_time_policy(&[Rule::per_minute(50).metered()], None);
    assert!(matches!(
        metered,
        Err(PolicyError::InvalidOption {
            option: "meter",
            ..
        })
    ));
    assert!(
        policy
            .run_time_policy(&[Rule::per_minute(0)], None)
            .is_err()
    );
    assert!(
        raised
            .run_time_policy(&[Rule::per_minute(1)], None)
            .is_err()
    );
}
