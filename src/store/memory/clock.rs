//! The time source of a [`MemoryStore`](super::MemoryStore): the [`Clock`] trait, the default
//! [`SystemClock`] and the [`ManualClock`] of tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
/// The time source of a [`MemoryStore`](super::MemoryStore), in milliseconds since the Unix epoch.
///
/// Tests use [`ManualClock`]; the default is [`SystemClock`].
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_unix_ms(&self) -> u64;
}

/// Unix time that never goes backwards: the system time when the clock was made, plus a monotonic
/// `Instant` since then. A system clock stepped back by NTP can't reopen a window; in exchange the
/// clock drifts from the wall clock by whatever steps the system clock takes later (small, and
/// only visible in `X-RateLimit-Reset`).
#[derive(Debug, Clone)]
pub struct SystemClock {
    anchor_unix_ms: u64,
    anchor: Instant,
}

impl SystemClock {
    /// Anchors the clock at the current system time.
    pub fn new() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        SystemClock {
            anchor_unix_ms: millis(since_epoch),
            anchor: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now_unix_ms(&self) -> u64 {
        self.anchor_unix_ms + millis(self.anchor.elapsed())
    }
}

/// A clock that moves only when told to, for tests. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_millis(250));
/// assert_eq!(clock.now_unix_ms(), 1_250);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock showing `unix_ms`.
    pub fn new(unix_ms: u64) -> Self {
        ManualClock(Arc::new(AtomicU64::new(unix_ms)))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(millis(by), Ordering::SeqCst);
    }

    /// Sets the clock.
    pub fn set(&self, unix_ms: u64) {
        self.0.store(unix_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_unix_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A duration in whole milliseconds, saturating.
pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
