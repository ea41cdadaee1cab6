//! The script call of a batch of checks: its `FCALL` or `EVALSHA`, keys and arguments (its reply:
//! `reply`).

use std::time::Duration;

use ::redis::Cmd;
use smallvec::SmallVec;
use tokio::time::Instant;

use super::fair_tag::{FAIR_KEYS, FairTag};
use super::reply::RuleLimit;
use crate::policy::{Algorithm, Rule};
use crate::store::{Call, CheckRequest};

/// What the reply needs to know of each rule of `request`, in its rule order (the quota last).
fn rule_limits(request: &CheckRequest<'_>) -> RuleLimits {
    let mut limits: RuleLimits = request
        .rules
        .iter()
        .map(|rule| RuleLimit {
            guard: rule.is_duplicate_guard(),
            bucket: request.algorithm == Algorithm::TokenBucket && !rule.is_duplicate_guard(),
            ..RuleLimit::of(rule.limit())
        })
        .collect();
    if let Some(quota) = request.quota {
        limits.push(RuleLimit {
            quota: true,
            ..RuleLimit::of(quota.limit)
        });
    }
    if let Some(concurrency) = request.concurrency {
        // Its state comes after the quota's, as it does in the reply.
        limits.push(RuleLimit {
            concurrency: true,
            ..RuleLimit::of(concurrency.max_in_flight())
        });
    }
    if let Some(fair) = request.fair {
        // The budget's and the share's come last (the share's limit is the reply's).
        limits.push(RuleLimit {
            budget: true,
            bucket: request.algorithm == Algorithm::TokenBucket,
            ..RuleLimit::of(fair.budget.limit())
        });
        limits.push(RuleLimit {
            share: true,
            ..RuleLimit::of(fair.budget.limit())
        });
    }
    limits
}

/// What the reply needs to know of a check's rules, kept in place for the common policies (up
/// to three rules, the quota and the concurrency limit counted): no allocation of its own.
pub(super) type RuleLimits = SmallVec<[RuleLimit; 3]>;

/// How many options a budget shared fairly has, the last ones (see `lua/batch.lua`).
const FAIR_OPTIONS: usize = 6;

/// Where a check's keys end in its packing, kept in place for up to four keys.
type KeyEnds = SmallVec<[usize; 4]>;

/// The shape of a lease's release (see `lua/batch.lua`): its one key is the leases.
const RELEASE_SHAPE: &str = "rl|1";

/// A check on its way to Redis.
pub(super) struct Member {
    pub(super) check: PackedCheck,
    /// Replicas that must acknowledge its writes (`WAIT`), if any.
    pub(super) replicas: Option<u32>,
    /// When it stops waiting.
    pub(super) deadline: Instant,
    /// The store timeout it reports when it runs out of time.
    pub(super) timeout: Duration,
}

/// One check packed for the batch script (see `lua/batch.lua` and `lua/entry.lua`): its keys
/// (`<counter key per counted rule> [<guard key>] [<quota key> <flag keys>] [<leases key>]
/// [<block key>]`), then
/// its shape: `<algorithm>|<key count>|<cost>|<options>|<limit>|<period>[|<burst>]…` (a limit,
/// period and, for a token bucket, burst per counted rule; a check's or a peek's may end
/// `~<suffix>~<gate>`, see `overrides.rs`), then what rides with its entry (its
/// receipt), all back to back in one buffer, so a check costs one allocation whatever its rules,
/// and a batch copies them once. Checks of one policy and cost have the same shape, which a
/// batch sends once and the script parses once.
pub(super) struct PackedCheck {
    /// The keys, then the shape, then the receipt (keys are written here directly).
    data: String,
    /// Where each key ends in `data`; the shape follows the last.
    ends: KeyEnds,
    /// What the reply needs to know of each rule.
    pub(super) limits: RuleLimits,
    /// Where the shape ends in `data` and what rides with the check's shape number in its entry
    /// (see `lua/batch.lua`) starts: a give-back's receipt, `@<checked ms>,<delay ms>[,<bucket
    /// full time µs> per counted rule]`; a release's lease, `@<id>`; a claim, `#<id>,<lasting
    /// ms>`; nothing for every other check.
    receipt_at: usize,
    /// Whether, and how, it may go as one entry with others of its batch (`merge.rs`).
    merging: Merging,
}

/// How a packed check may go as one entry with others of its batch (see `merge.rs`).
#[derive(Clone)]
enum Merging {
    /// It goes alone.
    Alone,
    /// A give-back that adds up with identical ones: where its cost piece lies in its packing.
    AddsUp(std::ops::Range<usize>),
    /// A lease's release, joined with the releases of the same key: its lease's id (the first
    /// one's, once joined).
    Releases(u64),
}

