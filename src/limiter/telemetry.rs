//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (the `metrics` feature): what
//! each request came to, which rules refused, how the store answered.
//!
//! Handles are registered once per layer, at its first request, and kept: recording is then an
//! atomic add in the installed recorder, with no label built or looked up per request. So install
//! the recorder (e.g. `metrics-exporter-prometheus`) before the app serves; without one, every
//! handle is a no-op. Labels are policy, rule, quota and store names, bounded by the
//! configuration; identities never become labels.

use std::time::Duration;

use crate::decision::Decision;
use crate::policy::{Policy, StateOf};
use crate::store::StoreError;

/// What became of a request (`ratelimit_requests_total`'s `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Admitted at once.
    Allowed,
    /// Refused by the store.
    Refused,
    /// Would have been refused; shadow mode let it through.
    ShadowRefused,
    /// Admitted after a wait (delay mode).
    Delayed,
    /// Refused at once: no rule (or quota) could ever admit its cost.
    TooCostly,
    /// The policy's key was missing (let through or refused, as the policy says).
    NoKey,
    /// The store failed and the policy lets requests through.
    StoreErrorAllowed,
    /// The store failed and the policy refuses requests.
    StoreErrorDenied,
    /// Refused from the layer's cache of refusals, without a store call.
    CachedRefusal,
    /// Let through uncounted by an `unlimited` override (an allow list).
    OverrideUnlimited,
    /// Refused with 403 by a `deny` override (a deny list).
    OverrideDenied,
}

impl Outcome {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const ALL: [Outcome; 11] = [
        Outcome::Allowed,
        Outcome::Refused,
        Outcome::ShadowRefused,
        Outcome::Delayed,
        Outcome::TooCostly,
        Outcome::NoKey,
        Outcome::StoreErrorAllowed,
        Outcome::StoreErrorDenied,
        Outcome::CachedRefusal,
        Outcome::OverrideUnlimited,
        Outcome::OverrideDenied,
    ];

    /// The label value.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Refused => "refused",
            Outcome::ShadowRefused => "shadow_refused",
            Outcome::Delayed => "delayed",
            Outcome::TooCostly => "too_costly",
            Outcome::NoKey => "no_key",
            Outcome::StoreErrorAllowed => "store_error_allowed",
            Outcome::StoreErrorDenied => "store_error_denied",
            Outcome::CachedRefusal => "cached_refusal",
            Outcome::OverrideUnlimited => "override_unlimited",
            Outcome::OverrideDenied => "override_denied",
        }
    }
}

/// `ratelimit_store_duration_seconds`'s `outcome` labels, indexed by [`store_outcome`].
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
const STORE_OUTCOMES: [&str; 3] = ["ok", "error", "timeout"];

/// The latest window of a budget shared fairly that a decision saw, and whether one saw it
/// saturated: counted (`ratelimit_fair_windows_total`) when a later window's first decision
/// comes.
#[derive(Debug, Default)]
pub(crate) struct SaturationWatch {
    window: std::sync::atomic::AtomicU64,
    saturated: std::sync::atomic::AtomicBool,
}

impl SaturationWatch {
    /// Notes a decision in `window` that saw the budget `saturated`; the window before's
    /// saturation when this is the first decision seen of a later window (none before the
    /// first).
    pub(crate) fn saw(&self, window: u64, saturated: bool) -> Option<bool> {
        use std::sync::atomic::Ordering::{AcqRel, Acquire, Release};
        let last = self.window.load(Acquire);
        if window > last
            && self
                .window
                .compare_exchange(last, window, AcqRel, Acquire)
                .is_ok()
        {
            let before = self.saturated.swap(saturated, AcqRel);
            return (last != 0).then_some(before);
        }
        if saturated && window == self.window.load(Acquire) {
            self.saturated.store(true, Release);
        }
        None
    }
}

/// How a store call ended, as an index into [`STORE_OUTCOMES`].
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
fn store_outcome(result: Result<(), &StoreError>) -> usize {
    match result {
        Ok(()) => 0,
        Err(StoreError::Timeout(_)) => 2,
        Err(_) => 1,
    }
}

/// Below this share of a rule's limit left, an admission is "near the limit".
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
const NEAR_LIMIT_PERCENT: u64 = 10;

/// Whether an admission that left `remaining` of `limit` is near the limit (under 10 % left).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) fn near_limit(remaining: u64, limit: u64) -> bool {
    u128::from(remaining) * 100 < u128::from(limit) * u128::from(NEAR_LIMIT_PERCENT)
}

/// What becomes of metered units (`ratelimit_metered_units_total`'s `event`): reserved at an
/// admission, used as reported, given back (reserved and not used), and charged past the
/// reservation (`overdrawn`: used beyond it, past the limit if need be).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
const METERED_EVENTS: [&str; 4] = ["reserved", "used", "given_back", "overdrawn"];

