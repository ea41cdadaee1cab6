//! Reading an upstream's own limits from its answer: how long it asks its callers to stop; and
//! the pauses an instance learnt, kept at hand for its own calls.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, StatusCode};
use tokio::time::Instant;

use crate::headers::{self, RetryAfter};

/// The most upstreams [`LocalPauses`] keeps paused at once; past it a new pause is kept in the
/// store only (still seen by every call, at a store read each).
const MAX_LOCAL_PAUSES: usize = 1_024;

/// The pauses this instance learnt, by store key, until they end, so that its own calls see one
/// without asking the store. The store stays the truth (other instances' pauses are only there);
/// this only saves the reads of the common case, the instance that was told.
#[derive(Debug, Default)]
pub(super) struct LocalPauses(Mutex<HashMap<String, Instant>>);

impl LocalPauses {
    /// `key` is paused until `until` (a pause never shortens a longer one).
    pub(super) fn set(&self, key: &str, until: Instant) {
        let mut pauses = self.lock();
        if let Some(end) = pauses.get_mut(key) {
            *end = (*end).max(until);
            return;
        }
        // Pauses are rare: sweeping the ended ones at each new one keeps the map small.
        let now = Instant::now();
        pauses.retain(|_, end| *end > now);
        if pauses.len() < MAX_LOCAL_PAUSES {
            pauses.insert(key.to_owned(), until);
        }
    }

    /// How long `key`'s pause has left, if this instance knows of one.
    pub(super) fn left(&self, key: &str) -> Option<Duration> {
        let pauses = self.lock();
        let end = *pauses.get(key)?;
        Some(end.saturating_duration_since(Instant::now())).filter(|left| !left.is_zero())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        // The map holds plain instants: one left by a panicking thread is still whole.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `X-RateLimit-Reset` values from this on are Unix times (seconds); below, seconds from now.
/// (GitHub sends the former, many APIs the latter; 10^9 s is 2001, and no reset is 31 years away.)
const UNIX_TIME_FROM: u64 = 1_000_000_000;

/// `X-RateLimit-Reset` values from this on are Unix times in milliseconds: as seconds they would
/// be past the year 5000 (10^11 ms is 1973, and every reset of this century in ms is above it).
const UNIX_MILLIS_FROM: u64 = 100_000_000_000;

/// How long `upstream`'s answer asks every caller to wait before the next request, if at all:
/// the longest of
/// - `Retry-After` (delay-seconds or an HTTP-date) on a 429 or a 503;
/// - the reset `t` of an IETF `RateLimit` item with `r=0`;
/// - `X-RateLimit-Reset` (Unix seconds, or seconds from now, whole or with a fraction as
///   Discord sends them: `2.5`, `1795674424.250`; a value too large for Unix seconds is Unix
///   milliseconds) with `X-RateLimit-Remaining: 0`;
/// - LLM vendors' headers: `retry-after-ms` on a 429 or a 503 (OpenAI, Azure OpenAI);
///   OpenAI's `x-ratelimit-remaining-{requests,tokens}: 0` with `x-ratelimit-reset-…` (a
///   duration such as `1s`, `6m0s` or `120ms`); Anthropic's
///   `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-remaining: 0` with `-reset`
///   (an RFC 3339 time). Their buckets refill continuously and a reset is the time until full, so
///   with the bucket's `-limit` sent the wait is the time one unit takes to come back
///   (`reset / limit`), never more than the reset; every such wait is rounded up to whole
///   milliseconds;
/// - a gRPC upstream's trailers-only `RESOURCE_EXHAUSTED` (`grpc-status: 8` in the headers): its
///   `grpc-retry-pushback-ms` and, with the `grpc` feature, the `RetryInfo` of its
///   `grpc-status-details-bin`. (A status that comes in trailers, after a response has begun, is
///   not seen: servers and proxies refuse a call before answering it, trailers-only.)
///
/// Each header is read on its own, so a malformed one doesn't hide the others; malformed values
/// are ignored and nothing here panics. `now` turns HTTP-dates and Unix times into waits. The
/// result is not capped: [`OutboundLayer::pause_cap`](super::OutboundLayer::pause_cap) does that.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use http::{HeaderMap, StatusCode};
/// use tower_redis_ratelimit::outbound::announced_pause;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "2".parse().unwrap());
/// let now = SystemTime::now();
/// assert_eq!(announced_pause(StatusCode::TOO_MANY_REQUESTS, &headers, now), Some(Duration::from_secs(2)));
/// assert_eq!(announced_pause(StatusCode::OK, &headers, now), None);
/// headers.insert("ratelimit", "\"default\";r=0;t=7".parse().unwrap());
/// assert_eq!(announced_pause(StatusCode::OK, &headers, now), Some(Duration::from_secs(7)));
/// ```
pub fn announced_pause(
    status: StatusCode,
    upstream: &HeaderMap,
    now: SystemTime,
) -> Option<Duration> {
    let mut longest = Duration::ZERO;
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        let retry = only(upstream, &http::header::RETRY_AFTER)
            .and_then(|alone| headers::parse(&alone).ok()?.retry_after);
        if let Some(retry) = retry {
            longest = longest.max(match retry {
                RetryAfter::Delay(delay) => delay,
                date => date.delay_from(now),
            });
        }
    }
    if let Some(alone) = only(upstream, &HeaderName::from_static("ratelimit"))
        && let Ok(parsed) = headers::parse(&alone)
    {
        for item in parsed.limits.iter().filter(|item| item.remaining == 0) {
            longest = longest.max(Duration::from_secs(item.reset.unwrap_or(0)));
        }
    }
    let remaining = integer(upstream, "x-ratelimit-remaining");
    if remaining == Some(0)
        && let Some(reset) = upstream
            .get("x-ratelimit-reset")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| reset_wait(value, now))
    {
        longest = longest.max(reset);
    }
    if let Some(wait) = crate::grpc::announced_wait(upstream) {
        longest = longest.max(wait);
    }
    longest = longest.max(super::vendor::vendor_pause(status, upstream, now));
    (!longest.is_zero()).then_some(longest)
}

