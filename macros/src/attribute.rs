//! Reads `#[rate_limit(...)]` into values, each with the span of what wrote it, parsing every
//! value as a config file would (through `tower-redis-ratelimit-spec`).

use std::time::Duration;

use proc_macro2::Span;
use syn::meta::ParseNestedMeta;
use syn::parse::Parse as _;
use syn::spanned::Spanned as _;
use syn::{Attribute, LitInt, LitStr};
use tower_redis_ratelimit_spec::{
    Algorithm, KeySpec, OnStoreError, Scope, StatusSet, parse_any_duration, parse_header_name,
};

/// A value and the span of the argument that wrote it.
#[derive(Debug, Clone)]
pub(crate) struct Spanned<T> {
    pub(crate) value: T,
    pub(crate) span: Span,
}

/// One `rule(limit = .., period = ..[, burst = ..][, name = ..])`.
#[derive(Debug, Clone)]
pub(crate) struct RuleArg {
    /// The whole `rule(...)`.
    pub(crate) span: Span,
    pub(crate) limit: Spanned<u64>,
    pub(crate) period: Spanned<Duration>,
    pub(crate) burst: Option<Spanned<u64>>,
    pub(crate) name: Option<Spanned<String>>,
    /// `metered`: the rule counts the meter's units.
    pub(crate) metered: bool,
}

/// `meter(unit = "tokens"[, estimate = 500][, estimate_header = ".."][, usage_header = ".."]
/// [, max_usage = ..])`.
#[derive(Debug, Clone)]
pub(crate) struct MeterArg {
    /// The whole `meter(...)`.
    pub(crate) span: Span,
    pub(crate) unit: Spanned<String>,
    pub(crate) estimate: Option<Spanned<u64>>,
    pub(crate) estimate_header: Option<Spanned<String>>,
    pub(crate) usage_header: Option<Spanned<String>>,
    pub(crate) max_usage: Option<Spanned<u64>>,
}

/// Everything `#[rate_limit(...)]` says.
#[derive(Debug, Default)]
pub(crate) struct RateLimitArgs {
    pub(crate) name: Option<Spanned<String>>,
    pub(crate) key: Option<Spanned<KeySpec>>,
    pub(crate) algorithm: Option<Spanned<Algorithm>>,
    pub(crate) message: Option<Spanned<String>>,
    pub(crate) rules: Vec<RuleArg>,
    pub(crate) prevent_duplicate: Option<Spanned<Duration>>,
    pub(crate) block_for: Option<Spanned<Duration>>,
    pub(crate) mode: Option<Spanned<String>>,
    pub(crate) max_delay: Option<Spanned<Duration>>,
    pub(crate) cost_header: Option<Spanned<String>>,
    pub(crate) max_in_flight: Option<Spanned<u64>>,
    pub(crate) lease: Option<Spanned<Duration>>,
    pub(crate) scope: Option<Spanned<Scope>>,
    pub(crate) on_store_error: Option<Spanned<OnStoreError>>,
    pub(crate) prefetch: Option<Spanned<u64>>,
    /// `count_only = [401, "5xx"]`: the statuses, checked, as written.
    pub(crate) count_only: Option<Spanned<Vec<CountedStatus>>>,
    pub(crate) meter: Option<MeterArg>,
}

/// One status of `count_only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CountedStatus {
    /// A code (`401`).
    Code(u16),
    /// A class (`"5xx"`): its first digit.
    Class(u16),
}

/// The options the attribute takes, as an error lists them.
const OPTIONS: &str = "name, key, algorithm, message, rule(...), prevent_duplicate, block_for, \
                       mode, max_delay, cost_header, count_only, prefetch, max_in_flight, lease, scope, \
                       on_store_error, meter(...)";

impl RateLimitArgs {
    /// Reads every `#[rate_limit(...)]` of the type (options may be split over several), and
    /// returns the first, which errors about the policy as a whole point at.
    pub(crate) fn from_attributes(attributes: &[Attribute]) -> syn::Result<(Self, Attribute)> {
        let mut args = RateLimitArgs::default();
        let mut found = None;
        for attribute in attributes {
            if !attribute.path().is_ident("rate_limit") {
                continue;
            }
            found.get_or_insert_with(|| attribute.clone());
            attribute.parse_nested_meta(|meta| args.option(&meta))?;
        }
        let Some(attribute) = found else {
            return Err(syn::Error::new(
                Span::call_site(),
                "#[derive(LimitPolicy)] needs a #[rate_limit(...)] attribute with at least one \
                 rule(limit = .., period = \"..\") or a max_in_flight",
            ));
        };
        Ok((args, attribute))
    }