impl PackedCheck {
    /// `request` packed; `generic`: with its options spelled out even when all are zero, so the
    /// script takes `lua/entry.lua`'s check rather than `lua/fast.lua`'s (tests compare them).
    pub(super) fn new(request: &CheckRequest<'_>, generic: bool) -> Self {
        let counted = || {
            request
                .rules
                .iter()
                .filter(|rule| !rule.is_duplicate_guard())
        };
        let rules = counted().count();
        let guard = request.rules.iter().find(|rule| rule.is_duplicate_guard());
        let block_ms = request.block_for.map_or(0, |block| block.as_millis());
        let quota = request.quota;
        let concurrency = request.concurrency;
        let thresholds = quota.map_or(&[][..], |quota| quota.thresholds);
        let keys = rules
            + usize::from(guard.is_some())
            + usize::from(quota.is_some())
            + usize::from(concurrency.is_some())
            + usize::from(block_ms > 0)
            + usize::from(matches!(request.call, Call::GiveBack(_)))
            + if request.fair.is_some() { FAIR_KEYS } else { 0 };
        // A receipt: two numbers, and a full time per token bucket rule; a claim: two numbers.
        let receipt = match request.call {
            Call::GiveBack(_) => 44 + rules * 21,
            _ => 0,
        } + if request.claim.is_some() { 44 } else { 0 };
        let mut packed = PackedCheck {
            data: String::with_capacity(
                keys * (2 * request.key.len() + 48) + rules * 24 + 32 + receipt,
            ),
            ends: KeyEnds::new(),
            limits: rule_limits(request),
            receipt_at: 0,
            merging: Merging::Alone,
        };
        // The check's own keys share their stem, found once (see [`OwnKeys`]).
        let mut own = OwnKeys::of(request);
        for (index, rule) in request.rules.iter().enumerate() {
            if rule.is_duplicate_guard() {
                continue;
            }
            // A run-time override's rule is kept in the counter of the policy's rule it shares.
            let limit = request.counted_limit(index, rule);
            write_rule_key(&mut own, &mut packed.data, request.algorithm, rule, limit);
            packed.end_key();
        }
        if let Some(guard) = guard {
            let mut window = itoa::Buffer::new();
            own.write(&mut packed.data, &["dup", window.format(guard.period_ms())]);
            packed.end_key();
        }
        if let Some(quota) = quota {
            let (mut day, mut offset) = (itoa::Buffer::new(), itoa::Buffer::new());
            let (day, offset) = (
                day.format(quota.day_ms),
                offset.format(quota.day_start_offset_ms),
            );
            match request.shared_budget() {
                // (Under a budget shared fairly, every key of the check has its tag.)
                Some(budget) => FairTag::of(budget).write_tenant(
                    &mut packed.data,
                    quota.key,
                    &["q", day, offset],
                ),
                None => write_key(
                    &mut packed.data,
                    quota.key,
                    quota.identity,
                    &["q", day, offset],
                ),
            }
            packed.end_key();
        }
        if concurrency.is_some() {
            own.write(&mut packed.data, &["leases"]);
            packed.end_key();
        }
        if block_ms > 0 {
            own.write(&mut packed.data, &["block"]);
            packed.end_key();
        }
        if let Call::GiveBack(_) = request.call {
            own.write(&mut packed.data, &["reset"]);
            packed.end_key();
        }
        if let Some(fair) = request.fair {
            let tag = FairTag::of(fair.key);
            // (The shares, as the budget's counter, are the budget rule's: a changed rule starts
            // afresh, as in the memory store.)
            for what in ["budget", "shares"] {
                with_rule_key_parts(
                    request.algorithm,
                    fair.budget,
                    fair.budget.limit(),
                    |parts| tag.write(&mut packed.data, what, parts),
                );
                packed.end_key();
            }
            tag.write(&mut packed.data, "s", &[fair.tenant_of(request)]);
            packed.end_key();
        }
        // A claim's key follows the shape's keys, outside its count: a check with a claim has
        // the shape of one without (lua/claims.lua).
        if request.claim.is_some() {
            own.write(&mut packed.data, &["claims"]);
            packed.end_key();
        }
        let data = &mut packed.data;
        data.push_str(algorithm_code(request.algorithm));
        let mut number = itoa::Buffer::new();
        let mut piece = |data: &mut String, value: u64| {
            data.push('|');
            data.push_str(number.format(value));
        };
        piece(data, keys as u64);
        let cost_start = data.len() + 1;
        piece(data, request.cost);
        if request.is_metered() {
            // `<cost>:<units>:<flags>`: a flag per counted rule, then the quota's (lua/common.lua).
            data.push(':');
            data.push_str(itoa::Buffer::new().format(request.units));
            data.push(':');
            for rule in counted() {
                data.push(if rule.is_metered() { 'm' } else { 'r' });
            }
            if let Some(quota) = quota {
                data.push(if quota.metered { 'm' } else { 'r' });
            }
        }
        // A give-back whose units simply come off counts (a fixed window's, a sliding counter's,
        // a quota's) may add up with identical ones of its batch: one entry, their units summed.
        if matches!(request.call, Call::GiveBack(_))
            && matches!(
                request.algorithm,
                Algorithm::FixedWindow | Algorithm::SlidingCounter
            )
            && guard.is_none()
            && concurrency.is_none()
            && request.claim.is_none()
            && request.fair.is_none()
        {
            packed.merging = Merging::AddsUp(cost_start..data.len());
        }
        // The options are one piece, empty when there are none (the script's lean functions of
        // the common case take checks without options).
        data.push('|');
        let max_delay = request.max_delay.as_millis();
        let guard_ms = guard.map_or(0, Rule::period_ms);
        if generic
            || max_delay > 0
            || guard_ms > 0
            || block_ms > 0
            || quota.is_some()
            || concurrency.is_some()
            || request.fair.is_some()
            || !request.call.records()
        {
            let options = [
                u64::try_from(max_delay).unwrap_or(u64::MAX),
                guard_ms,
                u64::try_from(block_ms).unwrap_or(u64::MAX),
                quota.map_or(0, |quota| quota.limit),
                quota.map_or(0, |quota| quota.day_ms),
                quota.map_or(0, |quota| quota.day_start_offset_ms),
                concurrency.map_or(0, |limit| limit.max_in_flight()),
                concurrency.map_or(0, |limit| {
                    u64::try_from(limit.lease().as_millis()).unwrap_or(u64::MAX)
                }),
                // 0: a check, 1: a peek, 2: a refund, 3: a give-back, 4: an overdraw
                // (lua/entry.lua); plus 8 in the generic form, which lua/entry.lua decides
                // alone, never a lean function of lua/fast.lua (tests compare the two).
                request.call.code() + if generic { 8 } else { 0 },
                // A budget shared fairly: its limit (0: none), period, burst, the request's
                // cost in it, the identity's weight and whether it counts metered units
                // (lua/fair.lua).
                request.fair.map_or(0, |fair| fair.budget.limit()),
                request.fair.map_or(0, |fair| fair.budget.period_ms()),
                request.fair.map_or(0, |fair| fair.budget.burst_size()),
                request.fair.map_or(0, |fair| fair.cost_of(request)),
                request.fair.map_or(0, |fair| u64::from(fair.weight)),
                request
                    .fair
                    .map_or(0, |fair| u64::from(fair.budget.is_metered())),
            ];
            let alerts = thresholds
                .iter()
                .flat_map(|threshold| [threshold.percent.into(), threshold.used]);
            // (Without a budget or alerts after them, the budget's zeros go unsaid: the script
            // reads an option left out as 0.)
            let said = if request.fair.is_none() && thresholds.is_empty() {
                options.len() - FAIR_OPTIONS
            } else {
                options.len()
            };
            for (index, option) in options.into_iter().take(said).chain(alerts).enumerate() {
                if index > 0 {
                    data.push(',');
                }
                // Most options are off: a zero needs no formatting.
                if option == 0 {
                    data.push('0');
                } else {
                    data.push_str(itoa::Buffer::new().format(option));
                }
            }
        }
        let with_burst = request.algorithm == Algorithm::TokenBucket;
        for rule in counted() {
            piece(data, rule.limit());
            piece(data, rule.period_ms());
            if with_burst {
                piece(data, rule.burst_size());
            }
        }
        // A check or a peek reads its identity's run-time override in the same call
        // (`lua/overrides.lua`).
        if matches!(request.call, Call::Check | Call::Peek)
            && let Some(lookup) = request.override_lookup
        {
            data.push_str(lookup);
        }
        packed.receipt_at = packed.data.len();
        if let Call::GiveBack(charged) = request.call {
            write_receipt(&mut packed.data, request, charged);
        }
        if let Some(claim) = request.claim {
            let mut number = itoa::Buffer::new();
            let receipt = &mut packed.data;
            receipt.push('#');
            receipt.push_str(number.format(claim.id));
            receipt.push(',');
            receipt.push_str(number.format(claim.lasting_ms));
        }
        packed
    }

