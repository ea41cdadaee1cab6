//! The table of units taken ahead: per identity, the units in hand, the take in flight, and the
//! receipts of the takes that charged them (see the [module docs](super)).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;
// Tokio's clock, which tests can pause and move with the stores' clocks.
use tokio::time::Instant;

use crate::decision::Decision;
use crate::policy::quota::QuotaLookup;
use crate::policy::{Policy, StorageKey};
use crate::store::{ResetListener, ResetWatch, Store, StoreError};

/// How long a token bucket's units taken ahead may sit unused before they are given back.
pub(crate) const IDLE: Duration = Duration::from_secs(1);

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

/// A take's judged answer: what the request goes on with, and the store's answer to the take
/// with how many of its units come after the request's own.
pub(super) type TakeAnswer = (Result<Decision, StoreError>, Option<(Arc<Decision>, u64)>);

/// Units dropped from those in hand: per take, the store's answer to it and its units.
#[derive(Debug, Default)]
pub(crate) struct Expired {
    pub(super) units: u64,
    pub(super) receipts: Receipts,
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
    pub(super) fn may_take_ahead(self: &Arc<Self>, store: &dyn Store) -> bool {
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
    pub(super) fn drain(&self) -> Vec<Held> {
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
