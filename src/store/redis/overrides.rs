//! Overrides set at run time, as the Redis store keeps them: each identity's in a key beside its
//! counters, `<prefix>:{<identity>}:<policy>:override`, which a check reads in its own call
//! (`lua/overrides.lua`), and the policy's index of them (`lua/override_book.lua`), which lists
//! them and, on one node, is the gate a batch reads once per shape. Only identities (as the
//! policy's key stores them) are kept so: an address or a network would need the client's address
//! in the check, which the store is not sent.

use std::time::Duration;

use ::redis::Value;

use super::command::{algorithm_code, rule_counter, write_key};
use super::script::{OVERRIDE_BOOK, evalsha};
use crate::policy::{Policy, Rule, StoredAction, StoredOverride, Whom};
use crate::store::StoreError;
use crate::store::overrides::{Listed, action_of_text, action_text};

/// The ending of the shape of a check of `policy` that reads its identity's override
/// (`~<suffix>~<gate>`, see `lua/batch.lua`): how many characters end its first key after the
/// stem, and the index, the gate (none on a Cluster, where it lies in another slot).
pub(super) fn lookup_of(policy: &Policy, cluster: bool) -> Option<Box<str>> {
    let first = policy
        .rules()
        .iter()
        .find(|rule| !rule.is_duplicate_guard())?;
    let suffix = rule_counter(policy.algorithm(), first, first.limit()).len();
    let gate = if cluster {
        String::new()
    } else {
        index_keys(policy.key_base()).0
    };
    Some(format!("~{suffix}~{gate}").into())
}

/// The policy's index: when each override ends (a sorted set), and their values (a hash), both
/// under the policy's own hash tag: `<prefix>:{<policy>}:overrides`, `…:overrides:values`.
pub(super) fn index_keys(key_base: &str) -> (String, String) {
    let base = key_base.strip_suffix(':').unwrap_or(key_base);
    let (prefix, name) = base.split_once(':').unwrap_or((base, ""));
    let ends = format!("{prefix}:{{{name}}}:overrides");
    let values = format!("{ends}:values");
    (ends, values)
}

/// The key of `identity`'s override under the policy whose keys start with `key_base`.
fn override_key(key_base: &str, identity: &str) -> String {
    let mut key = String::new();
    write_key(
        &mut key,
        &format!("{key_base}{identity}"),
        identity,
        &["override"],
    );
    key
}

/// The identity an override of `whom` is kept under, or the error of one the store can't keep.
fn identity_of(whom: &Whom) -> Result<&str, StoreError> {
    match whom {
        Whom::Identity(identity) => Ok(identity),
        Whom::Address(_) | Whom::Network(_) => Err(StoreError::Config(
            "the Redis store keeps run-time overrides of identities only: an address or a \
             network needs the client's address in the check (set it in the policy instead)"
                .to_owned(),
        )),
    }
}

/// What the override key of `over` holds (see `lua/overrides.lua`): the script's line, then
/// what the crate reads back ([`action_text`]).
fn value_of(policy: &Policy, over: &StoredOverride) -> Result<String, StoreError> {
    let script = match over.action() {
        StoredAction::Deny => "d".to_owned(),
        StoredAction::Unlimited => "u".to_owned(),
        StoredAction::Rules(rules) => {
            let own = policy
                .run_time_policy(rules)
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
    key_base: &str,
    whom: &Whom,
    set: Option<(&Policy, &StoredOverride, Option<Duration>)>,
    cluster: bool,
) -> Result<Vec<::redis::Cmd>, StoreError> {
    let identity = identity_of(whom)?;
    let key = override_key(key_base, identity);
    let (ends, values) = index_keys(key_base);
    let (action, value, lasting) = match set {
        Some((policy, over, lasting)) => (
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
            .arg(identity)
            .arg(&value)
            .arg(&lasting);
        command
    };
    Ok(if cluster {
        vec![call("i", &[&ends, &values]), call("k", &[&key])]
    } else {
        vec![call("ki", &[&key, &ends, &values])]
    })
}

/// The `lua/override_book.lua` call that lists the policy's overrides.
pub(super) fn list_call(key_base: &str) -> ::redis::Cmd {
    let (ends, values) = index_keys(key_base);
    let mut command = evalsha(&OVERRIDE_BOOK);
    command.arg(2).arg(ends).arg(values).arg("i").arg("list");
    command.arg("").arg("").arg("");
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
    let mut listed = Vec::new();
    for entry in items.get(1..).unwrap_or_default().chunks(3) {
        let [identity, value, left] = entry else {
            return Err(malformed());
        };
        let (identity, value, left) = (
            text(identity).ok_or_else(malformed)?,
            text(value).ok_or_else(malformed)?,
            number(left).ok_or_else(malformed)?,
        );
        let Some(action) = value
            .split_once('\n')
            .and_then(|(_, kept)| action_of_text(kept))
        else {
            continue;
        };
        listed.push(Listed {
            over: std::sync::Arc::new(StoredOverride {
                whom: Whom::Identity(identity),
                action,
            }),
            left: u64::try_from(left).ok().map(Duration::from_millis),
        });
    }
    Ok(listed)
}
