//! [`Charge`]: what one admission was charged, and where, so that its units can go back to the
//! windows that were charged and nowhere else: under a `count_only` policy when its response
//! turns out not to count, and by [`Admitted::refund`](crate::Admitted::refund).

use std::sync::Arc;

use http::StatusCode;

use super::caller::Caller;
use super::settling::InFlight;
use super::{Limiter, Price};
use crate::decision::Decision;
use crate::policy::StorageKey;
use crate::policy::quota::QuotaLookup;
use crate::store::gcra::Bucket;
use crate::store::{CheckFuture, StoreError};

/// The units one admitted request was charged, and where: its key, its day's quota, and the
/// store's answer, which the charge owns from the moment the store gives it (the receipt a
/// give-back reads: when it was checked, its delay, a token bucket's full time per rule).
pub(crate) struct Charge {
    limiter: Arc<Limiter>,
    key: StorageKey,
    /// Its cost in requests, and the units it reserved in the metered rules and quota.
    price: Price,
    quota: Option<QuotaLookup>,
    /// The admission's decision, as its caller is told it.
    decision: Decision,
    /// Which answer says where the units went.
    charged: Charged,
    /// Whose share of a budget shared fairly it was charged to, when not its key's identity's
    /// (an outgoing call's caller).
    caller: Option<Caller>,
}

/// Which of the store's answers says where a charge's units went: what a give-back reads.
pub(crate) enum Charged {
    /// None is known (nothing goes back).
    Unknown,
    /// The admission's own decision.
    Own,
    /// A take's of units ahead, shared by the requests it admits (each told its decision as
    /// held), and how many of the take's units come after this charge's: a token bucket's charge
    /// is its slice of the take's time, which ends that many intervals before the take's full
    /// time (so the requests of one take together never give back more than the take charged).
    Taken(Arc<Decision>, u64),
}

impl Charge {
    /// The charge of `price` to `key` (and `quota`) that admitted a request with `decision`, its
    /// units' whereabouts said by `charged`.
    pub(crate) fn new(
        limiter: Arc<Limiter>,
        key: StorageKey,
        price: Price,
        quota: Option<QuotaLookup>,
        decision: Decision,
        charged: Charged,
    ) -> Self {
        Charge {
            limiter,
            key,
            price,
            quota,
            decision,
            charged,
            caller: None,
        }
    }

    /// The admission's decision, as its caller is told it.
    pub(crate) fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The store's answer that says where the units went, if one is known.
    fn receipt(&self) -> Option<&Decision> {
        match &self.charged {
            Charged::Unknown => None,
            Charged::Own => Some(&self.decision),
            Charged::Taken(take, _) => Some(take),
        }
    }

    /// Whether the response decides if this charge is kept or given back (`count_only`).
    pub(crate) fn kept_or_given_back_after_response(&self) -> bool {
        self.limiter.policy.counts_only_some()
    }

    /// Whether the charge reserved metered units, which its usage settles.
    pub(crate) fn is_metered(&self) -> bool {
        self.limiter.policy.metering().is_some()
    }

    /// What follows a store call that moved the charge's units (`decision`, its answer): a
    /// refusal cached for the key may stand no more, and a settle that took the day's quota
    /// past a threshold sends its alert.
    pub(super) fn moved(&self, decision: &Decision) {
        let limiter = &self.limiter;
        limiter.refusals.forget_key(self.key.as_str());
        limiter.alert_quota(decision, self.quota.as_ref());
    }

    /// Keeps the charge if a response of `status` counts, else gives it back: at once with an
    /// in-process store, in a task of its own with a networked one (the response doesn't wait).
    /// A give-back that fails is logged; the units then count, on the safe side.
    pub(crate) fn keep_or_give_back(self, status: StatusCode) {
        if self.limiter.policy.counts(status) {
            return;
        }
        let give_back = self.give_back(self.price);
        self.finish(
            give_back,
            "could not give back the charge of a response that doesn't count; it counts",
        );
    }

    /// Hands the store's `call` on this charge its answer's use, without the response waiting
    /// (see [`CheckFuture::then`]): then forgets a refusal cached for the key, or logs what
    /// failed (`failed`).
    pub(super) fn finish(self, call: CheckFuture, failed: &'static str) {
        let in_flight = self.limiter.settling.clone().map(InFlight::new);
        call.then(move |result| {
            self.given_back(result, failed);
            // Landed (or, dropped unrun, given up): said after the store's answer is applied.
            drop(in_flight);
        });
    }

