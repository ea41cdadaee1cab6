//! A flood's refusals repeat themselves: within a second, every refusal of a hot key carries the
//! same `RateLimit` value (`r=0` and the same `t`) and the same `Retry-After`. Each thread keeps
//! its last refusal's two values and gives them again while they would be written the same, so a
//! flood is answered without formatting or allocating either. Per thread: a reuse writes the
//! value's reference count, on a cache line this core alone writes. Admissions don't come here
//! (their `r` changes with every request).

use std::cell::RefCell;

use arrayvec::ArrayVec;
use http::HeaderValue;

use super::AnswerPlan;

/// The most states a kept `RateLimit` value describes; a refusal by a policy of more is written
/// afresh each time.
const MAX_STATES: usize = 4;

/// A `RateLimit` value and what it was written from: the plan (its state names), whether the
/// quota's state was among them, and each state's remaining and reset in whole seconds.
struct Status {
    plan: AnswerPlan,
    with_quota: bool,
    states: ArrayVec<(u64, u64), MAX_STATES>,
    value: HeaderValue,
}

thread_local! {
    static LAST_STATUS: RefCell<Option<Status>> = const { RefCell::new(None) };
    static LAST_RETRY_AFTER: RefCell<Option<(u64, HeaderValue)>> = const { RefCell::new(None) };
}

/// The `RateLimit` value of a refusal by `plan`'s states `(remaining, reset_secs)`: this thread's
/// last one if it was written from the same, or else `write`'s, kept for the next.
pub(super) fn ratelimit_value(
    plan: &AnswerPlan,
    with_quota: bool,
    states: impl Iterator<Item = (u64, u64)>,
    write: impl FnOnce() -> HeaderValue,
) -> HeaderValue {
    let mut kept = ArrayVec::new();
    for state in states {
        if kept.try_push(state).is_err() {
            return write();
        }
    }
    LAST_STATUS.with_borrow_mut(|last| {
        if let Some(last) = last
            && last.with_quota == with_quota
            && last.states == kept
            && last.plan.same_as(plan)
        {
            return last.value.clone();
        }
        let value = write();
        *last = Some(Status {
            plan: plan.clone(),
            with_quota,
            states: kept,
            value: value.clone(),
        });
        value
    })
}

/// The `Retry-After` value of `secs`: this thread's last one if it was the same, or else
/// `write`'s, kept for the next.
pub(super) fn retry_after_value(secs: u64, write: impl FnOnce(u64) -> HeaderValue) -> HeaderValue {
    LAST_RETRY_AFTER.with_borrow_mut(|last| match last {
        Some((kept, value)) if *kept == secs => value.clone(),
        _ => {
            let value = write(secs);
            *last = Some((secs, value.clone()));
            value
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Policy, Rule};

    fn plan() -> AnswerPlan {
        let policy = Policy::builder("recent")
            .rule(Rule::per_minute(5))
            .build()
            .unwrap();
        AnswerPlan::new(&policy)
    }

    fn value(text: &'static str) -> HeaderValue {
        HeaderValue::from_static(text)
    }

    #[test]
    fn a_refusal_written_from_the_same_states_by_the_same_plan_reuses_the_value() {
        let plan = plan();
        let first = ratelimit_value(&plan, false, [(0, 42)].into_iter(), || value("first"));
        let again = ratelimit_value(&plan, false, [(0, 42)].into_iter(), || value("again"));
        assert_eq!((first, again), (value("first"), value("first")));
    }

    #[test]
    fn another_state_another_plan_or_the_quota_is_written_afresh() {
        let (plan, other) = (plan(), plan());
        ratelimit_value(&plan, false, [(0, 42)].into_iter(), || value("first"));
        let later = ratelimit_value(&plan, false, [(0, 41)].into_iter(), || value("later"));
        let by_other = ratelimit_value(&other, false, [(0, 41)].into_iter(), || value("other"));
        let quota = ratelimit_value(&other, true, [(0, 41)].into_iter(), || value("quota"));
        assert_eq!(
            [later, by_other, quota],
            [value("later"), value("other"), value("quota")]
        );
    }

    #[test]
    fn more_states_than_are_kept_are_written_each_time() {
        let plan = plan();
        let states = || (0..=MAX_STATES as u64).map(|index| (0, index));
        ratelimit_value(&plan, false, states(), || value("first"));
        let again = ratelimit_value(&plan, false, states(), || value("again"));
        assert_eq!(again, value("again"));
    }

    #[test]
    fn retry_after_is_reused_for_the_same_seconds_alone() {
        let write = |secs: u64| HeaderValue::from(secs);
        let first = retry_after_value(7, write);
        let again = retry_after_value(7, |_| value("not reused"));
        let other = retry_after_value(8, write);
        assert_eq!([first, again, other], [value("7"), value("7"), value("8")]);
    }
}