    /// The release of concurrency lease `lease` of `request`, an entry of a batch (see
    /// `lua/batch.lua`): its one key, the leases, and the shape `rl|1`; its receipt is the lease's
    /// id, and its entry names no rule.
    pub(super) fn release(request: &CheckRequest<'_>, lease: u64) -> Self {
        let mut packed = PackedCheck {
            data: String::with_capacity(2 * request.key.len() + 48),
            ends: KeyEnds::new(),
            limits: RuleLimits::new(),
            receipt_at: 0,
            merging: Merging::Releases(lease),
        };
        write_leases_key(&mut packed.data, request);
        packed.end_key();
        packed.data.push_str(RELEASE_SHAPE);
        packed.receipt_at = packed.data.len();
        packed.data.push('@');
        packed.data.push_str(itoa::Buffer::new().format(lease));
        packed
    }

    /// Whether it may go as one entry with identical give-backs of its batch (see `merge.rs`).
    pub(super) fn adds_up(&self) -> bool {
        matches!(self.merging, Merging::AddsUp(_))
    }

    /// Whether it is a lease's release, which may go as one entry with the releases of the same
    /// leases in its batch (see `merge.rs`).
    pub(super) fn releases(&self) -> bool {
        matches!(self.merging, Merging::Releases(_))
    }

