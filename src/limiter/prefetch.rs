//! [`Prefetched`]: the units an instance took ahead for hot identities ([`PolicyBuilder::prefetch`]),
//! spent without asking the store.
//!
//! A request that finds enough units here is admitted at once. Otherwise it asks the store for
//! its cost plus some units ahead; what it takes is charged in the shared counters, all or
//! nothing, as a check of that cost would be, so the shared limit is never passed. How many
//! units ahead grows with the identity's pace: doubling while this instance asks the store for
//! it again within [`HOT`], back to none once it asks less often. Once a hot identity has spent
//! three quarters of its last take, the request that finds it so takes the next one in the
//! background (doubled if the last went within [`HOT`]), so that its next requests still find
//! units in hand: only one take per identity is in flight that way. Units held for an identity
//! (in hand and asked for) never exceed the policy's `prefetch`. They are valid until the
//! earliest window of the policy that charged them ends (spent later, they would count in a
//! window that didn't charge them): the caller says when.
//!
//! [`PolicyBuilder::prefetch`]: crate::PolicyBuilder::prefetch

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;
// Tokio's clock, which tests can pause and move with the stores' clocks.
use tokio::time::Instant;

use super::{Admission, Charged, Checked, Limiter};
use crate::decision::Decision;
use crate::limiter::telemetry::Outcome;
use crate::policy::quota::QuotaLookup;
use crate::policy::{Algorithm, Policy, StorageKey};
use crate::response::LimitHeaders;
use crate::store::{ResetListener, ResetWatch, Store, StoreError};

/// Asking the store again for an identity within this long makes it hot: the next ask takes
/// twice as many units ahead.
pub(crate) const HOT: Duration = Duration::from_millis(10);

/// Shards of the table, so that instances' threads rarely wait on one lock.
const SHARDS: usize = 16;

/// Identities a shard remembers at most; past it, those holding nothing are forgotten first.
const MAX_PER_SHARD: usize = 4_096;

/// The units taken ahead by one limiter, per identity.
pub(crate) struct Prefetched {
    /// The most units held per identity.
    max: u64,
    hasher: RandomState,
    shards: Box<[Mutex<Shard>]>,
    /// Whether the store's reset notices are heard (registered at the first spend, in a
    /// runtime): `None` inside when the store can't tell of resets.
    resets: OnceLock<Option<ResetWatch>>,
}

/// One shard of the table: what this instance holds, by store key.
type Shard = HashMap<Box<str>, Allowance>;

/// What this instance holds for one identity.
struct Allowance {
    /// Units in hand.
    units: u64,
    /// Units asked for by takes not answered yet.
    pending: u64,
    /// Of those, how many to drop when they land: asked for before a reset (or lost notices),
    /// they were charged before it.
    void: u64,
    /// Whether a take in the background is among them: it is answered for certain (a request's
    /// own take is not, if the request is dropped).
    ahead_in_flight: bool,
    /// Until when the units in hand may be spent.
    valid_until: Instant,
    /// When the last take was answered, and its decision (the state after it).
    taken_at: Instant,
    decision: Option<Decision>,
    /// How many units a take is sized for (the last one's, the request's own included, or what
    /// a take in the background asked for): the next hot take doubles it.
    last_take: u64,
    /// The key and quota the units in hand were charged to, for giving them back.
    charged: Option<(StorageKey, Option<QuotaLookup>)>,
    /// Where the units in hand were charged: per take, oldest first, the store's answer to it
    /// and how many of its units are still in hand (spent oldest first), for giving each back
    /// where it was charged (a later take's window, or its bucket's later full time, would take
    /// back more than an earlier take's units hold).
    receipts: Receipts,
    /// When a request last had to ask the store.
    last_ask: Instant,
    /// The units wanted by requests that waited for the take in flight: the next take is at
    /// least as large.
    wanted: u64,
    /// Wakes the requests waiting for a take in flight, once it is answered (made for the first
    /// such request: a cold identity never needs it).
    landed: Option<Arc<Notify>>,
}

