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
//!
//! The table (`table.rs`) owns the units; this module's functions are what a request does with
//! it, handed its limiter (for the store, the metrics and the headers): [`prepare`] before asking,
//! [`judge_take`] after, [`forget_key`] on a reset, [`give_back_unspent`] at shutdown.
//!
//! [`PolicyBuilder::prefetch`]: crate::PolicyBuilder::prefetch

mod table;
#[cfg(test)]
mod tests;

use table::TakeAnswer;
pub(crate) use table::{Expired, IDLE, Prefetched, Spend, WAIT_AT_MOST};

use std::sync::Arc;
use std::time::Duration;

// Tokio's clock, which tests can pause and move with the stores' clocks.
use tokio::time::Instant;

use super::{Admission, Ask, Charged, Limiter, Prepared, Price, Told};
use crate::decision::Decision;
use crate::limiter::telemetry::Outcome;
use crate::policy::quota::QuotaLookup;
use crate::policy::{Algorithm, StorageKey};
use crate::response::LimitHeaders;
use crate::response::Protocol;
use crate::store::{ResetListener, StoreError};

/// What a request of `price` for `key` (and the day's `quota`) comes to before it asks the store
/// (`receipt`: its admission keeps its charge): admitted at once from units in hand; waiting for
/// a take in flight, then doing as it then finds; or asking the store for its cost and, under a
/// prefetching policy, units ahead.
pub(super) fn prepare(
    limiter: &Arc<Limiter>,
    key: StorageKey,
    price: Price,
    quota: Option<QuotaLookup>,
    protocol: Protocol,
    receipt: bool,
) -> Prepared {
    if limiter.prefetched.is_none() {
        return limiter.prepare_ask(key, price, quota, protocol, 0, receipt);
    }
    match spend(limiter, &key, price.cost, quota.as_ref(), true) {
        Spend::Local {
            decision, charged, ..
        } => admit(limiter, key, price, quota, receipt, decision, charged),
        Spend::Ask { extra, .. } => {
            limiter.prepare_ask(key, price, quota, protocol, extra, receipt)
        }
        Spend::Wait {
            landed, certain, ..
        } => {
            let limiter = limiter.clone();
            let deadline = Instant::now() + WAIT_AT_MOST;
            Prepared::AwaitUnits(Box::pin(async move {
                let (mut landed, mut certain) = (landed, certain);
                // Until units are in hand, or no take is in flight, or the wait is too long: a
                // take in flight may bring fewer units than those waiting want. (A take in the
                // background lands for certain: no timer.)
                let extra = loop {
                    if certain {
                        landed.await;
                    } else {
                        let _ = tokio::time::timeout_at(deadline, landed).await;
                    }
                    let may_wait = Instant::now() < deadline;
                    match spend(&limiter, &key, price.cost, quota.as_ref(), may_wait) {
                        Spend::Local {
                            decision, charged, ..
                        } => return admit(&limiter, key, price, quota, receipt, decision, charged),
                        Spend::Wait {
                            landed: next,
                            certain: sure,
                            ..
                        } => (landed, certain) = (next, sure),
                        Spend::Ask { extra, .. } => break extra,
                    }
                };
                // Told as this limiter's, which may be an override's.
                match limiter.prepare_ask(key, price, quota, protocol, extra, receipt) {
                    Prepared::Check(ask) => Prepared::CheckBy(limiter, ask),
                    Prepared::Respond(refusal, protocol) => {
                        Prepared::RespondBy(limiter, refusal, protocol)
                    }
                    other => other,
                }
            }))
        }
    }
}

/// The table's answer to a request of `cost` for `key`, its side work done: a hot identity's
/// next take started in the background, units that sat in hand too long counted (and a token
/// bucket's given back). A policy that doesn't prefetch asks for its cost alone.
fn spend(
    limiter: &Arc<Limiter>,
    key: &StorageKey,
    cost: u64,
    quota: Option<&QuotaLookup>,
    may_wait: bool,
) -> Spend {
    let Some(prefetched) = &limiter.prefetched else {
        return Spend::Ask {
            extra: 0,
            expired: Expired::default(),
        };
    };
    let may_take_ahead = prefetched.may_take_ahead(limiter.store());
    let mut spent = prefetched.spend(key.as_str(), cost, Instant::now(), may_wait, may_take_ahead);
    match &mut spent {
        Spend::Local { take_ahead, .. } if *take_ahead > 0 => {
            take_units_ahead(limiter, prefetched, key, quota, *take_ahead);
        }
        Spend::Local { .. } => {}
        Spend::Wait { expired, .. } | Spend::Ask { expired, .. } => {
            count_expired(limiter, key, std::mem::take(expired), quota);
        }
    }
    spent
}

/// The admission of a request from units in hand, which the store answered `decision` (the
/// take that charged them answered `charged`): its headers, and its charge when it keeps one.
fn admit(
    limiter: &Arc<Limiter>,
    key: StorageKey,
    price: Price,
    quota: Option<QuotaLookup>,
    receipt: bool,
    decision: Decision,
    charged: Option<(Arc<Decision>, u64)>,
) -> Prepared {
    let metrics = limiter.metrics();
    metrics.request(Outcome::Allowed);
    metrics.prefetch("spent", price.cost);
    metrics.admitted(&decision);
    let headers = LimitHeaders::new(
        &limiter.answers,
        &limiter.policy,
        &decision,
        limiter.legacy_headers,
    );
    let admission = Admission {
        headers: Some(headers),
        lease: None,
        told: Told::Decision(decision),
        ..Admission::unchecked()
    };
    if !receipt {
        return Prepared::Admit(admission);
    }
    let charged = charged.map_or(Charged::Unknown, |(take, after)| {
        Charged::Taken(take, after)
    });
    Prepared::Admit(admission.charging(limiter.clone(), key, price, quota, charged))
}

