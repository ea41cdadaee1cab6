//! How much Redis memory a policy's sliding logs may take per identity, and the warning
//! [`PolicyBuilder::build`](super::PolicyBuilder::build) logs when that is a lot.
//!
//! A sliding log keeps one entry per admitted request in its window, up to its rule's limit (a
//! metered rule's entries count admissions, not units); the
//! other algorithms keep one small value per rule whatever the limit (under 200 bytes per rule in
//! Redis). The constants are measured by `cargo bench --bench redis_memory` (Redis 7.0, keys as
//! the layer builds them, `used_memory` growth per identity; the README has its tables). Redis
//! keeps a sorted set of up to 128 members in one compact listpack and a larger one as a skiplist
//! plus a hash table, so a log's cost per entry jumps about fourfold past 128 entries.

use super::{Algorithm, Policy};

/// A sliding log's Redis bytes besides its entries: key name, object, keyspace and expiry slots
/// (the bench's one-entry log, 181 B, less one compact entry).
const LOG_KEY_BYTES: u64 = 161;

/// The most entries Redis keeps in its compact encoding (`zset-max-listpack-entries`, 128 unless
/// configured otherwise).
const COMPACT_ENTRIES: u64 = 128;

/// Bytes per entry of a compact log (the bench: 19.9 B per entry from 1 to 128 entries).
const COMPACT_ENTRY_BYTES: u64 = 20;

/// A log past [`COMPACT_ENTRIES`]: a fixed part and bytes per entry, fitted to the bench's
/// 16 015 B at 129 entries and 102 397 B at 1 000 (99.2 B per entry between them).
const LARGE_LOG_BYTES: u64 = 3_250;

/// See [`LARGE_LOG_BYTES`].
const LARGE_ENTRY_BYTES: u64 = 99;

/// Above this estimate per identity, building the policy logs a warning. 10 KiB is about 30 times
/// what the other algorithms take for two rules (the bench: 300–360 B), 10 GiB for a million
/// active identities. Two small compact logs (10 per minute and 100 per hour: about 2 500 B) stay
/// under it; any single log past 128 entries (at least 16 KB) is over it.
const WARN_BYTES_PER_IDENTITY: u64 = 10 * 1024;

/// The Redis bytes of a sliding log holding `entries` entries.
fn log_bytes(entries: u64) -> u64 {
    if entries <= COMPACT_ENTRIES {
        LOG_KEY_BYTES + entries * COMPACT_ENTRY_BYTES
    } else {
        LARGE_LOG_BYTES.saturating_add(entries.saturating_mul(LARGE_ENTRY_BYTES))
    }
}

/// The most entries one identity's sliding logs hold under `policy`, and the Redis bytes they
/// take then (an estimate from the bench); `None` unless the policy counts with
/// [`Algorithm::SlidingLog`] (whose duplicate guard alone holds one entry at most).
pub(super) fn sliding_log_bytes_per_identity(policy: &Policy) -> Option<(u64, u64)> {
    if policy.algorithm() != Algorithm::SlidingLog {
        return None;
    }
    let rules = policy.rules();
    rules
        .iter()
        .map(|rule| {
            let entries = if rule.is_metered() {
                metered_entries(rule, rules)
            } else {
                rule.limit()
            };
            (entries, log_bytes(entries))
        })
        .reduce(|(entries, bytes), (more, more_bytes)| {
            (
                entries.saturating_add(more),
                bytes.saturating_add(more_bytes),
            )
        })
}

/// The most entries a metered rule's log holds: one per admission whatever its units, so at
/// most the requests the policy's rules of requests admit in its period (each scaled to it),
/// and never more than its limit.
fn metered_entries(metered: &super::Rule, rules: &[super::Rule]) -> u64 {
    let period = metered.period_ms().max(1);
    rules
        .iter()
        .filter(|rule| !rule.is_metered())
        .map(|rule| {
            let windows = period.div_ceil(rule.period_ms().max(1));
            rule.limit().saturating_mul(windows)
        })
        .fold(metered.limit(), u64::min)
}

/// What [`warn_if_large`] warns of: the entries and bytes per identity when over the threshold.
pub(super) fn large_sliding_logs(policy: &Policy) -> Option<(u64, u64)> {
    sliding_log_bytes_per_identity(policy).filter(|&(_, bytes)| bytes > WARN_BYTES_PER_IDENTITY)
}

/// Logs a warning when `policy`'s sliding logs may take more than
/// [`WARN_BYTES_PER_IDENTITY`] per identity.
pub(super) fn warn_if_large(policy: &Policy) {
    if let Some((entries, bytes)) = large_sliding_logs(policy) {
        tracing::warn!(
            policy = %policy.name(),
            entries_per_identity = entries,
            bytes_per_identity = bytes,
            "this sliding_log policy keeps an entry per admitted request: an active identity may \
             take up to about {} of Redis memory ({entries} entries). For limits this large, \
             choose Algorithm::SlidingCounter (algorithm = \"sliding_counter\"): the same \
             limits, weighted over two windows, in under 200 bytes per rule whatever the limits \
             (fixed_window and token_bucket too); keep sliding_log for small limits, where an \
             exact log costs little",
            in_words(bytes)
        );
    }
}

/// `bytes` as a person reads it: `850 bytes`, `127 KB`, `1.2 MB` (of 1 024).
fn in_words(bytes: u64) -> String {
    const KB: f64 = 1024.0;
    let value = bytes as f64;
    if value < KB {
        format!("{bytes} bytes")
    } else if value < KB * KB {
        format!("{:.0} KB", value / KB)
    } else {
        format!("{:.1} MB", value / KB / KB)
    }
}
