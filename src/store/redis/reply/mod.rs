//! The batch script's reply (see `lua/batch.lua`): one MessagePack string holding a flat array,
//! the batch's time and then each check's entry, read straight into numbers and decisions. A
//! reply item as Redis's own array would cost the client a parsed reply value each; the string is
//! one, whatever the batch's size.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use rmp::Marker;

use super::super::StoreError;
use super::error::fault_of;
use crate::decision::{AppliedOverride, Decision, RuleState};

/// What the reply needs to know of a rule, in the request's rule order (the counted rules and the
/// guard, then the quota, the concurrency limit, a budget shared fairly and the share).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RuleLimit {
    pub(super) limit: u64,
    /// The duplicate guard, whose state the script sends after the counted rules'.
    pub(super) guard: bool,
    /// The daily quota, whose state comes after the guard's.
    pub(super) quota: bool,
    /// The concurrency limit, whose state comes after the quota's and is followed by the lease.
    pub(super) concurrency: bool,
    /// A token bucket's counted rule (or budget): an admission's full reply says its bucket's
    /// full time after the lease.
    pub(super) bucket: bool,
    /// A budget shared fairly, whose state comes after the concurrency limit's.
    pub(super) budget: bool,
    /// The identity's share of it, whose state comes last, and whose limit the reply says after
    /// the lease (it moves with the budget's saturation).
    pub(super) share: bool,
}

impl RuleLimit {
    /// A counted rule of `limit`.
    pub(super) fn of(limit: u64) -> Self {
        RuleLimit {
            limit,
            ..RuleLimit::default()
        }
    }

    /// Whether its state comes after the guard's (the quota, the concurrency limit, a budget
    /// shared fairly, the share), kept when a run-time override replaces the counted rules.
    fn after_guard(&self) -> bool {
        self.quota || self.concurrency || self.budget || self.share
    }
}

/// The batch reply read: the batch's time (ms since the Unix epoch), its numbers, and where each
/// check's entry lies among them, or the error its check raised.
pub(super) struct BatchReply {
    now_unix_ms: u64,
    items: Vec<i64>,
    entries: Vec<Result<Entry, StoreError>>,
}

/// One check's entry in a [`BatchReply`].
struct Entry {
    /// An admission's short form (two items per rule), or the check's full reply.
    short: bool,
    items: Range<usize>,
    /// The run-time override it was checked by (`lua/overrides.lua`), if any.
    overridden: Option<Overridden>,
}

/// The run-time override an entry was checked by: the override key's value, and what the reply
/// needs to know of its rules (`None`: deny or unlimited, which have no entry).
struct Overridden {
    value: Arc<str>,
    limits: Option<smallvec::SmallVec<[RuleLimit; 3]>>,
    unlimited: bool,
}

impl Overridden {
    /// The override of `value` (see `lua/overrides.lua`), in place of the counted rules of a
    /// check of `limits`; `None` for a value no crate wrote.
    fn of(value: String, limits: &[RuleLimit]) -> Option<Self> {
        let (what, _) = value.split_once('\n')?;
        let (limits, unlimited) = match what {
            "d" => (None, false),
            "u" => (None, true),
            rules => {
                let mut pieces = rules.split('|');
                let (_, code, count) = (pieces.next()?, pieces.next()?, pieces.next()?);
                let count: usize = count.parse().ok()?;
                let bucket = code == "tb";
                let params: Vec<u64> = pieces
                    .skip(1)
                    .take(count * if bucket { 3 } else { 2 })
                    .map(|piece| piece.parse().ok())
                    .collect::<Option<_>>()?;
                let own = params
                    .chunks(if bucket { 3 } else { 2 })
                    .map(|params| RuleLimit {
                        bucket,
                        ..RuleLimit::of(params[0])
                    });
                // The quota's, the concurrency limit's and a budget's stay the request's.
                let kept = limits.iter().filter(|rule| rule.after_guard());
                (Some(own.chain(kept.copied()).collect()), false)
            }
        };
        Some(Overridden {
            value: value.into(),
            limits,
            unlimited,
        })
    }
}