/// What becomes of units taken ahead (`ratelimit_prefetch_units_total`'s `event`).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
const PREFETCH_EVENTS: [&str; 3] = ["taken", "spent", "expired"];

#[cfg(feature = "metrics")]
mod handles {
    use metrics::{Counter, Histogram, counter, histogram};

    use super::*;

    /// One layer's metric handles, registered at its first request.
    #[derive(Clone)]
    pub(crate) struct PolicyMetrics {
        requests: [Counter; Outcome::ALL.len()],
        /// Per rule in policy order, then the daily quota's, the budget's and the share's, as
        /// the policy has them.
        rule_refusals: Vec<Counter>,
        /// How many rules the policy has, and whether a quota: where the others' counters are.
        rules: usize,
        has_quota: bool,
        /// Under a budget shared fairly: the windows a request saw, not saturated and saturated.
        fair_windows: Option<[Counter; 2]>,
        near_limit: Vec<Counter>,
        delay: Histogram,
        store_durations: [Histogram; 3],
        store: &'static str,
        /// Under a policy that prefetches: units taken ahead, spent from hand, and dropped
        /// unused.
        prefetch_units: Option<[Counter; 3]>,
        /// Under a meter: its units reserved, used, given back and overdrawn.
        metered_units: Option<[Counter; 4]>,
        /// Requests an override set at run time applied to.
        overrides_applied: Counter,
    }

    impl PolicyMetrics {
        pub(crate) fn new(policy: &Policy, store: &'static str) -> Self {
            let name = policy.name().to_owned();
            let requests = Outcome::ALL.map(|outcome| {
                counter!("ratelimit_requests_total", "policy" => name.clone(), "outcome" => outcome.label())
            });
            let rules: Vec<String> = policy
                .rule_names()
                .iter()
                .map(|rule| rule.to_string())
                .chain(policy.quota().map(|quota| quota.name().to_owned()))
                .chain(policy.fair_share().into_iter().flat_map(|fairness| {
                    [
                        fairness.budget_name.to_string(),
                        fairness.share_name.to_string(),
                    ]
                }))
                .collect();
            let per_rule = |metric: &'static str| -> Vec<Counter> {
                rules
                    .iter()
                    .map(|rule| counter!(metric, "policy" => name.clone(), "rule" => rule.clone()))
                    .collect()
            };
            PolicyMetrics {
                requests,
                rule_refusals: per_rule("ratelimit_rule_refusals_total"),
                rules: policy.rules().len(),
                has_quota: policy.quota().is_some(),
                fair_windows: policy.fair_share().map(|_| {
                    ["false", "true"].map(|saturated| {
                        counter!(
                            "ratelimit_fair_windows_total",
                            "policy" => name.clone(),
                            "saturated" => saturated
                        )
                    })
                }),
                overrides_applied: counter!("ratelimit_overrides_applied_total", "policy" => name.clone()),
                near_limit: per_rule("ratelimit_near_limit_total"),
                delay: histogram!("ratelimit_delay_seconds", "policy" => name.clone()),
                store_durations: STORE_OUTCOMES.map(|outcome| {
                    histogram!("ratelimit_store_duration_seconds", "store" => store, "outcome" => outcome)
                }),
                store,
                prefetch_units: policy.prefetch().map(|_| {
                    PREFETCH_EVENTS.map(|event| {
                        counter!("ratelimit_prefetch_units_total", "policy" => name.clone(), "event" => event)
                    })
                }),
                metered_units: policy.meter().map(|meter| {
                    let unit = meter.unit().to_owned();
                    METERED_EVENTS.map(|event| {
                        counter!(
                            "ratelimit_metered_units_total",
                            "policy" => name.clone(),
                            "unit" => unit.clone(),
                            "event" => event
                        )
                    })
                }),
            }
        }

        /// Counts `units` taken ahead (`taken`), spent from hand (`spent`) or dropped unused
        /// (`expired`).
        pub(crate) fn prefetch(&self, event: &'static str, units: u64) {
            if let Some(counters) = &self.prefetch_units
                && let Some(index) = PREFETCH_EVENTS.iter().position(|known| *known == event)
            {
                counters[index].increment(units);
            }
        }

        /// Counts `units` metered units `reserved`, `used`, `given_back` or `overdrawn`.
        pub(crate) fn metered(&self, event: &'static str, units: u64) {
            if let Some(counters) = &self.metered_units
                && let Some(index) = METERED_EVENTS.iter().position(|known| *known == event)
            {
                counters[index].increment(units);
            }
        }

        pub(crate) fn request(&self, outcome: Outcome) {
            self.requests[outcome as usize].increment(1);
        }

        /// Counts a request an override set at run time applied to.
        pub(crate) fn override_applied(&self) {
            self.overrides_applied.increment(1);
        }

