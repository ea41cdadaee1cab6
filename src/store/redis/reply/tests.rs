use super::*;

/// What the script packs: a MessagePack array of these items.
enum Packed<'a> {
    Number(i64),
    Float(f64),
    Text(&'a str),
}

/// `items` packed as the script packs its reply.
fn packed(items: &[Packed<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    rmp::encode::write_array_len(&mut out, items.len() as u32).unwrap();
    for item in items {
        match item {
            Packed::Number(number) => {
                rmp::encode::write_sint(&mut out, *number).unwrap();
            }
            Packed::Float(number) => rmp::encode::write_f64(&mut out, *number).unwrap(),
            Packed::Text(text) => rmp::encode::write_str(&mut out, text).unwrap(),
        }
    }
    out
}

fn numbers(values: &[i64]) -> Vec<u8> {
    let items: Vec<Packed<'_>> = values.iter().copied().map(Packed::Number).collect();
    packed(&items)
}

/// `checks` checks of one plain rule each.
fn one_rule_each(checks: usize) -> impl ExactSizeIterator<Item = &'static [RuleLimit]> {
    static ONE: std::sync::LazyLock<Vec<RuleLimit>> =
        std::sync::LazyLock::new(|| limits_of_short_length(2));
    std::iter::repeat_n(&ONE[..], checks)
}

/// The decision of one check's reply `items` (its entry after the time), with `limits`.
fn decision_of(items: &[i64], limits: &[RuleLimit]) -> Result<Decision, StoreError> {
    let reply = read_batch_reply(
        &numbers(&[[1_000].as_slice(), items].concat()),
        std::iter::once(limits),
    )?;
    reply.into_decisions([limits]).next().expect("one decision")
}

fn counted(limit: u64) -> RuleLimit {
    RuleLimit::of(limit)
}

#[test]
fn a_batch_reply_splits_into_each_checks_items_or_error() {
    let reply = packed(&[
        Packed::Number(1_000),
        // A full reply of 5 items, its length negated.
        Packed::Number(-5),
        Packed::Number(1),
        Packed::Number(0),
        Packed::Number(4),
        Packed::Number(500),
        Packed::Number(-1),
        Packed::Number(-1),
        Packed::Text("WRONGTYPE no"),
        // A short form: two items for its one rule, and no length.
        Packed::Number(70_000),
        Packed::Float(59_999.7),
        Packed::Number(-5),
        Packed::Number(0),
        Packed::Number(0),
        Packed::Number(0),
        Packed::Number(1_000),
        Packed::Number(3),
    ]);
    let read = read_batch_reply(&reply, one_rule_each(4)).unwrap();
    assert_eq!(read.now_unix_ms, 1_000);
    let limits = [
        [counted(5)],
        [counted(5)],
        [counted(100_000)],
        [counted(1_000)],
    ];
    let mut decisions = read.into_decisions(limits.iter().map(|limits| &limits[..]));
    let first = decisions.next().unwrap().unwrap();
    assert_eq!((first.allowed, first.now_unix_ms), (true, 1_000));
    assert_eq!(first.rules[0].remaining, 4);
    // Its error, in Redis's words, as the fault it is.
    assert!(matches!(
        decisions.next().unwrap(),
        Err(StoreError::WrongType(message)) if message == "WRONGTYPE no"
    ));
    let short = decisions.next().unwrap().unwrap();
    assert!(short.allowed);
    // A fraction is cut toward zero, as Redis cuts a number it replies with.
    assert_eq!(
        (short.rules[0].remaining, short.rules[0].reset),
        (70_000, Duration::from_millis(59_999))
    );
    let refused = decisions.next().unwrap().unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.rules[0].retry_after, Some(Duration::from_millis(3)));
    assert!(decisions.next().is_none());
}