/// Forgets the units `ask` would have asked for ahead: it won't ask (answered from the
/// refusal cache).
pub(super) fn untake(limiter: &Limiter, ask: &Ask) {
    if let Some(prefetched) = &limiter.prefetched
        && ask.extra > 0
    {
        prefetched.untook(ask.key.as_str(), ask.price.cost, ask.extra);
    }
}

/// Units that sat in hand past their end: counted; a token bucket's are given back, as far
/// as time has not repaid them already (its window never ends, so they would be lost for
/// every instance), the others' window ended and took them along.
fn count_expired(
    limiter: &Arc<Limiter>,
    key: &StorageKey,
    expired: Expired,
    quota: Option<&QuotaLookup>,
) {
    if expired.units == 0 {
        return;
    }
    limiter.metrics().prefetch("expired", expired.units);
    if limiter.policy.algorithm() == Algorithm::TokenBucket {
        for (charged, units) in &expired.receipts {
            give_back(limiter, key, *units, quota, charged);
        }
    }
}

/// Gives `units` of `key` back to the store, where the take answered `charged` charged
/// them, in the background.
fn give_back(
    limiter: &Arc<Limiter>,
    key: &StorageKey,
    units: u64,
    quota: Option<&QuotaLookup>,
    charged: &Decision,
) {
    let request = limiter.store_request(key, quota).cost(units);
    // A failure leaves the units counted: on the safe side.
    limiter.store().give_back(&request, charged).then(drop);
}

/// Takes `units` of `key` ahead in the background: in hand once the store admits them, else
/// forgotten (near the limit, the next request asks for its cost alone).
fn take_units_ahead(
    limiter: &Arc<Limiter>,
    prefetched: &Arc<Prefetched>,
    key: &StorageKey,
    quota: Option<&QuotaLookup>,
    units: u64,
) {
    let request = limiter.store_request(key, quota).cost(units);
    let started = Instant::now();
    let mut check = limiter.store().check(&request);
    let (limiter, held) = (limiter.clone(), prefetched.clone());
    let (charged_key, quota) = (key.clone(), quota.cloned());
    let land = move |result: Result<Decision, StoreError>| {
        limiter
            .metrics()
            .store_call(started.elapsed(), result.as_ref().map(|_| ()));
        match result {
            Ok(decision) if decision.allowed => {
                let charged = (&charged_key, quota.as_ref());
                let decision = Arc::new(decision);
                landed(&limiter, &held, charged, (0, units), &decision, started);
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
    limiter: &Limiter,
    prefetched: &Prefetched,
    charged: (&StorageKey, Option<&QuotaLookup>),
    (cost, extra): (u64, u64),
    decision: &Arc<Decision>,
    started: Instant,
) -> Decision {
    let now = Instant::now();
    let until = started + units_last(limiter, decision, charged.1);
    limiter.metrics().prefetch("taken", extra);
    prefetched.took(charged, cost, extra, decision, until, now)
}

/// Judges a check's answer for units taken ahead: `None` when a take was refused (the
/// request then asks for its cost alone), else the answer the request goes on with, the
/// units in hand counted in what it tells, and the store's answer to the take (what the
/// request's own charge was answered, when it differs from what it tells).
pub(super) fn judge_take(
    limiter: &Limiter,
    result: Result<Decision, StoreError>,
    ask: &Ask,
) -> Option<TakeAnswer> {
    let Some(prefetched) = limiter.prefetched.as_ref().filter(|_| ask.extra > 0) else {
        return Some((result, None));
    };
    let (key, cost, extra) = (ask.key.as_str(), ask.price.cost, ask.extra);
    match result {
        Ok(decision) if decision.allowed => {
            let charged = (&ask.key, ask.quota.as_ref());
            let started = ask.started.map_or_else(Instant::now, tokio_instant);
            let taken = Arc::new(decision);
            let told = landed(limiter, prefetched, charged, (cost, extra), &taken, started);
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
fn units_last(limiter: &Limiter, decision: &Decision, quota: Option<&QuotaLookup>) -> Duration {
    let now = decision.now_unix_ms;
    let policy = &limiter.policy;
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

/// Drops the units `limiter` (and its overrides') holds ahead for `key`: it was reset.
pub(crate) fn forget_key(limiter: &Limiter, key: &str) {
    for each in with_overrides(limiter) {
        if let Some(prefetched) = &each.prefetched {
            prefetched.key_reset(key);
        }
    }
}

/// Gives back every unit `limiter` (and its overrides') took ahead and didn't spend, and waits
/// for the store: for an instance shutting down. A fixed window's or sliding counter's units come
/// back only while their window lasts; a failure leaves them counted.
pub(crate) async fn give_back_unspent(limiter: &Limiter) {
    for each in with_overrides(limiter) {
        let Some(prefetched) = &each.prefetched else {
            continue;
        };
        for (key, quota, receipts) in prefetched.drain() {
            for (charged, units) in receipts {
                let request = each.store_request(&key, quota.as_ref()).cost(units);
                let _ = each.store().give_back(&request, &charged).await;
            }
        }
    }
}

/// `limiter` and the limiters of its `rules` overrides made so far.
fn with_overrides(limiter: &Limiter) -> impl Iterator<Item = &Limiter> {
    let overriding = limiter.overriding.get().into_iter().flatten().flatten();
    std::iter::once(limiter).chain(overriding.map(|own| &**own))
}

/// `started` (a wall-clock instant) on tokio's clock, which tests may pause.
fn tokio_instant(started: std::time::Instant) -> Instant {
    let now = Instant::now();
    now.checked_sub(started.elapsed()).unwrap_or(now)
}
