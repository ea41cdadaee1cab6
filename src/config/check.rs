//! Checks a [`ConfigFile`] into policies, naming the first bad field.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use super::file::{
    ConfigFile, DuplicateConfig, MeterConfig, OverrideConfig, QuotaConfig, RouteConfig, RuleConfig,
    StatusItem,
};
use super::store::{RedisSettings, StoreSpec, check_store, check_tls};
use super::{
    ConfigError, DEFAULT_PREFIX, RateLimitConfig, RouteLimit, RouteSource, SharedSettings,
};
use crate::client_ip::{ClientIp, ForwardedHeader};
use crate::key::Key;
use crate::policy::meter::Meter;
use crate::policy::quota::Quota;
use crate::policy::{
    self, Algorithm, Mode, OnStoreError, Override, Policy, PolicyError, Rule, Scope,
    UnknownAlgorithm,
};
use tower_redis_ratelimit_spec::{
    ErrorSite, KeySpec, PolicyParts, RulePart, StatusSet, parse_duration, parse_header_name,
};

/// The tier header when none is configured.
pub(super) const DEFAULT_TIER_HEADER: &str = "x-tier";

/// Checks a whole file. `other` top-level fields are refused unless listed in `app_fields`.
pub(super) fn check_file(
    file: &ConfigFile,
    app_fields: &[&str],
) -> Result<RateLimitConfig, ConfigError> {
    if let Some(unknown) = file
        .other
        .keys()
        .find(|key| !app_fields.contains(&key.as_str()))
    {
        return Err(ConfigError::new(
            unknown.clone(),
            "unknown field: expected store, prefix, on_store_error, store_timeout, \
             trusted_proxies, forwarded_header, legacy_headers, tls_ca, tls_insecure, \
             wait_for_replicas, routes or quota",
        ));
    }
    let timeout = match &file.store_timeout {
        None => crate::store::DEFAULT_TIMEOUT,
        Some(text) => {
            parse_duration(text).map_err(|message| ConfigError::new("store_timeout", message))?
        }
    };
    let store = check_store(&file.store)?;
    let tls = check_tls(file.tls_ca.as_deref(), file.tls_insecure, &store)?;
    let wait_for_replicas = match file.wait_for_replicas {
        Some(replicas) if replicas > 0 && store == StoreSpec::Memory => {
            return Err(ConfigError::new(
                "wait_for_replicas",
                "applies only to a Redis store, not \"memory\"",
            ));
        }
        replicas => replicas.unwrap_or(0),
    };
    let on_store_error = match file.on_store_error.as_deref() {
        None => OnStoreError::default(),
        Some(text) => text.parse().map_err(|error: policy::UnknownName| {
            ConfigError::new("on_store_error", error.to_string())
        })?,
    };
    let prefix = file.prefix.as_deref().unwrap_or(DEFAULT_PREFIX);
    if !policy::is_valid_name(prefix) {
        return Err(ConfigError::new(
            "prefix",
            format!(
                "{prefix:?} must be 1 to 64 letters, digits and -._~@+=!*(),/ (it starts every \
                 store key)"
            ),
        ));
    }
    let mut trusted_proxies = Vec::with_capacity(file.trusted_proxies.len());
    for (index, text) in file.trusted_proxies.iter().enumerate() {
        trusted_proxies.push(parse_cidr(text).ok_or_else(|| {
            ConfigError::new(
                format!("trusted_proxies[{index}]"),
                format!("{text:?} is not a CIDR such as \"10.0.0.0/8\" or \"fd00::/8\""),
            )
        })?);
    }
    let mut client_ip = ClientIp::new().trust_proxies(trusted_proxies.iter().copied());
    let forwarded_header: Option<ForwardedHeader> = match &file.forwarded_header {
        None => None,
        Some(text) => Some(text.parse().map_err(
            |error: crate::client_ip::ParseForwardedHeaderError| {
                ConfigError::new("forwarded_header", error.to_string())
            },
        )?),
    };
    if let Some(header) = forwarded_header {
        client_ip = client_ip.forwarded_header(header);
    }
    if file.routes.is_empty() {
        return Err(ConfigError::new("routes", "must list at least one route"));
    }
    let quota = file
        .quota
        .as_ref()
        .map(|quota| check_quota(quota, prefix))
        .transpose()?;
    // What every route's policy is built from besides its own entry: a reload keeps a route's
    // limiter only when this and the entry are unchanged.
    let settings = Arc::new(SharedSettings {
        prefix: prefix.to_owned(),
        on_store_error: file.on_store_error.clone(),
        trusted_proxies: file.trusted_proxies.clone(),
        forwarded_header: file.forwarded_header.clone(),
        legacy_headers: file.legacy_headers,
        quota: file.quota.clone(),
    });
    let mut routes: Vec<RouteLimit> = Vec::with_capacity(file.routes.len());
    for (index, raw) in file.routes.iter().enumerate() {
        let route = RouteCheck {
            index,
            prefix,
            client_ip: &client_ip,
            on_store_error,
            quota: quota.as_ref(),
            settings: &settings,
        }
        .check(raw)?;
        for (at, path) in route.paths.iter().enumerate() {
            let field = match (&raw.path, at) {
                (Some(_), 0) => "path".to_owned(),
                (Some(_), at) => format!("paths[{}]", at - 1),
                (None, at) => format!("paths[{at}]"),
            };
            let earlier = routes
                .iter()
                .position(|earlier| earlier.paths.contains(path))
                .map(|first| format!("routes[{first}]"))
                .or_else(|| {
                    route.paths[..at]
                        .contains(path)
                        .then(|| "this route".to_owned())
                });
            if let Some(earlier) = earlier {
                return Err(ConfigError::new(
                    format!("routes[{index}].{field}"),
                    format!("{path:?} is already used by {earlier}"),
                ));
            }
        }
        if let Some(first) = routes
            .iter()
            .position(|earlier| earlier.policy.name() == route.policy.name())
        {
            return Err(ConfigError::new(
                format!("routes[{index}].name"),
                format!(
                    "{:?} is already the name of routes[{first}]",
                    route.policy.name()
                ),
            ));
        }
        routes.push(route);
    }
    Ok(RateLimitConfig {
        store,
        redis: RedisSettings {
            timeout,
            wait_for_replicas,
            tls,
        },
        prefix: prefix.to_owned(),
        trusted_proxies,
        forwarded_header,
        legacy_headers: file.legacy_headers,
        routes,
    })
}

