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
    /// Whether a subscription task runs (cleared when it ends, however it ends).
    started: AtomicBool,
    /// What the tests wait on (`RedisStore::until_reset_heard_for_tests`): the keys of the
    /// notices heard, and a wake-up at each notice and each change of `live`.
    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    pub(super) heard: Mutex<Vec<String>>,
    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    pub(super) changed: tokio::sync::Notify,
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
        #[cfg(any(debug_assertions, feature = "test-hooks"))]
        {
            let mut heard = self.heard.lock().unwrap_or_else(PoisonError::into_inner);
            // The latest only: a debug build serving for days keeps no growing list.
            if heard.len() >= 1024 {
                heard.drain(..512);
            }
            heard.push(key.to_owned());
            drop(heard);
            self.changed.notify_waiters();
        }
    }

    /// Whether notices are heard now.
    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    pub(super) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Says whether notices are heard from now on, and tells every listener that some may have
    /// been missed.
    fn set_live(&self, live: bool) {
        self.live.store(live, Ordering::Release);
        for listener in self.listeners() {
            listener.notices_lost();
        }
        #[cfg(any(debug_assertions, feature = "test-hooks"))]
        self.changed.notify_waiters();
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

/// How often a quiet subscription is checked: the store still there, the connection alive (a
/// `PING` answered within [`PING_TIMEOUT`]; a half-open one would otherwise stay "live").
const QUIET_CHECK: Duration = Duration::from_secs(15);

/// How long a subscription's `PING` may take.
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// Marks the feed down when the subscription task ends however it ends (the runtime that
/// spawned it shut down included), so a later listener starts another.
struct Running(Weak<Shared>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            shared.resets.started.store(false, Ordering::Release);
            if shared.resets.live.load(Ordering::Acquire) {
                shared.resets.set_live(false);
            }
        }
    }
}

/// Subscribes to [`RESETS_CHANNEL`] and tells the store's listeners of every reset, for as long
/// as the store lives; subscribes again after a failure.
pub(super) async fn serve(store: Weak<Shared>) {
    let _running = Running(store.clone());
    let mut attempt = 0;
    let mut failed_before = false;
    loop {
        let Some(shared) = store.upgrade() else {
            return;
        };
        let client = match &shared.notices_client {
            Some(client) => Some(client.clone()),
            None => pubsub_client(&shared.connector, attempt).await,
        };
        attempt += 1;
        drop(shared);
        match subscribe(client).await {
            Ok(pubsub) => {
                failed_before = false;
                if let Some(shared) = store.upgrade() {
                    shared.resets.set_live(true);
                }
                let ended = listen(pubsub, &store).await;
                if let Some(shared) = store.upgrade() {
                    shared.resets.set_live(false);
                }
                if ended == Ended::StoreGone {
                    return;
                }
                tracing::warn!(
                    "the rate-limit store's reset subscription dropped: units taken ahead are \
                     dropped and none is taken until it is back; subscribing again"
                );
            }
            Err(error) if !failed_before => {
                failed_before = true;
                tracing::warn!(
                    %error,
                    channel = RESETS_CHANNEL,
                    "the rate-limit store can't subscribe to its reset notices (an ACL without \
                     this channel?): prefetching policies take no units ahead until it can, and \
                     networks set at run time reach this instance's copy every 10 seconds; \
                     retrying every second"
                );
            }
            Err(_) => {}
        }
        tokio::time::sleep(RESUBSCRIBE_AFTER).await;
    }
}

/// Why listening ended.
#[derive(PartialEq)]
enum Ended {
    /// The connection dropped or stopped answering.
    Dropped,
    /// The store is gone: nobody to tell.
    StoreGone,
}

/// A subscription to [`RESETS_CHANNEL`] through `client`.
async fn subscribe(
    client: Option<::redis::Client>,
) -> Result<::redis::aio::PubSub, ::redis::RedisError> {
    let client = client.ok_or_else(|| {
        ::redis::RedisError::from((::redis::ErrorKind::Io, "no node to subscribe on"))
    })?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(RESETS_CHANNEL).await?;
    Ok(pubsub)
}

/// Tells the store's listeners of every notice until the connection drops, stops answering a
/// `PING`, or the store is gone.
async fn listen(pubsub: ::redis::aio::PubSub, store: &Weak<Shared>) -> Ended {
    let (mut sink, mut messages) = pubsub.split();
    loop {
        match tokio::time::timeout(QUIET_CHECK, messages.next()).await {
            Ok(Some(message)) => {
                let Some(shared) = store.upgrade() else {
                    return Ended::StoreGone;
                };
                if let Ok(key) = message.get_payload::<String>() {
                    shared.resets.key_reset(&key);
                }
            }
            Ok(None) => return Ended::Dropped,
            Err(_quiet) => {
                if store.strong_count() == 0 {
                    return Ended::StoreGone;
                }
                let ping = tokio::time::timeout(PING_TIMEOUT, sink.ping::<String>()).await;
                if !matches!(ping, Ok(Ok(_))) {
                    return Ended::Dropped;
                }
            }
        }
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
