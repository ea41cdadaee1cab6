//! Judging a request by the store's answer: the verdict, what it is counted and logged as, and
//! what an admission holds (headers, slot, charge).

use super::prepare::{Found, Overridden};
use super::{Admission, Ask, Charged, Limiter, Refusal, Told, Verdict};
use crate::limiter::refusals::Asking;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::decision::{AppliedOverride, Decision, RuleState};
use crate::limiter::slots::Lease;
use crate::limiter::telemetry::Outcome;
use crate::policy::StateOf;
use crate::policy::quota::QuotaLookup;
use crate::policy::{Mode, OnStoreError, StorageKey, StoredOverride, Whom};
use crate::response::{LimitHeaders, TooManyRequests};
use crate::store::StoreError;

impl Limiter {
    /// What to do with a request, given the store's answer.
    /// An admission takes `ask`'s key and quota along (into its charge): the request is
    /// resolved.
    pub(super) fn judge(
        self: &Arc<Self>,
        result: Result<Decision, StoreError>,
        ask: &mut Ask,
    ) -> Verdict {
        self.judge_after(result, ask, self.policy.mode().max_delay(), Duration::ZERO)
    }

    /// [`Limiter::judge`] for a request that has `waited` for a slot and may wait `budget` more.
    pub(super) fn judge_after(
        self: &Arc<Self>,
        result: Result<Decision, StoreError>,
        ask: &mut Ask,
        budget: Duration,
        waited: Duration,
    ) -> Verdict {
        // The refusal log and the alerts below belong to the check's span (when it is on: a
        // span a subscriber doesn't want still costs its field lookups to record into).
        let span = (!ask.span.is_disabled()).then(|| ask.span.clone());
        let _entered = span.as_ref().map(tracing::Span::enter);
        let mut result = result;
        if let Ok(decision) = &mut result
            && let Some(applied) = decision.run_time_override.take()
        {
            return self.judged_by_override(applied, result, ask, waited);
        }
        let result = self.whole(result, ask.quota.is_some());
        self.count_store_call(result.as_ref().map(|_| ()), ask.started, &ask.span);
        // A take of units ahead: in hand if admitted; if not, ask for the cost alone. The charge
        // of an admission is answered by its decision, or the take's.
        let (result, charged) = if ask.extra == 0 {
            (result, Charged::Own)
        } else {
            match super::prefetch::judge_take(self, result, ask) {
                Some((result, Some((taken, after)))) => (result, Charged::Taken(taken, after)),
                Some((result, None)) => (result, Charged::Own),
                None => return Verdict::Retake,
            }
        };
        let decision = match result {
            Ok(decision) => decision,
            Err(error) => return self.store_failed(&error, ask),
        };
        self.alert_quota(&decision, ask.quota.as_ref());
        self.watch_saturation(&decision);
        if decision.allowed {
            return self.admitted(decision, ask, charged, waited);
        }
        if !budget.is_zero() && self.only_slot_missing(&decision, budget) {
            return Verdict::AwaitSlot;
        }
        if self.policy.mode() == Mode::Shadow {
            return self.shadow_pass(decision, ask);
        }
        self.refused(decision, ask)
    }

    /// What to do with a request the store checked by the identity's override set at run time
    /// (`applied`; the Redis store applies them in the check's call): answered as the override
    /// says, its rules' decision judged by the limiter of those rules (whose headers and
    /// give-backs are theirs).
    fn judged_by_override(
        self: &Arc<Self>,
        applied: AppliedOverride,
        result: Result<Decision, StoreError>,
        ask: &mut Ask,
        waited: Duration,
    ) -> Verdict {
        let Some(action) = applied.action() else {
            let error = StoreError::Protocol("an unreadable run-time override".to_owned());
            return self.store_failed(&error, ask);
        };
        let found = Found::RunTime(Arc::new(StoredOverride {
            whom: Whom::Identity(ask.key.identity().to_owned()),
            action,
            // (Its counters, as the store named them when it charged them.)
            counted_as: applied.counted_as().map(Into::into),
        }));
        match self.overridden(found, &ask.key) {
            Overridden::Unlimited => {
                self.count_store_call(Ok(()), ask.started, &ask.span);
                Verdict::Admit(Admission::let_through(self))
            }
            Overridden::Denied => {
                self.count_store_call(Ok(()), ask.started, &ask.span);
                Verdict::Respond(Refusal::Denied, ask.protocol.clone())
            }
            // (A limiter of its own waits for no slot: its wait would be this one's.)
            Overridden::By(own) => match own.judge_after(result, ask, Duration::ZERO, waited) {
                Verdict::Respond(refusal, protocol) => Verdict::RespondBy(own, refusal, protocol),
                verdict => verdict,
            },
            Overridden::No => {
                let error = StoreError::Protocol(
                    "a run-time override with rules this policy can't take".to_owned(),
                );
                self.store_failed(&error, ask)
            }
        }
    }

