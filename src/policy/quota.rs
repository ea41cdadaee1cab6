//! The quota's parts: tiers, thresholds, the day, and the lookup of a request's quota (the
//! public ones are [`crate::quota`]'s).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;

use crate::alert::{AlertQueue, AlertReport, AlertStats, QuotaAlert, QuotaNotifier, date_of};
use crate::client_ip::ClientIp;
use crate::key::Key;
use crate::policy::{KeyLookup, MAX_LIMIT, Policy, Rule, StorageKey};

/// A day, the length of a quota's window.
pub const DAY: Duration = Duration::from_secs(86_400);

/// How many alerts may wait for the notifier by default.
pub const DEFAULT_ALERT_QUEUE: usize = 1_024;

/// The thresholds alerts fire at when none are given: 80 % and 100 %.
pub const DEFAULT_ALERT_PERCENTS: [u8; 2] = [80, 100];

/// A request's plan tier, as a request extension set by your authentication layer. It wins over
/// the quota's tier function.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tier(pub Cow<'static, str>);

impl Tier {
    /// The tier named `name`.
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        Tier(name.into())
    }
}

type TierFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// A daily quota by tier: build one with [`Quota::builder`] and give it to
/// [`PolicyBuilder::quota`](crate::PolicyBuilder::quota). Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Quota(Arc<Inner>);

struct Inner {
    name: String,
    /// Finds the quota's key (a policy of its own, so its keys are `prefix:name:identity`).
    keys: Policy,
    tiers: Vec<(String, u64)>,
    default_tier: usize,
    tier_fn: Option<TierFn>,
    utc_offset_minutes: i32,
    day: Duration,
    alert_percents: Vec<u8>,
    /// Per tier, the counts its alert thresholds are reached at: worked out once, here.
    thresholds: Vec<Vec<QuotaThreshold>>,
    /// Where alerts go; without a notifier they are only logged.
    alerts: Option<AlertQueue>,
    /// Whether the quota counts its policy's metered units rather than requests.
    metered: bool,
}

impl fmt::Debug for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quota")
            .field("name", &self.0.name)
            .field("key", self.0.keys.key())
            .field("tiers", &self.0.tiers)
            .field("default_tier", &self.0.tiers[self.0.default_tier].0)
            .field("utc_offset_minutes", &self.0.utc_offset_minutes)
            .field("alert_percents", &self.0.alert_percents)
            .finish_non_exhaustive()
    }
}

/// Why a quota was refused when it was built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuotaError {
    /// The quota has no tiers.
    #[error("quota {quota:?} has no tiers")]
    NoTiers {
        /// The quota's name.
        quota: String,
    },
    /// The quota's key reads a header by a name no header can have (`Key::header`).
    #[error("quota {quota:?}: the key's header name {name:?} is not a valid header name")]
    InvalidKeyHeader {
        /// The quota's name.
        quota: String,
        /// The name given.
        name: String,
    },
    /// A tier's limit is zero or above [`MAX_LIMIT`].
    #[error("quota {quota:?}, tier {tier:?}: the limit must be 1 to 2^35 requests per day")]
    BadLimit {
        /// The quota's name.
        quota: String,
        /// The tier.
        tier: String,
    },
    /// A tier is named twice.
    #[error("quota {quota:?}: tier {tier:?} is given twice")]
    DuplicateTier {
        /// The quota's name.
        quota: String,
        /// The tier.
        tier: String,
    },
    /// The default tier is not one of the tiers.
    #[error("quota {quota:?}: the default tier {tier:?} is not one of the tiers")]
    UnknownDefaultTier {
        /// The quota's name.
        quota: String,
        /// The default tier.
        tier: String,
    },
    /// An alert threshold outside 1..=100 percent.
    #[error("quota {quota:?}: alert thresholds are percents from 1 to 100, not {percent}")]
    BadAlertPercent {
        /// The quota's name.
        quota: String,
        /// The refused value.
        percent: u16,
    },
    /// A UTC offset beyond ±18 hours.
    #[error("quota {quota:?}: the UTC offset must be within ±18:00")]
    BadUtcOffset {
        /// The quota's name.
        quota: String,
    },
    /// A day length that is not a whole, non-zero number of milliseconds of at most a day.
    #[error("quota {quota:?}: the day length must be 1 ms to 24 h, in whole milliseconds")]
    BadDayLength {
        /// The quota's name.
        quota: String,
    },
    /// A name or key prefix that would break the store key layout, or can't be a header item.
    #[error(
        "quota name or key prefix {value:?} must be 1 to 64 characters of letters, digits and -._~@+=!*(),/"
    )]
    InvalidName {
        /// The refused value.
        value: String,
    },
}

