//! What an upstream's last answer to this instance announced is left of its requests and tokens
//! (OpenAI's and Anthropic's headers, read by `vendor.rs`), so that a call needing more than is
//! left waits for it to come back instead of meeting a 429; and the warning when the vendor's
//! limit is below the policy's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::vendor::{Announcement, Bucket};
use crate::policy::{Policy, Rule};

/// The most upstreams whose announcements are kept at once; past it a new one is not kept (its
/// calls go by the store's count alone, as without vendor headers).
const MAX_ANNOUNCED: usize = 1_024;

/// The announcements this instance was answered, by store key, until their buckets are full
/// again. Local, as the answers are: every instance reads its own.
#[derive(Debug, Default)]
pub(super) struct Announced {
    snapshots: Mutex<HashMap<String, Snapshot>>,
    /// Whether a vendor limit below the policy's was said yet (once per layer).
    warned_below: AtomicBool,
}

/// One answer's buckets, when it came, and what this instance's calls took since.
#[derive(Debug)]
struct Snapshot {
    announcement: Announcement,
    seen: Instant,
    /// The longest wait it makes, from `seen` (the layer's pause cap).
    cap: Duration,
    /// When every bucket is full again: the snapshot says nothing after it.
    ends: Instant,
    sent_requests: u64,
    sent_tokens: u64,
}

impl Announced {
    /// Keeps what an answer about `key` announced (`now`: when it came), in place of the last;
    /// no wait it makes lasts longer than `cap` from the answer.
    pub(super) fn learn(&self, key: &str, announcement: Announcement, now: Instant, cap: Duration) {
        let buckets = [announcement.requests, announcement.tokens];
        let Some(longest) = buckets.iter().flatten().filter_map(Bucket::reset).max() else {
            return;
        };
        let snapshot = Snapshot {
            announcement,
            seen: now,
            cap,
            ends: now + longest.min(cap),
            sent_requests: 0,
            sent_tokens: 0,
        };
        let mut snapshots = self.lock();
        if let Some(kept) = snapshots.get_mut(key) {
            *kept = snapshot;
            return;
        }
        // Sweeping the ended ones at each new key keeps the map small.
        snapshots.retain(|_, kept| kept.ends > now);
        if snapshots.len() < MAX_ANNOUNCED {
            snapshots.insert(key.to_owned(), snapshot);
        }
    }

    /// How long a call to `key` that needs one request and `tokens` (a metered call's estimate)
    /// waits for them to come back, by the last announcement, if at all.
    pub(super) fn wait(&self, key: &str, tokens: Option<u64>, now: Instant) -> Option<Duration> {
        let snapshots = self.lock();
        let kept = snapshots.get(key)?;
        let requests = kept.announcement.requests.map_or(Duration::ZERO, |bucket| {
            bucket.wait_for(1, kept.sent_requests)
        });
        let tokens = kept
            .announcement
            .tokens
            .zip(tokens)
            .map_or(Duration::ZERO, |(bucket, needed)| {
                bucket.wait_for(needed, kept.sent_tokens)
            });
        let from_now = requests
            .max(tokens)
            .min(kept.cap)
            .saturating_sub(now.saturating_duration_since(kept.seen));
        Some(from_now).filter(|wait| !wait.is_zero())
    }

    /// A call to `key` was sent, taking one request and `tokens` of what was announced.
    pub(super) fn sent(&self, key: &str, tokens: Option<u64>) {
        if let Some(kept) = self.lock().get_mut(key) {
            kept.sent_requests = kept.sent_requests.saturating_add(1);
            kept.sent_tokens = kept.sent_tokens.saturating_add(tokens.unwrap_or(0));
        }
    }

