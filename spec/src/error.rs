//! [`PolicyError`]: why a policy was refused when it was built.

/// Why a policy was refused when it was built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The policy has no rules.
    #[error("policy {policy:?} has no rules")]
    NoRules {
        /// The policy's name.
        policy: String,
    },
    /// The policy's key reads a header by a name no header can have (`Key::header`).
    #[error("policy {policy:?}: the key's header name {name:?} is not a valid header name")]
    InvalidKeyHeader {
        /// The policy's name.
        policy: String,
        /// The name given.
        name: String,
    },
    /// A rule's limit is zero.
    #[error("policy {policy:?}, rules[{index}] ({rule}): the limit must be at least 1")]
    ZeroLimit {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// A rule's limit is above [`MAX_LIMIT`](crate::MAX_LIMIT).
    #[error(
        "policy {policy:?}, rules[{index}] ({rule}): the limit must be at most 2^35 (34359738368)"
    )]
    LimitTooLarge {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// A rule's period is zero.
    #[error("policy {policy:?}, rules[{index}] ({rule}): the period must be longer than zero")]
    ZeroPeriod {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// A rule's period is not a whole number of milliseconds.
    #[error(
        "policy {policy:?}, rules[{index}] ({rule}): the period must be a whole number of milliseconds"
    )]
    SubMillisecondPeriod {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// A rule's period is longer than [`MAX_PERIOD`](crate::MAX_PERIOD).
    #[error("policy {policy:?}, rules[{index}] ({rule}): the period must be at most 366 days")]
    PeriodTooLong {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
    },
    /// Two rules have the same limit and period.
    #[error("policy {policy:?}, rules[{index}] ({rule}) is the same rule as rules[{first}]")]
    DuplicateRule {
        /// The policy's name.
        policy: String,
        /// The duplicate's position (from 0).
        index: usize,
        /// The position of the rule it repeats.
        first: usize,
        /// The rule as text.
        rule: String,
    },
    /// Two rules have the same name, so clients couldn't tell them apart (`index` is one past the
    /// rules when the daily quota has the name of a rule).
    #[error("policy {policy:?}, rules[{index}] has the name {name:?} of rules[{first}]")]
    DuplicateRuleName {
        /// The policy's name.
        policy: String,
        /// The duplicate's position (from 0).
        index: usize,
        /// The position of the rule whose name it repeats.
        first: usize,
        /// The shared name.
        name: String,
    },
    /// A rule name that can't be sent in a header.
    #[error("policy {policy:?}, rules[{index}]: {source}")]
    InvalidRuleName {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// What is wrong with the name.
        source: crate::InvalidRuleName,
    },
    /// A rule's token-bucket settings can't work.
    #[error("policy {policy:?}, rules[{index}] ({rule}): {reason}")]
    InvalidBurst {
        /// The policy's name.
        policy: String,
        /// The rule's position (from 0).
        index: usize,
        /// The rule as text.
        rule: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A policy option (`block_for`, `max_delay`, `prevent_duplicate`) can't work.
    #[error("policy {policy:?}, {option}: {reason}")]
    InvalidOption {
        /// The policy's name.
        policy: String,
        /// The option.
        option: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// A policy name or key prefix that would break the store key layout.
    #[error(
        "{what} {value:?} must be 1 to 64 characters of letters, digits and -._~@+=!*(),/ (it is part of every store key)"
    )]
    InvalidName {
        /// `"policy name"` or `"key prefix"`.
        what: &'static str,
        /// The refused value.
        value: String,
    },
    /// Over a store whose checks reach one place (`Store::keys_share_one_slot`: Redis Cluster),
    /// the policy's quota is keyed apart from its rules, so one request's keys would be in
    /// different hash slots. Key the quota with a clone of the policy's `Key`.
    #[error(
        "policy {policy:?} is keyed by {key} but its quota {quota:?} by {quota_key}: on Redis \
         Cluster all keys of a request must share one hash slot, so key the quota with a clone \
         of the policy's own Key"
    )]
    QuotaKeyedApart {
        /// The policy's name.
        policy: String,
        /// The policy's key, as `Key::ip`, `Key::header("x-api-key")`, ….
        key: String,
        /// The quota's name.
        quota: String,
        /// The quota's key.
        quota_key: String,
    },
    /// An override can't work: its identity doesn't fit the policy's key, it names an
    /// identity twice, or its rules are refused.
    #[error("policy {policy:?}, overrides[{index}]: {reason}")]
    InvalidOverride {
        /// The policy's name.
        policy: String,
        /// The override's position (from 0).
        index: usize,
        /// Why.
        reason: String,
    },
}

