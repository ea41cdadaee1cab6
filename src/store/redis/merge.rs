//! Identical give-backs of a batch go as one entry, their units summed.
//!
//! Under load a hot key's batch carries the give-backs of the requests the previous batch
//! admitted (`count_only` responses that don't count, settles of a meter): the same keys, the
//! same cost and the same receipt, since those checks shared their batch's time. Where a
//! give-back's units simply come off counts (a fixed window's, a sliding counter's, a quota's;
//! each clamped at 0), k of them in a row leave what one of k times the units leaves, so the
//! batch sends one entry for them all and each is answered what it found, the same for all.
//! Moving a later one up to the first one's place in the batch is an order their requests could
//! have arrived in: none of them waits on the checks between.

use std::collections::HashMap;

use super::batch::Member;
use super::command::PackedCheck;

/// A batch's entries once its identical give-backs are merged.
pub(super) struct Merged {
    /// Per entry, how many identical give-backs it stands for and the check sent (the first's,
    /// that many times over; None: the member's own, unchanged).
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
            .filter(|member| member.check.adds_up())
            .count()
            < 2
        {
            return None;
        }
        let mut seen: HashMap<(&str, &str), usize> = HashMap::new();
        let mut entries: Vec<(usize, Option<PackedCheck>)> = Vec::with_capacity(members.len());
        let mut entry_of = Vec::with_capacity(members.len());
        let mut first: Vec<usize> = Vec::with_capacity(members.len());
        for (index, member) in members.iter().enumerate() {
            let check = &member.check;
            if check.adds_up()
                && let Some(&entry) = seen.get(&check.identity())
                && members[first[entry]].check.same_keys(check)
            {
                entries[entry].0 += 1;
                entry_of.push(entry);
                continue;
            }
            if check.adds_up() {
                seen.insert(check.identity(), entries.len());
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
                // (A sum past what the script counts exactly: the batch goes unmerged.)
                *sent = Some(members[first[entry]].check.times(*count as u64)?);
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
