//! Give-backs of a batch that add up, and releases of one key's leases, go as one entry.
//!
//! Under load a hot key's batch carries the give-backs of the requests the previous batch
//! admitted (`count_only` responses that don't count, settles of a meter): the same keys, the
//! same cost and the same receipt, since those checks shared their batch's time. Where a
//! give-back's units simply come off counts (a fixed window's, a sliding counter's, a quota's;
//! each clamped at 0), k of them in a row leave what one of k times the units leaves, so the
//! batch sends one entry for them all and each is answered what it found, the same for all.
//! Likewise the releases of one identity's leases (a concurrency limit's requests that ended)
//! go as one entry naming every lease, which the script ends together (`lua/leases.lua`: those
//! at the head of the list, most often all of them, in one command); nobody reads a release's
//! answer. Moving a later one up to the first one's place in the batch is an order their
//! requests could have arrived in: none of them waits on the checks between.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use super::command::Member;
use super::command::PackedCheck;

/// A batch's entries once its give-backs that add up and its releases of one key are merged.
pub(super) struct Merged {
    /// Per entry, how many members it stands for and the check sent (the first give-back's, that
    /// many times over, or the releases' joined; None: the member's own, unchanged).
    entries: Vec<(usize, Option<PackedCheck>)>,
    /// Per member, in order, the index of its entry.
    entry_of: Vec<usize>,
    /// Per entry, the index of its first member.
    first: Vec<usize>,
}

impl Merged {
    /// `members`' entries, or None when no two of them merge (the common case, at no cost).
    pub(super) fn of(members: &[Member]) -> Option<Merged> {
        if members
            .iter()
            .filter(|member| merges(&member.check).is_some())
            .count()
            < 2
        {
            return None;
        }
        // foldhash, seeded per process as the memory store's table is, not SipHash: hashing a
        // give-back's hundred bytes of keys cost more than the rest of its merge.
        let mut seen: HashMap<(&str, &str), usize, RandomState> =
            HashMap::with_capacity_and_hasher(members.len(), RandomState::default());
        let mut entries: Vec<(usize, Option<PackedCheck>)> = Vec::with_capacity(members.len());
        let mut entry_of = Vec::with_capacity(members.len());
        let mut first: Vec<usize> = Vec::with_capacity(members.len());
        // The entry last merged into: a hot key's give-backs or releases mostly follow each
        // other, found without hashing their keys again.
        let mut last: Option<((&str, &str), usize)> = None;
        for (index, member) in members.iter().enumerate() {
            let check = &member.check;
            let identity = merges(check);
            if let Some(identity) = identity {
                let entry = match last {
                    Some((known, entry)) if known == identity => Some(entry),
                    _ => seen.get(&identity).copied(),
                };
                if let Some(entry) = entry
                    && members[first[entry]].check.same_keys(check)
                {
                    entries[entry].0 += 1;
                    entry_of.push(entry);
                    last = Some((identity, entry));
                    continue;
                }
                seen.insert(identity, entries.len());
                last = Some((identity, entries.len()));
            }
            entry_of.push(entries.len());
            first.push(index);
            entries.push((1, None));
        }
        if entries.len() == members.len() {
            return None;
        }
        for (entry, (count, sent)) in entries.iter_mut().enumerate() {
            if *count > 1 {
                let head = &members[first[entry]].check;
                *sent = Some(if head.releases() {
                    // Its members but the first, in order.
                    let others = entry_of
                        .iter()
                        .zip(members)
                        .skip(first[entry] + 1)
                        .filter(|(of, _)| **of == entry)
                        .map(|(_, member)| &member.check);
                    head.joined(others)
                } else {
                    // (A sum past what the script counts exactly: the batch goes unmerged.)
                    head.times(*count as u64)?
                });
            }
        }
        Some(Merged {
            entries,
            entry_of,
            first,
        })
    }

    /// The checks sent, in order.
    pub(super) fn checks<'a>(&'a self, members: &'a [Member]) -> Vec<&'a PackedCheck> {
        self.entries
            .iter()
            .zip(&self.first)
            .map(|((_, sent), &first)| sent.as_ref().unwrap_or(&members[first].check))
            .collect()
    }

    /// Per member, in order, its entry's index.
    pub(super) fn entry_of(&self) -> &[usize] {
        &self.entry_of
    }

    /// How many members entry `entry` stands for.
    pub(super) fn members_of(&self, entry: usize) -> usize {
        self.entries[entry].0
    }
}

/// What makes two members of a batch go as one entry, when they may: a give-back's keys, shape
/// and receipt (see [`PackedCheck::adds_up`]), or a release's keys and shape (the leases).
fn merges(check: &PackedCheck) -> Option<(&str, &str)> {
    if check.adds_up() {
        Some(check.identity())
    } else if check.releases() {
        Some((check.identity().0, ""))
    } else {
        None
    }
}
