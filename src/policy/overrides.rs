//! [`Override`]: identities or client networks that a policy treats apart: without a limit (an
//! allow list), refused outright (a deny list), or with rules of their own.

use std::collections::HashMap;
use std::net::IpAddr;

use http::request::Parts;
use ipnet::IpNet;

use crate::client_ip::ClientIp;
use crate::key::{Identity, Key};

use super::{Policy, Rule};

/// One exception to a policy's rules, for an identity or a client network; add it with
/// [`PolicyBuilder::overrides`](super::PolicyBuilder::overrides).
///
/// ```
/// use tower_redis_ratelimit::{policy::Override, Key, Policy, Rule};
///
/// let policy = Policy::builder("api")
///     .key(Key::user())
///     .rule(Rule::per_minute(10))
///     .overrides([
///         Override::identity("vip").unlimited(),
///         Override::identity("big").rules([Rule::per_minute(100)]),
///         Override::identity("evil").deny(),
///         Override::cidr("10.0.0.0/8".parse().unwrap()).rules([Rule::per_minute(1000)]),
///     ])
///     .build()
///     .unwrap();
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    target: Target,
    action: Action,
}

/// Whom an override is for, before it says what it does: [`Override::identity`] or
/// [`Override::cidr`].
#[derive(Debug, Clone, PartialEq)]
#[must_use = "say what the override does: .unlimited(), .deny() or .rules([...])"]
pub struct OverrideTarget(Target);

#[derive(Debug, Clone, PartialEq)]
enum Target {
    Identity(String),
    Cidr(IpNet),
}

#[derive(Debug, Clone, PartialEq)]
enum Action {
    Unlimited,
    Deny,
    Rules(Vec<Rule>),
}

impl Override {
    /// The requests whose key yields `identity`: a user id (`Key::user`), a header or query value
    /// (`Key::header`, `Key::query`: the value itself, which the logs only show hashed), a client
    /// address (`Key::ip`: `"203.0.113.7"`, matched against the client's own address whatever the
    /// IPv6 grouping), or for `Key::custom` the identity as its extractor writes it
    /// (`"tenant:acme"`).
    pub fn identity(identity: impl Into<String>) -> OverrideTarget {
        OverrideTarget(Target::Identity(identity.into()))
    }

    /// The requests whose client address (found by the policy's
    /// [`ClientIp`](crate::client_ip::ClientIp) settings) is in `network`, whatever the policy is keyed by.
    pub fn cidr(network: IpNet) -> OverrideTarget {
        OverrideTarget(Target::Cidr(network.trunc()))
    }
}

impl OverrideTarget {
    /// Let these requests through without counting them anywhere and without rate-limit headers.
    pub fn unlimited(self) -> Override {
        self.with(Action::Unlimited)
    }

    /// Refuse these requests with 403 Forbidden and a problem body, counting them nowhere.
    pub fn deny(self) -> Override {
        self.with(Action::Deny)
    }

    /// Count these requests by `rules` instead of the policy's (the rest of the policy, such as
    /// its algorithm, block, quota and concurrency limit, still applies). A rule the policy also
    /// has shares its count.
    pub fn rules(self, rules: impl IntoIterator<Item = Rule>) -> Override {
        self.with(Action::Rules(rules.into_iter().collect()))
    }

    fn with(self, action: Action) -> Override {
        Override {
            target: self.0,
            action,
        }
    }
}

/// An override set at run time, as a store keeps it: whom (as store keys hold it) and what it
/// does. Made by [`Override::stored`] once the policy has checked it.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq)]
pub struct StoredOverride {
    pub(crate) whom: Whom,
    pub(crate) action: StoredAction,
    /// The limits its rules' counters are kept under, as the store fixed them when it was set
    /// ([`StoredOverride::pinned_to`]; the Redis store names them in the override's value), so
    /// a reload of the policy doesn't move them; `None`: by the policy at each check.
    pub(crate) counted_as: Option<Box<[u64]>>,
}

/// Whom a stored override is for.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Whom {
    /// An identity as store keys hold it (`user:alice`, `header#…`).
    Identity(String),
    /// A client address (a policy keyed by client IP).
    Address(IpAddr),
    /// A client network.
    Network(IpNet),
}

/// What a stored override does.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum StoredAction {
    /// Let through, counted nowhere.
    Unlimited,
    /// Refused (403).
    Deny,
    /// Counted by these rules instead of the policy's.
    Rules(Vec<Rule>),
}

impl Whom {
    /// As the logs show it: the stored identity (an API key only as its hash), the address or
    /// the network.
    pub(crate) fn shown(&self) -> String {
        match self {
            Whom::Identity(identity) => identity.clone(),
            Whom::Address(address) => address.to_string(),
            Whom::Network(network) => network.to_string(),
        }
    }
}

impl Override {
    /// Whether it names an identity, and that identity is empty.
    pub(crate) fn names_empty_identity(&self) -> bool {
        matches!(&self.target, Target::Identity(identity) if identity.is_empty())
    }

