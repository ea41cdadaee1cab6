//! Rate-limit response headers: written by the middleware, parsed by clients and tests.
//!
//! Three families of fields are covered.
//!
//! **`RateLimit-Policy` and `RateLimit`** ([draft-ietf-httpapi-ratelimit-headers-10]).
//! Both are structured-field Lists ([RFC 9651]) with one item per rule. The item is
//! an sf-string naming the rule and its parameters carry the numbers:
//!
//! ```text
//! RateLimit-Policy: "20-per-60s";q=20;w=60, "100-per-3600s";q=100;w=3600
//! RateLimit: "20-per-60s";r=7;t=42, "100-per-3600s";r=87;t=3000
//! ```
//!
//! In `RateLimit-Policy`, `q` is the quota (required) and `w` the window in seconds
//! (optional). In `RateLimit`, `r` is the remaining quota (required) and `t` the
//! number of seconds until more quota is available (optional). Unknown parameters
//! (such as `pk` or `qu`) are ignored. A field may be sent as several field lines;
//! they form one list, as if joined with `", "`.
//!
//! **`X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`**: the legacy,
//! unstandardised trio. Each is a plain non-negative integer; the reset is a Unix
//! time in seconds (a point in time, not a delay).
//!
//! **`Retry-After`** ([RFC 9110, section 10.2.3]): either delay-seconds or an HTTP-date.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//!
//! use http::{HeaderMap, HeaderValue, header::RETRY_AFTER};
//! use tower_redis_ratelimit::headers::{self, RetryAfter};
//!
//! let mut map = HeaderMap::new();
//! map.insert(
//!     headers::RATELIMIT_POLICY,
//!     HeaderValue::from_static(r#""20-per-60s";q=20;w=60, "100-per-3600s";q=100;w=3600"#),
//! );
//! map.insert(
//!     headers::RATELIMIT,
//!     HeaderValue::from_static(r#""20-per-60s";r=7;t=42, "100-per-3600s";r=87;t=3000"#),
//! );
//! map.insert(RETRY_AFTER, HeaderValue::from_static("42"));
//!
//! let parsed = headers::parse(&map)?;
//! assert_eq!(parsed.policy("20-per-60s").map(|p| p.quota), Some(20));
//! let tightest = parsed.most_limiting().expect("two status items");
//! assert_eq!((tightest.name.as_str(), tightest.remaining), ("20-per-60s", 7));
//! assert_eq!(parsed.retry_after, Some(RetryAfter::Delay(Duration::from_secs(42))));
//! assert_eq!(parsed.legacy, None);
//! # Ok::<(), headers::HeaderParseError>(())
//! ```
//!
//! [draft-ietf-httpapi-ratelimit-headers-10]: https://datatracker.ietf.org/doc/draft-ietf-httpapi-ratelimit-headers/10/
//! [RFC 9651]: https://www.rfc-editor.org/rfc/rfc9651
//! [RFC 9110, section 10.2.3]: https://www.rfc-editor.org/rfc/rfc9110#section-10.2.3

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderName, HeaderValue};
use sfv::{BareItem, ItemSerializer, ListEntry, Parameters, Parser, StringRef};

// Re-exported where it was first public: the header writer refused such names before the
// policy did.
use crate::policy::InvalidRuleName;

/// `RateLimit-Policy`: the quota policies of the rules that apply to a request.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// `RateLimit`: the current state of each rule's quota.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// `X-RateLimit-Limit`: legacy header carrying the request quota of the reported rule.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");

/// `X-RateLimit-Remaining`: legacy header carrying the quota left for the reported rule.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");

/// `X-RateLimit-Reset`: legacy header carrying the Unix time (seconds) at which the quota resets.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Largest integer an sf-integer can carry (`999_999_999_999_999`); values above are
/// clamped to it when written.
pub(crate) const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// Optional whitespace (RFC 9110): never part of a field value proper.
const OWS: &[char] = &[' ', '\t'];

// ---------------------------------------------------------------------------
// Serialisation (server side)
// ---------------------------------------------------------------------------

/// One rule's entry in `RateLimit-Policy`, as passed to [`policy_header_value`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PolicyItem<'a> {
    /// Rule name, serialised once when the limiter was built.
    pub name: &'a SfName,
    /// Requests allowed per window (`q`).
    pub quota: u64,
    /// Window length in seconds (`w`).
    pub window_secs: u64,
}

/// A rule name serialised once as an sf-string (quotes and escapes included), so that the
/// per-response `RateLimit` value only has to append it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SfName(Box<str>);

impl SfName {
    /// Serialises `name` with sfv.
    ///
    /// # Errors
    ///
    /// [`InvalidRuleName`] if `name` contains anything but printable ASCII.
    pub(crate) fn new(name: &str) -> Result<Self, InvalidRuleName> {
        let string = StringRef::from_str(name).map_err(|_| InvalidRuleName {
            name: name.to_owned(),
        })?;
        Ok(SfName(
            ItemSerializer::new().bare_item(string).finish().into(),
        ))
    }

    /// Serialises a name a policy has checked (`check_rule_name`
    /// accepts exactly what an sf-string carries). Were one to slip through unchecked, its other
    /// characters would be written as `?` rather than make a header invalid.
    pub(crate) fn of_checked(name: &str) -> Self {
        SfName::new(name).unwrap_or_else(|_| {
            let printable: String = name
                .chars()
                .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
                .collect();
            SfName::new(&printable).unwrap_or(SfName("\"?\"".into()))
        })
    }

    /// The serialised name, quotes included.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// One rule's entry in `RateLimit`, as passed to [`ratelimit_header_value`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RuleEntry<'a> {
    /// Rule name, serialised once when the limiter was built.
    pub name: &'a SfName,
    /// Requests still allowed in the current window (`r`).
    pub remaining: u64,
    /// Seconds until more quota becomes available (`t`).
    pub reset_secs: u64,
}

