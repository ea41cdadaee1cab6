//! What a layer remembers of its refusals: a cache of refused identities, answered without the
//! store, and a log budget, so that a refusal flood is neither a store flood nor a log flood.
//!
//! The cache is exact. After the store refuses a request, every rule that refused it stays refused
//! at least until the refusal's retry time whatever other instances do (their requests only add
//! to the counts), and a refused request recorded nothing, so answering the next ones locally
//! changes nothing in the store; an admission of the identity (at another cost or tier) drops its
//! entry, since it used quota. An entry is used only for the same identity, the same cost (a
//! smaller one may fit sooner; a larger one would be refused too, but may have to wait longer than
//! the cached `Retry-After` says) and the same quota tier and limit, and only until the earliest of the retry time and the
//! next reset of any rule (so no window rolls over behind a cached answer's headers); in delay
//! mode, until the wait is down to the policy's `max_delay`, when the store would hold the
//! request and admit it rather than refuse it (the store refuses exactly while the wait is
//! longer, and the wait only shrinks with time or grows with others' admissions). Its
//! headers are the refusal's, with every time counted down: `r` as the store last said, `t` and
//! `Retry-After` to the same instants.
//!
//! One thing can shorten a refusal: an operator's reset ([`RateLimitLayer::reset`]) on another
//! instance. So an entry stands at most [`MAX_CACHED_FOR`]: a reset reaches every instance within
//! a second, and a flooding identity costs the store one call a second per instance.
//!
//! [`RateLimitLayer::reset`]: crate::RateLimitLayer::reset

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::decision::Decision;
use crate::limiter::log_budget::LogBudget;

/// The longest a cached refusal is answered without asking the store again.
pub(crate) const MAX_CACHED_FOR: Duration = Duration::from_secs(1);

/// Identities a layer's cache holds by default.
pub const DEFAULT_REFUSAL_CACHE: usize = 10_000;

/// Refusal log lines a policy writes per second at most; the rest are counted and reported in the
/// next line.
const LOG_LINES_PER_SECOND: u64 = 16;

/// The refusals of one layer (shared by its clones).
pub(crate) struct Refusals {
    /// Refused identities by storage key; `None` when the cache is off.
    cache: Option<quick_cache::sync::Cache<String, Arc<Entry>>>,
    /// How many identities the cache holds at most.
    capacity: usize,
    /// When the cache last took an entry, in ms since `epoch`, plus one (0: never). An entry
    /// stands at most [`MAX_CACHED_FOR`], so once that long has passed, none stands: lookups and
    /// admissions then skip the cache, whose emptiness costs a lock per shard to ask.
    last_remembered: AtomicU64,
    epoch: Instant,
    /// The refusal log's budget; it counts the refusals not logged since the last line (over
    /// budget, or answered from the cache).
    log: LogBudget,
}

/// A request as the cache knows it: its identity's store key, its cost, its metered units and
/// its quota tier and limit. A cached refusal answers only a request of the same cost, units
/// and tier.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asking<'a> {
    pub(crate) key: &'a str,
    pub(crate) cost: u64,
    pub(crate) units: u64,
    pub(crate) quota: Option<(usize, u64)>,
}

/// One refused identity.
struct Entry {
    /// The store's refusal.
    decision: Decision,
    /// Its cost and units: only a request of the same cost and units gets the same answer.
    cost: u64,
    units: u64,
    /// Its quota tier and limit: another tier may admit sooner.
    quota: Option<(usize, u64)>,
    /// When the store answered, and until when the refusal stands for sure.
    at: Instant,
    until: Instant,
}

impl Refusals {
    /// A cache of at most `capacity` identities (0: no cache).
    pub(crate) fn new(capacity: usize) -> Self {
        Refusals {
            cache: (capacity > 0).then(|| quick_cache::sync::Cache::new(capacity)),
            capacity,
            last_remembered: AtomicU64::new(0),
            epoch: Instant::now(),
            log: LogBudget::new(LOG_LINES_PER_SECOND),
        }
    }