/// What a request of an identity does.
#[derive(Debug)]
pub(crate) enum Spend {
    /// Admitted from units in hand: the decision its headers tell, and the answer to the take
    /// that charged its units. `take_ahead`: units to take now in the background (0: none), so
    /// that the next requests still find units in hand.
    Local {
        decision: Decision,
        charged: Option<(Arc<Decision>, u64)>,
        take_ahead: u64,
    },
    /// Ask the store for its cost and `extra` units ahead. `expired`: units in hand that had
    /// to be dropped (their window ended, or they sat unused), for the caller to count or give
    /// back.
    Ask { extra: u64, expired: Expired },
    /// Too few units in hand, and a take is in flight: wait until it is answered, then spend
    /// again. `certain`: a take in the background, which is answered for certain; else wait at
    /// most [`WAIT_AT_MOST`]. `expired` as above.
    Wait {
        landed: OwnedNotified,
        certain: bool,
        expired: Expired,
    },
}

/// Per take of units ahead, oldest first: the store's answer to it, and how many of its units.
type Receipts = VecDeque<(Arc<Decision>, u64)>;

/// Units in hand given back at shutdown: their key, quota and receipts.
type Held = (StorageKey, Option<QuotaLookup>, Receipts);

/// A take's settled answer: what the request goes on with, and the store's answer to the take
/// with how many of its units come after the request's own.
type Settled = (Result<Decision, StoreError>, Option<(Arc<Decision>, u64)>);

/// Units dropped from those in hand: per take, the store's answer to it and its units.
#[derive(Debug, Default)]
pub(crate) struct Expired {
    units: u64,
    receipts: Receipts,
}

/// How long a request waits at most for a take in flight (one whose requester left never
/// lands) before it asks the store itself.
pub(crate) const WAIT_AT_MOST: Duration = Duration::from_millis(50);

impl Prefetched {
    /// Units of at most `max` per identity.
    pub(crate) fn new(max: u64) -> Self {
        Prefetched {
            max,
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            resets: OnceLock::new(),
        }
    }

    /// Whether units may be taken ahead now: not while a store that tells of resets isn't
    /// heard (its subscription is down, or not up yet), since a reset would then miss them.
    /// Registers with `store` at the first call.
    fn may_take_ahead(self: &Arc<Self>, store: &dyn Store) -> bool {
        let watch = self.resets.get_or_init(|| {
            let listener: Arc<dyn ResetListener> = self.clone();
            store.watch_resets(Arc::downgrade(&listener))
        });
        watch.as_ref().is_none_or(ResetWatch::is_live)
    }

