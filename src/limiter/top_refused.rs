//! The most refused identities, recently: a heavy-hitters summary of refusals in fixed memory.
//!
//! An operator hunting abuse wants to know *who* is being refused, not only how often: the few IPs,
//! users or API keys behind most of the 429s. Counting every refused identity exactly would take
//! memory in proportion to the attackers' imagination, so this keeps a Space-Saving summary
//! (Metwally, Agrawal and El Abbadi, *Efficient Computation of Frequent and Top-k Elements in Data
//! Streams*, 2005) of at most `k` counters, whatever the traffic.
//!
//! A tracked identity's refusal adds one to its counter. An untracked one, when all `k` counters are
//! taken, replaces the identity with the smallest count `m`: it inherits `m + 1` with an error of
//! `m` (it may have been refused up to `m` times before, while untracked). So after `N` refusals:
//!
//! - every counter overestimates, by at most its `error`: the true count is in
//!   `count - error ..= count`, and `error <= m <= N / k`;
//! - every identity refused more than `N / k` times is tracked (the smallest count is at most
//!   `N / k`, and an identity's count never drops below its true count);
//! - the counts add up to exactly `N`.
//!
//! Refusals are counted in generations (five minutes by default), and [`TopRefused::top`] merges
//! the current generation with the previous one, so the summary shows who is refused *now*: a
//! refusal older than two generations is forgotten.
//!
//! Counters live in a binary min-heap indexed by a hash table, so a refusal costs `O(log k)` and
//! allocates nothing when its identity is already tracked.

use std::cmp::Ordering;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::mem;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hashbrown::HashTable;
use tokio::time::Instant;

use crate::operate::HeavyHitter;

/// Identities the summary tracks per generation by default.
pub(crate) const DEFAULT_TOP_REFUSED: usize = 64;

/// How long a generation of the summary lasts by default.
pub(crate) const DEFAULT_TOP_REFUSED_GENERATION: Duration = Duration::from_secs(5 * 60);

/// The most refused identities of the current and previous generation, in fixed memory (see the
/// module documentation). Shared by reference: it locks inside.
pub(crate) struct TopRefused {
    /// Counters per generation at most.
    capacity: usize,
    /// How long a generation lasts.
    generation: Duration,
    /// The two generations' summaries.
    inner: Mutex<Generations>,
}

/// The current and previous generation.
struct Generations {
    /// Hashes `(key kind, identity)` for both summaries (counters keep their hash across a rotation).
    hasher: RandomState,
    /// When the current generation started; `None` until the first call.
    started: Option<Instant>,
    /// Refusals since `started`.
    current: Summary,
    /// Refusals of the generation before.
    previous: Summary,
}

/// One generation's Space-Saving summary: counters in a min-heap by count, and where each is.
#[derive(Default)]
struct Summary {
    /// A binary min-heap by `count`: the first counter is the one to replace.
    counters: Vec<Counter>,
    /// The position in `counters` of each counter, hashed by its `(key kind, identity)`.
    index: HashTable<usize>,
}

/// One tracked identity.
struct Counter {
    /// Refusals counted for it, an upper bound of its true count.
    count: u64,
    /// How much `count` may overcount (the count of the counter it replaced).
    error: u64,
    /// Its kind of key.
    key_kind: &'static str,
    /// The identity.
    identity: Box<str>,
    /// The hash of `(key_kind, identity)`.
    hash: u64,
}

impl Counter {
    /// Whether this counts `identity` of kind `key_kind`.
    fn is(&self, key_kind: &str, identity: &str) -> bool {
        self.key_kind == key_kind && *self.identity == *identity
    }
}

impl TopRefused {
    /// A summary tracking at most `capacity` identities per generation; a generation lasts
    /// `generation` (refusals older than two generations are forgotten, so the summary shows who is
    /// refused *recently*). A `capacity` of 0 tracks nothing; a zero `generation` forgets every
    /// refusal at once.
    pub(crate) fn new(capacity: usize, generation: Duration) -> Self {
        TopRefused {
            capacity,
            generation,
            inner: Mutex::new(Generations {
                hasher: RandomState::new(),
                started: None,
                current: Summary::default(),
                previous: Summary::default(),
            }),
        }
    }

    /// Counts one refusal of `identity` (of key kind `key_kind`) at `now`.
    pub(crate) fn record(&self, key_kind: &'static str, identity: &str, now: Instant) {
        if self.capacity == 0 {
            return;
        }
        let mut inner = self.lock();
        inner.rotate(now, self.generation);
        let hash = inner.hasher.hash_one((key_kind, identity));
        inner
            .current
            .record(self.capacity, hash, key_kind, identity);
    }

    /// The `n` most refused identities of the current and previous generation, most refused first
    /// (ties: by identity, so the order is stable), with counts and error bounds.
    pub(crate) fn top(&self, n: usize, now: Instant) -> Vec<HeavyHitter> {
        if self.capacity == 0 || n == 0 {
            return Vec::new();
        }
        let mut inner = self.lock();
        inner.rotate(now, self.generation);
        let (current, previous) = (&inner.current, &inner.previous);
        // What an identity missing from a summary may have been refused there: nothing if the
        // summary is not full (it would be tracked), else up to its smallest count (then evicted).
        let unseen_current = current.unseen(self.capacity);
        let unseen_previous = previous.unseen(self.capacity);
        let mut merged: Vec<(u64, u64, &Counter)> =
            Vec::with_capacity(current.counters.len() + previous.counters.len());
        for counter in &current.counters {
            let (count, error) = previous
                .get(counter)
                .map_or((unseen_previous, unseen_previous), |before| {
                    (before.count, before.error)
                });
            merged.push((
                counter.count.saturating_add(count),
                counter.error.saturating_add(error),
                counter,
            ));
        }
        for counter in &previous.counters {
            if current.get(counter).is_none() {
                merged.push((
                    counter.count.saturating_add(unseen_current),
                    counter.error.saturating_add(unseen_current),
                    counter,
                ));
            }
        }
        let rank = |a: &(u64, u64, &Counter), b: &(u64, u64, &Counter)| -> Ordering {
            b.0.cmp(&a.0)
                .then_with(|| a.2.identity.cmp(&b.2.identity))
                .then_with(|| a.2.key_kind.cmp(b.2.key_kind))
        };
        if merged.len() > n {
            merged.select_nth_unstable_by(n - 1, rank);
            merged.truncate(n);
        }
        merged.sort_unstable_by(rank);
        merged
            .into_iter()
            .map(|(count, error, counter)| HeavyHitter {
                key_kind: counter.key_kind,
                identity: counter.identity.to_string(),
                count,
                error,
            })
            .collect()
    }