/// What part of a written policy a [`PolicyError`] is about, so that a config file can name the
/// field and the derive can point at the argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorSite {
    /// The policy's name.
    Name,
    /// The key prefix.
    Prefix,
    /// The list of rules as a whole (there is none).
    Rules,
    /// One rule, or one part of it.
    Rule {
        /// Its position (from 0; the duplicate guard comes after the rules, the quota after it).
        index: usize,
        /// Which part.
        part: RulePart,
    },
    /// An option: `block_for`, `prevent_duplicate`, `max_delay`, `lease`, `max_in_flight`,
    /// `mode`, `key`.
    Option(&'static str),
    /// An override.
    Override(usize),
    /// The policy as a whole.
    Policy,
}

/// The part of a rule an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RulePart {
    /// The rule as a whole (it repeats another).
    Whole,
    /// Its limit.
    Limit,
    /// Its period.
    Period,
    /// Its burst.
    Burst,
    /// Its name.
    Name,
}

impl PolicyError {
    /// What part of the written policy the error is about.
    pub fn site(&self) -> ErrorSite {
        let rule = |index: usize, part| ErrorSite::Rule { index, part };
        match self {
            PolicyError::NoRules { .. } => ErrorSite::Rules,
            PolicyError::ZeroLimit { index, .. } | PolicyError::LimitTooLarge { index, .. } => {
                rule(*index, RulePart::Limit)
            }
            PolicyError::ZeroPeriod { index, .. }
            | PolicyError::SubMillisecondPeriod { index, .. }
            | PolicyError::PeriodTooLong { index, .. } => rule(*index, RulePart::Period),
            PolicyError::DuplicateRule { index, .. } => rule(*index, RulePart::Whole),
            PolicyError::DuplicateRuleName { index, .. }
            | PolicyError::InvalidRuleName { index, .. } => rule(*index, RulePart::Name),
            // Most reasons are about the burst; a rate above one unit per microsecond is about
            // the limit and period together.
            PolicyError::InvalidBurst { index, reason, .. } if reason.contains("burst") => {
                rule(*index, RulePart::Burst)
            }
            PolicyError::InvalidBurst { index, .. } => rule(*index, RulePart::Whole),
            PolicyError::InvalidOption { option, .. } => ErrorSite::Option(option),
            PolicyError::InvalidName {
                what: "key prefix", ..
            } => ErrorSite::Prefix,
            PolicyError::InvalidName { .. } => ErrorSite::Name,
            PolicyError::InvalidOverride { index, .. } => ErrorSite::Override(*index),
            PolicyError::QuotaKeyedApart { .. } => ErrorSite::Policy,
            PolicyError::InvalidKeyHeader { .. } => ErrorSite::Option("key"),
        }
    }

    /// The error as said of its [`site`](Self::site): `must be at least 1` of a rule's limit,
    /// where [`Display`](std::fmt::Display) says `policy "login", rules[0] (0 per 60s): the
    /// limit must be at least 1`.
    pub fn reason(&self) -> String {
        match self {
            PolicyError::NoRules { .. } => "must list at least one rule".to_owned(),
            PolicyError::ZeroLimit { .. } => "must be at least 1".to_owned(),
            PolicyError::LimitTooLarge { .. } => "must be at most 2^35 (34359738368)".to_owned(),
            PolicyError::ZeroPeriod { .. } => "must be longer than zero".to_owned(),
            PolicyError::SubMillisecondPeriod { .. } => {
                "must be a whole number of milliseconds".to_owned()
            }
            PolicyError::PeriodTooLong { .. } => "must be at most 366 days".to_owned(),
            PolicyError::DuplicateRule { first, rule, .. } => {
                format!("{rule} is the same rule as rules[{first}]")
            }
            PolicyError::DuplicateRuleName { first, name, .. } => {
                format!("{name:?} is the name of rules[{first}] too")
            }
            PolicyError::InvalidRuleName { source, .. } => source.to_string(),
            PolicyError::InvalidBurst { rule, reason, .. } => format!("{rule}: {reason}"),
            PolicyError::InvalidOption { reason, .. } => (*reason).to_owned(),
            PolicyError::InvalidOverride { reason, .. } => reason.clone(),
            PolicyError::InvalidKeyHeader { name, .. } => {
                format!("the header name {name:?} is not a valid header name")
            }
            PolicyError::InvalidName { .. } | PolicyError::QuotaKeyedApart { .. } => {
                self.to_string()
            }
        }
    }
}