    /// Drops every unit in hand, and those of takes in flight (notices may have been lost).
    fn drop_units(&self) {
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            for allowance in shard.values_mut() {
                allowance.forget_units();
            }
        }
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, Shard> {
        let index = (self.hasher.hash_one(key) % SHARDS as u64) as usize;
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Spends `cost` units of `key` from those in hand, or says to wait for a take in flight
    /// (if `may_wait`), or how many to take ahead.
    pub(crate) fn spend(
        &self,
        key: &str,
        cost: u64,
        now: Instant,
        may_wait: bool,
        may_take_ahead: bool,
    ) -> Spend {
        let mut shard = self.shard(key);
        let Some(allowance) = shard.get_mut(key) else {
            // Never seen: the exact path. Remembered, so that a second ask soon after is hot.
            if shard.len() >= MAX_PER_SHARD {
                shard.retain(|_, allowance| allowance.units > 0 || allowance.pending > 0);
                if shard.len() >= MAX_PER_SHARD {
                    shard.clear();
                }
            }
            shard.insert(key.into(), Allowance::new(cost, now));
            return Spend::Ask {
                extra: 0,
                expired: Expired::default(),
            };
        };
        let mut expired = Expired::default();
        if allowance.units > 0 && now >= allowance.valid_until {
            expired = Expired {
                units: std::mem::take(&mut allowance.units),
                receipts: std::mem::take(&mut allowance.receipts),
            };
        }
        if allowance.units >= cost
            && let Some(decision) = &allowance.decision
        {
            allowance.units -= cost;
            let decision = as_held(decision, allowance.units, now - allowance.taken_at);
            let charged = allowance.spend_receipts(cost);
            let take_ahead = if may_take_ahead {
                self.take_ahead(allowance, now)
            } else {
                0
            };
            return Spend::Local {
                decision,
                charged,
                take_ahead,
            };
        }
        let since_ask = now.saturating_duration_since(allowance.last_ask);
        // A take unanswered for so long was dropped with its request (a client that left):
        // its units never came.
        if since_ask > IDLE {
            allowance.pending = 0;
            allowance.void = 0;
        }
        // A take in flight brings units soon: a round trip, without a check of its own.
        if may_wait && allowance.pending > 0 {
            allowance.wanted = allowance.wanted.saturating_add(cost);
            let landed = allowance.landed.get_or_insert_with(Arc::default).clone();
            return Spend::Wait {
                landed: landed.notified_owned(),
                certain: allowance.ahead_in_flight,
                expired,
            };
        }
        let hot = since_ask < HOT;
        allowance.last_ask = now;
        let target = if hot {
            allowance
                .last_take
                .saturating_mul(2)
                .clamp(cost, self.max.max(cost))
        } else {
            // Cooled down: start over from the exact path.
            allowance.last_take = cost;
            cost
        };
        let room = self
            .max
            .saturating_sub(allowance.units + allowance.pending + cost);
        let extra = if may_take_ahead {
            target.saturating_sub(cost).min(room)
        } else {
            0
        };
        allowance.pending += extra;
        Spend::Ask { extra, expired }
    }

    /// How many units `allowance`, just spent from, takes ahead in the background now: none
    /// while a take is in flight or more than a quarter of the last take is in hand, nor once
    /// the last take lasted longer than [`IDLE`] (it isn't hot); doubled if it went within
    /// [`HOT`]; never more than the max held.
    fn take_ahead(&self, allowance: &mut Allowance, now: Instant) -> u64 {
        if allowance.pending > 0 || allowance.units.saturating_mul(4) > allowance.last_take {
            return 0;
        }
        let lasted = now.saturating_duration_since(allowance.taken_at);
        let size = if lasted < HOT {
            allowance.last_take.saturating_mul(2)
        } else if lasted < IDLE {
            allowance.last_take
        } else {
            return 0;
        };
        let size = size.min(self.max);
        let extra = size.saturating_sub(allowance.units);
        if extra > 0 {
            allowance.pending = extra;
            allowance.ahead_in_flight = true;
            allowance.last_take = size;
            allowance.last_ask = now;
        }
        extra
    }

    /// A take of `cost + extra` units was admitted, answered with `decision`: the extra units
    /// are in hand until `valid_until`. Returns the decision as the requester tells it (the
    /// units in hand counted in what is left).
    pub(crate) fn took(
        &self,
        (key, quota): (&StorageKey, Option<&QuotaLookup>),
        cost: u64,
        extra: u64,
        decision: &Arc<Decision>,
        valid_until: Instant,
        now: Instant,
    ) -> Decision {
        let mut shard = self.shard(key.as_str());
        let allowance = shard
            .entry(key.as_str().into())
            .or_insert_with(|| Allowance::new(cost, now));
        if allowance.charged.is_none() {
            allowance.charged = Some((key.clone(), quota.cloned()));
        }
        allowance.pending = allowance.pending.saturating_sub(extra);
        if cost == 0 {
            allowance.ahead_in_flight = false;
        }
        // Units asked for before a reset were charged before it: they don't go in hand.
        let voided = extra.min(allowance.void);
        allowance.void -= voided;
        let extra = extra - voided;
        // Units of an earlier take still in hand keep their own end and receipt: all end at
        // the earlier, and go back where the earlier went (never more than it holds).
        if allowance.units > 0 && allowance.valid_until > now {
            allowance.valid_until = allowance.valid_until.min(valid_until);
        } else {
            allowance.units = 0;
            allowance.valid_until = valid_until;
            allowance.receipts.clear();
        }
        if extra > 0 {
            allowance.receipts.push_back((decision.clone(), extra));
        }
        allowance.units += extra;
        allowance.taken_at = now;
        allowance.decision = Some(Decision::clone(decision));
        let wanted = std::mem::take(&mut allowance.wanted);
        allowance.last_take = allowance.last_take.max(cost + extra).max(wanted);
        if let Some(landed) = &allowance.landed {
            landed.notify_waiters();
        }
        as_held(decision, allowance.units, Duration::ZERO)
    }

    /// A take of `cost + extra` units was refused or failed: nothing is in hand from it, and the
    /// next take starts over from the cost alone (near the limit, an instance takes fewer).
    pub(crate) fn untook(&self, key: &str, cost: u64, extra: u64) {
        if let Some(allowance) = self.shard(key).get_mut(key) {
            allowance.pending = allowance.pending.saturating_sub(extra);
            allowance.void = allowance.void.min(allowance.pending);
            if cost == 0 {
                allowance.ahead_in_flight = false;
            }
            allowance.last_take = cost;
            allowance.wanted = 0;
            // Those waiting for it ask for themselves.
            if let Some(landed) = &allowance.landed {
                landed.notify_waiters();
            }
        }
    }

    /// Takes every unit in hand out of the table, for giving back (an instance shutting down):
    /// what each was charged to, and per take that charged them, its answer and its units.
    fn drain(&self) -> Vec<Held> {
        let mut held = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            for allowance in shard.values_mut() {
                let units = std::mem::take(&mut allowance.units);
                let receipts = std::mem::take(&mut allowance.receipts);
                if units > 0
                    && let Some((key, quota)) = &allowance.charged
                {
                    held.push((key.clone(), quota.clone(), receipts));
                }
            }
        }
        held
    }
}

