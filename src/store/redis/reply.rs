//! The batch script's reply (see `lua/batch.lua`): one MessagePack string holding a flat array,
//! the batch's time and then each check's entry, read straight into numbers and decisions. A
//! reply item as Redis's own array would cost the client a parsed reply value each; the string is
//! one, whatever the batch's size.

use std::ops::Range;
use std::time::Duration;

use rmp::Marker;

use super::super::StoreError;
use super::error::fault_of;
use crate::decision::{Decision, RuleState};

/// What the reply needs to know of a rule, in the request's rule order (the quota last).
#[derive(Debug, Clone, Copy)]
pub(super) struct RuleLimit {
    pub(super) limit: u64,
    /// The duplicate guard, whose state the script sends after the counted rules'.
    pub(super) guard: bool,
    /// The daily quota, whose state comes after the guard's.
    pub(super) quota: bool,
    /// The concurrency limit, whose state comes after the quota's and is followed by the lease.
    pub(super) concurrency: bool,
    /// A token bucket's counted rule: an admission's full reply says its bucket's full time
    /// after the lease.
    pub(super) bucket: bool,
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
            decision_from(&items[entry.items], entry.short, now_unix_ms, limits)
        })
    }
}

/// At most this many bytes of an unreadable reply go into its error.
const MAX_SHOWN: usize = 200;

