//! Overrides set at run time ([`RateLimiter::set_override`](crate::RateLimiter::set_override)),
//! as a store keeps them: a book per policy, which every limiter of that policy over the store
//! reads before its check. The memory store keeps its books themselves; a limiter finds a
//! policy's book once, when it is made, so a policy without run-time overrides pays one atomic
//! read per request for them.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ipnet::IpNet;

use crate::policy::{Rule, StoredAction, StoredOverride, Whom};

/// What time it is for a book: the store's clock, in ms since the Unix epoch.
pub(crate) type Now = Arc<dyn Fn() -> u64 + Send + Sync>;

/// One policy's overrides set at run time, by whom they are for.
#[doc(hidden)]
pub struct OverrideBook {
    /// How many are set (expired ones included until they are swept): 0 skips every lookup.
    set: AtomicUsize,
    /// How many times one was set or removed here: a copy read before a change made here is
    /// not put in its place ([`OverrideBook::replace`]).
    changes: AtomicUsize,
    now: Now,
    table: RwLock<Table>,
}

/// The overrides of a book: identities and addresses by a map (no scan), networks in the order
/// they were set.
#[derive(Default)]
struct Table {
    by_identity: HashMap<String, Kept>,
    by_address: HashMap<IpAddr, Kept>,
    by_network: Vec<(IpNet, Kept)>,
    /// The size at which the next `set` sweeps out the overrides that have ended (so that
    /// sweeping costs a set O(1) on average).
    sweep_at: usize,
}

/// An override in a book, and until when it lasts (ms; `None`: until removed).
#[derive(Clone)]
struct Kept {
    over: Arc<StoredOverride>,
    until_ms: Option<u64>,
}

/// An override as a book lists it: what it is, and how long it has left.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct Listed {
    pub(crate) over: Arc<StoredOverride>,
    pub(crate) left: Option<Duration>,
}

impl Kept {
    fn live(&self, now: u64) -> bool {
        self.until_ms.is_none_or(|until| until > now)
    }
}

impl OverrideBook {
    /// An empty book, on the clock `now`.
    pub(crate) fn new(now: Now) -> Self {
        OverrideBook {
            set: AtomicUsize::new(0),
            changes: AtomicUsize::new(0),
            now,
            table: RwLock::default(),
        }
    }

    /// Whether none is set: then a request looks nothing up.
    pub(crate) fn is_empty(&self) -> bool {
        self.set.load(Ordering::Relaxed) == 0
    }

    /// The override of the identity `identity` (as store keys hold it), or of the client address
    /// `address`, if one is set and lasts.
    pub(crate) fn find_exact(
        &self,
        identity: &str,
        address: impl FnOnce() -> Option<IpAddr>,
    ) -> Option<Arc<StoredOverride>> {
        let table = self.read();
        let now = (self.now)();
        let kept = table.by_identity.get(identity).or_else(|| {
            if table.by_address.is_empty() {
                return None;
            }
            table.by_address.get(&address()?)
        })?;
        kept.live(now).then(|| kept.over.clone())
    }

    /// The override of the first network set that holds `address`, if any lasts.
    pub(crate) fn find_network(
        &self,
        address: impl FnOnce() -> Option<IpAddr>,
    ) -> Option<Arc<StoredOverride>> {
        let table = self.read();
        if table.by_network.is_empty() {
            return None;
        }
        let now = (self.now)();
        let address = address()?;
        table
            .by_network
            .iter()
            .find(|(network, kept)| kept.live(now) && network.contains(&address))
            .map(|(_, kept)| kept.over.clone())
    }

    /// Whether any network override is set (then a request's client address is looked up).
    pub(crate) fn has_networks(&self) -> bool {
        !self.read().by_network.is_empty()
    }

