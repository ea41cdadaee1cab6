//! The memory store's arithmetic of the sliding-window counter (`lua/sliding_counter.lua` is the
//! same arithmetic, so the stores agree to the unit).
//!
//! A rule keeps two counts: the current window's and the previous window's (windows aligned to the
//! epoch, as for the fixed window). The previous count is weighted by how much of the previous
//! window still overlaps the sliding window that ends now:
//!
//! ```text
//! used = floor(previous * weight / 65536) + current,  weight = floor((period - elapsed) * 65536 / period)
//! ```
//!
//! where `elapsed` is the time since the current window began. The weight is fixed point in
//! 1/65536ths so every step is an integer below 2^52: `lua/sliding_counter.lua` computes the same
//! numbers with Lua's doubles exactly, given limits of at most [`MAX_LIMIT`](crate::policy::MAX_LIMIT).

/// The weight of a whole window.
const ONE: u128 = 1 << 16;

/// The weight of the previous window `elapsed` ms into a window of `period` ms.
fn weight(period: u64, elapsed: u64) -> u128 {
    // u128: rules handed to a store directly may have periods beyond what policies allow.
    u128::from(period - elapsed.min(period)) * ONE / u128::from(period)
}

/// The previous window's weighted count `elapsed` ms into the current window.
pub(crate) fn weighted(previous: u64, period: u64, elapsed: u64) -> u64 {
    narrow(u128::from(previous) * weight(period, elapsed) / ONE)
}

/// The first moment, at or after `elapsed` and within the current window, when the previous
/// window's weighted count is at most `target`; `None` if that happens only after the window ends.
fn first_elapsed_at_most(previous: u64, target: u64, period: u64, elapsed: u64) -> Option<u64> {
    if previous == 0 {
        return Some(elapsed);
    }
    // previous * w / ONE <= target  <=>  w <= ((target + 1) * ONE - 1) / previous
    let max_weight = ((u128::from(target) + 1) * ONE - 1) / u128::from(previous);
    if max_weight >= ONE {
        return Some(elapsed);
    }
    // weight(e) <= max_weight  <=>  (period - e) * ONE < (max_weight + 1) * period
    //                          <=>  e > period - (max_weight + 1) * period / ONE
    let period_wide = u128::from(period);
    let first = narrow((ONE * period_wide - (max_weight + 1) * period_wide) / ONE + 1);
    let first = first.max(elapsed);
    (first < period).then_some(first)
}

fn narrow(value: u128) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// Milliseconds from `elapsed` until a request of `cost` fits, given the counts now (it doesn't
/// fit now). Assumes no other request is admitted meanwhile.
pub(crate) fn wait_until_fits(
    previous: u64,
    current: u64,
    cost: u64,
    limit: u64,
    period: u64,
    elapsed: u64,
) -> u64 {
    let Some(room) = limit.checked_sub(cost) else {
        return period; // costs more than the limit: it never fits; say one period
    };
    if let Some(room) = room.checked_sub(current)
        && let Some(first) = first_elapsed_at_most(previous, room, period, elapsed)
    {
        return first - elapsed;
    }
    // Not in this window: in the next one, this window's count is the previous one.
    let to_next = period - elapsed;
    to_next.saturating_add(first_elapsed_at_most(current, room, period, 0).unwrap_or(period))
}