    /// These releases of one key's leases (see [`PackedCheck::releases`]) as one entry: the
    /// first's keys and shape, and every lease id (`@<id> <id>…`, see `lua/batch.lua`), in
    /// ascending order, the list's own (`lua/leases.lua`): when they are its first leases, as
    /// they mostly are, the script ends them all by comparing one text.
    pub(super) fn joined<'a>(
        &'a self,
        others: impl Iterator<Item = &'a PackedCheck>,
    ) -> PackedCheck {
        // Sorted by number, written from their text (a sort of the texts compared about 250
        // instructions' worth per id; formatting the numbers anew, about 100).
        let mut ids: Vec<(u64, &str)> = std::iter::once(self)
            .chain(others)
            .filter_map(|release| match release.merging {
                // (A release's receipt is `@<id>`.)
                Merging::Releases(id) => Some((id, release.receipt().get(1..).unwrap_or_default())),
                _ => None,
            })
            .collect();
        ids.sort_unstable_by_key(|&(id, _)| id);
        let head = &self.data[..self.receipt_at];
        let mut data = String::with_capacity(
            head.len() + ids.iter().map(|(_, id)| id.len() + 1).sum::<usize>(),
        );
        data.push_str(head);
        for (index, (_, id)) in ids.iter().enumerate() {
            data.push(if index == 0 { '@' } else { ' ' });
            data.push_str(id);
        }
        PackedCheck {
            data,
            ends: self.ends.clone(),
            limits: RuleLimits::new(),
            receipt_at: self.receipt_at,
            merging: Merging::Releases(ids.first().map_or(0, |&(id, _)| id)),
        }
    }

    /// What makes two give-backs the same but for how many there are: their keys, shape and
    /// receipt (where each key ends: [`PackedCheck::same_keys`]).
    pub(super) fn identity(&self) -> (&str, &str) {
        self.data.split_at(self.receipt_at)
    }

    /// What rides with its shape's number (see [`PackedCheck::receipt_at`]).
    fn receipt(&self) -> &str {
        &self.data[self.receipt_at..]
    }

    /// Whether `other`, of the same [`identity`](PackedCheck::identity), splits it into the same
    /// keys.
    pub(super) fn same_keys(&self, other: &PackedCheck) -> bool {
        self.ends == other.ends
    }

    /// This give-back `times` over: its cost and units multiplied, the rest as it is. None when
    /// it can't add up (see [`PackedCheck::adds_up`]) or its units would pass 2^53, which the
    /// script's numbers (doubles) no longer count exactly.
    pub(super) fn times(&self, times: u64) -> Option<PackedCheck> {
        const EXACT: u64 = 1 << 53;
        let Merging::AddsUp(range) = self.merging.clone() else {
            return None;
        };
        let piece = &self.data[range.clone()];
        let mut parts = piece.splitn(3, ':');
        let cost: u64 = parts.next()?.parse().ok()?;
        let mut number = itoa::Buffer::new();
        let mut data = String::with_capacity(self.data.len() + 16);
        data.push_str(&self.data[..range.start]);
        let times_over = |value: u64| value.checked_mul(times).filter(|&value| value <= EXACT);
        data.push_str(number.format(times_over(cost)?));
        if let (Some(units), Some(flags)) = (parts.next(), parts.next()) {
            let units: u64 = units.parse().ok()?;
            data.push(':');
            data.push_str(number.format(times_over(units)?));
            data.push(':');
            data.push_str(flags);
        }
        let cost_end = data.len();
        data.push_str(&self.data[range.end..]);
        // The cost piece lies in the shape, after the keys and before the receipt.
        let receipt_at = self.receipt_at - range.end + cost_end;
        Some(PackedCheck {
            data,
            ends: self.ends.clone(),
            limits: self.limits.clone(),
            receipt_at,
            merging: Merging::AddsUp(range.start..cost_end),
        })
    }

    /// Ends the key written into `data` since the last one.
    fn end_key(&mut self) {
        self.ends.push(self.data.len());
    }

    /// Its keys, in order.
    pub(super) fn keys(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(self.ends.iter().copied())
            .map(|(start, end)| &self.data.as_bytes()[start..end])
    }

    /// Its shape (see [`PackedCheck`]).
    fn shape(&self) -> &str {
        &self.data[self.ends.last().copied().unwrap_or(0)..self.receipt_at]
    }

    pub(super) fn key_count(&self) -> usize {
        self.ends.len()
    }

    /// The bytes it adds to a batch's command.
    pub(super) fn len(&self) -> usize {
        self.data.len()
    }
}

/// Appends the receipt of a give-back of `request` for the admission answered `charged` (see
/// [`PackedCheck::receipt_at`]): when it was checked and its delay, then per counted rule the
/// full time of its token bucket (0 when the store didn't say: nothing goes back to that rule).
fn write_receipt(
    receipt: &mut String,
    request: &CheckRequest<'_>,
    charged: &crate::decision::Decision,
) {
    let delay_ms = u64::try_from(charged.delay.as_millis()).unwrap_or(u64::MAX);
    let mut number = itoa::Buffer::new();
    receipt.push('@');
    receipt.push_str(number.format(charged.now_unix_ms));
    receipt.push(',');
    receipt.push_str(number.format(delay_ms));
    if request.algorithm == Algorithm::TokenBucket {
        let states = request.rules.iter().zip(&charged.rules);
        for (_, state) in states.filter(|(rule, _)| !rule.is_duplicate_guard()) {
            receipt.push(',');
            receipt.push_str(number.format(state.bucket_full_at_us.unwrap_or(0)));
        }
        // A budget shared fairly's, after the rules' (its state the second last).
        if request.fair.is_some() {
            let budget = charged.rules.len().checked_sub(2);
            let full_at = budget.and_then(|at| charged.rules.get(at));
            receipt.push(',');
            receipt.push_str(
                number.format(
                    full_at
                        .and_then(|state| state.bucket_full_at_us)
                        .unwrap_or(0),
                ),
            );
        }
    }
}