/// Serialises the `RateLimit-Policy` value for `items`, e.g.
/// `"20-per-60s";q=20;w=60, "100-per-3600s";q=100;w=3600`. Runs once per limiter (and per quota tier's request).
/// Numbers above [`SF_INTEGER_MAX`] are clamped. An empty `items` gives an empty value, which
/// callers should not send (RFC 9651 never serialises empty lists).
pub(crate) fn policy_header_value(items: &[PolicyItem<'_>]) -> HeaderValue {
    write_list(
        items
            .iter()
            .map(|item| (item.name, item.quota, item.window_secs)),
        "q",
        "w",
    )
}

/// Serialises the `RateLimit` value for `items`, e.g.
/// `"20-per-60s";r=7;t=42, "100-per-3600s";r=87;t=3000`. Runs per response. Numbers above
/// [`SF_INTEGER_MAX`] are clamped.
pub(crate) fn ratelimit_header_value<'a, I>(items: I) -> HeaderValue
where
    I: IntoIterator<Item = RuleEntry<'a>>,
    I::IntoIter: Clone,
{
    write_list(
        items
            .into_iter()
            .map(|item| (item.name, item.remaining, item.reset_secs)),
        "r",
        "t",
    )
}

/// Writes a list of `name;<first>=a;<second>=b` items. The names were serialised by sfv when the
/// limiter was built and the parameters are non-negative integers, whose sf form is plain decimal
/// digits, so this only appends; the buffer is sized exactly, so the `HeaderValue` takes it over
/// without a second allocation.
fn write_list<'a>(
    items: impl Iterator<Item = (&'a SfName, u64, u64)> + Clone,
    first: &str,
    second: &str,
) -> HeaderValue {
    let items = items.map(|(name, a, b)| (name, a.min(SF_INTEGER_MAX), b.min(SF_INTEGER_MAX)));
    let count = items.clone().count();
    let len = items
        .clone()
        .map(|(name, a, b)| {
            name.0.len() + first.len() + second.len() + 4 + decimal_len(a) + decimal_len(b)
        })
        .sum::<usize>()
        + ", ".len() * count.saturating_sub(1);
    let mut out = String::with_capacity(len);
    let mut digits = itoa::Buffer::new();
    for (index, (name, a, b)) in items.enumerate() {
        if index > 0 {
            out.push_str(", ");
        }
        out.push_str(&name.0);
        for (key, value) in [(first, a), (second, b)] {
            out.push(';');
            out.push_str(key);
            out.push('=');
            out.push_str(digits.format(value));
        }
    }
    header_value(out)
}

/// How many decimal digits `value` has.
fn decimal_len(value: u64) -> usize {
    value.checked_ilog10().map_or(1, |log| log as usize + 1)
}

fn header_value(serialised: String) -> HeaderValue {
    HeaderValue::try_from(serialised)
        .expect("structured-field serialisation only emits printable ASCII")
}

// ---------------------------------------------------------------------------
// Parsing (client side)
// ---------------------------------------------------------------------------

/// Everything [`parse`] found in a response's rate-limit headers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RateLimitHeaders {
    /// Items of `RateLimit-Policy`, in order; later items repeating a name are dropped.
    pub policies: Vec<RateLimitPolicyItem>,
    /// Items of `RateLimit`, in order; later items repeating a name are dropped.
    pub limits: Vec<RateLimitItem>,
    /// `Retry-After`, if present.
    pub retry_after: Option<RetryAfter>,
    /// The `X-RateLimit-*` trio; `Some` only if all three headers are present.
    pub legacy: Option<LegacyRateLimit>,
}

impl RateLimitHeaders {
    /// The policy named `name`, if `RateLimit-Policy` has one.
    #[must_use]
    pub fn policy(&self, name: &str) -> Option<&RateLimitPolicyItem> {
        self.policies.iter().find(|p| p.name == name)
    }

    /// The status of the rule named `name`, if `RateLimit` has one.
    #[must_use]
    pub fn status(&self, name: &str) -> Option<&RateLimitItem> {
        self.limits.iter().find(|s| s.name == name)
    }

    /// The status item with the least remaining quota: the one a client should watch.
    /// On a tie the earliest item wins; `None` when `RateLimit` had no items.
    #[must_use]
    pub fn most_limiting(&self) -> Option<&RateLimitItem> {
        // `min_by_key` returns the first of equal minima.
        self.limits.iter().min_by_key(|s| s.remaining)
    }
}

/// One item of `RateLimit-Policy`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RateLimitPolicyItem {
    /// The rule's name (the item's sf-string).
    pub name: String,
    /// Quota per window (`q`).
    pub quota: u64,
    /// Window length in seconds (`w`), if given.
    pub window: Option<u64>,
}

/// One item of `RateLimit`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RateLimitItem {
    /// The rule's name (the item's sf-string).
    pub name: String,
    /// Remaining quota (`r`).
    pub remaining: u64,
    /// Seconds until more quota is available (`t`), if given.
    pub reset: Option<u64>,
}

/// A parsed `Retry-After` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryAfter {
    /// delay-seconds: wait this long after receiving the response.
    Delay(Duration),
    /// HTTP-date: wait until this point in time.
    Date(SystemTime),
}

impl RetryAfter {
    /// How long to wait, counted from `now`. A date in the past gives zero.
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use tower_redis_ratelimit::headers::RetryAfter;
    ///
    /// let now = UNIX_EPOCH + Duration::from_secs(1_000);
    /// let date = RetryAfter::Date(UNIX_EPOCH + Duration::from_secs(1_030));
    /// assert_eq!(date.delay_from(now), Duration::from_secs(30));
    /// assert_eq!(RetryAfter::Date(UNIX_EPOCH).delay_from(now), Duration::ZERO);
    /// let delay = RetryAfter::Delay(Duration::from_secs(5));
    /// assert_eq!(delay.delay_from(now), Duration::from_secs(5));
    /// ```
    #[must_use]
    pub fn delay_from(&self, now: SystemTime) -> Duration {
        match *self {
            Self::Delay(delay) => delay,
            Self::Date(date) => date.duration_since(now).unwrap_or(Duration::ZERO),
        }
    }
}

