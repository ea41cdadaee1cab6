//! Settling metered units after the response: [`Usage`], what a handler records the units its
//! request used in, and [`Tab`], one admission's reservation, settled once the response's body
//! has ended (or been dropped) and the last clone of its `Usage` is gone (`Tabs` holds them, and
//! settles them when dropped). Public as
//! [`crate::meter`].

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::FromRequestParts;
use http::request::Parts;
use http::{HeaderMap, StatusCode};

use super::{Charge, Price};
use crate::decision::Decision;
use crate::store::{CheckFuture, StoreError};

/// The units a request used, recorded by its handler (or by a stream as it ends) and settled
/// by the layer of each meter on the request: what it used less than it reserved goes back to
/// the windows its admission charged, what it used more is charged on top, past the limit if
/// need be. Nothing recorded (and no usage header) means the reservation stands.
///
/// An axum extractor that never fails. Clones share one tally: move one into a streamed body and
/// record as the stream ends; the request settles when its body has ended and the last clone
/// is dropped (an outbound call's, when its response and the last clone are dropped: one rule,
/// the answer that carries it over and its last clone gone). On a route without a meter it
/// records nothing (said once, at WARN).
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_redis_ratelimit::meter::{Meter, Usage};
/// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, Rule};
///
/// async fn complete(usage: Usage) -> &'static str {
///     // ... call the model; it reports 1 234 tokens.
///     usage.record(1_234);
///     "done"
/// }
///
/// let policy = Policy::builder("llm")
///     .rule(Rule::per_minute(40_000).metered())
///     .meter(Meter::new("tokens").estimate(|_| 500))
///     .build()
///     .unwrap();
/// let app: Router = Router::new()
///     .route("/v1/complete", post(complete))
///     .layer(RateLimitLayer::new(policy, MemoryStore::new()));
/// ```
#[derive(Clone, Default)]
pub struct Usage(Arc<Tabs>);

/// The reservations of one request, one per metered layer it passed: the first in place (one
/// meter is the common case: nothing more to allocate), the others after it. They settle when
/// the last holder (a clone of the request's `Usage`, a response body) lets go.
#[derive(Default)]
struct Tabs {
    first: std::sync::OnceLock<Tab>,
    more: Mutex<Vec<Tab>>,
    /// A metered layer let the request through without a reservation (see
    /// [`Usage::let_through`]).
    let_through: AtomicBool,
}

impl Tabs {
    /// Calls `each` on every reservation.
    fn each(&self, mut each: impl FnMut(&Tab)) {
        if let Some(first) = self.first.get() {
            each(first);
            for tab in self
                .more
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
            {
                each(tab);
            }
        }
    }

    /// Calls `on` with reservation `index` (0: the first).
    fn with(&self, index: usize, on: impl FnOnce(&Tab)) {
        match index {
            0 => self.first.get().map(on),
            _ => self
                .more
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(index - 1)
                .map(on),
        };
    }
}

impl Drop for Tabs {
    fn drop(&mut self) {
        if let Some(first) = self.first.get_mut() {
            first.settle();
        }
        let more = self.more.get_mut().unwrap_or_else(PoisonError::into_inner);
        for tab in more.iter_mut() {
            tab.settle();
        }
    }
}

/// Said once per process: a `Usage` recorded on a route without a meter.
static UNMETERED_WARNED: AtomicBool = AtomicBool::new(false);

impl Usage {
    /// Adds `units` used, for every meter on the request (the only one, usually). Clamped at
    /// each meter's [`max_usage`](crate::meter::Meter::max_usage) when it settles.
    pub fn record(&self, units: u64) {
        self.record_where(|_| true, units);
    }

    /// Adds `units` used for the meters of `unit` on the request: where two policies meter
    /// two units on one route (input and output tokens), each gets its own.
    pub fn record_unit(&self, unit: &str, units: u64) {
        self.record_where(|tab| *tab.unit == *unit, units);
    }