impl BatchReply {
    /// Each check's decision, in the batch's order; `limits`: each check's rules.
    pub(super) fn into_decisions<'a>(
        self,
        limits: impl IntoIterator<Item = &'a [RuleLimit]>,
    ) -> impl Iterator<Item = Result<Decision, StoreError>> {
        let BatchReply {
            now_unix_ms,
            items,
            entries,
        } = self;
        entries.into_iter().zip(limits).map(move |(entry, limits)| {
            let entry = entry?;
            let Some(by) = entry.overridden else {
                return decision_from(&items[entry.items], entry.short, now_unix_ms, limits);
            };
            let applied = Some(AppliedOverride(by.value));
            match by.limits {
                Some(limits) => {
                    decision_from(&items[entry.items], entry.short, now_unix_ms, &limits).map(
                        |decision| Decision {
                            run_time_override: applied,
                            ..decision
                        },
                    )
                }
                // Deny or unlimited: decided by the override alone, nothing counted.
                None => Ok(Decision {
                    allowed: by.unlimited,
                    rules: Vec::new(),
                    now_unix_ms,
                    delay: Duration::ZERO,
                    quota_alerts: Vec::new(),
                    lease: None,
                    run_time_override: applied,
                }),
            }
        })
    }
}

/// The length of an admission's short form for a check of these rules (see `lua/batch.lua`):
/// remaining and reset per rule, then the lease taken when it has a concurrency limit, the
/// share's limit when it has a budget shared fairly, then each token bucket's full time.
pub(super) fn short_length(limits: &[RuleLimit]) -> usize {
    let leases = usize::from(limits.iter().any(|rule| rule.concurrency));
    let shares = usize::from(limits.iter().any(|rule| rule.share));
    let buckets = limits.iter().filter(|rule| rule.bucket).count();
    2 * limits.len() + leases + shares + buckets
}

/// Plain rules whose admissions' short form is `length` items long (one rule a token bucket when
/// it is odd): what tests and the fuzzer read replies for.
#[cfg(any(test, fuzzing))]
pub(super) fn limits_of_short_length(length: usize) -> Vec<RuleLimit> {
    (0..length / 2)
        .map(|index| RuleLimit {
            bucket: index == 0 && length % 2 == 1,
            ..RuleLimit::of(10)
        })
        .collect()
}

/// At most this many bytes of an unreadable reply go into its error.
const MAX_SHOWN: usize = 200;

/// Reads the batch script's reply, `packed`, for checks of these rules (see [`rule_limits`],
/// `command.rs`), in the batch's order. A reply that doesn't hold exactly one entry per
/// check is a [`StoreError::Protocol`].
pub(super) fn read_batch_reply<'a>(
    packed: &[u8],
    checks: impl ExactSizeIterator<Item = &'a [RuleLimit]>,
) -> Result<BatchReply, StoreError> {
    let malformed = |what: &str| {
        // What Redis answered, as far as a log line should show it.
        let shown = String::from_utf8_lossy(&packed[..packed.len().min(MAX_SHOWN)]);
        StoreError::Protocol(format!("unreadable batch reply ({what}): {shown:?}"))
    };
    let mut rest = packed;
    let length =
        rmp::decode::read_array_len(&mut rest).map_err(|_| malformed("not an array"))? as usize;
    let mut left = length;
    let mut next = |rest: &mut &[u8]| -> Result<Item, StoreError> {
        left = left
            .checked_sub(1)
            .ok_or_else(|| malformed("fewer items than checks"))?;
        read_item(rest).ok_or_else(|| malformed("an item that is neither a number nor text"))
    };
    let now_unix_ms = match next(&mut rest)? {
        Item::Number(now) => u64::try_from(now).map_err(|_| malformed("a negative time"))?,
        Item::Text(_) => return Err(malformed("no time")),
    };
    let count = checks.len();
    // Each item takes a byte at least: a length beyond what is left is a broken reply, not an
    // allocation to make (the fuzzer found one of 4 billion items aborting the process).
    let mut items = Vec::with_capacity(length.min(rest.len()));
    let mut entries = Vec::with_capacity(count);
    for limits in checks {
        let start = items.len();
        let mut first = next(&mut rest)?;
        // Checked by a run-time override: its value first, then its entry (none for deny and
        // unlimited).
        let mut overridden = None;
        if let Item::Text(value) = first {
            let by = Overridden::of(value, limits)
                .ok_or_else(|| malformed("an unreadable run-time override"))?;
            if by.limits.is_none() {
                entries.push(Ok(Entry {
                    short: false,
                    items: start..start,
                    overridden: Some(by),
                }));
                continue;
            }
            first = next(&mut rest)?;
            overridden = Some(by);
        }
        let short_length = short_length(
            overridden
                .as_ref()
                .and_then(|by| by.limits.as_deref())
                .unwrap_or(limits),
        );
        let (short, count) = match first {
            Item::Number(-1) => {
                let Item::Text(error) = next(&mut rest)? else {
                    return Err(malformed("an error without its message"));
                };
                entries.push(Err(fault_of(error)));
                continue;
            }
            Item::Number(length) if length < 0 => (false, length.unsigned_abs() as usize),
            Item::Number(first) if short_length > 0 => {
                items.push(first);
                (true, short_length - 1)
            }
            _ => {
                return Err(malformed(
                    "an entry that is neither a length nor a short form",
                ));
            }
        };
        for _ in 0..count {
            match next(&mut rest)? {
                Item::Number(number) => items.push(number),
                Item::Text(_) => return Err(malformed("text in an entry")),
            }
        }
        entries.push(Ok(Entry {
            short,
            items: start..items.len(),
            overridden,
        }));
    }
    if left > 0 || !rest.is_empty() {
        return Err(StoreError::Protocol(format!(
            "a batch of {count} checks answered more than {count} entries"
        )));
    }
    Ok(BatchReply {
        now_unix_ms,
        items,
        entries,
    })
}