    /// How many identities the cache holds at most (0: no cache).
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Remembers the store's refusal of `asking`, checked with a reservation of up to
    /// `max_delay` (zero but in delay mode).
    pub(crate) fn remember(&self, asking: Asking<'_>, decision: &Decision, max_delay: Duration) {
        let Some(cache) = &self.cache else { return };
        let Some(retry) = decision.retry_after() else {
            return;
        };
        // In delay mode the store holds and admits a request once its wait is down to
        // `max_delay`, that long before the retry time: the refusal stands only until then.
        let refused_until = retry.saturating_sub(max_delay);
        // Until the first time any rule's state could improve.
        let stands_for = decision
            .rules
            .iter()
            .map(|state| state.reset)
            .filter(|reset| !reset.is_zero())
            .fold(refused_until, Duration::min)
            .min(MAX_CACHED_FOR);
        if stands_for.is_zero() {
            return;
        }
        let at = Instant::now();
        let entry = Entry {
            decision: decision.clone(),
            cost: asking.cost,
            units: asking.units,
            quota: asking.quota,
            at,
            until: at + stands_for,
        };
        cache.insert(asking.key.to_owned(), Arc::new(entry));
        self.last_remembered
            .fetch_max(self.millis_since_epoch(at) + 1, Ordering::Relaxed);
    }

    /// Whole milliseconds from `epoch` to `at`.
    fn millis_since_epoch(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether no cached refusal can stand at `now`: none was remembered in the last
    /// [`MAX_CACHED_FOR`]. An entry remembered less than `m + 1` ms after `epoch` (`m + 1` is
    /// recorded) stands until less than `m + 1` ms plus [`MAX_CACHED_FOR`] after it.
    fn none_stands(&self, now: Instant) -> bool {
        let last = self.last_remembered.load(Ordering::Relaxed);
        let longest = u64::try_from(MAX_CACHED_FOR.as_millis()).unwrap_or(u64::MAX);
        last == 0 || self.millis_since_epoch(now) >= last.saturating_add(longest)
    }

    /// Now, when a cached refusal may stand; None when none was ever remembered (the clock is
    /// read only once one was: a limiter that never refused reads it for nothing here).
    fn now_if_any_may_stand(&self) -> Option<Instant> {
        if self.last_remembered.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let now = Instant::now();
        (!self.none_stands(now)).then_some(now)
    }

    /// Forgets the refusal cached for `asking`'s identity, after the store admitted it (at another
    /// cost or tier): the admission used quota, so that refusal's retry time may have moved.
    pub(crate) fn forget(&self, asking: Asking<'_>) {
        if let Some(cache) = &self.cache
            && self.now_if_any_may_stand().is_some()
        {
            cache.remove(asking.key);
        }
    }

    /// Drops the cached refusal of the store key `key`, if any. (A give-back calls it: when no
    /// refusal can stand, it costs an atomic load, not a look at every shard of the cache.)
    pub(crate) fn forget_key(&self, key: &str) {
        if let Some(cache) = &self.cache
            && self.now_if_any_may_stand().is_some()
        {
            cache.remove(key);
        }
    }

    /// The cached refusal of `asking`, moved forward to now, if one stands.
    pub(crate) fn answer(&self, asking: Asking<'_>) -> Option<Decision> {
        let cache = self.cache.as_ref()?;
        let now = self.now_if_any_may_stand()?;
        let entry = cache.get(asking.key)?;
        if now >= entry.until
            || asking.cost != entry.cost
            || asking.units != entry.units
            || asking.quota != entry.quota
        {
            return None;
        }
        let elapsed = now - entry.at;
        let mut decision = entry.decision.clone();
        decision.now_unix_ms = decision
            .now_unix_ms
            .saturating_add(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX));
        for state in &mut decision.rules {
            state.reset = state.reset.saturating_sub(elapsed);
            state.retry_after = state.retry_after.map(|retry| retry.saturating_sub(elapsed));
        }
        // Alerts fired with the store's answer, not again.
        decision.quota_alerts.clear();
        Some(decision)
    }

    /// Whether a refusal may be logged now; if not, it is counted for the next line.
    pub(crate) fn may_log(&self, now: Instant) -> bool {
        self.log.may_log_at(now)
    }

    /// A refusal that is not logged (answered from the cache, or over the budget).
    pub(crate) fn count_unlogged(&self) {
        self.log.count_unlogged();
    }

    /// The refusals not logged since the last line; starts the count over.
    pub(crate) fn take_unlogged(&self) -> u64 {
        self.log.take_unlogged()
    }
}