    fn record_where(&self, meters: impl Fn(&Tab) -> bool, units: u64) {
        let mut recorded = false;
        self.0.each(|tab| {
            if meters(tab) {
                tab.record(units);
                recorded = true;
            }
        });
        if recorded {
            return;
        }
        if self.0.let_through.load(Ordering::Relaxed) {
            tracing::debug!(
                units,
                "usage recorded on a request its metered layer let through without a reservation \
                 (an unlimited identity, shadow mode, a store failure let through): it counts \
                 nowhere"
            );
        } else if !UNMETERED_WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                units,
                "usage recorded on a request no meter reserved for (a route without a meter, \
                 or another unit): it counts nothing"
            );
        }
    }

    /// Notes that a metered layer let the request through without a reservation (an unlimited
    /// identity, a shadow pass, a store failure let through): what it records then counts
    /// nowhere, as it should, and is no sign of a missing meter.
    pub(crate) fn let_through(&self) {
        self.0.let_through.store(true, Ordering::Relaxed);
    }

    /// The request's `Usage`, found in `extensions` or put there.
    pub(crate) fn of(extensions: &mut http::Extensions) -> &Usage {
        extensions.get_or_insert_default::<Usage>()
    }

    /// Adds a meter's reservation to the request's: what its layer holds to read the
    /// response's word and keep it until the body ends.
    pub(crate) fn hold(&self, tab: Tab) -> Reserved {
        let index = match self.0.first.set(tab) {
            Ok(()) => 0,
            Err(tab) => {
                let mut more = self.0.more.lock().unwrap_or_else(PoisonError::into_inner);
                more.push(tab);
                more.len()
            }
        };
        Reserved {
            usage: self.clone(),
            index,
        }
    }
}

impl std::fmt::Debug for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        self.0.each(|tab| {
            list.entry(&(&*tab.unit, tab.used.load(Ordering::Relaxed)));
        });
        list.finish()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Usage {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Infallible> {
        Ok(parts.extensions.get::<Usage>().cloned().unwrap_or_default())
    }
}

/// One layer's reservation on a request, as its layer holds it: the request's reservations (a
/// clone of its `Usage`, which the response body keeps until it ends) and which is its own.
pub(crate) struct Reserved {
    usage: Usage,
    index: usize,
}

impl Reserved {
    /// Reads what the response says of this reservation (see [`Tab::answered`]).
    pub(crate) fn answered<B>(&self, response: &http::Response<B>) {
        self.answered_with(response.status(), response.headers());
    }

    /// Reads what a response of `status` with `headers` says of this reservation.
    pub(crate) fn answered_with(&self, status: StatusCode, headers: &HeaderMap) {
        self.usage
            .0
            .with(self.index, |tab| tab.answered(status, headers));
    }

    /// Settles this reservation at nothing used, now: the call was refused (an upstream's 429).
    pub(crate) fn nothing_used(&self) {
        self.usage.0.with(self.index, Tab::nothing_used);
    }
}

/// One admission's reservation of metered units: settled when the request's reservations are
/// let go of (its `Usage` clones, its response body).
pub(crate) struct Tab {
    unit: Arc<str>,
    /// What the code recorded (`Usage::record`), and whether it did.
    used: AtomicU64,
    recorded: AtomicBool,
    /// What the response's usage header reported, and whether it did: it counts only when the
    /// code recorded nothing (one report per request).
    header_used: AtomicU64,
    header_reported: AtomicBool,
    /// The charge (and its receipt), until it settles or a response that doesn't count takes it
    /// back whole.
    charge: Mutex<Option<Charge>>,
}

impl Tab {
    /// The reservation `charge` made, of its meter's unit.
    pub(crate) fn new(charge: Charge, unit: Arc<str>) -> Self {
        Tab {
            unit,
            used: AtomicU64::new(0),
            recorded: AtomicBool::new(false),
            header_used: AtomicU64::new(0),
            header_reported: AtomicBool::new(false),
            charge: Mutex::new(Some(charge)),
        }
    }