#[test]
fn a_reply_of_other_than_one_entry_per_check_is_a_protocol_error() {
    let cases: [(&[u8], usize); 8] = [
        (b"", 1),
        (&numbers(&[]), 0),
        (&numbers(&[-5]), 0),
        // Fewer entries than checks, or more.
        (&numbers(&[1_000, 4, 500]), 2),
        (&numbers(&[1_000, 4, 500, 3, 400]), 1),
        // A length past the end, an error without its message.
        (&numbers(&[1_000, -7, 1, 0]), 1),
        (&numbers(&[1_000, -1]), 1),
        // Not MessagePack's array.
        (b"\x81\x01\x02", 0),
    ];
    for (reply, checks) in cases {
        assert!(
            matches!(
                read_batch_reply(reply, one_rule_each(checks)),
                Err(StoreError::Protocol(_))
            ),
            "{reply:?}"
        );
    }
    let text = packed(&[
        Packed::Number(1_000),
        Packed::Number(4),
        Packed::Text("500"),
    ]);
    assert!(read_batch_reply(&text, one_rule_each(1)).is_err());
    let text_time = packed(&[Packed::Text("now")]);
    assert!(read_batch_reply(&text_time, one_rule_each(0)).is_err());
}

#[test]
fn replies_become_decisions() {
    let decision = decision_of(
        &[-8, 0, 0, 0, 500, 500, 7, 90_000, -1],
        &[counted(5), counted(10)],
    )
    .unwrap();
    assert!(!decision.allowed);
    assert_eq!(decision.now_unix_ms, 1_000);
    assert_eq!(decision.delay, Duration::ZERO);
    assert_eq!(
        decision.rules,
        [
            RuleState {
                limit: 5,
                remaining: 0,
                reset: Duration::from_millis(500),
                retry_after: Some(Duration::from_millis(500)),
                bucket_full_at_us: None,
            },
            RuleState {
                limit: 10,
                remaining: 7,
                reset: Duration::from_secs(90),
                retry_after: None,
                bucket_full_at_us: None,
            },
        ]
    );
}

#[test]
fn an_admissions_short_form_is_two_items_per_rule() {
    let decision = decision_of(&[4, 500, 29, 59_500], &[counted(5), counted(30)]).unwrap();
    assert!(decision.allowed);
    assert_eq!(decision.now_unix_ms, 1_000);
    assert_eq!(decision.delay, Duration::ZERO);
    assert!(decision.quota_alerts.is_empty());
    assert_eq!(
        decision.rules,
        [
            RuleState {
                limit: 5,
                remaining: 4,
                reset: Duration::from_millis(500),
                retry_after: None,
                bucket_full_at_us: None,
            },
            RuleState {
                limit: 30,
                remaining: 29,
                reset: Duration::from_millis(59_500),
                retry_after: None,
                bucket_full_at_us: None,
            },
        ]
    );
}

#[test]
fn a_short_form_carries_the_lease_then_each_buckets_full_time() {
    let bucket = RuleLimit {
        bucket: true,
        ..counted(10)
    };
    let slots = RuleLimit {
        concurrency: true,
        ..counted(3)
    };
    let limits = [bucket, slots];
    assert_eq!(short_length(&limits), 2 * 2 + 1 + 1);
    let decision = decision_of(&[9, 100, 2, 60_000, 77, 1_000_100_000], &limits).unwrap();
    assert!(decision.allowed);
    assert_eq!(decision.lease, Some(77));
    assert_eq!(decision.rules[0].remaining, 9);
    assert_eq!(decision.rules[0].bucket_full_at_us, Some(1_000_100_000));
    assert_eq!(decision.rules[1].remaining, 2);
    assert_eq!(decision.rules[1].reset, Duration::from_secs(60));
    // Two items per rule alone is no longer a whole short form for these rules.
    assert!(decision_of(&[9, 100, 2, 60_000], &limits).is_err());
}

