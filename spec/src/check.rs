//! The checks a policy passes before it is built: one copy, run by `PolicyBuilder::build` when
//! an app starts (and by config files through it) and by `#[derive(LimitPolicy)]` when the app
//! compiles.

use std::time::Duration;

use crate::{
    Algorithm, MAX_LIMIT, MAX_PERIOD, Mode, PolicyError, Rule, check_rule_name, is_valid_name,
};

/// A policy's plain parts: everything the checks look at.
#[derive(Debug, Clone)]
pub struct PolicyParts<'a> {
    /// The policy's name.
    pub name: &'a str,
    /// The prefix of its store keys.
    pub prefix: &'a str,
    /// Its rules, in order.
    pub rules: Vec<Rule>,
    /// How it counts.
    pub algorithm: Algorithm,
    /// What it does with a refused request.
    pub mode: Mode,
    /// A penalty block after a refusal.
    pub block_for: Option<Duration>,
    /// The duplicate guard's window.
    pub duplicate_window: Option<Duration>,
    /// The concurrency limit: requests in progress at once, per identity.
    pub max_in_flight: Option<u64>,
    /// How long a request holds its concurrency slot at most.
    pub lease: Option<Duration>,
    /// The name of the daily quota, if the policy has one: no rule may have it.
    pub quota_name: Option<&'a str>,
    /// Whether only some responses count (`count_only`): admitted requests are charged, and
    /// refunded when their response's status doesn't count.
    pub count_only: bool,
    /// The most units an instance takes ahead for one identity (`prefetch`).
    pub prefetch: Option<u64>,
    /// The unit the policy's meter counts (`meter`), if it has one: metered rules and a metered
    /// quota count it.
    pub meter_unit: Option<&'a str>,
    /// The meter's bound on one report of units used (`max_usage`), if set.
    pub max_usage: Option<u64>,
    /// Whether the daily quota counts metered units rather than requests.
    pub quota_metered: bool,
}

/// A policy's parts that passed: its rules with the duplicate guard last, their names, and the
/// concurrency limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedParts {
    /// The rules, the duplicate guard (when asked for) last.
    pub rules: Vec<Rule>,
    /// How many of them the policy counts (all but the duplicate guard).
    pub counted_rules: usize,
    /// Each rule's name, as clients see it.
    pub rule_names: Vec<Box<str>>,
    /// `max_in_flight` and its lease.
    pub concurrency: Option<(u64, Duration)>,
}

impl<'a> PolicyParts<'a> {
    /// A policy of `rules` and nothing else (enforce mode, no options); set the other fields on
    /// the result.
    pub fn new(name: &'a str, prefix: &'a str, rules: Vec<Rule>, algorithm: Algorithm) -> Self {
        PolicyParts {
            name,
            prefix,
            rules,
            algorithm,
            mode: Mode::Enforce,
            block_for: None,
            duplicate_window: None,
            max_in_flight: None,
            lease: None,
            quota_name: None,
            count_only: false,
            prefetch: None,
            meter_unit: None,
            max_usage: None,
            quota_metered: false,
        }
    }

