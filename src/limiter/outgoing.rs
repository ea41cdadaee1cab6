//! An outgoing call's decision, the flow of a door that waits rather than refuses (the outbound
//! layer's, both its tower service and its reqwest middleware): the store reserves the call's
//! slot and the call sleeps until it; a pause, stored or known here, is waited out; a metered
//! call waits its turn for room and leaves with its reservation; a store failure is answered as
//! the policy says, as for any door. What the door knows of its upstream without the store (the
//! pauses it learnt, what the upstream announced is left) it lends as an [`Upstream`].
//!
//! A metered call's estimate is reserved only when every rule has room for it now, never ahead:
//! a reservation ahead at the estimate would hold room that the call's settle may give back. It
//! waits its turn ([`WaitingTurn`]): refused, it leaves a claim in the store, and calls that ask
//! after it, on every instance, see the room less the units it waits for, so a large call is not
//! starved by small ones. Until then it sleeps the store's `retry_after`, or until a settle of
//! this limiter lands, and asks again, within the maximum wait. One whose room is further away
//! than that fails at once (its claim withdrawn), unless a settle here is on its way (which may
//! bring room back).

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

use tokio::time::Instant;

use super::caller::Caller;
use super::claim::WaitingTurn;
use super::metered::Tab;
use super::{Charge, Charged, Limiter, Price, Settling};
use crate::decision::Decision;
use crate::policy::StorageKey;
use crate::store::{CheckRequest, StoreError};

/// What a door knows of its upstream without asking the store.
pub(crate) trait Upstream: Send + Sync {
    /// How long a call to `key` needing `units` (a metered call's estimate; `None` for a plain
    /// call) waits by what this instance knows: a pause it learnt, or an announcement that less
    /// is left than the call needs.
    fn known_wait(&self, key: &str, units: Option<u64>) -> Option<Duration>;

    /// This instance's own pause of `key`, if one is on.
    fn paused(&self, key: &str) -> Option<Duration>;

    /// A call of `units` to `key` is on its way (what the upstream announced is left, less it).
    fn sent(&self, key: &str, units: Option<u64>);
}

/// Why an outgoing call is not sent.
#[derive(Debug)]
pub(crate) enum NotSent {
    /// Its slot, or the end of a pause, is further away than its maximum wait: this long.
    WouldWait(Duration),
    /// The store failed and the policy fails closed.
    Store(StoreError),
}

/// Waits until a call of `units` (its meter's estimate; 1 without a meter) to `key` may go,
/// within `max_wait`: `Ok` when it may, with a metered call's reservation (which its answer
/// settles; none when the store failed and the policy let the call through). Under a budget
/// shared fairly, the call is of `caller`'s share.
pub(crate) async fn send_when_free(
    limiter: &Arc<Limiter>,
    key: StorageKey,
    units: u64,
    max_wait: Duration,
    upstream: &dyn Upstream,
    caller: Option<Caller>,
) -> Result<Option<Tab>, NotSent> {
    let deadline = Instant::now() + max_wait;
    if limiter.policy.metering().is_some() {
        let turn = WaitingTurn::new(limiter.clone(), key.clone(), units.max(1), caller.clone());
        return wait_for_room(
            limiter,
            key,
            units,
            (deadline, max_wait),
            upstream,
            (turn, caller),
        )
        .await;
    }
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Paused by an answer to this instance, or its requests announced used up: no need to
        // ask the store.
        if let Some(wait) = upstream.known_wait(key.as_str(), None) {
            hold(wait, left).await?;
            continue;
        }
        let request =
            Caller::applied(caller.as_ref(), limiter.store_request(&key, None)).max_delay(left);
        match limiter.store.check(&request).await {
            Ok(decision) if decision.allowed => {
                // Not delayed: the check saw every pause, just now.
                if decision.delay.is_zero() {
                    upstream.sent(key.as_str(), None);
                    return Ok(None);
                }
                tokio::time::sleep(decision.delay).await;
                // Paused while it waited, here or on another instance: the slot is not used (it
                // still counts, which only errs on the safe side); wait for the pause's end, then
                // take a new slot behind every other.
                match pause_left(limiter, &request, upstream).await? {
                    None => {
                        upstream.sent(key.as_str(), None);
                        return Ok(None);
                    }
                    Some(pause) => {
                        hold(pause, deadline.saturating_duration_since(Instant::now())).await?;
                    }
                }
            }
            Ok(decision) => {
                // Paused by the upstream, and the pause ends in time: wait, then queue.
                hold(decision.retry_after().unwrap_or(max_wait), left).await?;
            }
            Err(error) => return store_failed(limiter, error).map(|()| None),
        }
    }
}

