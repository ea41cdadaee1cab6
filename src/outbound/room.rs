//! A metered call's wait for room. Its estimate is reserved only when every rule has room for it
//! now, never ahead: a reservation ahead at the estimate would hold room that the call's settle
//! may give back. It waits its turn ([`WaitingTurn`]): refused, it leaves a claim in the store,
//! and calls that ask after it, on every instance, see the room less the units it waits for, so
//! a large call is not starved by small ones. Until then it sleeps the store's `retry_after`, or
//! until a settle on this instance lands, and asks again, within the maximum wait. One whose
//! room is further away than that fails at once (its claim withdrawn), unless a settle here is on
//! its way (which may bring room back).

use std::future::Future;
use std::pin::{Pin, pin};
use std::task::{Context, Waker};

use tokio::time::Instant;

use super::{OutboundError, Shared};
use crate::decision::Decision;
use crate::limiter::claim::WaitingTurn;
use crate::limiter::metered::Tab;
use crate::limiter::{Charge, Charged, Price};
use crate::policy::StorageKey;

impl Shared {
    /// Reserves `units` of `upstream`'s metered rules (and one request of the others) as soon as
    /// they have room, before `deadline`; the reservation, which its answer settles. Nothing is
    /// reserved for a call that is not sent.
    pub(super) async fn wait_for_room(
        &self,
        upstream: &str,
        key: StorageKey,
        units: u64,
        deadline: Instant,
    ) -> Result<Option<Tab>, OutboundError> {
        // (An estimate of 0 is charged a unit, given back when it settles: it needs room too.)
        let price = Price::new(1, units);
        let mut turn = WaitingTurn::new(self.limiter.clone(), key.clone(), price.units);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Paused, or less left than it needs by the upstream's last word to this instance.
            if let Some(wait) = self.known_wait(key.as_str(), Some(units)) {
                self.hold(upstream, wait, left).await?;
                continue;
            }
            // Listening before asking, so that a settle between the answer and the sleep is
            // not missed.
            let mut settled = pin!(self.settling.landed());
            settled.as_mut().enable();
            let answer = turn.check(left).await;
            let decision = match answer {
                Ok(decision) => decision,
                Err(error) => return self.store_failed(error).map(|()| None),
            };
            if decision.allowed {
                turn.served();
                self.announced.sent(key.as_str(), Some(units));
                return Ok(Some(self.reservation(key, price, decision)));
            }
            let retry_after = decision.retry_after().unwrap_or(self.max_wait);
            let would_wait = || OutboundError::WouldWait {
                upstream: upstream.to_owned(),
                retry_after,
            };
            if retry_after < left {
                // Room comes back at the store's time, or sooner when a call here settles.
                let _ = tokio::time::timeout(retry_after, settled).await;
            } else if has_fired(settled.as_mut()) {
                // A settle landed since the check: ask again.
            } else if !self.settling.any_in_flight()
                || tokio::time::timeout(left, settled).await.is_err()
            {
                // Too far, and no settle on its way here that could bring room back sooner.
                return Err(would_wait());
            }
        }
    }

    /// The reservation of `price` to `key`, which the store answered `decision`.
    fn reservation(&self, key: StorageKey, price: Price, decision: Decision) -> Tab {
        let unit = self
            .policy
            .meter()
            .map(|meter| meter.unit_arc().clone())
            .unwrap_or_default();
        self.limiter.count_reserved(price.units);
        let charge = Charge::new(self.limiter.clone(), key, price, None, Charged::Told);
        Tab::new(charge, Some(decision), unit)
    }
}

/// Whether `notified` (enabled) has been woken already.
fn has_fired(notified: Pin<&mut tokio::sync::futures::Notified<'_>>) -> bool {
    notified
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_ready()
}
