//! The sliding-window log: one entry per admitted request, so it is exact; also the counter of
//! every duplicate guard, whatever the policy's algorithm. An admission at `t` counts while
//! `t + period > now`. The counterpart of `lua/sliding_log.lua`.
//!
//! An entry holds a request's units, however many: its cost costs neither memory nor time. Units
//! are numbered in admission order, so the log's count is the next number less the oldest entry's
//! first, and the entry holding the n-th oldest unit is found by a binary search. Entries are kept
//! in time order: an admission recorded before the newest one (a clock that stepped back, a
//! reservation ahead of it) is recorded at the newest one's time, which only counts it longer.

use std::collections::VecDeque;

/// One admitted request: when, and the number of its first unit.
#[derive(Clone, Copy)]
struct Admission {
    at: u64,
    first: u64,
}

/// A sliding log of admissions for one rule.
pub(super) struct SlidingLog {
    /// The limit of the rule counting by it (a run-time override's may differ from the one it is
    /// kept under: see `Counter`).
    limit: u64,
    period_ms: u64,
    /// Admissions, oldest first.
    admissions: VecDeque<Admission>,
    /// The number of the next unit: the newest admission's first plus its cost (0 when empty).
    next: u64,
}

impl SlidingLog {
    pub(super) fn new(limit: u64, period_ms: u64) -> Self {
        SlidingLog {
            limit,
            period_ms,
            admissions: VecDeque::new(),
            next: 0,
        }
    }

    /// Counts by `limit` from now on, keeping its state.
    pub(super) fn fit_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// Drops admissions older than the period.
    pub(super) fn forget_before(&mut self, now: u64) {
        while self
            .admissions
            .front()
            .is_some_and(|admission| admission.at.saturating_add(self.period_ms) <= now)
        {
            self.admissions.pop_front();
        }
        if self.admissions.is_empty() {
            self.next = 0;
        }
    }

    /// The units in use (after `forget_before(now)`).
    fn used(&self) -> u64 {
        self.admissions
            .front()
            .map_or(0, |oldest| self.next.wrapping_sub(oldest.first))
    }

    pub(super) fn fits(&self, cost: u64) -> bool {
        self.used().saturating_add(cost) <= self.limit
    }