impl ResetListener for Prefetched {
    fn key_reset(&self, key: &str) {
        let mut shard = self.shard(key);
        if let Some(allowance) = shard.get_mut(key) {
            allowance.forget_units();
        }
    }

    fn notices_lost(&self) {
        self.drop_units();
    }
}

impl Allowance {
    /// Forgets the units in hand and those of the takes in flight (they land void): the
    /// identity was reset, and they were charged before. Not given back.
    fn forget_units(&mut self) {
        self.units = 0;
        self.receipts.clear();
        self.void = self.pending;
    }

    /// Spends `cost` units from the receipts, oldest take first: the answer to the take they
    /// came from and how many of its units come after them (the request's own charge, should it
    /// be given back).
    fn spend_receipts(&mut self, cost: u64) -> Option<(Arc<Decision>, u64)> {
        // Its units are the take's next ones: what the take holds after them says which (a
        // token bucket's slice of the take's time). Units spanning two takes: none known.
        let charged = self
            .receipts
            .front()
            .filter(|(_, units)| *units >= cost)
            .map(|(decision, units)| (decision.clone(), units - cost));
        let mut left = cost;
        while left > 0
            && let Some((_, units)) = self.receipts.front_mut()
        {
            let spent = left.min(*units);
            *units -= spent;
            left -= spent;
            if *units == 0 {
                self.receipts.pop_front();
            }
        }
        charged
    }

    fn new(cost: u64, now: Instant) -> Self {
        Allowance {
            units: 0,
            pending: 0,
            void: 0,
            ahead_in_flight: false,
            valid_until: now,
            taken_at: now,
            decision: None,
            last_take: cost,
            charged: None,
            receipts: VecDeque::new(),
            // The first ask: a second one within HOT makes the identity hot.
            last_ask: now,
            wanted: 0,
            landed: None,
        }
    }
}

/// `decision` (a take's) as a request tells it `elapsed` after the take, with `units` still in
/// hand: admitted, each state's remaining the shared remaining plus the units in hand (never
/// more than its limit: what this instance could still admit), its times counted down.
fn as_held(decision: &Decision, units: u64, elapsed: Duration) -> Decision {
    let mut held = decision.clone();
    held.allowed = true;
    held.delay = Duration::ZERO;
    held.quota_alerts.clear();
    held.lease = None;
    held.now_unix_ms = held
        .now_unix_ms
        .saturating_add(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX));
    for state in &mut held.rules {
        state.remaining = state.remaining.saturating_add(units).min(state.limit);
        state.reset = state.reset.saturating_sub(elapsed);
        state.retry_after = None;
    }
    held
}

