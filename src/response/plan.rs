//! [`AnswerPlan`]: what a limiter prepares once from its policy to answer requests, so that the
//! wire side, not the policy, knows how answers are written: the rule names as header items, the
//! `RateLimit-Policy` values and the 429 bodies of one-state refusals.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;

use super::interned::{static_bytes, static_header};
use super::refusal_body;
use crate::decision::ceil_secs;
use crate::headers::{self, PolicyItem, SfName};
use crate::policy::meter::Meter;
use crate::policy::{Policy, Rule, StateOf};

/// Prepared once per limiter (and rebuilt with it); cheap to clone into a [`TooManyRequests`](super::TooManyRequests).
#[derive(Debug, Clone)]
pub(crate) struct AnswerPlan(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// The rules' names as sf-strings, in rule order.
    rule_names: Box<[SfName]>,
    /// The daily quota's name as an sf-string, its window (the day) in whole seconds, and its
    /// unit when it is metered.
    quota: Option<(SfName, u64, Option<Box<str>>)>,
    /// The concurrency limit's name as an sf-string and its `RateLimit-Policy` item
    /// (`"1-in-flight";q=1`).
    concurrency: Option<(SfName, Box<str>)>,
    /// A budget shared fairly: its name and its share's as sf-strings, the budget's
    /// `RateLimit-Policy` item, and its window in whole seconds (the share's item, whose quota
    /// is the identity's, is made per answer while it binds).
    fair: Option<Fair>,
    /// `RateLimit-Policy` of the rules alone.
    rules_policy: HeaderValue,
    /// `RateLimit-Policy` of a request without a quota: the rules' items, then the concurrency
    /// limit's.
    policy: HeaderValue,
    /// `RateLimit-Policy` of a request of each quota tier, by its limit: made once, not per
    /// request.
    quota_policies: Box<[(u64, HeaderValue)]>,
    /// The 429 body of a refusal by one state alone: each rule, then the quota, then the
    /// concurrency limit. The common refusal is answered without serialising anything.
    bodies: Box<[Bytes]>,
}

/// What a plan prepares of a budget shared fairly.
#[derive(Debug)]
struct Fair {
    budget_name: SfName,
    share_name: SfName,
    budget_item: Box<str>,
    window_secs: u64,
}

impl AnswerPlan {
    /// The plan of `policy`'s answers.
    pub(crate) fn new(policy: &Policy) -> Self {
        let rule_names: Box<[SfName]> = policy
            .rule_names()
            .iter()
            .map(|name| SfName::of_checked(name))
            .collect();
        let items: Vec<PolicyItem<'_>> = policy
            .rules()
            .iter()
            .zip(&rule_names)
            .map(|(rule, name)| PolicyItem {
                name,
                quota: rule.limit(),
                window_secs: ceil_secs(rule.period()),
            })
            .collect();
        let unit = policy.meter().map(Meter::unit);
        let rules_policy = match unit {
            // A metered rule says its unit in the draft's quota-unit parameter.
            Some(unit) if policy.rules().iter().any(Rule::is_metered) => {
                let each = items.iter().zip(policy.rules()).map(|(item, rule)| {
                    let value = headers::policy_header_value(&[*item]);
                    let mut item = value.to_str().unwrap_or_default().to_owned();
                    if rule.is_metered() {
                        with_unit(&mut item, unit);
                    }
                    item
                });
                let each: Vec<String> = each.collect();
                HeaderValue::from_str(&each.join(", "))
                    .unwrap_or_else(|_| headers::policy_header_value(&items))
            }
            _ => headers::policy_header_value(&items),
        };
        let concurrency = policy.concurrency().map(|limit| {
            let name = SfName::of_checked(&limit.name());
            let item = format!("{};q={}", name.as_str(), limit.max_in_flight());
            (name, item.into_boxed_str())
        });
        let fair = policy.fair_share().map(|fairness| {
            let budget = fairness.fair.budget();
            let budget_name = SfName::of_checked(&fairness.budget_name);
            let window_secs = ceil_secs(budget.period());
            let mut budget_item = headers::policy_header_value(&[PolicyItem {
                name: &budget_name,
                quota: budget.limit(),
                window_secs,
            }])
            .to_str()
            .unwrap_or_default()
            .to_owned();
            if let Some(unit) = unit.filter(|_| budget.is_metered()) {
                with_unit(&mut budget_item, unit);
            }
            Fair {
                share_name: SfName::of_checked(&fairness.share_name),
                budget_name,
                budget_item: budget_item.into(),
                window_secs,
            }
        });
        let after_quota = concurrency
            .iter()
            .map(|(_, item)| &**item)
            .chain(fair.iter().map(|fair| &*fair.budget_item));
        let policy_value = joined(&rules_policy, after_quota);
        let quota = policy.quota().map(|quota| {
            let unit = unit.filter(|_| quota.is_metered()).map(Box::from);
            (
                SfName::of_checked(quota.name()),
                ceil_secs(quota.day()),
                unit,
            )
        });
        let states = policy.rules().len()
            + usize::from(policy.quota().is_some())
            + policy.states_after_quota();
        let bodies = (0..states)
            .filter_map(|index| policy.state_name(index, states))
            .map(|name| static_bytes(refusal_body(policy.message(), &[name])))
            .collect();
        let mut inner = Inner {
            rule_names,
            quota,
            concurrency,
            fair,
            rules_policy: static_header(&rules_policy),
            policy: static_header(&policy_value),
            quota_policies: Box::default(),
            bodies,
        };
        if let Some(quota) = policy.quota() {
            inner.quota_policies = quota
                .tier_limits()
                .map(|limit| (limit, static_header(&inner.policy_with_quota(limit))))
                .collect();
        }
        AnswerPlan(Arc::new(inner))
    }

