//! Fair shares of one budget (issue 62), as the memory store keeps them: who asked in the
//! budget's current window and the one before, how much (refused requests included), what each
//! was admitted this window, and the level each tenant's share stands at while the budget is
//! saturated. The budget's own count is a rule's counter like any other; this is what decides,
//! on top of it, whether a tenant's request may take from it.
//!
//! The arithmetic, in windows of the budget's period (epoch-aligned, as a fixed window's):
//! - **Saturated**: what was asked reached the budget in the window before, or so far in this
//!   one. While it isn't, nobody is held to a share.
//! - **Shares**, max-min fair by weight: the level `L` such that `Σ min(need, weight × L)` over
//!   the active tenants is the budget, where a tenant's need is what it asked in the window
//!   before (so a tenant that asked little is held to nothing it doesn't use, and what it leaves
//!   goes to those who want more), or so far in this one when more. A tenant is admitted up to
//!   `weight × L` this window. When every tenant asks more than its share, `L` is
//!   `budget / Σ weights`: the share is `budget × weight / Σ weights`.
//! - **When**: the level is set at each window's first request (from the window before, so a
//!   saturated window's shares hold from its first millisecond), when the window saturates while
//!   it had none, and once a tenth into the window, when the tenants that asked for more than
//!   their share before but haven't asked since let theirs go to the others. A tenant that
//!   arrives meanwhile is held to `weight × L` and counted in the next window's level: it has its
//!   share within one window.
//! - **Active**: asked in this window or the one before; a tenant quiet for longer is forgotten
//!   at the next window's first request.

use std::collections::HashMap;
use std::time::Duration;

use super::clock::millis;
use super::counter::{ChargedAt, Counter};
use crate::decision::{Decision, RuleState};
use crate::policy::Algorithm;
use crate::store::{CheckRequest, FairRequest};

/// How often the budgets are swept of those that have counted nothing for a while (ms).
const SWEEP_EVERY_MS: u64 = 10_000;

/// The budgets shared fairly, by key: locked before a shard (see `MemoryStore::check_now`).
#[derive(Default)]
pub(super) struct Budgets {
    by_key: HashMap<Box<str>, Budget>,
    next_sweep_ms: u64,
}

/// One budget: its count (a rule's counter, of the request's algorithm) and its shares.
pub(super) struct Budget {
    counter: Counter,
    shares: Shares,
    /// The latest time it was asked at (its clock never goes back).
    latest_ms: u64,
}

/// What a budget makes of a request before its identity's own limits are checked.
#[derive(Debug, Clone, Copy)]
pub(super) struct Gate {
    share: Share,
    budget_fits: bool,
    cost: u64,
    now: u64,
}

impl Gate {
    /// Whether the budget, or the identity's share of it, refuses the request.
    pub(super) fn refuses(&self) -> bool {
        !self.budget_fits || !self.share.fits(self.cost)
    }
}

impl Budgets {
    /// The budget of `fair`, made at its first request, and the time it is for it (`now`, or
    /// later when it was asked later).
    pub(super) fn budget(
        &mut self,
        fair: &FairRequest<'_>,
        algorithm: Algorithm,
        now: u64,
    ) -> (&mut Budget, u64) {
        if now >= self.next_sweep_ms {
            self.by_key
                .retain(|_, budget| budget.counter.expires_at() > now || budget.shares.len() > 0);
            self.next_sweep_ms = now.saturating_add(SWEEP_EVERY_MS);
        }
        // (Looked up by the borrowed key: a budget already kept allocates nothing; one of
        // another rule, after a reload, starts afresh.)
        let kept = self.by_key.get(fair.key).is_some_and(|budget| {
            budget
                .counter
                .counts(algorithm, fair.budget, fair.budget.limit())
        });
        if !kept {
            let budget = Budget {
                counter: Counter::new(algorithm, fair.budget, fair.budget.limit()),
                shares: Shares::new(fair.budget.limit(), fair.budget.period_ms()),
                latest_ms: 0,
            };
            self.by_key.insert(fair.key.into(), budget);
        }
        let budget = self
            .by_key
            .get_mut(fair.key)
            .expect("the budget was just found or put in");
        budget.latest_ms = budget.latest_ms.max(now);
        let now = budget.latest_ms;
        (budget, now)
    }
}

