//! The daily quotas: one count per quota key for the current (calendar) day, shared by every
//! policy that names the quota, and the alert thresholds it has fired. Locked after a shard, and
//! checked and recorded in the same step as the rules (see `Entry::check`).

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::super::QuotaRequest;
use super::{SWEEP_INTERVAL_MS, Shared};

/// How long an alert flag lives: 30 hours, longer than any day, as the seed sets it.
const ALERT_FLAG_MS: u64 = 30 * 3_600_000;

/// The daily quota counters, by quota key.
#[derive(Default)]
pub(super) struct QuotaTable {
    counters: HashMap<Box<str>, QuotaCounter>,
    next_sweep_ms: u64,
}

/// One key's daily count, and when each alert threshold last fired.
#[derive(Default)]
pub(super) struct QuotaCounter {
    /// The start of the day `count` counts.
    start_ms: u64,
    pub(super) count: u64,
    /// When the count is over: the day's end, or 0 while nothing is counted.
    ends_ms: u64,
    /// Per threshold percent: the day start it fired for and when that flag expires.
    flags: Vec<(u8, u64, u64)>,
    /// The latest check, for eviction.
    last_seen_ms: u64,
}

impl QuotaTable {
    /// The counter of `quota`'s key, rolled over to the day of `now`. A full table (as many quota
    /// keys as the store's `max_keys`) makes room as the shards do: expired counters go, then the
    /// least recently checked one.
    pub(super) fn counter(
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
        // (Looked up by the borrowed key: a key already counted allocates nothing.)
        let known = self.counters.contains_key(quota.key);
        if !known && self.counters.len() >= shared.max_keys {
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
        if !known {
            self.counters
                .insert(quota.key.into(), QuotaCounter::default());
        }
        let counter = self
            .counters
            .get_mut(quota.key)
            .expect("the counter was just found or put in");
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
    pub(super) fn fits(&self, cost: u64, limit: u64) -> bool {
        self.count.saturating_add(cost) <= limit
    }

    /// Gives back up to `cost` units of the day (the counter is rolled over to the day of now).
    pub(super) fn refund(&mut self, cost: u64) {
        self.count -= cost.min(self.count);
    }

    /// Gives back up to `cost` units charged on the day starting at `day_start`, if that is
    /// still the counter's day (it is rolled over to the day of now).
    pub(super) fn give_back(&mut self, cost: u64, day_start: u64) {
        if day_start == self.start_ms {
            self.refund(cost);
        }
    }

    /// Milliseconds until a request of `cost` fits: the next day, or one day when it never fits.
    pub(super) fn admits_after(&self, cost: u64, quota: &QuotaRequest<'_>, now: u64) -> u64 {
        let to_next_day = (self.start_ms + quota.day_ms).saturating_sub(now);
        if cost > quota.limit {
            quota.day_ms
        } else {
            to_next_day
        }
    }

    pub(super) fn frees_after(&self, quota: &QuotaRequest<'_>, now: u64) -> u64 {
        if self.count == 0 {
            0
        } else {
            (self.start_ms + quota.day_ms).saturating_sub(now)
        }
    }

    /// Counts an admitted request; returns the thresholds it reached first today.
    pub(super) fn record(&mut self, cost: u64, quota: &QuotaRequest<'_>, now: u64) -> Vec<u8> {
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