    /// Adds `units` used.
    pub(crate) fn record(&self, units: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                Some(used.saturating_add(units))
            });
        self.recorded.store(true, Ordering::Release);
    }

    /// Reads what a response (`status`, `headers`) says: under `count_only` whether it counts (one that doesn't gives
    /// the whole charge back), and the usage it reports in the meter's header, if any (a whole
    /// number is the header's report, which counts when the code records nothing; anything else
    /// is no report, said once at WARN).
    fn answered(&self, status: StatusCode, headers: &HeaderMap) {
        let mut held = self.charge.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(charge) = held.as_ref() else {
            return;
        };
        let counts_only_some = charge.limiter().policy().counts_only_some();
        if counts_only_some && !charge.limiter().policy().counts(status) {
            // Under count_only, a response that doesn't count settles to zero: its whole charge
            // goes back.
            if let Some(charge) = held.take() {
                drop(held);
                charge.keep_or_give_back(status);
            }
            return;
        }
        let policy = charge.limiter().policy();
        let Some(metering) = policy.metering() else {
            return;
        };
        let Some(value) = metering
            .meter
            .usage_header_name()
            .and_then(|name| headers.get(name))
        else {
            return;
        };
        match value
            .to_str()
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
        {
            Some(units) => {
                self.header_used.store(units, Ordering::Relaxed);
                self.header_reported.store(true, Ordering::Release);
            }
            None => {
                if !metering.warned_header.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        policy = policy.name(),
                        header = ?value,
                        "a usage header that isn't a whole number is no report (said once)"
                    );
                }
            }
        }
    }

    /// Settles the reservation at what was reported: what the code recorded, else what the
    /// usage header said; nothing reported, it stands.
    fn settle(&mut self) {
        let Some(charge) = self
            .charge
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return;
        };
        let header = self
            .header_reported
            .get_mut()
            .then_some(*self.header_used.get_mut());
        let used = if *self.recorded.get_mut() {
            if header.is_some() {
                let policy = charge.limiter().policy();
                if policy.metering().is_some_and(|metering| {
                    !metering.warned_two_reports.swap(true, Ordering::Relaxed)
                }) {
                    tracing::warn!(
                        policy = policy.name(),
                        recorded = *self.used.get_mut(),
                        header = header,
                        "a request both recorded its usage and reported it in the usage header: \
                         the record counts, the header doesn't (said once)"
                    );
                }
            }
            *self.used.get_mut()
        } else if let Some(units) = header {
            units
        } else {
            // Nothing reported: the reservation stands at the estimate (the unit an estimate of
            // 0 was charged, only so that it needed room, goes back).
            let price = charge.price();
            if price.estimate >= price.units {
                return;
            }
            price.estimate
        };
        settle_at(charge, used);
    }

    /// Settles the reservation at nothing used, now, whatever is recorded after.
    pub(crate) fn nothing_used(&self) {
        let charge = self
            .charge
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(charge) = charge {
            settle_at(charge, 0);
        }
    }
}

/// Settles `charge` at `used` units, in the background.
fn settle_at(charge: Charge, used: u64) {
    if let Some(call) = settle_call(&charge, used) {
        charge.finish(
            call,
            "could not settle the metered units a response used; its reservation stands",
        );
    }
}

/// The store call that settles `charge` at `used` units (clamped at the meter's bound, said
/// once at WARN): a give-back of what it reserved and didn't use, or an overdraw of what it used
/// beyond; `None` when it used what it reserved. Counts the units in the policy's metrics.
pub(super) fn settle_call(charge: &Charge, used: u64) -> Option<CheckFuture> {
    let limiter = charge.limiter();
    let policy = limiter.policy();
    let metering = policy.metering()?;
    let used = if used > metering.max_usage {
        if !metering.warned_max_usage.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                policy = policy.name(),
                unit = metering.meter.unit(),
                reported = used,
                max_usage = metering.max_usage,
                "a usage report above the meter's max_usage counts as max_usage (said once)"
            );
        }
        metering.max_usage
    } else {
        used
    };
    let reserved = charge.price().units;
    let metrics = limiter.metrics();
    metrics.metered("used", used);
    if used < reserved {
        metrics.metered("given_back", reserved - used);
        let unused = Price::exactly(0, reserved - used);
        Some(charge.give_back(unused))
    } else if used > reserved {
        metrics.metered("overdrawn", used - reserved);
        Some(charge.overdraw(used - reserved))
    } else {
        None
    }
}

/// Settles `charge` at `used` units and waits for the store: what it then finds for the key
/// (a handle's [`Reservation::settle`](crate::meter::Reservation::settle)).
pub(crate) async fn settle_now(charge: Charge, used: u64) -> Result<Decision, StoreError> {
    let decision = match settle_call(&charge, used) {
        Some(call) => call.await?,
        None => charge.give_back(Price::exactly(0, 0)).await?,
    };
    charge.moved(&decision);
    Ok(decision)
}
