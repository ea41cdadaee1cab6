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

use foldhash::fast::RandomState;
use std::cmp::Ordering;
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
                hasher: RandomState::default(),
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
mod tests;