/// One item of the reply.
enum Item {
    /// A number: Lua's numbers are doubles, which MessagePack keeps as integers when they are
    /// whole; a fraction is cut toward zero, as Redis does when it replies with one.
    Number(i64),
    /// An error's message.
    Text(String),
}

/// The next item of `rest`, if it is a number or text.
fn read_item(rest: &mut &[u8]) -> Option<Item> {
    let number = match rmp::decode::read_marker(rest).ok()? {
        Marker::FixPos(value) => i64::from(value),
        Marker::FixNeg(value) => i64::from(value),
        Marker::U8 => i64::from(take::<1>(rest)?[0]),
        Marker::U16 => i64::from(u16::from_be_bytes(take(rest)?)),
        Marker::U32 => i64::from(u32::from_be_bytes(take(rest)?)),
        Marker::U64 => i64::try_from(u64::from_be_bytes(take(rest)?)).ok()?,
        Marker::I8 => i64::from(i8::from_be_bytes(take(rest)?)),
        Marker::I16 => i64::from(i16::from_be_bytes(take(rest)?)),
        Marker::I32 => i64::from(i32::from_be_bytes(take(rest)?)),
        Marker::I64 => i64::from_be_bytes(take(rest)?),
        // `as` cuts toward zero (and saturates), as Redis does.
        Marker::F32 => f32::from_be_bytes(take(rest)?) as i64,
        Marker::F64 => f64::from_be_bytes(take(rest)?) as i64,
        Marker::FixStr(length) => return text(rest, usize::from(length)),
        Marker::Str8 => {
            let length = take::<1>(rest)?[0];
            return text(rest, usize::from(length));
        }
        Marker::Str16 => {
            let length = u16::from_be_bytes(take(rest)?);
            return text(rest, usize::from(length));
        }
        Marker::Str32 => {
            let length = u32::from_be_bytes(take(rest)?);
            return text(rest, usize::try_from(length).ok()?);
        }
        _ => return None,
    };
    Some(Item::Number(number))
}

/// The next `N` bytes of `rest`.
fn take<const N: usize>(rest: &mut &[u8]) -> Option<[u8; N]> {
    let (bytes, after) = rest.split_first_chunk::<N>()?;
    *rest = after;
    Some(*bytes)
}

