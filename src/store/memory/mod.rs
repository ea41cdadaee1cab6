//! The in-process store: the embedded default.
//!
//! Keys are spread over shards, each a locked hash table; a check locks one shard for a few hundred
//! nanoseconds, which makes check-and-record atomic without a global lock. Memory stays bounded
//! without a background task: each shard drops its expired entries when it is touched after a sweep
//! interval, and a cap on distinct keys evicts the least recently checked key when a shard is full.
//!
//! The cap counts keys, not bytes: a fixed window keeps one counter per rule, a sliding log one
//! entry (16 bytes) per admitted request, so a sliding-log key can take up to `16 × limit` bytes
//! per rule.
//!
//! Laid out as `lua/` is: [`entry`] is the shared step of a check (`lua/head.lua` and
//! `lua/tail.lua`), [`counter`] dispatches to one file per algorithm ([`fixed_window`],
//! [`sliding_log`], [`sliding_counter`], [`token_bucket`], as `lua/fixed_window.lua` …), and
//! [`quota`] keeps the daily quotas.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use hashbrown::HashTable;

use self::entry::Entry;
use self::quota::QuotaTable;
use super::{
    ActionFuture, Call, CheckFuture, CheckRequest, PauseFuture, ResetListener, ResetWatch, Store,
};
use crate::decision::Decision;

mod clock;
mod counter;
mod entry;
mod fixed_window;
mod quota;
mod sliding_counter;
mod sliding_log;
mod token_bucket;
mod weighted;

pub use self::clock::{Clock, ManualClock, SystemClock};

/// How often (at most) a shard scans for expired entries.
const SWEEP_INTERVAL_MS: u64 = 1_000;

/// The in-process store. Cheap to clone; clones share their counts.
///
/// ```
/// use tower_redis_ratelimit::MemoryStore;
///
/// let store = MemoryStore::builder().max_keys(10_000).build();
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Clone)]
pub struct MemoryStore(Arc<Shared>);

struct Shared {
    shards: Box<[Mutex<Shard>]>,
    /// Daily quota counters, by quota key; locked after a shard, never before.
    quotas: Mutex<QuotaTable>,
    hasher: RandomState,
    clock: Box<dyn Clock>,
    max_keys_per_shard: usize,
    /// The most quota counters kept (the store's `max_keys`).
    max_keys: usize,
    evictions: AtomicU64,
    /// The last concurrency lease handed out: ids are unique in the store, so a late release
    /// never frees another request's slot.
    next_lease: AtomicU64,
    /// Who hears of resets ([`Store::watch_resets`]): told at once, inside `reset`.
    reset_listeners: Mutex<Vec<Weak<dyn ResetListener>>>,
}

/// The keys of one shard. A `HashTable` rather than a `HashMap`, so that the one keyed hash that
/// picked the shard also finds the entry: a key is hashed once per check.
#[derive(Default)]
struct Shard {
    entries: HashTable<Entry>,
    next_sweep_ms: u64,
    /// The latest time this shard has seen: a clock that steps back (a custom or manual clock) must
    /// not reopen a window or misorder a log, so time never goes backwards inside a shard.
    latest_ms: u64,
}

impl MemoryStore {
    /// A store with the default settings: at most 100 000 keys, the system clock.
    pub fn new() -> Self {
        MemoryStore::builder().build()
    }