    /// The ready body of a refusal by the state at `index` alone, of a decision of `states`.
    pub(super) fn body(&self, policy: &Policy, index: usize, states: usize) -> Option<&Bytes> {
        let rules = policy.rules().len();
        let at = match policy.state_of(index, states) {
            StateOf::Rule(index) => index,
            StateOf::Quota => rules,
            StateOf::Concurrency => rules + usize::from(policy.quota().is_some()),
            StateOf::Budget | StateOf::Share => {
                let before = rules
                    + usize::from(policy.quota().is_some())
                    + usize::from(policy.concurrency().is_some());
                before + usize::from(matches!(policy.state_of(index, states), StateOf::Share))
            }
        };
        self.0.bodies.get(at)
    }

    /// Whether this is `other` (the same build): the same state names.
    pub(super) fn same_as(&self, other: &AnswerPlan) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// `RateLimit-Policy` of the rules alone.
    pub(super) fn rules_policy(&self) -> &HeaderValue {
        &self.0.rules_policy
    }

    /// `RateLimit-Policy` of a request without a quota.
    pub(super) fn policy(&self) -> &HeaderValue {
        &self.0.policy
    }

    /// The names of a decision's states as sf-strings, in the decision's order: the rules, the
    /// quota when the request had one, the concurrency limit when the policy has one.
    pub(super) fn state_names(&self, with_quota: bool) -> impl Iterator<Item = &SfName> + Clone {
        self.0
            .rule_names
            .iter()
            .chain(
                self.0
                    .quota
                    .as_ref()
                    .filter(|_| with_quota)
                    .map(|(name, _, _)| name),
            )
            .chain(self.0.concurrency.as_ref().map(|(name, _)| name))
            .chain(
                self.0
                    .fair
                    .iter()
                    .flat_map(|fair| [&fair.budget_name, &fair.share_name]),
            )
    }

    /// `policy` (a `RateLimit-Policy` value of this plan) with the item of an identity's share
    /// of the budget, `share` a window, appended: while it binds.
    pub(super) fn with_share(&self, policy: &HeaderValue, share: u64) -> HeaderValue {
        let Some(fair) = &self.0.fair else {
            return policy.clone();
        };
        let item = headers::policy_header_value(&[PolicyItem {
            name: &fair.share_name,
            quota: share,
            window_secs: fair.window_secs,
        }]);
        joined(policy, [item.to_str().unwrap_or_default()])
    }

    /// Whether the policy shares a budget fairly.
    pub(super) fn has_fair_share(&self) -> bool {
        self.0.fair.is_some()
    }

    /// `RateLimit-Policy` of a request whose quota tier allows `quota_limit` a day: the rules'
    /// items, the quota's, then the concurrency limit's.
    pub(super) fn policy_with_quota(&self, quota_limit: u64) -> HeaderValue {
        match self
            .0
            .quota_policies
            .iter()
            .find(|(limit, _)| *limit == quota_limit)
        {
            Some((_, value)) => value.clone(),
            None => self.0.policy_with_quota(quota_limit),
        }
    }
}

impl Inner {
    /// [`AnswerPlan::policy_with_quota`], made anew.
    fn policy_with_quota(&self, quota_limit: u64) -> HeaderValue {
        let Some((name, window_secs, unit)) = &self.quota else {
            return self.policy.clone();
        };
        let quota = headers::policy_header_value(&[PolicyItem {
            name,
            quota: quota_limit,
            window_secs: *window_secs,
        }]);
        let mut quota = quota.to_str().unwrap_or_default().to_owned();
        if let Some(unit) = unit {
            with_unit(&mut quota, unit);
        }
        let concurrency = self.concurrency.as_ref().map(|(_, item)| &**item);
        let budget = self.fair.as_ref().map(|fair| &*fair.budget_item);
        joined(
            &self.rules_policy,
            std::iter::once(&*quota).chain(concurrency).chain(budget),
        )
    }
}