/// Appends the key of `request`'s concurrency leases: a list of lease ids in expiry order
/// (`lua/leases.lua`).
fn write_leases_key(key: &mut String, request: &CheckRequest<'_>) {
    OwnKeys::of(request).write(key, &["leases"]);
}

/// Appends the key of `request`'s reset marker: when its identity was last reset
/// (`lua/reset.lua`), which a give-back of an earlier admission reads (`lua/entry.lua`).
pub(super) fn write_reset_marker(key: &mut String, request: &CheckRequest<'_>) {
    OwnKeys::of(request).write(key, &["reset"]);
}

/// The batch script's code of an algorithm (see `lua/batch.lua`).
pub(super) fn algorithm_code(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingLog => "sl",
        Algorithm::SlidingCounter => "sc",
        Algorithm::TokenBucket => "tb",
    }
}

/// `<FCALL function | EVALSHA sha> <keys> <every check's keys> <time> <shape count> <shapes>
/// <per check: its shape's number>` (see `lua/batch.lua`): one call that runs `checks` in order.
/// Checks of one shape (one policy, one cost) share it, sent once. `invocation`: the command and
/// the function's name or the script's hash. `time`: a fixed time (µs) for tests, or none (Redis
/// TIME).
pub(super) fn batch_command<'a>(
    (verb, name): (&str, &str),
    checks: impl Iterator<Item = &'a PackedCheck> + Clone,
    fixed_time_us: Option<u64>,
) -> Cmd {
    // A batch holds few shapes (about one per policy), so a linear search finds them.
    let mut shapes: Vec<&str> = Vec::new();
    let mut shape_numbers = Vec::new();
    let (mut keys, mut bytes) = (0, 0);
    for check in checks.clone() {
        let shape = check.shape();
        let number = match shapes.iter().position(|known| *known == shape) {
            Some(index) => index + 1,
            None => {
                shapes.push(shape);
                shapes.len()
            }
        };
        shape_numbers.push((number, check.receipt()));
        keys += check.key_count();
        bytes += check.data.len() + 4;
    }
    let mut command = Cmd::with_capacity(
        5 + keys + shapes.len() + shape_numbers.len(),
        name.len() + 48 + bytes,
    );
    command.arg(verb).arg(name).arg(keys);
    for check in checks {
        for key in check.keys() {
            command.arg(key);
        }
    }
    match fixed_time_us {
        Some(time) => command.arg(time),
        None => command.arg(""),
    };
    command.arg(shapes.len());
    for shape in shapes {
        command.arg(shape);
    }
    // One buffer for every entry with a receipt (an argument is copied into the command).
    let mut entry = Vec::new();
    for (number, receipt) in shape_numbers {
        if receipt.is_empty() {
            command.arg(number);
        } else {
            // A give-back's receipt, a release's lease or a claim rides with its shape's number
            // (see lua/batch.lua).
            entry.clear();
            entry.extend_from_slice(itoa::Buffer::new().format(number).as_bytes());
            entry.extend_from_slice(receipt.as_bytes());
            command.arg(&entry[..]);
        }
    }
    command
}

/// The key of one counted rule:
/// `<prefix>:{<identity>}:<policy>:<algorithm>:<period ms>:<limit>`. Every key starts with the
/// prefix, so `SCAN MATCH <prefix>:*` finds them all; the identity is the hash tag (see
/// [`write_key`]); a counter per algorithm, period, limit (and `m` for a metered rule) gives every rule of a policy its own
/// key (a policy can't hold the same rule twice) and keeps rule sets that share a key apart, as in
/// the memory store. A token bucket's burst is not part of it: its state (the time the bucket is
/// full again) means the same whatever the burst, so a new burst keeps the count.
/// `counted_as` is the limit the key names: the rule's own, or for a run-time override's rule
/// the limit of the policy's rule whose counter it shares (`CheckRequest::counted_as`).
fn write_rule_key(
    own: &mut OwnKeys<'_>,
    key: &mut String,
    algorithm: Algorithm,
    rule: &Rule,
    counted_as: u64,
) {
    with_rule_key_parts(algorithm, rule, counted_as, |parts| own.write(key, parts));
}

/// The end of a counted rule's key after its stem, `:<algorithm>:<period ms>:<limit>[:m]` (see
/// [`write_rule_key`]).
pub(super) fn rule_counter(algorithm: Algorithm, rule: &Rule, counted_as: u64) -> String {
    let mut counter = String::new();
    with_rule_key_parts(algorithm, rule, counted_as, |parts| {
        write_parts(&mut counter, parts);
    });
    counter
}

