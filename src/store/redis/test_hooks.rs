//! Hooks for the crate's own tests: a fixed Redis time, checks that skip `lua/fast.lua`, a batch sent
//! by hand. Compiled in debug builds (as `cargo test` builds) and with the `test-hooks` feature;
//! never in a release build, so production pays for none of it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::time::Instant;

use super::command::Member;
use crate::decision::Decision;
use crate::store::{CheckRequest, StoreError};

use super::RedisStore;

/// What the tests set on a store (and its clones).
#[derive(Default)]
pub(super) struct TestHooks {
    /// A time (µs) that every script call takes instead of Redis TIME; 0: none.
    fixed_time_us: AtomicU64,
    /// Whether checks skip the script's lean functions of the common case.
    generic_only: AtomicBool,
}

impl TestHooks {
    /// The time every script call takes, if the test fixed one.
    pub(super) fn fixed_time(&self) -> Option<u64> {
        Some(self.fixed_time_us.load(Ordering::Relaxed)).filter(|&time| time > 0)
    }

    /// Whether checks take `lua/entry.lua` only, never `lua/fast.lua`.
    pub(super) fn generic_only(&self) -> bool {
        self.generic_only.load(Ordering::Relaxed)
    }
}

impl RedisStore {
    /// Makes every script call of this store (and its clones) check at `unix_us` instead of
    /// Redis's time, or at Redis's time again with `None`. For tests that compare decisions
    /// exactly; never in production.
    #[doc(hidden)]
    pub fn fix_time_for_tests(&self, unix_us: Option<u64>) {
        self.shared
            .hooks
            .fixed_time_us
            .store(unix_us.unwrap_or(0), Ordering::Relaxed);
    }

    /// Makes the store's checks skip the script's lean functions of the common case
    /// (`lua/fast.lua`), for tests that compare them with the generic ones.
    #[doc(hidden)]
    pub fn generic_checks_for_tests(&self, generic: bool) {
        self.shared
            .hooks
            .generic_only
            .store(generic, Ordering::Relaxed);
    }

    /// Waits until every call handed to the store's group commit has landed and its answer has
    /// been applied: the give-backs, settles and releases a response starts in the background
    /// included. For tests that read what those wrote, rather than sleep for it. Not covered: a
    /// prefetching policy's takes ahead (a task of their own, seen once it runs), a call whose
    /// request was dropped while Redis ran it, and a Redis Cluster store (no group commit).
    ///
    /// # Panics
    ///
    /// When calls are still landing after 10 s (a test that never lets its calls end).
    #[doc(hidden)]
    pub async fn until_calls_land_for_tests(&self) {
        let batcher = &self.shared.batcher;
        until(
            || batcher.idle(),
            || batcher.is_idle(),
            "the store's calls were still landing",
        )
        .await;
    }

    /// Waits until this store's reset subscription has heard the notice of a reset of a key
    /// that contains `key_part` (a test's own prefix, say: the notices of every test on the same
    /// Redis are heard). For tests that read what a notice did, rather than sleep for it.
    ///
    /// # Panics
    ///
    /// When none has come after 10 s.
    #[doc(hidden)]
    pub async fn until_reset_heard_for_tests(&self, key_part: &str) {
        let resets = &self.shared.resets;
        let heard = || {
            resets
                .heard
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .any(|key| key.contains(key_part))
        };
        let changed = || resets.changed.notified();
        until(changed, heard, "no reset notice of the key was heard").await;
    }

    /// Waits until this store's reset subscription is up (`live`), or down: for tests of what
    /// an instance does then, rather than sleep for the subscription.
    ///
    /// # Panics
    ///
    /// When it is not so after 10 s.
    #[doc(hidden)]
    pub async fn until_resets_live_for_tests(&self, live: bool) {
        let resets = &self.shared.resets;
        let changed = || resets.changed.notified();
        let done = || resets.is_live() == live;
        until(changed, done, "the reset subscription was not as awaited").await;
    }

    /// Sends `requests` as one batch, in order, bypassing the queue: for tests that compare a
    /// batch with the same checks one at a time.
    #[doc(hidden)]
    pub async fn check_batch_for_tests(
        &self,
        requests: &[CheckRequest<'_>],
    ) -> Vec<Result<Decision, StoreError>> {
        let members: Vec<Member> = requests
            .iter()
            .map(|request| self.member(request))
            .collect();
        let deadline = Instant::now() + self.timeout;
        self.shared.call(&members, deadline).await
    }
}

/// Waits until `done` says so, asked again at each wake-up `wake` makes (listened to before
/// asking, so that none is missed).
///
/// # Panics
///
/// With `what` when it has not come after 10 s.
async fn until<'a>(
    wake: impl Fn() -> tokio::sync::futures::Notified<'a>,
    done: impl Fn() -> bool,
    what: &str,
) {
    let waited = async {
        loop {
            let woken = wake();
            let mut woken = std::pin::pin!(woken);
            woken.as_mut().enable();
            if done() {
                return;
            }
            woken.await;
        }
    };
    if tokio::time::timeout(std::time::Duration::from_secs(10), waited)
        .await
        .is_err()
    {
        panic!("{what} after 10 s");
    }
}
