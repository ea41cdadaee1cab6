//! [`LimitHeaders`]: the rate-limit headers of one decision (`RateLimit-Policy`, `RateLimit` and
//! the legacy `X-RateLimit-*` trio), put together from the limiter's [`AnswerPlan`].

use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use super::AnswerPlan;
use crate::decision::{Decision, ceil_secs};
use crate::headers::{self, RuleEntry};
use crate::policy::Policy;

/// The rate-limit headers of one decision, built before the inner service runs and added to its
/// response.
#[derive(Debug, Clone)]
pub(crate) struct LimitHeaders {
    policy: HeaderValue,
    status: HeaderValue,
    /// Boxed: only `legacy_headers` layers send them, and every admission carries this.
    legacy: Option<Box<Legacy>>,
}

#[derive(Debug, Clone)]
struct Legacy {
    limit: HeaderValue,
    remaining: u64,
    reset_unix_secs: HeaderValue,
}

impl LimitHeaders {
    pub(crate) fn new(
        plan: &AnswerPlan,
        policy: &Policy,
        decision: &Decision,
        legacy: bool,
    ) -> Self {
        // A quota's state follows the rules' when the request had one, then the concurrency
        // limit's when the policy has one.
        let with_quota = policy.quota().is_some()
            && decision.rules.len() > policy.rules().len() + policy.states_after_quota();
        // A budget shared fairly: its share, last, is described while it binds (less than the
        // budget) as the identity's own limit.
        let share = plan
            .has_fair_share()
            .then(|| decision.rules.len().checked_sub(2))
            .flatten()
            .and_then(|budget| {
                let (budget, share) =
                    (decision.rules.get(budget)?, decision.rules.get(budget + 1)?);
                Some(share.limit).filter(|&share| share < budget.limit)
            });
        let shown = decision.rules.len()
            - usize::from(plan.has_fair_share() && share.is_none() && !decision.rules.is_empty());
        let items = plan
            .state_names(with_quota)
            .zip(&decision.rules)
            .take(shown)
            .map(|(name, state)| RuleEntry {
                name,
                remaining: state.remaining,
                reset_secs: ceil_secs(state.reset),
            });
        let legacy = legacy
            .then(|| legacy_rule(policy, decision))
            .flatten()
            .map(|index| {
                let state = &decision.rules[index];
                let now = Duration::from_millis(decision.now_unix_ms);
                Box::new(Legacy {
                    limit: HeaderValue::from(state.limit),
                    remaining: state.remaining,
                    reset_unix_secs: HeaderValue::from(ceil_secs(now + state.reset)),
                })
            });
        let mut policy_header = match decision.rules.get(policy.rules().len()) {
            Some(quota) if with_quota => plan.policy_with_quota(quota.limit),
            // Static bytes (see `interned.rs`): a clone writes nothing shared.
            _ => plan.policy().clone(),
        };
        if let Some(share) = share {
            policy_header = plan.with_share(&policy_header, share);
        }
        let status = match decision.allowed {
            true => headers::ratelimit_header_value(items),
            // A flood's refusals repeat their value: this thread's last one may be it.
            false => super::recent::ratelimit_value(
                plan,
                with_quota,
                items.clone().map(|item| (item.remaining, item.reset_secs)),
                || headers::ratelimit_header_value(items),
            ),
        };
        LimitHeaders {
            policy: policy_header,
            status,
            legacy,
        }
    }

    /// Adds the headers. `RateLimit-Policy` and `RateLimit` are lists, so nested limiters append
    /// their items; the single-rule legacy headers keep whichever limiter has less remaining.
    pub(crate) fn apply(self, map: &mut HeaderMap) {
        map.append(headers::RATELIMIT_POLICY, self.policy);
        map.append(headers::RATELIMIT, self.status);
        if let Some(legacy) = self.legacy {
            let existing = map
                .get(headers::X_RATELIMIT_REMAINING)
                .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
            if existing.is_none_or(|remaining| legacy.remaining < remaining) {
                map.insert(headers::X_RATELIMIT_LIMIT, legacy.limit);
                map.insert(
                    headers::X_RATELIMIT_REMAINING,
                    HeaderValue::from(legacy.remaining),
                );
                map.insert(headers::X_RATELIMIT_RESET, legacy.reset_unix_secs);
            }
        }
    }
}

/// The rule the single-rule legacy headers describe: the one closest to running out, leaving out
/// the duplicate guard (one request per few seconds would show on every response) unless it is
/// what refused the request.
fn legacy_rule(policy: &Policy, decision: &Decision) -> Option<usize> {
    let rules = policy.rules();
    let guard_refused = rules
        .iter()
        .zip(&decision.rules)
        .any(|(rule, state)| rule.is_duplicate_guard() && state.refused());
    let counted = rules.iter().any(|rule| !rule.is_duplicate_guard());
    if guard_refused || !counted {
        return decision.most_limiting();
    }
    decision.most_limiting_among(|index| {
        rules
            .get(index)
            .is_none_or(|rule| !rule.is_duplicate_guard())
    })
}
