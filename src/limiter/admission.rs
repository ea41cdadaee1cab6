//! [`Admission`]: what an admitted request holds until its answer (its headers, its concurrency
//! slot, the store's decision, its charge), and [`OnResponse`], the part of it a response waits
//! for. The doors keep these whole: only the limiter looks inside.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Response};
use tower::BoxError;

use super::{Charge, Charged, Limiter, Price};
use crate::decision::Decision;
use crate::limiter::holding_body::HoldingBody;
use crate::limiter::metered::{Reserved, Tab, Usage};
use crate::limiter::slots::Lease;
use crate::policy::StorageKey;
use crate::policy::quota::QuotaLookup;
use crate::response::LimitHeaders;
use crate::store::StoreError;

/// What the store told an admission.
pub(crate) enum Told {
    /// Nothing: nothing was checked, or the store failed open.
    Nothing,
    /// Its decision, with nothing to give back (a request's admission without `count_only`:
    /// nothing would).
    Decision(Decision),
    /// Its decision inside its charge, which owns it as the receipt a give-back reads: given
    /// back by [`Admitted::refund`](crate::Admitted::refund), under `count_only` when the
    /// response doesn't count, or settled by a meter. In place, not boxed: a handle's admission
    /// always has one, and a receipt costs it no allocation (`tests/allocations.rs`).
    Charge(Charge),
}

impl Told {
    /// The charge, taken out when `wanted`: what is left is the decision.
    fn take_charge_if(&mut self, wanted: impl FnOnce(&Charge) -> bool) -> Option<Charge> {
        if !matches!(self, Told::Charge(charge) if wanted(charge)) {
            return None;
        }
        match std::mem::replace(self, Told::Nothing) {
            Told::Charge(charge) => Some(charge),
            _ => None,
        }
    }
}

/// An admitted request: what its response gets, and what it holds until then.
pub(crate) struct Admission {
    /// The rate-limit headers (none when nothing was checked, or the store failed open).
    pub(super) headers: Option<LimitHeaders>,
    /// The concurrency slot, held until the response body is done (boxed: only a policy with
    /// `max_in_flight` has one, and every admission is moved a few times on its way).
    pub(super) lease: Option<Box<Lease>>,
    /// What the store told it: its decision (for a handle's caller), held by its charge when
    /// something may give the charge back.
    pub(super) told: Told,
    /// A metered policy let the request through without a reservation (unlimited, a shadow
    /// pass, a store failure let through): what it records counts nowhere, and its `Usage` says
    /// so rather than blaming a missing meter.
    pub(super) uncounted: bool,
}

impl Admission {
    /// An admission without a check: nothing to send, hold or give back.
    pub(crate) fn unchecked() -> Self {
        Admission {
            headers: None,
            lease: None,
            told: Told::Nothing,
            uncounted: false,
        }
    }

    /// An admission without a check or a reservation by `limiter` (unlimited, a shadow pass, a
    /// store failure let through).
    pub(super) fn let_through(limiter: &Limiter) -> Self {
        Admission {
            uncounted: limiter.policy().metering().is_some(),
            ..Admission::unchecked()
        }
    }

    /// This admission with its charge: `price` to `key` (and `quota`) by `limiter`, whose units'
    /// whereabouts `charged` says. The charge holds the admission's decision from then on (an
    /// admission without a decision charged nothing).
    pub(super) fn charging(
        mut self,
        limiter: Arc<Limiter>,
        key: StorageKey,
        price: Price,
        quota: Option<QuotaLookup>,
        charged: Charged,
    ) -> Self {
        if let Told::Decision(decision) = self.told {
            let charge = Charge::new(limiter, key, price, quota, decision, charged);
            self.told = Told::Charge(charge);
        }
        self
    }

    /// The store's decision (none when nothing was checked, or the store failed open).
    pub(crate) fn decision(&self) -> Option<&Decision> {
        match &self.told {
            Told::Nothing => None,
            Told::Decision(decision) => Some(decision),
            Told::Charge(charge) => Some(charge.decision()),
        }
    }

    /// Whether the admission holds a concurrency slot.
    pub(crate) fn holds_slot(&self) -> bool {
        self.lease.is_some()
    }

    /// Releases the concurrency slot now, if one is held.
    pub(crate) async fn release_slot(&mut self) -> Result<(), StoreError> {
        match self.lease.take() {
            Some(lease) => lease.release().await,
            None => Ok(()),
        }
    }

