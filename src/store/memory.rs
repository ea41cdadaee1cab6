//! The in-process store: the embedded default.
//!
//! Keys are spread over shards, each a locked hash table; a check locks one shard for a few hundred
//! nanoseconds, which makes check-and-record atomic without a global lock. Memory stays bounded
//! without a background task: each shard drops its expired entries when it is touched after a sweep
//! interval, and a cap on distinct keys evicts the least recently checked key when a shard is full.
//!
//! The cap counts keys, not bytes: a fixed window keeps one counter per rule, a sliding log one
//! timestamp per admitted unit, so a sliding-log key can take up to `8 × limit` bytes per rule.

use std::collections::VecDeque;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hashbrown::HashTable;

use super::gcra::{self, Bucket};
use super::weighted;
use super::{CheckFuture, CheckRequest, QuotaRequest, Store};
use crate::decision::{Decision, RuleState};
use crate::policy::{Algorithm, Rule};

/// How often (at most) a shard scans for expired entries.
const SWEEP_INTERVAL_MS: u64 = 1_000;

/// The time source of a [`MemoryStore`], in milliseconds since the Unix epoch.
///
/// Tests use [`ManualClock`]; the default is [`SystemClock`].
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_unix_ms(&self) -> u64;
}

/// Unix time that never goes backwards: the system time when the clock was made, plus a monotonic
/// `Instant` since then. A system clock stepped back by NTP can't reopen a window; in exchange the
/// clock drifts from the wall clock by whatever steps the system clock takes later (small, and
/// only visible in `X-RateLimit-Reset`).
#[derive(Debug, Clone)]
pub struct SystemClock {
    anchor_unix_ms: u64,
    anchor: Instant,
}

impl SystemClock {
    /// Anchors the clock at the current system time.
    pub fn new() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        SystemClock {
            anchor_unix_ms: millis(since_epoch),
            anchor: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now_unix_ms(&self) -> u64 {
        self.anchor_unix_ms + millis(self.anchor.elapsed())
    }
}

/// A clock that moves only when told to, for tests. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_millis(250));
/// assert_eq!(clock.now_unix_ms(), 1_250);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock showing `unix_ms`.
    pub fn new(unix_ms: u64) -> Self {
        ManualClock(Arc::new(AtomicU64::new(unix_ms)))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(millis(by), Ordering::SeqCst);
    }

