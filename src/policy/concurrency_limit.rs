//! The concurrency limit a policy may carry: its numbers and its name. What it does at run time
//! (leases, slot queues) lives in [`crate::concurrency`].

use std::time::Duration;

/// A concurrency limit: at most `max_in_flight` requests of one identity in progress at once, each
/// holding its slot at most `lease`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyLimit {
    max_in_flight: u64,
    lease: Duration,
}

impl ConcurrencyLimit {
    /// At most `max_in_flight` requests in progress at once, each slot held at most `lease`.
    pub fn new(max_in_flight: u64, lease: Duration) -> Self {
        ConcurrencyLimit {
            max_in_flight,
            lease,
        }
    }

    /// How many requests of one identity may be in progress at once.
    pub fn max_in_flight(&self) -> u64 {
        self.max_in_flight
    }

    /// The longest a request holds its slot.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The limit's name in headers and 429 bodies: `<n>-in-flight`.
    pub fn name(&self) -> String {
        format!("{}-in-flight", self.max_in_flight)
    }
}
