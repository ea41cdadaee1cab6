//! Each instance's copy of the addresses and networks set at run time for a policy whose checks
//! can't match them in their own call: one keyed by something else than the client address
//! sends no address with its checks, and on a Cluster the policy's index lies in another slot
//! than a check's keys. The limiter matches a request's client address against the copy, and a
//! check it found an override for carries that override's value to the script, which applies it
//! unless the identity has one of its own (`lua/overrides.lua`): an identity still wins over a
//! network, in the same call.
//!
//! The copy is read when the first limiter of the policy is made, then again at each change of
//! a network (`lua/override_book.lua` publishes the index's key on the reset channel,
//! `resets.rs`), when notices may have been lost, and every [`REREAD_EVERY`] whatever happens (a
//! store that can't subscribe hears no notice). A change made through this store applies to its
//! copy before the call returns.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use super::RedisStore;
use super::overrides::{index_keys, listed_of, networks_call};
use super::script::OVERRIDE_BOOK;
use crate::store::overrides::OverrideBook;
use crate::store::{ResetListener, Store};

/// How long a copy goes at most without being read again.
const REREAD_EVERY: Duration = Duration::from_secs(10);

/// The copies of one store, by policy (`prefix:name:`); each lives as long as a limiter holds it.
#[derive(Default)]
pub(super) struct Mirrors(Mutex<HashMap<String, Weak<OverrideBook>>>);

/// What wakes a copy's reader: a notice of its index's key, or notices lost.
struct Listener {
    notice: String,
    wake: Notify,
}

impl ResetListener for Listener {
    fn key_reset(&self, key: &str) {
        if key == self.notice {
            self.wake.notify_one();
        }
    }

    fn notices_lost(&self) {
        self.wake.notify_one();
    }
}

impl RedisStore {
    /// The copy of the addresses and networks set for the policy whose keys start with
    /// `key_base`: the one limiters of it hold already, or a new one, read from now on.
    pub(super) fn mirror_of(&self, key_base: &str) -> Arc<OverrideBook> {
        let mut mirrors = self
            .shared
            .mirrors
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        mirrors.retain(|_, book| book.strong_count() > 0);
        if let Some(book) = mirrors.get(key_base).and_then(Weak::upgrade) {
            return book;
        }
        let book = Arc::new(OverrideBook::new(Arc::new(now_ms)));
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // (Not kept: a limiter made inside a runtime later gets a copy that is read.)
            tracing::warn!(
                key_base,
                "a rate limiter made outside a Tokio runtime can't read the networks set at run \
                 time for its policy: make it inside one"
            );
            return book;
        };
        mirrors.insert(key_base.to_owned(), Arc::downgrade(&book));
        drop(mirrors);
        let [notice, ..] = index_keys(key_base);
        let listener = Arc::new(Listener {
            notice,
            wake: Notify::new(),
        });
        // (Without notices, a copy is read again every REREAD_EVERY.)
        let listening: Weak<dyn ResetListener> = Arc::downgrade(&listener) as _;
        let _ = self.watch_resets(listening);
        runtime.spawn(keep(
            self.clone(),
            key_base.to_owned(),
            Arc::downgrade(&book),
            listener,
        ));
        book
    }

    /// The copy of the policy whose keys start with `key_base`, if a limiter holds one.
    pub(super) fn mirror_held(&self, key_base: &str) -> Option<Arc<OverrideBook>> {
        let mirrors = self
            .shared
            .mirrors
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        mirrors.get(key_base).and_then(Weak::upgrade)
    }
}

/// Reads the copy `book` of the policy whose keys start with `key_base` again at each wake-up
/// and every [`REREAD_EVERY`], as long as a limiter holds it.
async fn keep(
    store: RedisStore,
    key_base: String,
    book: Weak<OverrideBook>,
    listener: Arc<Listener>,
) {
    let mut failing = false;
    loop {
        let Some(changes) = book.upgrade().map(|book| book.changes()) else {
            return;
        };
        let read = store
            .run_script(networks_call(&key_base), &OVERRIDE_BOOK)
            .await;
        match read.and_then(listed_of) {
            Ok(listed) => {
                let Some(book) = book.upgrade() else {
                    return;
                };
                failing = false;
                // A change made here meanwhile: the read may have missed it, read again.
                if !book.replace(listed, changes) {
                    continue;
                }
            }
            // (Said once per outage, not every REREAD_EVERY.)
            Err(error) if !failing => {
                failing = true;
                tracing::warn!(
                    key_base,
                    %error,
                    "can't read the networks set at run time: the copy held stays as it is"
                );
            }
            Err(_) => {}
        }
        // (A notice heard while reading wakes the next wait at once: `notify_one` keeps it.)
        let _ = tokio::time::timeout(REREAD_EVERY, listener.wake.notified()).await;
    }
}

/// This machine's time, in ms since the Unix epoch (a copy's overrides end by the time they had
/// left when read).
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}