#[test]
fn the_quota_state_comes_last_then_the_alerts_fired() {
    let quota = RuleLimit {
        quota: true,
        ..counted(100)
    };
    let decision = decision_of(
        &[-9, 1, 0, 19, 60_000, -1, 20, 5_000, -1, 80],
        &[counted(20), quota],
    )
    .unwrap();
    assert_eq!(decision.rules[1].remaining, 20);
    assert_eq!(decision.quota_alerts, [80]);
}

#[test]
fn the_guard_state_comes_last_and_goes_back_to_its_rule() {
    // A guard that isn't the last rule (a hand-made request) still gets its own state.
    let limits = [
        RuleLimit {
            guard: true,
            ..counted(1)
        },
        counted(5),
    ];
    let decision = decision_of(&[-8, 1, 250, 0, 5_000, -1, 4, 900, -1], &limits).unwrap();
    assert_eq!(decision.delay, Duration::from_millis(250));
    assert_eq!(
        (decision.rules[0].limit, decision.rules[0].remaining),
        (1, 4)
    );
    assert_eq!(
        (decision.rules[1].limit, decision.rules[1].remaining),
        (5, 0)
    );
}

#[test]
fn a_length_beyond_the_reply_is_an_error_not_an_allocation() {
    // Found by `fuzz/`'s store_reply target: an array of 4 294 967 295 items, then a time,
    // asked the allocator for 32 GiB and aborted the process.
    let huge = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x00, 0x01, 0x02];
    assert!(matches!(
        read_batch_reply(&huge, one_rule_each(1)),
        Err(StoreError::Protocol(_))
    ));
}

#[test]
fn malformed_entries_are_protocol_errors() {
    for entry in [
        &[-2, 1, 0][..],
        &[-4, 1, 0, 1, 2],
        &[-5, 2, 0, 1, 2, -1],
        &[-5, 1, -1, 1, 2, -1],
        &[-5, 0, 0, -1, 2, -1],
        &[-5, 0, 0, 1, 2, -7],
        &[-3, 1, 0, 1, 2, -1],
        &[4, -2],
    ] {
        assert!(
            matches!(
                decision_of(entry, &[counted(5)]),
                Err(StoreError::Protocol(_))
            ),
            "{entry:?}"
        );
    }
}

#[test]
fn a_budgets_and_a_shares_states_come_after_the_slots_and_the_shares_limit_after_the_lease() {
    let slots = RuleLimit {
        concurrency: true,
        ..counted(3)
    };
    let budget = RuleLimit {
        budget: true,
        bucket: true,
        ..counted(300)
    };
    let share = RuleLimit {
        share: true,
        ..counted(300)
    };
    let limits = [counted(10), slots, budget, share];
    // Short: remaining and reset per state, the lease, the share's limit, the budget's full time.
    assert_eq!(short_length(&limits), 2 * 4 + 1 + 1 + 1);
    let decision = decision_of(
        &[
            9,
            100,
            2,
            60_000,
            250,
            1_000,
            40,
            1_000,
            77,
            75,
            1_000_100_000,
        ],
        &limits,
    )
    .unwrap();
    assert_eq!(decision.lease, Some(77));
    assert_eq!(
        (decision.rules[2].limit, decision.rules[2].remaining),
        (300, 250)
    );
    assert_eq!(decision.rules[2].bucket_full_at_us, Some(1_000_100_000));
    assert_eq!(
        (decision.rules[3].limit, decision.rules[3].remaining),
        (75, 40)
    );
    // Full: refused by the share, whose retry is the window's end.
    let refused = decision_of(
        &[
            -16, 0, 0, 9, 100, -1, 2, 60_000, -1, 250, 1_000, -1, 0, 400, 400, 0, 75,
        ],
        &limits,
    )
    .unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.rules[3].limit, 75);
    assert_eq!(
        refused.rules[3].retry_after,
        Some(Duration::from_millis(400))
    );
    assert_eq!(refused.rules[2].retry_after, None);
}