    /// Counts the store's answer to a check asked at `started` (a remote store's; `None` for an
    /// in-process one, whose microsecond the span's and the metric's units round to nothing, so
    /// it is not timed) as a store call, its latency recorded on the check's `span`.
    pub(super) fn count_store_call(
        &self,
        result: Result<(), &StoreError>,
        started: Option<Instant>,
        span: &tracing::Span,
    ) {
        let took = started.map_or(Duration::ZERO, |started| started.elapsed());
        self.metrics().store_call(took, result);
        if !span.is_disabled() {
            span.record("store_latency_us", took.as_micros() as u64);
        }
    }

    /// The store's answer, if it answered for every rule (and the quota and the slot): anything
    /// else is a broken store, not a decision.
    fn whole(
        &self,
        result: Result<Decision, StoreError>,
        with_quota: bool,
    ) -> Result<Decision, StoreError> {
        let expected =
            self.policy.rules().len() + usize::from(with_quota) + self.policy.states_after_quota();
        result.and_then(|decision| {
            if decision.rules.len() == expected {
                Ok(decision)
            } else {
                Err(StoreError::Protocol(format!(
                    "{} rule states for a policy of {} rules",
                    decision.rules.len(),
                    expected
                )))
            }
        })
    }

    /// Sends the quota alerts the store says are due for the day's quota `lookup` (a check's, or
    /// a settle's that took the quota past a threshold).
    pub(super) fn alert_quota(&self, decision: &Decision, lookup: Option<&QuotaLookup>) {
        // The quota's state comes after the rules' (and before a concurrency limit's).
        let quota_state = decision.rules.get(self.policy.rules().len());
        if !decision.quota_alerts.is_empty()
            && let (Some(quota), Some(lookup), Some(state)) =
                (self.policy.quota(), lookup, quota_state)
        {
            quota.alert(
                lookup,
                &decision.quota_alerts,
                state.remaining,
                decision.now_unix_ms,
                crate::limiter::telemetry::quota_alert,
            );
        }
    }

    /// An admission (after `waited` for a slot): its headers, its slot's lease and its charge,
    /// now or after the delay the store reserved.
    fn admitted(
        self: &Arc<Self>,
        decision: Decision,
        ask: &mut Ask,
        charged: Charged,
        waited: Duration,
    ) -> Verdict {
        self.count_admission(&decision, ask.asking(), &ask.span, waited);
        let headers = self.limit_headers(&decision);
        let waiting = self.may_wait_for_slots().then(|| self.slot_queues.clone());
        let lease = decision.lease.map(|id| {
            let (store, policy) = (self.store.clone(), self.policy.clone());
            let errors = self.store_errors.clone();
            Box::new(Lease::new(
                store,
                policy,
                ask.key.clone(),
                id,
                waiting,
                errors,
            ))
        });
        // Given back by the caller (a handle's), under count_only if the response doesn't count,
        // or settled by a meter (a shadow pass or a store failure charged nothing); made only
        // for them.
        let delay = decision.delay;
        let admission = Admission {
            headers: Some(headers),
            lease,
            // The charge holds the decision, when one is made.
            told: if ask.receipt {
                Told::Charge(ask.take_charge(self.clone(), decision, charged))
            } else {
                Told::Decision(decision)
            },
            uncounted: false,
        };
        if delay.is_zero() {
            Verdict::Admit(admission)
        } else {
            Verdict::Delay(delay, admission)
        }
    }