impl Budget {
    /// What the budget and the identity's share make of `request` at `now`.
    pub(super) fn gate(
        &mut self,
        request: &CheckRequest<'_>,
        fair: &FairRequest<'_>,
        now: u64,
    ) -> Gate {
        let cost = fair.cost_of(request);
        self.counter.forget_before(now);
        Gate {
            // (A peek weighs nothing: an operator's has no request to weigh.)
            share: self.shares.share(
                fair.tenant_of(request),
                request.call.records().then_some(fair.weight),
                cost,
                now,
            ),
            budget_fits: self.counter.fits(now, cost),
            cost,
            now,
        }
    }

    /// Counts a checked request (`decision`, of its identity's own limits and the gate's
    /// refusal): what it asked, when nothing else refused it, and what it used, admitted; then
    /// reports the budget's state and the share's after the others.
    pub(super) fn settle(
        &mut self,
        request: &CheckRequest<'_>,
        gate: Gate,
        decision: &mut Decision,
    ) {
        let (cost, now) = (gate.cost, gate.now);
        let own_limits_admit = decision
            .rules
            .iter()
            .all(|state| state.retry_after.is_none());
        if request.call.records()
            && own_limits_admit
            && let Some(fair) = request.fair
        {
            self.shares
                .count(fair.tenant_of(request), cost, decision.allowed);
            if decision.allowed {
                self.counter
                    .record(now.saturating_add(millis(decision.delay)), cost);
            }
        }
        let budget_refused = !decision.allowed && !gate.budget_fits;
        let share_refused = !decision.allowed && !gate.share.fits(cost);
        self.report(request, gate.share, budget_refused, share_refused, decision);
    }

    /// Reports the budget's state and `share`'s (as a peek of one unit would see them, but for
    /// the refusals given) after `decision`'s.
    fn report(
        &mut self,
        request: &CheckRequest<'_>,
        share: Share,
        budget_refused: bool,
        share_refused: bool,
        decision: &mut Decision,
    ) {
        let now = self.latest_ms;
        let cost = request.fair.map_or(1, |fair| fair.cost_of(request));
        let budget_left = self.counter.remaining(now);
        // While shares bind, no later than the window's end: a tenant held back asks again when
        // the next window's shares are set (a caller that waits for room included).
        let budget_retry = budget_refused.then(|| {
            let wait = self
                .counter
                .admits_after(now, cost, false)
                .unwrap_or(self.counter.period_ms());
            let wait = match share.cap {
                Some(_) => wait.min(share.resets_in_ms),
                None => wait,
            };
            Duration::from_millis(wait)
        });
        // (What a check admitted used; a peek, as the rules' states, says what is left.)
        let recorded = decision.allowed && request.call.records();
        let used = share.used.saturating_add(if recorded { cost } else { 0 });
        let resets = Duration::from_millis(share.resets_in_ms);
        let (limit, remaining) = match share.cap {
            Some(cap) => (cap, cap.saturating_sub(used).min(budget_left)),
            None => (self.shares.budget, budget_left),
        };
        decision.rules.push(RuleState {
            limit: self.shares.budget,
            remaining: budget_left,
            reset: Duration::from_millis(self.counter.frees_after(now)),
            retry_after: budget_retry,
            bucket_full_at_us: self
                .counter
                .bucket_full_at_us(now)
                .filter(|_| decision.allowed),
        });
        decision.rules.push(RuleState {
            limit,
            remaining,
            reset: resets,
            retry_after: share_refused.then_some(resets),
            bucket_full_at_us: None,
        });
    }

    /// Gives back `request`'s units to the budget and the identity's share (a refund), then
    /// reports both after `decision`'s.
    pub(super) fn refund(
        &mut self,
        request: &CheckRequest<'_>,
        fair: &FairRequest<'_>,
        decision: &mut Decision,
    ) {
        let now = self.latest_ms;
        let cost = fair.cost_of(request);
        self.counter.forget_before(now);
        self.counter.refund(now, cost);
        self.shares.give_back(fair.tenant_of(request), cost, now);
        self.report_now(request, fair, decision);
    }