/// The legacy `X-RateLimit-Limit` / `-Remaining` / `-Reset` trio.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LegacyRateLimit {
    /// `X-RateLimit-Limit`.
    pub limit: u64,
    /// `X-RateLimit-Remaining`.
    pub remaining: u64,
    /// `X-RateLimit-Reset`, converted from Unix seconds.
    pub reset: SystemTime,
}

/// Why [`parse`] rejected a response's headers. Every variant names the header at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderParseError {
    /// The value holds bytes other than visible ASCII, space and tab.
    #[error("{header} is not visible ASCII text")]
    NotText {
        /// The header at fault.
        header: HeaderName,
    },
    /// The (joined) value is not a valid structured-field List.
    #[error("{header} is not a valid structured-field list: {message}")]
    Syntax {
        /// The header at fault.
        header: HeaderName,
        /// The structured-field parser's explanation.
        message: String,
    },
    /// A list member is an inner list rather than an item.
    #[error("{header} has an inner list where a rule item was expected")]
    InnerList {
        /// The header at fault.
        header: HeaderName,
    },
    /// A list item is neither a string nor a token, so it names no rule.
    #[error("{header} has an item that is not a string naming a rule")]
    NotAString {
        /// The header at fault.
        header: HeaderName,
    },
    /// An item lacks a required parameter (`q` or `r`).
    #[error("{header} item {item:?} lacks required parameter {param:?}")]
    MissingParameter {
        /// The header at fault.
        header: HeaderName,
        /// The item's rule name.
        item: String,
        /// The missing parameter's key.
        param: &'static str,
    },
    /// A known parameter is not a non-negative sf-integer.
    #[error("{header} item {item:?} parameter {param:?} is not a non-negative integer")]
    BadParameter {
        /// The header at fault.
        header: HeaderName,
        /// The item's rule name.
        item: String,
        /// The parameter's key.
        param: &'static str,
    },
    /// A legacy `X-RateLimit-*` value is not plain ASCII digits fitting in a `u64`
    /// (or, for the reset, not a representable point in time).
    #[error("{header} is not a non-negative integer")]
    BadInteger {
        /// The header at fault.
        header: HeaderName,
    },
    /// A single-valued header (`Retry-After`, `X-RateLimit-*`) appears more than once.
    #[error("{header} appears more than once")]
    Duplicate {
        /// The header at fault.
        header: HeaderName,
    },
    /// `Retry-After` is neither delay-seconds nor an HTTP-date.
    #[error("retry-after is neither delay-seconds nor an HTTP-date")]
    BadRetryAfter,
}

/// Parses the rate-limit headers of a response: `RateLimit-Policy`, `RateLimit`,
/// `Retry-After` and the `X-RateLimit-*` trio. Absent headers leave their fields empty.
///
/// Leniencies, all deliberate: items may be tokens instead of strings (older drafts
/// used tokens); unknown parameters are ignored; an item repeating an earlier item's
/// name is dropped; empty field lines and surrounding whitespace are ignored;
/// `RateLimit` items need not match any `RateLimit-Policy` item.
///
/// See the [module documentation](self) for an example.
///
/// # Errors
///
/// A [`HeaderParseError`] naming the first malformed header. Never panics.
pub fn parse(headers: &HeaderMap) -> Result<RateLimitHeaders, HeaderParseError> {
    let policies = named_items(headers, &RATELIMIT_POLICY)?
        .into_iter()
        .map(|(name, params)| {
            let header = &RATELIMIT_POLICY;
            Ok(RateLimitPolicyItem {
                quota: required_param(header, &name, &params, "q")?,
                window: param(header, &name, &params, "w")?,
                name,
            })
        })
        .collect::<Result<_, _>>()?;

    let limits = named_items(headers, &RATELIMIT)?
        .into_iter()
        .map(|(name, params)| {
            let header = &RATELIMIT;
            Ok(RateLimitItem {
                remaining: required_param(header, &name, &params, "r")?,
                reset: param(header, &name, &params, "t")?,
                name,
            })
        })
        .collect::<Result<_, _>>()?;

    let retry_after = single_value(headers, &RETRY_AFTER)?
        .map(parse_retry_after)
        .transpose()?;

    let limit = legacy_integer(headers, &X_RATELIMIT_LIMIT)?;
    let remaining = legacy_integer(headers, &X_RATELIMIT_REMAINING)?;
    let reset = legacy_integer(headers, &X_RATELIMIT_RESET)?
        .map(|secs| {
            // `UNIX_EPOCH + Duration` would panic for absurd values.
            UNIX_EPOCH
                .checked_add(Duration::from_secs(secs))
                .ok_or(HeaderParseError::BadInteger {
                    header: X_RATELIMIT_RESET,
                })
        })
        .transpose()?;
    let legacy = match (limit, remaining, reset) {
        (Some(limit), Some(remaining), Some(reset)) => Some(LegacyRateLimit {
            limit,
            remaining,
            reset,
        }),
        _ => None,
    };

    Ok(RateLimitHeaders {
        policies,
        limits,
        retry_after,
        legacy,
    })
}

/// Parses all field lines of `header` as one sf-List and returns each item's rule
/// name and parameters, keeping only the first item of each name.
fn named_items(
    headers: &HeaderMap,
    header: &HeaderName,
) -> Result<Vec<(String, Parameters)>, HeaderParseError> {
    let mut joined = String::new();
    for value in headers.get_all(header) {
        let line = value.to_str().map_err(|_| HeaderParseError::NotText {
            header: header.clone(),
        })?;
        let line = line.trim_matches(OWS);
        // An empty field line contributes no members; joining it would leave a stray comma.
        if line.is_empty() {
            continue;
        }
        if !joined.is_empty() {
            joined.push_str(", ");
        }
        joined.push_str(line);
    }
    if joined.is_empty() {
        return Ok(Vec::new());
    }

    let list: sfv::List =
        Parser::new(&joined)
            .parse_list()
            .map_err(|err| HeaderParseError::Syntax {
                header: header.clone(),
                message: err.to_string(),
            })?;

    let mut seen = HashSet::with_capacity(list.len());
    let mut items = Vec::with_capacity(list.len());
    for entry in list {
        let item = match entry {
            ListEntry::Item(item) => item,
            ListEntry::InnerList(_) => {
                return Err(HeaderParseError::InnerList {
                    header: header.clone(),
                });
            }
        };
        let name = match item.bare_item {
            BareItem::String(name) => String::from(name),
            BareItem::Token(name) => String::from(name),
            _ => {
                return Err(HeaderParseError::NotAString {
                    header: header.clone(),
                });
            }
        };
        if seen.insert(name.clone()) {
            items.push((name, item.params));
        }
    }
    Ok(items)
}