/// The parts of a counted rule's key after its stem, handed to `write`.
fn with_rule_key_parts(
    algorithm: Algorithm,
    rule: &Rule,
    counted_as: u64,
    write: impl FnOnce(&[&str]),
) {
    let (mut period, mut limit) = (itoa::Buffer::new(), itoa::Buffer::new());
    let parts = [
        algorithm_code(algorithm),
        period.format(rule.period_ms()),
        limit.format(counted_as),
    ];
    // A metered rule counts apart from a rule of requests of the same limit and period.
    let parts = if rule.is_metered() {
        &[parts[0], parts[1], parts[2], "m"][..]
    } else {
        &parts[..]
    };
    write(parts);
}

/// Writes the keys of one check's identity (its counters, guard, leases, block, reset marker,
/// claims): their stem, `<prefix>:{<identity>}:<name>` (see [`write_key`]), is found and written
/// once, and copied for each later key, rather than taken apart again per key.
struct OwnKeys<'a> {
    base: &'a str,
    identity: &'a str,
    /// Under a budget shared fairly, its tag (see [`FairTag`]).
    fair: Option<FairTag<'a>>,
    /// Where the first key's stem lies in the packing, once written.
    stem: Option<std::ops::Range<usize>>,
}

impl<'a> OwnKeys<'a> {
    fn of(request: &CheckRequest<'a>) -> Self {
        OwnKeys {
            base: request.key,
            identity: request.identity,
            fair: request.shared_budget().map(FairTag::of),
            stem: None,
        }
    }

    /// Appends the key of `parts` to `key` (the packing the stem was first written into).
    fn write(&mut self, key: &mut String, parts: &[&str]) {
        match &self.stem {
            Some(stem) => key.extend_from_within(stem.clone()),
            None => {
                let start = key.len();
                match &self.fair {
                    Some(tag) => tag.write_tenant(key, self.base, &[]),
                    None => write_stem(key, self.base, self.identity),
                }
                self.stem = Some(start..key.len());
            }
        }
        write_parts(key, parts);
    }
}

/// Appends the store key of `parts` under `base` (a policy's or a quota's key,
/// `<prefix>:<name>:<identity>`) to `key`:
/// `<prefix>:{<identity>}:<name>:<part>:<part>…`. The identity is the hash tag, so every key of one
/// identity (every rule of every policy, and a quota keyed the same way) lands on one Redis
/// Cluster slot. A `base` that doesn't end with `identity` is the tag whole:
/// `<prefix>:{<base>}:<part>…`.
pub(super) fn write_key(key: &mut String, base: &str, identity: &str, parts: &[&str]) {
    write_stem(key, base, identity);
    write_parts(key, parts);
}

/// Appends the stem of [`write_key`]'s key: `<prefix>:{<identity>}:<name>`, or `<prefix>:{<base>}`.
fn write_stem(key: &mut String, base: &str, identity: &str) {
    // A prefix can't contain ':' (policies refuse it), so the key's first part is the prefix.
    let prefix = base.split_once(':').map_or(base, |(prefix, _)| prefix);
    let name = base
        .strip_suffix(identity)
        .and_then(|rest| rest.strip_suffix(':'))
        .and_then(|rest| rest.strip_prefix(prefix))
        .and_then(|rest| rest.strip_prefix(':'))
        .filter(|name| !name.is_empty() && !identity.is_empty());
    key.push_str(prefix);
    key.push_str(":{");
    match name {
        Some(name) => {
            key.push_str(identity);
            key.push_str("}:");
            key.push_str(name);
        }
        None => {
            key.push_str(base);
            key.push('}');
        }
    }
}

