//! [`FairRequest`]: what a check of a policy with a budget shared fairly asks of the store
//! beyond its identity's own limits (see [`fair`](crate::fair)).

use super::CheckRequest;
use crate::policy::Rule;

/// The budget a request's identity shares fairly with the others of its policy (see
/// [`fair`](crate::fair)): counted under its own key across every identity, and, while it is
/// saturated, the identity ([`CheckRequest::identity`]) admitted up to its weighted share.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct FairRequest<'a> {
    /// The budget's key (`prefix:policy:fair`): braces-free, as the rules' keys are.
    pub key: &'a str,
    /// The budget: its limit per its period, counted with the request's algorithm.
    pub budget: &'a Rule,
    /// The identity's weight (at least 1).
    pub weight: u32,
    /// Whose share the request is of, when not its identity's ([`CheckRequest::identity`]): the
    /// outbound layer's checks are keyed by upstream, and name the caller here.
    pub tenant: Option<&'a str>,
}

impl<'a> FairRequest<'a> {
    /// The budget `budget` under `key`, for an identity of weight 1.
    pub fn new(key: &'a str, budget: &'a Rule) -> Self {
        FairRequest {
            key,
            budget,
            weight: 1,
            tenant: None,
        }
    }

    /// Counts the request in the share of `tenant` rather than its identity's.
    #[must_use]
    pub fn tenant(mut self, tenant: Option<&'a str>) -> Self {
        self.tenant = tenant;
        self
    }

    /// Sets the identity's weight (0 counts as 1).
    #[must_use]
    pub fn weight(mut self, weight: u32) -> Self {
        self.weight = weight.max(1);
        self
    }

    /// Whose share `request` is of: its tenant's, or its identity's.
    pub(crate) fn tenant_of(&self, request: &CheckRequest<'a>) -> &'a str {
        self.tenant.unwrap_or(request.identity)
    }

    /// What the request costs the budget: its units when the budget is metered.
    pub(crate) fn cost_of(&self, request: &CheckRequest<'_>) -> u64 {
        if self.budget.is_metered() {
            request.units
        } else {
            request.cost
        }
    }
}