    pub(super) fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }

    pub(super) fn record(&mut self, at: u64, cost: u64) {
        if cost == 0 {
            return;
        }
        let at = self
            .admissions
            .back()
            .map_or(at, |newest| newest.at.max(at));
        self.admissions.push_back(Admission {
            at,
            first: self.next,
        });
        self.next = self.next.wrapping_add(cost);
    }

    /// Gives back up to `cost` of the newest units still in the log (after `forget_before(now)`):
    /// the newest admissions shrink or go.
    pub(super) fn refund(&mut self, cost: u64) {
        let mut left = cost;
        while left > 0
            && let Some(newest) = self.admissions.back()
        {
            let units = self.next.wrapping_sub(newest.first);
            if units <= left {
                left -= units;
                self.next = newest.first;
                self.admissions.pop_back();
            } else {
                self.next = self.next.wrapping_sub(left);
                left = 0;
            }
        }
        if self.admissions.is_empty() {
            self.next = 0;
        }
    }

    /// Gives back up to `cost` units of an admission at `admitted_ms` (after
    /// `forget_before(now)`): from the entries recorded at or before that time, newest first. Its
    /// own entry is the newest of them, unless it was recorded later (at a newer entry's time);
    /// then older ones give back, which leave no later than it would: never more room than the
    /// admission's own units would have made. The entries after them are numbered down, so the
    /// count stays the next number less the oldest's first.
    pub(super) fn give_back(&mut self, cost: u64, admitted_ms: u64) {
        let mut left = cost;
        let mut end = self
            .admissions
            .partition_point(|admission| admission.at <= admitted_ms);
        while left > 0 && end > 0 {
            let index = end - 1;
            let first = self.admissions[index].first;
            let until = self
                .admissions
                .get(index + 1)
                .map_or(self.next, |after| after.first);
            let units = until.wrapping_sub(first);
            let back = units.min(left);
            left -= back;
            for after in self.admissions.range_mut(index + 1..) {
                after.first = after.first.wrapping_sub(back);
            }
            self.next = self.next.wrapping_sub(back);
            if back == units {
                self.admissions.remove(index);
            }
            end = index;
        }
        if self.admissions.is_empty() {
            self.next = 0;
        }
    }

    pub(super) fn admits_after(&self, now: u64, cost: u64) -> Option<u64> {
        if cost > self.limit {
            return None;
        }
        // The request fits once `used + cost - limit` of the oldest units leave: the one of
        // them admitted last is unit `used + cost - limit - 1`, counted from the oldest.
        let unit = (self.used() + cost)
            .checked_sub(self.limit)?
            .checked_sub(1)?;
        let base = self.admissions.front()?.first;
        let holding = self
            .admissions
            .partition_point(|admission| admission.first.wrapping_sub(base) <= unit)
            .checked_sub(1)?;
        let admission = self.admissions[holding];
        Some(
            admission
                .at
                .saturating_add(self.period_ms)
                .saturating_sub(now),
        )
    }

    /// When the oldest admission leaves the log.
    pub(super) fn frees_after(&self, now: u64) -> u64 {
        self.admissions.front().map_or(0, |oldest| {
            oldest.at.saturating_add(self.period_ms).saturating_sub(now)
        })
    }

    /// When the newest admission leaves the log.
    pub(super) fn expires_at(&self) -> u64 {
        self.admissions
            .back()
            .map_or(0, |newest| newest.at.saturating_add(self.period_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::SlidingLog;

    #[test]
    fn a_request_is_one_admission_whatever_its_cost() {
        // The outside probe's crash: 2^32 units of a 2^35 log once allocated 8 bytes a unit.
        let mut log = SlidingLog::new(1 << 35, 3_600_000);
        log.record(0, 1 << 32);
        log.record(5, 3);
        assert_eq!(log.admissions.len(), 2);
        assert_eq!(log.remaining(), (1 << 35) - (1 << 32) - 3);
    }

    #[test]
    fn the_wait_is_for_the_admission_holding_the_last_unit_that_must_leave() {
        let mut log = SlidingLog::new(10, 1_000);
        // Units 0-3 at 0 ms, 4 at 100 ms, 5-9 at 200 ms: full.
        log.record(0, 4);
        log.record(100, 1);
        log.record(200, 5);
        assert!(!log.fits(1));
        // One unit: the oldest admission's first leaves at 1 000 ms.
        assert_eq!(log.admits_after(300, 1), Some(700));
        // Four: still the oldest admission. Five: the one at 100 ms.
        assert_eq!(log.admits_after(300, 4), Some(700));
        assert_eq!(log.admits_after(300, 5), Some(800));
        // Six to ten: the newest. Eleven: never.
        assert_eq!(log.admits_after(300, 6), Some(900));
        assert_eq!(log.admits_after(300, 10), Some(900));
        assert_eq!(log.admits_after(300, 11), None);
        log.forget_before(1_000);
        assert_eq!(log.remaining(), 4);
        assert_eq!(log.frees_after(1_000), 100);
    }

    #[test]
    fn a_give_back_takes_the_admission_s_own_units_not_the_newest() {
        // 3 per 4 s: a slow request admitted at 0, two failures at 3 000; the slow one is
        // given back at 3 500. Its unit goes, the failures' stay until 7 000.
        let mut log = SlidingLog::new(3, 4_000);
        log.record(0, 1);
        log.record(3_000, 2);
        log.forget_before(3_500);
        log.give_back(1, 0);
        assert_eq!(log.remaining(), 1);
        log.forget_before(4_000);
        assert_eq!(log.remaining(), 1, "the failures still count");
        log.forget_before(6_999);
        assert_eq!(log.remaining(), 1);
        log.forget_before(7_000);
        assert_eq!(log.remaining(), 3);
    }

    #[test]
    fn a_give_back_shrinks_entries_at_or_before_its_time_and_renumbers_the_later_ones() {
        let mut log = SlidingLog::new(100, 10_000);
        log.record(0, 4);
        log.record(100, 3);
        log.record(200, 5);
        // 5 units of the admission at 100: its 3, then 2 of the one at 0 (older: they leave
        // no later), none of the one at 200.
        log.give_back(5, 100);
        assert_eq!(log.remaining(), 100 - 7);
        assert_eq!(log.admissions.len(), 2);
        // The one at 0 holds 2 units (they leave at 10 000), the one at 200 its 5.
        assert_eq!(log.admits_after(300, 95), Some(9_700));
        assert_eq!(log.admits_after(300, 96), Some(9_900));
        log.forget_before(10_000);
        assert_eq!(log.remaining(), 95);
        // Before any entry: nothing to give back.
        let mut early = SlidingLog::new(10, 1_000);
        early.record(500, 2);
        early.give_back(2, 499);
        assert_eq!(early.remaining(), 8);
    }

    #[test]
    fn an_admission_before_the_newest_counts_from_the_newest() {
        let mut log = SlidingLog::new(3, 1_000);
        // A reservation ahead, then an admission at an earlier time: kept in time order.
        log.record(500, 1);
        log.record(100, 1);
        assert_eq!(log.expires_at(), 1_500);
        log.forget_before(1_499);
        assert_eq!(log.remaining(), 1);
        log.forget_before(1_500);
        assert_eq!(log.remaining(), 3);
        // Emptied, it numbers its units from 0 again.
        assert_eq!(log.next, 0);
    }
}