    /// Whom this override is for as store keys hold it under a policy keyed by `key`, and what
    /// it does; an error says why it can't be (an empty identity, a non-address for
    /// [`Key::ip`], an identity under [`Key::global`], an empty rule list).
    pub(crate) fn stored(&self, key: &Key) -> Result<StoredOverride, String> {
        let whom = OverrideTarget(self.target.clone()).stored(key)?;
        let action = match &self.action {
            Action::Unlimited => StoredAction::Unlimited,
            Action::Deny => StoredAction::Deny,
            Action::Rules(rules) if rules.is_empty() => {
                return Err("rules must list at least one rule".to_owned());
            }
            Action::Rules(rules) => StoredAction::Rules(rules.clone()),
        };
        Ok(StoredOverride {
            whom,
            action,
            counted_as: None,
        })
    }
}

impl OverrideTarget {
    /// Whom this target names as store keys hold it under a policy keyed by `key`.
    pub(crate) fn stored(&self, key: &Key) -> Result<Whom, String> {
        Ok(match &self.0 {
            Target::Identity(identity) => match stored_identity(key, identity)? {
                Stored::Identity(text) => Whom::Identity(text),
                Stored::Address(address) => Whom::Address(address),
            },
            Target::Cidr(network) => Whom::Network(*network),
        })
    }

    /// Whether it names an identity, and that identity is empty.
    pub(crate) fn is_empty_identity(&self) -> bool {
        matches!(&self.0, Target::Identity(identity) if identity.is_empty())
    }
}

impl StoredOverride {
    /// Whom it is for.
    pub(crate) fn whom(&self) -> &Whom {
        &self.whom
    }

    /// What it does.
    pub(crate) fn action(&self) -> &StoredAction {
        &self.action
    }

    /// The limits its rules' counters are kept under, when the store fixed them.
    pub(crate) fn counted_as(&self) -> Option<&[u64]> {
        self.counted_as.as_deref()
    }

    /// This override with its rules' counters fixed as `policy` names them now (the policy's
    /// rule of the same period, see [`Policy::run_time_policy`]): where a store keeps them
    /// until the override ends, whatever a reload makes of the policy.
    pub(crate) fn pinned_to(mut self, policy: &super::Policy) -> Self {
        if let StoredAction::Rules(rules) = &self.action
            && let Ok(own) = policy.run_time_policy(rules, None)
        {
            let counted = own.counted_as().map_or_else(
                || rules.iter().map(super::Rule::limit).collect(),
                Box::<[u64]>::from,
            );
            self.counted_as = Some(counted);
        }
        self
    }
}

/// What a matching override makes of a request.
#[derive(Debug, Clone)]
pub(crate) enum Applied {
    Unlimited,
    Deny,
    /// The policy with the override's rules instead of its own.
    Rules(Policy),
}

/// A policy's overrides, ready to match requests.
#[derive(Debug, Clone, Default)]
pub(crate) struct Overrides {
    /// By the identity as store keys hold it (`user:vip`, `header#…`), to an index of `applied`.
    by_identity: HashMap<String, usize>,
    /// By client address: an `ip` key's identities, matched whatever the IPv6 grouping.
    by_address: HashMap<IpAddr, usize>,
    /// Client networks, in order.
    by_network: Vec<(IpNet, usize)>,
    applied: Vec<Applied>,
}

impl Overrides {
    /// Checks `overrides` for a policy keyed by `key`; `rules_policy` builds the policy of a
    /// `rules` override. An error is the override's index and why.
    pub(super) fn build(
        overrides: &[Override],
        key: &Key,
        mut rules_policy: impl FnMut(usize, &[Rule]) -> Result<Policy, String>,
    ) -> Result<Overrides, (usize, String)> {
        let mut built = Overrides::default();
        for (index, entry) in overrides.iter().enumerate() {
            match &entry.target {
                Target::Identity(identity) => {
                    let stored =
                        stored_identity(key, identity).map_err(|reason| (index, reason))?;
                    let first = match &stored {
                        Stored::Identity(text) => built.by_identity.get(text),
                        Stored::Address(address) => built.by_address.get(address),
                    };
                    if let Some(first) = first {
                        return Err((
                            index,
                            format!(
                                "identity {identity:?} is already overridden by overrides[{first}]"
                            ),
                        ));
                    }
                    match stored {
                        Stored::Identity(text) => built.by_identity.insert(text, index),
                        Stored::Address(address) => built.by_address.insert(address, index),
                    };
                }
                Target::Cidr(network) => built.by_network.push((*network, index)),
            }
            built.applied.push(match &entry.action {
                Action::Unlimited => Applied::Unlimited,
                Action::Deny => Applied::Deny,
                Action::Rules(rules) if rules.is_empty() => {
                    return Err((index, "rules must list at least one rule".to_owned()));
                }
                Action::Rules(rules) => {
                    Applied::Rules(rules_policy(index, rules).map_err(|reason| (index, reason))?)
                }
            });
        }
        Ok(built)
    }