/// An optional parameter that, when present, must be a non-negative sf-integer.
fn param(
    header: &HeaderName,
    item: &str,
    params: &Parameters,
    key: &'static str,
) -> Result<Option<u64>, HeaderParseError> {
    let Some(value) = params.get(key) else {
        return Ok(None);
    };
    value
        .as_integer()
        .and_then(|int| u64::try_from(int).ok())
        .map(Some)
        .ok_or_else(|| HeaderParseError::BadParameter {
            header: header.clone(),
            item: item.to_owned(),
            param: key,
        })
}

fn required_param(
    header: &HeaderName,
    item: &str,
    params: &Parameters,
    key: &'static str,
) -> Result<u64, HeaderParseError> {
    param(header, item, params, key)?.ok_or_else(|| HeaderParseError::MissingParameter {
        header: header.clone(),
        item: item.to_owned(),
        param: key,
    })
}

/// The trimmed text of a header that must appear at most once.
fn single_value<'h>(
    headers: &'h HeaderMap,
    header: &HeaderName,
) -> Result<Option<&'h str>, HeaderParseError> {
    let mut values = headers.get_all(header).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(HeaderParseError::Duplicate {
            header: header.clone(),
        });
    }
    let text = first.to_str().map_err(|_| HeaderParseError::NotText {
        header: header.clone(),
    })?;
    Ok(Some(text.trim_matches(OWS)))
}

fn legacy_integer(
    headers: &HeaderMap,
    header: &HeaderName,
) -> Result<Option<u64>, HeaderParseError> {
    single_value(headers, header)?
        .map(|text| {
            ascii_digits(text).ok_or_else(|| HeaderParseError::BadInteger {
                header: header.clone(),
            })
        })
        .transpose()
}

fn parse_retry_after(text: &str) -> Result<RetryAfter, HeaderParseError> {
    if let Some(secs) = ascii_digits(text) {
        return Ok(RetryAfter::Delay(Duration::from_secs(secs)));
    }
    httpdate::parse_http_date(text)
        .map(RetryAfter::Date)
        .map_err(|_| HeaderParseError::BadRetryAfter)
}

