//! The fixed window: one count per rule for the current window, windows aligned to the epoch. The
//! counterpart of `lua/fixed_window.lua`.

/// A fixed window's count for one rule.
pub(super) struct FixedWindow {
    /// The limit of the rule counting by it (a run-time override's may differ from the one it is
    /// kept under: see `Counter`).
    limit: u64,
    period_ms: u64,
    start_ms: u64,
    count: u64,
}

impl FixedWindow {
    pub(super) fn new(limit: u64, period_ms: u64) -> Self {
        FixedWindow {
            limit,
            period_ms,
            start_ms: 0,
            count: 0,
        }
    }

    /// Counts by `limit` from now on, keeping its state.
    pub(super) fn fit_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// Drops a past window.
    pub(super) fn forget_before(&mut self, now: u64) {
        // Windows are aligned to the epoch, so every store agrees where they start.
        let current = now - now % self.period_ms;
        if current > self.start_ms {
            self.start_ms = current;
            self.count = 0;
        }
    }

    /// The units in use (after `forget_before(now)`).
    fn used(&self) -> u64 {
        self.count
    }

    pub(super) fn fits(&self, cost: u64) -> bool {
        self.used().saturating_add(cost) <= self.limit
    }

    pub(super) fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }

    pub(super) fn record(&mut self, cost: u64) {
        self.count += cost;
    }

    /// Gives back up to `cost` units of the current window (after `forget_before(now)`).
    pub(super) fn refund(&mut self, cost: u64) {
        self.count -= cost.min(self.count);
    }

    /// Gives back up to `cost` units charged at `charged_ms`, if its window is still the current
    /// one (after `forget_before(now)`): a rolled window's units are gone with it.
    pub(super) fn give_back(&mut self, cost: u64, charged_ms: u64) {
        if charged_ms - charged_ms % self.period_ms == self.start_ms {
            self.refund(cost);
        }
    }

    /// The end of the window, unless the request costs more than the limit.
    pub(super) fn admits_after(&self, now: u64, cost: u64) -> Option<u64> {
        (cost <= self.limit).then(|| {
            self.start_ms
                .saturating_add(self.period_ms)
                .saturating_sub(now)
        })
    }

    pub(super) fn frees_after(&self, now: u64) -> u64 {
        if self.count == 0 {
            0
        } else {
            self.start_ms
                .saturating_add(self.period_ms)
                .saturating_sub(now)
        }
    }

    pub(super) fn expires_at(&self) -> u64 {
        if self.count == 0 {
            0
        } else {
            self.start_ms.saturating_add(self.period_ms)
        }
    }
}
