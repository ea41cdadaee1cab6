//! [`FairShare`]: a budget shared fairly, as a policy holds it (its guide: `src/fair.rs`).

use std::fmt;
use std::sync::Arc;

use http::request::Parts;

use super::Rule;

/// A tenant's weight from its request.
type WeightFn = Arc<dyn Fn(&Parts) -> u32 + Send + Sync>;

/// One budget shared fairly by the identities of a policy's key: see [`fair`](crate::fair).
#[derive(Clone)]
pub struct FairShare {
    budget: Rule,
    weight: Option<WeightFn>,
}

impl FairShare {
    /// A budget of `budget` (its limit per its period, metered or not), counted across every
    /// identity of the policy, shared fairly once saturated; each identity weighs 1.
    #[must_use]
    pub fn new(budget: Rule) -> Self {
        FairShare {
            budget,
            weight: None,
        }
    }

    /// Each request's identity weighs what `weight` says (at least 1: 0 counts as 1), for
    /// example by plan: its share is in proportion. An identity's weight is the one its latest
    /// request gave.
    #[must_use]
    pub fn weight_from_fn<F>(mut self, weight: F) -> FairShare
    where
        F: Fn(&Parts) -> u32 + Send + Sync + 'static,
    {
        self.weight = Some(Arc::new(weight));
        self
    }

    /// The shared budget.
    pub(crate) fn budget(&self) -> &Rule {
        &self.budget
    }

    /// The same, its budget's period longer by `margin` (see `Rule::widened`).
    pub(crate) fn widened(&self, margin: std::time::Duration) -> FairShare {
        FairShare {
            budget: self.budget.widened(margin),
            weight: self.weight.clone(),
        }
    }

    /// The weight of the identity of the request of `parts` (1 without `weight_from_fn`).
    pub(crate) fn weight(&self, parts: &Parts) -> u32 {
        self.weight
            .as_ref()
            .map_or(1, |weight| weight(parts).max(1))
    }
}

impl fmt::Debug for FairShare {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairShare")
            .field("budget", &self.budget)
            .field("weighted", &self.weight.is_some())
            .finish()
    }
}
