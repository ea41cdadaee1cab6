//! The arithmetic of the token bucket, as GCRA (the generic cell rate algorithm): the memory
//! store's token bucket runs on it (and `lua/token_bucket.lua` is the same arithmetic, to the
//! microsecond); both stores size the reset marker's lifetime by its tolerance, and the limiter
//! reads a take's slice by its interval.
//!
//! A rule of `limit` per `period` with a bucket of `burst` keeps one number: the theoretical arrival
//! time `tat`, when the bucket will be full again. A unit drips back every `interval` =
//! `period / limit` (rounded up to the microsecond, so the rate never exceeds the rule), and the
//! bucket holds `tolerance` = `burst × interval` of them. A request of `cost` units arriving at
//! `now` conforms when
//!
//! ```text
//! max(tat, now) + cost × interval − tolerance ≤ now
//! ```
//!
//! and then `tat` becomes `max(tat, now) + cost × interval`. Everything is an integer number of
//! microseconds below 2^53: policies keep `tolerance` within [`MAX_PERIOD`](crate::policy::MAX_PERIOD),
//! so `lua/token_bucket.lua` computes the same numbers with Lua's doubles exactly.

/// A rule's bucket, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// The time one unit takes to drip back.
    pub(crate) interval: u64,
    /// How far ahead of now `tat` may run: `burst × interval`.
    pub(crate) tolerance: u64,
}

impl Bucket {
    /// The bucket of `limit` per `period_ms` holding `burst`.
    pub(crate) fn new(limit: u64, period_ms: u64, burst: u64) -> Self {
        let period_us = u128::from(period_ms) * 1_000;
        let interval = narrow(period_us.div_ceil(u128::from(limit.max(1)))).max(1);
        Bucket {
            interval,
            tolerance: narrow(u128::from(burst) * u128::from(interval)),
        }
    }

    /// The earliest time a request of `cost` conforms, given `tat`; `None` when it never does (it
    /// costs more than the bucket holds).
    pub(crate) fn conforms_at(self, tat: u64, now: u64, cost: u64) -> Option<u64> {
        let charge = self.charge(cost)?;
        let at =
            (u128::from(tat.max(now)) + u128::from(charge)).saturating_sub(self.tolerance.into());
        Some(narrow(at))
    }

    /// When `cost` units more than the bucket holds would have dripped back, taken a bucketful at
    /// a time: what a claim's peek of the units ahead and its own reads (`lua/claims.lua`).
    pub(crate) fn conforms_at_past_burst(self, tat: u64, now: u64, cost: u64) -> u64 {
        let charge = u128::from(cost) * u128::from(self.interval);
        narrow((u128::from(tat.max(now)) + charge).saturating_sub(self.tolerance.into()))
    }

    /// The time `cost` units take to drip back; `None` when that is more than the bucket holds.
    fn charge(self, cost: u64) -> Option<u64> {
        let charge = u128::from(cost) * u128::from(self.interval);
        (charge <= u128::from(self.tolerance)).then(|| narrow(charge))
    }

    /// `tat` after admitting a request of `cost` that arrives at `at`.
    pub(crate) fn admit(self, tat: u64, at: u64, cost: u64) -> u64 {
        tat.max(at)
            .saturating_add(cost.saturating_mul(self.interval))
    }

    /// `tat` after up to `cost` units of a charge that moved `tat` to `full_at` are given back at
    /// `now`: moved back by what time has not repaid of them, `min(cost × interval, full_at -
    /// now)`, never before `now`. Units of an old charge that time has repaid are not given twice.
    pub(crate) fn give_back(self, tat: u64, now: u64, cost: u64, full_at: u64) -> u64 {
        let unrepaid = cost
            .saturating_mul(self.interval)
            .min(full_at.saturating_sub(now));
        tat.saturating_sub(unrepaid).max(now)
    }

