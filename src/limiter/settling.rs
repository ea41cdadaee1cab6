//! [`Settling`]: a limiter's give-backs and settles on their way to the store, counted while they
//! fly, and a wake-up as each lands (an outbound layer's metered calls waiting for room listen).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;
use tokio::sync::futures::Notified;

/// The give-backs and settles of a limiter's charges on their way to the store, and a wake-up
/// as each lands: what an outbound layer's calls waiting for room listen to.
#[derive(Debug, Default)]
pub(crate) struct Settling {
    in_flight: AtomicUsize,
    landed: Notify,
}

/// One give-back on its way to the store, counted while it lives.
pub(super) struct InFlight(Arc<Settling>);

impl InFlight {
    pub(super) fn new(settling: Arc<Settling>) -> Self {
        settling.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(settling)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.landed.notify_waiters();
    }
}

impl Settling {
    /// Whether one is on its way.
    pub(crate) fn any_in_flight(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0
    }

    /// Wakes those listening: one landed (its answer applied).
    pub(super) fn wake(&self) {
        self.landed.notify_waiters();
    }

    /// Ready when the next one lands (`enable` it before asking the store, so that one landing
    /// meanwhile is not missed).
    pub(crate) fn landed(&self) -> Notified<'_> {
        self.landed.notified()
    }
}
