//! [`StoreErrorLog`]: how a policy logs its store's failures. A failure is per request, so an
//! outage of a busy service would otherwise be a log line per request, a second outage (of the
//! log pipeline, and of the reader's attention). Each kind of failure gets its own
//! [`LogBudget`]: the first of a kind is logged at once, then at most
//! [`LINES_PER_SECOND`] a second, each line with the count of that kind not logged since the
//! last. Outages are logged at `warn`, faults (which someone has to mend) at `error`, in the
//! store's own words.

use std::fmt::Display;

use crate::limiter::log_budget::LogBudget;
use crate::store::StoreError;

/// Lines per second per kind of store failure, at most.
pub(crate) const LINES_PER_SECOND: u64 = 2;

/// The kinds with a budget of their own ([`StoreError::kind`]); a kind not listed shares the
/// budget after them.
const KINDS: [&str; 9] = [
    "unavailable",
    "timeout",
    "not_replicated",
    "protocol",
    "script",
    "wrong_type",
    "out_of_memory",
    "config",
    "unsupported_version",
];

/// The store-failure log of one policy (shared by the clones of its layer).
pub(crate) struct StoreErrorLog {
    /// One budget per kind of [`KINDS`], then the budget of any other kind.
    budgets: [LogBudget; KINDS.len() + 1],
}

impl Default for StoreErrorLog {
    fn default() -> Self {
        StoreErrorLog {
            budgets: std::array::from_fn(|_| LogBudget::new(LINES_PER_SECOND)),
        }
    }
}

impl StoreErrorLog {
    /// Logs `error` of `policy`, and `what` became of the request, unless its kind has used its
    /// lines this second (then it is counted for the kind's next line). `what` is formatted only
    /// for a line written (`format_args!` costs nothing otherwise).
    pub(crate) fn log(&self, policy: &str, error: &StoreError, what: impl Display) {
        let kind = error.kind();
        let budget = KINDS
            .iter()
            .position(|known| *known == kind)
            .unwrap_or(KINDS.len());
        let Some(unlogged) = self.budgets[budget].admit() else {
            return;
        };
        if error.is_fault() {
            tracing::error!(
                policy,
                kind,
                %error,
                unlogged_store_errors = unlogged,
                "rate-limit store fault; {what}"
            );
        } else {
            tracing::warn!(
                policy,
                kind,
                %error,
                unlogged_store_errors = unlogged,
                "rate-limit store failed; {what}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn every_kind_has_a_budget_of_its_own() {
        let errors = [
            StoreError::Unavailable("refused".into()),
            StoreError::Timeout(Duration::from_millis(1)),
            StoreError::NotReplicated {
                wanted: 1,
                acknowledged: 0,
            },
            StoreError::Protocol(String::new()),
            StoreError::Script(String::new()),
            StoreError::WrongType(String::new()),
            StoreError::OutOfMemory(String::new()),
            StoreError::Config(String::new()),
            StoreError::UnsupportedVersion {
                found: "6.0.9".into(),
                minimum: "6.2",
            },
        ];
        let kinds: Vec<&str> = errors.iter().map(StoreError::kind).collect();
        assert_eq!(kinds, KINDS);
        let faults: Vec<bool> = errors.iter().map(StoreError::is_fault).collect();
        assert_eq!(
            faults,
            [false, false, false, true, true, true, true, true, true],
            "{kinds:?}"
        );
    }
}
