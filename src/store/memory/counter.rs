//! The counter of one rule on one key, whatever its algorithm: an enum with one variant per
//! algorithm, each wrapping the state of its own file (as `lua/` has one script per algorithm),
//! and methods that dispatch to it with a `match` (no boxing, no dynamic dispatch: this is the hot
//! path).

use super::fixed_window::FixedWindow;
use super::sliding_counter::SlidingCounter;
use super::sliding_log::SlidingLog;
use super::token_bucket::TokenBucket;
use crate::policy::{Algorithm, Rule};

/// One rule's count on one key, in the layout of its algorithm.
pub(super) enum Counter {
    /// The fixed window: see [`fixed_window`](super::fixed_window).
    Window(FixedWindow),
    /// The sliding log (also every duplicate guard): see [`sliding_log`](super::sliding_log).
    Log(SlidingLog),
    /// The sliding-window counter: see [`sliding_counter`](super::sliding_counter).
    Weighted(SlidingCounter),
    /// The token bucket: see [`token_bucket`](super::token_bucket).
    Bucket(TokenBucket),
}

impl Counter {
    pub(super) fn new(algorithm: Algorithm, rule: &Rule) -> Self {
        // Policies refuse zero periods; a rule passed to a store directly must not divide by zero.
        let period_ms = rule.period_ms().max(1);
        let limit = rule.limit();
        if rule.is_duplicate_guard() {
            // Exact whatever the policy's algorithm: a double click is never let through.
            return Counter::Log(SlidingLog::new(limit, period_ms));
        }
        match algorithm {
            Algorithm::FixedWindow => Counter::Window(FixedWindow::new(limit, period_ms)),
            Algorithm::SlidingLog => Counter::Log(SlidingLog::new(limit, period_ms)),
            Algorithm::SlidingCounter => Counter::Weighted(SlidingCounter::new(limit, period_ms)),
            Algorithm::TokenBucket => {
                Counter::Bucket(TokenBucket::new(limit, period_ms, rule.burst_size()))
            }
        }
    }

    /// Whether this counter keeps the count of `rule` under `algorithm`.
    pub(super) fn counts(&self, algorithm: Algorithm, rule: &Rule) -> bool {
        // As `new` sets them.
        let (limit, period_ms) = (rule.limit(), rule.period_ms().max(1));
        if rule.is_duplicate_guard() {
            return matches!(self, Counter::Log(log) if log.counts(limit, period_ms));
        }
        match (self, algorithm) {
            (Counter::Window(window), Algorithm::FixedWindow) => window.counts(limit, period_ms),
            (Counter::Log(log), Algorithm::SlidingLog) => log.counts(limit, period_ms),
            (Counter::Weighted(weighted), Algorithm::SlidingCounter) => {
                weighted.counts(limit, period_ms)
            }
            (Counter::Bucket(bucket), Algorithm::TokenBucket) => {
                bucket.counts(limit, period_ms, rule.burst_size())
            }
            _ => false,
        }
    }

    pub(super) fn period_ms(&self) -> u64 {
        match self {
            Counter::Window(window) => window.period_ms(),
            Counter::Log(log) => log.period_ms(),
            Counter::Weighted(weighted) => weighted.period_ms(),
            Counter::Bucket(bucket) => bucket.period_ms(),
        }
    }

    /// Drops what no longer counts at `now`: a past window, or admissions older than the period.
    pub(super) fn forget_before(&mut self, now: u64) {
        match self {
            Counter::Window(window) => window.forget_before(now),
            Counter::Weighted(weighted) => weighted.forget_before(now),
            Counter::Log(log) => log.forget_before(now),
            // The bucket's one timestamp says it all.
            Counter::Bucket(_) => {}
        }
    }

    /// Whether a request of `cost` is admitted at `now`.
    pub(super) fn fits(&self, now: u64, cost: u64) -> bool {
        match self {
            Counter::Window(window) => window.fits(cost),
            Counter::Log(log) => log.fits(cost),
            Counter::Weighted(weighted) => weighted.fits(now, cost),
            Counter::Bucket(bucket) => bucket.fits(now, cost),
        }
    }

    /// Units available at `now`.
    pub(super) fn remaining(&self, now: u64) -> u64 {
        match self {
            Counter::Window(window) => window.remaining(),
            Counter::Log(log) => log.remaining(),
            Counter::Weighted(weighted) => weighted.remaining(now),
            Counter::Bucket(bucket) => bucket.remaining(now),
        }
    }

    /// Records a request of `cost` admitted at `at` (now, or later for a reservation).
    pub(super) fn record(&mut self, at: u64, cost: u64) {
        match self {
            Counter::Window(window) => window.record(cost),
            Counter::Weighted(weighted) => weighted.record(cost),
            Counter::Log(log) => log.record(at, cost),
            Counter::Bucket(bucket) => bucket.record(at, cost),
        }
    }

    /// Gives back up to `cost` units charged in the current window (after `forget_before(now)`).
    pub(super) fn refund(&mut self, now: u64, cost: u64) {
        match self {
            Counter::Window(window) => window.refund(cost),
            Counter::Weighted(weighted) => weighted.refund(cost),
            Counter::Log(log) => log.refund(cost),
            Counter::Bucket(bucket) => bucket.refund(now, cost),
        }
    }

    /// Milliseconds until a request of `cost` fits (it doesn't fit now), assuming nothing else is
    /// admitted meanwhile; `None` when it never fits.
    pub(super) fn admits_after(&self, now: u64, cost: u64) -> Option<u64> {
        match self {
            Counter::Window(window) => window.admits_after(now, cost),
            Counter::Log(log) => log.admits_after(now, cost),
            Counter::Weighted(weighted) => weighted.admits_after(now, cost),
            Counter::Bucket(bucket) => bucket.admits_after(now, cost),
        }
    }

    /// Milliseconds until some quota frees up (0 when nothing is used).
    pub(super) fn frees_after(&self, now: u64) -> u64 {
        match self {
            Counter::Window(window) => window.frees_after(now),
            Counter::Log(log) => log.frees_after(now),
            Counter::Weighted(weighted) => weighted.frees_after(now),
            Counter::Bucket(bucket) => bucket.frees_after(now),
        }
    }

    /// When this counter holds nothing any more.
    pub(super) fn expires_at(&self) -> u64 {
        match self {
            Counter::Window(window) => window.expires_at(),
            Counter::Log(log) => log.expires_at(),
            Counter::Weighted(weighted) => weighted.expires_at(),
            Counter::Bucket(bucket) => bucket.expires_at(),
        }
    }
}
