//! Overrides set at run time, as the Redis store keeps them: each identity's in a key beside its
//! counters, `<prefix>:{<identity>}:<policy>:override`, which a check reads in its own call
//! (`lua/overrides.lua`), and the policy's index of them (`lua/override_book.lua`), which lists
//! them and, on one node, is the gate a batch reads once per shape, holding the networks (an
//! address is a network of one). A check of a policy keyed by client address on one node
//! matches its identity against them in the same call; otherwise (a policy keyed by something
//! else sends no address, and on a Cluster the index lies in another slot than a check's keys)
//! each instance keeps a copy of them (`override_mirror.rs`), and a check carries the override
//! of the network its client's address falls in.

use std::time::Duration;

use ::redis::Value;
use ipnet::IpNet;

use super::command::{algorithm_code, rule_counter, write_key};
use super::fair_tag::FairTag;
use super::script::{OVERRIDE_BOOK, evalsha};
use crate::policy::{Policy, Rule, StoredAction, StoredOverride, Whom};
use crate::store::StoreError;
use crate::store::overrides::{Listed, action_of_text, action_text};

/// The ending of the shape of a check of `policy` that reads its identity's override
/// (`~<suffix>[n|a]~<gate>`, see `lua/batch.lua`): how many characters end its first key after
/// the stem; whether its identity is a client address, which addresses and networks set may hold
/// (`n`), or addresses only (`a`: `networks` false, for an identity the policy overrides itself);
/// and the index's
/// networks, the gate (none on a Cluster, where the index lies in another slot).
pub(super) fn lookup_of(policy: &Policy, networks: bool, cluster: bool) -> Option<Box<str>> {
    let first = policy
        .rules()
        .iter()
        .find(|rule| !rule.is_duplicate_guard())?;
    let suffix = rule_counter(policy.algorithm(), first, first.limit()).len();
    if cluster {
        return Some(format!("~{suffix}~").into());
    }
    let by_network = match (networks_in_call(policy, false), networks) {
        (true, true) => "n",
        (true, false) => "a",
        (false, _) => "",
    };
    let [.., networks] = index_keys(policy.key_base());
    Some(format!("~{suffix}{by_network}~{networks}").into())
}

/// The policy's index, under its own hash tag: when each override ends (a sorted set,
/// `<prefix>:{<policy>}:overrides`), the identities' values (`…:values`) and the networks
/// (`…:networks`, the gate).
pub(super) fn index_keys(key_base: &str) -> [String; 3] {
    let base = key_base.strip_suffix(':').unwrap_or(key_base);
    let (prefix, name) = base.split_once(':').unwrap_or((base, ""));
    let ends = format!("{prefix}:{{{name}}}:overrides");
    let values = format!("{ends}:values");
    let networks = format!("{ends}:networks");
    [ends, values, networks]
}

/// The key of `identity`'s override under the policy whose keys start with `key_base`, beside
/// the identity's counters (under the tag of the budget it shares fairly, `fair_key`, if any).
fn override_key(key_base: &str, identity: &str, fair_key: Option<&str>) -> String {
    let mut key = String::new();
    let base = format!("{key_base}{identity}");
    match fair_key {
        Some(fair_key) => FairTag::of(fair_key).write_tenant(&mut key, &base, &["override"]),
        None => write_key(&mut key, &base, identity, &["override"]),
    }
    key
}

/// Where an override is kept: an identity's key, or the index's networks.
enum Kept {
    Identity(String),
    Network(IpNet),
}

/// Where an override of `whom` is kept.
fn kept_of(whom: &Whom) -> Kept {
    match whom {
        Whom::Identity(identity) => Kept::Identity(identity.clone()),
        Whom::Address(address) => Kept::Network(IpNet::from(*address)),
        Whom::Network(network) => Kept::Network(*network),
    }
}

/// Whether a check of `policy` matches its client's address against the networks set in its
/// own call (keyed by client address, on one node, its keys tagged by the identity: not under a
/// budget shared fairly); if not, the instance keeps a copy of them.
pub(super) fn networks_in_call(policy: &Policy, cluster: bool) -> bool {
    policy.key().is_ip() && !cluster && policy.fair_share().is_none()
}

