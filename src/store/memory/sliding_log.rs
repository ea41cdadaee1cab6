//! The sliding-window log: one timestamp per admitted unit, so it is exact; also the counter of
//! every duplicate guard, whatever the policy's algorithm. An admission at `t` counts while
//! `t + period > now`. The counterpart of `lua/sliding_log.lua`.

use std::collections::VecDeque;

/// A sliding log of admissions for one rule.
pub(super) struct SlidingLog {
    /// The limit of the rule this counter counts for (part of its identity, with the period).
    limit: u64,
    period_ms: u64,
    /// Admission times, oldest first; one per unit of cost.
    stamps: VecDeque<u64>,
}

impl SlidingLog {
    pub(super) fn new(limit: u64, period_ms: u64) -> Self {
        SlidingLog {
            limit,
            period_ms,
            stamps: VecDeque::new(),
        }
    }

    /// Whether this counter counts for the rule of `limit` per `period_ms`.
    pub(super) fn counts(&self, limit: u64, period_ms: u64) -> bool {
        self.limit == limit && self.period_ms == period_ms
    }

    pub(super) fn period_ms(&self) -> u64 {
        self.period_ms
    }

    /// Drops admissions older than the period.
    pub(super) fn forget_before(&mut self, now: u64) {
        while self
            .stamps
            .front()
            .is_some_and(|&stamp| stamp.saturating_add(self.period_ms) <= now)
        {
            self.stamps.pop_front();
        }
    }

    /// The units in use (after `forget_before(now)`).
    fn used(&self) -> u64 {
        self.stamps.len() as u64
    }

    pub(super) fn fits(&self, cost: u64) -> bool {
        self.used().saturating_add(cost) <= self.limit
    }

    pub(super) fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }

    pub(super) fn record(&mut self, at: u64, cost: u64) {
        let stamps = &mut self.stamps;
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

    pub(super) fn admits_after(&self, now: u64, cost: u64) -> Option<u64> {
        // The request fits once `used + cost - limit` of the oldest admissions expire.
        let must_expire = (self.stamps.len() as u64 + cost).saturating_sub(self.limit);
        let stamp = self
            .stamps
            .get(usize::try_from(must_expire).ok()?.checked_sub(1)?)?;
        Some(stamp.saturating_add(self.period_ms).saturating_sub(now))
    }

    /// When the oldest admission leaves the log.
    pub(super) fn frees_after(&self, now: u64) -> u64 {
        self.stamps.front().map_or(0, |oldest| {
            oldest.saturating_add(self.period_ms).saturating_sub(now)
        })
    }

    /// When the newest admission leaves the log.
    pub(super) fn expires_at(&self) -> u64 {
        self.stamps
            .back()
            .map_or(0, |newest| newest.saturating_add(self.period_ms))
    }
}
