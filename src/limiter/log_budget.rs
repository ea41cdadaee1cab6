//! [`LogBudget`]: at most so many log lines a second for one kind of event, the rest counted and
//! reported by the next line, so that a flood of events (refusals, a store outage) is not a flood
//! of log lines.
//!
//! It is consulted once per event, on the request path: an atomic load and compare when over
//! budget, a compare-and-swap when a line is written; no lock, no allocation.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

/// Bits of the state that count the lines of the current second; the rest is the second.
const LINE_BITS: u32 = 20;
const LINE_MASK: u64 = (1 << LINE_BITS) - 1;

/// The log budget of one kind of event: the first lines of each second, up to `lines_per_second`.
pub(crate) struct LogBudget {
    lines_per_second: u64,
    /// The second (since `epoch`) counted in, shifted by [`LINE_BITS`], and the lines written in
    /// it: one word, so that a new second and its first line are one atomic step and a flood
    /// from many threads never writes more than the budget.
    state: AtomicU64,
    /// Events not logged since the last line.
    unlogged: AtomicU64,
    epoch: Instant,
}

impl LogBudget {
    /// A budget of `lines_per_second` lines (at least 1, at most about a million).
    pub(crate) fn new(lines_per_second: u64) -> Self {
        LogBudget {
            lines_per_second: lines_per_second.clamp(1, LINE_MASK),
            state: AtomicU64::new(0),
            unlogged: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Whether an event may be logged now; if not, it is counted for the next line.
    pub(crate) fn may_log(&self) -> bool {
        self.may_log_at(Instant::now())
    }

    /// [`LogBudget::may_log`] at `now` (a clock read the caller shares).
    pub(crate) fn may_log_at(&self, now: Instant) -> bool {
        // Second 0's count starts at 0 like any other's: the state starts as second 0, no line.
        let second = now.saturating_duration_since(self.epoch).as_secs();
        let per_second = self.lines_per_second;
        let granted = self
            .state
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |state| {
                let (at, lines) = (state >> LINE_BITS, state & LINE_MASK);
                // A thread that read the clock a little earlier than another counts in the
                // other's (later) second rather than starting an old one again.
                if at < second {
                    Some((second << LINE_BITS) | 1)
                } else if lines < per_second {
                    Some(state + 1)
                } else {
                    None
                }
            })
            .is_ok();
        if !granted {
            self.count_unlogged();
        }
        granted
    }

    /// An event that is not logged (over the budget, or answered without a line).
    pub(crate) fn count_unlogged(&self) {
        self.unlogged.fetch_add(1, Ordering::Relaxed);
    }

    /// The events not logged since the last line; starts the count over.
    pub(crate) fn take_unlogged(&self) -> u64 {
        self.unlogged.swap(0, Ordering::Relaxed)
    }

    /// [`LogBudget::may_log`] and, when it may, [`LogBudget::take_unlogged`]: the count for the
    /// line about to be written.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.may_log().then(|| self.take_unlogged())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_first_lines_of_each_second_are_written_and_the_next_line_counts_the_rest() {
        let budget = LogBudget::new(3);
        let lines: Vec<Option<u64>> = (0..10).map(|_| budget.admit()).collect();
        assert_eq!(
            lines,
            [
                Some(0),
                Some(0),
                Some(0),
                None,
                None,
                None,
                None,
                None,
                None,
                None
            ]
        );
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(budget.admit(), None);
        // A new second: its first line reports the 8 not logged.
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(budget.admit(), Some(8));
        assert_eq!(budget.admit(), Some(0));
        // Quiet seconds in between change nothing.
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(budget.admit(), Some(0));
    }

    #[test]
    fn threads_racing_never_write_more_than_the_budget() {
        let started = std::time::Instant::now();
        let budget = Arc::new(LogBudget::new(16));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let budget = budget.clone();
                std::thread::spawn(move || (0..10_000).filter(|_| budget.may_log()).count())
            })
            .collect();
        let written: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        // Each second the threads ran in (usually one) allows 16 lines, the first second's at once.
        let seconds = usize::try_from(started.elapsed().as_secs()).unwrap() + 1;
        assert!(
            (16..=16 * seconds).contains(&written),
            "{written} in {seconds} s"
        );
        let unlogged = usize::try_from(budget.take_unlogged()).unwrap();
        assert_eq!(written + unlogged, 40_000);
    }
}