/// Builds a [`Quota`]; see [`Quota::builder`].
#[must_use = "call .build() to get the quota"]
pub struct QuotaBuilder {
    name: String,
    prefix: String,
    key: Key,
    tiers: Vec<(String, u64)>,
    default_tier: Option<String>,
    tier_fn: Option<TierFn>,
    utc_offset_minutes: i32,
    day: Duration,
    alert_percents: Vec<u16>,
    notifier: Option<Arc<dyn QuotaNotifier>>,
    queue_capacity: usize,
    metered: bool,
}

impl fmt::Debug for QuotaBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaBuilder")
            .field("name", &self.name)
            .field("tiers", &self.tiers)
            .finish_non_exhaustive()
    }
}

impl Quota {
    /// Starts a quota named `name`: the name of its `RateLimit` item and part of its store keys.
    /// Keyed by user by default, days starting at midnight UTC, alerts at 80 % and 100 %.
    pub fn builder(name: impl Into<String>) -> QuotaBuilder {
        QuotaBuilder {
            name: name.into(),
            prefix: "rl".to_owned(),
            key: Key::user(),
            tiers: Vec::new(),
            default_tier: None,
            tier_fn: None,
            utc_offset_minutes: 0,
            day: DAY,
            alert_percents: DEFAULT_ALERT_PERCENTS.map(u16::from).to_vec(),
            notifier: None,
            queue_capacity: DEFAULT_ALERT_QUEUE,
            metered: false,
        }
    }

    /// The quota's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// What the quota is keyed by.
    pub fn key(&self) -> &Key {
        self.0.keys.key()
    }

    /// The daily limit of `tier`, if it is one of the tiers.
    pub fn limit_of(&self, tier: &str) -> Option<u64> {
        self.0
            .tiers
            .iter()
            .find(|(name, _)| name == tier)
            .map(|(_, limit)| *limit)
    }

    /// The tier requests without a known tier count as.
    pub fn default_tier(&self) -> &str {
        &self.0.tiers[self.0.default_tier].0
    }

    /// The offset from UTC, in minutes, of the midnight days start at.
    pub fn utc_offset_minutes(&self) -> i32 {
        self.0.utc_offset_minutes
    }

    /// The length of a day (24 hours, unless shortened for tests).
    pub fn day(&self) -> Duration {
        self.0.day
    }

    /// The alert thresholds, in percent, ascending.
    pub fn alert_percents(&self) -> &[u8] {
        &self.0.alert_percents
    }

    /// What became of the alerts so far; `None` without a notifier.
    pub fn alert_stats(&self) -> Option<&AlertStats> {
        self.0.alerts.as_ref().map(AlertQueue::stats)
    }

    /// Sends the alerts a request fired (`percents`), given the quota's state after it; each
    /// alert's outcome also goes to `report`.
    pub(crate) fn alert(
        &self,
        lookup: &QuotaLookup,
        percents: &[u8],
        remaining: u64,
        now_ms: u64,
        report: AlertReport,
    ) {
        let identity = lookup.key.identity();
        let user = identity.split_once(':').map_or(identity, |(_, user)| user);
        let day_start =
            now_ms - (now_ms + self.day_ms() - self.day_start_offset_ms()) % self.day_ms();
        for &percent in percents {
            let alert = QuotaAlert {
                user: user.to_owned(),
                tier: self.tier_name(lookup.tier).to_owned(),
                percent,
                used: lookup.limit.saturating_sub(remaining),
                limit: lookup.limit,
                day: date_of(day_start, self.0.utc_offset_minutes),
            };
            tracing::info!(
                quota = self.name(),
                user = %alert.user,
                tier = %alert.tier,
                percent,
                used = alert.used,
                limit = alert.limit,
                day = %alert.day,
                "quota alert"
            );
            if let Some(queue) = &self.0.alerts {
                queue.push(alert, report);
            }
        }
    }

    /// Where days start, as an offset from the epoch's midnight in `[0, day)` ms: midnight at
    /// UTC+07:00 is 17:00 UTC of the day before.
    pub(crate) fn day_start_offset_ms(&self) -> u64 {
        let day = self.day_ms() as i64;
        (-i64::from(self.0.utc_offset_minutes) * 60_000).rem_euclid(day) as u64
    }

    pub(crate) fn day_ms(&self) -> u64 {
        u64::try_from(self.0.day.as_millis()).unwrap_or(u64::MAX)
    }