/// The ending of the shape of a check of `policy` whose client's address or network has `over`
/// set, found in the instance's copy: the identity's own override, or else `over`'s, which it
/// carries (`~<suffix>c<length>~<gate><value>`, the value last: a gate may hold `~`).
pub(super) fn carrying_lookup_of(
    policy: &Policy,
    over: &StoredOverride,
    cluster: bool,
) -> Option<Box<str>> {
    let lookup = lookup_of(policy, false, cluster)?;
    let value = value_of(policy, over).ok()?;
    // (`~<suffix>` holds no other `~`.)
    let gate_at = 1 + lookup[1..].find('~')?;
    let (head, gate) = lookup.split_at(gate_at);
    Some(format!("{head}c{}{gate}{value}", value.len()).into())
}

/// What the override key of `over` holds (see `lua/overrides.lua`): the script's line, then
/// what the crate reads back ([`action_text`]).
fn value_of(policy: &Policy, over: &StoredOverride) -> Result<String, StoreError> {
    let script = match over.action() {
        StoredAction::Deny => "d".to_owned(),
        StoredAction::Unlimited => "u".to_owned(),
        StoredAction::Rules(rules) => {
            // (Counted where the store fixed it when it was set, if it did: see `listed_of`.)
            let own = policy
                .run_time_policy(rules, over.counted_as())
                .map_err(|error| StoreError::Config(error.to_string()))?;
            if policy
                .rules()
                .iter()
                .chain(own.rules())
                .any(Rule::is_duplicate_guard)
            {
                return Err(StoreError::Config(
                    "the Redis store can't keep a run-time override of a policy with a \
                     duplicate guard"
                        .to_owned(),
                ));
            }
            let algorithm = own.algorithm();
            let counted = own.rules();
            let mut script = format!("r|{}|{}|", algorithm_code(algorithm), counted.len());
            script.extend(
                counted
                    .iter()
                    .map(|rule| if rule.is_metered() { 'm' } else { 'r' }),
            );
            for rule in counted {
                script.push_str(&format!("|{}|{}", rule.limit(), rule.period_ms()));
                if algorithm == crate::policy::Algorithm::TokenBucket {
                    script.push_str(&format!("|{}", rule.burst_size()));
                }
            }
            for (index, rule) in counted.iter().enumerate() {
                let counted_as = own
                    .counted_as()
                    .and_then(|limits| limits.get(index).copied())
                    .unwrap_or_else(|| rule.limit());
                script.push('|');
                // (Without its leading ':', which the script puts back.)
                script.push_str(&rule_counter(algorithm, rule, counted_as)[1..]);
            }
            script
        }
    };
    Ok(format!("{script}\n{}", action_text(over.action())))
}

/// The `lua/override_book.lua` call(s) that set or remove the override of `identity`: one on one
/// node; on a Cluster, one for its key and one for the index, which lie in different slots.
pub(super) fn book_calls(
    policy: &Policy,
    whom: &Whom,
    set: Option<(&StoredOverride, Option<Duration>)>,
    cluster: bool,
) -> Result<Vec<::redis::Cmd>, StoreError> {
    let key_base = policy.key_base();
    let [ends, values, networks] = index_keys(key_base);
    let (target, key) = match kept_of(whom) {
        Kept::Identity(identity) => {
            let fair_key = policy.fair_share().map(|fairness| &*fairness.key);
            let key = override_key(key_base, &identity, fair_key);
            (identity, Some(key))
        }
        Kept::Network(network) => (format!("net:{network}"), None),
    };
    // The identity's key as a check names it: the notice every instance hears.
    let checked = format!("{key_base}{target}");
    let (action, value, lasting) = match set {
        Some((over, lasting)) => (
            "set",
            value_of(policy, over)?,
            lasting.map_or(String::new(), |lasting| {
                lasting.as_millis().max(1).to_string()
            }),
        ),
        None => ("remove", String::new(), String::new()),
    };
    let call = |which: &str, keys: &[&str]| {
        let mut command = evalsha(&OVERRIDE_BOOK);
        command.arg(keys.len());
        for key in keys {
            command.arg(*key);
        }
        command
            .arg(which)
            .arg(action)
            .arg(&target)
            .arg(&value)
            .arg(&lasting)
            .arg(&checked);
        command
    };
    let index = [ends.as_str(), values.as_str(), networks.as_str()];
    Ok(match key {
        None => vec![call("i", &index)],
        Some(key) if cluster => vec![call("i", &index), call("k", &[&key])],
        Some(key) => vec![call("ki", &[&key, &ends, &values, &networks])],
    })
}