/// Milliseconds from `elapsed` until the used count drops below what it is now (0 if nothing is
/// used).
pub(crate) fn wait_until_frees(previous: u64, current: u64, period: u64, elapsed: u64) -> u64 {
    let faded = weighted(previous, period, elapsed);
    if faded > 0 {
        return match first_elapsed_at_most(previous, faded - 1, period, elapsed) {
            Some(first) => first - elapsed,
            // The previous count drops out when this window ends.
            None => period - elapsed,
        };
    }
    if current == 0 {
        return 0;
    }
    // In the next window the used count starts at `current` (this window's, at full weight) and
    // drops as it fades.
    (period - elapsed)
        .saturating_add(first_elapsed_at_most(current, current - 1, period, 0).unwrap_or(period))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_previous_window_fades_linearly() {
        assert_eq!(weighted(100, 1_000, 0), 100);
        assert_eq!(weighted(100, 1_000, 250), 75);
        assert_eq!(weighted(100, 1_000, 500), 50);
        assert_eq!(weighted(100, 1_000, 999), 0);
        assert_eq!(weighted(100, 1_000, 1_000), 0);
    }

    #[test]
    fn waits_for_the_previous_window_to_fade_enough() {
        // 10 per second, 8 last window, 4 so far: at 200 ms, 6 (6.4) + 4 are used; one more fits
        // once the weighted previous count is 5, at 251 ms.
        assert_eq!(weighted(8, 1_000, 250), 6);
        assert_eq!(wait_until_fits(8, 4, 1, 10, 1_000, 200), 51);
        // 10 last window, 5 now, at 100 ms: 9 + 5 used; a request fits when 10 * w <= 4.
        let wait = wait_until_fits(10, 5, 1, 10, 1_000, 100);
        let at = 100 + wait;
        assert!(weighted(10, 1_000, at) + 5 < 10);
        assert!(weighted(10, 1_000, at - 1) + 5 >= 10);
    }

    #[test]
    fn a_full_window_waits_for_the_next_one() {
        // 10 per second, 10 in this window: nothing fits until this window's count fades in the
        // next one.
        let wait = wait_until_fits(0, 10, 1, 10, 1_000, 300);
        assert!(wait > 700, "{wait}");
        let next_elapsed = wait - 700;
        assert!(weighted(10, 1_000, next_elapsed) < 10);
        assert!(weighted(10, 1_000, next_elapsed - 1) >= 10);
        assert_eq!(wait_until_fits(0, 0, 11, 10, 1_000, 300), 1_000);
    }

    proptest! {
        /// The wait is exact: the request fits at `elapsed + wait` (in this window or the next,
        /// counts carried over), and not one millisecond earlier.
        #[test]
        fn waits_are_exact(
            limit in 1u64..2_000,
            period in 1u64..100_000,
            previous_share in 0u64..=100,
            current_share in 0u64..=100,
            cost in 1u64..50,
            elapsed_share in 0u64..100,
        ) {
            let previous = limit * previous_share / 100;
            let current = limit * current_share / 100;
            let elapsed = period * elapsed_share / 100;
            let fits_at = |t: u64| -> bool {
                if t < period {
                    weighted(previous, period, t) + current + cost <= limit
                } else if t < 2 * period {
                    weighted(current, period, t - period) + cost <= limit
                } else {
                    cost <= limit
                }
            };
            prop_assume!(!fits_at(elapsed) && cost <= limit);
            let wait = wait_until_fits(previous, current, cost, limit, period, elapsed);
            prop_assert!(fits_at(elapsed + wait), "wait {wait}");
            prop_assert!(wait == 0 || !fits_at(elapsed + wait - 1), "wait {wait} is not the first");
        }

        /// The reset is exact: the used count is lower at `elapsed + wait` and not before.
        #[test]
        fn frees_are_exact(
            limit in 1u64..2_000,
            period in 1u64..100_000,
            previous_share in 0u64..=100,
            current_share in 0u64..=100,
            elapsed_share in 0u64..100,
        ) {
            let previous = limit * previous_share / 100;
            let current = limit * current_share / 100;
            let elapsed = period * elapsed_share / 100;
            let used_at = |t: u64| -> u64 {
                if t < period {
                    weighted(previous, period, t) + current
                } else if t < 2 * period {
                    weighted(current, period, t - period)
                } else {
                    0
                }
            };
            let now = used_at(elapsed);
            let wait = wait_until_frees(previous, current, period, elapsed);
            if now == 0 {
                prop_assert_eq!(wait, 0);
            } else {
                prop_assert!(wait > 0);
                prop_assert!(used_at(elapsed + wait) < now, "wait {wait}");
                prop_assert!(used_at(elapsed + wait - 1) >= now, "wait {wait} is not the first");
            }
        }
    }
}