    /// Settings for a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_keys: 100_000,
            shards: 64,
            clock: None,
        }
    }

    /// How many keys the store holds now (expired ones included until they are swept).
    pub fn len(&self) -> usize {
        self.0
            .shards
            .iter()
            .map(|shard| lock(shard).entries.len())
            .sum()
    }

    /// Whether the store holds no keys.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many live keys were evicted so far because the store was full.
    pub fn evictions(&self) -> u64 {
        self.0.evictions.load(Ordering::Relaxed)
    }

    /// Forgets what the entry of `key` counted: its counters, reservations, guard and block
    /// (every rule's, since an entry holds them all). The entry stays, marked with the reset's
    /// time for as long as a window of its rules lasts, so that a receipt of an admission before
    /// the reset gives nothing back to the counts after it (as the Redis store's reset marker).
    fn forget(&self, request: &CheckRequest<'_>) {
        let now = self.0.clock.now_unix_ms();
        let key = request.key;
        let (hash, mut shard) = self.shard_of(key);
        let now = shard.latest_ms.max(now);
        if let Some(entry) = shard.entries.find_mut(hash, |entry| *entry.key == *key) {
            entry.reset(now, super::reset_marker_ms(request));
        }
    }

    /// The keyed hash of `key`, and its shard, locked.
    fn shard_of(&self, key: &str) -> (u64, std::sync::MutexGuard<'_, Shard>) {
        let shared = &*self.0;
        let hash = shared.hasher.hash_one(key);
        // Bits 32..48 pick the shard: the table inside indexes by the low bits and tags by the top 7.
        let index = usize::from((hash >> 32) as u16) % shared.shards.len();
        (hash, lock(&shared.shards[index]))
    }

    fn check_now(&self, request: &CheckRequest<'_>) -> Decision {
        let shared = &*self.0;
        let now = shared.clock.now_unix_ms();
        let (hash, mut shard) = self.shard_of(request.key);
        shard.latest_ms = shard.latest_ms.max(now);
        let now = shard.latest_ms;
        if now >= shard.next_sweep_ms {
            shard.sweep(now);
        }
        // The quota's counter, when the request has one: locked after the shard (always in that
        // order), so the rules and the quota are checked and recorded as one step.
        let mut quotas = request.quota.map(|_| lock(&shared.quotas));
        let mut quota = match (&mut quotas, request.quota) {
            (Some(table), Some(quota)) => Some((table.counter(&quota, now, shared), quota)),
            _ => None,
        };
        let lease_id = match request.concurrency {
            Some(_) => shared.next_lease.fetch_add(1, Ordering::Relaxed) + 1,
            None => 0,
        };
        if let Some(entry) = shard
            .entries
            .find_mut(hash, |entry| *entry.key == *request.key)
        {
            entry.arrange(request);
            match request.call {
                Call::GiveBack(charged) => entry.give_back(request, charged, now, quota.as_mut()),
                Call::Refund => entry.refund(request, now, quota.as_mut()),
                Call::Check | Call::Peek => {
                    return entry.check(request, now, quota.as_mut(), lease_id);
                }
            }
            // Units given back, the answer is a peek's of cost 1.
            return entry.check(&request.cost(1), now, quota.as_mut(), lease_id);
        }
        if let Call::Refund | Call::GiveBack(_) = request.call {
            // Nothing of the rules to give back; the day's quota may have something.
            if let Some((counter, quota)) = quota.as_mut() {
                match request.call {
                    Call::GiveBack(charged) => {
                        counter.give_back(request.cost, quota.day_start(charged.now_unix_ms))
                    }
                    _ => counter.refund(request.cost),
                }
            }
            let request = request.cost(1);
            return Entry::new(&request, hash).check(&request, now, quota.as_mut(), lease_id);
        }
        let mut entry = Entry::new(request, hash);
        let decision = entry.check(request, now, quota.as_mut(), lease_id);
        // A refused request leaves nothing behind, except the penalty block it started; nor does a
        // free one (cost 0, no duplicate guard, which counts requests): an operator's inspection.
        let recorded =
            request.cost > 0 || request.rules.iter().any(|rule| rule.is_duplicate_guard());
        if request.call.records() && (decision.allowed && (recorded || decision.lease.is_some()))
            || entry.blocked_until_ms > now
        {
            shard.insert(entry, now, shared);
        }
        decision
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.0.shards.len())
            .field("max_keys_per_shard", &self.0.max_keys_per_shard)
            .finish_non_exhaustive()
    }
}