    /// Gives back `request`'s units of the admission answered `charged` where it charged them
    /// (a give-back), then reports both after `decision`'s.
    pub(super) fn give_back(
        &mut self,
        request: &CheckRequest<'_>,
        fair: &FairRequest<'_>,
        charged: &Decision,
        decision: &mut Decision,
    ) {
        let now = self.latest_ms;
        let cost = fair.cost_of(request);
        let checked_ms = charged.now_unix_ms;
        // The budget's state is the second last of the charge's.
        let states = charged.rules.len();
        let bucket_full_at_us = states
            .checked_sub(2)
            .and_then(|at| charged.rules.get(at))
            .and_then(|state| state.bucket_full_at_us);
        self.counter.forget_before(now);
        self.counter.give_back(
            now,
            cost,
            ChargedAt {
                checked_ms,
                admitted_ms: checked_ms.saturating_add(millis(charged.delay)),
                bucket_full_at_us,
            },
        );
        self.shares
            .give_back(fair.tenant_of(request), cost, checked_ms);
        self.report_now(request, fair, decision);
    }

    /// Charges `request`'s units to the budget and the identity's share past their limits if
    /// need be (an overdraw: units used past an estimate), then reports both.
    pub(super) fn overdraw(
        &mut self,
        request: &CheckRequest<'_>,
        fair: &FairRequest<'_>,
        decision: &mut Decision,
    ) {
        let now = self.latest_ms;
        let cost = fair.cost_of(request).min(fair.budget.burst_size());
        self.counter.forget_before(now);
        if cost > 0 {
            self.counter.record(now, cost);
            let tenant = fair.tenant_of(request);
            self.shares.share(tenant, None, 0, now);
            self.shares.count(tenant, cost, true);
        }
        self.report_now(request, fair, decision);
    }

    /// Reports the budget's state and the identity's share as they are now.
    fn report_now(
        &mut self,
        request: &CheckRequest<'_>,
        fair: &FairRequest<'_>,
        decision: &mut Decision,
    ) {
        let now = self.latest_ms;
        let share = self.shares.share(fair.tenant_of(request), None, 0, now);
        self.report(request, share, false, false, decision);
    }
}

/// The shares of one budget.
pub(super) struct Shares {
    budget: u64,
    period_ms: u64,
    /// The current window (its start over the period).
    window: u64,
    /// Units asked this window, and in the one before (0 when that one saw none).
    asked: u64,
    asked_before: u64,
    /// The level shares stand at this window; `None` while the budget isn't saturated.
    level: Option<f64>,
    /// Whether the absent tenants' shares were let go this window.
    released: bool,
    tenants: HashMap<Box<str>, Tenant>,
}

/// One tenant of a budget.
#[derive(Debug, Clone, Copy)]
struct Tenant {
    weight: u32,
    /// The last window it asked in.
    window: u64,
    /// Units it asked in that window (refused included), and in the one before it.
    asked: u64,
    asked_before: u64,
    /// Units it was admitted in that window.
    used: u64,
    /// Whether it was held back (a request of it refused by the budget or its share, the
    /// budget saturated) in that window, and in the one before: it wanted more than it got,
    /// whatever it asked (a caller that waits for room, as the outbound layer's, asks once per
    /// wait, not as often as it would send).
    held: bool,
    held_before: bool,
}

/// A tenant's share of the budget now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Share {
    /// What it may use this window (`weight × level`); `None` while the budget isn't saturated.
    pub(super) cap: Option<u64>,
    /// What it has used this window.
    pub(super) used: u64,
    /// Time until the window ends (ms): when its share is whole again.
    pub(super) resets_in_ms: u64,
}

impl Share {
    /// Whether a request of `cost` units fits in it.
    pub(super) fn fits(&self, cost: u64) -> bool {
        self.cap
            .is_none_or(|cap| self.used.saturating_add(cost) <= cap)
    }
}

impl Tenant {
    /// What it asked and used, seen from window `window` (a later one than its own, or its own).
    fn in_window(self, window: u64) -> Tenant {
        match window.saturating_sub(self.window) {
            0 => self,
            1 => Tenant {
                window,
                asked: 0,
                asked_before: self.asked,
                used: 0,
                held: false,
                held_before: self.held,
                ..self
            },
            _ => Tenant {
                window,
                asked: 0,
                asked_before: 0,
                used: 0,
                held: false,
                held_before: false,
                ..self
            },
        }
    }