/// Appends the quota-unit parameter (`qu`) of a metered item: its meter's unit, a word of ASCII
/// letters, digits and `_` (checked when the policy was built), so a plain sf-string.
fn with_unit(item: &mut String, unit: &str) {
    item.push_str(";qu=\"");
    item.push_str(unit);
    item.push('"');
}

/// `list` with `items` appended, as one structured-field list.
fn joined<'a>(list: &HeaderValue, items: impl IntoIterator<Item = &'a str>) -> HeaderValue {
    let mut value = list.to_str().unwrap_or_default().to_owned();
    for item in items {
        if !value.is_empty() {
            value.push_str(", ");
        }
        value.push_str(item);
    }
    // The parts are valid field values, and so is their join.
    HeaderValue::try_from(value).unwrap_or_else(|_| list.clone())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Key, Quota, Rule};

    fn plan(policy: &Policy) -> AnswerPlan {
        AnswerPlan::new(policy)
    }

    #[test]
    fn a_metered_item_says_its_unit_and_clients_still_read_it() {
        let tokens_a_day = Quota::builder("tokens-daily")
            .key(Key::global())
            .tier("free", 100_000)
            .metered()
            .build()
            .unwrap();
        let policy = Policy::builder("llm")
            .key(Key::global())
            .rule(Rule::per_minute(60))
            .rule(Rule::per_minute(40_000).metered())
            .quota(tokens_a_day)
            .meter(crate::meter::Meter::new("tokens"))
            .build()
            .unwrap();
        let plan = plan(&policy);
        let rules = "\"60-per-60s\";q=60;w=60, \"40000-tokens-per-60s\";q=40000;w=60;qu=\"tokens\"";
        assert_eq!(plan.rules_policy(), rules);
        let with_quota = plan.policy_with_quota(100_000);
        assert_eq!(
            with_quota,
            format!("{rules}, \"tokens-daily\";q=100000;w=86400;qu=\"tokens\"").as_str()
        );
        let mut headers = http::HeaderMap::new();
        headers.insert("ratelimit-policy", with_quota);
        let parsed = crate::headers::parse(&headers).unwrap();
        assert_eq!(parsed.policy("40000-tokens-per-60s").unwrap().quota, 40_000);
        assert_eq!(parsed.policy("tokens-daily").unwrap().quota, 100_000);
    }

    #[test]
    fn the_policy_value_lists_every_rule_with_its_window_in_whole_seconds() {
        let policy = Policy::builder("p")
            .rule(Rule::per_minute(20))
            .rule(Rule::per_hour(100))
            .prevent_duplicate(Duration::from_secs(5))
            .build()
            .unwrap();
        let expected =
            "\"20-per-60s\";q=20;w=60, \"100-per-3600s\";q=100;w=3600, \"duplicate\";q=1;w=5";
        assert_eq!(plan(&policy).policy(), expected);
        assert_eq!(plan(&policy).rules_policy(), expected);
        // A sub-second window is sent as one whole second.
        let policy = Policy::builder("p")
            .rule(Rule::new(5, Duration::from_millis(1500)))
            .build()
            .unwrap();
        assert_eq!(plan(&policy).policy(), "\"5-per-1500ms\";q=5;w=2");
    }

    #[test]
    fn the_quota_comes_after_the_rules_and_the_concurrency_limit_last() {
        let quota = Quota::builder("daily")
            .key(Key::global())
            .tier("free", 500)
            .build()
            .unwrap();
        let policy = Policy::builder("p")
            .rule(Rule::per_minute(10).named("minute"))
            .max_in_flight(2)
            .lease(Duration::from_secs(30))
            .quota(quota)
            .build()
            .unwrap();
        let plan = plan(&policy);
        assert_eq!(plan.rules_policy(), "\"minute\";q=10;w=60");
        assert_eq!(plan.policy(), "\"minute\";q=10;w=60, \"2-in-flight\";q=2");
        assert_eq!(
            plan.policy_with_quota(500),
            "\"minute\";q=10;w=60, \"daily\";q=500;w=86400, \"2-in-flight\";q=2"
        );
        let names = |with_quota| {
            plan.state_names(with_quota)
                .map(|name| name.as_str().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(true), ["\"minute\"", "\"daily\"", "\"2-in-flight\""]);
        assert_eq!(names(false), ["\"minute\"", "\"2-in-flight\""]);
    }

    #[test]
    fn each_state_has_its_refusal_body() {
        let policy = Policy::builder("p")
            .rule(Rule::per_minute(10).named("minute"))
            .max_in_flight(2)
            .lease(Duration::from_secs(30))
            .message("slow down")
            .build()
            .unwrap();
        let plan = plan(&policy);
        for (index, name) in [(0, "minute"), (1, "2-in-flight")] {
            let body = plan.body(&policy, index, 2).expect("a ready body");
            let json: serde_json::Value = serde_json::from_slice(body).unwrap();
            assert_eq!(json["violated-policies"], serde_json::json!([name]));
            assert_eq!(json["detail"], "slow down");
        }
    }
}
