use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

const MINUTE: Duration = Duration::from_secs(60);

impl TopRefused {
    /// Checks both summaries: at most `capacity` counters, a min-heap, each indexed at its
    /// position. Returns how many counters each holds.
    fn check(&self) -> (usize, usize) {
        let inner = self.lock();
        for summary in [&inner.current, &inner.previous] {
            assert!(summary.counters.len() <= self.capacity);
            assert_eq!(summary.index.len(), summary.counters.len());
            for (at, counter) in summary.counters.iter().enumerate() {
                if at > 0 {
                    assert!(summary.counters[(at - 1) / 2].count <= counter.count);
                }
                assert!(counter.error < counter.count);
                assert_eq!(
                    counter.hash,
                    inner
                        .hasher
                        .hash_one((counter.key_kind, &*counter.identity))
                );
                let found = summary.index.find(counter.hash, |&i| {
                    summary.counters[i].is(counter.key_kind, &counter.identity)
                });
                assert_eq!(found, Some(&at));
            }
        }
        (inner.current.counters.len(), inner.previous.counters.len())
    }
}

fn entry(key_kind: &'static str, identity: &str, count: u64, error: u64) -> HeavyHitter {
    HeavyHitter {
        key_kind,
        identity: identity.to_owned(),
        count,
        error,
    }
}

#[test]
fn top_refused_tracks_and_ranks() {
    let top = TopRefused::new(4, MINUTE);
    let now = Instant::now();
    for (identity, times) in [("a", 3), ("b", 5), ("c", 1)] {
        for _ in 0..times {
            top.record("ip", identity, now);
        }
    }
    top.check();
    assert_eq!(
        top.top(10, now),
        [
            entry("ip", "b", 5, 0),
            entry("ip", "a", 3, 0),
            entry("ip", "c", 1, 0)
        ]
    );
    assert_eq!(top.top(1, now), [entry("ip", "b", 5, 0)]);
    assert!(top.top(0, now).is_empty());
}

#[test]
fn top_refused_evicts_the_minimum_with_its_count_as_error() {
    let top = TopRefused::new(2, MINUTE);
    let now = Instant::now();
    for _ in 0..3 {
        top.record("ip", "a", now);
    }
    for _ in 0..2 {
        top.record("ip", "b", now);
    }
    // Full: "c" replaces "b" (2), so it counts 3 with an error of 2.
    top.record("ip", "c", now);
    top.check();
    assert_eq!(
        top.top(10, now),
        [entry("ip", "a", 3, 0), entry("ip", "c", 3, 2)]
    );
    // "d" replaces one of the two at 3 (either may go), inheriting 3 as its error.
    top.record("ip", "d", now);
    assert_eq!(top.check(), (2, 0));
    let ranked = top.top(10, now);
    assert_eq!(ranked[0], entry("ip", "d", 4, 3));
    assert_eq!(ranked[1].count, 3);
}

#[test]
fn top_refused_keeps_kinds_apart() {
    let top = TopRefused::new(4, MINUTE);
    let now = Instant::now();
    top.record("ip", "x", now);
    top.record("user", "x", now);
    top.record("user", "x", now);
    top.check();
    assert_eq!(
        top.top(10, now),
        [entry("user", "x", 2, 0), entry("ip", "x", 1, 0)]
    );
}

#[test]
fn top_refused_of_capacity_zero_tracks_nothing() {
    let top = TopRefused::new(0, MINUTE);
    let now = Instant::now();
    top.record("ip", "a", now);
    assert_eq!(top.check(), (0, 0));
    assert!(top.top(10, now).is_empty());
}

#[test]
fn top_refused_orders_ties_by_identity() {
    let top = TopRefused::new(8, MINUTE);
    let now = Instant::now();
    for identity in ["d", "b", "c", "a"] {
        top.record("ip", identity, now);
        top.record("ip", identity, now);
    }
    top.record("user", "b", now);
    top.record("ip", "b", now);
    top.record("global", "b", now);
    let ranked: Vec<_> = top
        .top(10, now)
        .into_iter()
        .map(|e| (e.key_kind, e.identity, e.count))
        .collect();
    let expected = [
        ("ip", "b", 3),
        ("ip", "a", 2),
        ("ip", "c", 2),
        ("ip", "d", 2),
        ("global", "b", 1),
        ("user", "b", 1),
    ];
    let expected: Vec<_> = expected
        .into_iter()
        .map(|(kind, identity, count)| (kind, identity.to_owned(), count))
        .collect();
    assert_eq!(ranked, expected);
    // The first n of the same ranking.
    assert_eq!(top.top(3, now).len(), 3);
    assert_eq!(top.top(3, now)[2].identity, "c");
}

#[test]
fn top_refused_rotation_after_one_generation_keeps_the_previous() {
    let top = TopRefused::new(4, MINUTE);
    let start = Instant::now();
    top.record("ip", "a", start);
    top.record("ip", "a", start + Duration::from_secs(59));
    top.record("ip", "b", start + Duration::from_secs(59));
    // One generation later: both still shown, from the previous generation.
    let later = start + Duration::from_secs(61);
    top.record("ip", "b", later);
    assert_eq!(top.check(), (1, 2));
    assert_eq!(
        top.top(10, later),
        [entry("ip", "a", 2, 0), entry("ip", "b", 2, 0)]
    );
    // The boundaries stay put: the generation that started at 60 s ends at 120 s, and then the
    // one of 0..60 s is forgotten.
    let after = start + Duration::from_secs(120);
    assert_eq!(top.top(10, after), [entry("ip", "b", 1, 0)]);
    assert_eq!(top.check(), (0, 1));
}