    /// Whether it asked in `window` or the one before.
    fn is_active(self, window: u64) -> bool {
        self.window.saturating_add(1) >= window
    }
}

impl Shares {
    /// No tenant yet, for a budget of `budget` units per `period_ms`.
    pub(super) fn new(budget: u64, period_ms: u64) -> Self {
        Shares {
            budget,
            period_ms: period_ms.max(1),
            window: 0,
            asked: 0,
            asked_before: 0,
            level: None,
            released: false,
            tenants: HashMap::new(),
        }
    }

    /// `tenant`'s share at `now` (ms), of weight `weight` (at least 1; `None`, a call that
    /// doesn't weigh, as a give-back: the one its latest check gave, 1 for a new tenant), for a
    /// request of `cost` units: the level is set first, if this window has none yet, or
    /// saturates with it.
    pub(super) fn share(
        &mut self,
        tenant: &str,
        weight: Option<u32>,
        cost: u64,
        now: u64,
    ) -> Share {
        let window = now / self.period_ms;
        if window != self.window {
            self.roll(window);
        }
        let weight = weight.map(|weight| weight.max(1));
        let own = match self.tenants.get_mut(tenant) {
            Some(own) => {
                *own = own.in_window(window);
                own.weight = weight.unwrap_or(own.weight);
                *own
            }
            None => {
                let own = Tenant {
                    weight: weight.unwrap_or(1),
                    window,
                    asked: 0,
                    asked_before: 0,
                    used: 0,
                    held: false,
                    held_before: false,
                };
                self.tenants.insert(tenant.into(), own);
                own
            }
        };
        let into_window = now % self.period_ms;
        if self.level.is_some() && !self.released && into_window >= self.period_ms / 10 {
            self.released = true;
            self.level = self.level_now(Some((tenant, cost)), true);
        }
        if self.level.is_none() && self.asked.saturating_add(cost) >= self.budget {
            self.level = self.level_now(Some((tenant, cost)), false);
        }
        Share {
            cap: self
                .level
                .map(|level| (f64::from(own.weight) * level).floor() as u64),
            used: own.used,
            resets_in_ms: self.period_ms - into_window,
        }
    }

    /// Counts a request of `tenant` of `cost` units that reached the budget (its other limits
    /// admitted it), `admitted` or not: what it asked, what it used, and whether it was held
    /// back.
    pub(super) fn count(&mut self, tenant: &str, cost: u64, admitted: bool) {
        self.asked = self.asked.saturating_add(cost);
        if let Some(own) = self.tenants.get_mut(tenant) {
            own.asked = own.asked.saturating_add(cost);
            if admitted {
                own.used = own.used.saturating_add(cost);
            } else {
                own.held = true;
            }
        }
    }

    /// Gives back `cost` units `tenant` used in the window of `charged_ms` (a give-back, a
    /// refund): what it used this window, if that is this window.
    pub(super) fn give_back(&mut self, tenant: &str, cost: u64, charged_ms: u64) {
        let window = self.window;
        if let Some(own) = self.tenants.get_mut(tenant)
            && own.window == window
            && charged_ms / self.period_ms == window
        {
            own.used = own.used.saturating_sub(cost);
        }
    }

    /// Whether the budget is saturated this window (shares bind).
    #[cfg(test)]
    pub(super) fn is_saturated(&self) -> bool {
        self.level.is_some()
    }

    /// How many tenants it keeps.
    pub(super) fn len(&self) -> usize {
        self.tenants.len()
    }

    /// Starts window `window`: forgets the tenants quiet since before the one before it, and
    /// sets the level from what was asked in the window before.
    fn roll(&mut self, window: u64) {
        self.asked_before = if window == self.window + 1 {
            self.asked
        } else {
            0
        };
        self.asked = 0;
        self.window = window;
        self.released = false;
        self.tenants.retain(|_, tenant| tenant.is_active(window));
        self.level = if self.asked_before >= self.budget {
            self.level_now(None, false)
        } else {
            None
        };
    }