/// `1*DIGIT` as a `u64`; `None` on anything else (signs, decimals) or overflow.
fn ascii_digits(text: &str) -> Option<u64> {
    // `u64::from_str` alone would also accept a leading `+`.
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sfv::Integer;

    const POLICY_EXAMPLE: &str = r#""20-per-60s";q=20;w=60, "100-per-3600s";q=100;w=3600"#;
    const RATELIMIT_EXAMPLE: &str = r#""20-per-60s";r=7;t=42, "100-per-3600s";r=87;t=3000"#;

    /// A map holding one field line per `(header, value)`, in order.
    fn map(lines: &[(&HeaderName, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in lines {
            headers.append(
                (*name).clone(),
                HeaderValue::from_str(value).expect("test value"),
            );
        }
        headers
    }

    fn parse_err(lines: &[(&HeaderName, &str)]) -> HeaderParseError {
        parse(&map(lines)).expect_err("should be rejected")
    }

    fn policy(name: &str, quota: u64, window: Option<u64>) -> RateLimitPolicyItem {
        RateLimitPolicyItem {
            name: name.to_owned(),
            quota,
            window,
        }
    }

    fn status(name: &str, remaining: u64, reset: Option<u64>) -> RateLimitItem {
        RateLimitItem {
            name: name.to_owned(),
            remaining,
            reset,
        }
    }

    fn bad_param(header: &HeaderName, item: &str, param: &'static str) -> HeaderParseError {
        HeaderParseError::BadParameter {
            header: header.clone(),
            item: item.to_owned(),
            param,
        }
    }

    fn secs(n: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(n)
    }

    #[test]
    fn header_names_are_lowercase_wire_names() {
        assert_eq!(RATELIMIT_POLICY.as_str(), "ratelimit-policy");
        assert_eq!(RATELIMIT.as_str(), "ratelimit");
        assert_eq!(X_RATELIMIT_LIMIT.as_str(), "x-ratelimit-limit");
        assert_eq!(X_RATELIMIT_REMAINING.as_str(), "x-ratelimit-remaining");
        assert_eq!(X_RATELIMIT_RESET.as_str(), "x-ratelimit-reset");
    }

    #[test]
    fn policy_value_matches_example_byte_for_byte() {
        let value = policy_header_value(&[
            PolicyItem {
                name: &SfName::new("20-per-60s").unwrap(),
                quota: 20,
                window_secs: 60,
            },
            PolicyItem {
                name: &SfName::new("100-per-3600s").unwrap(),
                quota: 100,
                window_secs: 3600,
            },
        ]);
        assert_eq!(value.as_bytes(), POLICY_EXAMPLE.as_bytes());
    }

    #[test]
    fn ratelimit_value_matches_example_byte_for_byte() {
        let value = ratelimit_header_value([
            RuleEntry {
                name: &SfName::new("20-per-60s").unwrap(),
                remaining: 7,
                reset_secs: 42,
            },
            RuleEntry {
                name: &SfName::new("100-per-3600s").unwrap(),
                remaining: 87,
                reset_secs: 3000,
            },
        ]);
        assert_eq!(value.as_bytes(), RATELIMIT_EXAMPLE.as_bytes());
    }

    #[test]
    fn parses_the_examples() {
        let parsed = parse(&map(&[
            (&RATELIMIT_POLICY, POLICY_EXAMPLE),
            (&RATELIMIT, RATELIMIT_EXAMPLE),
        ]))
        .unwrap();
        assert_eq!(
            parsed,
            RateLimitHeaders {
                policies: vec![
                    policy("20-per-60s", 20, Some(60)),
                    policy("100-per-3600s", 100, Some(3600)),
                ],
                limits: vec![
                    status("20-per-60s", 7, Some(42)),
                    status("100-per-3600s", 87, Some(3000)),
                ],
                retry_after: None,
                legacy: None,
            }
        );
    }

    #[test]
    fn no_headers_parse_to_default() {
        assert_eq!(
            parse(&HeaderMap::new()).unwrap(),
            RateLimitHeaders::default()
        );
    }

    #[test]
    fn names_needing_escapes_round_trip() {
        let name = r#"a "quoted" \ name"#;
        let value = policy_header_value(&[PolicyItem {
            name: &SfName::new(name).unwrap(),
            quota: 5,
            window_secs: 1,
        }]);
        assert_eq!(value.to_str().unwrap(), r#""a \"quoted\" \\ name";q=5;w=1"#);
        let status_value = ratelimit_header_value([RuleEntry {
            name: &SfName::new(name).unwrap(),
            remaining: 0,
            reset_secs: 0,
        }]);
        let mut headers = HeaderMap::new();
        headers.insert(RATELIMIT_POLICY, value);
        headers.insert(RATELIMIT, status_value);
        let parsed = parse(&headers).unwrap();
        assert_eq!(parsed.policies, vec![policy(name, 5, Some(1))]);
        assert_eq!(parsed.limits, vec![status(name, 0, Some(0))]);
    }

    #[test]
    fn numbers_are_clamped_to_sf_integer_max() {
        assert_eq!(SF_INTEGER_MAX, u64::try_from(Integer::MAX).unwrap());
        let policy_value = policy_header_value(&[PolicyItem {
            name: &SfName::new("big").unwrap(),
            quota: u64::MAX,
            window_secs: SF_INTEGER_MAX + 1,
        }]);
        assert_eq!(
            policy_value.to_str().unwrap(),
            r#""big";q=999999999999999;w=999999999999999"#
        );
        let status_value = ratelimit_header_value([RuleEntry {
            name: &SfName::new("big").unwrap(),
            remaining: SF_INTEGER_MAX,
            reset_secs: u64::MAX,
        }]);
        assert_eq!(
            status_value.to_str().unwrap(),
            r#""big";r=999999999999999;t=999999999999999"#
        );
        let parsed = parse(&map(&[
            (&RATELIMIT_POLICY, policy_value.to_str().unwrap()),
            (&RATELIMIT, status_value.to_str().unwrap()),
        ]))
        .unwrap();
        assert_eq!(
            parsed.policies,
            vec![policy("big", SF_INTEGER_MAX, Some(SF_INTEGER_MAX))]
        );
        assert_eq!(
            parsed.limits,
            vec![status("big", SF_INTEGER_MAX, Some(SF_INTEGER_MAX))]
        );
    }

    #[test]
    fn empty_item_lists_serialise_to_empty_values() {
        assert_eq!(policy_header_value(&[]).as_bytes(), b"");
        assert_eq!(ratelimit_header_value([]).as_bytes(), b"");
    }

    proptest::proptest! {
        /// The policy's name check and the header writer agree: every name a policy accepts can be
        /// written as an sf-string, and every other one is refused by both.
        #[test]
        fn the_policy_name_check_is_the_sf_string_check(name in "[ -~]{0,12}|\\PC{0,12}|[\\x00-\\x7f]{0,12}") {
            proptest::prop_assert_eq!(
                tower_redis_ratelimit_spec::check_rule_name(&name).is_ok(),
                SfName::new(&name).is_ok()
            );
        }
    }

    #[test]
    fn invalid_rule_names_are_rejected_at_build_time() {
        for bad in ["caf\u{e9}", "tab\there", "new\nline", "\u{7f}"] {
            let err = SfName::new(bad).unwrap_err();
            assert_eq!(
                err,
                InvalidRuleName {
                    name: bad.to_owned()
                }
            );
        }
        assert_eq!(
            InvalidRuleName {
                name: "a\nb".to_owned()
            }
            .to_string(),
            r#"rule name "a\nb" is not a valid structured-field string (printable ASCII only)"#
        );
    }

    #[test]
    fn multiple_field_lines_form_one_list() {
        let parsed = parse(&map(&[
            (&RATELIMIT_POLICY, r#""a";q=1;w=10"#),
            (&RATELIMIT, r#""a";r=0;t=5"#),
            (&RATELIMIT_POLICY, r#""b";q=2, "c";q=3"#),
            (&RATELIMIT, r#""b";r=1"#),
        ]))
        .unwrap();
        assert_eq!(
            parsed.policies,
            vec![
                policy("a", 1, Some(10)),
                policy("b", 2, None),
                policy("c", 3, None)
            ]
        );
        assert_eq!(
            parsed.limits,
            vec![status("a", 0, Some(5)), status("b", 1, None)]
        );
    }

    #[test]
    fn empty_field_lines_and_surrounding_whitespace_are_ignored() {
        let parsed = parse(&map(&[
            (&RATELIMIT_POLICY, ""),
            (&RATELIMIT_POLICY, " \t\"a\";q=1\t "),
            (&RATELIMIT_POLICY, "  "),
            (&RATELIMIT_POLICY, r#""b";q=2"#),
        ]))
        .unwrap();
        assert_eq!(
            parsed.policies,
            vec![policy("a", 1, None), policy("b", 2, None)]
        );
    }

    #[test]
    fn unknown_parameters_are_ignored() {
        let parsed = parse(&map(&[
            (
                &RATELIMIT_POLICY,
                r#""a";pk=:YWJj:;q=5;qu="requests";w=10;x=1.5"#,
            ),
            (&RATELIMIT, r#""a";r=3;pk=:YWJj:;t=2;zz=?0"#),
        ]))
        .unwrap();
        assert_eq!(parsed.policies, vec![policy("a", 5, Some(10))]);
        assert_eq!(parsed.limits, vec![status("a", 3, Some(2))]);
    }

    #[test]
    fn token_items_are_accepted() {
        let parsed = parse(&map(&[
            (&RATELIMIT_POLICY, "default;q=100;w=60"),
            (&RATELIMIT, "default;r=50;t=30"),
        ]))
        .unwrap();
        assert_eq!(parsed.policies, vec![policy("default", 100, Some(60))]);
        assert_eq!(parsed.limits, vec![status("default", 50, Some(30))]);
    }

    #[test]
    fn duplicate_names_keep_the_first_item() {
        // The later duplicate is dropped whole, even though its `q` is invalid.
        let parsed = parse(&map(&[
            (&RATELIMIT_POLICY, r#""a";q=1, "b";q=2, "a";q=-1, b;q=4"#),
            (&RATELIMIT, r#""a";r=1"#),
            (&RATELIMIT, r#""a";r=9;t=9"#),
        ]))
        .unwrap();
        assert_eq!(
            parsed.policies,
            vec![policy("a", 1, None), policy("b", 2, None)]
        );
        assert_eq!(parsed.limits, vec![status("a", 1, None)]);
    }

    #[test]
    fn status_items_need_no_matching_policy() {
        let parsed = parse(&map(&[
            (&RATELIMIT_POLICY, r#""a";q=1"#),
            (&RATELIMIT, r#""other";r=4;t=1"#),
        ]))
        .unwrap();
        assert_eq!(parsed.policies, vec![policy("a", 1, None)]);
        assert_eq!(parsed.limits, vec![status("other", 4, Some(1))]);
    }

    #[test]
    fn lookups_by_name() {
        let parsed = parse(&map(&[
            (&RATELIMIT_POLICY, POLICY_EXAMPLE),
            (&RATELIMIT, RATELIMIT_EXAMPLE),
        ]))
        .unwrap();
        assert_eq!(
            parsed.policy("100-per-3600s"),
            Some(&policy("100-per-3600s", 100, Some(3600)))
        );
        assert_eq!(parsed.policy("nope"), None);
        assert_eq!(
            parsed.status("20-per-60s"),
            Some(&status("20-per-60s", 7, Some(42)))
        );
        assert_eq!(parsed.status("nope"), None);
    }

    #[test]
    fn most_limiting_is_least_remaining_first_on_ties() {
        assert_eq!(RateLimitHeaders::default().most_limiting(), None);
        let parsed = parse(&map(&[(
            &RATELIMIT,
            r#""a";r=5, "b";r=2;t=9, "c";r=2;t=1, "d";r=3"#,
        )]))
        .unwrap();
        assert_eq!(parsed.most_limiting(), Some(&status("b", 2, Some(9))));
    }

    #[test]
    fn retry_after_delay_seconds() {
        for (raw, expected) in [("120", 120), ("0", 0), ("  7\t", 7), ("007", 7)] {
            let parsed = parse(&map(&[(&RETRY_AFTER, raw)])).unwrap();
            assert_eq!(
                parsed.retry_after,
                Some(RetryAfter::Delay(Duration::from_secs(expected))),
                "{raw:?}"
            );
        }
    }

    #[test]
    fn retry_after_http_date() {
        // The three HTTP-date forms from RFC 9110, section 5.6.7, all the same instant.
        for raw in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            " Sunday, 06-Nov-94 08:49:37 GMT ",
            "Sun Nov  6 08:49:37 1994",
        ] {
            let parsed = parse(&map(&[(&RETRY_AFTER, raw)])).unwrap();
            assert_eq!(
                parsed.retry_after,
                Some(RetryAfter::Date(secs(784_111_777))),
                "{raw:?}"
            );
        }
    }

    #[test]
    fn retry_after_delay_from() {
        let now = secs(1_000);
        assert_eq!(
            RetryAfter::Delay(Duration::from_secs(3)).delay_from(now),
            Duration::from_secs(3)
        );
        assert_eq!(
            RetryAfter::Date(secs(1_045)).delay_from(now),
            Duration::from_secs(45)
        );
        assert_eq!(
            RetryAfter::Date(secs(1_000)).delay_from(now),
            Duration::ZERO
        );
        assert_eq!(RetryAfter::Date(secs(10)).delay_from(now), Duration::ZERO);
    }

    #[test]
    fn legacy_trio() {
        let parsed = parse(&map(&[
            (&X_RATELIMIT_LIMIT, "100"),
            (&X_RATELIMIT_REMAINING, " 0 "),
            (&X_RATELIMIT_RESET, "1700000000"),
        ]))
        .unwrap();
        assert_eq!(
            parsed.legacy,
            Some(LegacyRateLimit {
                limit: 100,
                remaining: 0,
                reset: secs(1_700_000_000),
            })
        );
    }

    #[test]
    fn legacy_needs_all_three_headers() {
        let parsed = parse(&map(&[
            (&X_RATELIMIT_LIMIT, "100"),
            (&X_RATELIMIT_RESET, "1700000000"),
        ]))
        .unwrap();
        assert_eq!(parsed, RateLimitHeaders::default());
    }

    #[test]
    fn error_not_text() {
        for header in [
            &RATELIMIT_POLICY,
            &RATELIMIT,
            &RETRY_AFTER,
            &X_RATELIMIT_LIMIT,
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(
                header.clone(),
                HeaderValue::from_bytes(b"\"caf\xc3\xa9\";q=1").unwrap(),
            );
            assert_eq!(
                parse(&headers).unwrap_err(),
                HeaderParseError::NotText {
                    header: header.clone()
                }
            );
        }
    }

    #[test]
    fn error_syntax() {
        for raw in [r#""a";q=1,"#, r#""unterminated"#, r#""a" "b""#, "A;q=1;Q=2"] {
            let expected = Parser::new(raw)
                .parse_list::<sfv::List>()
                .unwrap_err()
                .to_string();
            assert_eq!(
                parse_err(&[(&RATELIMIT, raw)]),
                HeaderParseError::Syntax {
                    header: RATELIMIT,
                    message: expected,
                },
                "{raw:?}"
            );
        }
    }

    #[test]
    fn error_inner_list() {
        assert_eq!(
            parse_err(&[(&RATELIMIT_POLICY, r#""a";q=1, ("b" "c");q=2"#)]),
            HeaderParseError::InnerList {
                header: RATELIMIT_POLICY
            }
        );
    }

    #[test]
    fn error_not_a_string() {
        for raw in [
            "1;q=1",
            "1.5;q=1",
            "?1;q=1",
            ":YWJj:;q=1",
            "@0;q=1",
            r#"%"x";q=1"#,
        ] {
            assert_eq!(
                parse_err(&[(&RATELIMIT_POLICY, raw)]),
                HeaderParseError::NotAString {
                    header: RATELIMIT_POLICY
                },
                "{raw:?}"
            );
        }
    }

    #[test]
    fn error_missing_parameter() {
        assert_eq!(
            parse_err(&[(&RATELIMIT_POLICY, r#""a";q=1, "b";w=60"#)]),
            HeaderParseError::MissingParameter {
                header: RATELIMIT_POLICY,
                item: "b".to_owned(),
                param: "q",
            }
        );
        assert_eq!(
            parse_err(&[(&RATELIMIT, r#""a";t=5"#)]),
            HeaderParseError::MissingParameter {
                header: RATELIMIT,
                item: "a".to_owned(),
                param: "r",
            }
        );
    }

    #[test]
    fn error_bad_parameter() {
        let cases: [(&HeaderName, &str, &'static str); 10] = [
            (&RATELIMIT_POLICY, r#""a";q=-1"#, "q"),
            (&RATELIMIT_POLICY, r#""a";q=1.5"#, "q"),
            (&RATELIMIT_POLICY, r#""a";q="5""#, "q"),
            (&RATELIMIT_POLICY, r#""a";q"#, "q"),
            (&RATELIMIT_POLICY, r#""a";q=1;w=-60"#, "w"),
            (&RATELIMIT_POLICY, r#""a";q=1;w=tok"#, "w"),
            (&RATELIMIT, r#""a";r=-1"#, "r"),
            (&RATELIMIT, r#""a";r=0.0"#, "r"),
            (&RATELIMIT, r#""a";r=1;t=2.5"#, "t"),
            (&RATELIMIT, r#""a";r=1;t=@60"#, "t"),
        ];
        for (header, raw, key) in cases {
            assert_eq!(
                parse_err(&[(header, raw)]),
                bad_param(header, "a", key),
                "{raw:?}"
            );
        }
    }

    #[test]
    fn error_bad_integer() {
        for raw in [
            "",
            "+5",
            "-5",
            "5.0",
            "1e3",
            "0x10",
            "five",
            "18446744073709551616",
        ] {
            assert_eq!(
                parse_err(&[(&X_RATELIMIT_REMAINING, raw)]),
                HeaderParseError::BadInteger {
                    header: X_RATELIMIT_REMAINING
                },
                "{raw:?}"
            );
        }
        // Fits in a u64 but not in a SystemTime.
        assert_eq!(
            parse_err(&[(&X_RATELIMIT_RESET, &u64::MAX.to_string())]),
            HeaderParseError::BadInteger {
                header: X_RATELIMIT_RESET
            }
        );
    }

    #[test]
    fn error_duplicate() {
        assert_eq!(
            parse_err(&[(&RETRY_AFTER, "1"), (&RETRY_AFTER, "2")]),
            HeaderParseError::Duplicate {
                header: RETRY_AFTER
            }
        );
        assert_eq!(
            parse_err(&[(&X_RATELIMIT_LIMIT, "1"), (&X_RATELIMIT_LIMIT, "1")]),
            HeaderParseError::Duplicate {
                header: X_RATELIMIT_LIMIT
            }
        );
    }

    #[test]
    fn error_bad_retry_after() {
        for raw in [
            "",
            "-1",
            "1.5",
            "+3",
            "soon",
            "18446744073709551616",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 06 Nov 1994",
        ] {
            assert_eq!(
                parse_err(&[(&RETRY_AFTER, raw)]),
                HeaderParseError::BadRetryAfter,
                "{raw:?}"
            );
        }
    }

    #[test]
    fn error_messages() {
        assert_eq!(
            bad_param(&RATELIMIT, "a", "t").to_string(),
            r#"ratelimit item "a" parameter "t" is not a non-negative integer"#
        );
        assert_eq!(
            HeaderParseError::MissingParameter {
                header: RATELIMIT_POLICY,
                item: "b".to_owned(),
                param: "q",
            }
            .to_string(),
            r#"ratelimit-policy item "b" lacks required parameter "q""#
        );
        assert_eq!(
            HeaderParseError::Duplicate {
                header: RETRY_AFTER
            }
            .to_string(),
            "retry-after appears more than once"
        );
    }

    /// Header names `parse` reads, plus one it ignores.
    const FUZZ_HEADERS: [&str; 7] = [
        "ratelimit-policy",
        "ratelimit",
        "retry-after",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "x-other",
    ];

    /// A near-valid structured list for `RateLimit-Policy` / `RateLimit`: mostly
    /// well-formed items, with wrong types, signs, junk and separators mixed in.
    fn fuzz_sf_list(required: &'static str) -> impl Strategy<Value = String> {
        let bare = prop_oneof![
            3 => Just("\"a\"".to_owned()),
            2 => Just("tok".to_owned()),
            3 => "\"[a-z0-9 -]{0,6}\"",
            1 => Just("1".to_owned()),
            1 => Just("(\"x\" y)".to_owned()),
            1 => "[ -~]{0,6}",
        ];
        let key = prop_oneof![
            3 => Just("q"),
            3 => Just("r"),
            2 => Just("w"),
            2 => Just("t"),
            1 => Just("pk"),
            1 => Just("Q"),
        ];
        let value = prop_oneof![
            6 => Just("=7"),
            1 => Just(""),
            1 => Just("=0"),
            1 => Just("=-1"),
            1 => Just("=1.5"),
            1 => Just("=\"x\""),
            1 => Just("=?0"),
            1 => Just("=@5"),
            1 => Just("=999999999999999"),
            1 => Just("=9999999999999999"),
            1 => Just("=:YQ==:"),
        ];
        // The required key usually comes first, so whole lists often parse.
        let first = prop_oneof![
            6 => value.clone().prop_map(move |v| format!(";{required}{v}")),
            1 => Just(String::new()),
        ];
        let item = (bare, first, prop::collection::vec((key, value), 0..3)).prop_map(
            |(bare, first, params)| {
                params
                    .into_iter()
                    .fold(bare + &first, |acc, (k, v)| format!("{acc};{k}{v}"))
            },
        );
        let separator = prop_oneof![4 => Just(", "), 1 => Just(","), 1 => Just(" ,\t")];
        (prop::collection::vec(item, 0..4), separator).prop_map(|(items, sep)| items.join(sep))
    }

    /// A value for `FUZZ_HEADERS[index]`: usually shaped like that header's
    /// syntax so parsing gets deep, sometimes arbitrary bytes or text.
    fn fuzz_value(index: usize) -> BoxedStrategy<Vec<u8>> {
        let number = prop_oneof![
            6 => any::<u64>().prop_map(|n| n.to_string()),
            1 => "[0-9 +.-]{0,24}",
        ];
        let shaped = match FUZZ_HEADERS[index] {
            "ratelimit-policy" => fuzz_sf_list("q").boxed(),
            "ratelimit" => fuzz_sf_list("r").boxed(),
            "retry-after" => prop_oneof![
                number,
                any::<u32>().prop_map(|n| httpdate::fmt_http_date(secs(n.into()))),
                "[A-Za-z]{3}, [0-9]{2} [A-Za-z]{3} [0-9]{4} [0-9:]{8} GMT",
            ]
            .boxed(),
            _ => number.boxed(),
        };
        prop_oneof![
            8 => shaped.prop_map(String::into_bytes),
            1 => prop::collection::vec(any::<u8>(), 0..48),
            1 => "[ -~\t]{0,48}".prop_map(String::into_bytes),
        ]
        .boxed()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn parse_never_panics(
            lines in prop::collection::vec(
                (0..FUZZ_HEADERS.len()).prop_flat_map(|i| (Just(i), fuzz_value(i))),
                0..5,
            )
        ) {
            let mut headers = HeaderMap::new();
            for (index, bytes) in &lines {
                // Bytes a HeaderValue cannot hold never reach a parser.
                if let Ok(value) = HeaderValue::from_bytes(bytes) {
                    headers.append(HeaderName::from_static(FUZZ_HEADERS[*index]), value);
                }
            }
            if let Ok(parsed) = parse(&headers) {
                let policy_names: HashSet<_> = parsed.policies.iter().map(|p| &p.name).collect();
                prop_assert_eq!(policy_names.len(), parsed.policies.len());
                let status_names: HashSet<_> = parsed.limits.iter().map(|s| &s.name).collect();
                prop_assert_eq!(status_names.len(), parsed.limits.len());
                let all_legacy = [&X_RATELIMIT_LIMIT, &X_RATELIMIT_REMAINING, &X_RATELIMIT_RESET]
                    .iter()
                    .all(|name| headers.contains_key(*name));
                prop_assert_eq!(parsed.legacy.is_some(), all_legacy);
                prop_assert_eq!(parsed.retry_after.is_some(), headers.contains_key(RETRY_AFTER));
            }
        }

        #[test]
        fn serialised_values_round_trip(
            rules in prop::collection::vec(
                ("[ -~]{0,12}", any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
                1..6,
            ),
            split in any::<prop::sample::Index>(),
        ) {
            let sf_names: Vec<SfName> = rules
                .iter()
                .map(|(name, ..)| SfName::new(name).unwrap())
                .collect();
            let policy_items: Vec<_> = rules
                .iter()
                .zip(&sf_names)
                .map(|((_, quota, window_secs, _, _), name)| PolicyItem {
                    name,
                    quota: *quota,
                    window_secs: *window_secs,
                })
                .collect();
            let status_items: Vec<_> = rules
                .iter()
                .zip(&sf_names)
                .map(|((_, _, _, remaining, reset_secs), name)| RuleEntry {
                    name,
                    remaining: *remaining,
                    reset_secs: *reset_secs,
                })
                .collect();

            // The policy as one field line, the status split over two (or one if the split is at 0).
            let mut headers = HeaderMap::new();
            headers.insert(RATELIMIT_POLICY, policy_header_value(&policy_items));
            let (first, second) = status_items.split_at(split.index(status_items.len()));
            for part in [first, second] {
                if !part.is_empty() {
                    headers.append(RATELIMIT, ratelimit_header_value(part.iter().copied()));
                }
            }

            let mut seen = HashSet::new();
            let (mut policies, mut limits) = (Vec::new(), Vec::new());
            for (name, quota, window, remaining, reset) in &rules {
                if seen.insert(name) {
                    policies.push(policy(name, (*quota).min(SF_INTEGER_MAX), Some((*window).min(SF_INTEGER_MAX))));
                    limits.push(status(name, (*remaining).min(SF_INTEGER_MAX), Some((*reset).min(SF_INTEGER_MAX))));
                }
            }
            prop_assert_eq!(
                parse(&headers).unwrap(),
                RateLimitHeaders { policies, limits, retry_after: None, legacy: None }
            );
        }

        #[test]
        fn retry_after_any_delay_seconds(secs in any::<u64>()) {
            let parsed = parse(&map(&[(&RETRY_AFTER, &secs.to_string())])).unwrap();
            prop_assert_eq!(parsed.retry_after, Some(RetryAfter::Delay(Duration::from_secs(secs))));
        }
    }
}
