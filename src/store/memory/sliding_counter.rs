//! The sliding-window counter: the counts of the current and the previous fixed window, the
//! previous one weighted by how much of it the sliding window still covers (the arithmetic of
//! [`weighted`]). The counterpart of `lua/sliding_counter.lua`.

use super::weighted;

/// A sliding-window counter for one rule.
pub(super) struct SlidingCounter {
    /// The limit of the rule counting by it (a run-time override's may differ from the one it is
    /// kept under: see `Counter`).
    limit: u64,
    period_ms: u64,
    start_ms: u64,
    previous: u64,
    current: u64,
}

impl SlidingCounter {
    pub(super) fn new(limit: u64, period_ms: u64) -> Self {
        SlidingCounter {
            limit,
            period_ms,
            start_ms: 0,
            previous: 0,
            current: 0,
        }
    }

    /// Counts by `limit` from now on, keeping its state.
    pub(super) fn fit_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// Moves on to the window of `now`.
    pub(super) fn forget_before(&mut self, now: u64) {
        let window = now - now % self.period_ms;
        if window > self.start_ms {
            // The window just ended becomes the previous one; older ones count for nothing.
            self.previous = if window - self.start_ms == self.period_ms {
                self.current
            } else {
                0
            };
            self.current = 0;
            self.start_ms = window;
        }
    }

    /// The units in use at `now` (after `forget_before(now)`).
    fn used(&self, now: u64) -> u64 {
        weighted::weighted(self.previous, self.period_ms, now - self.start_ms) + self.current
    }

    pub(super) fn fits(&self, now: u64, cost: u64) -> bool {
        self.used(now).saturating_add(cost) <= self.limit
    }

    pub(super) fn remaining(&self, now: u64) -> u64 {
        self.limit.saturating_sub(self.used(now))
    }

    /// Gives back up to `cost` units of the current window (after `forget_before(now)`): the
    /// previous window's count is history.
    pub(super) fn refund(&mut self, cost: u64) {
        self.current -= cost.min(self.current);
    }

    /// Gives back up to `cost` units charged at `charged_ms` (after `forget_before(now)`) to the
    /// count of the window they were charged in: the current one's, or the previous one's, which
    /// still weighs in the estimate (lowered by at most what the charge added to it). An older
    /// window counts for nothing: nothing to give back.
    pub(super) fn give_back(&mut self, cost: u64, charged_ms: u64) {
        let window = charged_ms - charged_ms % self.period_ms;
        if window == self.start_ms {
            self.current -= cost.min(self.current);
        } else if window.saturating_add(self.period_ms) == self.start_ms {
            self.previous -= cost.min(self.previous);
        }
    }

    pub(super) fn record(&mut self, cost: u64) {
        self.current += cost;
    }

    pub(super) fn admits_after(&self, now: u64, cost: u64) -> Option<u64> {
        (cost <= self.limit).then(|| {
            weighted::wait_until_fits(
                self.previous,
                self.current,
                cost,
                self.limit,
                self.period_ms,
                now - self.start_ms,
            )
        })
    }

    pub(super) fn frees_after(&self, now: u64) -> u64 {
        weighted::wait_until_frees(
            self.previous,
            self.current,
            self.period_ms,
            now - self.start_ms,
        )
    }

    pub(super) fn expires_at(&self) -> u64 {
        // This window's count matters until the next window ends; the previous one's until this
        // one ends.
        if self.current > 0 {
            self.start_ms
                .saturating_add(self.period_ms.saturating_mul(2))
        } else if self.previous > 0 {
            self.start_ms.saturating_add(self.period_ms)
        } else {
            0
        }
    }
}