    /// The quota's key, tier and limit for a request, or `None` when it has no key (no user, and no
    /// client IP to fall back to): such a request is left to the policy's own rules.
    pub(crate) fn lookup(&self, parts: &Parts, client_ip: &ClientIp) -> Option<QuotaLookup> {
        let key = match self.0.keys.storage_key_behind(parts, client_ip) {
            KeyLookup::Found(key) => key,
            _ => return None,
        };
        let named = parts
            .extensions
            .get::<Tier>()
            .map(|tier| Cow::Borrowed(&*tier.0))
            .or_else(|| self.0.tier_fn.as_ref()?(parts).map(Cow::Owned));
        let index = named
            .and_then(|name| self.0.tiers.iter().position(|(tier, _)| *tier == *name))
            .unwrap_or(self.0.default_tier);
        Some(QuotaLookup {
            key: Box::new(key),
            tier: index,
            limit: self.0.tiers[index].1,
        })
    }

    /// The quota of an identity the app names (a handle's): its key under the quota's prefix and
    /// name, as [`Policy::named_key`] makes it, in the default tier.
    pub(crate) fn lookup_identity(&self, identity: &str) -> QuotaLookup {
        let index = self.0.default_tier;
        QuotaLookup {
            key: Box::new(self.0.keys.named_key(identity)),
            tier: index,
            limit: self.0.tiers[index].1,
        }
    }

    /// Each tier's limit, in the tiers' order.
    pub(crate) fn tier_limits(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.tiers.iter().map(|(_, limit)| *limit)
    }

    /// The alert thresholds of tier `index`, as counts.
    pub(crate) fn thresholds(&self, tier: usize) -> &[QuotaThreshold] {
        &self.0.thresholds[tier]
    }

    /// Whether the quota counts metered units ([`QuotaBuilder::metered`]).
    pub fn is_metered(&self) -> bool {
        self.0.metered
    }

    /// The largest limit of its tiers.
    pub(crate) fn largest_limit(&self) -> u64 {
        self.0
            .tiers
            .iter()
            .map(|(_, limit)| *limit)
            .max()
            .unwrap_or(0)
    }

    /// The name of tier `index`.
    pub(crate) fn tier_name(&self, index: usize) -> &str {
        &self.0.tiers[index].0
    }
}

/// The quota of one request: its key, tier and limit.
#[derive(Debug, Clone)]
pub(crate) struct QuotaLookup {
    /// Boxed: every request's flow carries an `Option<QuotaLookup>` from value to value (its
    /// check, its admission, its charge), and most policies have no quota.
    pub(crate) key: Box<StorageKey>,
    pub(crate) tier: usize,
    pub(crate) limit: u64,
}

/// An alert threshold of a quota: `percent` of the limit, reached at `used` units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaThreshold {
    /// The threshold in percent of the limit.
    pub percent: u8,
    /// The count that reaches it: `ceil(percent × limit / 100)`.
    pub used: u64,
}

impl QuotaBuilder {
    /// What the quota is keyed by (default: [`Key::user`]). A request without the key counts
    /// against its client IP; without either, only the policy's rules apply.
    pub fn key(mut self, key: Key) -> Self {
        self.key = key;
        self
    }

    /// The prefix of the quota's store keys (default `rl`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// A tier and its limit, in requests (units) per day.
    pub fn tier(mut self, name: impl Into<String>, limit: u64) -> Self {
        self.tiers.push((name.into(), limit));
        self
    }

    /// The tier of requests that name none, or a tier that is not one of the tiers (default: the
    /// first tier given).
    pub fn default_tier(mut self, name: impl Into<String>) -> Self {
        self.default_tier = Some(name.into());
        self
    }

    /// How to find a request's tier when it has no [`Tier`] extension: a lookup on the request's
    /// head (a header your gateway sets, a claim of a verified token).
    pub fn tier_from_fn<F>(mut self, tier: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.tier_fn = Some(Arc::new(tier));
        self
    }

    /// Days start at midnight of this fixed offset from UTC, in minutes (default 0; `-300` is
    /// UTC−05:00). No daylight saving: a fixed offset, so every day is 24 hours.
    pub fn utc_offset_minutes(mut self, minutes: i32) -> Self {
        self.utc_offset_minutes = minutes;
        self
    }

    /// The alert thresholds, in percent of the limit (default 80 and 100).
    pub fn alert_at(mut self, percents: impl IntoIterator<Item = u16>) -> Self {
        self.alert_percents = percents.into_iter().collect();
        self
    }

    /// Where alerts go (default: nowhere but the log). They leave the request path at once through
    /// a bounded queue ([`QuotaBuilder::alert_queue`]) drained by a background task on the app's
    /// tokio runtime.
    pub fn notifier(mut self, notifier: impl QuotaNotifier) -> Self {
        self.notifier = Some(Arc::new(notifier));
        self
    }

    /// How many alerts may wait for the notifier (default 1 024); more are dropped and counted.
    pub fn alert_queue(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity;
        self
    }