impl Prefetched {
    /// The table of a policy that prefetches.
    pub(crate) fn of(policy: &Policy) -> Option<Arc<Prefetched>> {
        policy.prefetch().map(|max| Arc::new(Prefetched::new(max)))
    }
}

/// What a request of a prefetching policy does before asking the store.
#[allow(
    clippy::large_enum_variant,
    reason = "returned at once, never stored: boxing the admission would allocate per request"
)]
pub(crate) enum Spent {
    /// Admitted from units in hand (its charge still to be made: of the request's key and
    /// quota, answered by the take that charged its units).
    Admit(Admission, Charged),
    /// Wait for a take in flight (for certain it lands, or at most [`WAIT_AT_MOST`]), then
    /// spend again.
    Wait(OwnedNotified, bool),
    /// Ask the store for its cost and this many units ahead (0 under a policy that doesn't
    /// prefetch).
    Ask(u64),
}

impl Limiter {
    /// Admits a request of `cost` for `key` from units in hand, or says to wait for a take in
    /// flight (if `may_wait`), or how many units to ask for ahead.
    pub(super) fn spend_prefetched(
        self: &Arc<Self>,
        key: &StorageKey,
        cost: u64,
        quota: Option<&QuotaLookup>,
        may_wait: bool,
    ) -> Spent {
        let Some(prefetched) = &self.prefetched else {
            return Spent::Ask(0);
        };
        let may_take_ahead = prefetched.may_take_ahead(self.store());
        match prefetched.spend(key.as_str(), cost, Instant::now(), may_wait, may_take_ahead) {
            Spend::Local {
                decision,
                charged,
                take_ahead,
            } => {
                if take_ahead > 0 {
                    self.take_ahead(prefetched, key, quota, take_ahead);
                }
                let metrics = self.metrics();
                metrics.request(Outcome::Allowed);
                metrics.prefetch("spent", cost);
                metrics.admitted(&decision);
                let headers =
                    LimitHeaders::new(&self.answers, &self.policy, &decision, self.legacy_headers);
                let admission = Admission {
                    headers: Some(headers),
                    lease: None,
                    decision: Some(decision),
                    charge: None,
                };
                let charged = charged.map_or(Charged::Unknown, |(take, after)| {
                    Charged::Taken(take, after)
                });
                Spent::Admit(admission, charged)
            }
            Spend::Wait {
                landed,
                certain,
                expired,
            } => {
                self.expired(key, expired, quota);
                Spent::Wait(landed, certain)
            }
            Spend::Ask { extra, expired } => {
                self.expired(key, expired, quota);
                Spent::Ask(extra)
            }
        }
    }

    /// Forgets the units `checked` would have asked for ahead: it won't ask (answered from the
    /// refusal cache).
    pub(super) fn untake(&self, checked: &Checked) {
        if let Some(prefetched) = &self.prefetched
            && checked.extra > 0
        {
            prefetched.untook(checked.key.as_str(), checked.cost, checked.extra);
        }
    }

    /// Units that sat in hand past their end: counted; a token bucket's are given back, as far
    /// as time has not repaid them already (its window never ends, so they would be lost for
    /// every instance), the others' window ended and took them along.
    fn expired(self: &Arc<Self>, key: &StorageKey, expired: Expired, quota: Option<&QuotaLookup>) {
        if expired.units == 0 {
            return;
        }
        self.metrics().prefetch("expired", expired.units);
        if self.policy.algorithm() == Algorithm::TokenBucket {
            for (charged, units) in &expired.receipts {
                self.give_back(key, *units, quota, charged);
            }
        }
    }

