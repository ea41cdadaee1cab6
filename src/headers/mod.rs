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
/// digits, so this only appends: into a buffer on the stack, copied once into the `HeaderValue`
/// (a value past it, of many rules or long names, is sized first and taken over whole).
fn write_list<'a>(
    items: impl Iterator<Item = (&'a SfName, u64, u64)> + Clone,
    first: &str,
    second: &str,
) -> HeaderValue {
    let items = items.map(|(name, a, b)| (name, a.min(SF_INTEGER_MAX), b.min(SF_INTEGER_MAX)));
    let mut on_stack = arrayvec::ArrayString::<STACK_VALUE>::new();
    if append_list(&mut on_stack, items.clone(), first, second).is_ok() {
        return HeaderValue::from_str(&on_stack)
            .expect("structured-field serialisation only emits printable ASCII");
    }
    let count = items.clone().count();
    let len = items
        .clone()
        .map(|(name, a, b)| {
            name.0.len() + first.len() + second.len() + 4 + decimal_len(a) + decimal_len(b)
        })
        .sum::<usize>()
        + ", ".len() * count.saturating_sub(1);
    let mut out = String::with_capacity(len);
    append_list(&mut out, items, first, second).expect("a String takes any length");
    header_value(out)
}

/// The longest list value written on the stack: a few rules' worth.
const STACK_VALUE: usize = 192;

/// Appends the list `items` (see [`write_list`]) to `out`; an error when `out` is full.
fn append_list<'a>(
    out: &mut impl std::fmt::Write,
    items: impl Iterator<Item = (&'a SfName, u64, u64)>,
    first: &str,
    second: &str,
) -> std::fmt::Result {
    let mut digits = itoa::Buffer::new();
    for (index, (name, a, b)) in items.enumerate() {
        if index > 0 {
            out.write_str(", ")?;
        }
        out.write_str(&name.0)?;
        for (key, value) in [(first, a), (second, b)] {
            out.write_char(';')?;
            out.write_str(key)?;
            out.write_char('=')?;
            out.write_str(digits.format(value))?;
        }
    }
    Ok(())
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
mod tests;