    /// Sets the clock.
    pub fn set(&self, unix_ms: u64) {
        self.0.store(unix_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_unix_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

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

/// The counters of one key.
struct Entry {
    key: Box<str>,
    /// The key's hash, kept for growing the table.
    hash: u64,
    /// One counter per (algorithm, period, limit), so one per rule of a policy. The first ones match
    /// the rules of the latest check, in rule order; counters of other rules on the same key (two policies of one name, a policy
    /// redeployed with new rules) follow, kept until they expire rather than wiped.
    counters: Vec<Counter>,
    /// When every counter is empty again and the entry can go.
    expires_at_ms: u64,
    /// The latest check of this key, admitted or refused: eviction takes the least recent, so a
    /// client that keeps knocking while refused is not evicted by a flood of new keys.
    last_seen_ms: u64,
    /// The end of a penalty block (0 or past: none).
    blocked_until_ms: u64,
}

enum Counter {
    Window {
        /// The limit of the rule this counter counts for (part of its identity, with the period).
        limit: u64,
        period_ms: u64,
        start_ms: u64,
        count: u64,
    },
    Log {
        /// The limit of the rule this counter counts for (part of its identity, with the period).
        limit: u64,
        period_ms: u64,
        /// Admission times, oldest first; one per unit of cost.
        stamps: VecDeque<u64>,
    },
    /// The sliding-window counter: see [`weighted`](super::weighted).
    Weighted {
        /// The limit of the rule this counter counts for (part of its identity, with the period).
        limit: u64,
        period_ms: u64,
        start_ms: u64,
        previous: u64,
        current: u64,
    },
    /// The token bucket: see [`gcra`](super::gcra).
    Bucket {
        /// The limit of the rule this counter counts for (part of its identity, with the period
        /// and the burst).
        limit: u64,
        period_ms: u64,
        burst: u64,
        bucket: Bucket,
        /// The theoretical arrival time, in microseconds since the Unix epoch.
        tat_us: u64,
    },
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

    fn check_now(&self, request: &CheckRequest<'_>) -> Decision {
        let shared = &*self.0;
        let now = shared.clock.now_unix_ms();
        let hash = shared.hasher.hash_one(request.key);
        // Bits 32..48 pick the shard: the table inside indexes by the low bits and tags by the top 7.
        let index = usize::from((hash >> 32) as u16) % shared.shards.len();
        let mut shard = lock(&shared.shards[index]);
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
        if let Some(entry) = shard
            .entries
            .find_mut(hash, |entry| *entry.key == *request.key)
        {
            entry.arrange(request);
            return entry.check(request, now, quota.as_mut());
        }
        let mut entry = Entry::new(request, hash);
        let decision = entry.check(request, now, quota.as_mut());
        // A refused request leaves nothing behind, except the penalty block it started.
        if decision.allowed || entry.blocked_until_ms > now {
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

impl Entry {
    fn new(request: &CheckRequest<'_>, hash: u64) -> Self {
        let counters = request
            .rules
            .iter()
            .map(|rule| Counter::new(request.algorithm, rule))
            .collect();
        Entry {
            key: request.key.into(),
            hash,
            counters,
            expires_at_ms: 0,
            last_seen_ms: 0,
            blocked_until_ms: 0,
        }
    }

    /// Puts the counters of the request's rules first, in rule order, creating missing ones. Almost
    /// always a no-op: only a key shared by different rule sets moves anything.
    fn arrange(&mut self, request: &CheckRequest<'_>) {
        for (index, rule) in request.rules.iter().enumerate() {
            let algorithm = request.algorithm;
            let found = self.counters[index.min(self.counters.len())..]
                .iter()
                .position(|counter| counter.counts(algorithm, rule));
            match found {
                Some(0) => {}
                Some(offset) => self.counters.swap(index, index + offset),
                None => {
                    self.counters.push(Counter::new(algorithm, rule));
                    let last = self.counters.len() - 1;
                    self.counters.swap(index, last);
                }
            }
        }
    }

    /// Checks every rule, then records in all of them only if all admit the request, now or (when
    /// the request may wait) at the first time they all do.
    fn check(
        &mut self,
        request: &CheckRequest<'_>,
        now: u64,
        quota: Option<&mut (&mut QuotaCounter, QuotaRequest<'_>)>,
    ) -> Decision {
        self.last_seen_ms = now;
        if self.blocked_until_ms > now {
            return self.blocked(request, now, quota.as_deref());
        }
        let cost = request.cost;
        let mut allowed = true;
        // The wait until every refusing rule admits the request, if they all ever do.
        let mut wait = Some(0);
        let mut guard_refused = false;
        // A refusal by a rule other than the guard starts a penalty block.
        let mut counted_refused = false;
        for (counter, rule) in self.counters.iter_mut().zip(request.rules) {
            counter.forget_before(now);
            let cost = rule_cost(rule, cost);
            if !counter.fits(now, cost) {
                allowed = false;
                guard_refused |= rule.is_duplicate_guard();
                counted_refused |= !rule.is_duplicate_guard();
                wait = wait
                    .zip(counter.admits_after(now, cost))
                    .map(|(a, b)| a.max(b));
            }
        }
        // The quota, a calendar day, can't reserve: when it refuses, the request is refused.
        let quota_refused = quota
            .as_ref()
            .is_some_and(|(counter, request_quota)| !counter.fits(cost, request_quota.limit));
        if quota_refused {
            allowed = false;
        }
        // A reservation: the request is recorded when it fits, and waits until then.
        let delay = match wait {
            Some(wait)
                if !allowed
                    && !guard_refused
                    && !quota_refused
                    && request.algorithm.can_reserve()
                    && u128::from(wait) <= request.max_delay.as_millis() =>
            {
                allowed = true;
                wait
            }
            _ => 0,
        };
        let block_ms = request
            .block_for
            .filter(|_| !allowed && (quota_refused || counted_refused))
            .map(millis);
        let mut rules = Vec::with_capacity(request.rules.len());
        for (counter, rule) in self.counters.iter_mut().zip(request.rules) {
            let cost = rule_cost(rule, cost);
            let retry_after = if allowed {
                counter.record(now + delay, cost);
                None
            } else if counter.fits(now, cost) {
                None
            } else {
                // Costs more than the limit: it never fits; say one period.
                let wait = counter
                    .admits_after(now, cost)
                    .unwrap_or(counter.period_ms());
                Some(Duration::from_millis(wait.max(block_ms.unwrap_or(0))))
            };
            rules.push(RuleState {
                limit: rule.limit(),
                remaining: counter.remaining(now),
                reset: Duration::from_millis(counter.frees_after(now)),
                retry_after,
            });
        }
        let mut quota_alerts = Vec::new();
        if let Some((counter, request_quota)) = quota {
            let retry_after = if allowed {
                quota_alerts = counter.record(cost, request_quota, now);
                None
            } else if quota_refused {
                let wait = counter.admits_after(cost, request_quota, now);
                Some(Duration::from_millis(wait.max(block_ms.unwrap_or(0))))
            } else {
                None
            };
            rules.push(RuleState {
                limit: request_quota.limit,
                remaining: request_quota.limit.saturating_sub(counter.count),
                reset: Duration::from_millis(counter.frees_after(request_quota, now)),
                retry_after,
            });
        }
        if let Some(block_ms) = block_ms {
            self.blocked_until_ms = now.saturating_add(block_ms);
        }
        let rule_count = request.rules.len();
        if self.counters.len() > rule_count {
            // Counters of other rule sets stay only while they still hold something.
            let mut index = rule_count;
            while index < self.counters.len() {
                if self.counters[index].expires_at() <= now {
                    self.counters.swap_remove(index);
                } else {
                    index += 1;
                }
            }
        }
        self.expires_at_ms = self
            .counters
            .iter()
            .map(Counter::expires_at)
            .max()
            .unwrap_or(0)
            .max(self.blocked_until_ms);
        Decision {
            allowed,
            rules,
            now_unix_ms: now,
            delay: Duration::from_millis(delay),
            quota_alerts,
        }
    }

    /// The answer during a penalty block: nothing is available until it ends. A quota that is used
    /// up stays so past the block, to the end of its day: its item says when.
    fn blocked(
        &self,
        request: &CheckRequest<'_>,
        now: u64,
        quota: Option<&(&mut QuotaCounter, QuotaRequest<'_>)>,
    ) -> Decision {
        let left = self.blocked_until_ms - now;
        let state = |limit, wait: u64| RuleState {
            limit,
            remaining: 0,
            reset: Duration::from_millis(wait),
            retry_after: Some(Duration::from_millis(wait)),
        };
        let mut rules: Vec<RuleState> = request
            .rules
            .iter()
            .map(|rule| state(rule.limit(), left))
            .collect();
        if let Some((counter, quota)) = quota {
            let wait = if counter.fits(request.cost, quota.limit) {
                left
            } else {
                left.max(counter.admits_after(request.cost, quota, now))
            };
            rules.push(state(quota.limit, wait));
        }
        Decision {
            allowed: false,
            rules,
            now_unix_ms: now,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
        }
    }
}

/// What a request costs in `rule`: the duplicate guard counts requests, not units.
fn rule_cost(rule: &Rule, cost: u64) -> u64 {
    if rule.is_duplicate_guard() { 1 } else { cost }
}

/// How long an alert flag lives: 30 hours, longer than any day, as the seed sets it.
const ALERT_FLAG_MS: u64 = 30 * 3_600_000;

/// The daily quota counters, by quota key.
#[derive(Default)]
struct QuotaTable {
    counters: std::collections::HashMap<Box<str>, QuotaCounter>,
    next_sweep_ms: u64,
}

/// One key's daily count, and when each alert threshold last fired.
#[derive(Default)]
struct QuotaCounter {
    /// The start of the day `count` counts.
    start_ms: u64,
    count: u64,
    /// When the count is over: the day's end, or 0 while nothing is counted.
    ends_ms: u64,
    /// Per threshold percent: the day start it fired for and when that flag expires.
    flags: Vec<(u8, u64, u64)>,
    /// The latest check, for eviction.
    last_seen_ms: u64,
}

impl QuotaTable {
    /// The counter of `quota`'s key, rolled over to the day of `now`.
    /// The counter of `quota`'s key, rolled over to the day of `now`. A full table (as many quota
    /// keys as the store's `max_keys`) makes room as the shards do: expired counters go, then the
    /// least recently checked one.
    fn counter(
        &mut self,
        quota: &QuotaRequest<'_>,
        now: u64,
        shared: &Shared,
    ) -> &mut QuotaCounter {
        if now >= self.next_sweep_ms {
            self.counters
                .retain(|_, counter| counter.expires_at() > now);
            self.next_sweep_ms = now.saturating_add(SWEEP_INTERVAL_MS);
        }
        if !self.counters.contains_key(quota.key) && self.counters.len() >= shared.max_keys {
            self.counters
                .retain(|_, counter| counter.expires_at() > now);
            if self.counters.len() >= shared.max_keys {
                let victim = self
                    .counters
                    .iter()
                    .min_by_key(|(_, counter)| counter.last_seen_ms)
                    .map(|(key, _)| key.clone());
                if let Some(victim) = victim {
                    self.counters.remove(&victim);
                    shared.evictions.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let counter = self.counters.entry(quota.key.into()).or_default();
        counter.last_seen_ms = now;
        let start = quota.day_start(now);
        if start > counter.start_ms {
            counter.start_ms = start;
            counter.count = 0;
            counter.ends_ms = 0;
        }
        counter
    }
}

impl QuotaCounter {
    fn fits(&self, cost: u64, limit: u64) -> bool {
        self.count.saturating_add(cost) <= limit
    }

    /// Milliseconds until a request of `cost` fits: the next day, or one day when it never fits.
    fn admits_after(&self, cost: u64, quota: &QuotaRequest<'_>, now: u64) -> u64 {
        let to_next_day = (self.start_ms + quota.day_ms).saturating_sub(now);
        if cost > quota.limit {
            quota.day_ms
        } else {
            to_next_day
        }
    }

    fn frees_after(&self, quota: &QuotaRequest<'_>, now: u64) -> u64 {
        if self.count == 0 {
            0
        } else {
            (self.start_ms + quota.day_ms).saturating_sub(now)
        }
    }

    /// Counts an admitted request; returns the thresholds it reached first today.
    fn record(&mut self, cost: u64, quota: &QuotaRequest<'_>, now: u64) -> Vec<u8> {
        let before = self.count;
        self.count += cost;
        self.ends_ms = self.start_ms.saturating_add(quota.day_ms);
        let mut fired = Vec::new();
        for threshold in quota.thresholds {
            if before >= threshold.used || self.count < threshold.used {
                continue;
            }
            let flag = self
                .flags
                .iter_mut()
                .find(|(percent, _, _)| *percent == threshold.percent);
            let already = flag
                .as_ref()
                .is_some_and(|(_, day, expires)| *day == self.start_ms && *expires > now);
            if already {
                continue;
            }
            let set = (threshold.percent, self.start_ms, now + ALERT_FLAG_MS);
            match flag {
                Some(flag) => *flag = set,
                None => self.flags.push(set),
            }
            fired.push(threshold.percent);
        }
        fired
    }

    /// When nothing of this counter matters any more: its count and its alert flags are over.
    fn expires_at(&self) -> u64 {
        self.flags
            .iter()
            .map(|(_, _, expires)| *expires)
            .max()
            .unwrap_or(0)
            .max(self.ends_ms)
    }
}

impl Counter {
    fn new(algorithm: Algorithm, rule: &Rule) -> Self {
        // Policies refuse zero periods; a rule passed to a store directly must not divide by zero.
        let period_ms = rule.period_ms().max(1);
        let limit = rule.limit();
        if rule.is_duplicate_guard() {
            // Exact whatever the policy's algorithm: a double click is never let through.
            return Counter::Log {
                limit,
                period_ms,
                stamps: VecDeque::new(),
            };
        }
        match algorithm {
            Algorithm::FixedWindow => Counter::Window {
                limit,
                period_ms,
                start_ms: 0,
                count: 0,
            },
            Algorithm::SlidingLog => Counter::Log {
                limit,
                period_ms,
                stamps: VecDeque::new(),
            },
            Algorithm::SlidingCounter => Counter::Weighted {
                limit,
                period_ms,
                start_ms: 0,
                previous: 0,
                current: 0,
            },
            Algorithm::TokenBucket => Counter::Bucket {
                limit,
                period_ms,
                burst: rule.burst_size(),
                bucket: Bucket::new(limit, period_ms, rule.burst_size()),
                tat_us: 0,
            },
        }
    }

    /// Whether this counter keeps the count of `rule` under `algorithm`.
    fn counts(&self, algorithm: Algorithm, rule: &Rule) -> bool {
        let same = |limit: u64, period_ms: u64| {
            limit == rule.limit() && period_ms == rule.period_ms().max(1)
        };
        if rule.is_duplicate_guard() {
            return matches!(self, Counter::Log { limit, period_ms, .. } if same(*limit, *period_ms));
        }
        match (self, algorithm) {
            (
                Counter::Window {
                    limit, period_ms, ..
                },
                Algorithm::FixedWindow,
            )
            | (
                Counter::Log {
                    limit, period_ms, ..
                },
                Algorithm::SlidingLog,
            )
            | (
                Counter::Weighted {
                    limit, period_ms, ..
                },
                Algorithm::SlidingCounter,
            ) => same(*limit, *period_ms),
            (
                Counter::Bucket {
                    limit,
                    period_ms,
                    burst,
                    ..
                },
                Algorithm::TokenBucket,
            ) => same(*limit, *period_ms) && *burst == rule.burst_size(),
            _ => false,
        }
    }

    fn period_ms(&self) -> u64 {
        match self {
            Counter::Window { period_ms, .. }
            | Counter::Log { period_ms, .. }
            | Counter::Weighted { period_ms, .. }
            | Counter::Bucket { period_ms, .. } => *period_ms,
        }
    }

    /// Drops what no longer counts at `now`: a past window, or admissions older than the period.
    fn forget_before(&mut self, now: u64) {
        match self {
            Counter::Window {
                period_ms,
                start_ms,
                count,
                ..
            } => {
                // Windows are aligned to the epoch, so every store agrees where they start.
                let current = now - now % *period_ms;
                if current > *start_ms {
                    *start_ms = current;
                    *count = 0;
                }
            }
            Counter::Weighted {
                period_ms,
                start_ms,
                previous,
                current,
                ..
            } => {
                let window = now - now % *period_ms;
                if window > *start_ms {
                    // The window just ended becomes the previous one; older ones count for nothing.
                    *previous = if window - *start_ms == *period_ms {
                        *current
                    } else {
                        0
                    };
                    *current = 0;
                    *start_ms = window;
                }
            }
            Counter::Log {
                period_ms, stamps, ..
            } => {
                while stamps
                    .front()
                    .is_some_and(|&stamp| stamp.saturating_add(*period_ms) <= now)
                {
                    stamps.pop_front();
                }
            }
            // The bucket's one timestamp says it all.
            Counter::Bucket { .. } => {}
        }
    }

    /// The units in use at `now` (after `forget_before(now)`), for the counting algorithms.
    fn used(&self, now: u64) -> u64 {
        match self {
            Counter::Window { count, .. } => *count,
            Counter::Log { stamps, .. } => stamps.len() as u64,
            Counter::Weighted {
                period_ms,
                start_ms,
                previous,
                current,
                ..
            } => weighted::weighted(*previous, *period_ms, now - start_ms) + current,
            Counter::Bucket {
                burst,
                bucket,
                tat_us,
                ..
            } => burst.saturating_sub(bucket.remaining(*tat_us, micros(now))),
        }
    }

    /// Whether a request of `cost` is admitted at `now`.
    fn fits(&self, now: u64, cost: u64) -> bool {
        match self {
            Counter::Bucket { bucket, tat_us, .. } => bucket
                .conforms_at(*tat_us, micros(now), cost)
                .is_some_and(|at| at <= micros(now)),
            Counter::Window { limit, .. }
            | Counter::Log { limit, .. }
            | Counter::Weighted { limit, .. } => self.used(now).saturating_add(cost) <= *limit,
        }
    }

    /// Units available at `now`.
    fn remaining(&self, now: u64) -> u64 {
        match self {
            Counter::Bucket { bucket, tat_us, .. } => bucket.remaining(*tat_us, micros(now)),
            Counter::Window { limit, .. }
            | Counter::Log { limit, .. }
            | Counter::Weighted { limit, .. } => limit.saturating_sub(self.used(now)),
        }
    }

    /// Records a request of `cost` admitted at `at` (now, or later for a reservation).
    fn record(&mut self, at: u64, cost: u64) {
        match self {
            Counter::Window { count, .. } => *count += cost,
            Counter::Weighted { current, .. } => *current += cost,
            Counter::Log { stamps, .. } => {
                // Reservations may lie ahead of `at`: keep the log in time order.
                let position = stamps.partition_point(|&stamp| stamp <= at);
                if position == stamps.len() {
                    stamps.extend(std::iter::repeat_n(at, cost as usize));
                } else {
                    for _ in 0..cost {
                        stamps.insert(position, at);
                    }
                }
            }
            // A free request moves nothing, as in lua/token_bucket.lua.
            Counter::Bucket { bucket, tat_us, .. } if cost > 0 => {
                *tat_us = bucket.admit(*tat_us, micros(at), cost);
            }
            Counter::Bucket { .. } => {}
        }
    }

    /// Milliseconds until a request of `cost` fits (it doesn't fit now), assuming nothing else is
    /// admitted meanwhile; `None` when it never fits.
    fn admits_after(&self, now: u64, cost: u64) -> Option<u64> {
        match self {
            Counter::Window {
                limit,
                period_ms,
                start_ms,
                ..
            } => (cost <= *limit).then(|| start_ms.saturating_add(*period_ms).saturating_sub(now)),
            Counter::Log {
                limit,
                period_ms,
                stamps,
            } => {
                // The request fits once `used + cost - limit` of the oldest admissions expire.
                let must_expire = (stamps.len() as u64 + cost).saturating_sub(*limit);
                let stamp = stamps.get(usize::try_from(must_expire).ok()?.checked_sub(1)?)?;
                Some(stamp.saturating_add(*period_ms).saturating_sub(now))
            }
            Counter::Weighted {
                limit,
                period_ms,
                start_ms,
                previous,
                current,
            } => (cost <= *limit).then(|| {
                weighted::wait_until_fits(
                    *previous,
                    *current,
                    cost,
                    *limit,
                    *period_ms,
                    now - start_ms,
                )
            }),
            Counter::Bucket { bucket, tat_us, .. } => {
                let at = bucket.conforms_at(*tat_us, micros(now), cost)?;
                Some(gcra::ceil_ms(at.saturating_sub(micros(now))))
            }
        }
    }

    /// Milliseconds until some quota frees up (0 when nothing is used).
    fn frees_after(&self, now: u64) -> u64 {
        match self {
            Counter::Window {
                period_ms,
                start_ms,
                count,
                ..
            } => {
                if *count == 0 {
                    0
                } else {
                    start_ms.saturating_add(*period_ms).saturating_sub(now)
                }
            }
            Counter::Log {
                period_ms, stamps, ..
            } => stamps.front().map_or(0, |oldest| {
                oldest.saturating_add(*period_ms).saturating_sub(now)
            }),
            Counter::Weighted {
                period_ms,
                start_ms,
                previous,
                current,
                ..
            } => weighted::wait_until_frees(*previous, *current, *period_ms, now - start_ms),
            Counter::Bucket { bucket, tat_us, .. } => {
                gcra::ceil_ms(bucket.refills_after(*tat_us, micros(now)))
            }
        }
    }

    /// When this counter holds nothing any more.
    fn expires_at(&self) -> u64 {
        match self {
            Counter::Window {
                period_ms,
                start_ms,
                count,
                ..
            } => {
                if *count == 0 {
                    0
                } else {
                    start_ms.saturating_add(*period_ms)
                }
            }
            Counter::Log {
                period_ms, stamps, ..
            } => stamps
                .back()
                .map_or(0, |newest| newest.saturating_add(*period_ms)),
            // This window's count matters until the next window ends; the previous one's until
            // this one ends.
            Counter::Weighted {
                period_ms,
                start_ms,
                previous,
                current,
                ..
            } => {
                if *current > 0 {
                    start_ms.saturating_add(period_ms.saturating_mul(2))
                } else if *previous > 0 {
                    start_ms.saturating_add(*period_ms)
                } else {
                    0
                }
            }
            // The bucket is full again at its theoretical arrival time.
            Counter::Bucket { tat_us, .. } => gcra::ceil_ms(*tat_us),
        }
    }
}

fn micros(ms: u64) -> u64 {
    ms.saturating_mul(1_000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::QuotaThreshold;

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
