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

/// One rule's count on one key, in the layout of its algorithm, and what it is: the limit and
/// period it is kept under (the rule's own, or for a run-time override's rule those of the
/// policy's rule whose count it shares, as the Redis store's key names them) and whether it
/// counts metered units (a rule of requests and a metered rule of the same limit and period count
/// apart).
pub(super) struct Counter {
    metered: bool,
    counted_as: u64,
    period_ms: u64,
    tally: Tally,
}

/// A count in the layout of its algorithm.
pub(super) enum Tally {
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
    /// The counter of `rule`, kept under the limit `counted_as` (the rule's own but for a
    /// run-time override's rule: see `CheckRequest::counted_as`).
    pub(super) fn new(algorithm: Algorithm, rule: &Rule, counted_as: u64) -> Self {
        Counter {
            metered: rule.is_metered(),
            counted_as: Counter::kept_under(rule, counted_as),
            // Policies refuse zero periods; a rule passed to a store directly must not divide by
            // zero.
            period_ms: rule.period_ms().max(1),
            tally: Tally::new(algorithm, rule),
        }
    }

    /// Whether this counter keeps the count of `rule` under `algorithm`, kept under the limit
    /// `counted_as`.
    pub(super) fn counts(&self, algorithm: Algorithm, rule: &Rule, counted_as: u64) -> bool {
        self.metered == rule.is_metered()
            && self.counted_as == Counter::kept_under(rule, counted_as)
            && self.period_ms == rule.period_ms().max(1)
            && self.tally.is_of(algorithm, rule)
    }

    /// The limit a counter of `rule` is kept under: `counted_as`, but a duplicate guard's own
    /// (no override shares one).
    fn kept_under(rule: &Rule, counted_as: u64) -> u64 {
        if rule.is_duplicate_guard() {
            rule.limit()
        } else {
            counted_as
        }
    }
}

impl Tally {
    fn new(algorithm: Algorithm, rule: &Rule) -> Self {
        let period_ms = rule.period_ms().max(1);
        let limit = rule.limit();
        if rule.is_duplicate_guard() {
            // Exact whatever the policy's algorithm: a double click is never let through.
            return Tally::Log(SlidingLog::new(limit, period_ms));
        }
        match algorithm {
            Algorithm::FixedWindow => Tally::Window(FixedWindow::new(limit, period_ms)),
            Algorithm::SlidingLog => Tally::Log(SlidingLog::new(limit, period_ms)),
            Algorithm::SlidingCounter => Tally::Weighted(SlidingCounter::new(limit, period_ms)),
            Algorithm::TokenBucket => {
                Tally::Bucket(TokenBucket::new(limit, period_ms, rule.burst_size()))
            }
        }
    }

    /// Whether it is the layout `new` makes for `rule` under `algorithm` (a token bucket of any
    /// burst: a new burst keeps the count, see `fit_burst`).
    fn is_of(&self, algorithm: Algorithm, rule: &Rule) -> bool {
        if rule.is_duplicate_guard() {
            return matches!(self, Tally::Log(_));
        }
        matches!(
            (self, algorithm),
            (Tally::Window(_), Algorithm::FixedWindow)
                | (Tally::Log(_), Algorithm::SlidingLog)
                | (Tally::Weighted(_), Algorithm::SlidingCounter)
                | (Tally::Bucket(_), Algorithm::TokenBucket)
        )
    }
}

impl Counter {
    /// Takes `rule`'s burst, if this is a token bucket of another: its state (when the bucket
    /// is full again) means the same whatever the burst, as the Redis store's key says too.
    pub(super) fn fit_burst(&mut self, rule: &Rule) {
        if rule.is_duplicate_guard() {
            return;
        }
        // A counter shared by a run-time override's rule counts by the limit of the rule
        // checking it.
        match &mut self.tally {
            Tally::Window(window) => window.fit_limit(rule.limit()),
            Tally::Log(log) => log.fit_limit(rule.limit()),
            Tally::Weighted(weighted) => weighted.fit_limit(rule.limit()),
            Tally::Bucket(bucket) => {
                bucket.fit_limit(rule.limit());
                bucket.fit_burst(rule.burst_size());
            }
        }
    }

    pub(super) fn period_ms(&self) -> u64 {
        self.period_ms
    }

    /// Drops what no longer counts at `now`: a past window, or admissions older than the period.
    pub(super) fn forget_before(&mut self, now: u64) {
        match &mut self.tally {
            Tally::Window(window) => window.forget_before(now),
            Tally::Weighted(weighted) => weighted.forget_before(now),
            Tally::Log(log) => log.forget_before(now),
            // The bucket's one timestamp says it all.
            Tally::Bucket(_) => {}
        }
    }