/// Reserves `units` of `key`'s metered rules (and one request of the others) as soon as they have
/// room, before `deadline`: the reservation, which its answer settles. Nothing is reserved for a
/// call that is not sent.
async fn wait_for_room(
    limiter: &Arc<Limiter>,
    key: StorageKey,
    units: u64,
    (deadline, max_wait): (Instant, Duration),
    upstream: &dyn Upstream,
    (mut turn, caller): (WaitingTurn, Option<Caller>),
) -> Result<Option<Tab>, NotSent> {
    // Every metered limiter of an outgoing door counts its settles (see `Limiter::outgoing`).
    let settling: Arc<Settling> = limiter.settling.clone().unwrap_or_default();
    // (An estimate of 0 is charged a unit, given back when it settles: it needs room too; the
    // turn asks for as many.)
    let price = Price::new(1, units);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Paused, or less left than it needs by the upstream's last word to this instance.
        if let Some(wait) = upstream.known_wait(key.as_str(), Some(units)) {
            hold(wait, left).await?;
            continue;
        }
        // Listening before asking, so that a settle between the answer and the sleep is not
        // missed.
        let mut settled = pin!(settling.landed());
        settled.as_mut().enable();
        let decision = match turn.check(left).await {
            Ok(decision) => decision,
            Err(error) => return store_failed(limiter, error).map(|()| None),
        };
        if decision.allowed {
            turn.served();
            upstream.sent(key.as_str(), Some(units));
            return Ok(Some(reservation(limiter, key, price, decision, caller)));
        }
        let retry_after = decision.retry_after().unwrap_or(max_wait);
        if retry_after < left {
            // Room comes back at the store's time, or sooner when a call here settles.
            let _ = tokio::time::timeout(retry_after, settled).await;
        } else if has_fired(settled.as_mut()) {
            // A settle landed since the check: ask again.
        } else if !settling.any_in_flight() || tokio::time::timeout(left, settled).await.is_err() {
            // Too far, and no settle on its way here that could bring room back sooner.
            return Err(NotSent::WouldWait(retry_after));
        }
    }
}

/// The reservation of `price` to `key` (in `caller`'s share), which the store answered
/// `decision`: the charge owns its receipt from the store's answer on.
fn reservation(
    limiter: &Arc<Limiter>,
    key: StorageKey,
    price: Price,
    decision: Decision,
    caller: Option<Caller>,
) -> Tab {
    let unit = limiter
        .policy
        .meter()
        .map(|meter| meter.unit_arc().clone())
        .unwrap_or_default();
    limiter.count_reserved(price.units);
    let charge =
        Charge::new(limiter.clone(), key, price, None, decision, Charged::Own).for_caller(caller);
    Tab::new(charge, unit)
}

/// Sleeps for `pause` when it ends within `left` of the call's maximum wait; else the call is
/// not sent.
async fn hold(pause: Duration, left: Duration) -> Result<(), NotSent> {
    if pause >= left {
        return Err(NotSent::WouldWait(pause));
    }
    tokio::time::sleep(pause).await;
    Ok(())
}

/// How long the pause of `request`'s key has left, if one is on: this instance's own pause, or
/// else the store's (one read). A store failure is answered as a check's is.
async fn pause_left(
    limiter: &Limiter,
    request: &CheckRequest<'_>,
    upstream: &dyn Upstream,
) -> Result<Option<Duration>, NotSent> {
    if let Some(pause) = upstream.paused(request.key) {
        return Ok(Some(pause));
    }
    match limiter.store.pause_left(request).await {
        Ok(pause) => Ok(pause),
        Err(error) => store_failed(limiter, error).map(|()| None),
    }
}

/// Pauses `key` for `pause` on every instance (the upstream of `upstream` asked for it); a store
/// failure is only logged (the response is the caller's either way).
pub(crate) async fn pause(limiter: &Limiter, key: &StorageKey, upstream: &str, pause: Duration) {
    let request = limiter.store_request(key, None);
    let name = limiter.policy.name();
    match limiter.store.pause(&request, pause).await {
        Ok(()) => tracing::info!(
            policy = name,
            upstream,
            pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
            "the upstream asked for a pause"
        ),
        Err(error) => limiter.store_errors.log(
            name,
            &error,
            format_args!("could not pause the key of upstream {upstream:?}"),
        ),
    }
}

/// A store failure, answered by the policy: `Ok` (send anyway, with a warning) when it fails
/// open; logged either way, as any door's.
fn store_failed(limiter: &Limiter, error: StoreError) -> Result<(), NotSent> {
    let doing = (
        "sending the outbound request anyway",
        "not sending the outbound request",
    );
    if limiter.store_failure_lets_through(&error, doing) {
        Ok(())
    } else {
        Err(NotSent::Store(error))
    }
}

/// Whether `notified` (enabled) has been woken already.
fn has_fired(notified: Pin<&mut tokio::sync::futures::Notified<'_>>) -> bool {
    notified
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_ready()
}