    /// Gives the charge back where it was charged, and waits for the store: what it then finds
    /// for the key. An admission that charged nothing finds nothing to give back.
    pub(crate) async fn refund(self) -> Result<Decision, StoreError> {
        let Told::Charge(charge) = self.told else {
            return Ok(nothing_charged());
        };
        charge.refund().await
    }

    /// Settles a reservation of metered units at `used`, and waits for the store: what it then
    /// finds for the key. One that charged nothing finds nothing to settle.
    pub(crate) async fn settle_usage(self, used: u64) -> Result<Decision, StoreError> {
        let Told::Charge(charge) = self.told else {
            return Ok(nothing_charged());
        };
        super::metered::settle_now(charge, used).await
    }

    /// Puts the rate-limit headers on a response's `headers`; the slot is held as long as the
    /// admission lives.
    pub(crate) fn apply_headers(&mut self, headers: &mut HeaderMap) {
        if let Some(limit_headers) = self.headers.take() {
            limit_headers.apply(headers);
        }
    }

    /// Under a meter, moves the charge into a reservation the request's [`Usage`] (put in its
    /// `extensions`) holds, and this admission too: it settles once both are gone. Returns the
    /// reservation.
    pub(crate) fn meter_into(&mut self, extensions: &mut http::Extensions) -> Option<Reserved> {
        self.metering(extensions, false)
    }

    /// [`Admission::meter_into`]; `last` when the admission's decision is needed no more (else
    /// it keeps a copy of the decision its charge takes along).
    fn metering(&mut self, extensions: &mut http::Extensions, last: bool) -> Option<Reserved> {
        let charge = self.told.take_charge_if(Charge::is_metered)?;
        if !last {
            self.told = Told::Decision(charge.decision().clone());
        }
        let unit = charge
            .limiter()
            .policy()
            .metering()?
            .meter
            .unit_arc()
            .clone();
        Some(Usage::of(extensions).hold(Tab::new(charge, unit)))
    }

    /// What the response of a request about to be called with `extensions` waits for: its
    /// headers, what its body holds (a slot, a meter's reservation), and under `count_only` the
    /// charge its status settles (boxed: only such policies pay for its size). Under a meter the
    /// request's [`Usage`] goes into its extensions.
    pub(crate) fn on_call(mut self, extensions: &mut http::Extensions) -> OnResponse {
        let tab = self.metering(extensions, true);
        if self.uncounted {
            Usage::of(extensions).let_through();
        }
        let charge = self
            .told
            .take_charge_if(Charge::kept_or_given_back_after_response)
            .map(Box::new);
        OnResponse {
            headers: self.headers,
            lease: self.lease,
            charge,
            tab,
        }
    }
}

/// What an admitted request's response gets once the service answers ([`Admission::on_response`]).
pub(crate) struct OnResponse {
    headers: Option<LimitHeaders>,
    lease: Option<Box<Lease>>,
    charge: Option<Box<Charge>>,
    /// A meter's reservation, settled once the body has ended and the request's `Usage` is
    /// gone.
    tab: Option<Reserved>,
}

impl OnResponse {
    /// What the response of a request the limiter didn't check gets: nothing.
    pub(crate) fn nothing() -> Self {
        OnResponse {
            headers: None,
            lease: None,
            charge: None,
            tab: None,
        }
    }

    /// What the response of an admission that holds nothing gets: its rate-limit `headers`.
    pub(crate) fn with_headers(headers: LimitHeaders) -> Self {
        OnResponse {
            headers: Some(headers),
            ..OnResponse::nothing()
        }
    }

    /// The service's response, answered: a `count_only` charge settled by its status, the slot
    /// held until its body ends, the rate-limit headers on it.
    pub(crate) fn apply<B>(self, response: Response<B>) -> Response<Body>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        if let Some(charge) = self.charge {
            charge.keep_or_give_back(response.status());
        }
        if let Some(tab) = &self.tab {
            tab.answered(&response);
        }
        let mut response = match (self.lease, self.tab) {
            (None, None) => response.map(Body::new),
            held => response.map(|body| Body::new(HoldingBody::new(body, held))),
        };
        if let Some(headers) = self.headers {
            headers.apply(response.headers_mut());
        }
        response
    }
}

/// The answer to a give-back of nothing: an empty decision, now.
fn nothing_charged() -> Decision {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    Decision {
        allowed: true,
        rules: Vec::new(),
        now_unix_ms: u64::try_from(now.as_millis()).unwrap_or(u64::MAX),
        delay: Duration::ZERO,
        quota_alerts: Vec::new(),
        lease: None,
        run_time_override: None,
    }
}