/// A map of `name`'s field lines alone, when there are any.
fn only(headers: &HeaderMap, name: &HeaderName) -> Option<HeaderMap> {
    let mut alone = HeaderMap::new();
    for value in headers.get_all(name) {
        alone.append(name.clone(), value.clone());
    }
    (!alone.is_empty()).then_some(alone)
}

/// The wait an `X-RateLimit-Reset` value announces at `now`: Unix milliseconds, Unix seconds or
/// seconds from now (see [`UNIX_MILLIS_FROM`] and [`UNIX_TIME_FROM`]), whole or with a decimal
/// fraction; `None` for anything else.
fn reset_wait(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    let (whole, fraction) = value.split_once('.').unwrap_or((value, ""));
    let digits = |text: &str| text.bytes().all(|byte| byte.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(fraction) {
        return None;
    }
    let whole: u64 = whole.parse().ok()?;
    // Nanoseconds of the fraction (digits past the ninth can't matter).
    let nanos = fraction
        .bytes()
        .chain(std::iter::repeat(b'0'))
        .take(9)
        .fold(0u32, |nanos, digit| nanos * 10 + u32::from(digit - b'0'));
    let since_epoch = || now.duration_since(UNIX_EPOCH).unwrap_or_default();
    Some(if whole >= UNIX_MILLIS_FROM {
        // Milliseconds: the fraction is of a millisecond.
        let at = Duration::from_millis(whole) + Duration::from_nanos(u64::from(nanos) / 1_000);
        at.saturating_sub(since_epoch())
    } else if whole >= UNIX_TIME_FROM {
        Duration::new(whole, nanos).saturating_sub(since_epoch())
    } else {
        Duration::new(whole, nanos)
    })
}

/// A header holding one non-negative integer.
fn integer(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[tokio::test(start_paused = true)]
    async fn local_pauses_end_on_time_and_never_shorten() {
        let pauses = LocalPauses::default();
        assert_eq!(pauses.left("a"), None);
        pauses.set("a", Instant::now() + Duration::from_secs(2));
        pauses.set("a", Instant::now() + Duration::from_secs(1));
        assert_eq!(pauses.left("a"), Some(Duration::from_secs(2)));
        assert_eq!(pauses.left("b"), None);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(pauses.left("a"), None);
        // An ended pause is swept by the next one.
        pauses.set("b", Instant::now() + Duration::from_secs(1));
        assert_eq!(pauses.0.lock().unwrap().len(), 1);
    }

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

    const NOW: u64 = 1_800_000_000;

    fn pause(status: u16, pairs: &[(&str, &str)]) -> Option<Duration> {
        let now = UNIX_EPOCH + Duration::from_secs(NOW);
        announced_pause(StatusCode::from_u16(status).unwrap(), &headers(pairs), now)
    }

    #[test]
    fn retry_after_counts_on_429_and_503_only() {
        assert_eq!(
            pause(429, &[("retry-after", "2")]),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            pause(503, &[("retry-after", "120")]),
            Some(Duration::from_secs(120))
        );
        assert_eq!(pause(200, &[("retry-after", "2")]), None);
        assert_eq!(pause(429, &[]), None);
        // An HTTP-date 3 s after NOW (2027-01-15T08:00:00Z).
        let date = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(NOW + 3));
        assert_eq!(
            pause(429, &[("retry-after", &date)]),
            Some(Duration::from_secs(3))
        );
        let past = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(NOW - 60));
        assert_eq!(pause(429, &[("retry-after", &past)]), None);
    }

    #[test]
    fn a_legacy_reset_may_be_fractional_or_in_milliseconds() {
        let with = |reset: &str| {
            pause(
                200,
                &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", reset)],
            )
        };
        // Fractional delta seconds, as Discord sends them.
        assert_eq!(with("2.5"), Some(Duration::from_millis(2_500)));
        assert_eq!(with("0.25"), Some(Duration::from_millis(250)));
        // Fractional Unix seconds: 2.25 s after NOW.
        let unix = format!("{}.250", NOW + 2);
        assert_eq!(with(&unix), Some(Duration::from_millis(2_250)));
        // Unix milliseconds: 3.1 s after NOW, not a pause capped years away.
        let millis = (NOW * 1_000 + 3_100).to_string();
        assert_eq!(with(&millis), Some(Duration::from_millis(3_100)));
        let fractional_millis = format!("{}.5", NOW * 1_000 + 40);
        assert_eq!(
            with(&fractional_millis),
            Some(Duration::from_micros(40_500))
        );
        // Past or malformed: no pause, no panic.
        assert_eq!(with(&(NOW - 5).to_string()), None);
        for bad in [
            "", ".", "2.", ".5", "-1", "1e3", "2.5.1", "abc", "2,5", " 2 . 5 ",
        ] {
            let expected = if bad == "2." {
                Some(Duration::from_secs(2))
            } else {
                None
            };
            assert_eq!(with(bad), expected, "{bad:?}");
        }
    }

    #[test]
    fn ietf_items_with_nothing_left_pause_until_their_reset() {
        let both = [("ratelimit", "\"minute\";r=0;t=40, \"hour\";r=3;t=3000")];
        assert_eq!(pause(200, &both), Some(Duration::from_secs(40)));
        assert_eq!(pause(200, &[("ratelimit", "\"minute\";r=1;t=40")]), None);
        assert_eq!(pause(200, &[("ratelimit", "\"minute\";r=0")]), None);
    }

    #[test]
    fn the_legacy_trio_takes_unix_times_and_seconds_from_now() {
        let unix = (NOW + 30).to_string();
        let legacy = [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", unix.as_str()),
        ];
        assert_eq!(pause(200, &legacy), Some(Duration::from_secs(30)));
        let relative = [("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "12")];
        assert_eq!(pause(200, &relative), Some(Duration::from_secs(12)));
        let left = [("x-ratelimit-remaining", "4"), ("x-ratelimit-reset", "12")];
        assert_eq!(pause(200, &left), None);
    }

    #[test]
    fn a_malformed_header_hides_none_of_the_others_and_the_longest_wins() {
        let mixed = [
            ("ratelimit", "not a list;;;"),
            ("retry-after", "5"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "9"),
        ];
        assert_eq!(pause(429, &mixed), Some(Duration::from_secs(9)));
        assert_eq!(pause(429, &[("retry-after", "-3")]), None);
        assert_eq!(pause(429, &[("retry-after", "soon")]), None);
    }

    proptest! {
        /// Whatever the bytes, no panic; a pause, if any, is what some header said (so at most
        /// the largest number or date in them, which the layer then caps).
        #[test]
        fn arbitrary_header_values_never_panic(
            values in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 4),
            numbers in prop::collection::vec(any::<u64>(), 3),
            status in prop::sample::select(vec![200u16, 429, 503]),
        ) {
            let names = ["retry-after", "ratelimit", "x-ratelimit-remaining", "x-ratelimit-reset"];
            let mut map = HeaderMap::new();
            for (name, bytes) in names.iter().zip(&values) {
                if let Ok(value) = http::HeaderValue::from_bytes(bytes) {
                    map.append(HeaderName::from_static(name), value);
                }
            }
            let now = UNIX_EPOCH + Duration::from_secs(NOW);
            let _ = announced_pause(StatusCode::from_u16(status).unwrap(), &map, now);
            let huge = [
                ("retry-after", numbers[0].to_string()),
                ("ratelimit", format!("\"q\";r=0;t={}", numbers[1] % 1_000_000_000_000_000)),
                ("x-ratelimit-remaining", "0".to_owned()),
                ("x-ratelimit-reset", numbers[2].to_string()),
            ];
            let mut map = HeaderMap::new();
            for (name, value) in &huge {
                map.append(HeaderName::from_static(name), value.parse().unwrap());
            }
            let paused = announced_pause(StatusCode::from_u16(status).unwrap(), &map, now);
            let largest = Duration::from_secs(*numbers.iter().max().unwrap());
            prop_assert!(paused.is_none_or(|paused| paused <= largest));
        }
    }
}