    /// Sets `over`, in place of one for the same target, lasting `lasting` (`None`: until
    /// removed).
    pub(crate) fn set(&self, over: StoredOverride, lasting: Option<Duration>) {
        let now = (self.now)();
        let until_ms = lasting.map(|lasting| {
            now.saturating_add(u64::try_from(lasting.as_millis()).unwrap_or(u64::MAX))
        });
        let mut table = self.write();
        if table.len() >= table.sweep_at {
            table.sweep(now);
            table.sweep_at = (2 * table.len()).max(1024);
        }
        let kept = Kept {
            until_ms,
            over: Arc::new(over),
        };
        match kept.over.whom().clone() {
            Whom::Identity(identity) => {
                table.by_identity.insert(identity, kept);
            }
            Whom::Address(address) => {
                table.by_address.insert(address, kept);
            }
            Whom::Network(network) => {
                match table.by_network.iter_mut().find(|(set, _)| *set == network) {
                    Some(entry) => entry.1 = kept,
                    None => table.by_network.push((network, kept)),
                }
            }
        }
        self.set.store(table.len(), Ordering::Relaxed);
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// Removes the override of `whom`; whether one was set.
    pub(crate) fn remove(&self, whom: &Whom) -> bool {
        let mut table = self.write();
        let removed = match whom {
            Whom::Identity(identity) => table.by_identity.remove(identity).is_some(),
            Whom::Address(address) => table.by_address.remove(address).is_some(),
            Whom::Network(network) => {
                let before = table.by_network.len();
                table.by_network.retain(|(set, _)| set != network);
                table.by_network.len() != before
            }
        };
        self.set.store(table.len(), Ordering::Relaxed);
        self.changes.fetch_add(1, Ordering::Relaxed);
        removed
    }

    /// How many changes were made here so far: what [`OverrideBook::replace`] is given.
    #[cfg_attr(
        not(feature = "redis"),
        allow(dead_code, reason = "only the Redis store keeps copies")
    )]
    pub(crate) fn changes(&self) -> usize {
        self.changes.load(Ordering::Relaxed)
    }

    /// Holds `listed` (as a store listed them, each with the time it had left) in place of
    /// every override it held: a copy of what a store keeps elsewhere, read when this book had
    /// seen `changes` ([`OverrideBook::changes`]). `false`, holding nothing new, when a change
    /// was made here since: the read may have missed it, and must be made again.
    #[cfg_attr(
        not(feature = "redis"),
        allow(dead_code, reason = "only the Redis store keeps copies")
    )]
    pub(crate) fn replace(&self, listed: Vec<Listed>, changes: usize) -> bool {
        let now = (self.now)();
        let mut table = Table::default();
        for listed in listed {
            let kept = Kept {
                until_ms: listed.left.map(|left| {
                    now.saturating_add(u64::try_from(left.as_millis()).unwrap_or(u64::MAX))
                }),
                over: listed.over,
            };
            match kept.over.whom().clone() {
                Whom::Identity(identity) => {
                    table.by_identity.insert(identity, kept);
                }
                Whom::Address(address) => {
                    table.by_address.insert(address, kept);
                }
                Whom::Network(network) => table.by_network.push((network, kept)),
            }
        }
        table.sweep_at = (2 * table.len()).max(1024);
        let mut held = self.write();
        // (Changes are counted under the lock: one made here after the read is seen.)
        if self.changes.load(Ordering::Relaxed) != changes {
            return false;
        }
        *held = table;
        self.set.store(held.len(), Ordering::Relaxed);
        true
    }

    /// Every override that lasts, with the time it has left.
    pub(crate) fn list(&self) -> Vec<Listed> {
        let now = (self.now)();
        let mut table = self.write();
        table.sweep(now);
        self.set.store(table.len(), Ordering::Relaxed);
        let listed = |kept: &Kept| Listed {
            over: kept.over.clone(),
            left: kept
                .until_ms
                .map(|until| Duration::from_millis(until.saturating_sub(now))),
        };
        let mut all: Vec<Listed> = table
            .by_identity
            .values()
            .chain(table.by_address.values())
            .map(listed)
            .collect();
        all.sort_by_key(|listed| listed.over.whom().shown());
        all.extend(table.by_network.iter().map(|(_, kept)| listed(kept)));
        all
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        self.table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Table> {
        self.table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Table {
    fn len(&self) -> usize {
        self.by_identity.len() + self.by_address.len() + self.by_network.len()
    }

    /// Drops the overrides that have ended.
    fn sweep(&mut self, now: u64) {
        self.by_identity.retain(|_, kept| kept.live(now));
        self.by_address.retain(|_, kept| kept.live(now));
        self.by_network.retain(|(_, kept)| kept.live(now));
    }
}

impl Listed {
    /// Whom the override is for, as the logs show it.
    pub(crate) fn whom(&self) -> &Whom {
        self.over.whom()
    }

    /// What it does.
    pub(crate) fn action(&self) -> &StoredAction {
        self.over.action()
    }

    /// How long it has left (`None`: until removed).
    pub(crate) fn left(&self) -> Option<Duration> {
        self.left
    }
}

impl std::fmt::Debug for OverrideBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OverrideBook")
            .field("set", &self.set.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// An override's action as a store keeps it in text (the Redis store, after the script's own
/// line, `lua/overrides.lua`): `d` (deny), `u` (unlimited) or `r`, then a line per rule,
/// `<limit> <period ms> <burst> <m|r>[ <name>]` (`m`: metered; the name, printable ASCII, last,
/// only when one was given).
#[cfg_attr(
    not(feature = "redis"),
    allow(dead_code, reason = "only the Redis store writes it")
)]
pub(crate) fn action_text(action: &StoredAction) -> String {
    let rules = match action {
        StoredAction::Deny => return "d".to_owned(),
        StoredAction::Unlimited => return "u".to_owned(),
        StoredAction::Rules(rules) => rules,
    };
    let mut text = String::from("r");
    for rule in rules {
        let metered = if rule.is_metered() { 'm' } else { 'r' };
        text.push_str(&format!(
            "\n{} {} {} {metered}",
            rule.limit(),
            rule.period_ms(),
            rule.burst_size()
        ));
        let name = rule.name();
        if name != Rule::new(rule.limit(), rule.period()).name() {
            text.push(' ');
            text.push_str(&name);
        }
    }
    text
}

/// The action [`action_text`] wrote, if `text` is one.
pub(crate) fn action_of_text(text: &str) -> Option<StoredAction> {
    let mut lines = text.split('\n');
    let rules = match lines.next()? {
        "d" => return Some(StoredAction::Deny),
        "u" => return Some(StoredAction::Unlimited),
        "r" => lines,
        _ => return None,
    };
    rules
        .map(|line| {
            let mut fields = line.splitn(5, ' ');
            let limit = fields.next()?.parse().ok()?;
            let period = Duration::from_millis(fields.next()?.parse().ok()?);
            let burst: u64 = fields.next()?.parse().ok()?;
            let mut rule = Rule::new(limit, period);
            if burst != limit {
                rule = rule.burst(burst);
            }
            match fields.next()? {
                "m" => rule = rule.metered(),
                "r" => {}
                _ => return None,
            }
            if let Some(name) = fields.next() {
                rule = rule.named(name.to_owned());
            }
            Some(rule)
        })
        .collect::<Option<Vec<_>>>()
        .map(StoredAction::Rules)
}

impl crate::decision::AppliedOverride {
    /// The limits the counters of its rules are kept under, as its store line names them (the
    /// Redis store's, `r|<code>|<n>|<flags>|<params>…|<counter>…`, each counter
    /// `<algorithm>:<period>:<limit>[:m]`); `None` for deny and unlimited, or text no crate
    /// wrote.
    pub(crate) fn counted_as(&self) -> Option<Vec<u64>> {
        let (line, _) = self.0.split_once('\n')?;
        let mut pieces = line.split('|');
        let (what, code, count) = (pieces.next()?, pieces.next()?, pieces.next()?);
        let count: usize = count.parse().ok()?;
        if what != "r" {
            return None;
        }
        let arity = if code == "tb" { 3 } else { 2 };
        let counters: Vec<&str> = pieces.skip(1 + arity * count).collect();
        if counters.len() != count {
            return None;
        }
        counters
            .iter()
            .map(|counter| counter.split(':').nth(2)?.parse().ok())
            .collect()
    }

    /// What the override does, read from what the store kept (its first line is the store's
    /// own); `None` for text no crate wrote.
    pub(crate) fn action(&self) -> Option<StoredAction> {
        let (_, kept) = self.0.split_once('\n')?;
        action_of_text(kept)
    }
}