/// Appends `:<part>` for each of `parts`.
fn write_parts(key: &mut String, parts: &[&str]) {
    for part in parts {
        key.push(':');
        key.push_str(part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::policy::quota::QuotaThreshold;
    use crate::store::FairRequest;

    #[test]
    fn keys_share_the_identity_hash_tag_and_name_algorithm_and_period() {
        let rules = [Rule::per_minute(10), Rule::per_hour(100)];
        let request = CheckRequest::new("rl:login:ip:2001:db8::/64", &rules, Algorithm::SlidingLog)
            .identity("ip:2001:db8::/64");
        // The second key's stem is the first's, copied (`OwnKeys`).
        let keys: Vec<String> = PackedCheck::new(&request, false)
            .keys()
            .map(|key| String::from_utf8(key.to_vec()).unwrap())
            .collect();
        assert_eq!(
            keys,
            [
                "rl:{ip:2001:db8::/64}:login:sl:60000:10",
                "rl:{ip:2001:db8::/64}:login:sl:3600000:100"
            ]
        );
    }

    /// The batch command of `request` alone.
    fn command_of(hash: &str, request: &CheckRequest<'_>) -> Cmd {
        batch_command(
            ("EVALSHA", hash),
            std::iter::once(&PackedCheck::new(request, false)),
            None,
        )
    }

    fn args_of(command: &Cmd) -> Vec<String> {
        command
            .args_iter()
            .map(|arg| match arg {
                ::redis::Arg::Simple(bytes) => String::from_utf8(bytes.to_vec()).unwrap(),
                other => panic!("EVALSHA has only plain arguments, not {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_key_that_does_not_end_with_its_identity_is_its_own_tag() {
        let mut key = String::new();
        write_key(&mut key, "rl:api:global", "user:x", &["fw"]);
        assert_eq!(key, "rl:{rl:api:global}:fw");
        key.clear();
        write_key(
            &mut key,
            "rl:api:GETunmatched:ip:192.0.2.1",
            "ip:192.0.2.1",
            &["fw"],
        );
        assert_eq!(key, "rl:{ip:192.0.2.1}:api:GETunmatched:fw");
    }

    /// A give-back of a fixed window or sliding counter may stand for several alike: its cost and
    /// units multiplied, its keys, flags, options, rules and receipt unchanged. Others can't.
    #[test]
    fn a_give_back_that_adds_up_is_times_over_its_cost_and_units() {
        let rules = [Rule::per_second(2).metered(), Rule::per_minute(30)];
        let charged = crate::decision::Decision {
            allowed: true,
            rules: Vec::new(),
            now_unix_ms: 5_000,
            delay: Duration::ZERO,
            quota_alerts: Vec::new(),
            lease: None,
            run_time_override: None,
        };
        let request = CheckRequest::new("rl:api:global", &rules, Algorithm::FixedWindow)
            .cost(3)
            .units(500);
        let packed = PackedCheck::new(&request.giving_back(&charged), false);
        assert!(packed.adds_up());
        assert_eq!(
            packed.shape(),
            "fw|3|3:500:mr|0,0,0,0,0,0,0,0,3|2|1000|30|60000"
        );
        let times = packed.times(4).expect("it adds up");
        assert_eq!(
            times.shape(),
            "fw|3|12:2000:mr|0,0,0,0,0,0,0,0,3|2|1000|30|60000"
        );
        assert_eq!(times.identity().1, "@5000,0");
        assert!(times.keys().eq(packed.keys()));
        assert!(
            packed.times(u64::MAX).is_none(),
            "a sum past u64 goes unmerged"
        );
        // Not a check, nor a token bucket's give-back (its receipts differ per request).
        assert!(!PackedCheck::new(&request, false).adds_up());
        let bucket = CheckRequest::new("rl:api:global", &rules, Algorithm::TokenBucket);
        assert!(!PackedCheck::new(&bucket.giving_back(&charged), false).adds_up());
    }

    #[test]
    fn one_check_carries_keys_cost_limits_and_periods() {
        let rules = [Rule::per_second(2), Rule::per_minute(30)];
        let request = CheckRequest::new("rl:api:global", &rules, Algorithm::FixedWindow).cost(3);
        let args = args_of(&command_of("abc123", &request));
        assert_eq!(
            args,
            [
                "EVALSHA",
                "abc123",
                "2",
                "rl:{rl:api:global}:fw:1000:2",
                "rl:{rl:api:global}:fw:60000:30",
                "",
                "1",
                "fw|2|3||2|1000|30|60000",
                "1"
            ]
        );
    }

    #[test]
    fn the_guard_and_the_block_are_keys_of_their_own_after_the_counters() {
        let policy = crate::Policy::builder("otp")
            .rule(Rule::per_minute(3).burst(5))
            .algorithm(Algorithm::TokenBucket)
            .prevent_duplicate(Duration::from_secs(5))
            .block_for(Duration::from_secs(900))
            .mode(crate::Mode::Delay {
                max_delay: Duration::from_secs(2),
            })
            .build()
            .unwrap();
        let request = CheckRequest::new("rl:otp:user:bob", policy.rules(), policy.algorithm())
            .max_delay(policy.mode().max_delay())
            .block_for(policy.block_for());
        let args = args_of(&command_of("abc", &request));
        assert_eq!(
            args,
            [
                "EVALSHA",
                "abc",
                "3",
                "rl:{rl:otp:user:bob}:tb:60000:3",
                "rl:{rl:otp:user:bob}:dup:5000",
                "rl:{rl:otp:user:bob}:block",
                "",
                "1",
                "tb|3|1|2000,5000,900000,0,0,0,0,0,0|3|60000|5",
                "1"
            ]
        );
    }

    #[test]
    fn the_quota_is_a_key_under_the_quota_identity_holding_its_alert_flags() {
        let rules = [Rule::per_minute(20)];
        let thresholds = [
            QuotaThreshold {
                percent: 80,
                used: 80,
            },
            QuotaThreshold {
                percent: 100,
                used: 100,
            },
        ];
        let quota = crate::store::QuotaRequest::new(
            "rl:daily:user:ann",
            100,
            86_400_000,
            61_200_000,
            &thresholds,
        )
        .identity("user:ann");
        // Keyed like the quota, the policy's keys share its hash tag (one Cluster slot).
        let request = CheckRequest::new("rl:api:user:ann", &rules, Algorithm::SlidingLog)
            .identity("user:ann")
            .quota(Some(quota));
        assert_eq!(
            args_of(&command_of("abc", &request)),
            [
                "EVALSHA",
                "abc",
                "2",
                "rl:{user:ann}:api:sl:60000:20",
                "rl:{user:ann}:daily:q:86400000:61200000",
                "",
                "1",
                // (A budget's six options, zero, before the alerts.)
                "sl|2|1|0,0,0,100,86400000,61200000,0,0,0,0,0,0,0,0,0,80,80,100,100|20|60000",
                "1"
            ]
        );
    }

    #[test]
    fn under_a_budget_shared_fairly_every_key_has_the_policys_tag_and_the_budgets_come_last() {
        let rules = [Rule::per_minute(20)];
        let budget = Rule::per_second(300);
        let quota = crate::store::QuotaRequest::new("rl:daily:user:ann", 100, 86_400_000, 0, &[])
            .identity("user:ann");
        let request = CheckRequest::new("rl:llm:user:ann", &rules, Algorithm::FixedWindow)
            .identity("user:ann")
            .quota(Some(quota))
            .fair(Some(FairRequest::new("rl:llm:fair", &budget).weight(2)));
        assert_eq!(
            args_of(&command_of("abc", &request)),
            [
                "EVALSHA",
                "abc",
                "5",
                "rl:{llm}:fair:t:llm:user:ann:fw:60000:20",
                "rl:{llm}:fair:t:daily:user:ann:q:86400000:0",
                "rl:{llm}:fair:budget:fw:1000:300",
                "rl:{llm}:fair:shares:fw:1000:300",
                "rl:{llm}:fair:s:user:ann",
                "",
                "1",
                "fw|5|1|0,0,0,100,86400000,0,0,0,0,300,1000,300,1,2,0|20|60000",
                "1"
            ]
        );
        // A reset deletes the tenant's keys alone, under the same tag; so does its override.
        let mut marker = String::new();
        write_reset_marker(&mut marker, &request);
        assert_eq!(marker, "rl:{llm}:fair:t:llm:user:ann:reset");
    }

    #[test]
    fn a_release_is_an_entry_of_the_batch_with_the_leases_key_alone() {
        let rules = [Rule::per_second(2)];
        let limit =
            crate::policy::concurrency_limit::ConcurrencyLimit::new(1, Duration::from_secs(60));
        let request = CheckRequest::new("rl:jobs:user:ann", &rules, Algorithm::FixedWindow)
            .identity("user:ann")
            .concurrency(Some(limit));
        let check = PackedCheck::new(&request, false);
        let release = PackedCheck::release(&request, 1_795_000_000_000_123);
        // The leases key the check takes its lease in.
        assert_eq!(
            release.keys().collect::<Vec<_>>(),
            [check.keys().last().unwrap()]
        );
        assert!(release.limits.is_empty(), "its entry names no rule");
        assert_eq!(
            args_of(&batch_command(
                ("FCALL", "f"),
                [&check, &release].into_iter(),
                None
            )),
            [
                "FCALL",
                "f",
                "3",
                "rl:{user:ann}:jobs:fw:1000:2",
                "rl:{user:ann}:jobs:leases",
                "rl:{user:ann}:jobs:leases",
                "",
                "2",
                "fw|2|1|0,0,0,0,0,0,1,60000,0|2|1000",
                "rl|1",
                "1",
                "2@1795000000000123"
            ]
        );
    }

    #[test]
    fn releases_of_one_key_join_as_one_entry_naming_every_lease() {
        let rules = [Rule::per_second(2)];
        let limit =
            crate::policy::concurrency_limit::ConcurrencyLimit::new(1, Duration::from_secs(60));
        let ann = CheckRequest::new("rl:jobs:user:ann", &rules, Algorithm::FixedWindow)
            .identity("user:ann")
            .concurrency(Some(limit));
        // (In the order their requests ended; joined in the list's, ascending.)
        let releases = [7_005, 700, 7_001].map(|lease| PackedCheck::release(&ann, lease));
        assert!(releases.iter().all(PackedCheck::releases));
        assert!(
            !PackedCheck::new(&ann, false).releases(),
            "a check is no release"
        );
        let joined = releases[0].joined(releases[1..].iter());
        assert!(joined.releases());
        assert_eq!(
            args_of(&batch_command(("FCALL", "f"), [&joined].into_iter(), None)),
            [
                "FCALL",
                "f",
                "1",
                "rl:{user:ann}:jobs:leases",
                "",
                "1",
                "rl|1",
                "1@700 7001 7005"
            ]
        );
    }

    #[test]
    fn checks_of_one_policy_and_cost_share_one_shape() {
        let rules = [Rule::per_second(2)];
        let ann = CheckRequest::new("rl:api:ann", &rules, Algorithm::FixedWindow);
        let bob = CheckRequest::new("rl:api:bob", &rules, Algorithm::FixedWindow);
        let costly = CheckRequest::new("rl:api:ann", &rules, Algorithm::FixedWindow).cost(2);
        let checks = [
            PackedCheck::new(&ann, false),
            PackedCheck::new(&costly, false),
            PackedCheck::new(&bob, false),
        ];
        assert_eq!(
            args_of(&batch_command(("FCALL", "f"), checks.iter(), Some(7))),
            [
                "FCALL",
                "f",
                "3",
                "rl:{rl:api:ann}:fw:1000:2",
                "rl:{rl:api:ann}:fw:1000:2",
                "rl:{rl:api:bob}:fw:1000:2",
                "7",
                "2",
                "fw|1|1||2|1000",
                "fw|1|2||2|1000",
                "1",
                "2",
                "1"
            ]
        );
    }
}
