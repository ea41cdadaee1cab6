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
//! Laid out as `lua/` is: [`entry`] is the shared step of a check (`lua/entry.lua`), [`counter`] dispatches to one file per algorithm ([`fixed_window`],
//! [`sliding_log`], [`sliding_counter`], [`token_bucket`], as `lua/fixed_window.lua` …), and
//! [`quota`] keeps the daily quotas.

use foldhash::fast::RandomState;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use crossbeam_utils::CachePadded;
use hashbrown::HashTable;

use self::entry::Entry;
use self::quota::QuotaTable;
use super::{
    ActionFuture, Call, CheckFuture, CheckRequest, ListFuture, OverrideBook, PauseFuture,
    ResetListener, ResetWatch, Store,
};
use crate::decision::Decision;
use crate::policy::{Policy, StoredOverride, Whom};

mod claims;
mod clock;
mod counter;
mod entry;
mod fair;
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

/// Aligned to its own cache lines, which every check reads: no neighbour written by another core
/// shares them.
#[repr(align(128))]
struct Shared {
    /// Each on cache lines of its own: two cores checking keys of neighbouring shards don't
    /// take each other's lines.
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    /// Daily quota counters, by quota key; locked after a shard, never before.
    quotas: Mutex<QuotaTable>,
    /// The budgets shared fairly (`fair.rs`).
    budgets: Mutex<fair::Budgets>,
    /// Metered calls waiting for room ([`claims`]); locked before a shard, never after.
    claims: Mutex<claims::Claims>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    max_keys_per_shard: usize,
    /// The most quota counters kept (the store's `max_keys`).
    max_keys: usize,
    evictions: AtomicU64,
    /// The last concurrency lease handed out: ids are unique in the store, so a late release
    /// never frees another request's slot.
    next_lease: AtomicU64,
    /// Who hears of resets ([`Store::watch_resets`]): told at once, inside `reset`.
    reset_listeners: Mutex<Vec<Weak<dyn ResetListener>>>,
    /// Overrides set at run time, a book per policy (by `prefix:name:`), shared by every
    /// limiter over the store.
    books: Mutex<std::collections::HashMap<String, Arc<OverrideBook>>>,
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
    /// The book of run-time overrides of the policy whose keys start with `policy`, made at
    /// its first use.
    fn book(&self, policy: &str) -> Arc<OverrideBook> {
        let mut books = lock(&self.0.books);
        if let Some(book) = books.get(policy) {
            return book.clone();
        }
        let clock = self.0.clock.clone();
        let book = Arc::new(OverrideBook::new(Arc::new(move || clock.now_unix_ms())));
        books.insert(policy.to_owned(), book.clone());
        book
    }

    fn shard_of(&self, key: &str) -> (u64, std::sync::MutexGuard<'_, Shard>) {
        let shared = &*self.0;
        let hash = shared.hasher.hash_one(key);
        // Bits 32..48 pick the shard: the table inside indexes by the low bits and tags by the top 7.
        let index = usize::from((hash >> 32) as u16) % shared.shards.len();
        (hash, lock(&shared.shards[index]))
    }

    fn check_now(&self, request: &CheckRequest<'_>) -> Decision {
        let Some(fair) = request.fair else {
            return self.check_entry(request, false);
        };
        // The budget shared fairly: locked before the identity's shard (always in that order),
        // so the budget, the share and the identity's own limits are checked and recorded as
        // one step.
        let shared = &*self.0;
        let mut budgets = lock(&shared.budgets);
        let (budget, now) = budgets.budget(&fair, request.algorithm, shared.clock.now_unix_ms());
        match request.call {
            Call::Check | Call::Peek => {
                let gate = budget.gate(request, &fair, now);
                let mut decision = self.check_entry(request, gate.refuses());
                budget.settle(request, gate, &mut decision);
                decision
            }
            Call::Refund => {
                let mut decision = self.check_entry(request, false);
                budget.refund(request, &fair, &mut decision);
                decision
            }
            Call::GiveBack(charged) => {
                let mut decision = self.check_entry(request, false);
                budget.give_back(request, &fair, charged, &mut decision);
                decision
            }
            Call::Overdraw => {
                let mut decision = self.check_entry(request, false);
                budget.overdraw(request, &fair, &mut decision);
                decision
            }
        }
    }