    fn option(&mut self, meta: &ParseNestedMeta<'_>) -> syn::Result<()> {
        let Some(option) = meta.path.get_ident().map(ToString::to_string) else {
            return Err(meta.error(format!("unknown option: expected one of {OPTIONS}")));
        };
        let span = meta.path.span();
        match option.as_str() {
            "name" => set(&mut self.name, span, string(meta)?)?,
            "key" => set_spanned(&mut self.key, span, parsed(meta, KeySpec::parse)?)?,
            "algorithm" => {
                let algorithm = parsed(meta, |text| text.parse::<Algorithm>())?;
                set_spanned(&mut self.algorithm, span, algorithm)?;
            }
            "message" => set(&mut self.message, span, string(meta)?)?,
            "rule" => {
                let rule = rule(meta)?;
                self.rules.push(rule);
            }
            "prevent_duplicate" => {
                let window = if meta.input.peek(syn::token::Paren) {
                    let mut period = None;
                    meta.parse_nested_meta(|inner| {
                        if inner.path.is_ident("period") {
                            let span = inner.path.span();
                            set_spanned(&mut period, span, duration(&inner)?)
                        } else {
                            Err(inner.error("unknown option of prevent_duplicate: expected period"))
                        }
                    })?;
                    period.ok_or_else(|| {
                        meta.error("prevent_duplicate(...) needs a period, such as \"5s\"")
                    })?
                } else {
                    Spanned {
                        value: tower_redis_ratelimit_spec::DEFAULT_DUPLICATE_WINDOW,
                        span,
                    }
                };
                set_spanned(&mut self.prevent_duplicate, span, window)?;
            }
            "block_for" => set_spanned(&mut self.block_for, span, duration(meta)?)?,
            "mode" => {
                let text = string(meta)?;
                set(&mut self.mode, span, text)?;
            }
            "max_delay" => set_spanned(&mut self.max_delay, span, duration(meta)?)?,
            "cost_header" => {
                let header = parsed(meta, |text| {
                    parse_header_name(text).map(|name| name.as_str().to_owned())
                })?;
                set_spanned(&mut self.cost_header, span, header)?;
            }
            "count_only" => set_spanned(&mut self.count_only, span, statuses(meta)?)?,
            "prefetch" => set_spanned(&mut self.prefetch, span, integer(meta)?)?,
            "max_in_flight" => set_spanned(&mut self.max_in_flight, span, integer(meta)?)?,
            "lease" => set_spanned(&mut self.lease, span, duration(meta)?)?,
            "scope" => set_spanned(&mut self.scope, span, parsed(meta, str::parse)?)?,
            "on_store_error" => {
                set_spanned(&mut self.on_store_error, span, parsed(meta, str::parse)?)?;
            }
            "meter" => {
                if self.meter.is_some() {
                    return Err(syn::Error::new(span, "this option is given twice"));
                }
                self.meter = Some(meter(meta)?);
            }
            _ => {
                return Err(meta.error(format!(
                    "unknown option `{option}`: expected one of {OPTIONS}"
                )));
            }
        }
        Ok(())
    }
}

/// `rule(limit = 10, period = "60s"[, burst = 20][, name = "minute"][, metered])`.
fn rule(meta: &ParseNestedMeta<'_>) -> syn::Result<RuleArg> {
    let (mut limit, mut period, mut burst, mut name) = (None, None, None, None);
    let mut metered = false;
    meta.parse_nested_meta(|inner| {
        if inner.path.is_ident("metered") {
            // `metered`, or `metered = true | false`.
            metered = if inner.input.peek(syn::Token![=]) {
                inner.value()?.parse::<syn::LitBool>()?.value
            } else {
                true
            };
            return Ok(());
        }
        let span = inner.path.span();
        if inner.path.is_ident("limit") {
            set_spanned(&mut limit, span, integer(&inner)?)
        } else if inner.path.is_ident("period") {
            set_spanned(&mut period, span, duration(&inner)?)
        } else if inner.path.is_ident("burst") {
            set_spanned(&mut burst, span, integer(&inner)?)
        } else if inner.path.is_ident("name") {
            let text = string(&inner)?;
            set_spanned(&mut name, span, spanned(text.value(), &text))
        } else {
            Err(inner
                .error("unknown option of rule: expected limit, period, burst, name or metered"))
        }
    })?;
    let span = meta.path.span();
    let limit = limit.ok_or_else(|| meta.error("rule(...) needs a limit, such as limit = 10"))?;
    let period =
        period.ok_or_else(|| meta.error("rule(...) needs a period, such as period = \"60s\""))?;
    Ok(RuleArg {
        span,
        limit,
        period,
        burst,
        name,
        metered,
    })
}