/// What a route's check needs from the rest of the file.
struct RouteCheck<'a> {
    index: usize,
    prefix: &'a str,
    client_ip: &'a ClientIp,
    on_store_error: OnStoreError,
    quota: Option<&'a Quota>,
    settings: &'a Arc<SharedSettings>,
}

impl RouteCheck<'_> {
    fn error(&self, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::new(format!("routes[{}].{field}", self.index), message)
    }

    fn duration(&self, field: &str, text: &str) -> Result<Duration, ConfigError> {
        parse_duration(text).map_err(|message| self.error(field, message))
    }

    fn check(&self, raw: &RouteConfig) -> Result<RouteLimit, ConfigError> {
        if let Some(path) = &raw.path
            && !path.starts_with('/')
        {
            return Err(self.error("path", format!("{path:?} must start with \"/\"")));
        }
        for (at, path) in raw.paths.iter().enumerate() {
            if !path.starts_with('/') {
                let field = format!("paths[{at}]");
                return Err(self.error(&field, format!("{path:?} must start with \"/\"")));
            }
        }
        let paths: Vec<String> = raw.path.iter().chain(&raw.paths).cloned().collect();
        let Some(first_path) = paths.first() else {
            return Err(self.error("path", "a route needs a `path` or `paths`"));
        };
        let key_text = raw.key.as_deref().unwrap_or("ip");
        let key = parse_key(key_text).map_err(|message| self.error("key", message))?;
        let algorithm: Algorithm = match &raw.algorithm {
            None => Algorithm::default(),
            Some(text) => text
                .parse()
                .map_err(|error: UnknownAlgorithm| self.error("algorithm", error.to_string()))?,
        };
        let rules = self.rules("rules", &raw.rules)?;
        let overrides = raw
            .overrides
            .iter()
            .enumerate()
            .map(|(i, entry)| self.check_override(&format!("overrides[{i}]"), entry, algorithm))
            .collect::<Result<Vec<_>, _>>()?;
        let name = match &raw.name {
            Some(name) => name.clone(),
            None if policy::is_valid_name(first_path) => first_path.clone(),
            None => default_route_name(first_path),
        };
        let mut builder = Policy::builder(name)
            .prefix(self.prefix)
            .key(key)
            .rules(rules)
            .algorithm(algorithm)
            // A policy per route keeps routes apart; the route's methods share its budget.
            .scope(Scope::Policy)
            .client_ip(self.client_ip.clone())
            .on_store_error(self.on_store_error);
        match &raw.prevent_duplicate {
            None | Some(DuplicateConfig::On(false)) => {}
            Some(DuplicateConfig::On(true)) => {
                builder = builder.prevent_duplicate(policy::DEFAULT_DUPLICATE_WINDOW);
            }
            Some(DuplicateConfig::Rule(rule)) => {
                if rule.limit.is_some_and(|limit| limit != 1) {
                    return Err(self.error(
                        "prevent_duplicate.limit",
                        "the duplicate guard admits one request per period: leave out the \
                         limit or make it 1 (use a rule for more)",
                    ));
                }
                builder = builder
                    .prevent_duplicate(self.duration("prevent_duplicate.period", &rule.period)?);
            }
        }
        if let Some(text) = &raw.block_for {
            builder = builder.block_for(self.duration("block_for", text)?);
        }
        let max_delay = match &raw.max_delay {
            Some(text) => Some(self.duration("max_delay", text)?),
            None => None,
        };
        let mode = Mode::from_written(raw.mode.as_deref(), max_delay)
            .map_err(|error| self.error(error.field, error.reason))?;
        builder = builder.mode(mode);
        if let Some(name) = &raw.cost_header {
            let header =
                parse_header_name(name).map_err(|message| self.error("cost_header", message))?;
            builder = builder.cost_from_header(header);
        }
        if let Some(items) = &raw.count_only {
            let mut statuses = StatusSet::default();
            for (index, item) in items.iter().enumerate() {
                let added = match item {
                    StatusItem::Code(code) => statuses.insert_code(*code),
                    StatusItem::Written(text) => statuses.insert_written(text),
                };
                added.map_err(|error| {
                    self.error(&format!("count_only[{index}]"), error.to_string())
                })?;
            }
            if statuses.is_empty() {
                return Err(self.error(
                    "count_only",
                    "lists no status: name the ones that count, such as [401, 403] or [\"5xx\"]",
                ));
            }
            builder = builder.count_only_statuses(statuses);
        }
        if let Some(units) = raw.prefetch {
            builder = builder.prefetch(units);
        }
        if let Some(n) = raw.max_in_flight {
            builder = builder.max_in_flight(n);
        }
        if let Some(text) = &raw.lease {
            builder = builder.lease(self.duration("lease", text)?);
        }
        if let Some(meter) = &raw.meter {
            builder = builder.meter(self.meter(meter)?);
        }
        // A metered quota counts the routes that meter units.
        if let Some(quota) = self.quota
            && (!quota.is_metered() || raw.meter.is_some())
        {
            builder = builder.quota(quota.clone());
        }
        let policy = builder
            .overrides(overrides)
            .build()
            .map_err(|error| self.policy_error("", error))?;
        Ok(RouteLimit {
            path: first_path.clone(),
            paths,
            key: key_text.to_owned(),
            policy,
            source: RouteSource {
                route: raw.clone(),
                settings: self.settings.clone(),
            },
        })
    }

    /// The route's `meter`.
    fn meter(&self, raw: &MeterConfig) -> Result<Meter, ConfigError> {
        let mut meter = Meter::new(raw.unit.clone());
        let fixed = raw.estimate.unwrap_or(1);
        if fixed > policy::MAX_LIMIT {
            return Err(self.error("meter.estimate", "must be 0 to 2^35 units"));
        }
        if let Some(max_usage) = raw.max_usage
            && max_usage < fixed
        {
            return Err(self.error(
                "meter.max_usage",
                format!(
                    "is {max_usage}, below meter.estimate ({fixed}): no report could count what                      a request reserves; raise max_usage or lower the estimate"
                ),
            ));
        }
        match &raw.estimate_header {
            Some(name) => {
                let header = parse_header_name(name)
                    .map_err(|message| self.error("meter.estimate_header", message))?;
                meter = meter.estimate(move |parts| {
                    parts
                        .headers
                        .get(&header)
                        .and_then(|value| value.to_str().ok()?.trim().parse().ok())
                        .unwrap_or(fixed)
                });
            }
            None => meter = meter.estimate(move |_| fixed),
        }
        if let Some(name) = &raw.usage_header {
            let header = parse_header_name(name)
                .map_err(|message| self.error("meter.usage_header", message))?;
            meter = meter.usage_header(header);
        }
        if let Some(units) = raw.max_usage {
            meter = meter.max_usage(units);
        }
        Ok(meter)
    }

    /// The rules at `field` (`rules`, `overrides[1].rules`).
    fn rules(&self, field: &str, raw: &[RuleConfig]) -> Result<Vec<Rule>, ConfigError> {
        let mut rules = Vec::with_capacity(raw.len());
        for (i, rule) in raw.iter().enumerate() {
            let period = self.duration(&format!("{field}[{i}].period"), &rule.period)?;
            let mut parsed = Rule::new(rule.limit, period);
            if let Some(burst) = rule.burst {
                parsed = parsed.burst(burst);
            }
            if rule.metered {
                parsed = parsed.metered();
            }
            rules.push(parsed);
        }
        Ok(rules)
    }

    /// An `overrides` entry at `field`: whom it is for, and exactly one of what it does.
    fn check_override(
        &self,
        field: &str,
        raw: &OverrideConfig,
        algorithm: Algorithm,
    ) -> Result<Override, ConfigError> {
        let target = match (&raw.identity, &raw.cidr) {
            (Some(identity), None) => Override::identity(identity.clone()),
            (None, Some(text)) => Override::cidr(parse_cidr(text).ok_or_else(|| {
                self.error(
                    &format!("{field}.cidr"),
                    format!("{text:?} is not a CIDR such as \"10.0.0.0/8\" or \"fd00::/8\""),
                )
            })?),
            (Some(_), Some(_)) => {
                return Err(self.error(
                    field,
                    "names both identity and cidr: an override is for one or the other",
                ));
            }
            (None, None) => {
                return Err(self.error(
                    field,
                    "names no one: give identity = \"...\" or cidr = \"...\"",
                ));
            }
        };
        for (flag, value) in [("unlimited", raw.unlimited), ("deny", raw.deny)] {
            if value == Some(false) {
                return Err(self.error(
                    &format!("{field}.{flag}"),
                    format!("{flag} = false does nothing: leave it out"),
                ));
            }
        }
        match (&raw.rules, raw.unlimited, raw.deny) {
            (Some(rules), None, None) => {
                if rules.is_empty() {
                    return Err(
                        self.error(&format!("{field}.rules"), "must list at least one rule")
                    );
                }
                let rules = self.rules(&format!("{field}.rules"), rules)?;
                // The builder checks them again with the whole policy; checked here first so the
                // message names the override's rule.
                PolicyParts::new("override", DEFAULT_PREFIX, rules.clone(), algorithm)
                    .check()
                    .map_err(|error| self.policy_error(&format!("{field}."), error))?;
                Ok(target.rules(rules))
            }
            (None, Some(true), None) => Ok(target.unlimited()),
            (None, None, Some(true)) => Ok(target.deny()),
            (None, None, None) => Err(self.error(
                field,
                "says nothing to do: give rules = [...], unlimited = true or deny = true",
            )),
            _ => Err(self.error(
                field,
                "may give only one of rules = [...], unlimited = true and deny = true",
            )),
        }
    }

    /// An error of the policy checks, at the field it is about (under `within`: `""` for the
    /// route, `"overrides[1]."` for an override's rules).
    fn policy_error(&self, within: &str, error: PolicyError) -> ConfigError {
        let field = match error.site() {
            ErrorSite::Prefix => return ConfigError::new("prefix", error.reason()),
            ErrorSite::Policy => {
                return ConfigError::new(format!("routes[{}]", self.index), error.reason());
            }
            ErrorSite::Name => "name".to_owned(),
            ErrorSite::Rules => "rules".to_owned(),
            ErrorSite::Rule { index, part } => match part {
                RulePart::Whole | RulePart::Name => format!("rules[{index}]"),
                RulePart::Limit => format!("rules[{index}].limit"),
                RulePart::Period => format!("rules[{index}].period"),
                RulePart::Burst => format!("rules[{index}].burst"),
            },
            // The meter's options are fields of its table.
            ErrorSite::Option(option @ ("max_usage" | "usage_header")) => format!("meter.{option}"),
            ErrorSite::Option(option) => option.to_owned(),
            ErrorSite::Override(index) => format!("overrides[{index}]"),
        };
        self.error(&format!("{within}{field}"), error.reason())
    }
}

