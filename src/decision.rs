//! What a store answers for one request: allowed or not, and the state of every rule.
//!
//! A [`Decision`] is store-neutral (the in-memory store and the Redis store produce the same shape)
//! and HTTP-neutral: the tower layer turns it into headers and, when refused, a 429.

use std::time::Duration;

/// The outcome of checking one request against every rule of a policy.
///
/// `rules` holds one [`RuleState`] per rule, in the policy's rule order, then one for the policy's
/// daily [`Quota`](crate::Quota) when the request had one, then one for its concurrency limit
/// ([`PolicyBuilder::max_in_flight`](crate::PolicyBuilder::max_in_flight)) when it has one:
/// `limit` the slots, `remaining` the free ones, `reset` the time until the earliest lease
/// expires; then, under a budget shared fairly
/// ([`PolicyBuilder::fair_share`](crate::PolicyBuilder::fair_share)), one for the budget and
/// one for the identity's share of it (`limit` its share while the budget is saturated, else
/// the budget's; `reset` the window's end). When `allowed` is `true` the request was recorded
/// in every rule; when it is `false` it was recorded in none (all-or-nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether every rule admitted the request.
    pub allowed: bool,
    /// The state of each rule after the check, in the policy's rule order, then the daily quota's.
    pub rules: Vec<RuleState>,
    /// The store's clock when it decided, in milliseconds since the Unix epoch. For the Redis store
    /// this is Redis `TIME`, so absolute reset times don't depend on the app server's clock.
    pub now_unix_ms: u64,
    /// How long the request must wait before it goes on: zero, except for a request admitted by
    /// reservation ([`Mode::Delay`](crate::Mode::Delay)), which was recorded for this much later.
    pub delay: Duration,
    /// The alert thresholds (percent) of the daily quota that this request reached first, today,
    /// for its key: each fires once per key, threshold and day, however many requests race.
    pub quota_alerts: Vec<u8>,
    /// The lease of the concurrency slot this request took (admitted under a concurrency limit):
    /// the id to give [`Store::release`](crate::Store::release) when it is done.
    pub lease: Option<u64>,
    /// An override set at run time that the store applied in the check itself (the Redis store
    /// reads the identity's override in the check's own call): then `rules` are the override's.
    /// `None` when none applied so; a store that builds decisions of its own sets `None` (the
    /// memory store's overrides are applied by the limiter before it asks).
    pub run_time_override: Option<AppliedOverride>,
}

/// An override set at run time, as a store applied it in a check ([`Decision::run_time_override`]):
/// what the limiter reads to answer as the override says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedOverride(pub(crate) std::sync::Arc<str>);

/// The state of one rule after a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleState {
    /// The rule's limit (quota units per period).
    pub limit: u64,
    /// Units still available right now, after this request if it was admitted.
    pub remaining: u64,
    /// Time until this rule has more quota available than now: the end of the current window for a
    /// fixed window, the expiry of the oldest recorded request for a sliding log. Zero when nothing is
    /// in use.
    pub reset: Duration,
    /// `Some` when this rule refused the request: the time until it would admit it.
    pub retry_after: Option<Duration>,
    /// A token bucket's rule: when its bucket is full again after this check, in microseconds
    /// since the Unix epoch (its theoretical arrival time, the store's `tat`). A give-back of
    /// this admission's units ([`Store::give_back`](crate::Store::give_back)) reads it, so that
    /// only what time has not repaid yet goes back. `None` for the other algorithms, the quota
    /// and the concurrency limit.
    pub bucket_full_at_us: Option<u64>,
}

impl RuleState {
    /// Whether this rule refused the request.
    pub fn refused(&self) -> bool {
        self.retry_after.is_some()
    }
}

impl Decision {
    /// Indexes (in policy rule order) of the rules that refused the request.
    pub fn violated(&self) -> impl Iterator<Item = usize> + '_ {
        self.rules
            .iter()
            .enumerate()
            .filter(|(_, state)| state.refused())
            .map(|(index, _)| index)
    }

    /// The time until every rule that refused the request would admit it: the longest of their
    /// retry times. `None` when the request was allowed.
    pub fn retry_after(&self) -> Option<Duration> {
        self.rules
            .iter()
            .filter_map(|state| state.retry_after)
            .max()
    }

    /// The index of the rule closest to running out: least remaining, and of those the one that
    /// takes longest to reset. `None` for a policy without rules (which can't be built).
    pub fn most_limiting(&self) -> Option<usize> {
        self.most_limiting_among(|_| true)
    }

    /// [`Decision::most_limiting`] among the rules whose index `include` accepts.
    pub(crate) fn most_limiting_among(&self, include: impl Fn(usize) -> bool) -> Option<usize> {
        self.rules
            .iter()
            .enumerate()
            .filter(|(index, _)| include(*index))
            .min_by(|(_, a), (_, b)| {
                a.remaining
                    .cmp(&b.remaining)
                    .then_with(|| b.reset.cmp(&a.reset))
            })
            .map(|(index, _)| index)
    }
}

/// Whole seconds, rounded up: what headers carry. A partial second counts as a whole one, so a client
/// that waits this long is never early.
pub(crate) fn ceil_secs(duration: Duration) -> u64 {
    let secs = duration.as_secs();
    if duration.subsec_nanos() > 0 {
        secs.saturating_add(1)
    } else {
        secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(remaining: u64, reset_ms: u64, retry_ms: Option<u64>) -> RuleState {
        RuleState {
            limit: 10,
            remaining,
            reset: Duration::from_millis(reset_ms),
            retry_after: retry_ms.map(Duration::from_millis),
            bucket_full_at_us: None,
        }
    }

    #[test]
    fn retry_after_is_the_longest_of_the_refusing_rules() {
        let decision = Decision {
            allowed: false,
            rules: vec![
                state(0, 900, Some(900)),
                state(3, 9_000, None),
                state(0, 4_100, Some(4_100)),
            ],
            now_unix_ms: 0,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
            run_time_override: None,
        };
        assert_eq!(decision.retry_after(), Some(Duration::from_millis(4_100)));
        assert_eq!(decision.violated().collect::<Vec<_>>(), vec![0, 2]);
    }

    #[test]
    fn allowed_decision_has_no_retry_after() {
        let decision = Decision {
            allowed: true,
            rules: vec![state(4, 1_000, None)],
            now_unix_ms: 0,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
            run_time_override: None,
        };
        assert_eq!(decision.retry_after(), None);
        assert_eq!(decision.violated().count(), 0);
    }

    #[test]
    fn most_limiting_prefers_least_remaining_then_longest_reset() {
        let decision = Decision {
            allowed: true,
            rules: vec![
                state(5, 1_000, None),
                state(2, 500, None),
                state(2, 7_000, None),
            ],
            now_unix_ms: 0,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
            run_time_override: None,
        };
        assert_eq!(decision.most_limiting(), Some(2));
    }

    #[test]
    fn ceil_secs_rounds_partial_seconds_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1_000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1_001)), 2);
        assert_eq!(ceil_secs(Duration::from_secs(60)), 60);
    }
}