#[test]
fn top_refused_rotation_after_two_generations_forgets_everything() {
    let top = TopRefused::new(4, MINUTE);
    let start = Instant::now();
    top.record("ip", "a", start);
    top.record("ip", "b", start + Duration::from_secs(30));
    let later = start + Duration::from_secs(120);
    assert!(top.top(10, later).is_empty());
    assert_eq!(top.check(), (0, 0));
    top.record("ip", "c", later + Duration::from_secs(1));
    assert_eq!(
        top.top(10, later + Duration::from_secs(2)),
        [entry("ip", "c", 1, 0)]
    );
}

#[test]
fn top_refused_merge_charges_a_full_summarys_minimum() {
    let top = TopRefused::new(3, MINUTE);
    let start = Instant::now();
    // Previous generation, full: a 3, b 2, e 2.
    for identity in ["a", "a", "a", "b", "b", "e", "e"] {
        top.record("ip", identity, start);
    }
    // Current generation, not full: c 1, a 1.
    let later = start + MINUTE;
    top.record("ip", "c", later);
    top.record("ip", "a", later);
    // "c" may have been refused up to 2 times (the previous minimum) and evicted there; "b"
    // and "e", missing from the current generation, had exactly 0 there (it is not full).
    assert_eq!(
        top.top(10, later),
        [
            entry("ip", "a", 4, 0),
            entry("ip", "c", 3, 2),
            entry("ip", "b", 2, 0),
            entry("ip", "e", 2, 0)
        ]
    );
    // Once the current generation is full too, "b" and "e" are charged its minimum (1).
    top.record("ip", "d", later);
    let ranked = top.top(10, later);
    assert!(ranked.contains(&entry("ip", "b", 3, 1)), "{ranked:?}");
    assert!(ranked.contains(&entry("ip", "e", 3, 1)), "{ranked:?}");
}

/// Refusals skewed toward small identities (about Zipf-like), of two kinds.
fn stream() -> impl Strategy<Value = Vec<(&'static str, u32)>> {
    let refusal = (any::<bool>(), 0u32..1000).prop_map(|(user, x)| {
        let kind = if user { "user" } else { "ip" };
        // x³ puts most of the mass on the first identities of 0..50.
        let identity = (u64::from(x).pow(3) * 50 / 1_000_000_000) as u32;
        (kind, identity)
    });
    prop::collection::vec(refusal, 0..400)
}

proptest! {
    #[test]
    fn top_refused_bounds_the_true_counts(stream in stream(), capacity in 1usize..12) {
        let top = TopRefused::new(capacity, MINUTE);
        let now = Instant::now();
        let mut exact: HashMap<(&str, String), u64> = HashMap::new();
        for (kind, identity) in &stream {
            let identity = identity.to_string();
            top.record(kind, &identity, now);
            *exact.entry((kind, identity)).or_default() += 1;
            let (current, previous) = top.check();
            prop_assert!(current <= capacity && previous == 0);
        }
        let n = stream.len() as u64;
        let reported = top.top(capacity, now);
        prop_assert_eq!(reported.len(), exact.len().min(capacity));
        for entry in &reported {
            let truth = exact
                .get(&(entry.key_kind, entry.identity.clone()))
                .copied()
                .unwrap_or(0);
            prop_assert!(entry.count - entry.error <= truth && truth <= entry.count, "{:?}: true {}", entry, truth);
            prop_assert!(entry.error <= n / capacity as u64, "{:?}", entry);
        }
        for ((kind, identity), &truth) in &exact {
            if truth > n / capacity as u64 {
                prop_assert!(
                    reported.iter().any(|e| e.key_kind == *kind && e.identity == *identity),
                    "{}:{} refused {} of {} times, not reported", kind, identity, truth, n
                );
            }
        }
        prop_assert_eq!(reported.iter().map(|e| e.count).sum::<u64>(), n);
        for pair in reported.windows(2) {
            prop_assert!(
                (pair[1].count, &pair[0].identity) <= (pair[0].count, &pair[1].identity),
                "out of order: {:?}", pair
            );
        }
    }

    #[test]
    fn top_refused_merged_generations_bound_the_true_counts(
        before in stream(),
        after in stream(),
        capacity in 1usize..12,
    ) {
        let top = TopRefused::new(capacity, MINUTE);
        let start = Instant::now();
        let later = start + MINUTE + Duration::from_secs(1);
        let mut exact: HashMap<(&str, String), u64> = HashMap::new();
        for (refusals, now) in [(&before, start), (&after, later)] {
            for (kind, identity) in refusals {
                let identity = identity.to_string();
                top.record(kind, &identity, now);
                *exact.entry((kind, identity)).or_default() += 1;
            }
        }
        let (current, previous) = top.check();
        prop_assert!(current <= capacity && previous <= capacity);
        let reported = top.top(2 * capacity, later);
        prop_assert_eq!(reported.len(), current + previous - {
            // Identities in both generations are merged into one entry.
            let inner = top.lock();
            inner.current.counters.iter().filter(|c| inner.previous.get(c).is_some()).count()
        });
        for entry in &reported {
            let truth = exact
                .get(&(entry.key_kind, entry.identity.clone()))
                .copied()
                .unwrap_or(0);
            prop_assert!(entry.count - entry.error <= truth && truth <= entry.count, "{:?}: true {}", entry, truth);
        }
        // Two generations on, everything is forgotten.
        prop_assert!(top.top(2 * capacity, later + 2 * MINUTE).is_empty());
    }
}
