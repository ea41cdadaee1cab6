//! A request waiting for a concurrency slot (delay mode), first come first served among this
//! instance's requests of its key.

use crate::limiter::{Ask, Limiter, Verdict};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::decision::{Decision, RuleState};
use crate::policy::StateOf;

/// The first pause of a request polling for a concurrency slot; it doubles up to [`MAX_SLOT_POLL`].
const FIRST_SLOT_POLL: Duration = Duration::from_millis(5);

/// The longest pause of a request polling for a concurrency slot released by another instance.
const MAX_SLOT_POLL: Duration = Duration::from_millis(100);

impl Limiter {
    /// Whether a request refused for want of a concurrency slot may wait for one: the policy has a
    /// concurrency limit, in delay mode.
    pub(in crate::limiter) fn may_wait_for_slots(&self) -> bool {
        self.policy.concurrency().is_some() && !self.policy.mode().max_delay().is_zero()
    }

    /// Whether `decision` refused for want of a slot alone: every other state admits, or is a rate
    /// rule that would within `budget` (a reservation, once a slot is free). A refusal by the
    /// quota or the duplicate guard is final however long one waits for a slot.
    pub(in crate::limiter) fn only_slot_missing(
        &self,
        decision: &Decision,
        budget: Duration,
    ) -> bool {
        let states = decision.rules.len();
        self.may_wait_for_slots()
            && decision.rules.last().is_some_and(RuleState::refused)
            && decision.rules.iter().enumerate().all(|(index, state)| {
                match (self.policy.state_of(index, states), state.retry_after) {
                    (_, None) | (StateOf::Concurrency, _) => true,
                    (StateOf::Rule(rule), Some(retry)) => {
                        !self.policy.rules()[rule].is_duplicate_guard() && retry <= budget
                    }
                    (StateOf::Quota, Some(_)) => false,
                }
            })
    }

    /// Whether a request should queue behind others of its key waiting for a slot, rather than
    /// ask the store before them (first come, first served).
    pub(in crate::limiter) fn queues_first(&self, ask: &Ask) -> bool {
        self.may_wait_for_slots() && self.slot_queues.is_waiting(ask.key.as_str())
    }

    /// Waits for a concurrency slot, up to the policy's `max_delay` from the request's arrival,
    /// first come first served among this instance's requests of the key: the head of the key's
    /// queue asks the store again when this instance releases a slot of the key, and otherwise
    /// polls (every [`FIRST_SLOT_POLL`], doubling up to [`MAX_SLOT_POLL`]) for slots released
    /// elsewhere or by a lease's expiry. `just_refused` says the store has just refused the
    /// request, so the head waits before asking again.
    pub(in crate::limiter) async fn wait_for_slot(
        self: Arc<Self>,
        mut ask: Ask,
        just_refused: bool,
    ) -> (Verdict, Ask) {
        let arrived = tokio::time::Instant::now() - ask.started.elapsed();
        let deadline = arrived + self.policy.mode().max_delay();
        let place = self.slot_queues.join(ask.key.as_str());
        let (_turn, mut wait_first) = match place.try_turn() {
            Some(turn) => (turn, just_refused),
            None => match tokio::time::timeout_at(deadline, place.turn()).await {
                // The requests ahead have asked the store since: ask at once.
                Ok(turn) => (turn, false),
                // Out of time in the queue: one last look (it may admit, without a delay).
                Err(_) => {
                    ask.started = Instant::now();
                    let result = self.check_within(&ask, Duration::ZERO).await;
                    let waited = arrived.elapsed();
                    let verdict = self.judge_after(result, &mut ask, Duration::ZERO, waited);
                    return (verdict, ask);
                }
            },
        };
        let mut poll = FIRST_SLOT_POLL;
        loop {
            if wait_first {
                let pause =
                    poll.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
                // Woken by a release here, or polling for one elsewhere.
                let _ = tokio::time::timeout(pause, place.freed()).await;
                poll = (poll * 2).min(MAX_SLOT_POLL);
            }
            wait_first = true;
            let budget = deadline.saturating_duration_since(tokio::time::Instant::now());
            ask.started = Instant::now();
            let result = self.check_within(&ask, budget).await;
            match self.judge_after(result, &mut ask, budget, arrived.elapsed()) {
                Verdict::AwaitSlot => continue,
                verdict => return (verdict, ask),
            }
        }
    }
}