    /// [`MemoryStore::check_now`] of the identity's own limits (`refused_outside`: a budget
    /// shared fairly refuses it).
    fn check_entry(&self, request: &CheckRequest<'_>, refused_outside: bool) -> Decision {
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
        if request.call == Call::Overdraw
            && shard
                .entries
                .find(hash, |entry| *entry.key == *request.key)
                .is_none()
        {
            // A debt outlives nothing it charges: its entry is made for it.
            shard.insert(Entry::new(request, hash), now, shared);
        }
        if let Some(entry) = shard
            .entries
            .find_mut(hash, |entry| *entry.key == *request.key)
        {
            entry.arrange(request);
            let mut fired = Vec::new();
            match request.call {
                Call::GiveBack(charged) => entry.give_back(request, charged, now, quota.as_mut()),
                Call::Refund => entry.refund(request, now, quota.as_mut()),
                Call::Overdraw => fired = entry.overdraw(request, now, quota.as_mut()),
                Call::Check | Call::Peek => {
                    return entry.check(request, now, quota.as_mut(), lease_id, refused_outside);
                }
            }
            // Units given back or charged, the answer is a peek's of one unit.
            let mut decision =
                entry.check(&request.one_unit(), now, quota.as_mut(), lease_id, false);
            decision.quota_alerts = fired;
            return decision;
        }
        if let Call::Refund | Call::GiveBack(_) = request.call {
            // Nothing of the rules to give back; the day's quota may have something.
            if let Some((counter, quota)) = quota.as_mut() {
                match request.call {
                    Call::GiveBack(charged) => counter
                        .give_back(request.quota_cost(), quota.day_start(charged.now_unix_ms)),
                    _ => counter.refund(request.quota_cost()),
                }
            }
            let request = request.one_unit();
            return Entry::new(&request, hash).check(
                &request,
                now,
                quota.as_mut(),
                lease_id,
                false,
            );
        }
        let mut entry = Entry::new(request, hash);
        let decision = entry.check(request, now, quota.as_mut(), lease_id, refused_outside);
        // A refused request leaves nothing behind, except the penalty block it started; nor does a
        // free one (cost 0, no duplicate guard, which counts requests): an operator's inspection.
        let recorded = request.cost > 0
            || (request.units > 0 && request.is_metered())
            || request.rules.iter().any(|rule| rule.is_duplicate_guard());
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
        CheckFuture::ready(Ok(match request.claim {
            Some(claim) => self.check_claimed(request, claim),
            None => self.check_now(request),
        }))
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

    fn overdraw(&self, request: &CheckRequest<'_>) -> CheckFuture {
        CheckFuture::ready(Ok(self.check_now(&request.overdrawing())))
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn keeps_claims(&self) -> bool {
        true
    }

    fn abilities(&self) -> crate::store::Abilities {
        crate::store::Abilities::ALL
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

    fn override_book(&self, policy: &str) -> Option<Arc<OverrideBook>> {
        Some(self.book(policy))
    }

    fn set_override(
        &self,
        policy: &Policy,
        over: StoredOverride,
        lasting: Option<Duration>,
    ) -> ActionFuture {
        // (Its counters as the policy names them now, as the Redis store keeps them.)
        self.book(policy.key_base())
            .set(over.pinned_to(policy), lasting);
        Box::pin(std::future::ready(Ok(())))
    }

    fn remove_override(&self, policy: &Policy, whom: &Whom) -> ActionFuture {
        self.book(policy.key_base()).remove(whom);
        Box::pin(std::future::ready(Ok(())))
    }

    fn list_overrides(&self, policy: &str) -> ListFuture {
        Box::pin(std::future::ready(Ok(self.book(policy).list())))
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
            shards: (0..shards).map(|_| CachePadded::default()).collect(),
            quotas: Mutex::default(),
            budgets: Mutex::default(),
            claims: Mutex::default(),
            hasher: RandomState::default(),
            clock: self
                .clock
                .map_or_else(|| Arc::new(SystemClock::new()) as Arc<dyn Clock>, Arc::from),
            max_keys_per_shard,
            max_keys: self.max_keys.max(1),
            evictions: AtomicU64::new(0),
            next_lease: AtomicU64::new(0),
            reset_listeners: Mutex::default(),
            books: Mutex::default(),
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
mod tests;