    /// The limiter that charged.
    pub(super) fn limiter(&self) -> &Arc<Limiter> {
        &self.limiter
    }

    /// What was charged.
    pub(super) fn price(&self) -> Price {
        self.price
    }

    /// Charged to `caller`'s share of a budget shared fairly (see [`Caller`]).
    pub(crate) fn for_caller(mut self, caller: Option<Caller>) -> Self {
        self.caller = caller;
        self
    }

    /// The store's overdraw of `units` more to the charge's key (and quota), in their current
    /// windows: a settle's debt.
    pub(super) fn overdraw(&self, units: u64) -> CheckFuture {
        let request = self
            .limiter
            .store_request(&self.key, self.quota.as_ref())
            .cost(0)
            .units(units);
        let request = Caller::applied(self.caller.as_ref(), request);
        self.limiter.store().overdraw(&request)
    }

    /// Gives the charge back and waits for the store: what it then finds for the key.
    pub(crate) async fn refund(self) -> Result<Decision, StoreError> {
        let decision = self.give_back(self.price).await?;
        self.limiter.refusals.forget_key(self.key.as_str());
        Ok(decision)
    }

    /// The store's give-back of `price` of the charge (all of it, or units a settle didn't
    /// use); a peek when where it went isn't known (nothing goes back).
    pub(super) fn give_back(&self, price: Price) -> CheckFuture {
        let limiter = &self.limiter;
        let request = limiter
            .store_request(&self.key, self.quota.as_ref())
            .cost(price.cost)
            .units(price.units);
        let request = Caller::applied(self.caller.as_ref(), request);
        let Some(charged) = self.receipt() else {
            return limiter.store().peek(&request.cost(1).units(1));
        };
        match &self.charged {
            Charged::Taken(_, after) if *after > 0 => {
                let slice = slice_of(charged, limiter.policy.rules(), *after);
                limiter.store().give_back(&request, &slice)
            }
            _ => limiter.store().give_back(&request, charged),
        }
    }

    fn given_back(&self, result: Result<Decision, StoreError>, failed: &'static str) {
        let limiter = &self.limiter;
        match result {
            Ok(decision) => self.moved(&decision),
            Err(error) => limiter
                .store_errors
                .log(limiter.policy.name(), &error, failed),
        }
        if let Some(settling) = &limiter.settling {
            settling.wake();
        }
    }
}

/// A take's answer `charged` as the answer to one slice of it, `after` units before its end: each
/// token bucket's full time moved back by `after` of its rule's intervals (the slice's own end).
/// The other algorithms read the time of the check alone.
fn slice_of(charged: &Decision, rules: &[crate::Rule], after: u64) -> Decision {
    let mut slice = charged.clone();
    for (state, rule) in slice.rules.iter_mut().zip(rules) {
        if let Some(full_at) = &mut state.bucket_full_at_us {
            let interval = Bucket::new(rule.limit(), rule.period_ms(), rule.burst_size()).interval;
            *full_at = full_at.saturating_sub(after.saturating_mul(interval));
        }
    }
    slice
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::decision::RuleState;

    /// The requests one take admits share its answer: each gives back its own slice of the
    /// take's time, which ends `after` intervals before the take's full time, so together they
    /// never give back more than the take charged.
    #[test]
    fn a_slice_of_a_take_ends_its_later_units_before_the_take_s_full_time() {
        // 10 per second: an interval of 100 ms; the take left the bucket full at 5 s.
        let rules = [crate::Rule::per_second(10)];
        let state = RuleState {
            limit: 10,
            remaining: 0,
            reset: Duration::ZERO,
            retry_after: None,
            bucket_full_at_us: Some(5_000_000),
        };
        let take = Decision {
            allowed: true,
            rules: vec![state],
            now_unix_ms: 4_000,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
            run_time_override: None,
        };
        let slice = slice_of(&take, &rules, 3);
        assert_eq!(slice.rules[0].bucket_full_at_us, Some(4_700_000));
        assert_eq!(slice.now_unix_ms, take.now_unix_ms);
        // Never before the epoch, whatever the units after.
        let far = slice_of(&take, &rules, u64::MAX);
        assert_eq!(far.rules[0].bucket_full_at_us, Some(0));
        // Other algorithms carry no full time: nothing moves.
        let mut window = take.clone();
        window.rules[0].bucket_full_at_us = None;
        assert_eq!(slice_of(&window, &rules, 3), window);
    }
}
