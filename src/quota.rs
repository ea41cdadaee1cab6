//! Daily quotas by plan tier: a calendar-day cap per user that depends on their subscription, on
//! top of a policy's short-window rules, and checked in the same atomic step.
//!
//! ```
//! use tower_redis_ratelimit::{Key, Policy, Quota, Rule};
//!
//! let quota = Quota::builder("daily")
//!     .key(Key::user())
//!     .tier("free", 100)
//!     .tier("pro", 5_000)
//!     .default_tier("free")
//!     .utc_offset_minutes(7 * 60) // days start at midnight UTC+07:00
//!     .build()
//!     .expect("a valid quota");
//! let policy = Policy::builder("api")
//!     .rule(Rule::per_minute(20))
//!     .quota(quota)
//!     .build()
//!     .unwrap();
//! assert_eq!(policy.quota().unwrap().limit_of("pro"), Some(5_000));
//! ```
//!
//! The day is a fixed window of 24 hours starting at midnight of the configured UTC offset (UTC by
//! default); its counter expires on its own when the day ends. A request's tier comes from a
//! [`Tier`] extension, else the quota's tier function, else the default tier; an unknown tier name
//! counts as the default tier. The quota is one more item in the `RateLimit` headers, named after
//! the quota, with `w=86400`.

pub use crate::policy::quota::{
    DAY, DEFAULT_ALERT_PERCENTS, DEFAULT_ALERT_QUEUE, Quota, QuotaBuilder, QuotaError,
    QuotaThreshold, Tier,
};