    /// The level now: each active tenant needs what it asked in the window before, or so far
    /// in this one when more (`asking`, with the units of the request being judged), or, held
    /// back in either, more than any share (it wanted more than it got); with
    /// `release`, a tenant that asked for more than its share before and hasn't asked this
    /// window needs nothing. `None` when the needs fit in the budget.
    fn level_now(&self, asking: Option<(&str, u64)>, release: bool) -> Option<f64> {
        let window = self.window;
        let mut needs: Vec<(f64, f64)> = Vec::with_capacity(self.tenants.len());
        for (name, tenant) in &self.tenants {
            let tenant = tenant.in_window(window);
            let mut asked_now = tenant.asked;
            if let Some((asking, cost)) = asking
                && asking == &**name
            {
                asked_now = asked_now.saturating_add(cost);
            }
            let weight = f64::from(tenant.weight);
            let mut need = if tenant.held || tenant.held_before {
                f64::INFINITY
            } else {
                tenant.asked_before.max(asked_now) as f64
            };
            if release
                && asked_now == 0
                && let Some(level) = self.level
                && need >= weight * level
            {
                need = 0.0;
            }
            if need > 0.0 {
                needs.push((need, weight));
            }
        }
        level_of(self.budget as f64, &mut needs)
    }
}

/// The level `L` at which `Σ min(need, weight × L)` over `needs` (need, weight) is `budget`:
/// the tenants that need less than their weight's part take what they need, the rest share
/// what is left by weight. `None` when every need fits.
fn level_of(budget: f64, needs: &mut [(f64, f64)]) -> Option<f64> {
    needs.sort_by(|a, b| (a.0 / a.1).total_cmp(&(b.0 / b.1)));
    let mut left = budget;
    let mut weights: f64 = needs.iter().map(|(_, weight)| weight).sum();
    for &(need, weight) in needs.iter() {
        let level = left / weights;
        if need > weight * level {
            return Some(level);
        }
        left -= need;
        weights -= weight;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_level_shares_by_weight_and_gives_what_the_light_leave_to_the_heavy() {
        let mut all_heavy = [(1000.0, 1.0), (1000.0, 1.0), (1000.0, 2.0)];
        assert_eq!(level_of(300.0, &mut all_heavy), Some(75.0));
        // One asks 30: the other two share the 270 left.
        let mut one_light = [(1000.0, 1.0), (30.0, 1.0), (1000.0, 1.0)];
        assert_eq!(level_of(300.0, &mut one_light), Some(135.0));
        let mut all_fit = [(100.0, 1.0), (150.0, 2.0)];
        assert_eq!(level_of(300.0, &mut all_fit), None);
    }

    /// Tenants (name, weight, from, until: ms) asking `per_ms` requests each millisecond while
    /// they ask, against a budget of 300 a second counted in fixed windows: what each was
    /// admitted in each of `windows` (a row per window, tenants in order).
    fn run(
        shares: &mut Shares,
        tenants: &[(&str, u32, u64, u64)],
        per_ms: u64,
        windows: std::ops::Range<u64>,
    ) -> Vec<Vec<u64>> {
        let mut rows = Vec::new();
        for window in windows {
            let mut budget_used = 0;
            let mut row = vec![0; tenants.len()];
            for ms in window * 1000..(window + 1) * 1000 {
                for _ in 0..per_ms {
                    for (at, &(tenant, weight, from, until)) in tenants.iter().enumerate() {
                        if ms < from || ms >= until {
                            continue;
                        }
                        let share = shares.share(tenant, Some(weight), 1, ms);
                        let admit = share.fits(1) && budget_used < 300;
                        shares.count(tenant, 1, admit);
                        if admit {
                            budget_used += 1;
                            row[at] += 1;
                        }
                    }
                }
            }
            rows.push(row);
        }
        rows
    }

    #[test]
    fn saturating_tenants_get_their_weighted_shares_from_the_second_window() {
        let mut shares = Shares::new(300, 1000);
        let tenants = [
            ("a", 1, 0, u64::MAX),
            ("b", 1, 0, u64::MAX),
            ("c", 2, 0, u64::MAX),
        ];
        let admitted = run(&mut shares, &tenants, 2, 0..5);
        assert_eq!(admitted[1..], [[75, 75, 150]; 4]);
    }

    #[test]
    fn a_tenant_that_stops_lets_its_share_go_a_tenth_into_the_next_window() {
        let mut shares = Shares::new(300, 1000);
        // c (weight 2) stops at 2.5 s: the window after, its share is let go a tenth in.
        let tenants = [
            ("a", 1, 0, u64::MAX),
            ("b", 1, 0, u64::MAX),
            ("c", 2, 0, 2500),
        ];
        let admitted = run(&mut shares, &tenants, 2, 0..6);
        assert_eq!(admitted[3..], [[150, 150, 0]; 3]);
    }

    #[test]
    fn a_tenant_that_arrives_has_its_share_the_next_window() {
        let mut shares = Shares::new(300, 1000);
        let tenants = [
            ("a", 1, 0, u64::MAX),
            ("b", 1, 0, u64::MAX),
            ("d", 1, 2300, u64::MAX),
        ];
        let admitted = run(&mut shares, &tenants, 2, 0..5);
        assert_eq!(admitted[1], [150, 150, 0]);
        assert_eq!(admitted[3..], [[100, 100, 100]; 2]);
    }

    #[test]
    fn a_light_tenant_is_held_to_nothing_and_its_unused_share_goes_to_the_heavy() {
        let mut shares = Shares::new(300, 1000);
        // `light` asks once every 20 ms (50 a second), late in each window too.
        let mut light_admitted = [0u64; 5];
        let mut heavy_admitted = [0u64; 5];
        for window in 0..5u64 {
            let mut budget_used = 0;
            for ms in window * 1000..(window + 1) * 1000 {
                for _ in 0..2 {
                    let share = shares.share("heavy", Some(1), 1, ms);
                    let admit = share.fits(1) && budget_used < 300;
                    shares.count("heavy", 1, admit);
                    if admit {
                        budget_used += 1;
                        heavy_admitted[window as usize] += 1;
                    }
                }
                if ms % 20 == 10 {
                    let share = shares.share("light", Some(1), 1, ms);
                    let admit = share.fits(1) && budget_used < 300;
                    shares.count("light", 1, admit);
                    if admit {
                        budget_used += 1;
                        light_admitted[window as usize] += 1;
                    }
                }
            }
        }
        // In the first window `heavy` took the budget before it saturated, and `light` was held
        // back: the window after, its whole share (150) is kept for it, of which it uses 50.
        assert_eq!((light_admitted[1], heavy_admitted[1]), (50, 150));
        for window in 2..5 {
            assert_eq!(light_admitted[window], 50, "window {window}");
            assert_eq!(heavy_admitted[window], 250, "window {window}");
        }
    }

    #[test]
    fn a_tenant_held_back_needs_more_than_any_share_whatever_it_asked() {
        let mut shares = Shares::new(40, 1000);
        // `waiting` asks once per wait (a caller that waits for room): 10 a window, of which 5
        // are refused; `eager` asks 60 and is admitted 35.
        for (tenant, asked, admitted) in [("waiting", 10, 5), ("eager", 60, 35)] {
            for n in 0..asked {
                shares.share(tenant, Some(3), 1, 500);
                shares.count(tenant, 1, n < admitted);
            }
        }
        // Both were held back: each needs more than its share, by weight 3:3.
        let next = shares.share("waiting", Some(3), 1, 1_010);
        assert_eq!(next.cap, Some(20));
    }

    #[test]
    fn a_call_that_doesnt_weigh_keeps_the_tenants_weight() {
        let mut shares = Shares::new(300, 1000);
        let tenants = [("a", 1, 0, u64::MAX), ("c", 2, 0, u64::MAX)];
        run(&mut shares, &tenants, 2, 0..2);
        // A give-back's report, say: c still weighs 2, and its share is twice a's.
        let (a, c) = (
            shares.share("a", None, 0, 2_050),
            shares.share("c", None, 0, 2_050),
        );
        assert_eq!((a.cap, c.cap), (Some(100), Some(200)));
    }

    #[test]
    fn an_unsaturated_budget_holds_nobody_and_quiet_tenants_are_forgotten() {
        let mut shares = Shares::new(300, 1000);
        for ms in 0..100 {
            let share = shares.share("a", Some(1), 1, ms);
            assert_eq!(share.cap, None);
            shares.count("a", 1, true);
        }
        shares.share("b", Some(1), 1, 1500);
        assert_eq!(shares.len(), 2);
        // Two windows later, `a` (last asked in window 0) is gone.
        shares.share("b", Some(1), 1, 2500);
        assert_eq!(shares.len(), 1);
        assert!(!shares.is_saturated());
    }
}