    /// Says once, at WARN, when the vendor announces a limit below the policy's: the policy
    /// then lets more through than the vendor takes, and the calls past it meet 429s.
    pub(super) fn compare(&self, policy: &Policy, upstream: &str, announcement: &Announcement) {
        let pairs = [
            (announcement.requests, false, "requests"),
            (announcement.tokens, true, "tokens"),
        ];
        for (bucket, metered, kind) in pairs {
            let Some(vendor) = bucket.and_then(|bucket| bucket.limit) else {
                continue;
            };
            let Some(rule) = nearest_a_minute(policy.rules(), metered) else {
                continue;
            };
            if vendor < rule.limit() && !self.warned_below.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    policy = policy.name(),
                    upstream,
                    kind,
                    vendor_limit = vendor,
                    policy_limit = rule.limit(),
                    period_ms = rule.period_ms(),
                    "the upstream announces a limit below the policy's: calls past it will \
                     meet 429s; set the policy from the vendor's limits (said once)"
                );
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Snapshot>> {
        // The map holds plain numbers: one left by a panicking thread is still whole.
        self.snapshots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The rule whose period is nearest a minute among the metered ones (`metered`) or the others:
/// the one a vendor's per-minute limit (RPM, TPM) corresponds to.
fn nearest_a_minute(rules: &[Rule], metered: bool) -> Option<&Rule> {
    rules
        .iter()
        .filter(|rule| rule.is_metered() == metered && !rule.is_duplicate_guard())
        .min_by_key(|rule| rule.period_ms().abs_diff(60_000))
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use http::{HeaderMap, HeaderName};

    use super::super::vendor::announcement;
    use super::*;

    fn announced(pairs: &[(&str, &str)]) -> Announcement {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        announcement(&map, UNIX_EPOCH + Duration::from_secs(1_717_200_000))
    }

    /// OpenAI's documented example: 150 000 tokens a minute, 149 984 left, full again in 6 ms
    /// (the 16 used come back in 6 ms). After calls of 149 800 tokens sent since, 184 are left:
    /// a call of 200 misses 16 and waits the 6 ms they take; later, less.
    #[tokio::test(start_paused = true)]
    async fn a_call_above_what_is_left_waits_for_the_missing_tokens() {
        let announced_tokens = announced(&[
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-tokens", "6ms"),
        ]);
        let kept = Announced::default();
        let now = Instant::now();
        kept.learn("openai", announced_tokens, now, Duration::from_secs(600));
        assert_eq!(kept.wait("openai", Some(100_000), now), None);
        assert_eq!(kept.wait("openai", None, now), None, "requests: no word");
        kept.sent("openai", Some(149_800));
        assert_eq!(
            kept.wait("openai", Some(200), now),
            Some(Duration::from_millis(6))
        );
        let ms = Duration::from_millis;
        assert_eq!(kept.wait("openai", Some(200), now + ms(4)), Some(ms(2)));
        assert_eq!(kept.wait("openai", Some(200), now + ms(6)), None);
        // An estimate above the whole bucket waits for the reset, no longer.
        assert_eq!(kept.wait("openai", Some(10_000_000), now), Some(ms(6)));
        assert_eq!(kept.wait("other", Some(10_000_000), now), None);
    }

    /// Anthropic's requests bucket, 50 a minute with none left: a call waits for one to come
    /// back (1.2 s of the minute); one sent meanwhile counts.
    #[tokio::test(start_paused = true)]
    async fn anthropic_requests_left_are_kept_and_taken() {
        let reset = humantime::format_rfc3339(UNIX_EPOCH + Duration::from_secs(1_717_200_000 + 60))
            .to_string();
        let announced_requests = announced(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "1"),
            ("anthropic-ratelimit-requests-reset", &reset),
        ]);
        let kept = Announced::default();
        let now = Instant::now();
        kept.learn(
            "anthropic",
            announced_requests,
            now,
            Duration::from_secs(600),
        );
        assert_eq!(kept.wait("anthropic", None, now), None);
        kept.sent("anthropic", None);
        // 49 came back in 60 s, so one takes 60 / 49 s, rounded up to the millisecond.
        assert_eq!(
            kept.wait("anthropic", None, now),
            Some(Duration::from_millis(1_225))
        );
        // A new answer replaces the last, and what was sent before it.
        kept.learn(
            "anthropic",
            announced_requests,
            now,
            Duration::from_secs(600),
        );
        assert_eq!(kept.wait("anthropic", None, now), None);
    }

    #[test]
    fn a_vendor_limit_is_compared_with_the_rule_nearest_a_minute() {
        let rules = [
            Rule::per_day(1_000_000).metered(),
            Rule::per_minute(40_000).metered(),
            Rule::per_second(10),
            Rule::per_minute(600),
        ];
        assert_eq!(nearest_a_minute(&rules, true).unwrap().limit(), 40_000);
        assert_eq!(nearest_a_minute(&rules, false).unwrap().limit(), 600);
        assert!(nearest_a_minute(&rules[..2], false).is_none());
    }
}
