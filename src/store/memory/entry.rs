//! The counters of one key, and the step every check shares whatever the algorithm: check every
//! rule (and the daily quota), then record in all or none; answer a penalty block. The counterpart
//! of `lua/entry.lua`; each rule's own arithmetic is its [`Counter`]'s.

use std::time::Duration;

use super::super::{CheckRequest, QuotaRequest};
use super::clock::millis;
use super::counter::{ChargedAt, Counter};
use super::quota::QuotaCounter;
use crate::decision::{Decision, RuleState};

/// The counters of one key.
pub(super) struct Entry {
    pub(super) key: Box<str>,
    /// The key's hash, kept for growing the table.
    pub(super) hash: u64,
    /// One counter per (algorithm, period, limit), so one per rule of a policy. The first ones match
    /// the rules of the latest check, in rule order; counters of other rules on the same key (two policies of one name, a policy
    /// redeployed with new rules) follow, kept until they expire rather than wiped.
    pub(super) counters: Vec<Counter>,
    /// When every counter is empty again and the entry can go.
    pub(super) expires_at_ms: u64,
    /// The latest check of this key, admitted or refused: eviction takes the least recent, so a
    /// client that keeps knocking while refused is not evicted by a flood of new keys.
    pub(super) last_seen_ms: u64,
    /// The end of a penalty block (0 or past: none).
    pub(super) blocked_until_ms: u64,
    /// The leases of a concurrency limit: (id, expiry in ms), the counterpart of the script's
    /// sorted set; expired ones are dropped at the next check.
    pub(super) leases: Vec<(u64, u64)>,
    /// When the key was last reset (0: never), and until when that counts: a receipt of an
    /// admission checked then or before gives nothing back to its rules meanwhile
    /// (`lua/reset.lua`'s marker).
    reset_ms: u64,
    reset_until_ms: u64,
}

impl Entry {
    pub(super) fn new(request: &CheckRequest<'_>, hash: u64) -> Self {
        let counters = request
            .rules
            .iter()
            .enumerate()
            .map(|(index, rule)| {
                Counter::new(request.algorithm, rule, request.counted_limit(index, rule))
            })
            .collect();
        Entry {
            key: request.key.into(),
            hash,
            counters,
            expires_at_ms: 0,
            last_seen_ms: 0,
            blocked_until_ms: 0,
            leases: Vec::new(),
            reset_ms: 0,
            reset_until_ms: 0,
        }
    }

    /// Forgets everything counted (a reset at `now`), and remembers when for `marker_ms`.
    pub(super) fn reset(&mut self, now: u64, marker_ms: u64) {
        self.counters.clear();
        self.leases.clear();
        self.blocked_until_ms = 0;
        self.reset_ms = now;
        self.reset_until_ms = now.saturating_add(marker_ms);
        self.expires_at_ms = self.reset_until_ms;
    }

    /// Puts the counters of the request's rules first, in rule order, creating missing ones. Almost
    /// always a no-op: only a key shared by different rule sets moves anything.
    pub(super) fn arrange(&mut self, request: &CheckRequest<'_>) {
        for (index, rule) in request.rules.iter().enumerate() {
            let algorithm = request.algorithm;
            let counted_as = request.counted_limit(index, rule);
            let found = self.counters[index.min(self.counters.len())..]
                .iter()
                .position(|counter| counter.counts(algorithm, rule, counted_as));
            match found {
                Some(0) => self.counters[index].fit_burst(rule),
                Some(offset) => {
                    self.counters.swap(index, index + offset);
                    self.counters[index].fit_burst(rule);
                }
                None => {
                    self.counters
                        .push(Counter::new(algorithm, rule, counted_as));
                    let last = self.counters.len() - 1;
                    self.counters.swap(index, last);
                }
            }
        }
    }