    /// Runs every check, in the order `PolicyBuilder::build` reports them.
    ///
    /// ```
    /// use tower_redis_ratelimit_spec::{Algorithm, PolicyParts, Rule};
    ///
    /// let parts = PolicyParts::new("login", "rl", vec![Rule::per_minute(0)], Algorithm::SlidingLog);
    /// let error = parts.check().unwrap_err();
    /// assert_eq!(
    ///     error.to_string(),
    ///     "policy \"login\", rules[0] (0 per 60s): the limit must be at least 1"
    /// );
    /// ```
    ///
    /// # Errors
    ///
    /// The first [`PolicyError`] found.
    pub fn check(self) -> Result<CheckedParts, PolicyError> {
        for (what, value) in [("policy name", self.name), ("key prefix", self.prefix)] {
            if !is_valid_name(value) {
                return Err(PolicyError::InvalidName {
                    what,
                    value: value.to_owned(),
                });
            }
        }
        let policy = || self.name.to_owned();
        if self.rules.is_empty() && self.max_in_flight.is_none() {
            return Err(PolicyError::NoRules { policy: policy() });
        }
        let option = |option, reason| PolicyError::InvalidOption {
            policy: policy(),
            option,
            reason,
        };
        let durations = [
            ("block_for", self.block_for),
            ("prevent_duplicate", self.duplicate_window),
            (
                "max_delay",
                match self.mode {
                    Mode::Delay { max_delay } => Some(max_delay),
                    Mode::Enforce | Mode::Shadow => None,
                },
            ),
        ];
        for (name, duration) in durations {
            if let Some(duration) = duration
                && let Err(reason) = check_duration(duration)
            {
                return Err(option(name, reason));
            }
        }
        let concurrency = match (self.max_in_flight, self.lease) {
            (None, None) => None,
            (Some(0), _) => {
                return Err(option("max_in_flight", "must be at least 1"));
            }
            (Some(_), None) => {
                return Err(option(
                    "lease",
                    "is required with max_in_flight: the longest a request holds its slot, such \
                     as \"30s\" (a crashed instance must not hold one for ever)",
                ));
            }
            (None, Some(_)) => {
                return Err(option("lease", "applies only with max_in_flight"));
            }
            (Some(n), Some(lease)) => {
                if let Err(reason) = check_duration(lease) {
                    return Err(option("lease", reason));
                }
                if n > MAX_LIMIT {
                    return Err(option("max_in_flight", "is larger than any rule may be"));
                }
                Some((n, lease))
            }
        };
        if matches!(self.mode, Mode::Delay { .. }) && !self.algorithm.can_reserve() {
            return Err(option(
                "mode",
                "delay mode needs the sliding_log or token_bucket algorithm, which can reserve a \
                 request's place in the future",
            ));
        }
        if self.count_only && self.rules.is_empty() {
            return Err(option(
                "count_only",
                "needs a rule to count in: a concurrency limit alone counts requests in progress, \
                 whatever their responses",
            ));
        }
        check_meter(&self).map_err(|(name, reason)| option(name, reason))?;
        if let Some(units) = self.prefetch {
            check_prefetch(&self, units).map_err(|reason| option("prefetch", reason))?;
        }
        let mut rules = self.rules;
        let counted_rules = rules.len();
        if let Some(window) = self.duplicate_window {
            let mut guard = Rule::new(1, window).named("duplicate");
            guard.duplicate_guard = true;
            rules.push(guard);
        }
        let mut rule_names: Vec<Box<str>> = Vec::with_capacity(rules.len());
        for (index, rule) in rules.iter().enumerate() {
            let text = || rule.to_string();
            if rule.limit == 0 {
                return Err(PolicyError::ZeroLimit {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if rule.limit > MAX_LIMIT {
                return Err(PolicyError::LimitTooLarge {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if rule.period.is_zero() {
                return Err(PolicyError::ZeroPeriod {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if !rule.period.subsec_nanos().is_multiple_of(1_000_000) {
                return Err(PolicyError::SubMillisecondPeriod {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if rule.period > MAX_PERIOD {
                return Err(PolicyError::PeriodTooLong {
                    policy: policy(),
                    index,
                    rule: text(),
                });
            }
            if let Err(reason) = check_burst(self.algorithm, rule) {
                return Err(PolicyError::InvalidBurst {
                    policy: policy(),
                    index,
                    rule: text(),
                    reason,
                });
            }
            if let Some(first) = rules[..index].iter().position(|earlier| {
                earlier.limit == rule.limit
                    && earlier.period == rule.period
                    && earlier.metered == rule.metered
            }) {
                return Err(PolicyError::DuplicateRule {
                    policy: policy(),
                    index,
                    first,
                    rule: text(),
                });
            }
            let name = rule.name_counting(self.meter_unit);
            if let Some(first) = rule_names.iter().position(|earlier| **earlier == *name) {
                return Err(PolicyError::DuplicateRuleName {
                    policy: policy(),
                    index,
                    first,
                    name: name.into_owned(),
                });
            }
            check_rule_name(&name).map_err(|source| PolicyError::InvalidRuleName {
                policy: policy(),
                index,
                source,
            })?;
            rule_names.push(name.into());
        }
        if let Some(quota) = self.quota_name
            && let Some(first) = rule_names.iter().position(|name| **name == *quota)
        {
            // Clients tell the quota's header item from the rules' by name.
            return Err(PolicyError::DuplicateRuleName {
                policy: policy(),
                index: rules.len(),
                first,
                name: quota.to_owned(),
            });
        }
        Ok(CheckedParts {
            rules,
            counted_rules,
            rule_names,
            concurrency,
        })
    }
}

/// Whether a policy option's duration can work: whole milliseconds, more than zero, at most
/// [`MAX_PERIOD`].
fn check_duration(duration: Duration) -> Result<(), &'static str> {
    if duration.is_zero() {
        Err("must be longer than zero")
    } else if !duration.subsec_nanos().is_multiple_of(1_000_000) {
        Err("must be a whole number of milliseconds")
    } else if duration > MAX_PERIOD {
        Err("must be at most 366 days")
    } else {
        Ok(())
    }
}

/// Whether the policy's meter and its metered rules go together: a meter counts in a metered
/// rule or quota, a metered rule or quota needs a meter, its unit is a word clients can read, and
/// its bound on one report can be stored.
fn check_meter(parts: &PolicyParts<'_>) -> Result<(), (&'static str, &'static str)> {
    let metered_rules = parts.rules.iter().any(|rule| rule.metered);
    let Some(unit) = parts.meter_unit else {
        if metered_rules || parts.quota_metered {
            return Err((
                "meter",
                "is required by a metered rule or quota: it says what they count (Meter::new(\"tokens\"))",
            ));
        }
        return Ok(());
    };
    if !metered_rules && !parts.quota_metered {
        return Err((
            "meter",
            "counts in no rule or quota: mark the rules that count its units with Rule::metered()",
        ));
    }
    if unit.is_empty()
        || !unit
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_')
    {
        return Err((
            "meter",
            "its unit must be a word of ASCII letters, digits and '_' (such as \"tokens\"): \
             rule names and headers carry it",
        ));
    }
    match parts.max_usage {
        Some(0) => return Err(("max_usage", "must be at least 1")),
        Some(max) if max > MAX_LIMIT => {
            return Err(("max_usage", "is larger than any rule may be"));
        }
        _ => {}
    }
    if parts.prefetch.is_some_and(|units| units > 1) {
        return Err((
            "prefetch",
            "can't go with a meter: units taken ahead are whole requests', and a metered \
             request's units are known only once its response ends",
        ));
    }
    Ok(())
}

/// Whether units can be taken ahead (`prefetch = units`) under `parts`: only where units an
/// instance holds can never let more than a limit through.
fn check_prefetch(parts: &PolicyParts<'_>, units: u64) -> Result<(), &'static str> {
    if units == 0 {
        return Err("must be at least 1 (1 takes no unit ahead)");
    }
    if units > MAX_LIMIT {
        return Err("is larger than any rule may be");
    }
    if parts.algorithm == Algorithm::SlidingLog {
        return Err(
            "can't take units of a sliding log ahead: the log records each request at its own \
             time, and units taken earlier would leave the window early, letting more than the \
             limit through later; use fixed_window, sliding_counter or token_bucket",
        );
    }
    if matches!(parts.mode, Mode::Delay { .. }) {
        return Err("can't go with delay mode, which reserves each request's own time");
    }
    if parts.duplicate_window.is_some() {
        return Err("can't go with prevent_duplicate: the duplicate guard must see every request");
    }
    if parts.block_for.is_some() {
        return Err(
            "can't go with block_for: a block refuses every request of an identity, and an \
             instance spending units it took can't see a block another instance started",
        );
    }
    if parts.max_in_flight.is_some() {
        return Err(
            "can't go with max_in_flight: a concurrency slot is a request in progress, never \
             taken ahead",
        );
    }
    Ok(())
}

/// Whether a rule's burst can work under `algorithm`.
fn check_burst(algorithm: Algorithm, rule: &Rule) -> Result<(), &'static str> {
    if algorithm != Algorithm::TokenBucket {
        return match rule.burst {
            Some(_) => Err("a burst applies only to the token_bucket algorithm"),
            None => Ok(()),
        };
    }
    if rule.duplicate_guard {
        return Ok(());
    }
    if rule.burst == Some(0) {
        return Err("the burst must be at least 1");
    }
    let period_us = u128::from(rule.period_ms()) * 1_000;
    if u128::from(rule.limit) > period_us {
        return Err("a token bucket refills at most one unit per microsecond");
    }
    let interval = period_us.div_ceil(u128::from(rule.limit));
    if u128::from(rule.burst_size()) * interval > MAX_PERIOD.as_micros() {
        return Err("the bucket must refill from empty within 366 days (burst × period / limit)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ErrorSite, RulePart};

    fn parts(rules: Vec<Rule>) -> PolicyParts<'static> {
        PolicyParts::new("p", "rl", rules, Algorithm::SlidingLog)
    }

    #[test]
    fn each_refusal_names_its_site_and_says_why_of_it() {
        let minute = Rule::per_minute(5);
        let cases: Vec<(PolicyParts<'static>, ErrorSite, &str)> = vec![
            (
                parts(vec![]),
                ErrorSite::Rules,
                "must list at least one rule",
            ),
            (
                parts(vec![minute.clone(), Rule::per_hour(0)]),
                ErrorSite::Rule {
                    index: 1,
                    part: RulePart::Limit,
                },
                "must be at least 1",
            ),
            (
                parts(vec![Rule::new(1, Duration::ZERO)]),
                ErrorSite::Rule {
                    index: 0,
                    part: RulePart::Period,
                },
                "must be longer than zero",
            ),
            (
                parts(vec![minute.clone(), minute.clone()]),
                ErrorSite::Rule {
                    index: 1,
                    part: RulePart::Whole,
                },
                "5 per 60s is the same rule as rules[0]",
            ),
            (
                parts(vec![minute.clone().burst(9)]),
                ErrorSite::Rule {
                    index: 0,
                    part: RulePart::Burst,
                },
                "5 per 60s: a burst applies only to the token_bucket algorithm",
            ),
            (
                PolicyParts {
                    block_for: Some(Duration::ZERO),
                    ..parts(vec![minute.clone()])
                },
                ErrorSite::Option("block_for"),
                "must be longer than zero",
            ),
            (
                PolicyParts {
                    max_in_flight: Some(2),
                    ..parts(vec![])
                },
                ErrorSite::Option("lease"),
                "is required with max_in_flight: the longest a request holds its slot, such as \
                 \"30s\" (a crashed instance must not hold one for ever)",
            ),
            (
                PolicyParts {
                    mode: Mode::Delay {
                        max_delay: Duration::from_secs(1),
                    },
                    algorithm: Algorithm::FixedWindow,
                    ..parts(vec![minute.clone()])
                },
                ErrorSite::Option("mode"),
                "delay mode needs the sliding_log or token_bucket algorithm, which can reserve a \
                 request's place in the future",
            ),
            (
                PolicyParts {
                    name: "bad name",
                    ..parts(vec![minute.clone()])
                },
                ErrorSite::Name,
                "policy name \"bad name\" must be 1 to 64 characters of letters, digits and \
                 -._~@+=!*(),/ (it is part of every store key)",
            ),
        ];
        for (parts, site, reason) in cases {
            let error = parts.check().unwrap_err();
            assert_eq!(
                (error.site(), error.reason().as_str()),
                (site, reason),
                "{error}"
            );
        }
    }

    #[test]
    fn a_policy_that_passes_gets_its_guard_last_and_its_names() {
        let checked = PolicyParts {
            duplicate_window: Some(Duration::from_secs(5)),
            max_in_flight: Some(3),
            lease: Some(Duration::from_secs(30)),
            ..parts(vec![
                Rule::per_minute(10),
                Rule::per_hour(100).named("hourly"),
            ])
        }
        .check()
        .unwrap();
        assert_eq!(checked.counted_rules, 2);
        assert!(checked.rules[2].is_duplicate_guard());
        let names: Vec<&str> = checked.rule_names.iter().map(|name| &**name).collect();
        assert_eq!(names, ["10-per-60s", "hourly", "duplicate"]);
        assert_eq!(checked.concurrency, Some((3, Duration::from_secs(30))));
    }
}