/// The next `length` bytes of `rest`, as text.
fn text(rest: &mut &[u8], length: usize) -> Option<Item> {
    let (bytes, after) = rest.split_at_checked(length)?;
    *rest = after;
    Some(Item::Text(String::from_utf8_lossy(bytes).into_owned()))
}

/// Reads a check's entry in the batch reply (see `lua/batch.lua`) into a decision at
/// `now_unix_ms` (the batch's time), its rules in the request's rule order. The entry is either an
/// admission's short form (`short`: `remaining, reset` per rule: admitted, no delay, no retry, no
/// alert; then the lease taken, and each token bucket's full time), or the check's reply
/// (`allowed, delay, then remaining, reset, retry` per rule, the counted rules, then the guard,
/// then the quota, then the concurrency limit, a budget shared fairly and the share, then the lease
/// taken (0: none), then the share's limit, then, when admitted, each token bucket's full time,
/// then the percents of the alerts that fired).
fn decision_from(
    entry: &[i64],
    short: bool,
    now_unix_ms: u64,
    limits: &[RuleLimit],
) -> Result<Decision, StoreError> {
    let malformed = || StoreError::Protocol(format!("unexpected script reply {entry:?}"));
    let unsigned = |value: i64| u64::try_from(value).map_err(|_| malformed());
    let (allowed, delay, width, states_start) = if short {
        if entry.len() != short_length(limits) {
            return Err(malformed());
        }
        (true, Duration::ZERO, 2, 0)
    } else {
        if entry.len() < 2 + 3 * limits.len() {
            return Err(malformed());
        }
        let allowed = match entry[0] {
            1 => true,
            0 => false,
            _ => return Err(malformed()),
        };
        (allowed, Duration::from_millis(unsigned(entry[1])?), 3, 2)
    };
    let states_end = states_start + width * limits.len();
    let state_at = |slot: usize| {
        let start = states_start + width * slot;
        entry.get(start..start + width).ok_or_else(malformed)
    };
    let counted = limits
        .iter()
        .filter(|rule| !rule.guard && !rule.after_guard())
        .count();
    let guards = limits.iter().filter(|rule| rule.guard).count();
    let (mut next_counted, mut next_guard, mut next_quota) = (0, counted, counted + guards);
    let mut rules = limits
        .iter()
        .map(|rule| {
            let slot = if rule.after_guard() {
                &mut next_quota
            } else if rule.guard {
                &mut next_guard
            } else {
                &mut next_counted
            };
            let state = state_at(*slot)?;
            *slot += 1;
            Ok(RuleState {
                limit: rule.limit,
                remaining: unsigned(state[0])?,
                reset: Duration::from_millis(unsigned(state[1])?),
                retry_after: match state.get(2).copied().unwrap_or(-1) {
                    -1 => None,
                    retry => Some(Duration::from_millis(unsigned(retry)?)),
                },
                bucket_full_at_us: None,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    let (lease, mut alerts_start) = if limits.iter().any(|rule| rule.concurrency) {
        let id = unsigned(*entry.get(states_end).ok_or_else(malformed)?)?;
        (Some(id).filter(|&id| id > 0), states_end + 1)
    } else {
        (None, states_end)
    };
    if let Some(share) = limits.iter().position(|rule| rule.share) {
        rules[share].limit = unsigned(*entry.get(alerts_start).ok_or_else(malformed)?)?;
        alerts_start += 1;
    }
    // An admission's token buckets: each counted rule's full time, in the counted rules' order.
    if allowed {
        for (state, _) in rules
            .iter_mut()
            .zip(limits)
            .filter(|(_, limit)| limit.bucket)
        {
            let full_at = entry.get(alerts_start).ok_or_else(malformed)?;
            state.bucket_full_at_us = Some(unsigned(*full_at)?);
            alerts_start += 1;
        }
    }
    let quota_alerts = entry[alerts_start..]
        .iter()
        .map(|&value| {
            u8::try_from(value)
                .ok()
                .filter(|percent| (1..=100).contains(percent))
                .ok_or_else(malformed)
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(Decision {
        allowed,
        rules,
        now_unix_ms,
        delay,
        quota_alerts,
        lease,
        run_time_override: None,
    })
}

#[cfg(test)]
mod tests;