/// Reads the batch script's reply, `packed`, for checks whose short forms have these lengths
/// (two items per rule), in the batch's order. A reply that doesn't hold exactly one entry per
/// check is a [`StoreError::Protocol`].
pub(super) fn read_batch_reply(
    packed: &[u8],
    short_lengths: impl ExactSizeIterator<Item = usize>,
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
    let checks = short_lengths.len();
    // Each item takes a byte at least: a length beyond what is left is a broken reply, not an
    // allocation to make (the fuzzer found one of 4 billion items aborting the process).
    let mut items = Vec::with_capacity(length.min(rest.len()));
    let mut entries = Vec::with_capacity(checks);
    for short_length in short_lengths {
        let start = items.len();
        let (short, count) = match next(&mut rest)? {
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
        }));
    }
    if left > 0 || !rest.is_empty() {
        return Err(StoreError::Protocol(format!(
            "a batch of {checks} checks answered more than {checks} entries"
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
/// alert), or the check's reply (`allowed, delay, then remaining, reset, retry` per rule, the
/// counted rules, then the guard, then the quota, then the concurrency limit and the lease taken
/// (0: none), then the percents of the alerts that fired).
fn decision_from(
    entry: &[i64],
    short: bool,
    now_unix_ms: u64,
    limits: &[RuleLimit],
) -> Result<Decision, StoreError> {
    let malformed = || StoreError::Protocol(format!("unexpected script reply {entry:?}"));
    let unsigned = |value: i64| u64::try_from(value).map_err(|_| malformed());
    let (allowed, delay, width, states_start) = if short {
        if entry.len() != 2 * limits.len() {
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
        .filter(|rule| !rule.guard && !rule.quota && !rule.concurrency)
        .count();
    let guards = limits.iter().filter(|rule| rule.guard).count();
    let (mut next_counted, mut next_guard, mut next_quota) = (0, counted, counted + guards);
    let mut rules = limits
        .iter()
        .map(|rule| {
            let slot = if rule.quota || rule.concurrency {
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
    let (lease, mut alerts_start) = match limits.last() {
        Some(last) if last.concurrency && !short => {
            let id = unsigned(*entry.get(states_end).ok_or_else(malformed)?)?;
            (Some(id).filter(|&id| id > 0), states_end + 1)
        }
        _ => (None, states_end),
    };
    // An admission's token buckets: each counted rule's full time, in the counted rules' order.
    if allowed && !short {
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the script packs: a MessagePack array of these items.
    enum Packed<'a> {
        Number(i64),
        Float(f64),
        Text(&'a str),
    }

    /// `items` packed as the script packs its reply.
    fn packed(items: &[Packed<'_>]) -> Vec<u8> {
        let mut out = Vec::new();
        rmp::encode::write_array_len(&mut out, items.len() as u32).unwrap();
        for item in items {
            match item {
                Packed::Number(number) => {
                    rmp::encode::write_sint(&mut out, *number).unwrap();
                }
                Packed::Float(number) => rmp::encode::write_f64(&mut out, *number).unwrap(),
                Packed::Text(text) => rmp::encode::write_str(&mut out, text).unwrap(),
            }
        }
        out
    }

    fn numbers(values: &[i64]) -> Vec<u8> {
        let items: Vec<Packed<'_>> = values.iter().copied().map(Packed::Number).collect();
        packed(&items)
    }

    /// The decision of one check's reply `items` (its entry after the time), with `limits`.
    fn decision_of(items: &[i64], limits: &[RuleLimit]) -> Result<Decision, StoreError> {
        let reply = read_batch_reply(
            &numbers(&[[1_000].as_slice(), items].concat()),
            std::iter::once(2 * limits.len()),
        )?;
        reply.into_decisions([limits]).next().expect("one decision")
    }

    fn counted(limit: u64) -> RuleLimit {
        RuleLimit {
            limit,
            guard: false,
            quota: false,
            concurrency: false,
            bucket: false,
        }
    }

    #[test]
    fn a_batch_reply_splits_into_each_checks_items_or_error() {
        let reply = packed(&[
            Packed::Number(1_000),
            // A full reply of 5 items, its length negated.
            Packed::Number(-5),
            Packed::Number(1),
            Packed::Number(0),
            Packed::Number(4),
            Packed::Number(500),
            Packed::Number(-1),
            Packed::Number(-1),
            Packed::Text("WRONGTYPE no"),
            // A short form: two items for its one rule, and no length.
            Packed::Number(70_000),
            Packed::Float(59_999.7),
            Packed::Number(-5),
            Packed::Number(0),
            Packed::Number(0),
            Packed::Number(0),
            Packed::Number(1_000),
            Packed::Number(3),
        ]);
        let read = read_batch_reply(&reply, [2, 2, 2, 2].into_iter()).unwrap();
        assert_eq!(read.now_unix_ms, 1_000);
        let limits = [
            [counted(5)],
            [counted(5)],
            [counted(100_000)],
            [counted(1_000)],
        ];
        let mut decisions = read.into_decisions(limits.iter().map(|limits| &limits[..]));
        let first = decisions.next().unwrap().unwrap();
        assert_eq!((first.allowed, first.now_unix_ms), (true, 1_000));
        assert_eq!(first.rules[0].remaining, 4);
        // Its error, in Redis's words, as the fault it is.
        assert!(matches!(
            decisions.next().unwrap(),
            Err(StoreError::WrongType(message)) if message == "WRONGTYPE no"
        ));
        let short = decisions.next().unwrap().unwrap();
        assert!(short.allowed);
        // A fraction is cut toward zero, as Redis cuts a number it replies with.
        assert_eq!(
            (short.rules[0].remaining, short.rules[0].reset),
            (70_000, Duration::from_millis(59_999))
        );
        let refused = decisions.next().unwrap().unwrap();
        assert!(!refused.allowed);
        assert_eq!(refused.rules[0].retry_after, Some(Duration::from_millis(3)));
        assert!(decisions.next().is_none());
    }

    #[test]
    fn a_reply_of_other_than_one_entry_per_check_is_a_protocol_error() {
        let cases: [(&[u8], usize); 8] = [
            (b"", 1),
            (&numbers(&[]), 0),
            (&numbers(&[-5]), 0),
            // Fewer entries than checks, or more.
            (&numbers(&[1_000, 4, 500]), 2),
            (&numbers(&[1_000, 4, 500, 3, 400]), 1),
            // A length past the end, an error without its message.
            (&numbers(&[1_000, -7, 1, 0]), 1),
            (&numbers(&[1_000, -1]), 1),
            // Not MessagePack's array.
            (b"\x81\x01\x02", 0),
        ];
        for (reply, checks) in cases {
            assert!(
                matches!(
                    read_batch_reply(reply, std::iter::repeat_n(2, checks)),
                    Err(StoreError::Protocol(_))
                ),
                "{reply:?}"
            );
        }
        let text = packed(&[
            Packed::Number(1_000),
            Packed::Number(4),
            Packed::Text("500"),
        ]);
        assert!(read_batch_reply(&text, std::iter::once(2)).is_err());
        let text_time = packed(&[Packed::Text("now")]);
        assert!(read_batch_reply(&text_time, std::iter::empty()).is_err());
    }

    #[test]
    fn replies_become_decisions() {
        let decision = decision_of(
            &[-8, 0, 0, 0, 500, 500, 7, 90_000, -1],
            &[counted(5), counted(10)],
        )
        .unwrap();
        assert!(!decision.allowed);
        assert_eq!(decision.now_unix_ms, 1_000);
        assert_eq!(decision.delay, Duration::ZERO);
        assert_eq!(
            decision.rules,
            [
                RuleState {
                    limit: 5,
                    remaining: 0,
                    reset: Duration::from_millis(500),
                    retry_after: Some(Duration::from_millis(500)),
                    bucket_full_at_us: None,
                },
                RuleState {
                    limit: 10,
                    remaining: 7,
                    reset: Duration::from_secs(90),
                    retry_after: None,
                    bucket_full_at_us: None,
                },
            ]
        );
    }

    #[test]
    fn an_admissions_short_form_is_two_items_per_rule() {
        let decision = decision_of(&[4, 500, 29, 59_500], &[counted(5), counted(30)]).unwrap();
        assert!(decision.allowed);
        assert_eq!(decision.now_unix_ms, 1_000);
        assert_eq!(decision.delay, Duration::ZERO);
        assert!(decision.quota_alerts.is_empty());
        assert_eq!(
            decision.rules,
            [
                RuleState {
                    limit: 5,
                    remaining: 4,
                    reset: Duration::from_millis(500),
                    retry_after: None,
                    bucket_full_at_us: None,
                },
                RuleState {
                    limit: 30,
                    remaining: 29,
                    reset: Duration::from_millis(59_500),
                    retry_after: None,
                    bucket_full_at_us: None,
                },
            ]
        );
    }

    #[test]
    fn the_quota_state_comes_last_then_the_alerts_fired() {
        let quota = RuleLimit {
            limit: 100,
            guard: false,
            quota: true,
            concurrency: false,
            bucket: false,
        };
        let decision = decision_of(
            &[-9, 1, 0, 19, 60_000, -1, 20, 5_000, -1, 80],
            &[counted(20), quota],
        )
        .unwrap();
        assert_eq!(decision.rules[1].remaining, 20);
        assert_eq!(decision.quota_alerts, [80]);
    }

    #[test]
    fn the_guard_state_comes_last_and_goes_back_to_its_rule() {
        // A guard that isn't the last rule (a hand-made request) still gets its own state.
        let limits = [
            RuleLimit {
                limit: 1,
                guard: true,
                quota: false,
                concurrency: false,
                bucket: false,
            },
            counted(5),
        ];
        let decision = decision_of(&[-8, 1, 250, 0, 5_000, -1, 4, 900, -1], &limits).unwrap();
        assert_eq!(decision.delay, Duration::from_millis(250));
        assert_eq!(
            (decision.rules[0].limit, decision.rules[0].remaining),
            (1, 4)
        );
        assert_eq!(
            (decision.rules[1].limit, decision.rules[1].remaining),
            (5, 0)
        );
    }

    #[test]
    fn a_length_beyond_the_reply_is_an_error_not_an_allocation() {
        // Found by `fuzz/`'s store_reply target: an array of 4 294 967 295 items, then a time,
        // asked the allocator for 32 GiB and aborted the process.
        let huge = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x00, 0x01, 0x02];
        assert!(matches!(
            read_batch_reply(&huge, [2].into_iter()),
            Err(StoreError::Protocol(_))
        ));
    }

    #[test]
    fn malformed_entries_are_protocol_errors() {
        for entry in [
            &[-2, 1, 0][..],
            &[-4, 1, 0, 1, 2],
            &[-5, 2, 0, 1, 2, -1],
            &[-5, 1, -1, 1, 2, -1],
            &[-5, 0, 0, -1, 2, -1],
            &[-5, 0, 0, 1, 2, -7],
            &[-3, 1, 0, 1, 2, -1],
            &[4, -2],
        ] {
            assert!(
                matches!(
                    decision_of(entry, &[counted(5)]),
                    Err(StoreError::Protocol(_))
                ),
                "{entry:?}"
            );
        }
    }
}