    /// Whether there are none (then a request costs no lookup).
    pub(crate) fn is_empty(&self) -> bool {
        self.applied.is_empty()
    }

    /// The override of a request by its identity (or client address) alone.
    pub(crate) fn find_exact(
        &self,
        identity: &str,
        parts: Option<&Parts>,
        client_ip: &ClientIp,
    ) -> Option<(usize, &Applied)> {
        let index = self.by_identity.get(identity).copied().or_else(|| {
            if self.by_address.is_empty() {
                return None;
            }
            let address = client_ip.client_addr(parts?)?.to_canonical();
            self.by_address.get(&address).copied()
        })?;
        Some((index, &self.applied[index]))
    }

    /// The override of a request by the first network holding its client address.
    pub(crate) fn find_network(
        &self,
        parts: &Parts,
        client_ip: &ClientIp,
    ) -> Option<(usize, &Applied)> {
        if self.by_network.is_empty() {
            return None;
        }
        let address = client_ip.client_addr(parts)?.to_canonical();
        let index = self
            .by_network
            .iter()
            .find(|(network, _)| network.contains(&address))
            .map(|&(_, index)| index)?;
        Some((index, &self.applied[index]))
    }

    /// What each override does, in order.
    pub(crate) fn applied(&self) -> &[Applied] {
        &self.applied
    }

    /// Whether override `index` is a network's.
    pub(crate) fn is_network(&self, index: usize) -> bool {
        self.by_network.iter().any(|&(_, of)| of == index)
    }
}

/// How an override's identity is matched.
enum Stored {
    /// The identity as a store key holds it.
    Identity(String),
    /// A client address.
    Address(IpAddr),
}

/// The identity `key` yields for the value `identity`, as store keys hold it.
fn stored_identity(key: &Key, identity: &str) -> Result<Stored, String> {
    if identity.is_empty() {
        return Err("identity must not be empty".to_owned());
    }
    Ok(Stored::Identity(match key.kind() {
        "ip" => {
            let address: IpAddr = identity.parse().map_err(|_| {
                format!(
                    "identity {identity:?} is not an IP address (the policy is keyed by client \
                     IP; name a network with cidr)"
                )
            })?;
            return Ok(Stored::Address(address.to_canonical()));
        }
        "global" => {
            return Err(
                "the policy's key is global, one identity for every request: name client \
                 networks with cidr"
                    .to_owned(),
            );
        }
        "user" => Identity::new("user", identity).as_str().to_owned(),
        kind @ ("header" | "query") => Identity::secret(kind, identity.as_bytes())
            .as_str()
            .to_owned(),
        _ => identity.to_owned(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(_: usize, _: &[Rule]) -> Result<Policy, String> {
        Ok(Policy::builder("p")
            .rule(Rule::per_minute(1))
            .build()
            .unwrap())
    }

    #[test]
    fn identities_are_stored_as_their_key_writes_them() {
        let overrides = [
            Override::identity("vip").unlimited(),
            Override::identity("k").deny(),
        ];
        let user = Overrides::build(&overrides, &Key::user(), policy).unwrap();
        assert!(user.by_identity.contains_key("user:vip"));
        let header = Overrides::build(&overrides, &Key::header("x-api-key"), policy).unwrap();
        let hashed = Identity::secret("header", b"vip");
        assert!(header.by_identity.contains_key(hashed.as_str()));
        let mapped = [Override::identity("::ffff:10.1.2.3").deny()];
        let ip = Overrides::build(&mapped, &Key::ip(), policy).unwrap();
        let address: IpAddr = "10.1.2.3".parse().unwrap();
        assert!(ip.by_address.contains_key(&address) && ip.by_network.is_empty());
        let twice = [
            Override::identity("10.1.2.3").deny(),
            Override::identity("10.1.2.3").unlimited(),
        ];
        assert_eq!(
            Overrides::build(&twice, &Key::ip(), policy).unwrap_err().0,
            1
        );
    }

    #[test]
    fn bad_overrides_are_refused_with_their_index() {
        let twice = [
            Override::identity("a").deny(),
            Override::identity("a").unlimited(),
        ];
        let error = Overrides::build(&twice, &Key::user(), policy).unwrap_err();
        assert_eq!(
            error,
            (
                1,
                "identity \"a\" is already overridden by overrides[0]".to_owned()
            )
        );
        let not_an_address = [Override::identity("alice").deny()];
        assert_eq!(
            Overrides::build(&not_an_address, &Key::ip(), policy)
                .unwrap_err()
                .0,
            0
        );
        let global = [Override::identity("x").deny()];
        assert!(Overrides::build(&global, &Key::global(), policy).is_err());
        let no_rules = [Override::identity("x").rules([])];
        assert_eq!(
            Overrides::build(&no_rules, &Key::user(), policy).unwrap_err(),
            (0, "rules must list at least one rule".to_owned())
        );
    }
}