impl Store for MemoryStore {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        CheckFuture::ready(Ok(self.check_now(request)))
    }

    fn peek(&self, request: &CheckRequest<'_>) -> CheckFuture {
        CheckFuture::ready(Ok(self.check_now(&request.peeking())))
    }

    fn refund(&self, request: &CheckRequest<'_>) -> CheckFuture {
        CheckFuture::ready(Ok(self.check_now(&request.refunding())))
    }

    fn give_back(&self, request: &CheckRequest<'_>, charged: &Decision) -> CheckFuture {
        CheckFuture::ready(Ok(self.check_now(&request.giving_back(charged))))
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn reset(&self, request: &CheckRequest<'_>) -> ActionFuture {
        self.forget(request);
        // Units held ahead by every limiter over this store go too, before `reset` returns.
        let listeners: Vec<_> = {
            let mut listeners = lock(&self.0.reset_listeners);
            listeners.retain(|listener| listener.strong_count() > 0);
            listeners.iter().filter_map(Weak::upgrade).collect()
        };
        for listener in listeners {
            listener.key_reset(request.key);
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn watch_resets(&self, listener: Weak<dyn ResetListener>) -> Option<ResetWatch> {
        let mut listeners = lock(&self.0.reset_listeners);
        listeners.retain(|listener| listener.strong_count() > 0);
        listeners.push(listener);
        Some(ResetWatch::always())
    }

    fn release(&self, request: &CheckRequest<'_>, lease: u64) -> ActionFuture {
        let (hash, mut shard) = self.shard_of(request.key);
        if let Some(entry) = shard
            .entries
            .find_mut(hash, |entry| *entry.key == *request.key)
        {
            entry.release(lease);
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn pause(&self, request: &CheckRequest<'_>, pause: Duration) -> ActionFuture {
        let shared = &*self.0;
        let now = shared.clock.now_unix_ms();
        let until = now.saturating_add(u64::try_from(pause.as_millis()).unwrap_or(u64::MAX));
        let (hash, mut shard) = self.shard_of(request.key);
        let now = shard.latest_ms.max(now);
        match shard
            .entries
            .find_mut(hash, |entry| *entry.key == *request.key)
        {
            Some(entry) => {
                entry.blocked_until_ms = entry.blocked_until_ms.max(until);
                entry.expires_at_ms = entry.expires_at_ms.max(until);
            }
            None => {
                let mut entry = Entry::new(request, hash);
                entry.blocked_until_ms = until;
                // Swept once the pause is over, not before.
                entry.expires_at_ms = until;
                entry.last_seen_ms = now;
                shard.insert(entry, now, shared);
            }
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn pause_left(&self, request: &CheckRequest<'_>) -> PauseFuture {
        let now = self.0.clock.now_unix_ms();
        let (hash, shard) = self.shard_of(request.key);
        // The shard's time, as a check would see it (it never goes back).
        let now = shard.latest_ms.max(now);
        let left = shard
            .entries
            .find(hash, |entry| *entry.key == *request.key)
            .map(|entry| entry.blocked_until_ms.saturating_sub(now))
            .filter(|&left| left > 0)
            .map(Duration::from_millis);
        Box::pin(std::future::ready(Ok(left)))
    }
}

/// A poisoned shard only means another thread panicked mid-check; its counters are still whole
/// numbers, so keep serving rather than poisoning every later request.
fn lock<T>(shard: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Settings for a [`MemoryStore`].
#[must_use = "call .build() to get the store"]
pub struct MemoryStoreBuilder {
    max_keys: usize,
    shards: usize,
    clock: Option<Box<dyn Clock>>,
}

impl MemoryStoreBuilder {
    /// The most distinct keys kept (default 100 000; at least one per shard), and as many daily
    /// quota counters. When full, the least recently checked entry is evicted to make room, and
    /// [`MemoryStore::evictions`] counts it.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// How many independently locked shards to spread keys over (default 64; 1 to 65 536).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// The time source (default: [`SystemClock`]).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Box::new(clock));
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let shards = self.shards.clamp(1, 1 << 16);
        let max_keys_per_shard = self.max_keys.div_ceil(shards).max(1);
        MemoryStore(Arc::new(Shared {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            quotas: Mutex::default(),
            hasher: RandomState::new(),
            clock: self.clock.unwrap_or_else(|| Box::new(SystemClock::new())),
            max_keys_per_shard,
            max_keys: self.max_keys.max(1),
            evictions: AtomicU64::new(0),
            next_lease: AtomicU64::new(0),
            reset_listeners: Mutex::default(),
        }))
    }
}

impl fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_keys", &self.max_keys)
            .field("shards", &self.shards)
            .finish_non_exhaustive()
    }
}

impl Shard {
    fn sweep(&mut self, now: u64) {
        self.entries.retain(|entry| entry.expires_at_ms > now);
        self.next_sweep_ms = now.saturating_add(SWEEP_INTERVAL_MS);
    }

    /// Inserts an entry whose key is not in the shard yet, making room first when it is full.
    fn insert(&mut self, entry: Entry, now: u64, shared: &Shared) {
        if self.entries.len() >= shared.max_keys_per_shard {
            self.sweep(now);
            if self.entries.len() >= shared.max_keys_per_shard {
                // The least recently checked key: not one that is being refused right now.
                let victim = self
                    .entries
                    .iter()
                    .min_by_key(|entry| entry.last_seen_ms)
                    .map(|entry| (entry.hash, entry.key.clone()));
                if let Some((hash, key)) = victim
                    && let Ok(found) = self.entries.find_entry(hash, |entry| entry.key == key)
                {
                    found.remove();
                    shared.evictions.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.entries
            .insert_unique(entry.hash, entry, |entry| entry.hash);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::QuotaRequest;
    use super::*;
    use crate::policy::quota::QuotaThreshold;
    use crate::policy::{Algorithm, Rule};

    fn store(clock: &ManualClock) -> MemoryStore {
        MemoryStore::builder().clock(clock.clone()).build()
    }

    fn check(store: &MemoryStore, algorithm: Algorithm, rules: &[Rule]) -> Decision {
        store.check_now(&CheckRequest::new("k", rules, algorithm))
    }

    const ALL: [Algorithm; 4] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::TokenBucket,
    ];

    #[test]
    fn admits_the_limit_then_refuses_with_the_time_left() {
        for algorithm in ALL {
            // Start 10 s into a minute, so the fixed window has 50 s left.
            let clock = ManualClock::new(1_000_000 * 60_000 + 10_000);
            let store = store(&clock);
            let rules = [Rule::per_minute(3)];
            for expected_remaining in [2, 1, 0] {
                let decision = check(&store, algorithm, &rules);
                assert!(decision.allowed, "{algorithm}");
                assert_eq!(decision.rules[0].remaining, expected_remaining);
                clock.advance(Duration::from_secs(1));
            }
            let refused = check(&store, algorithm, &rules);
            assert!(!refused.allowed);
            assert_eq!(refused.rules[0].remaining, 0);
            let expected = match algorithm {
                // The window ends 50 s after the first request; 3 s have passed.
                Algorithm::FixedWindow => Duration::from_secs(47),
                // The first admission (3 s ago) leaves the log in 57 s.
                Algorithm::SlidingLog => Duration::from_secs(57),
                // This window's 3 count in full when the next one starts, and fade 1 ms later.
                Algorithm::SlidingCounter => Duration::from_millis(47_001),
                // One unit drips back every 20 s; the bucket was full 3 s ago.
                Algorithm::TokenBucket => Duration::from_secs(17),
            };
            assert_eq!(refused.retry_after(), Some(expected), "{algorithm}");
            assert_eq!(refused.rules[0].reset, expected, "{algorithm}");
        }
    }

    #[test]
    fn a_refused_request_consumes_nothing_in_any_rule() {
        for algorithm in ALL {
            let clock = ManualClock::new(0);
            let store = store(&clock);
            let rules = [Rule::per_second(2), Rule::per_minute(10)];
            assert!(check(&store, algorithm, &rules).allowed);
            assert!(check(&store, algorithm, &rules).allowed);
            let mut wait = Duration::ZERO;
            for _ in 0..5 {
                let refused = check(&store, algorithm, &rules);
                assert!(!refused.allowed);
                // The per-second rule refused; the per-minute rule was not charged.
                assert!(refused.rules[0].refused());
                assert!(!refused.rules[1].refused());
                assert_eq!(refused.rules[1].remaining, 8, "{algorithm}");
                wait = refused.retry_after().unwrap();
            }
            clock.advance(wait);
            let next = check(&store, algorithm, &rules);
            assert!(next.allowed);
            assert_eq!(next.rules[1].remaining, 7, "{algorithm}");
        }
    }

    #[test]
    fn at_a_window_edge_only_the_fixed_window_lets_twice_the_limit_through() {
        // Five at the end of one second, five more at the start of the next.
        let rules = [Rule::per_second(5)];
        for algorithm in ALL {
            let clock = ManualClock::new(10_900);
            let store = store(&clock);
            let mut admitted = 0;
            for at in [10_900, 11_000] {
                clock.set(at);
                for _ in 0..5 {
                    admitted += u32::from(check(&store, algorithm, &rules).allowed);
                }
            }
            let expected = match algorithm {
                Algorithm::FixedWindow => 10,
                // The log, the counter (the last window still weighs in full) and the bucket
                // (one unit drips back every 200 ms) all hold the line.
                _ => 5,
            };
            assert_eq!(admitted, expected, "{algorithm}");
        }
    }

    #[test]
    fn the_sliding_counter_errs_by_its_even_spread_assumption() {
        let rules = [Rule::per_second(10)];
        let admitted_at = |first: u64, second: u64| {
            let clock = ManualClock::new(first);
            let store = store(&clock);
            for _ in 0..10 {
                assert!(check(&store, Algorithm::SlidingCounter, &rules).allowed);
            }
            clock.set(second);
            (0..20)
                .filter(|_| check(&store, Algorithm::SlidingCounter, &rules).allowed)
                .count()
        };
        // Ten at the very end of a window, then half a window later: the counter weighs the last
        // window at one half, so five more pass where an exact log would pass none (the documented
        // worst case: about 1.5x in that second)...
        assert_eq!(admitted_at(10_999, 11_500), 5);
        // ...and ten at the very start: the log would pass ten, the counter five.
        assert_eq!(admitted_at(10_000, 11_500), 5);
    }

    #[test]
    fn a_token_bucket_bursts_then_keeps_the_steady_rate() {
        let clock = ManualClock::new(1_000_000);
        let store = store(&clock);
        // 10 per second, a bucket of 5: five at once, then one every 100 ms.
        let rules = [Rule::per_second(10).burst(5)];
        for left in (0..5).rev() {
            let decision = check(&store, Algorithm::TokenBucket, &rules);
            assert!(decision.allowed);
            assert_eq!(decision.rules[0].remaining, left);
        }
        let refused = check(&store, Algorithm::TokenBucket, &rules);
        assert_eq!(refused.retry_after(), Some(Duration::from_millis(100)));
        assert_eq!(refused.rules[0].reset, Duration::from_millis(100));
        let mut admitted_at = Vec::new();
        for _ in 0..1_000 {
            clock.advance(Duration::from_millis(1));
            if check(&store, Algorithm::TokenBucket, &rules).allowed {
                admitted_at.push(clock.now_unix_ms() - 1_000_000);
            }
        }
        assert_eq!(
            admitted_at,
            [100, 200, 300, 400, 500, 600, 700, 800, 900, 1_000]
        );
        // Quiet for half a second: the bucket refills five units, not more.
        clock.advance(Duration::from_secs(10));
        let burst = (0..10)
            .filter(|_| check(&store, Algorithm::TokenBucket, &rules).allowed)
            .count();
        assert_eq!(burst, 5);
    }

    fn guarded(algorithm: Algorithm, rules: &[Rule]) -> Vec<Rule> {
        let mut builder = crate::Policy::builder("p")
            .algorithm(algorithm)
            .rules(rules.iter().cloned());
        builder = builder.prevent_duplicate(Duration::from_secs(5));
        builder.build().unwrap().rules().to_vec()
    }

    #[test]
    fn the_duplicate_guard_refuses_a_second_request_within_its_window() {
        for algorithm in ALL {
            // Just before a fixed window's edge, where a counted 1-per-5s rule would let a double
            // click through.
            let clock = ManualClock::new(4_999);
            let store = store(&clock);
            let rules = guarded(algorithm, &[Rule::per_minute(10)]);
            assert!(check(&store, algorithm, &rules).allowed);
            clock.set(5_001);
            let refused = check(&store, algorithm, &rules);
            assert!(!refused.allowed, "{algorithm}");
            assert_eq!(refused.violated().collect::<Vec<_>>(), [1]);
            assert_eq!(refused.retry_after(), Some(Duration::from_millis(4_998)));
            // The refusal charged nothing.
            assert_eq!(refused.rules[0].remaining, 9, "{algorithm}");
            clock.set(9_999);
            let next = check(&store, algorithm, &rules);
            assert!(next.allowed, "{algorithm}");
            assert_eq!(next.rules[0].remaining, 8, "{algorithm}");
        }
    }

    #[test]
    fn a_penalty_block_outlasts_the_window() {
        for algorithm in ALL {
            let clock = ManualClock::new(0);
            let store = store(&clock);
            let rules = [Rule::per_minute(2)];
            let blocked = |store: &MemoryStore| {
                store.check_now(
                    &CheckRequest::new("k", &rules, algorithm)
                        .block_for(Some(Duration::from_secs(900))),
                )
            };
            assert!(blocked(&store).allowed);
            assert!(blocked(&store).allowed);
            let refused = blocked(&store);
            assert!(!refused.allowed);
            assert_eq!(refused.retry_after(), Some(Duration::from_secs(900)));
            // Long after the rule's window, still blocked, to the end of the block.
            clock.set(600_000);
            let still = blocked(&store);
            assert!(!still.allowed, "{algorithm}");
            assert_eq!(still.retry_after(), Some(Duration::from_secs(300)));
            assert_eq!(still.rules[0].remaining, 0);
            clock.set(900_000);
            assert!(blocked(&store).allowed, "{algorithm}");
        }
    }

    #[test]
    fn a_refused_first_request_keeps_its_block() {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::per_minute(2)];
        let request = CheckRequest::new("k", &rules, Algorithm::SlidingLog)
            .cost(3)
            .block_for(Some(Duration::from_secs(60)));
        assert!(!store.check_now(&request).allowed);
        assert_eq!(store.len(), 1);
        clock.set(30_000);
        let blocked = store.check_now(&CheckRequest::new("k", &rules, Algorithm::SlidingLog));
        assert_eq!(blocked.retry_after(), Some(Duration::from_secs(30)));
    }

    #[test]
    fn a_duplicate_does_not_start_a_block() {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = guarded(Algorithm::SlidingLog, &[Rule::per_minute(10)]);
        let request = CheckRequest::new("k", &rules, Algorithm::SlidingLog)
            .block_for(Some(Duration::from_secs(900)));
        assert!(store.check_now(&request).allowed);
        let duplicate = store.check_now(&request);
        assert_eq!(duplicate.retry_after(), Some(Duration::from_secs(5)));
        clock.set(5_000);
        assert!(store.check_now(&request).allowed);
    }

    #[test]
    fn delayed_requests_reserve_exactly_the_limit_in_order() {
        for algorithm in [Algorithm::SlidingLog, Algorithm::TokenBucket] {
            let clock = ManualClock::new(0);
            let store = store(&clock);
            // 2 per second, waits of up to 1.5 s: two now and two reserved for 1 s later (the log),
            // or one each 500 ms (a bucket of one, which spaces requests evenly); the rest refused.
            let rules = match algorithm {
                Algorithm::SlidingLog => [Rule::per_second(2)],
                _ => [Rule::per_second(2).burst(1)],
            };
            let request =
                CheckRequest::new("k", &rules, algorithm).max_delay(Duration::from_millis(1_500));
            let delays: Vec<Option<u64>> = (0..6)
                .map(|_| {
                    let decision = store.check_now(&request);
                    decision
                        .allowed
                        .then_some(decision.delay.as_millis() as u64)
                })
                .collect();
            let expected = match algorithm {
                Algorithm::SlidingLog => [Some(0), Some(0), Some(1_000), Some(1_000), None, None],
                _ => [Some(0), Some(500), Some(1_000), Some(1_500), None, None],
            };
            assert_eq!(delays, expected, "{algorithm}");
            // No second of the reservations holds more than the limit.
            let admitted: Vec<u64> = delays.iter().flatten().copied().collect();
            for start in 0..=2_000 {
                let in_window = admitted
                    .iter()
                    .filter(|&&at| at >= start && at < start + 1_000)
                    .count();
                assert!(in_window <= 2, "{algorithm}: {in_window} in [{start}, +1s)");
            }
        }
    }

    #[test]
    fn a_request_that_fits_now_goes_before_earlier_reservations() {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::new(2, Duration::from_secs(10))];
        let request = CheckRequest::new("k", &rules, Algorithm::SlidingLog)
            .max_delay(Duration::from_secs(20));
        assert!(store.check_now(&request).allowed);
        clock.set(5_000);
        assert!(store.check_now(&request).allowed);
        // Full until 10 s: reserved for then.
        assert_eq!(store.check_now(&request).delay, Duration::from_secs(5));
        // At 10 s the admission of 0 s leaves; the one at 5 s and the reservation at 10 s hold
        // the window, so the next waits for 15 s.
        assert_eq!(store.check_now(&request).delay, Duration::from_secs(10));
    }

    const THRESHOLDS: [QuotaThreshold; 2] = [
        QuotaThreshold {
            percent: 80,
            used: 8,
        },
        QuotaThreshold {
            percent: 100,
            used: 10,
        },
    ];

    #[test]
    fn a_daily_quota_caps_the_day_and_alerts_once_per_threshold() {
        const DAY: u64 = 86_400_000;
        // Days start at midnight UTC+01:00, 23:00 UTC; the clock starts at 22:00 UTC.
        let offset = DAY - 3_600_000;
        let clock = ManualClock::new(100 * DAY + offset - 3_600_000);
        let store = store(&clock);
        let rules = [Rule::per_second(1_000)];
        let quota = QuotaRequest::new("rl:daily:user:ann", 10, DAY, offset, &THRESHOLDS);
        let check = |key: &str| {
            store.check_now(
                &CheckRequest::new(key, &rules, Algorithm::SlidingLog).quota(Some(quota)),
            )
        };
        let mut alerts = Vec::new();
        for n in 1..=10 {
            // Two policies (two keys) share the quota.
            let decision = check(if n % 2 == 0 {
                "rl:a:user:ann"
            } else {
                "rl:b:user:ann"
            });
            assert!(decision.allowed, "request {n}");
            assert_eq!(decision.rules[1].remaining, 10 - n);
            alerts.extend(decision.quota_alerts.iter().map(|percent| (n, *percent)));
        }
        assert_eq!(alerts, [(8, 80), (10, 100)]);
        let refused = check("rl:a:user:ann");
        assert!(!refused.allowed);
        // The day ends in an hour, at midnight UTC+01:00; the per-second rule was not charged.
        assert_eq!(refused.retry_after(), Some(Duration::from_secs(3_600)));
        assert_eq!(refused.rules[1].reset, Duration::from_secs(3_600));
        assert!(!refused.rules[0].refused());
        assert!(refused.quota_alerts.is_empty());
        clock.advance(Duration::from_secs(3_600));
        let next_day = check("rl:a:user:ann");
        assert!(next_day.allowed);
        assert_eq!(next_day.rules[1].remaining, 9);
        for _ in 2..8 {
            check("rl:a:user:ann");
        }
        // A new day, a new 80 % alert at its eighth request.
        assert_eq!(check("rl:a:user:ann").quota_alerts, [80]);
    }

    #[test]
    fn quota_counters_are_capped_like_keys() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .max_keys(2)
            .clock(clock.clone())
            .build();
        let rules = [Rule::per_minute(100)];
        let check = |user: &str| {
            clock.advance(Duration::from_millis(1));
            let quota_key = format!("rl:daily:user:{user}");
            let quota = QuotaRequest::new(&quota_key, 1, 86_400_000, 0, &[]);
            store
                .check_now(
                    &CheckRequest::new("rl:p:global", &rules, Algorithm::FixedWindow)
                        .quota(Some(quota)),
                )
                .allowed
        };
        assert!(check("a"));
        assert!(!check("a"));
        let evictions = store.evictions();
        assert!(check("b"));
        assert!(
            check("c"),
            "a third user evicts the least recently checked counter"
        );
        assert_eq!(store.evictions(), evictions + 1);
        assert!(!check("c"));
        assert!(check("a"), "a's counter was evicted: a starts afresh");
    }

    #[test]
    fn a_block_does_not_hide_a_used_up_quota() {
        const DAY: u64 = 86_400_000;
        let clock = ManualClock::new(10 * DAY + 1_000);
        let store = store(&clock);
        let rules = [Rule::per_minute(10)];
        let quota = QuotaRequest::new("rl:daily:user:ida", 1, DAY, 0, &[]);
        let request = CheckRequest::new("rl:p:user:ida", &rules, Algorithm::SlidingLog)
            .block_for(Some(Duration::from_secs(10)))
            .quota(Some(quota));
        assert!(store.check_now(&request).allowed);
        let to_midnight = Duration::from_millis(DAY - 1_000);
        assert_eq!(store.check_now(&request).retry_after(), Some(to_midnight));
        clock.advance(Duration::from_secs(5));
        // Blocked for 5 s more, but the quota is out until midnight: that is when to come back.
        let blocked = store.check_now(&request);
        assert_eq!(
            blocked.retry_after(),
            Some(to_midnight - Duration::from_secs(5))
        );
        assert_eq!(blocked.rules[0].retry_after, Some(Duration::from_secs(5)));
    }

    #[test]
    fn a_request_over_the_quota_is_refused_in_every_rule_and_counts_nowhere() {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::per_minute(5)];
        let quota = QuotaRequest::new("rl:daily:user:bo", 2, 86_400_000, 0, &[]);
        let request =
            CheckRequest::new("rl:p:user:bo", &rules, Algorithm::FixedWindow).quota(Some(quota));
        assert!(store.check_now(&request).allowed);
        assert!(store.check_now(&request).allowed);
        let refused = store.check_now(&request);
        assert!(!refused.allowed);
        assert_eq!(refused.violated().collect::<Vec<_>>(), [1]);
        assert_eq!(
            refused.rules[0].remaining, 3,
            "the minute's rule keeps what it had"
        );
    }

    #[test]
    fn sliding_log_retry_waits_only_for_the_oldest_needed_admission() {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::new(2, Duration::from_secs(10))];
        assert!(check(&store, Algorithm::SlidingLog, &rules).allowed);
        clock.advance(Duration::from_secs(4));
        assert!(check(&store, Algorithm::SlidingLog, &rules).allowed);
        clock.advance(Duration::from_millis(1_500));
        let refused = check(&store, Algorithm::SlidingLog, &rules);
        // The admission at 0 s expires at 10 s; now is 5.5 s.
        assert_eq!(refused.retry_after(), Some(Duration::from_millis(4_500)));
        clock.set(10_000);
        assert!(check(&store, Algorithm::SlidingLog, &rules).allowed);
    }

    #[test]
    fn costs_count_as_several_units() {
        for algorithm in ALL {
            let clock = ManualClock::new(0);
            let store = store(&clock);
            let rules = [Rule::per_minute(5)];
            let weighted =
                |cost| store.check_now(&CheckRequest::new("k", &rules, algorithm).cost(cost));
            assert_eq!(weighted(3).rules[0].remaining, 2);
            let refused = weighted(3);
            assert!(!refused.allowed);
            assert_eq!(refused.rules[0].remaining, 2);
            assert!(weighted(2).allowed);
        }
    }

    #[test]
    fn keys_are_independent() {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let rules = [Rule::per_minute(1)];
        for key in ["a", "b", "c"] {
            let decision = store.check_now(&CheckRequest::new(key, &rules, Algorithm::FixedWindow));
            assert!(decision.allowed, "{key}");
        }
        assert_eq!(store.len(), 3);
    }

    #[test]
    fn expired_entries_are_swept_and_refusals_store_nothing() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .shards(1)
            .clock(clock.clone())
            .build();
        let rules = [Rule::per_second(1)];
        for key in 0..100 {
            let key = key.to_string();
            store.check_now(&CheckRequest::new(&key, &rules, Algorithm::SlidingLog));
        }
        assert_eq!(store.len(), 100);
        // A request that costs more than the limit is refused and leaves no entry behind.
        store.check_now(&CheckRequest::new("heavy", &rules, Algorithm::SlidingLog).cost(2));
        assert_eq!(store.len(), 100);
        clock.advance(Duration::from_secs(2));
        check(&store, Algorithm::SlidingLog, &rules);
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn a_full_store_evicts_the_least_recently_checked_key() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .shards(1)
            .max_keys(3)
            .clock(clock.clone())
            .build();
        let request = |key: &str| {
            clock.advance(Duration::from_millis(1));
            store
                .check_now(&CheckRequest::new(
                    key,
                    &[Rule::per_hour(1)],
                    Algorithm::SlidingLog,
                ))
                .allowed
        };
        assert!(request("blocked"));
        assert!(request("a"));
        assert!(request("b"));
        // The blocked client keeps knocking: refused, but recently seen.
        assert!(!request("blocked"));
        // A flood of new keys evicts the idle ones, never the client being refused.
        assert!(request("c"));
        assert!(request("d"));
        assert_eq!(store.len(), 3);
        assert_eq!(store.evictions(), 2);
        assert!(!request("blocked"));
        assert!(request("a"), "the idle key was evicted and starts afresh");
    }

    #[test]
    fn two_rule_sets_on_one_key_keep_their_own_counters() {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        let minute = [Rule::per_minute(2)];
        let hour = [Rule::per_hour(3)];
        // Alternating requests of two policies that ended up on the same key.
        for _ in 0..2 {
            assert!(check(&store, Algorithm::SlidingLog, &minute).allowed);
            assert!(check(&store, Algorithm::SlidingLog, &hour).allowed);
        }
        assert!(!check(&store, Algorithm::SlidingLog, &minute).allowed);
        assert!(check(&store, Algorithm::SlidingLog, &hour).allowed);
        assert!(!check(&store, Algorithm::SlidingLog, &hour).allowed);
        // Same period, other algorithm: a counter of its own too.
        assert!(check(&store, Algorithm::FixedWindow, &minute).allowed);
    }

    #[test]
    fn rules_of_one_period_keep_their_own_counts() {
        for algorithm in ALL {
            let clock = ManualClock::new(0);
            let store = store(&clock);
            let rules = [Rule::per_hour(1), Rule::per_hour(2)];
            let first = check(&store, algorithm, &rules);
            assert!(first.allowed);
            assert_eq!((first.rules[0].remaining, first.rules[1].remaining), (0, 1));
            let second = check(&store, algorithm, &rules);
            assert!(!second.allowed);
            assert!(second.rules[0].refused() && !second.rules[1].refused());
            assert_eq!(second.rules[1].remaining, 1, "{algorithm}");
        }
    }

    #[test]
    fn a_clock_stepping_back_reopens_nothing() {
        for algorithm in ALL {
            let clock = ManualClock::new(120_000);
            let store = store(&clock);
            let rules = [Rule::per_minute(1)];
            assert!(check(&store, algorithm, &rules).allowed);
            // Back into the previous window: still the same limit, not a fresh count.
            clock.set(90_000);
            let refused = check(&store, algorithm, &rules);
            assert!(!refused.allowed, "{algorithm}");
            // Counted from 120 s, the newest time the store has seen. The sliding counter's
            // window count still counts in full when the next window starts, so it waits 1 ms more.
            let wait = refused.retry_after().unwrap();
            let expected = match algorithm {
                Algorithm::SlidingCounter => Duration::from_millis(60_001),
                _ => Duration::from_secs(60),
            };
            assert_eq!(wait, expected, "{algorithm}");
            clock.set(120_000 + wait.as_millis() as u64);
            assert!(check(&store, algorithm, &rules).allowed, "{algorithm}");
        }
    }

    #[test]
    fn huge_periods_saturate_instead_of_overflowing() {
        let clock = ManualClock::new(1_000);
        let store = store(&clock);
        let rules = [Rule::new(1, Duration::from_millis(u64::MAX))];
        for algorithm in ALL {
            let key = algorithm.as_str();
            let request = CheckRequest::new(key, &rules, algorithm);
            assert!(store.check_now(&request).allowed);
            assert!(!store.check_now(&request).allowed, "{algorithm}");
        }
    }

    #[test]
    fn changed_rules_count_apart_from_the_old_ones() {
        let clock = ManualClock::new(0);
        let store = store(&clock);
        assert!(check(&store, Algorithm::SlidingLog, &[Rule::per_minute(1)]).allowed);
        assert!(!check(&store, Algorithm::SlidingLog, &[Rule::per_minute(1)]).allowed);
        assert!(check(&store, Algorithm::SlidingLog, &[Rule::per_hour(1)]).allowed);
        assert!(check(&store, Algorithm::FixedWindow, &[Rule::per_hour(1)]).allowed);
        // The old per-minute count was kept, not wiped.
        assert!(!check(&store, Algorithm::SlidingLog, &[Rule::per_minute(1)]).allowed);
    }

    #[test]
    fn system_clock_does_not_go_backwards() {
        let clock = SystemClock::new();
        let first = clock.now_unix_ms();
        let second = clock.now_unix_ms();
        assert!(second >= first);
        // 2020-01-01 as a sanity floor: the anchor really is Unix time.
        assert!(first > 1_577_836_800_000);
    }
}