    /// Gives `units` of `key` back to the store, where the take answered `charged` charged
    /// them, in the background.
    fn give_back(
        self: &Arc<Self>,
        key: &StorageKey,
        units: u64,
        quota: Option<&QuotaLookup>,
        charged: &Decision,
    ) {
        let request = self.store_request(key, quota).cost(units);
        let mut refund = self.store().give_back(&request, charged);
        if refund.take_ready().is_none()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                // A failure leaves the units counted: on the safe side.
                let _ = refund.await;
            });
        }
    }

    /// Takes `units` of `key` ahead in the background: in hand once the store admits them, else
    /// forgotten (near the limit, the next request asks for its cost alone).
    fn take_ahead(
        self: &Arc<Self>,
        prefetched: &Arc<Prefetched>,
        key: &StorageKey,
        quota: Option<&QuotaLookup>,
        units: u64,
    ) {
        let request = self.store_request(key, quota).cost(units);
        let started = Instant::now();
        let mut check = self.store().check(&request);
        let (limiter, held) = (self.clone(), prefetched.clone());
        let (charged_key, quota) = (key.clone(), quota.cloned());
        let land = move |result: Result<Decision, StoreError>| {
            limiter
                .metrics()
                .store_call(started.elapsed(), result.as_ref().map(|_| ()));
            match result {
                Ok(decision) if decision.allowed => {
                    let charged = (&charged_key, quota.as_ref());
                    let decision = Arc::new(decision);
                    limiter.landed(&held, charged, (0, units), &decision, started);
                }
                // Refused: nothing in hand; failed: the units may be charged, on the safe side.
                _ => held.untook(charged_key.as_str(), 0, units),
            }
        };
        if let Some(result) = check.take_ready() {
            land(result);
        } else if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { land(check.await) });
        } else {
            prefetched.untook(key.as_str(), 0, units);
        }
    }

    /// `extra` units (beyond a request's `cost`) taken with `decision`, asked for at `started`,
    /// are in hand: until the earliest window that charged them ends. Returns the decision as
    /// the requester tells it.
    fn landed(
        &self,
        prefetched: &Prefetched,
        charged: (&StorageKey, Option<&QuotaLookup>),
        (cost, extra): (u64, u64),
        decision: &Arc<Decision>,
        started: Instant,
    ) -> Decision {
        let now = Instant::now();
        let until = started + self.units_last(decision, charged.1);
        self.metrics().prefetch("taken", extra);
        prefetched.took(charged, cost, extra, decision, until, now)
    }

    /// Settles a check's answer for units taken ahead: `None` when a take was refused (the
    /// request then asks for its cost alone), else the answer the request goes on with, the
    /// units in hand counted in what it tells, and the store's answer to the take (what the
    /// request's own charge was answered, when it differs from what it tells).
    pub(super) fn settle_take(
        &self,
        result: Result<Decision, StoreError>,
        checked: &Checked,
    ) -> Option<Settled> {
        let Some(prefetched) = self.prefetched.as_ref().filter(|_| checked.extra > 0) else {
            return Some((result, None));
        };
        let (key, cost, extra) = (checked.key.as_str(), checked.cost, checked.extra);
        match result {
            Ok(decision) if decision.allowed => {
                let charged = (&checked.key, checked.quota.as_ref());
                let started = tokio_instant(checked.started);
                let taken = Arc::new(decision);
                let told = self.landed(prefetched, charged, (cost, extra), &taken, started);
                // The request's own units are the take's first: `extra` come after them.
                Some((Ok(told), Some((taken, extra))))
            }
            Ok(_) => {
                prefetched.untook(key, cost, extra);
                None
            }
            Err(error) => {
                prefetched.untook(key, cost, extra);
                Some((Err(error), None))
            }
        }
    }

    /// How long units taken with `decision` may be spent, from when they were asked for: until
    /// the earliest window that charged them ends, in the store's time (counted from the ask,
    /// which is no later than the store's reading: never past the end). A token bucket's units
    /// stay valid until time has repaid the take (its full time), and at most [`IDLE`].
    fn units_last(&self, decision: &Decision, quota: Option<&QuotaLookup>) -> Duration {
        let now = decision.now_unix_ms;
        let policy = &self.policy;
        if policy.algorithm() == Algorithm::TokenBucket {
            // Until the take's full time, when time has repaid it: the bucket may then be full
            // again, having forgotten the charge of the units still in hand (spent later, they
            // would pass the burst). Its store time is read to the millisecond, so a
            // millisecond less. And at most IDLE, unused.
            let now_us = now.saturating_mul(1_000).saturating_add(999);
            let until_full = decision
                .rules
                .iter()
                .filter_map(|state| state.bucket_full_at_us)
                .map(|full_at| full_at.saturating_sub(now_us))
                .min()
                .unwrap_or(0);
            return IDLE.min(Duration::from_micros(until_full));
        }
        let window_left = |period: u64| {
            let period = period.max(1);
            period - now % period
        };
        let rules = policy
            .rules()
            .iter()
            .map(|rule| window_left(rule.period_ms()));
        let day = policy.quota().zip(quota).map(|(quota, _)| {
            let day = quota.day_ms().max(1);
            let start = now - (now + day - quota.day_start_offset_ms() % day) % day;
            start + day - now
        });
        Duration::from_millis(rules.chain(day).min().unwrap_or(0))
    }
}

