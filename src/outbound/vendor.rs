//! The rate-limit headers LLM vendors send, read as pauses: OpenAI's (and Azure OpenAI's)
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` with resets written as durations
//! (`1s`, `6m0s`, `120ms`), `retry-after-ms`, and Anthropic's
//! `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`
//! with resets as RFC 3339 times.
//!
//! Both vendors refill their buckets continuously, and a reset is the time until one is full
//! again, from what remained to its limit. So a call that needs units a bucket lacks waits only
//! as long as they take to come back, `reset × missing / (limit − remaining)` when the limit is
//! sent (`reset × missing / limit` when nothing remained), never longer than the reset.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode};

/// The kinds of OpenAI's buckets (`x-ratelimit-remaining-<kind>`).
const OPENAI_KINDS: [&str; 2] = ["requests", "tokens"];

/// The kinds of Anthropic's buckets (`anthropic-ratelimit-<kind>-remaining`).
const ANTHROPIC_KINDS: [&str; 4] = ["requests", "tokens", "input-tokens", "output-tokens"];

/// The longest pause the vendors' headers announce for a call that needs one unit of each kind,
/// rounded up to whole milliseconds; zero when none does. Malformed values are no word.
pub(super) fn vendor_pause(status: StatusCode, upstream: &HeaderMap, now: SystemTime) -> Duration {
    let mut longest = Duration::ZERO;
    if (status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE)
        && let Some(ms) = text(upstream, "retry-after-ms").and_then(decimal_millis)
    {
        longest = longest.max(ms);
    }
    for kind in OPENAI_KINDS {
        longest = longest.max(openai_bucket(upstream, kind).wait_for(1, 0));
    }
    for kind in ANTHROPIC_KINDS {
        longest = longest.max(anthropic_bucket(upstream, kind, now).wait_for(1, 0));
    }
    ceil_millis(longest)
}

/// The requests and tokens a vendor's answer says are left: OpenAI's
/// `x-ratelimit-*-{requests,tokens}`, else Anthropic's `anthropic-ratelimit-{requests,tokens}-*`
/// (its `tokens` bucket is the most restrictive of its token limits in effect). A bucket is
/// there when its remaining and reset are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Announcement {
    pub(super) requests: Option<Bucket>,
    pub(super) tokens: Option<Bucket>,
}

/// What `upstream`'s headers announce is left of its requests and tokens.
pub(super) fn announcement(upstream: &HeaderMap, now: SystemTime) -> Announcement {
    let bucket = |kind: &str| {
        Some(openai_bucket(upstream, kind))
            .filter(|bucket| bucket.is_announced())
            .or_else(|| Some(anthropic_bucket(upstream, kind, now)))
            .filter(|bucket| bucket.is_announced())
    };
    Announcement {
        requests: bucket("requests"),
        tokens: bucket("tokens"),
    }
}

fn openai_bucket(upstream: &HeaderMap, kind: &str) -> Bucket {
    Bucket {
        limit: integer(upstream, &format!("x-ratelimit-limit-{kind}")),
        remaining: integer(upstream, &format!("x-ratelimit-remaining-{kind}")),
        reset: text(upstream, &format!("x-ratelimit-reset-{kind}")).and_then(go_duration),
    }
}

fn anthropic_bucket(upstream: &HeaderMap, kind: &str, now: SystemTime) -> Bucket {
    let reset = text(upstream, &format!("anthropic-ratelimit-{kind}-reset"))
        .and_then(|at| humantime::parse_rfc3339(at.trim()).ok())
        .map(|at| at.duration_since(now).unwrap_or_default());
    Bucket {
        limit: integer(upstream, &format!("anthropic-ratelimit-{kind}-limit")),
        remaining: integer(upstream, &format!("anthropic-ratelimit-{kind}-remaining")),
        reset,
    }
}

/// One vendor bucket as its headers describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bucket {
    pub(super) limit: Option<u64>,
    remaining: Option<u64>,
    /// The time until it is full again.
    reset: Option<Duration>,
}

impl Bucket {
    /// Whether the headers said what is left and when it is full.
    fn is_announced(&self) -> bool {
        self.remaining.is_some() && self.reset.is_some()
    }

    /// The time from the answer until it is full again.
    pub(super) fn reset(&self) -> Option<Duration> {
        self.reset
    }

    /// How long, from the answer, a call that needs `needed` units waits for them when `sent`
    /// were taken since: none while they remain; else the time the missing ones take to come
    /// back. The bucket refills continuously, from what remained to its limit in the reset, so
    /// that is `reset × missing / (limit − remaining)` (`reset × missing / limit` when nothing
    /// remained), at most the reset (all of it without a limit). Rounded up to whole
    /// milliseconds.
    pub(super) fn wait_for(&self, needed: u64, sent: u64) -> Duration {
        let (Some(remaining), Some(reset)) = (self.remaining, self.reset) else {
            return Duration::ZERO;
        };
        let left = remaining.saturating_sub(sent);
        if left >= needed {
            return Duration::ZERO;
        }
        let missing = needed - left;
        let wait = match self.limit.filter(|&limit| limit > remaining) {
            Some(limit) => {
                let nanos = reset.as_nanos() * u128::from(missing);
                let wait = nanos.div_ceil(u128::from(limit - remaining));
                Duration::from_nanos(u64::try_from(wait).unwrap_or(u64::MAX)).min(reset)
            }
            None => reset,
        };
        ceil_millis(wait)
    }
}

/// `duration` rounded up to whole milliseconds: a caller that waits this long is never early.
fn ceil_millis(duration: Duration) -> Duration {
    let millis = duration.as_nanos().div_ceil(1_000_000);
    Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX))
}

/// A duration as Go prints one, as OpenAI's resets are: `1s`, `6m0s`, `1.5s`, `120ms`,
/// `1h2m3.004s`; a sequence of numbers (with an optional fraction), each with its unit (`h`,
/// `m`, `s`, `ms`, `us`, `µs`, `ns`). `None` for anything else. A well-formed duration longer
/// than a `Duration` of `u64::MAX` nanoseconds (about 584 years) is that: the longest wait
/// said, which the caller caps, never none.
pub(crate) fn go_duration(text: &str) -> Option<Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_end);
        let unit_end = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_end);
        let unit_nanos: u64 = match unit {
            "h" => 3_600_000_000_000,
            "m" => 60_000_000_000,
            "s" => 1_000_000_000,
            "ms" => 1_000_000,
            "us" | "µs" => 1_000,
            "ns" => 1,
            _ => return None,
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() {
            return None;
        }
        // (Digits only: a number that doesn't parse is past u64, and saturates.)
        let whole: u64 = if whole.is_empty() {
            0
        } else {
            whole.parse().unwrap_or(u64::MAX)
        };
        if !fraction.bytes().all(|byte| byte.is_ascii_digit()) {
            return None;
        }
        // The fraction's nanoseconds, rounded up: a wait is never cut short.
        let mut fraction_nanos: u128 = 0;
        let mut scale: u128 = 1;
        for digit in fraction.bytes().take(18) {
            fraction_nanos = fraction_nanos * 10 + u128::from(digit - b'0');
            scale *= 10;
        }
        let part = u128::from(whole) * u128::from(unit_nanos)
            + (fraction_nanos * u128::from(unit_nanos)).div_ceil(scale);
        let longest = Duration::from_nanos(u64::MAX);
        total = total
            .saturating_add(Duration::from_nanos(
                u64::try_from(part).unwrap_or(u64::MAX),
            ))
            .min(longest);
        rest = next;
    }
    Some(total)
}

/// `retry-after-ms`: milliseconds, whole or with a fraction.
fn decimal_millis(text: &str) -> Option<Duration> {
    go_duration(&format!("{}ms", text.trim())).filter(|_| !text.trim().is_empty())
}

/// A header's text.
fn text<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name)?.to_str().ok()
}

/// A header holding one non-negative integer.
fn integer(headers: &HeaderMap, name: &str) -> Option<u64> {
    text(headers, name)?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use http::HeaderName;
    use proptest::prelude::*;

    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    /// 2024-06-01T00:00:00Z.
    const NOW: u64 = 1_717_200_000;

    fn pause(status: u16, pairs: &[(&str, &str)]) -> Duration {
        let now = UNIX_EPOCH + Duration::from_secs(NOW);
        vendor_pause(StatusCode::from_u16(status).unwrap(), &headers(pairs), now)
    }

    #[test]
    fn go_durations_as_openai_writes_them() {
        let ms = Duration::from_millis;
        assert_eq!(go_duration("1s"), Some(ms(1_000)));
        assert_eq!(go_duration("6m0s"), Some(ms(360_000)));
        assert_eq!(go_duration("1.5s"), Some(ms(1_500)));
        assert_eq!(go_duration("120ms"), Some(ms(120)));
        assert_eq!(go_duration("1h2m3.004s"), Some(ms(3_723_004)));
        assert_eq!(go_duration("17.28s"), Some(ms(17_280)));
        assert_eq!(go_duration("250us"), Some(Duration::from_micros(250)));
        assert_eq!(go_duration("0s"), Some(Duration::ZERO));
        // A fraction past the nanosecond rounds up, never down.
        assert_eq!(go_duration("0.0000000001s"), Some(Duration::from_nanos(1)));
        for bad in [
            "", "s", "1", "1x", "1.2.3s", "-1s", "1s2", "ms", ".s", "1 s",
        ] {
            assert_eq!(go_duration(bad), None, "{bad:?}");
        }
        // Longer than a Duration can say: the longest, which the layer caps, not none.
        let longest = Some(Duration::from_nanos(u64::MAX));
        for huge in [
            "9999999999999999999h",
            "9999999999h",
            "18446744073709551616ms",
            "99999999999999999999999999s",
            "1000000000000000000ms1h",
        ] {
            assert_eq!(go_duration(huge), longest, "{huge:?}");
        }
    }

    /// The values of OpenAI's documentation (rate limits, "Rate limits in headers").
    #[test]
    fn openai_headers_pause_a_call_that_needs_what_a_bucket_lacks() {
        let documented = [
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ];
        assert_eq!(pause(200, &documented), Duration::ZERO);
        // No request left: one comes back in 1 s / 60, rounded up to 17 ms.
        let mut out = documented;
        out[2].1 = "0";
        assert_eq!(pause(200, &out), Duration::from_millis(17));
        // No token left: one token comes back in 6 min / 150 000 = 2.4 ms, so 3 ms.
        let mut out = documented;
        out[3].1 = "0";
        assert_eq!(pause(200, &out), Duration::from_millis(3));
        // Without its limit, the whole reset.
        assert_eq!(
            pause(
                200,
                &[
                    ("x-ratelimit-remaining-requests", "0"),
                    ("x-ratelimit-reset-requests", "20ms")
                ]
            ),
            Duration::from_millis(20)
        );
        // A 429 with `retry-after-ms` (Azure OpenAI sends it too), a fraction rounded up.
        assert_eq!(
            pause(429, &[("retry-after-ms", "1500.2")]),
            Duration::from_millis(1_501)
        );
        assert_eq!(pause(200, &[("retry-after-ms", "1500")]), Duration::ZERO);
    }

    /// The values of Anthropic's documentation (rate limits, "Response headers").
    #[test]
    fn anthropic_headers_pause_until_the_units_come_back() {
        let reset = "2024-06-01T00:00:30Z"; // 30 s after NOW
        assert_eq!(
            pause(
                200,
                &[
                    ("anthropic-ratelimit-requests-limit", "50"),
                    ("anthropic-ratelimit-requests-remaining", "0"),
                    ("anthropic-ratelimit-requests-reset", reset),
                ]
            ),
            Duration::from_millis(600)
        );
        // Output tokens out, no limit sent: the whole reset, with its fraction rounded up.
        assert_eq!(
            pause(
                200,
                &[
                    ("anthropic-ratelimit-output-tokens-remaining", "0"),
                    (
                        "anthropic-ratelimit-output-tokens-reset",
                        "2024-06-01T00:00:01.2345Z"
                    ),
                ]
            ),
            Duration::from_millis(1_235)
        );
        // Units left, or a reset in the past: no pause.
        assert_eq!(
            pause(
                200,
                &[
                    ("anthropic-ratelimit-tokens-remaining", "5"),
                    ("anthropic-ratelimit-tokens-reset", reset),
                ]
            ),
            Duration::ZERO
        );
        assert_eq!(
            pause(
                200,
                &[
                    ("anthropic-ratelimit-tokens-remaining", "0"),
                    ("anthropic-ratelimit-tokens-reset", "2024-05-31T23:59:00Z"),
                ]
            ),
            Duration::ZERO
        );
    }

    #[test]
    fn malformed_values_are_no_word() {
        for pairs in [
            &[
                ("x-ratelimit-remaining-tokens", "none"),
                ("x-ratelimit-reset-tokens", "1s"),
            ][..],
            &[
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "soon"),
            ],
            &[
                ("x-ratelimit-remaining-tokens", "-1"),
                ("x-ratelimit-reset-tokens", "1s"),
            ],
            &[
                ("anthropic-ratelimit-tokens-remaining", "0"),
                ("anthropic-ratelimit-tokens-reset", "tomorrow"),
            ],
            &[("retry-after-ms", "")],
            &[("retry-after-ms", "a lot")],
        ] {
            assert_eq!(pause(429, pairs), Duration::ZERO, "{pairs:?}");
        }
    }

    proptest! {
        /// Whatever the headers hold, reading them never panics, and a bucket's wait is never
        /// longer than its reset (rounded up to the millisecond).
        #[test]
        fn any_value_is_read_without_a_panic(
            remaining in "\\PC{0,12}",
            reset in "\\PC{0,16}",
            limit in "\\PC{0,12}",
        ) {
            let mut map = HeaderMap::new();
            for (name, value) in [
                ("x-ratelimit-remaining-tokens", &remaining),
                ("x-ratelimit-reset-tokens", &reset),
                ("x-ratelimit-limit-tokens", &limit),
                ("anthropic-ratelimit-tokens-reset", &reset),
                ("retry-after-ms", &remaining),
            ] {
                if let Ok(value) = value.parse() {
                    map.insert(HeaderName::from_static(name), value);
                }
            }
            let now = UNIX_EPOCH + Duration::from_secs(NOW);
            let _ = vendor_pause(StatusCode::TOO_MANY_REQUESTS, &map, now);
            let _ = announcement(&map, now);
            if let Some(reset) = go_duration(&reset) {
                let bucket = Bucket { limit: limit.trim().parse().ok(), remaining: Some(0), reset: Some(reset) };
                prop_assert!(bucket.wait_for(1, 0) <= ceil_millis(reset));
                prop_assert!(bucket.wait_for(u64::MAX, u64::MAX) <= ceil_millis(reset));
            }
        }
    }
}
