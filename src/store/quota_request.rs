//! [`QuotaRequest`]: the daily quota a check counts beside its rules (see
//! [`Quota`](crate::Quota)).

use crate::policy::quota::QuotaThreshold;
#[cfg(doc)]
use crate::{decision::Decision, store::CheckRequest};

/// The daily quota of one request: a window of `day_ms` starting `day_start_offset_ms` after each
/// epoch-aligned day (midnight of the quota's UTC offset), counted under its own key.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QuotaRequest<'a> {
    /// The quota's key (`prefix:quota:identity`): braces-free, so a store may wrap it in a hash tag.
    pub key: &'a str,
    /// The identity at the end of `key`, as [`CheckRequest::identity`]; [`QuotaRequest::new`]
    /// takes the whole key.
    pub identity: &'a str,
    /// The request's tier's limit per day.
    pub limit: u64,
    /// The length of a day, in ms (86 400 000 but in tests).
    pub day_ms: u64,
    /// Where days start, in `[0, day_ms)`: midnight at UTC+07:00 is 61 200 000 (17:00 UTC).
    pub day_start_offset_ms: u64,
    /// The alert thresholds: when an admitted request takes the day's count from below `used` to
    /// `used` or more, and no alert of that percent fired this day for this key, it fires (see
    /// [`Decision::quota_alerts`]).
    pub thresholds: &'a [QuotaThreshold],
    /// Whether the quota counts the request's metered units ([`CheckRequest::units`]) rather
    /// than its cost.
    pub metered: bool,
}

impl<'a> QuotaRequest<'a> {
    /// The quota of `limit` per `day_ms` under `key`, days starting at epoch-aligned midnights
    /// plus `day_start_offset_ms`, with these alert thresholds.
    pub fn new(
        key: &'a str,
        limit: u64,
        day_ms: u64,
        day_start_offset_ms: u64,
        thresholds: &'a [QuotaThreshold],
    ) -> Self {
        QuotaRequest {
            key,
            identity: key,
            limit,
            day_ms,
            day_start_offset_ms,
            thresholds,
            metered: false,
        }
    }

    /// Sets whether the quota counts metered units.
    pub fn metered(mut self, metered: bool) -> Self {
        self.metered = metered;
        self
    }

    /// Sets the identity at the end of the key.
    pub fn identity(mut self, identity: &'a str) -> Self {
        self.identity = identity;
        self
    }

    /// The start of the day that `now` (ms) falls in.
    pub fn day_start(&self, now: u64) -> u64 {
        let day = self.day_ms.max(1);
        now - (now + day - self.day_start_offset_ms % day) % day
    }
}