/// Checks the `[quota]` section and builds the quota every route shares.
fn check_quota(raw: &QuotaConfig, prefix: &str) -> Result<Quota, ConfigError> {
    let key = parse_key(raw.key.as_deref().unwrap_or("user"))
        .map_err(|message| ConfigError::new("quota.key", message))?;
    let tier_header = raw.tier_header.as_deref().unwrap_or(DEFAULT_TIER_HEADER);
    let tier_header = parse_header_name(tier_header)
        .map_err(|message| ConfigError::new("quota.tier_header", message))?;
    if raw.tiers.is_empty() {
        return Err(ConfigError::new(
            "quota.tiers",
            "must name at least one tier, such as { free = 100 }",
        ));
    }
    let mut builder = Quota::builder("daily").prefix(prefix).key(key);
    for (tier, limit) in &raw.tiers {
        if *limit == 0 || *limit > policy::MAX_LIMIT {
            return Err(ConfigError::new(
                format!("quota.tiers.{tier}"),
                "must be 1 to 2^35 requests per day",
            ));
        }
        builder = builder.tier(tier.clone(), *limit);
    }
    match (&raw.default_tier, raw.tiers.len()) {
        (Some(tier), _) if !raw.tiers.contains_key(tier) => {
            return Err(ConfigError::new(
                "quota.default_tier",
                format!("{tier:?} is not one of the tiers"),
            ));
        }
        (Some(tier), _) => builder = builder.default_tier(tier.clone()),
        (None, 1) => {}
        (None, _) => {
            return Err(ConfigError::new(
                "quota.default_tier",
                "is required with more than one tier: the tier of requests without a known one",
            ));
        }
    }
    if let Some(percents) = &raw.alert_at {
        if let Some(bad) = percents.iter().find(|p| !(1..=100).contains(*p)) {
            return Err(ConfigError::new(
                "quota.alert_at",
                format!("{bad} is not a percent from 1 to 100"),
            ));
        }
        builder = builder.alert_at(percents.iter().copied());
    }
    if let Some(text) = &raw.utc_offset {
        let minutes = parse_utc_offset(text).ok_or_else(|| {
            ConfigError::new(
                "quota.utc_offset",
                format!(
                    "{text:?} is not an offset such as \"+00:00\", \"+05:30\" or \"-08:00\" (at \
                     most 18 hours)"
                ),
            )
        })?;
        builder = builder.utc_offset_minutes(minutes);
    }
    if let Some(url) = &raw.alert_webhook {
        if !url.starts_with("http://") {
            return Err(ConfigError::new(
                "quota.alert_webhook",
                format!("{url:?} is not an http:// URL"),
            ));
        }
        #[cfg(feature = "webhook")]
        {
            builder = builder.notifier(crate::alert::WebhookNotifier::new(url.clone()));
        }
        #[cfg(not(feature = "webhook"))]
        return Err(ConfigError::new(
            "quota.alert_webhook",
            "needs the crate feature \"webhook\"",
        ));
    }
    builder = builder.tier_from_fn(move |parts| {
        let tier = parts.headers.get(&tier_header)?.to_str().ok()?;
        Some(tier.trim().to_owned())
    });
    if raw.metered {
        builder = builder.metered();
    }
    builder
        .build()
        .map_err(|error| ConfigError::new("quota", error.to_string()))
}