    /// `tat` after `cost` units charged earlier are given back at `now`: moved back by their
    /// charge, but never before `now` (a full bucket holds no more).
    pub(crate) fn refund(self, tat: u64, now: u64, cost: u64) -> u64 {
        tat.saturating_sub(cost.saturating_mul(self.interval))
            .max(now)
    }

    /// Whole units in the bucket at `now`.
    pub(crate) fn remaining(self, tat: u64, now: u64) -> u64 {
        let debt = tat.saturating_sub(now);
        self.tolerance.saturating_sub(debt) / self.interval
    }

    /// Microseconds from `now` until the bucket holds one more unit than now (0 when full).
    pub(crate) fn refills_after(self, tat: u64, now: u64) -> u64 {
        if tat <= now {
            return 0;
        }
        // The bucket holds r + 1 units once tat - t <= tolerance - (r + 1) * interval.
        let next = self.remaining(tat, now) + 1;
        let at = u128::from(tat) + u128::from(next) * u128::from(self.interval);
        narrow(at.saturating_sub(u128::from(self.tolerance))).saturating_sub(now)
    }
}

fn narrow(value: u128) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// Microseconds as milliseconds, rounded up: a client that waits this long is never early.
pub(crate) fn ceil_ms(micros: u64) -> u64 {
    micros.div_ceil(1_000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_interval_is_the_period_over_the_limit_rounded_up() {
        assert_eq!(Bucket::new(10, 1_000, 10).interval, 100_000);
        assert_eq!(Bucket::new(3, 1_000, 3).interval, 333_334);
        assert_eq!(Bucket::new(10, 1_000, 25).tolerance, 2_500_000);
    }

    #[test]
    fn a_full_bucket_bursts_then_drips() {
        // 10 per second, bucket of 5: five at once, then one every 100 ms.
        let bucket = Bucket::new(10, 1_000, 5);
        let mut tat = 0;
        let now = 1_000_000;
        for left in (0..5).rev() {
            assert!(bucket.conforms_at(tat, now, 1).unwrap() <= now);
            tat = bucket.admit(tat, now, 1);
            assert_eq!(bucket.remaining(tat, now), left);
        }
        assert_eq!(bucket.conforms_at(tat, now, 1), Some(now + 100_000));
        assert_eq!(bucket.refills_after(tat, now), 100_000);
        assert_eq!(bucket.remaining(tat, now + 99_999), 0);
        assert_eq!(bucket.remaining(tat, now + 100_000), 1);
        assert_eq!(bucket.remaining(tat, now + 500_000), 5);
        assert_eq!(bucket.conforms_at(tat, now, 6), None);
    }

    proptest! {
        /// A refused request conforms at exactly `conforms_at` and not a microsecond earlier, and
        /// the bucket gains a unit at exactly `refills_after`.
        #[test]
        fn waits_are_exact(
            limit in 1u64..1_000,
            period in 1u64..100_000,
            burst in 1u64..1_000,
            debt_share in 0u64..=150,
            cost in 1u64..50,
        ) {
            let bucket = Bucket::new(limit, period, burst);
            let now = 10_000_000_000;
            let tat = now + bucket.tolerance * debt_share / 100;
            let fits = |t: u64| bucket.conforms_at(tat, t, cost).is_some_and(|at| at <= t);
            match bucket.conforms_at(tat, now, cost) {
                None => prop_assert!(cost > burst),
                Some(at) if at > now => {
                    prop_assert!(fits(at));
                    prop_assert!(!fits(at - 1));
                }
                Some(_) => prop_assert!(fits(now)),
            }
            let wait = bucket.refills_after(tat, now);
            let units = bucket.remaining(tat, now);
            if wait == 0 {
                prop_assert_eq!(units, burst);
            } else {
                prop_assert_eq!(bucket.remaining(tat, now + wait), units + 1);
                prop_assert_eq!(bucket.remaining(tat, now + wait - 1), units);
            }
        }
    }
}