    /// Checks every rule, then records in all of them only if all admit the request, now or (when
    /// the request may wait) at the first time they all do; with a concurrency limit, an admitted
    /// request also takes a slot, leased as `lease_id`.
    /// Releases lease `id`, if it is still held.
    pub(super) fn release(&mut self, id: u64) {
        self.leases.retain(|&(lease, _)| lease != id);
    }

    pub(super) fn check(
        &mut self,
        request: &CheckRequest<'_>,
        now: u64,
        quota: Option<&mut (&mut QuotaCounter, QuotaRequest<'_>)>,
        lease_id: u64,
        refused_outside: bool,
    ) -> Decision {
        self.last_seen_ms = now;
        if self.blocked_until_ms > now {
            return self.blocked(request, now, quota.as_deref());
        }
        let mut allowed = true;
        // The wait until every refusing rule admits the request, if they all ever do.
        let mut wait = Some(0);
        let mut guard_refused = false;
        // A refusal by a rule other than the guard starts a penalty block.
        let mut counted_refused = false;
        for (counter, rule) in self.counters.iter_mut().zip(request.rules) {
            counter.forget_before(now);
            let cost = request.cost_in(rule);
            if !counter.fits(now, cost) {
                allowed = false;
                guard_refused |= rule.is_duplicate_guard();
                counted_refused |= !rule.is_duplicate_guard();
                wait = wait
                    .zip(counter.admits_after(now, cost, request.past_burst))
                    .map(|(a, b)| a.max(b));
            }
        }
        // The quota, a calendar day, can't reserve: when it refuses, the request is refused.
        let quota_cost = request.quota_cost();
        let quota_refused = quota
            .as_ref()
            .is_some_and(|(counter, request_quota)| !counter.fits(quota_cost, request_quota.limit));
        if quota_refused {
            allowed = false;
        }
        // The concurrency limit: expired leases are gone, the others each hold a slot.
        self.leases.retain(|&(_, expires)| expires > now);
        let slot_refused = request
            .concurrency
            .is_some_and(|limit| self.leases.len() as u64 >= limit.max_in_flight());
        if slot_refused {
            allowed = false;
        }
        // A budget shared fairly, kept apart (`fair.rs`), may refuse too: then nothing is
        // recorded here, and no reservation waits for a share.
        if refused_outside {
            allowed = false;
        }
        // A reservation: the request is recorded when it fits, and waits until then (never for a
        // slot, whose end isn't known).
        let delay = match wait {
            Some(wait)
                if !allowed
                    && request.call.records()
                    && !guard_refused
                    && !quota_refused
                    && !slot_refused
                    && !refused_outside
                    && request.algorithm.can_reserve()
                    && u128::from(wait) <= request.max_delay.as_millis() =>
            {
                allowed = true;
                wait
            }
            _ => 0,
        };
        let block_ms = request
            .block_for
            .filter(|_| !allowed && request.call.records() && (quota_refused || counted_refused))
            .map(millis);
        // A peek records nothing.
        let record = allowed && request.call.records();
        let mut rules = Vec::with_capacity(request.rules.len());
        for (counter, rule) in self.counters.iter_mut().zip(request.rules) {
            let cost = request.cost_in(rule);
            let retry_after = if record {
                counter.record(now + delay, cost);
                None
            } else if allowed || counter.fits(now, cost) {
                None
            } else {
                // Costs more than the limit: it never fits; say one period.
                let wait = counter
                    .admits_after(now, cost, request.past_burst)
                    .unwrap_or(counter.period_ms());
                Some(Duration::from_millis(wait.max(block_ms.unwrap_or(0))))
            };
            rules.push(RuleState {
                limit: rule.limit(),
                remaining: counter.remaining(now),
                reset: Duration::from_millis(counter.frees_after(now)),
                retry_after,
                // (An admission's receipt, as the script reports it: not for a refusal.)
                bucket_full_at_us: counter.bucket_full_at_us(now).filter(|_| allowed),
            });
        }
        let mut quota_alerts = Vec::new();
        if let Some((counter, request_quota)) = quota {
            let retry_after = if record {
                quota_alerts = counter.record(quota_cost, request_quota, now);
                None
            } else if quota_refused {
                let wait = counter.admits_after(quota_cost, request_quota, now);
                Some(Duration::from_millis(wait.max(block_ms.unwrap_or(0))))
            } else {
                None
            };
            rules.push(RuleState {
                limit: request_quota.limit,
                remaining: request_quota.limit.saturating_sub(counter.count),
                reset: Duration::from_millis(counter.frees_after(request_quota, now)),
                retry_after,
                bucket_full_at_us: None,
            });
        }
        let mut lease = None;
        if let Some(limit) = request.concurrency {
            if record {
                // No earlier than the lease taken before it, as the script's list keeps them
                // (lua/leases.lua): the earliest lease is the first.
                let expires = now
                    .saturating_add(delay)
                    .saturating_add(millis(limit.lease()))
                    .max(self.leases.last().map_or(0, |&(_, expires)| expires));
                self.leases.push((lease_id, expires));
                lease = Some(lease_id);
            }
            let frees = self.earliest_lease_expiry(now);
            rules.push(RuleState {
                limit: limit.max_in_flight(),
                remaining: limit
                    .max_in_flight()
                    .saturating_sub(self.leases.len() as u64),
                reset: Duration::from_millis(frees),
                retry_after: slot_refused
                    .then(|| Duration::from_millis(frees.max(block_ms.unwrap_or(0)))),
                bucket_full_at_us: None,
            });
        }
        if let Some(block_ms) = block_ms {
            self.blocked_until_ms = now.saturating_add(block_ms);
        }
        let rule_count = request.rules.len();
        if self.counters.len() > rule_count {
            // Counters of other rule sets stay only while they still hold something.
            let mut index = rule_count;
            while index < self.counters.len() {
                if self.counters[index].expires_at() <= now {
                    self.counters.swap_remove(index);
                } else {
                    index += 1;
                }
            }
        }
        self.expires_at_ms = self
            .counters
            .iter()
            .map(Counter::expires_at)
            .max()
            .unwrap_or(0)
            .max(self.blocked_until_ms)
            .max(self.reset_until_ms)
            .max(
                self.leases
                    .iter()
                    .map(|&(_, expires)| expires)
                    .max()
                    .unwrap_or(0),
            );
        Decision {
            allowed,
            rules,
            now_unix_ms: now,
            delay: Duration::from_millis(delay),
            quota_alerts,
            lease,
            run_time_override: None,
        }
    }

    /// Gives back `request.cost` units in every counted rule (not the duplicate guard) and the
    /// day's quota.
    pub(super) fn refund(
        &mut self,
        request: &CheckRequest<'_>,
        now: u64,
        quota: Option<&mut (&mut QuotaCounter, QuotaRequest<'_>)>,
    ) {
        for (counter, rule) in self.counters.iter_mut().zip(request.rules) {
            if !rule.is_duplicate_guard() {
                counter.forget_before(now);
                counter.refund(now, request.cost_in(rule));
            }
        }
        if let Some((counter, _)) = quota {
            counter.refund(request.quota_cost());
        }
    }

    /// Charges `request.cost` (and `request.units` to metered rules and quota) to every counted
    /// rule and the day's quota at `now`, past their limits if need be, each by at most its
    /// limit: see [`Store::overdraw`](crate::Store::overdraw). Returns the quota's alerts it
    /// fired.
    pub(super) fn overdraw(
        &mut self,
        request: &CheckRequest<'_>,
        now: u64,
        quota: Option<&mut (&mut QuotaCounter, QuotaRequest<'_>)>,
    ) -> Vec<u8> {
        for (counter, rule) in self.counters.iter_mut().zip(request.rules) {
            let cost = request.cost_in(rule).min(rule.burst_size());
            if !rule.is_duplicate_guard() && cost > 0 {
                counter.forget_before(now);
                counter.record(now, cost);
            }
        }
        match quota {
            Some((counter, quota)) => {
                let cost = request.quota_cost().min(quota.limit);
                counter.record(cost, quota, now)
            }
            None => Vec::new(),
        }
    }

    /// Gives back `request.cost` units of the admission answered `charged` to where it charged
    /// every counted rule (not the duplicate guard) and the day's quota: see
    /// [`Store::give_back`](crate::Store::give_back).
    pub(super) fn give_back(
        &mut self,
        request: &CheckRequest<'_>,
        charged: &Decision,
        now: u64,
        quota: Option<&mut (&mut QuotaCounter, QuotaRequest<'_>)>,
    ) {
        let checked_ms = charged.now_unix_ms;
        let admitted_ms = checked_ms.saturating_add(millis(charged.delay));
        // Reset since: the rules hold nothing of it (the quota, never reset, may).
        let reset_since = checked_ms <= self.reset_ms && now < self.reset_until_ms;
        let states = charged.rules.iter();
        for ((counter, rule), state) in self.counters.iter_mut().zip(request.rules).zip(states) {
            if !rule.is_duplicate_guard() && !reset_since {
                counter.forget_before(now);
                let at = ChargedAt {
                    checked_ms,
                    admitted_ms,
                    bucket_full_at_us: state.bucket_full_at_us,
                };
                counter.give_back(now, request.cost_in(rule), at);
            }
        }
        if let Some((counter, quota)) = quota {
            counter.give_back(request.quota_cost(), quota.day_start(checked_ms));
        }
    }

    /// The answer during a penalty block: nothing is admitted or counted. Every item is refused
    /// until the later of the block's end and the time it would admit the request itself, so a
    /// client that waits as long as `Retry-After` says finds no rule still full (which would
    /// refuse it and block it anew).
    fn blocked(
        &mut self,
        request: &CheckRequest<'_>,
        now: u64,
        quota: Option<&(&mut QuotaCounter, QuotaRequest<'_>)>,
    ) -> Decision {
        let left = self.blocked_until_ms - now;
        let state = |limit, own_wait: u64| {
            let wait = Duration::from_millis(left.max(own_wait));
            RuleState {
                limit,
                remaining: 0,
                reset: wait,
                retry_after: Some(wait),
                bucket_full_at_us: None,
            }
        };
        let mut rules = Vec::with_capacity(request.rules.len() + 2);
        for (counter, rule) in self.counters.iter_mut().zip(request.rules) {
            counter.forget_before(now);
            let cost = request.cost_in(rule);
            let own_wait = if counter.fits(now, cost) {
                0
            } else {
                counter
                    .admits_after(now, cost, request.past_burst)
                    .unwrap_or(counter.period_ms())
            };
            rules.push(state(rule.limit(), own_wait));
        }
        if let Some((counter, quota)) = quota {
            let cost = request.quota_cost();
            let own_wait = if counter.fits(cost, quota.limit) {
                0
            } else {
                counter.admits_after(cost, quota, now)
            };
            rules.push(state(quota.limit, own_wait));
        }
        if let Some(limit) = request.concurrency {
            self.leases.retain(|&(_, expires)| expires > now);
            let own_wait = if (self.leases.len() as u64) < limit.max_in_flight() {
                0
            } else {
                self.earliest_lease_expiry(now)
            };
            rules.push(state(limit.max_in_flight(), own_wait));
        }
        Decision {
            allowed: false,
            rules,
            now_unix_ms: now,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
            run_time_override: None,
        }
    }

    /// Milliseconds until the earliest lease expires (0: none is held).
    fn earliest_lease_expiry(&self, now: u64) -> u64 {
        self.leases
            .iter()
            .map(|&(_, expires)| expires - now)
            .min()
            .unwrap_or(0)
    }
}