    /// Counts an admission of `asking` by `decision` (after it `waited` for a slot), and says so
    /// on the check's `span`. A refusal cached for it is forgotten: the admission (of another
    /// cost) used quota, so a refusal cached before it may now have to wait longer.
    pub(super) fn count_admission(
        &self,
        decision: &Decision,
        asking: Asking<'_>,
        span: &tracing::Span,
        waited: Duration,
    ) {
        let metrics = self.metrics();
        self.refusals.forget(asking);
        metrics.admitted(decision);
        if self.policy.metering().is_some() {
            metrics.metered("reserved", asking.units);
        }
        let delayed = decision.delay + waited;
        if delayed.is_zero() {
            metrics.request(self.outcome(span, Outcome::Allowed));
        } else {
            metrics.request(self.outcome(span, Outcome::Delayed));
            metrics.delay(delayed);
        }
    }

    /// The rate-limit headers of `decision`.
    pub(super) fn limit_headers(&self, decision: &Decision) -> LimitHeaders {
        LimitHeaders::new(&self.answers, &self.policy, decision, self.legacy_headers)
    }

    /// A refusal in shadow mode: let through, with the headers, counted and logged as what it
    /// would have been.
    fn shadow_pass(&self, decision: Decision, ask: &Ask) -> Verdict {
        self.shadow_refusals.fetch_add(1, Ordering::Relaxed);
        let outcome = self.outcome(&ask.span, Outcome::ShadowRefused);
        self.count_refusal(outcome, &ask.key, self.refused_states(&decision));
        let headers = self.limit_headers(&decision);
        let rejected =
            TooManyRequests::new(self.policy.clone(), decision.clone(), self.answers.clone());
        self.log_rejection(
            &rejected,
            &ask.key,
            "request would be rate limited (shadow mode)",
        );
        Verdict::Admit(Admission {
            headers: Some(headers),
            told: Told::Decision(decision),
            ..Admission::let_through(self)
        })
    }

    /// A refusal: cached (when a cached answer would be right), counted, logged within the
    /// log's budget, answered.
    fn refused(&self, decision: Decision, ask: &Ask) -> Verdict {
        // A penalty block's refusals are not cached: the property test shows the store's later
        // answers under a block may wait longer than a cached one would say. Nor are refusals for
        // want of a concurrency slot: one frees when a request ends, long before the lease's
        // expiry that a cached refusal would wait for.
        let states = decision.rules.len();
        let slot_refused = self
            .policy
            .concurrency_state(states)
            .and_then(|slot| decision.rules.get(slot))
            .is_some_and(RuleState::refused);
        // Nor a refusal by a budget shared fairly or the share of it: a share grows when others
        // leave, the budget when any tenant gives back, and a refused request counts there, in
        // what its tenant asked (the shares of the next window are set by it).
        let fair_refused = self.policy.fair_share().is_some()
            && decision.rules.iter().rev().take(2).any(RuleState::refused);
        if self.policy.block_for().is_none() && !slot_refused && !fair_refused {
            let max_delay = self.policy.mode().max_delay();
            self.refusals.remember(ask.asking(), &decision, max_delay);
        }
        let outcome = self.outcome(&ask.span, Outcome::Refused);
        let now = self.count_refusal(outcome, &ask.key, self.refused_states(&decision));
        if self.refusals.may_log(now) {
            let rejected =
                TooManyRequests::new(self.policy.clone(), decision.clone(), self.answers.clone());
            self.log_rejection(&rejected, &ask.key, "request rate limited");
        }
        Verdict::Respond(Refusal::Limited(decision), ask.protocol.clone())
    }

    /// A store failure, answered as the policy says: let through unchecked, or refused with 503.
    fn store_failed(&self, error: &StoreError, ask: &Ask) -> Verdict {
        let doing = ("letting the request through", "refusing the request");
        if self.store_failure_lets_through(error, doing) {
            self.metrics()
                .request(self.outcome(&ask.span, Outcome::StoreErrorAllowed));
            Verdict::Admit(Admission::let_through(self))
        } else {
            self.metrics()
                .request(self.outcome(&ask.span, Outcome::StoreErrorDenied));
            Verdict::Respond(Refusal::StoreUnavailable, ask.protocol.clone())
        }
    }