/// The `lua/override_book.lua` call that lists the policy's overrides.
pub(super) fn list_call(key_base: &str) -> ::redis::Cmd {
    index_call(key_base, "list")
}

/// The `lua/override_book.lua` call that lists the policy's networks and addresses only.
pub(super) fn networks_call(key_base: &str) -> ::redis::Cmd {
    index_call(key_base, "networks")
}

/// A `lua/override_book.lua` call that reads the policy's index.
fn index_call(key_base: &str, action: &str) -> ::redis::Cmd {
    let [ends, values, networks] = index_keys(key_base);
    let mut command = evalsha(&OVERRIDE_BOOK);
    command
        .arg(3)
        .arg(ends)
        .arg(values)
        .arg(networks)
        .arg("i")
        .arg(action);
    command.arg("").arg("").arg("").arg("");
    command
}

/// The overrides a list call answered.
pub(super) fn listed_of(reply: Value) -> Result<Vec<Listed>, StoreError> {
    let malformed = || StoreError::Protocol("an unreadable list of run-time overrides".to_owned());
    let Value::Array(items) = reply else {
        return Err(malformed());
    };
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    let number = |value: &Value| match value {
        Value::Int(number) => Some(*number),
        _ => None,
    };
    // Identities and addresses by their text, then networks in the order they were set (as the
    // memory store lists them).
    let (mut exact, mut networks) = (Vec::new(), Vec::new());
    for entry in items.get(1..).unwrap_or_default().chunks(3) {
        let [target, value, left] = entry else {
            return Err(malformed());
        };
        let (target, value, left) = (
            text(target).ok_or_else(malformed)?,
            text(value).ok_or_else(malformed)?,
            number(left).ok_or_else(malformed)?,
        );
        let network = target
            .strip_prefix("net:")
            .and_then(|network| network.parse::<IpNet>().ok());
        // A network's value starts with `<order> <end>`.
        let (order, value) = match network {
            Some(_) => {
                let (head, value) = value.split_once('\n').ok_or_else(malformed)?;
                let order: u64 = head
                    .split(' ')
                    .next()
                    .and_then(|order| order.parse().ok())
                    .ok_or_else(malformed)?;
                (order, value)
            }
            None => (0, value.as_str()),
        };
        let Some(action) = value
            .split_once('\n')
            .and_then(|(_, kept)| action_of_text(kept))
        else {
            continue;
        };
        // The counters its value names, fixed when it was set: an instance's copy carries the
        // override as it was set, whatever its own policy's rules are now.
        let counted_as = crate::decision::AppliedOverride(value.into())
            .counted_as()
            .map(Into::into);
        let whom = match network {
            Some(network) if network.prefix_len() == network.max_prefix_len() => {
                Whom::Address(network.addr())
            }
            Some(network) => Whom::Network(network),
            None => Whom::Identity(target),
        };
        let listed = Listed {
            over: std::sync::Arc::new(StoredOverride {
                whom,
                action,
                counted_as,
            }),
            left: u64::try_from(left).ok().map(Duration::from_millis),
        };
        match listed.whom() {
            Whom::Network(_) => networks.push((order, listed)),
            _ => exact.push(listed),
        }
    }
    exact.sort_by_key(|listed| listed.whom().shown());
    networks.sort_by_key(|(order, _)| *order);
    exact.extend(networks.into_iter().map(|(_, listed)| listed));
    Ok(exact)
}
