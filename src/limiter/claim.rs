//! A metered call's place in line while it waits for room ([`WaitingTurn`]). Its checks carry a
//! claim ([`Claim`]): refused, the call leaves it in the store, and the calls that ask after it,
//! on every instance sharing the store, see the room less the units it waits for, so they can't
//! keep taking the room a larger call waits for. Nothing is reserved: a claim charges nothing.
//! It goes when the call is admitted (the store takes it away in the same call), when the call
//! gives up or is dropped (a withdrawal, sent then), or, failing both, at the end of the call's
//! time to wait (the store drops it as expired).

use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::Limiter;
use super::caller::Caller;
use crate::policy::StorageKey;
use crate::store::{CheckFuture, Claim};

/// The longest a claim lasts (ms): 2^52, far past any wait, and exact in the script's numbers.
const LONGEST_CLAIM_MS: u64 = 1 << 52;

/// A metered call waiting its turn for room: asks with its claim ([`WaitingTurn::check`]), and
/// withdraws the claim when dropped before it was served.
pub(crate) struct WaitingTurn {
    limiter: Arc<Limiter>,
    key: StorageKey,
    units: u64,
    /// Whose share of a budget shared fairly the call is of (see [`Caller`]).
    caller: Option<Caller>,
    id: u64,
    /// Whether the store may hold its claim: asked, and not yet served.
    held: bool,
}

impl WaitingTurn {
    /// The turn of a call of `caller` needing `units` of `key`'s metered rules.
    pub(crate) fn new(
        limiter: Arc<Limiter>,
        key: StorageKey,
        units: u64,
        caller: Option<Caller>,
    ) -> Self {
        WaitingTurn {
            limiter,
            key,
            units,
            caller,
            id: claim_id(),
            held: false,
        }
    }

    /// Asks for room for its units (and a request of the rules that count requests), after the
    /// claims made before its own: a check that, refused, leaves its claim for `left` (the
    /// call's time to wait) unless it has one.
    pub(crate) fn check(&mut self, left: Duration) -> CheckFuture {
        if !self.limiter.store().keeps_claims() {
            // A check without a claim, as any other.
            let request = self
                .limiter
                .store_request(&self.key, None)
                .units(self.units);
            let request = Caller::applied(self.caller.as_ref(), request);
            return self.limiter.store().check(&request);
        }
        self.held = true;
        // (Below 2^53, so the script's numbers hold it exactly: a wait of 143 000 years.)
        let lasting_ms = u64::try_from(left.as_millis())
            .unwrap_or(u64::MAX)
            .clamp(1, LONGEST_CLAIM_MS);
        self.ask(lasting_ms)
    }

    /// Admitted: the store took its claim away with the admission.
    pub(crate) fn served(mut self) {
        self.held = false;
    }

    fn ask(&self, lasting_ms: u64) -> CheckFuture {
        let claim = Claim {
            id: self.id,
            lasting_ms,
        };
        let request = self
            .limiter
            .store_request(&self.key, None)
            .units(self.units)
            .claiming(claim);
        let request = Caller::applied(self.caller.as_ref(), request);
        self.limiter.store().check(&request)
    }
}

impl Drop for WaitingTurn {
    /// Withdraws the claim of a call that gave up, so the calls after it don't wait for it until
    /// its time runs out. Sent now (polled once), and awaited in a task of its own with a
    /// networked store; its answer is not needed, and a withdrawal that fails leaves the claim to
    /// expire.
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        // Without a runtime (a test's teardown, a runtime shut down) a networked store can't be
        // asked: the claim expires.
        let runtime = tokio::runtime::Handle::try_current();
        if runtime.is_err() && self.limiter.store().is_remote() {
            return;
        }
        let mut withdrawal = self.ask(0);
        if withdrawal.take_ready().is_some() {
            return;
        }
        if let Ok(runtime) = runtime
            && let Poll::Pending =
                Pin::new(&mut withdrawal).poll(&mut Context::from_waker(Waker::noop()))
        {
            runtime.spawn(withdrawal);
        }
    }
}

/// A claim id no other call is likely to have, on any instance: a per-process random stream
/// (the hasher's seed) over a counter.
fn claim_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static SEED: std::sync::LazyLock<foldhash::fast::RandomState> =
        std::sync::LazyLock::new(foldhash::fast::RandomState::default);
    SEED.hash_one(NEXT.fetch_add(1, Ordering::Relaxed))
}