/// `meter(unit = "tokens"[, estimate = 500][, estimate_header = ".."][, usage_header = ".."]
/// [, max_usage = ..])`.
fn meter(meta: &ParseNestedMeta<'_>) -> syn::Result<MeterArg> {
    let (mut unit, mut estimate, mut estimate_header, mut usage_header, mut max_usage) =
        (None, None, None, None, None);
    let header = |inner: &ParseNestedMeta<'_>| {
        parsed(inner, |text| {
            parse_header_name(text).map(|name| name.as_str().to_owned())
        })
    };
    meta.parse_nested_meta(|inner| {
        let span = inner.path.span();
        if inner.path.is_ident("unit") {
            let text = string(&inner)?;
            set_spanned(&mut unit, span, spanned(text.value(), &text))
        } else if inner.path.is_ident("estimate") {
            set_spanned(&mut estimate, span, integer(&inner)?)
        } else if inner.path.is_ident("estimate_header") {
            set_spanned(&mut estimate_header, span, header(&inner)?)
        } else if inner.path.is_ident("usage_header") {
            set_spanned(&mut usage_header, span, header(&inner)?)
        } else if inner.path.is_ident("max_usage") {
            set_spanned(&mut max_usage, span, integer(&inner)?)
        } else {
            Err(inner.error(
                "unknown option of meter: expected unit, estimate, estimate_header, \
                 usage_header or max_usage",
            ))
        }
    })?;
    let unit =
        unit.ok_or_else(|| meta.error("meter(...) needs a unit, such as unit = \"tokens\""))?;
    Ok(MeterArg {
        span: meta.path.span(),
        unit,
        estimate,
        estimate_header,
        usage_header,
        max_usage,
    })
}

/// Sets an option given as a string literal, refusing it twice.
fn set(slot: &mut Option<Spanned<String>>, span: Span, text: LitStr) -> syn::Result<()> {
    set_spanned(slot, span, spanned(text.value(), &text))
}

fn set_spanned<T>(slot: &mut Option<Spanned<T>>, span: Span, value: Spanned<T>) -> syn::Result<()> {
    if slot.is_some() {
        return Err(syn::Error::new(span, "this option is given twice"));
    }
    *slot = Some(value);
    Ok(())
}

fn spanned<T>(value: T, literal: &impl syn::spanned::Spanned) -> Spanned<T> {
    Spanned {
        value,
        span: literal.span(),
    }
}

fn error(literal: &LitStr, message: impl std::fmt::Display) -> syn::Error {
    syn::Error::new(literal.span(), message)
}

/// A string option read by `parse` (a parser of the spec crate, the one config files use), its
/// error pointed at the literal.
fn parsed<T, E: std::fmt::Display>(
    meta: &ParseNestedMeta<'_>,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> syn::Result<Spanned<T>> {
    let text = string(meta)?;
    let value = parse(&text.value()).map_err(|message| error(&text, message))?;
    Ok(spanned(value, &text))
}

fn string(meta: &ParseNestedMeta<'_>) -> syn::Result<LitStr> {
    meta.value()?.parse()
}

/// `[401, 403, "5xx"]`: codes and classes, each checked as a config file's `count_only` is.
fn statuses(meta: &ParseNestedMeta<'_>) -> syn::Result<Spanned<Vec<CountedStatus>>> {
    let input = meta.value()?;
    let content;
    let brackets = syn::bracketed!(content in input);
    let elements = content.parse_terminated(syn::Lit::parse, syn::Token![,])?;
    let mut written = Vec::new();
    for element in &elements {
        let mut set = StatusSet::default();
        let status = match element {
            syn::Lit::Int(code) if code.suffix().is_empty() => {
                let code: i64 = code.base10_parse()?;
                set.insert_code(code)
                    .map_err(|invalid| syn::Error::new(element.span(), invalid.to_string()))?;
                CountedStatus::Code(code as u16)
            }
            syn::Lit::Str(text) => {
                let value = text.value();
                set.insert_written(&value)
                    .map_err(|invalid| error(text, invalid))?;
                match value.parse::<u16>() {
                    Ok(code) => CountedStatus::Code(code),
                    Err(_) => CountedStatus::Class(u16::from(value.as_bytes()[0] - b'0')),
                }
            }
            _ => {
                return Err(syn::Error::new(
                    element.span(),
                    "expected a status code (401) or a class (\"5xx\")",
                ));
            }
        };
        written.push(status);
    }
    let span = brackets.span.join();
    if written.is_empty() {
        return Err(syn::Error::new(
            span,
            "count_only lists no status: name the ones that count, such as [401, 403] or [\"5xx\"]",
        ));
    }
    Ok(Spanned {
        value: written,
        span,
    })
}

/// A whole number, written plainly (`10`, `1_000`): no sign, no type suffix.
fn integer(meta: &ParseNestedMeta<'_>) -> syn::Result<Spanned<u64>> {
    let literal: LitInt = meta.value()?.parse()?;
    match literal.base10_parse() {
        Ok(value) if literal.suffix().is_empty() => Ok(spanned(value, &literal)),
        _ => Err(syn::Error::new(
            literal.span(),
            format!("{literal} is not a whole number such as 10 (no sign, no type suffix)"),
        )),
    }
}

/// A duration as config files write it (`"500ms"`, `"1h30m"`). Zero is let through: the
/// builder's checks refuse it with their own message.
fn duration(meta: &ParseNestedMeta<'_>) -> syn::Result<Spanned<Duration>> {
    let text = string(meta)?;
    let duration = parse_any_duration(&text.value()).map_err(|message| error(&text, message))?;
    Ok(spanned(duration, &text))
}
