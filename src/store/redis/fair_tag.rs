//! The keys of a budget shared fairly and of its checks on Redis (see `lua/fair.lua`): every
//! key of such a check has the policy's hash tag, so one budget's tenants live on one Cluster
//! slot and its checks stay one call.

/// How many keys a budget shared fairly adds to a check: its counter, its shares and the
/// tenant's field among them (see `lua/fair.lua`).
pub(super) const FAIR_KEYS: usize = 3;

/// The hash tag of a budget shared fairly and of every key of its checks (its policy's name, as
/// its index of run-time overrides has): one budget's tenants live on one Cluster slot, so its
/// checks stay one call. Its keys are `<prefix>:{<policy>}:fair:budget:<algorithm>:<period
/// ms>:<limit>[:m]`, its shares `…:fair:shares:<the same>`, and a tenant's field among them `…:fair:s:<identity>`; a
/// tenant's own keys are `<prefix>:{<policy>}:fair:t:<its key after the prefix>:<part>…`.
#[derive(Clone, Copy)]
pub(super) struct FairTag<'a> {
    prefix: &'a str,
    policy: &'a str,
}

impl<'a> FairTag<'a> {
    /// The tag of the budget whose key is `fair_key` (`<prefix>:<policy>:fair`).
    pub(super) fn of(fair_key: &'a str) -> Self {
        let base = fair_key.strip_suffix(":fair").unwrap_or(fair_key);
        let (prefix, policy) = base.split_once(':').unwrap_or((base, ""));
        FairTag { prefix, policy }
    }

    /// Appends `<prefix>:{<policy>}:fair:<what>` and `:<part>` for each of `parts` to `key`.
    pub(super) fn write(&self, key: &mut String, what: &str, parts: &[&str]) {
        key.push_str(self.prefix);
        key.push_str(":{");
        key.push_str(self.policy);
        key.push_str("}:fair:");
        key.push_str(what);
        push_parts(key, parts);
    }

    /// Appends the key of `parts` under `base` (a tenant's, or its quota's, `<prefix>:<name>:
    /// <identity>`) to `key`.
    pub(super) fn write_tenant(&self, key: &mut String, base: &str, parts: &[&str]) {
        let own = base.split_once(':').map_or(base, |(_, rest)| rest);
        self.write(key, "t", &[own]);
        push_parts(key, parts);
    }
}

/// Appends `:<part>` for each of `parts` (as the identities' keys have them).
fn push_parts(key: &mut String, parts: &[&str]) {
    for part in parts {
        key.push(':');
        key.push_str(part);
    }
}