    /// Whether the policy lets a request through when the store fails (`OnStoreError`); the
    /// failure is logged within its budget as what the door does, `doing.0` when it lets it
    /// through, `doing.1` when not. Every door's answer to a store failure.
    pub(super) fn store_failure_lets_through(
        &self,
        error: &StoreError,
        doing: (&str, &str),
    ) -> bool {
        let (lets_through, what) = match self.policy.on_store_error() {
            OnStoreError::Allow => (true, doing.0),
            OnStoreError::Deny => (false, doing.1),
        };
        self.store_errors.log(self.policy.name(), error, what);
        lets_through
    }

    /// `outcome`, recorded on the check's `span` too.
    fn outcome(&self, span: &tracing::Span, outcome: Outcome) -> Outcome {
        if !span.is_disabled() {
            span.record("outcome", outcome.label());
        }
        outcome
    }
}

/// What a refusal is counted and logged as, and whether one for want of a slot may wait for it.
impl Limiter {
    /// Counts a refusal (or, in shadow mode, what would have been one) of `key` by `rules`; the
    /// time it read, for the caller to share.
    pub(super) fn count_refusal(
        &self,
        outcome: Outcome,
        key: &StorageKey,
        refused: impl Iterator<Item = StateOf>,
    ) -> tokio::time::Instant {
        let metrics = self.metrics();
        metrics.request(outcome);
        metrics.rule_refusals(refused);
        let now = tokio::time::Instant::now();
        self.top_refused.record(key.kind(), key.identity(), now);
        now
    }

    /// Under a budget shared fairly: notes whether `decision` saw it saturated (its share, the
    /// last state, less than the budget), counting each window once the next one comes.
    fn watch_saturation(&self, decision: &Decision) {
        let Some(fairness) = self.policy.fair_share() else {
            return;
        };
        let [.., budget, share] = &decision.rules[..] else {
            return;
        };
        let period = fairness.fair.budget().period_ms().max(1);
        let window = decision.now_unix_ms / period;
        if let Some(saturated) = self.saturation.saw(window, share.limit < budget.limit) {
            self.metrics().fair_window(saturated);
        }
    }

    /// What each state of `decision` that refused it describes.
    pub(super) fn refused_states<'a>(
        &'a self,
        decision: &'a Decision,
    ) -> impl Iterator<Item = StateOf> + 'a {
        let states = decision.rules.len();
        decision
            .violated()
            .map(move |index| self.policy.state_of(index, states))
    }

    /// Logs a refusal at `info`, with the count of refusals not logged since the last line.
    pub(super) fn log_rejection(
        &self,
        rejected: &TooManyRequests,
        key: &StorageKey,
        message: &str,
    ) {
        let rules: Vec<&str> = rejected.violated_rules().collect();
        tracing::info!(
            policy = self.policy.name(),
            rule = %rules.join(", "),
            key_kind = key.kind(),
            key = key.identity(),
            retry_after_s = rejected.retry_after_secs(),
            unlogged_refusals = self.refusals.take_unlogged(),
            "{message}"
        );
    }

    /// Whether a request refused for want of a concurrency slot may wait for one: the policy has a
    /// concurrency limit, in delay mode.
    pub(super) fn may_wait_for_slots(&self) -> bool {
        self.policy.concurrency().is_some() && !self.policy.mode().max_delay().is_zero()
    }

    /// Whether `decision` refused for want of a slot alone: every other state admits, or is a rate
    /// rule that would within `budget` (a reservation, once a slot is free). A refusal by the
    /// quota or the duplicate guard is final however long one waits for a slot.
    pub(super) fn only_slot_missing(&self, decision: &Decision, budget: Duration) -> bool {
        let states = decision.rules.len();
        self.may_wait_for_slots()
            && self
                .policy
                .concurrency_state(states)
                .and_then(|slot| decision.rules.get(slot))
                .is_some_and(RuleState::refused)
            && decision.rules.iter().enumerate().all(|(index, state)| {
                match (self.policy.state_of(index, states), state.retry_after) {
                    (_, None) | (StateOf::Concurrency, _) => true,
                    (StateOf::Rule(rule), Some(retry)) => {
                        !self.policy.rules()[rule].is_duplicate_guard() && retry <= budget
                    }
                    (StateOf::Quota | StateOf::Budget | StateOf::Share, Some(_)) => false,
                }
            })
    }
}