impl Limiter {
    /// Drops the units this limiter (and its overrides') holds ahead for `key`: it was reset.
    pub(crate) fn forget_units(&self, key: &str) {
        let overriding = self.overriding.get().into_iter().flatten().flatten();
        let limiters = std::iter::once(self).chain(overriding.map(|own| &**own));
        for limiter in limiters {
            if let Some(prefetched) = &limiter.prefetched {
                prefetched.key_reset(key);
            }
        }
    }

    /// Gives back every unit this limiter (and its overrides') took ahead and didn't spend, and
    /// waits for the store: for an instance shutting down. A fixed window's or sliding counter's
    /// units come back only while their window lasts; a failure leaves them counted.
    pub(crate) async fn give_back_prefetched(&self) {
        let overriding = self.overriding.get().into_iter().flatten().flatten();
        let limiters = std::iter::once(self).chain(overriding.map(|own| &**own));
        for limiter in limiters {
            let Some(prefetched) = &limiter.prefetched else {
                continue;
            };
            for (key, quota, receipts) in prefetched.drain() {
                for (charged, units) in receipts {
                    let request = limiter.store_request(&key, quota.as_ref()).cost(units);
                    let _ = limiter.store().give_back(&request, &charged).await;
                }
            }
        }
    }
}

/// `started` (a wall-clock instant) on tokio's clock, which tests may pause.
fn tokio_instant(started: std::time::Instant) -> Instant {
    let now = Instant::now();
    now.checked_sub(started.elapsed()).unwrap_or(now)
}

