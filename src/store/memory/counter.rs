//! The counter of one rule on one key, whatever its algorithm: an enum with one variant per
//! algorithm, each wrapping the state of its own file (as `lua/` has one script per algorithm),
//! and methods that dispatch to it with a `match` (no boxing, no dynamic dispatch: this is the hot
//! path).

use super::fixed_window::FixedWindow;
use super::sliding_counter::SlidingCounter;
use super::sliding_log::SlidingLog;
use super::token_bucket::TokenBucket;
use crate::policy::{Algorithm, Rule};

/// Where an admission charged one rule: what a give-back of its units reads.
#[derive(Debug, Clone, Copy)]
pub(super) struct ChargedAt {
    /// When the store checked it (ms): the window, and the quota's day, it charged.
    pub(super) checked_ms: u64,
    /// When it was admitted (ms; later than `checked_ms` for a reservation): a sliding log's
    /// entry time, or earlier.
    pub(super) admitted_ms: u64,
    /// A token bucket's full time after the charge (µs).
    pub(super) bucket_full_at_us: Option<u64>,
}

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
            // Whatever its burst: a new burst keeps the count (see `fit_burst`).
            (Counter::Bucket(bucket), Algorithm::TokenBucket) => bucket.counts(limit, period_ms),
            _ => false,
        }
    }

    /// Takes `rule`'s burst, if this is a token bucket of another: its state (when the bucket
    /// is full again) means the same whatever the burst, as the Redis store's key says too.
    pub(super) fn fit_burst(&mut self, rule: &Rule) {
        if let Counter::Bucket(bucket) = self
            && !rule.is_duplicate_guard()
        {
            bucket.fit_burst(rule.burst_size());
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

    /// Gives back up to `cost` units of the charge `charged` to where it was charged (after
    /// `forget_before(now)`): see [`Store::give_back`](crate::Store::give_back).
    pub(super) fn give_back(&mut self, now: u64, cost: u64, charged: ChargedAt) {
        match self {
            Counter::Window(window) => window.give_back(cost, charged.checked_ms),
            Counter::Weighted(weighted) => weighted.give_back(cost, charged.checked_ms),
            Counter::Log(log) => log.give_back(cost, charged.admitted_ms),
            // A bucket whose full time the store didn't say gets nothing (on the safe side).
            Counter::Bucket(bucket) => {
                if let Some(full_at_us) = charged.bucket_full_at_us {
                    bucket.give_back(now, cost, full_at_us);
                }
            }
        }
    }

    /// A token bucket's full time at `now` (µs), what a give-back of its last charge reads;
    /// `None` for the other algorithms.
    pub(super) fn bucket_full_at_us(&self, now: u64) -> Option<u64> {
        match self {
            Counter::Bucket(bucket) => Some(bucket.full_at_us(now)),
            _ => None,
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
