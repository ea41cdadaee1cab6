//! Reset notices over Redis pub/sub ([`Store::watch_resets`](crate::Store::watch_resets)): the
//! reset script publishes the key it reset on [`RESETS_CHANNEL`] (`lua/reset.lua`), and a
//! subscription of the store's own tells every listener of this instance, so units another
//! instance took ahead of that key are dropped within a round trip of the reset. The
//! subscription starts at the first listener and reconnects after a failure; each time it is
//! (re)established, and each time it drops, listeners forget everything they hold (notices sent
//! meanwhile were lost), and [`ResetWatch::is_live`] says whether notices are heard.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use futures_util::StreamExt;

use super::Shared;
use super::connection::Connector;
use crate::store::{ResetListener, ResetWatch};

/// The channel every reset is published on (its message: the reset key, as
/// [`CheckRequest::key`](crate::store::CheckRequest::key) names it).
pub(super) const RESETS_CHANNEL: &str = "tower-redis-ratelimit:resets";

/// The pause before subscribing again after a failure.
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);

/// The listeners of one store, and whether its subscription is up.
#[derive(Default)]
pub(super) struct ResetFeed {
    listeners: Mutex<Vec<Weak<dyn ResetListener>>>,
    live: Arc<AtomicBool>,
    started: AtomicBool,
}

impl ResetFeed {
    /// Registers `listener`; `true` when this is the first, and the subscription should start.
    pub(super) fn watch(&self, listener: Weak<dyn ResetListener>) -> (ResetWatch, bool) {
        let mut listeners = self.lock();
        listeners.retain(|listener| listener.strong_count() > 0);
        listeners.push(listener);
        let first = !self.started.swap(true, Ordering::AcqRel);
        (ResetWatch::new(self.live.clone()), first)
    }

    /// Tells every listener that `key` was reset.
    fn key_reset(&self, key: &str) {
        for listener in self.listeners() {
            listener.key_reset(key);
        }
    }

    /// Says whether notices are heard from now on, and tells every listener that some may have
    /// been missed.
    fn set_live(&self, live: bool) {
        self.live.store(live, Ordering::Release);
        for listener in self.listeners() {
            listener.notices_lost();
        }
    }

    /// The listeners still there (called outside the lock: a listener may take its own locks).
    fn listeners(&self) -> Vec<Arc<dyn ResetListener>> {
        let mut listeners = self.lock();
        listeners.retain(|listener| listener.strong_count() > 0);
        listeners.iter().filter_map(Weak::upgrade).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Weak<dyn ResetListener>>> {
        self.listeners
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Whether the store's own connector can subscribe (a pool you built can't lend a connection
/// for it).
pub(super) fn can_subscribe(connector: &Connector) -> bool {
    match connector {
        Connector::Node(_) => true,
        #[cfg(feature = "cluster")]
        Connector::Cluster(_) => true,
        #[cfg(feature = "sentinel")]
        Connector::Sentinel(_) => true,
        _ => false,
    }
}

/// Subscribes to [`RESETS_CHANNEL`] and tells the store's listeners of every reset, for as long
/// as the store lives; subscribes again after a failure.
pub(super) async fn serve(store: Weak<Shared>) {
    let mut attempt = 0;
    loop {
        let Some(shared) = store.upgrade() else {
            return;
        };
        let client = pubsub_client(&shared.connector, attempt).await;
        attempt += 1;
        drop(shared);
        if let Some(client) = client
            && let Ok(mut pubsub) = client.get_async_pubsub().await
            && pubsub.subscribe(RESETS_CHANNEL).await.is_ok()
        {
            if let Some(shared) = store.upgrade() {
                shared.resets.set_live(true);
            }
            let mut messages = pubsub.on_message();
            while let Some(message) = messages.next().await {
                let Some(shared) = store.upgrade() else {
                    return;
                };
                if let Ok(key) = message.get_payload::<String>() {
                    shared.resets.key_reset(&key);
                }
            }
            if let Some(shared) = store.upgrade() {
                shared.resets.set_live(false);
            }
            tracing::warn!("the rate-limit store's reset subscription dropped; subscribing again");
        }
        tokio::time::sleep(RESUBSCRIBE_AFTER).await;
    }
}

/// A client to subscribe with: the node's; the primary's, asked of the sentinels; a seed node of
/// a cluster (the `attempt`-th, round robin).
async fn pubsub_client(connector: &Connector, attempt: usize) -> Option<::redis::Client> {
    let _ = attempt;
    match connector {
        Connector::Node(client) => Some(client.clone()),
        #[cfg(feature = "cluster")]
        Connector::Cluster(router) => router.seed_client(attempt).ok(),
        #[cfg(feature = "sentinel")]
        Connector::Sentinel(sentinel) => sentinel.lock().await.async_get_client().await.ok(),
        _ => None,
    }
}
