//! The token bucket, as GCRA: one theoretical arrival time per rule, in microseconds (the
//! arithmetic of [`gcra`]). The counterpart of `lua/token_bucket.lua`.

use crate::store::gcra::{self, Bucket};

/// A token bucket for one rule.
pub(super) struct TokenBucket {
    /// The limit of the rule counting by it (a run-time override's may differ from the one it is
    /// kept under: see `Counter`; nor is the burst part of what it is: see `fit_burst`).
    limit: u64,
    period_ms: u64,
    burst: u64,
    bucket: Bucket,
    /// The theoretical arrival time, in microseconds since the Unix epoch.
    tat_us: u64,
}

impl TokenBucket {
    pub(super) fn new(limit: u64, period_ms: u64, burst: u64) -> Self {
        TokenBucket {
            limit,
            period_ms,
            burst,
            bucket: Bucket::new(limit, period_ms, burst),
            tat_us: 0,
        }
    }

    /// Holds `burst` from now on, keeping its state.
    pub(super) fn fit_burst(&mut self, burst: u64) {
        if self.burst != burst {
            self.burst = burst;
            self.bucket = Bucket::new(self.limit, self.period_ms, burst);
        }
    }

    /// Counts by `limit` from now on, keeping its state.
    pub(super) fn fit_limit(&mut self, limit: u64) {
        if self.limit != limit {
            self.limit = limit;
            self.bucket = Bucket::new(limit, self.period_ms, self.burst);
        }
    }

    pub(super) fn fits(&self, now: u64, cost: u64) -> bool {
        self.bucket
            .conforms_at(self.tat_us, micros(now), cost)
            .is_some_and(|at| at <= micros(now))
    }

    pub(super) fn remaining(&self, now: u64) -> u64 {
        self.bucket.remaining(self.tat_us, micros(now))
    }

    pub(super) fn record(&mut self, at: u64, cost: u64) {
        // A free request moves nothing, as in lua/token_bucket.lua.
        if cost > 0 {
            self.tat_us = self.bucket.admit(self.tat_us, micros(at), cost);
        }
    }

    /// Gives back `cost` units charged earlier, as far as they haven't dripped back already.
    pub(super) fn refund(&mut self, now: u64, cost: u64) {
        if self.tat_us > micros(now) {
            self.tat_us = self.bucket.refund(self.tat_us, micros(now), cost);
        }
    }

    /// Gives back up to `cost` units of a charge that left the bucket full at `full_at_us`, as
    /// far as time has not repaid them yet: `min(cost × interval, full_at - now)`, never past full.
    pub(super) fn give_back(&mut self, now: u64, cost: u64, full_at_us: u64) {
        let now = micros(now);
        if self.tat_us > now {
            self.tat_us = self.bucket.give_back(self.tat_us, now, cost, full_at_us);
        }
    }

    /// When the bucket is full again (its `tat`, µs; `now` when it is full): what a give-back
    /// of the last charge reads.
    pub(super) fn full_at_us(&self, now: u64) -> u64 {
        self.tat_us.max(micros(now))
    }

    pub(super) fn admits_after(&self, now: u64, cost: u64, past_burst: bool) -> Option<u64> {
        let at = if past_burst {
            self.bucket
                .conforms_at_past_burst(self.tat_us, micros(now), cost)
        } else {
            self.bucket.conforms_at(self.tat_us, micros(now), cost)?
        };
        Some(gcra::ceil_ms(at.saturating_sub(micros(now))))
    }

    pub(super) fn frees_after(&self, now: u64) -> u64 {
        gcra::ceil_ms(self.bucket.refills_after(self.tat_us, micros(now)))
    }

    pub(super) fn expires_at(&self) -> u64 {
        // The bucket is full again at its theoretical arrival time.
        gcra::ceil_ms(self.tat_us)
    }
}

fn micros(ms: u64) -> u64 {
    ms.saturating_mul(1_000)
}
