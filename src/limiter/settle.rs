//! Settling a request by the store's answer: the verdict, what it is counted and logged as, and
//! what an admission holds (headers, slot, charge).

use super::{Admission, Answer, Charged, Checked, Limiter, Refusal, Verdict};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::decision::{Decision, RuleState};
use crate::limiter::slots::Lease;
use crate::limiter::telemetry::Outcome;
use crate::policy::{Mode, OnStoreError};
use crate::response::{LimitHeaders, TooManyRequests};
use crate::store::StoreError;

impl Limiter {
    /// What to do with a request, given the store's answer.
    /// An admission takes `checked`'s key and quota along (into its charge): the request is
    /// settled.
    pub(super) fn settle(
        self: &Arc<Self>,
        result: Result<Decision, StoreError>,
        checked: &mut Checked,
    ) -> Verdict {
        self.settle_after(
            result,
            checked,
            self.policy.mode().max_delay(),
            Duration::ZERO,
        )
    }

    /// [`Limiter::settle`] for a request that has `waited` for a slot and may wait `budget` more.
    pub(super) fn settle_after(
        self: &Arc<Self>,
        result: Result<Decision, StoreError>,
        checked: &mut Checked,
        budget: Duration,
        waited: Duration,
    ) -> Verdict {
        let took = checked.started.elapsed();
        // The refusal log and the alerts below belong to the check's span.
        let span = checked.span.clone();
        let _entered = span.enter();
        let expected_states = self.policy.rules().len()
            + usize::from(checked.quota.is_some())
            + usize::from(self.policy.concurrency().is_some());
        // A store must answer for every rule; anything else is a broken store, not a decision.
        let result = result.and_then(|decision| {
            if decision.rules.len() == expected_states {
                Ok(decision)
            } else {
                Err(StoreError::Protocol(format!(
                    "{} rule states for a policy of {} rules",
                    decision.rules.len(),
                    expected_states
                )))
            }
        });
        let metrics = self.metrics();
        metrics.store_call(took, result.as_ref().map(|_| ()));
        span.record("store_latency_us", took.as_micros() as u64);
        // A take of units ahead: in hand if admitted; if not, ask for the cost alone. The charge
        // of an admission is answered by its decision, or the take's.
        let (result, charged) = match self.settle_take(result, checked) {
            Some((result, Some((taken, after)))) => (result, Charged::Taken(taken, after)),
            Some((result, None)) => (result, Charged::Told),
            None => return Verdict::Retake,
        };
        let key = &checked.key;
        let outcome = |outcome: Outcome| {
            span.record("outcome", outcome.label());
            outcome
        };
        match result {
            Ok(decision) => {
                if !decision.quota_alerts.is_empty()
                    && let (Some(quota), Some(lookup), Some(state)) = (
                        self.policy.quota(),
                        checked.quota.as_ref(),
                        decision.rules.last(),
                    )
                {
                    quota.alert(
                        lookup,
                        &decision.quota_alerts,
                        state.remaining,
                        decision.now_unix_ms,
                        crate::limiter::telemetry::quota_alert,
                    );
                }
                if decision.allowed {
                    // An admission (of another cost) used quota: a refusal cached before it may
                    // now have to wait longer.
                    self.refusals.forget(checked.asking());
                    metrics.admitted(&decision);
                    let headers = LimitHeaders::new(
                        &self.answers,
                        &self.policy,
                        &decision,
                        self.legacy_headers,
                    );
                    let waiting = self.may_wait_for_slots().then(|| self.slot_queues.clone());
                    let lease = decision.lease.map(|id| {
                        let (store, policy) = (self.store.clone(), self.policy.clone());
                        let errors = self.store_errors.clone();
                        Lease::new(store, policy, key.clone(), id, waiting, errors)
                    });
                    if !(decision.delay + waited).is_zero() {
                        metrics.request(outcome(Outcome::Delayed));
                        metrics.delay(decision.delay + waited);
                    } else {
                        metrics.request(outcome(Outcome::Allowed));
                    }
                    // Given back by the caller (a handle's), or under count_only if the response
                    // doesn't count (a shadow pass or a store failure charged nothing).
                    let charge = Some(checked.take_charge(self.clone(), charged));
                    let admission = Admission {
                        headers: Some(headers),
                        lease,
                        decision: None,
                        charge,
                    };
                    if !decision.delay.is_zero() {
                        let delay = decision.delay;
                        return Verdict::Delay(
                            delay,
                            Admission {
                                decision: Some(decision),
                                ..admission
                            },
                        );
                    }
                    return Verdict::Admit(Admission {
                        decision: Some(decision),
                        ..admission
                    });
                }
                if !budget.is_zero() && self.only_slot_missing(&decision, budget) {
                    return Verdict::AwaitSlot;
                }
                if self.policy.mode() == Mode::Shadow {
                    self.shadow_refusals.fetch_add(1, Ordering::Relaxed);
                    self.count_refusal(outcome(Outcome::ShadowRefused), key, decision.violated());
                    let headers = LimitHeaders::new(
                        &self.answers,
                        &self.policy,
                        &decision,
                        self.legacy_headers,
                    );
                    let rejected = TooManyRequests::new(
                        self.policy.clone(),
                        decision.clone(),
                        self.answers.clone(),
                    );
                    self.log_rejection(
                        &rejected,
                        key,
                        "request would be rate limited (shadow mode)",
                    );
                    return Verdict::Admit(Admission {
                        headers: Some(headers),
                        decision: Some(decision),
                        ..Admission::unchecked()
                    });
                }
                // A penalty block's refusals are not cached: the property test shows the store's
                // later answers under a block may wait longer than a cached one would say. Nor
                // are refusals for want of a concurrency slot: one frees when a request ends,
                // long before the lease's expiry that a cached refusal would wait for.
                let slot_refused = self.policy.concurrency().is_some()
                    && decision.rules.last().is_some_and(RuleState::refused);
                if self.policy.block_for().is_none() && !slot_refused {
                    let max_delay = self.policy.mode().max_delay();
                    self.refusals
                        .remember(checked.asking(), &decision, max_delay);
                }
                self.count_refusal(outcome(Outcome::Refused), key, decision.violated());
                if self.refusals.may_log() {
                    let rejected = TooManyRequests::new(
                        self.policy.clone(),
                        decision.clone(),
                        self.answers.clone(),
                    );
                    self.log_rejection(&rejected, key, "request rate limited");
                }
                Verdict::Respond(Answer::new(Refusal::Limited(decision), &checked.protocol))
            }
            Err(error) => match self.policy.on_store_error() {
                OnStoreError::Allow => {
                    metrics.request(outcome(Outcome::StoreErrorAllowed));
                    self.store_errors.log(
                        self.policy.name(),
                        &error,
                        "letting the request through",
                    );
                    Verdict::Admit(Admission::unchecked())
                }
                OnStoreError::Deny => {
                    metrics.request(outcome(Outcome::StoreErrorDenied));
                    self.store_errors
                        .log(self.policy.name(), &error, "refusing the request");
                    Verdict::Respond(Answer::new(Refusal::StoreUnavailable, &checked.protocol))
                }
            },
        }
    }
}