        /// Counts a refusal against each state that refused: a rule, the quota, the budget
        /// shared fairly or the identity's share of it (not the concurrency limit).
        pub(crate) fn rule_refusals(&self, refused: impl Iterator<Item = StateOf>) {
            let quota = usize::from(self.has_quota);
            for state in refused {
                let at = match state {
                    StateOf::Rule(rule) => rule,
                    StateOf::Quota => self.rules,
                    StateOf::Budget => self.rules + quota,
                    StateOf::Share => self.rules + quota + 1,
                    StateOf::Concurrency => continue,
                };
                if let Some(counter) = self.rule_refusals.get(at) {
                    counter.increment(1);
                }
            }
        }

        /// Counts a window of the budget shared fairly that requests saw, once it has ended,
        /// and whether one saw it saturated.
        pub(crate) fn fair_window(&self, saturated: bool) {
            if let Some(counters) = &self.fair_windows {
                counters[usize::from(saturated)].increment(1);
            }
        }

        /// Counts, for an admission, each rule it left with less than 10 % of its limit.
        pub(crate) fn admitted(&self, decision: &Decision) {
            for (state, counter) in decision.rules.iter().zip(&self.near_limit) {
                if near_limit(state.remaining, state.limit) {
                    counter.increment(1);
                }
            }
        }

        pub(crate) fn delay(&self, delay: Duration) {
            self.delay.record(delay.as_secs_f64());
        }

        /// Records how long a store call took and, for a failure, what kind it was.
        pub(crate) fn store_call(&self, took: Duration, result: Result<(), &StoreError>) {
            self.store_durations[store_outcome(result)].record(took.as_secs_f64());
            if let Err(error) = result {
                // Errors are rare: this handle is looked up when one happens.
                counter!("ratelimit_store_errors_total", "store" => self.store, "kind" => error.kind())
                    .increment(1);
            }
        }
    }

    /// Counts what became of a quota alert (`sent`, `failed` or `dropped`).
    pub(crate) fn quota_alert(quota: &str, percent: u8, outcome: &'static str) {
        counter!(
            "ratelimit_quota_alerts_total",
            "quota" => quota.to_owned(),
            "percent" => percent.to_string(),
            "outcome" => outcome
        )
        .increment(1);
    }

    /// Counts a change of the overrides set at run time for `policy` (`set` or `removed`).
    pub(crate) fn override_changed(policy: &str, change: &'static str) {
        counter!(
            "ratelimit_overrides_changed_total",
            "policy" => policy.to_owned(),
            "change" => change
        )
        .increment(1);
    }

    /// Counts a reload of a configuration (`applied` or `refused`).
    #[cfg_attr(not(feature = "config"), allow(dead_code))]
    pub(crate) fn config_reload(outcome: &'static str) {
        counter!("ratelimit_config_reloads_total", "outcome" => outcome).increment(1);
    }
}

#[cfg(not(feature = "metrics"))]
mod handles {
    use super::*;

    /// Without the `metrics` feature: nothing is recorded.
    #[derive(Clone)]
    pub(crate) struct PolicyMetrics;

    impl PolicyMetrics {
        pub(crate) fn new(_policy: &Policy, _store: &'static str) -> Self {
            PolicyMetrics
        }
        pub(crate) fn request(&self, _outcome: Outcome) {}
        pub(crate) fn override_applied(&self) {}
        pub(crate) fn rule_refusals(&self, _refused: impl Iterator<Item = StateOf>) {}
        pub(crate) fn fair_window(&self, _saturated: bool) {}
        pub(crate) fn admitted(&self, _decision: &Decision) {}
        pub(crate) fn delay(&self, _delay: Duration) {}
        pub(crate) fn store_call(&self, _took: Duration, _result: Result<(), &StoreError>) {}
        pub(crate) fn prefetch(&self, _event: &'static str, _units: u64) {}
        pub(crate) fn metered(&self, _event: &'static str, _units: u64) {}
    }

    pub(crate) fn quota_alert(_quota: &str, _percent: u8, _outcome: &'static str) {}
    pub(crate) fn override_changed(_policy: &str, _change: &'static str) {}

    #[cfg_attr(not(feature = "config"), allow(dead_code))]
    pub(crate) fn config_reload(_outcome: &'static str) {}
}

pub(crate) use handles::{PolicyMetrics, quota_alert};
#[cfg_attr(not(feature = "config"), allow(unused_imports))]
pub(crate) use handles::{config_reload, override_changed};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_limit_is_under_a_tenth_left() {
        assert!(near_limit(0, 10));
        assert!(!near_limit(1, 10));
        assert!(near_limit(9, 100));
        assert!(!near_limit(10, 100));
        assert!(near_limit(0, 1));
        assert!(!near_limit(1, 1));
        assert!(near_limit(u64::MAX / 20, u64::MAX));
    }

    #[test]
    fn outcomes_index_their_own_handles() {
        for (index, outcome) in Outcome::ALL.iter().enumerate() {
            assert_eq!(*outcome as usize, index, "{}", outcome.label());
        }
    }
}