    /// The generations, even if a thread panicked holding them (every step leaves them consistent).
    fn lock(&self) -> MutexGuard<'_, Generations> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Generations {
    /// Starts a new generation if the current one is over at `now`: the current becomes the
    /// previous, or both are forgotten if two generations or more are over.
    fn rotate(&mut self, now: Instant, generation: Duration) {
        let Some(started) = self.started else {
            self.started = Some(now);
            return;
        };
        let elapsed = now.saturating_duration_since(started);
        if elapsed < generation {
            return;
        }
        if elapsed - generation < generation {
            // Exactly one generation is over: keep it as the previous (reusing the memory of the
            // one before), and keep the generations' boundaries where they were.
            mem::swap(&mut self.current, &mut self.previous);
            self.current.clear();
            self.started = Some(started + generation);
        } else {
            // Nothing recorded is recent enough: start afresh from `now`.
            self.current.clear();
            self.previous.clear();
            self.started = Some(now);
        }
    }
}

impl Summary {
    /// Counts one refusal of `identity` of kind `key_kind` (hashed to `hash`), in at most
    /// `capacity` counters.
    fn record(&mut self, capacity: usize, hash: u64, key_kind: &'static str, identity: &str) {
        let counters = &self.counters;
        if let Some(&at) = self
            .index
            .find(hash, |&i| counters[i].is(key_kind, identity))
        {
            let counter = &mut self.counters[at];
            counter.count = counter.count.saturating_add(1);
            self.sift_down(at);
        } else if self.counters.len() < capacity {
            let at = self.counters.len();
            self.counters.push(Counter {
                count: 1,
                error: 0,
                key_kind,
                identity: identity.into(),
                hash,
            });
            let counters = &self.counters;
            self.index.insert_unique(hash, at, |&i| counters[i].hash);
            self.sift_up(at);
        } else {
            // Replace the least counted identity: the newcomer may have been refused as often
            // while untracked, so it inherits that count as its error.
            let smallest = self.counters[0].count;
            match self.index.find_entry(self.counters[0].hash, |&i| i == 0) {
                Ok(entry) => {
                    entry.remove();
                }
                Err(_) => unreachable!("every counter is indexed"),
            }
            self.counters[0] = Counter {
                count: smallest.saturating_add(1),
                error: smallest,
                key_kind,
                identity: identity.into(),
                hash,
            };
            let counters = &self.counters;
            self.index.insert_unique(hash, 0, |&i| counters[i].hash);
            self.sift_down(0);
        }
    }

    /// Moves the counter at `at` down the heap until no child counts less.
    fn sift_down(&mut self, mut at: usize) {
        let len = self.counters.len();
        loop {
            let left = 2 * at + 1;
            if left >= len {
                return;
            }
            let right = left + 1;
            let child = if right < len && self.counters[right].count < self.counters[left].count {
                right
            } else {
                left
            };
            if self.counters[child].count >= self.counters[at].count {
                return;
            }
            self.swap(at, child);
            at = child;
        }
    }

    /// Moves the counter at `at` up the heap until its parent counts no more.
    fn sift_up(&mut self, mut at: usize) {
        while at > 0 {
            let parent = (at - 1) / 2;
            if self.counters[parent].count <= self.counters[at].count {
                return;
            }
            self.swap(at, parent);
            at = parent;
        }
    }

    /// Swaps the counters at `a` and `b` (distinct), and their positions in the index.
    fn swap(&mut self, a: usize, b: usize) {
        let positions = [a, b];
        let hashes = [self.counters[a].hash, self.counters[b].hash];
        // Both looked up before either changes: positions are unique until then.
        match self
            .index
            .get_disjoint_mut(hashes, |n, &i| i == positions[n])
        {
            [Some(at_a), Some(at_b)] => {
                *at_a = b;
                *at_b = a;
            }
            _ => unreachable!("every counter is indexed"),
        }
        self.counters.swap(a, b);
    }

    /// The counter of the same identity as `other` (of another summary with the same hasher).
    fn get(&self, other: &Counter) -> Option<&Counter> {
        self.index
            .find(other.hash, |&i| {
                self.counters[i].is(other.key_kind, &other.identity)
            })
            .map(|&i| &self.counters[i])
    }

    /// How many refusals an identity missing from this summary may have had in it.
    fn unseen(&self, capacity: usize) -> u64 {
        if self.counters.len() < capacity {
            0
        } else {
            self.counters.first().map_or(0, |smallest| smallest.count)
        }
    }

    /// Forgets every counter, keeping the memory.
    fn clear(&mut self) {
        self.counters.clear();
        self.index.clear();
    }
}

#[cfg(test)]
mod tests {
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
}
