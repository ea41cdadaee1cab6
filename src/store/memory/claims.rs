//! Claims of metered calls waiting for room, in memory: the counterpart of `lua/claims.lua` (see
//! [`Claim`]). A check that carries one fits only if the room left holds the units of the live
//! claims made before it (every live claim when it has none yet) and its own; refused, it leaves
//! its claim; admitted, it takes it away.

use std::collections::HashMap;

use super::{MemoryStore, lock};
use crate::decision::Decision;
use crate::store::{CheckRequest, Claim};

/// The live claims, by key, each key's in the order they were made. Few at a time (calls waiting
/// for room), so a key's are a list.
#[derive(Default)]
pub(super) struct Claims {
    by_key: HashMap<Box<str>, Vec<Held>>,
    /// When the claims of every key are next swept for expired ones (a key whose calls all gave
    /// up is not asked again to drop them).
    next_sweep_ms: u64,
}

/// One claim: its id, the units it waits for, and when it ends (ms).
struct Held {
    id: u64,
    units: u64,
    expires_ms: u64,
}

impl Claims {
    /// The units of the live claims of `key` ahead of claim `id` (all of them when `id` has
    /// none), and whether `id` has one; expired claims go.
    fn ahead(&mut self, key: &str, id: u64, now: u64) -> (u64, bool) {
        if now >= self.next_sweep_ms {
            self.by_key.retain(|_, held| {
                held.retain(|claim| claim.expires_ms > now);
                !held.is_empty()
            });
            self.next_sweep_ms = now.saturating_add(super::SWEEP_INTERVAL_MS);
        }
        let Some(held) = self.by_key.get_mut(key) else {
            return (0, false);
        };
        held.retain(|claim| claim.expires_ms > now);
        let mut ahead = 0u64;
        for claim in held.iter() {
            if claim.id == id {
                return (ahead, true);
            }
            ahead = ahead.saturating_add(claim.units);
        }
        if held.is_empty() {
            self.by_key.remove(key);
        }
        (ahead, false)
    }

    /// Makes claim `id` of `units`, after every claim of `key` made before.
    fn make(&mut self, key: &str, id: u64, units: u64, expires_ms: u64) {
        let held = Held {
            id,
            units,
            expires_ms,
        };
        match self.by_key.get_mut(key) {
            Some(claims) => claims.push(held),
            None => {
                self.by_key.insert(key.into(), vec![held]);
            }
        }
    }

    /// Whether no key holds a live or expired claim (tests).
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Takes claim `id` of `key` away.
    fn take(&mut self, key: &str, id: u64) {
        if let Some(held) = self.by_key.get_mut(key) {
            held.retain(|claim| claim.id != id);
            if held.is_empty() {
                self.by_key.remove(key);
            }
        }
    }
}

impl MemoryStore {
    /// Checks `request`, which carries `claim`: the claims are locked over the whole check, so
    /// two claimed checks of a key are one after the other, as the script's are.
    pub(super) fn check_claimed(&self, request: &CheckRequest<'_>, claim: Claim) -> Decision {
        let mut claims = lock(&self.0.claims);
        let now = self.0.clock.now_unix_ms();
        let (ahead, mine) = claims.ahead(request.key, claim.id, now);
        let unclaimed = CheckRequest {
            claim: None,
            ..*request
        };
        if claim.lasting_ms == 0 {
            claims.take(request.key, claim.id);
            return self.check_now(&unclaimed.peeking());
        }
        let make = |claims: &mut Claims| {
            if !mine {
                let expires_ms = now.saturating_add(claim.lasting_ms);
                // (Only metered units wait: lua/claims.lua.)
                let units = if request.is_metered() {
                    request.units
                } else {
                    0
                };
                claims.make(request.key, claim.id, units, expires_ms);
            }
        };
        if ahead > 0 {
            let with_theirs = CheckRequest {
                past_burst: true,
                ..unclaimed
                    .peeking()
                    .units(request.units.saturating_add(ahead))
            };
            let peeked = self.check_now(&with_theirs);
            if !peeked.allowed {
                make(&mut claims);
                return peeked;
            }
        }
        let decision = self.check_now(&unclaimed);
        if decision.allowed {
            claims.take(request.key, claim.id);
        } else {
            make(&mut claims);
        }
        decision
    }
}