/// How long a token bucket's units taken ahead may sit unused before they are given back.
const IDLE: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Waker};

    use super::*;
    use crate::decision::RuleState;

    fn key(identity: &str) -> StorageKey {
        crate::Policy::builder("p")
            .rule(crate::Rule::per_minute(1))
            .build()
            .unwrap()
            .named_key(identity)
    }

    fn decision(remaining: u64) -> Decision {
        Decision {
            allowed: true,
            rules: vec![RuleState {
                limit: 1_000,
                remaining,
                reset: Duration::from_secs(10),
                retry_after: None,
                bucket_full_at_us: None,
            }],
            now_unix_ms: 0,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
        }
    }

    #[test]
    fn a_cold_key_takes_single_units_and_a_hot_one_doubles_up_to_the_max() {
        let prefetched = Prefetched::new(16);
        let start = Instant::now();
        // Asks a second apart: never hot, never more than the cost.
        for second in 0..3 {
            let at = start + Duration::from_secs(second);
            assert!(matches!(
                prefetched.spend("cold", 1, at, false, true),
                Spend::Ask { extra: 0, .. }
            ));
        }
        // Requests 100 µs apart, each take answered at once: the second asks for 2 units; from
        // then on each take goes in the background once three quarters of the last are spent,
        // doubling (less what is still in hand) up to the max: no request asks again.
        let mut takes = Vec::new();
        let mut at = start;
        let hot = key("hot");
        for request in 0..60 {
            at += Duration::from_micros(100);
            let (cost, extra) = match prefetched.spend(hot.as_str(), 1, at, false, true) {
                Spend::Local { take_ahead: 0, .. } => continue,
                Spend::Local { take_ahead, .. } => (0, take_ahead),
                Spend::Ask { extra, .. } => {
                    assert!(request < 2, "request {request} asked the store");
                    (1, extra)
                }
                Spend::Wait { .. } => unreachable!("asked not to wait"),
            };
            takes.push(cost + extra);
            let until = at + Duration::from_secs(1);
            prefetched.took(
                (&hot, None),
                cost,
                extra,
                &Arc::new(decision(500)),
                until,
                at,
            );
        }
        assert_eq!(&takes[..5], [1, 2, 4, 7, 14]);
        assert!(takes[5..].iter().all(|&take| take == 12), "{takes:?}");
    }

    #[test]
    fn one_take_ahead_at_a_time_and_none_for_a_key_spent_slowly() {
        let prefetched = Prefetched::new(8);
        let start = Instant::now();
        let k = key("k");
        let spend = |at| match prefetched.spend(k.as_str(), 1, at, false, true) {
            Spend::Local { take_ahead, .. } => Some(take_ahead),
            Spend::Ask { .. } => None,
            Spend::Wait { .. } => unreachable!("asked not to wait"),
        };
        assert_eq!(spend(start), None);
        let at = start + Duration::from_millis(1);
        assert_eq!(spend(at), None);
        prefetched.took(
            (&k, None),
            1,
            7,
            &Arc::new(decision(50)),
            at + Duration::from_secs(60),
            at,
        );
        // 7 in hand of a take of 8: the 5th request leaves 2 (a quarter) and takes 6 ahead (the
        // max less what is in hand); while that is in flight nobody takes more, and the units
        // left are still spent.
        let spent: Vec<_> = (0..7).map(|_| spend(at).unwrap()).collect();
        assert_eq!(spent, [0, 0, 0, 0, 6, 0, 0]);
        assert_eq!(
            spend(at),
            None,
            "nothing in hand while the take is in flight"
        );
        // One that may wait for the take in flight is woken when it lands.
        let Spend::Wait { landed, .. } = prefetched.spend(k.as_str(), 1, at, true, true) else {
            panic!("a take is in flight: wait for it");
        };
        let mut landed = std::pin::pin!(landed);
        let mut context = Context::from_waker(Waker::noop());
        assert!(landed.as_mut().poll(&mut context).is_pending());
        // The take lands; spending its units over 2 s is not hot: no take ahead.
        prefetched.took(
            (&k, None),
            0,
            6,
            &Arc::new(decision(40)),
            at + Duration::from_secs(60),
            at,
        );
        assert!(landed.as_mut().poll(&mut context).is_ready());
        let slowly: Vec<_> = (1..=6)
            .map(|second| spend(at + Duration::from_secs(second)).unwrap())
            .collect();
        assert_eq!(slowly, [0; 6]);
    }

    #[test]
    fn units_held_never_exceed_the_max_and_expire_with_their_window() {
        let prefetched = Prefetched::new(10);
        let start = Instant::now();
        let k = key("k");
        let ask = |at| match prefetched.spend(k.as_str(), 1, at, false, true) {
            Spend::Ask { extra, .. } => extra,
            Spend::Local { .. } => panic!("nothing in hand"),
            Spend::Wait { .. } => unreachable!("asked not to wait"),
        };
        assert_eq!(ask(start), 0);
        // Hot, and two asks in flight at once: together at most the max.
        let first = ask(start + Duration::from_millis(1));
        let second = ask(start + Duration::from_millis(2));
        assert!(first + second + 2 <= 10, "{first} + {second}");
        let until = start + Duration::from_millis(50);
        let told = prefetched.took((&k, None), 1, first, &Arc::new(decision(100)), until, start);
        assert_eq!(told.rules[0].remaining, 100 + first);
        for _ in 0..first {
            assert!(matches!(
                prefetched.spend(k.as_str(), 1, start + Duration::from_millis(3), false, true),
                Spend::Local { .. }
            ));
        }
        // In hand again, then the window ends: the units are dropped, not spent.
        prefetched.untook(k.as_str(), 1, second);
        prefetched.took((&k, None), 1, 3, &Arc::new(decision(100)), until, start);
        match prefetched.spend(k.as_str(), 1, until, false, true) {
            Spend::Ask { expired, .. } => assert_eq!(expired.units, 3),
            Spend::Local { .. } => panic!("spent a unit past its window"),
            Spend::Wait { .. } => unreachable!("asked not to wait"),
        }
    }
}