    /// Shortens the day, for tests that need to cross midnight on a real clock (Redis `TIME`):
    /// days of this length, aligned like real ones. Keep the default in production.
    #[doc(hidden)]
    pub fn day_length_for_tests(mut self, day: Duration) -> Self {
        self.day = day;
        self
    }

    /// The quota counts its policy's metered units ("2 million tokens a day on the pro plan")
    /// rather than requests: a request reserves its estimate in it, and settles what it used
    /// after its response, as the policy's metered rules do; alerts fire when a settle reaches
    /// their thresholds. The policy needs a [`Meter`](crate::meter::Meter).
    ///
    /// ```
    /// use tower_redis_ratelimit::meter::Meter;
    /// use tower_redis_ratelimit::{Key, Policy, Quota, Rule};
    ///
    /// let tokens_a_day = Quota::builder("tokens-daily")
    ///     .key(Key::user())
    ///     .tier("free", 100_000)
    ///     .tier("pro", 2_000_000)
    ///     .metered()
    ///     .build()
    ///     .unwrap();
    /// let policy = Policy::builder("llm")
    ///     .key(Key::user())
    ///     .rule(Rule::per_minute(60))
    ///     .quota(tokens_a_day)
    ///     .meter(Meter::new("tokens").estimate(|_| 500))
    ///     .build()
    ///     .unwrap();
    /// assert!(policy.quota().unwrap().is_metered());
    /// ```
    pub fn metered(mut self) -> Self {
        self.metered = true;
        self
    }

    /// Checks the quota and builds it.
    pub fn build(self) -> Result<Quota, QuotaError> {
        let quota = || self.name.clone();
        for value in [&self.name, &self.prefix] {
            if !crate::policy::is_valid_name(value) {
                return Err(QuotaError::InvalidName {
                    value: value.clone(),
                });
            }
        }
        if self.tiers.is_empty() {
            return Err(QuotaError::NoTiers { quota: quota() });
        }
        if let Some(name) = self.key.invalid_header() {
            return Err(QuotaError::InvalidKeyHeader {
                quota: quota(),
                name: name.to_owned(),
            });
        }
        for (index, (tier, limit)) in self.tiers.iter().enumerate() {
            if *limit == 0 || *limit > MAX_LIMIT {
                return Err(QuotaError::BadLimit {
                    quota: quota(),
                    tier: tier.clone(),
                });
            }
            if self.tiers[..index]
                .iter()
                .any(|(earlier, _)| earlier == tier)
            {
                return Err(QuotaError::DuplicateTier {
                    quota: quota(),
                    tier: tier.clone(),
                });
            }
        }
        let default_tier = match &self.default_tier {
            None => 0,
            Some(name) => self
                .tiers
                .iter()
                .position(|(tier, _)| tier == name)
                .ok_or_else(|| QuotaError::UnknownDefaultTier {
                    quota: quota(),
                    tier: name.clone(),
                })?,
        };
        let mut alert_percents = Vec::with_capacity(self.alert_percents.len());
        for &percent in &self.alert_percents {
            let valid = u8::try_from(percent).ok().filter(|p| (1..=100).contains(p));
            let Some(percent) = valid else {
                return Err(QuotaError::BadAlertPercent {
                    quota: quota(),
                    percent,
                });
            };
            alert_percents.push(percent);
        }
        alert_percents.sort_unstable();
        alert_percents.dedup();
        if self.utc_offset_minutes.unsigned_abs() > 18 * 60 {
            return Err(QuotaError::BadUtcOffset { quota: quota() });
        }
        if self.day.is_zero()
            || self.day > DAY
            || !self.day.subsec_nanos().is_multiple_of(1_000_000)
        {
            return Err(QuotaError::BadDayLength { quota: quota() });
        }
        // The key lookup of a policy: the same identities, fallbacks and key layout.
        let keys = Policy::builder(&self.name)
            .prefix(&self.prefix)
            .key(self.key)
            .rule(Rule::new(1, self.day))
            .build()
            .map_err(|_| QuotaError::InvalidName {
                value: self.name.clone(),
            })?;
        let thresholds = self
            .tiers
            .iter()
            .map(|&(_, limit)| {
                alert_percents
                    .iter()
                    .map(|&percent| QuotaThreshold {
                        percent,
                        used: (u64::from(percent) * limit).div_ceil(100),
                    })
                    .collect()
            })
            .collect();
        let alerts = self
            .notifier
            .map(|notifier| AlertQueue::new(&self.name, notifier, self.queue_capacity));
        Ok(Quota(Arc::new(Inner {
            name: self.name,
            keys,
            tiers: self.tiers,
            default_tier,
            tier_fn: self.tier_fn,
            utc_offset_minutes: self.utc_offset_minutes,
            day: self.day,
            alert_percents,
            thresholds,
            alerts,
            metered: self.metered,
        })))
    }
}
