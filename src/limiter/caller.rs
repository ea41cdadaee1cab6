//! [`Caller`]: whose share of a budget shared fairly an outgoing call is of. The outbound
//! layer's checks are keyed by upstream, so the caller (named by the policy's key on the
//! outgoing request) and its weight ride with each of the call's store requests: its check, its
//! claim's, and its reservation's settle.

use std::sync::Arc;

use crate::store::CheckRequest;

/// The caller of an outgoing call under a budget shared fairly.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    /// Its identity, as the policy's key names it (`-` when the key finds none).
    identity: Arc<str>,
    /// Its weight (at least 1).
    weight: u32,
}

impl Caller {
    /// The caller `identity`, of `weight`.
    pub(crate) fn new(identity: &str, weight: u32) -> Self {
        Caller {
            identity: identity.into(),
            weight: weight.max(1),
        }
    }

    /// `request` counted in the share of `caller`, if any (a give-back or an overdraw weighs
    /// nothing in the store: the tenant keeps the weight its latest check gave).
    pub(crate) fn applied<'a>(
        caller: Option<&'a Caller>,
        mut request: CheckRequest<'a>,
    ) -> CheckRequest<'a> {
        if let Some(caller) = caller {
            request.fair = request
                .fair
                .map(|fair| fair.tenant(Some(&caller.identity)).weight(caller.weight));
        }
        request
    }
}
