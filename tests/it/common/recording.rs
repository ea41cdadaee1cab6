//! [`Recording`]: a store that records the cost of every check it is asked, and passes
//! everything else to the store it wraps.

use std::sync::{Arc, Mutex, Weak};

use tower_redis_ratelimit::Decision;
use tower_redis_ratelimit::store::{
    ActionFuture, CheckFuture, CheckRequest, ResetListener, ResetWatch, Store,
};

/// `store`, recording into `costs` the cost of each check.
#[derive(Clone)]
pub struct Recording<S> {
    pub store: S,
    pub costs: Arc<Mutex<Vec<u64>>>,
}

impl<S> Recording<S> {
    /// `store` with an empty record, and the record.
    pub fn new(store: S) -> (Self, Arc<Mutex<Vec<u64>>>) {
        let costs = Arc::new(Mutex::new(Vec::new()));
        let recording = Recording {
            store,
            costs: costs.clone(),
        };
        (recording, costs)
    }
}

impl<S: Store> Store for Recording<S> {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.costs.lock().unwrap().push(request.cost);
        self.store.check(request)
    }

    fn peek(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.store.peek(request)
    }

    fn refund(&self, request: &CheckRequest<'_>) -> CheckFuture {
        self.store.refund(request)
    }

    fn give_back(&self, request: &CheckRequest<'_>, charged: &Decision) -> CheckFuture {
        self.store.give_back(request, charged)
    }

    fn reset(&self, request: &CheckRequest<'_>) -> ActionFuture {
        self.store.reset(request)
    }

    fn watch_resets(&self, listener: Weak<dyn ResetListener>) -> Option<ResetWatch> {
        self.store.watch_resets(listener)
    }

    fn is_remote(&self) -> bool {
        self.store.is_remote()
    }

    fn abilities(&self) -> tower_redis_ratelimit::store::Abilities {
        use tower_redis_ratelimit::store::Abilities;
        // What it forwards of the store's.
        let forwarded =
            Abilities::PEEK | Abilities::REFUND | Abilities::GIVE_BACK | Abilities::RESET;
        let mut abilities = Abilities::CHECK_ONLY;
        for ability in [
            Abilities::PEEK,
            Abilities::REFUND,
            Abilities::GIVE_BACK,
            Abilities::RESET,
        ] {
            if self.store.abilities().contains(ability) && forwarded.contains(ability) {
                abilities = abilities | ability;
            }
        }
        abilities
    }
}
