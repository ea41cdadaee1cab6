use super::*;
use proptest::prelude::*;
use sfv::Integer;

const POLICY_EXAMPLE: &str = r#""20-per-60s";q=20;w=60, "100-per-3600s";q=100;w=3600"#;
const RATELIMIT_EXAMPLE: &str = r#""20-per-60s";r=7;t=42, "100-per-3600s";r=87;t=3000"#;

/// A map holding one field line per `(header, value)`, in order.
fn map(lines: &[(&HeaderName, &str)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in lines {
        headers.append(
            (*name).clone(),
            HeaderValue::from_str(value).expect("test value"),
        );
    }
    headers
}

fn parse_err(lines: &[(&HeaderName, &str)]) -> HeaderParseError {
    parse(&map(lines)).expect_err("should be rejected")
}

fn policy(name: &str, quota: u64, window: Option<u64>) -> RateLimitPolicyItem {
    RateLimitPolicyItem {
        name: name.to_owned(),
        quota,
        window,
    }
}

fn status(name: &str, remaining: u64, reset: Option<u64>) -> RateLimitItem {
    RateLimitItem {
        name: name.to_owned(),
        remaining,
        reset,
    }
}

fn bad_param(header: &HeaderName, item: &str, param: &'static str) -> HeaderParseError {
    HeaderParseError::BadParameter {
        header: header.clone(),
        item: item.to_owned(),
        param,
    }
}

fn secs(n: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(n)
}

#[test]
fn header_names_are_lowercase_wire_names() {
    assert_eq!(RATELIMIT_POLICY.as_str(), "ratelimit-policy");
    assert_eq!(RATELIMIT.as_str(), "ratelimit");
    assert_eq!(X_RATELIMIT_LIMIT.as_str(), "x-ratelimit-limit");
    assert_eq!(X_RATELIMIT_REMAINING.as_str(), "x-ratelimit-remaining");
    assert_eq!(X_RATELIMIT_RESET.as_str(), "x-ratelimit-reset");
}

#[test]
fn policy_value_matches_example_byte_for_byte() {
    let value = policy_header_value(&[
        PolicyItem {
            name: &SfName::new("20-per-60s").unwrap(),
            quota: 20,
            window_secs: 60,
        },
        PolicyItem {
            name: &SfName::new("100-per-3600s").unwrap(),
            quota: 100,
            window_secs: 3600,
        },
    ]);
    assert_eq!(value.as_bytes(), POLICY_EXAMPLE.as_bytes());
}

#[test]
fn ratelimit_value_matches_example_byte_for_byte() {
    let value = ratelimit_header_value([
        RuleEntry {
            name: &SfName::new("20-per-60s").unwrap(),
            remaining: 7,
            reset_secs: 42,
        },
        RuleEntry {
            name: &SfName::new("100-per-3600s").unwrap(),
            remaining: 87,
            reset_secs: 3000,
        },
    ]);
    assert_eq!(value.as_bytes(), RATELIMIT_EXAMPLE.as_bytes());
}

/// A value of many rules passes the stack buffer it is first written in: it comes out whole, as
/// a short one does.
#[test]
fn a_ratelimit_value_of_many_rules_is_written_whole() {
    let names: Vec<SfName> = (1..=12)
        .map(|rule| SfName::new(&format!("{rule}000000-per-{rule}86400s")).unwrap())
        .collect();
    let entries = names.iter().enumerate().map(|(at, name)| RuleEntry {
        name,
        remaining: 9_999_999_999 - at as u64,
        reset_secs: 86_400 + at as u64,
    });
    let value = ratelimit_header_value(entries.clone());
    let expected: Vec<String> = entries
        .map(|entry| {
            format!(
                "{};r={};t={}",
                entry.name.0, entry.remaining, entry.reset_secs
            )
        })
        .collect();
    let expected = expected.join(", ");
    assert!(expected.len() > 192, "{}", expected.len());
    assert_eq!(value.to_str().unwrap(), expected);
}

#[test]
fn parses_the_examples() {
    let parsed = parse(&map(&[
        (&RATELIMIT_POLICY, POLICY_EXAMPLE),
        (&RATELIMIT, RATELIMIT_EXAMPLE),
    ]))
    .unwrap();
    assert_eq!(
        parsed,
        RateLimitHeaders {
            policies: vec![
                policy("20-per-60s", 20, Some(60)),
                policy("100-per-3600s", 100, Some(3600)),
            ],
            limits: vec![
                status("20-per-60s", 7, Some(42)),
                status("100-per-3600s", 87, Some(3000)),
            ],
            retry_after: None,
            legacy: None,
        }
    );
}

#[test]
fn no_headers_parse_to_default() {
    assert_eq!(
        parse(&HeaderMap::new()).unwrap(),
        RateLimitHeaders::default()
    );
}

#[test]
fn names_needing_escapes_round_trip() {
    let name = r#"a "quoted" \ name"#;
    let value = policy_header_value(&[PolicyItem {
        name: &SfName::new(name).unwrap(),
        quota: 5,
        window_secs: 1,
    }]);
    assert_eq!(value.to_str().unwrap(), r#""a \"quoted\" \\ name";q=5;w=1"#);
    let status_value = ratelimit_header_value([RuleEntry {
        name: &SfName::new(name).unwrap(),
        remaining: 0,
        reset_secs: 0,
    }]);
    let mut headers = HeaderMap::new();
    headers.insert(RATELIMIT_POLICY, value);
    headers.insert(RATELIMIT, status_value);
    let parsed = parse(&headers).unwrap();
    assert_eq!(parsed.policies, vec![policy(name, 5, Some(1))]);
    assert_eq!(parsed.limits, vec![status(name, 0, Some(0))]);
}

#[test]
fn numbers_are_clamped_to_sf_integer_max() {
    assert_eq!(SF_INTEGER_MAX, u64::try_from(Integer::MAX).unwrap());
    let policy_value = policy_header_value(&[PolicyItem {
        name: &SfName::new("big").unwrap(),
        quota: u64::MAX,
        window_secs: SF_INTEGER_MAX + 1,
    }]);
    assert_eq!(
        policy_value.to_str().unwrap(),
        r#""big";q=999999999999999;w=999999999999999"#
    );
    let status_value = ratelimit_header_value([RuleEntry {
        name: &SfName::new("big").unwrap(),
        remaining: SF_INTEGER_MAX,
        reset_secs: u64::MAX,
    }]);
    assert_eq!(
        status_value.to_str().unwrap(),
        r#""big";r=999999999999999;t=999999999999999"#
    );
    let parsed = parse(&map(&[
        (&RATELIMIT_POLICY, policy_value.to_str().unwrap()),
        (&RATELIMIT, status_value.to_str().unwrap()),
    ]))
    .unwrap();
    assert_eq!(
        parsed.policies,
        vec![policy("big", SF_INTEGER_MAX, Some(SF_INTEGER_MAX))]
    );
    assert_eq!(
        parsed.limits,
        vec![status("big", SF_INTEGER_MAX, Some(SF_INTEGER_MAX))]
    );
}

#[test]
fn empty_item_lists_serialise_to_empty_values() {
    assert_eq!(policy_header_value(&[]).as_bytes(), b"");
    assert_eq!(ratelimit_header_value([]).as_bytes(), b"");
}

proptest::proptest! {
    /// The policy's name check and the header writer agree: every name a policy accepts can be
    /// written as an sf-string, and every other one is refused by both.
    #[test]
    fn the_policy_name_check_is_the_sf_string_check(name in "[ -~]{0,12}|\\PC{0,12}|[\\x00-\\x7f]{0,12}") {
        proptest::prop_assert_eq!(
            tower_redis_ratelimit_spec::check_rule_name(&name).is_ok(),
            SfName::new(&name).is_ok()
        );
    }
}

#[test]
fn invalid_rule_names_are_rejected_at_build_time() {
    for bad in ["caf\u{e9}", "tab\there", "new\nline", "\u{7f}"] {
        let err = SfName::new(bad).unwrap_err();
        assert_eq!(
            err,
            InvalidRuleName {
                name: bad.to_owned()
            }
        );
    }
    assert_eq!(
        InvalidRuleName {
            name: "a\nb".to_owned()
        }
        .to_string(),
        r#"rule name "a\nb" is not a valid structured-field string (printable ASCII only)"#
    );
}

#[test]
fn multiple_field_lines_form_one_list() {
    let parsed = parse(&map(&[
        (&RATELIMIT_POLICY, r#""a";q=1;w=10"#),
        (&RATELIMIT, r#""a";r=0;t=5"#),
        (&RATELIMIT_POLICY, r#""b";q=2, "c";q=3"#),
        (&RATELIMIT, r#""b";r=1"#),
    ]))
    .unwrap();
    assert_eq!(
        parsed.policies,
        vec![
            policy("a", 1, Some(10)),
            policy("b", 2, None),
            policy("c", 3, None)
        ]
    );
    assert_eq!(
        parsed.limits,
        vec![status("a", 0, Some(5)), status("b", 1, None)]
    );
}

#[test]
fn empty_field_lines_and_surrounding_whitespace_are_ignored() {
    let parsed = parse(&map(&[
        (&RATELIMIT_POLICY, ""),
        (&RATELIMIT_POLICY, " \t\"a\";q=1\t "),
        (&RATELIMIT_POLICY, "  "),
        (&RATELIMIT_POLICY, r#""b";q=2"#),
    ]))
    .unwrap();
    assert_eq!(
        parsed.policies,
        vec![policy("a", 1, None), policy("b", 2, None)]
    );
}

#[test]
fn unknown_parameters_are_ignored() {
    let parsed = parse(&map(&[
        (
            &RATELIMIT_POLICY,
            r#""a";pk=:YWJj:;q=5;qu="requests";w=10;x=1.5"#,
        ),
        (&RATELIMIT, r#""a";r=3;pk=:YWJj:;t=2;zz=?0"#),
    ]))
    .unwrap();
    assert_eq!(parsed.policies, vec![policy("a", 5, Some(10))]);
    assert_eq!(parsed.limits, vec![status("a", 3, Some(2))]);
}

#[test]
fn token_items_are_accepted() {
    let parsed = parse(&map(&[
        (&RATELIMIT_POLICY, "default;q=100;w=60"),
        (&RATELIMIT, "default;r=50;t=30"),
    ]))
    .unwrap();
    assert_eq!(parsed.policies, vec![policy("default", 100, Some(60))]);
    assert_eq!(parsed.limits, vec![status("default", 50, Some(30))]);
}

#[test]
fn duplicate_names_keep_the_first_item() {
    // The later duplicate is dropped whole, even though its `q` is invalid.
    let parsed = parse(&map(&[
        (&RATELIMIT_POLICY, r#""a";q=1, "b";q=2, "a";q=-1, b;q=4"#),
        (&RATELIMIT, r#""a";r=1"#),
        (&RATELIMIT, r#""a";r=9;t=9"#),
    ]))
    .unwrap();
    assert_eq!(
        parsed.policies,
        vec![policy("a", 1, None), policy("b", 2, None)]
    );
    assert_eq!(parsed.limits, vec![status("a", 1, None)]);
}

#[test]
fn status_items_need_no_matching_policy() {
    let parsed = parse(&map(&[
        (&RATELIMIT_POLICY, r#""a";q=1"#),
        (&RATELIMIT, r#""other";r=4;t=1"#),
    ]))
    .unwrap();
    assert_eq!(parsed.policies, vec![policy("a", 1, None)]);
    assert_eq!(parsed.limits, vec![status("other", 4, Some(1))]);
}

#[test]
fn lookups_by_name() {
    let parsed = parse(&map(&[
        (&RATELIMIT_POLICY, POLICY_EXAMPLE),
        (&RATELIMIT, RATELIMIT_EXAMPLE),
    ]))
    .unwrap();
    assert_eq!(
        parsed.policy("100-per-3600s"),
        Some(&policy("100-per-3600s", 100, Some(3600)))
    );
    assert_eq!(parsed.policy("nope"), None);
    assert_eq!(
        parsed.status("20-per-60s"),
        Some(&status("20-per-60s", 7, Some(42)))
    );
    assert_eq!(parsed.status("nope"), None);
}

#[test]
fn most_limiting_is_least_remaining_first_on_ties() {
    assert_eq!(RateLimitHeaders::default().most_limiting(), None);
    let parsed = parse(&map(&[(
        &RATELIMIT,
        r#""a";r=5, "b";r=2;t=9, "c";r=2;t=1, "d";r=3"#,
    )]))
    .unwrap();
    assert_eq!(parsed.most_limiting(), Some(&status("b", 2, Some(9))));
}

#[test]
fn retry_after_delay_seconds() {
    for (raw, expected) in [("120", 120), ("0", 0), ("  7\t", 7), ("007", 7)] {
        let parsed = parse(&map(&[(&RETRY_AFTER, raw)])).unwrap();
        assert_eq!(
            parsed.retry_after,
            Some(RetryAfter::Delay(Duration::from_secs(expected))),
            "{raw:?}"
        );
    }
}

#[test]
fn retry_after_http_date() {
    // The three HTTP-date forms from RFC 9110, section 5.6.7, all the same instant.
    for raw in [
        "Sun, 06 Nov 1994 08:49:37 GMT",
        " Sunday, 06-Nov-94 08:49:37 GMT ",
        "Sun Nov  6 08:49:37 1994",
    ] {
        let parsed = parse(&map(&[(&RETRY_AFTER, raw)])).unwrap();
        assert_eq!(
            parsed.retry_after,
            Some(RetryAfter::Date(secs(784_111_777))),
            "{raw:?}"
        );
    }
}

#[test]
fn retry_after_delay_from() {
    let now = secs(1_000);
    assert_eq!(
        RetryAfter::Delay(Duration::from_secs(3)).delay_from(now),
        Duration::from_secs(3)
    );
    assert_eq!(
        RetryAfter::Date(secs(1_045)).delay_from(now),
        Duration::from_secs(45)
    );
    assert_eq!(
        RetryAfter::Date(secs(1_000)).delay_from(now),
        Duration::ZERO
    );
    assert_eq!(RetryAfter::Date(secs(10)).delay_from(now), Duration::ZERO);
}

#[test]
fn legacy_trio() {
    let parsed = parse(&map(&[
        (&X_RATELIMIT_LIMIT, "100"),
        (&X_RATELIMIT_REMAINING, " 0 "),
        (&X_RATELIMIT_RESET, "1700000000"),
    ]))
    .unwrap();
    assert_eq!(
        parsed.legacy,
        Some(LegacyRateLimit {
            limit: 100,
            remaining: 0,
            reset: secs(1_700_000_000),
        })
    );
}

#[test]
fn legacy_needs_all_three_headers() {
    let parsed = parse(&map(&[
        (&X_RATELIMIT_LIMIT, "100"),
        (&X_RATELIMIT_RESET, "1700000000"),
    ]))
    .unwrap();
    assert_eq!(parsed, RateLimitHeaders::default());
}

#[test]
fn error_not_text() {
    for header in [
        &RATELIMIT_POLICY,
        &RATELIMIT,
        &RETRY_AFTER,
        &X_RATELIMIT_LIMIT,
    ] {
        let mut headers = HeaderMap::new();
        headers.insert(
            header.clone(),
            HeaderValue::from_bytes(b"\"caf\xc3\xa9\";q=1").unwrap(),
        );
        assert_eq!(
            parse(&headers).unwrap_err(),
            HeaderParseError::NotText {
                header: header.clone()
            }
        );
    }
}

#[test]
fn error_syntax() {
    for raw in [r#""a";q=1,"#, r#""unterminated"#, r#""a" "b""#, "A;q=1;Q=2"] {
        let expected = Parser::new(raw)
            .parse_list::<sfv::List>()
            .unwrap_err()
            .to_string();
        assert_eq!(
            parse_err(&[(&RATELIMIT, raw)]),
            HeaderParseError::Syntax {
                header: RATELIMIT,
                message: expected,
            },
            "{raw:?}"
        );
    }
}

#[test]
fn error_inner_list() {
    assert_eq!(
        parse_err(&[(&RATELIMIT_POLICY, r#""a";q=1, ("b" "c");q=2"#)]),
        HeaderParseError::InnerList {
            header: RATELIMIT_POLICY
        }
    );
}

#[test]
fn error_not_a_string() {
    for raw in [
        "1;q=1",
        "1.5;q=1",
        "?1;q=1",
        ":YWJj:;q=1",
        "@0;q=1",
        r#"%"x";q=1"#,
    ] {
        assert_eq!(
            parse_err(&[(&RATELIMIT_POLICY, raw)]),
            HeaderParseError::NotAString {
                header: RATELIMIT_POLICY
            },
            "{raw:?}"
        );
    }
}

#[test]
fn error_missing_parameter() {
    assert_eq!(
        parse_err(&[(&RATELIMIT_POLICY, r#""a";q=1, "b";w=60"#)]),
        HeaderParseError::MissingParameter {
            header: RATELIMIT_POLICY,
            item: "b".to_owned(),
            param: "q",
        }
    );
    assert_eq!(
        parse_err(&[(&RATELIMIT, r#""a";t=5"#)]),
        HeaderParseError::MissingParameter {
            header: RATELIMIT,
            item: "a".to_owned(),
            param: "r",
        }
    );
}

#[test]
fn error_bad_parameter() {
    let cases: [(&HeaderName, &str, &'static str); 10] = [
        (&RATELIMIT_POLICY, r#""a";q=-1"#, "q"),
        (&RATELIMIT_POLICY, r#""a";q=1.5"#, "q"),
        (&RATELIMIT_POLICY, r#""a";q="5""#, "q"),
        (&RATELIMIT_POLICY, r#""a";q"#, "q"),
        (&RATELIMIT_POLICY, r#""a";q=1;w=-60"#, "w"),
        (&RATELIMIT_POLICY, r#""a";q=1;w=tok"#, "w"),
        (&RATELIMIT, r#""a";r=-1"#, "r"),
        (&RATELIMIT, r#""a";r=0.0"#, "r"),
        (&RATELIMIT, r#""a";r=1;t=2.5"#, "t"),
        (&RATELIMIT, r#""a";r=1;t=@60"#, "t"),
    ];
    for (header, raw, key) in cases {
        assert_eq!(
            parse_err(&[(header, raw)]),
            bad_param(header, "a", key),
            "{raw:?}"
        );
    }
}

#[test]
fn error_bad_integer() {
    for raw in [
        "",
        "+5",
        "-5",
        "5.0",
        "1e3",
        "0x10",
        "five",
        "18446744073709551616",
    ] {
        assert_eq!(
            parse_err(&[(&X_RATELIMIT_REMAINING, raw)]),
            HeaderParseError::BadInteger {
                header: X_RATELIMIT_REMAINING
            },
            "{raw:?}"
        );
    }
    // Fits in a u64 but not in a SystemTime.
    assert_eq!(
        parse_err(&[(&X_RATELIMIT_RESET, &u64::MAX.to_string())]),
        HeaderParseError::BadInteger {
            header: X_RATELIMIT_RESET
        }
    );
}

#[test]
fn error_duplicate() {
    assert_eq!(
        parse_err(&[(&RETRY_AFTER, "1"), (&RETRY_AFTER, "2")]),
        HeaderParseError::Duplicate {
            header: RETRY_AFTER
        }
    );
    assert_eq!(
        parse_err(&[(&X_RATELIMIT_LIMIT, "1"), (&X_RATELIMIT_LIMIT, "1")]),
        HeaderParseError::Duplicate {
            header: X_RATELIMIT_LIMIT
        }
    );
}

#[test]
fn error_bad_retry_after() {
    for raw in [
        "",
        "-1",
        "1.5",
        "+3",
        "soon",
        "18446744073709551616",
        "Sun, 06 Nov 1994 08:49:37 UTC",
        "Sun, 06 Nov 1994",
    ] {
        assert_eq!(
            parse_err(&[(&RETRY_AFTER, raw)]),
            HeaderParseError::BadRetryAfter,
            "{raw:?}"
        );
    }
}

#[test]
fn error_messages() {
    assert_eq!(
        bad_param(&RATELIMIT, "a", "t").to_string(),
        r#"ratelimit item "a" parameter "t" is not a non-negative integer"#
    );
    assert_eq!(
        HeaderParseError::MissingParameter {
            header: RATELIMIT_POLICY,
            item: "b".to_owned(),
            param: "q",
        }
        .to_string(),
        r#"ratelimit-policy item "b" lacks required parameter "q""#
    );
    assert_eq!(
        HeaderParseError::Duplicate {
            header: RETRY_AFTER
        }
        .to_string(),
        "retry-after appears more than once"
    );
}

/// Header names `parse` reads, plus one it ignores.
const FUZZ_HEADERS: [&str; 7] = [
    "ratelimit-policy",
    "ratelimit",
    "retry-after",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "x-other",
];

/// A near-valid structured list for `RateLimit-Policy` / `RateLimit`: mostly
/// well-formed items, with wrong types, signs, junk and separators mixed in.
fn fuzz_sf_list(required: &'static str) -> impl Strategy<Value = String> {
    let bare = prop_oneof![
        3 => Just("\"a\"".to_owned()),
        2 => Just("tok".to_owned()),
        3 => "\"[a-z0-9 -]{0,6}\"",
        1 => Just("1".to_owned()),
        1 => Just("(\"x\" y)".to_owned()),
        1 => "[ -~]{0,6}",
    ];
    let key = prop_oneof![
        3 => Just("q"),
        3 => Just("r"),
        2 => Just("w"),
        2 => Just("t"),
        1 => Just("pk"),
        1 => Just("Q"),
    ];
    let value = prop_oneof![
        6 => Just("=7"),
        1 => Just(""),
        1 => Just("=0"),
        1 => Just("=-1"),
        1 => Just("=1.5"),
        1 => Just("=\"x\""),
        1 => Just("=?0"),
        1 => Just("=@5"),
        1 => Just("=999999999999999"),
        1 => Just("=9999999999999999"),
        1 => Just("=:YQ==:"),
    ];
    // The required key usually comes first, so whole lists often parse.
    let first = prop_oneof![
        6 => value.clone().prop_map(move |v| format!(";{required}{v}")),
        1 => Just(String::new()),
    ];
    let item = (bare, first, prop::collection::vec((key, value), 0..3)).prop_map(
        |(bare, first, params)| {
            params
                .into_iter()
                .fold(bare + &first, |acc, (k, v)| format!("{acc};{k}{v}"))
        },
    );
    let separator = prop_oneof![4 => Just(", "), 1 => Just(","), 1 => Just(" ,\t")];
    (prop::collection::vec(item, 0..4), separator).prop_map(|(items, sep)| items.join(sep))
}

/// A value for `FUZZ_HEADERS[index]`: usually shaped like that header's
/// syntax so parsing gets deep, sometimes arbitrary bytes or text.
fn fuzz_value(index: usize) -> BoxedStrategy<Vec<u8>> {
    let number = prop_oneof![
        6 => any::<u64>().prop_map(|n| n.to_string()),
        1 => "[0-9 +.-]{0,24}",
    ];
    let shaped = match FUZZ_HEADERS[index] {
        "ratelimit-policy" => fuzz_sf_list("q").boxed(),
        "ratelimit" => fuzz_sf_list("r").boxed(),
        "retry-after" => prop_oneof![
            number,
            any::<u32>().prop_map(|n| httpdate::fmt_http_date(secs(n.into()))),
            "[A-Za-z]{3}, [0-9]{2} [A-Za-z]{3} [0-9]{4} [0-9:]{8} GMT",
        ]
        .boxed(),
        _ => number.boxed(),
    };
    prop_oneof![
        8 => shaped.prop_map(String::into_bytes),
        1 => prop::collection::vec(any::<u8>(), 0..48),
        1 => "[ -~\t]{0,48}".prop_map(String::into_bytes),
    ]
    .boxed()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn parse_never_panics(
        lines in prop::collection::vec(
            (0..FUZZ_HEADERS.len()).prop_flat_map(|i| (Just(i), fuzz_value(i))),
            0..5,
        )
    ) {
        let mut headers = HeaderMap::new();
        for (index, bytes) in &lines {
            // Bytes a HeaderValue cannot hold never reach a parser.
            if let Ok(value) = HeaderValue::from_bytes(bytes) {
                headers.append(HeaderName::from_static(FUZZ_HEADERS[*index]), value);
            }
        }
        if let Ok(parsed) = parse(&headers) {
            let policy_names: HashSet<_> = parsed.policies.iter().map(|p| &p.name).collect();
            prop_assert_eq!(policy_names.len(), parsed.policies.len());
            let status_names: HashSet<_> = parsed.limits.iter().map(|s| &s.name).collect();
            prop_assert_eq!(status_names.len(), parsed.limits.len());
            let all_legacy = [&X_RATELIMIT_LIMIT, &X_RATELIMIT_REMAINING, &X_RATELIMIT_RESET]
                .iter()
                .all(|name| headers.contains_key(*name));
            prop_assert_eq!(parsed.legacy.is_some(), all_legacy);
            prop_assert_eq!(parsed.retry_after.is_some(), headers.contains_key(RETRY_AFTER));
        }
    }

    #[test]
    fn serialised_values_round_trip(
        rules in prop::collection::vec(
            ("[ -~]{0,12}", any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
            1..6,
        ),
        split in any::<prop::sample::Index>(),
    ) {
        let sf_names: Vec<SfName> = rules
            .iter()
            .map(|(name, ..)| SfName::new(name).unwrap())
            .collect();
        let policy_items: Vec<_> = rules
            .iter()
            .zip(&sf_names)
            .map(|((_, quota, window_secs, _, _), name)| PolicyItem {
                name,
                quota: *quota,
                window_secs: *window_secs,
            })
            .collect();
        let status_items: Vec<_> = rules
            .iter()
            .zip(&sf_names)
            .map(|((_, _, _, remaining, reset_secs), name)| RuleEntry {
                name,
                remaining: *remaining,
                reset_secs: *reset_secs,
            })
            .collect();

        // The policy as one field line, the status split over two (or one if the split is at 0).
        let mut headers = HeaderMap::new();
        headers.insert(RATELIMIT_POLICY, policy_header_value(&policy_items));
        let (first, second) = status_items.split_at(split.index(status_items.len()));
        for part in [first, second] {
            if !part.is_empty() {
                headers.append(RATELIMIT, ratelimit_header_value(part.iter().copied()));
            }
        }

        let mut seen = HashSet::new();
        let (mut policies, mut limits) = (Vec::new(), Vec::new());
        for (name, quota, window, remaining, reset) in &rules {
            if seen.insert(name) {
                policies.push(policy(name, (*quota).min(SF_INTEGER_MAX), Some((*window).min(SF_INTEGER_MAX))));
                limits.push(status(name, (*remaining).min(SF_INTEGER_MAX), Some((*reset).min(SF_INTEGER_MAX))));
            }
        }
        prop_assert_eq!(
            parse(&headers).unwrap(),
            RateLimitHeaders { policies, limits, retry_after: None, legacy: None }
        );
    }

    #[test]
    fn retry_after_any_delay_seconds(secs in any::<u64>()) {
        let parsed = parse(&map(&[(&RETRY_AFTER, &secs.to_string())])).unwrap();
        prop_assert_eq!(parsed.retry_after, Some(RetryAfter::Delay(Duration::from_secs(secs))));
    }
}