/// A key kind: `ip`, `user`, `global`, `header:<name>` or `query:<name>`.
pub(super) fn parse_key(text: &str) -> Result<Key, String> {
    KeySpec::parse(text).map(Key::from)
}

/// A CIDR, or a bare address meaning just that address.
fn parse_cidr(text: &str) -> Option<IpNet> {
    text.parse::<IpNet>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from))
}

/// `+HH:MM` or `-HH:MM` as minutes east of UTC, at most 18 hours.
fn parse_utc_offset(text: &str) -> Option<i32> {
    let (sign, rest) = match text.as_bytes().first()? {
        b'+' => (1, &text[1..]),
        b'-' => (-1, &text[1..]),
        _ => return None,
    };
    let (hours, minutes) = rest.split_once(':')?;
    let two_digits = |part: &str| part.len() == 2 && part.bytes().all(|b| b.is_ascii_digit());
    if !two_digits(hours) || !two_digits(minutes) {
        return None;
    }
    let (hours, minutes): (i32, i32) = (hours.parse().ok()?, minutes.parse().ok()?);
    let total = hours * 60 + minutes;
    (minutes < 60 && total <= 18 * 60).then_some(sign * total)
}

/// The policy name of a route whose path can't be one (a template, a `:`, over 64 bytes):
/// `route-` and the first 64 bits of the path's SHA-256 in hex. It names the route by what it is,
/// so its store keys (and counts) don't move when routes are reordered or inserted.
fn default_route_name(path: &str) -> String {
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    let digest = Sha256::digest(path.as_bytes());
    let mut name = String::with_capacity(22);
    name.push_str("route-");
    for byte in &digest[..8] {
        let _ = write!(name, "{byte:02x}");
    }
    name
}