    /// Whether a request of `cost` is admitted at `now`.
    pub(super) fn fits(&self, now: u64, cost: u64) -> bool {
        match &self.tally {
            Tally::Window(window) => window.fits(cost),
            Tally::Log(log) => log.fits(cost),
            Tally::Weighted(weighted) => weighted.fits(now, cost),
            Tally::Bucket(bucket) => bucket.fits(now, cost),
        }
    }

    /// Units available at `now`.
    pub(super) fn remaining(&self, now: u64) -> u64 {
        match &self.tally {
            Tally::Window(window) => window.remaining(),
            Tally::Log(log) => log.remaining(),
            Tally::Weighted(weighted) => weighted.remaining(now),
            Tally::Bucket(bucket) => bucket.remaining(now),
        }
    }

    /// Records a request of `cost` admitted at `at` (now, or later for a reservation).
    pub(super) fn record(&mut self, at: u64, cost: u64) {
        match &mut self.tally {
            Tally::Window(window) => window.record(cost),
            Tally::Weighted(weighted) => weighted.record(cost),
            Tally::Log(log) => log.record(at, cost),
            Tally::Bucket(bucket) => bucket.record(at, cost),
        }
    }

    /// Gives back up to `cost` units charged in the current window (after `forget_before(now)`).
    pub(super) fn refund(&mut self, now: u64, cost: u64) {
        match &mut self.tally {
            Tally::Window(window) => window.refund(cost),
            Tally::Weighted(weighted) => weighted.refund(cost),
            Tally::Log(log) => log.refund(cost),
            Tally::Bucket(bucket) => bucket.refund(now, cost),
        }
    }

    /// Gives back up to `cost` units of the charge `charged` to where it was charged (after
    /// `forget_before(now)`): see [`Store::give_back`](crate::Store::give_back).
    pub(super) fn give_back(&mut self, now: u64, cost: u64, charged: ChargedAt) {
        match &mut self.tally {
            Tally::Window(window) => window.give_back(cost, charged.checked_ms),
            Tally::Weighted(weighted) => weighted.give_back(cost, charged.checked_ms),
            Tally::Log(log) => log.give_back(cost, charged.admitted_ms),
            // A bucket whose full time the store didn't say gets nothing (on the safe side).
            Tally::Bucket(bucket) => {
                if let Some(full_at_us) = charged.bucket_full_at_us {
                    bucket.give_back(now, cost, full_at_us);
                }
            }
        }
    }

    /// A token bucket's full time at `now` (µs), what a give-back of its last charge reads;
    /// `None` for the other algorithms.
    pub(super) fn bucket_full_at_us(&self, now: u64) -> Option<u64> {
        match &self.tally {
            Tally::Bucket(bucket) => Some(bucket.full_at_us(now)),
            _ => None,
        }
    }

    /// Milliseconds until a request of `cost` fits (it doesn't fit now), assuming nothing else is
    /// admitted meanwhile; `None` when it never fits. `past_burst`: a claim's peek of the units
    /// ahead and its own (`claims.rs`), which a token bucket answers past its burst with when they
    /// will have gone one after another.
    pub(super) fn admits_after(&self, now: u64, cost: u64, past_burst: bool) -> Option<u64> {
        match &self.tally {
            Tally::Window(window) => window.admits_after(now, cost),
            Tally::Log(log) => log.admits_after(now, cost),
            Tally::Weighted(weighted) => weighted.admits_after(now, cost),
            Tally::Bucket(bucket) => bucket.admits_after(now, cost, past_burst),
        }
    }

    /// Milliseconds until some quota frees up (0 when nothing is used).
    pub(super) fn frees_after(&self, now: u64) -> u64 {
        match &self.tally {
            Tally::Window(window) => window.frees_after(now),
            Tally::Log(log) => log.frees_after(now),
            Tally::Weighted(weighted) => weighted.frees_after(now),
            Tally::Bucket(bucket) => bucket.frees_after(now),
        }
    }

    /// When this counter holds nothing any more.
    pub(super) fn expires_at(&self) -> u64 {
        match &self.tally {
            Tally::Window(window) => window.expires_at(),
            Tally::Log(log) => log.expires_at(),
            Tally::Weighted(weighted) => weighted.expires_at(),
            Tally::Bucket(bucket) => bucket.expires_at(),
        }
    }
}
