//! [`Rule`]: one limit, at most `limit` units per `period`.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

/// The longest period a rule may have: 366 days, enough for yearly quotas, short enough that no
/// store arithmetic on it can overflow.
pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 86_400);

/// The largest limit a rule may have: 2^35 (about 34 billion) units per period. Far above any real
/// quota, and low enough that the Redis scripts, whose numbers are Lua doubles, compute every count
/// exactly (the sliding counter multiplies counts by a 16-bit weight).
pub const MAX_LIMIT: u64 = 1 << 35;

/// A rule name clients could not read: names are sent in the `RateLimit` headers and 429 bodies,
/// so they are printable ASCII (space to `~`), the characters a structured-field string carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rule name {name:?} is not a valid structured-field string (printable ASCII only)")]
pub struct InvalidRuleName {
    /// The offending name.
    pub name: String,
}

/// Checks a rule's (or a quota's, or a concurrency limit's) name: printable ASCII only.
///
/// # Errors
///
/// [`InvalidRuleName`] for any other character.
pub fn check_rule_name(name: &str) -> Result<(), InvalidRuleName> {
    if name.bytes().all(|byte| (b' '..=b'~').contains(&byte)) {
        Ok(())
    } else {
        Err(InvalidRuleName {
            name: name.to_owned(),
        })
    }
}

/// One limit: at most `limit` units per `period`.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit_spec::Rule;
///
/// assert_eq!(Rule::per_minute(20).name(), "20-per-60s");
/// assert_eq!(Rule::new(5, Duration::from_millis(1500)).name(), "5-per-1500ms");
/// assert_eq!(Rule::per_hour(100).named("hourly").name(), "hourly");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    pub(crate) limit: u64,
    pub(crate) period: Duration,
    pub(crate) name: Option<Cow<'static, str>>,
    pub(crate) burst: Option<u64>,
    pub(crate) duplicate_guard: bool,
    pub(crate) metered: bool,
}

impl Rule {
    /// At most `limit` units per `period`. Checked when the policy is built: the limit must be at
    /// least 1 and at most [`MAX_LIMIT`], the period a whole, non-zero number of milliseconds, at
    /// most [`MAX_PERIOD`].
    pub const fn new(limit: u64, period: Duration) -> Self {
        Rule {
            limit,
            period,
            name: None,
            burst: None,
            duplicate_guard: false,
            metered: false,
        }
    }

    /// `limit` per second.
    pub const fn per_second(limit: u64) -> Self {
        Rule::new(limit, Duration::from_secs(1))
    }

    /// `limit` per minute.
    pub const fn per_minute(limit: u64) -> Self {
        Rule::new(limit, Duration::from_secs(60))
    }

    /// `limit` per hour.
    pub const fn per_hour(limit: u64) -> Self {
        Rule::new(limit, Duration::from_secs(3600))
    }

    /// `limit` per day (86 400 s; a sliding or fixed period, not a calendar day).
    pub const fn per_day(limit: u64) -> Self {
        Rule::new(limit, Duration::from_secs(86_400))
    }

    /// Names the rule in headers and 429 bodies instead of the default `<limit>-per-<period>`. Useful
    /// when two nested layers would otherwise send rules of the same name.
    pub fn named(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The bucket size of a [`Algorithm::TokenBucket`](crate::Algorithm::TokenBucket) rule: up to `burst` units at once after a
    /// quiet spell, refilled at `limit` per `period` (default: the limit). Only token buckets have
    /// one; `PolicyBuilder::build` refuses a burst under another algorithm.
    ///
    /// ```
    /// use tower_redis_ratelimit_spec::Rule;
    ///
    /// let rule = Rule::per_second(10).burst(50);
    /// assert_eq!((rule.limit(), rule.burst_size()), (10, 50));
    /// assert_eq!(Rule::per_second(10).burst_size(), 10);
    /// ```
    pub const fn burst(mut self, burst: u64) -> Self {
        self.burst = Some(burst);
        self
    }

    /// This rule counts the policy's metered units (its meter's: tokens, bytes, money) rather
    /// than requests. A request is admitted only if every metered rule has room for its estimate;
    /// what it really used is settled after its response. The policy's other rules count
    /// requests, checked with the metered ones in one store call, all or nothing.
    ///
    /// ```
    /// use tower_redis_ratelimit_spec::Rule;
    ///
    /// let tokens = Rule::per_minute(40_000).metered();
    /// assert!(tokens.is_metered());
    /// assert!(!Rule::per_minute(60).is_metered());
    /// assert_eq!(tokens.name_counting(Some("tokens")), "40000-tokens-per-60s");
    /// ```
    pub const fn metered(mut self) -> Self {
        self.metered = true;
        self
    }

    /// Whether this rule counts metered units ([`Rule::metered`]).
    pub fn is_metered(&self) -> bool {
        self.metered
    }

    /// The same rule over a period longer by `margin` (the outbound layer's safety margin).
    #[doc(hidden)]
    pub fn widened(&self, margin: Duration) -> Rule {
        Rule {
            period: self.period.saturating_add(margin),
            ..self.clone()
        }
    }

    /// The bucket size: the one given to [`Rule::burst`], else the limit.
    pub fn burst_size(&self) -> u64 {
        self.burst.unwrap_or(self.limit)
    }

    /// Whether this is the rule `PolicyBuilder::prevent_duplicate` adds: one request per
    /// period, counted exactly (as a sliding log) whatever the policy's algorithm.
    pub fn is_duplicate_guard(&self) -> bool {
        self.duplicate_guard
    }

    /// The rule's limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The rule's period.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// The period in whole milliseconds, the unit stores work in.
    pub fn period_ms(&self) -> u64 {
        u64::try_from(self.period.as_millis()).unwrap_or(u64::MAX)
    }

    /// The name clients see: the one given to [`Rule::named`], else `<limit>-per-<period>` such as
    /// `20-per-60s` or `5-per-1500ms`.
    pub fn name(&self) -> Cow<'_, str> {
        match &self.name {
            Some(name) => Cow::Borrowed(name),
            None => Cow::Owned(format!("{}-per-{}", self.limit, PeriodText(self.period))),
        }
    }
}

impl Rule {
    /// The name clients see in a policy whose meter counts `unit`: [`Rule::name`], except that a
    /// metered rule's default name says its unit, `<limit>-<unit>-per-<period>` (so "1 000
    /// requests a minute" and "1 000 tokens a minute" are told apart).
    pub fn name_counting(&self, unit: Option<&str>) -> Cow<'_, str> {
        match (&self.name, unit) {
            (None, Some(unit)) if self.metered => Cow::Owned(format!(
                "{}-{unit}-per-{}",
                self.limit,
                PeriodText(self.period)
            )),
            _ => self.name(),
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} per {}", self.limit, PeriodText(self.period))?;
        if self.metered {
            f.write_str(" (metered)")?;
        }
        Ok(())
    }
}

/// A period as `60s` when it is whole seconds, else `1500ms` (or `1.5µs`-free debug form).
struct PeriodText(Duration);

impl fmt::Display for PeriodText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let period = self.0;
        if period.subsec_nanos() == 0 {
            write!(f, "{}s", period.as_secs())
        } else if period.subsec_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", period.as_millis())
        } else {
            write!(f, "{period:?}")
        }
    }
}
