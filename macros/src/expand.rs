//! Checks the attribute's policy with the builder's own checks and writes the `impl LimitPolicy`
//! that builds it.

use std::time::Duration;

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::DeriveInput;
use syn::ext::IdentExt as _;
use syn::spanned::Spanned as _;
use tower_redis_ratelimit_spec::{
    Algorithm, ErrorSite, KeySpec, Mode, OnStoreError, PolicyParts, Rule, RulePart, Scope,
};

use crate::attribute::{CountedStatus, MeterArg, RateLimitArgs, RuleArg};

/// The key prefix of a derived policy: the builder's default (the attribute doesn't take one).
const PREFIX: &str = "rl";

pub(crate) fn derive(input: &DeriveInput) -> syn::Result<TokenStream> {
    if let Some(parameter) = input.generics.params.first() {
        // A policy is one type with one name: `G<A>` and `G<B>` would share one set of counts.
        return Err(syn::Error::new_spanned(
            parameter,
            "#[derive(LimitPolicy)] takes a type without generic parameters: each policy is a \
             type of its own, with a name of its own",
        ));
    }
    let (args, attribute) = RateLimitArgs::from_attributes(&input.attrs)?;
    let attribute_span = attribute.span();
    let name = args.name.as_ref().map_or_else(
        || input.ident.unraw().to_string(),
        |name| name.value.clone(),
    );
    let mode = Mode::from_written(
        args.mode.as_ref().map(|mode| mode.value.as_str()),
        args.max_delay.as_ref().map(|max_delay| max_delay.value),
    )
    .map_err(|error| {
        // A missing max_delay is pointed at the mode that needs it.
        let span = match (error.field, &args.max_delay, &args.mode) {
            ("max_delay", Some(max_delay), _) => max_delay.span,
            (_, _, Some(mode)) => mode.span,
            _ => attribute_span,
        };
        syn::Error::new(span, error.to_string())
    })?;
    let algorithm = args
        .algorithm
        .as_ref()
        .map_or_else(Algorithm::default, |algorithm| algorithm.value);
    let parts = PolicyParts {
        mode,
        block_for: args.block_for.as_ref().map(|block| block.value),
        duplicate_window: args.prevent_duplicate.as_ref().map(|window| window.value),
        max_in_flight: args.max_in_flight.as_ref().map(|n| n.value),
        lease: args.lease.as_ref().map(|lease| lease.value),
        count_only: args.count_only.is_some(),
        prefetch: args.prefetch.as_ref().map(|units| units.value),
        meter_unit: args.meter.as_ref().map(|meter| meter.unit.value.as_str()),
        max_usage: args
            .meter
            .as_ref()
            .and_then(|meter| meter.max_usage.as_ref())
            .map(|units| units.value),
        ..PolicyParts::new(
            &name,
            PREFIX,
            args.rules.iter().map(rule_of).collect(),
            algorithm,
        )
    };
    if let Err(error) = parts.check() {
        return Err(match span_of(&error.site(), &args, &input.ident) {
            Some(span) => syn::Error::new(span, error.to_string()),
            // About the policy as a whole: the whole attribute.
            None => syn::Error::new_spanned(&attribute, error.to_string()),
        });
    }
    Ok(implementation(input, &name, &args, mode, algorithm))
}

/// The rule an argument writes, as the builder gets it.
fn rule_of(arg: &RuleArg) -> Rule {
    let mut rule = Rule::new(arg.limit.value, arg.period.value);
    if let Some(burst) = &arg.burst {
        rule = rule.burst(burst.value);
    }
    if let Some(name) = &arg.name {
        rule = rule.named(name.value.clone());
    }
    if arg.metered {
        rule = rule.metered();
    }
    rule
}

/// Where an error of the checks points: the argument it is about (`None`: the attribute).
fn span_of(site: &ErrorSite, args: &RateLimitArgs, ident: &syn::Ident) -> Option<Span> {
    match *site {
        ErrorSite::Name => Some(args.name.as_ref().map_or(ident.span(), |name| name.span)),
        ErrorSite::Prefix | ErrorSite::Rules | ErrorSite::Policy | ErrorSite::Override(_) => None,
        ErrorSite::Rule { index, part } => match args.rules.get(index) {
            Some(rule) => Some(match part {
                RulePart::Limit => rule.limit.span,
                RulePart::Period => rule.period.span,
                RulePart::Burst => rule.burst.as_ref().map_or(rule.span, |burst| burst.span),
                RulePart::Name => rule.name.as_ref().map_or(rule.span, |name| name.span),
                RulePart::Whole => rule.span,
            }),
            // Past the rules: the duplicate guard.
            None => args.prevent_duplicate.as_ref().map(|guard| guard.span),
        },
        ErrorSite::Option(name) => match name {
            "block_for" => args.block_for.as_ref().map(|arg| arg.span),
            "prevent_duplicate" => args.prevent_duplicate.as_ref().map(|arg| arg.span),
            "max_delay" => args.max_delay.as_ref().map(|arg| arg.span),
            "max_in_flight" => args.max_in_flight.as_ref().map(|arg| arg.span),
            // A lease missing is the max_in_flight's fault.
            "lease" => args
                .lease
                .as_ref()
                .map(|arg| arg.span)
                .or(args.max_in_flight.as_ref().map(|arg| arg.span)),
            "mode" => args.mode.as_ref().map(|arg| arg.span),
            "count_only" => args.count_only.as_ref().map(|arg| arg.span),
            "prefetch" => args.prefetch.as_ref().map(|arg| arg.span),
            "max_usage" => args
                .meter
                .as_ref()
                .map(|meter| meter.max_usage.as_ref().map_or(meter.span, |arg| arg.span)),
            "meter" => args.meter.as_ref().map(|meter| meter.span),
            _ => None,
        },
    }
}

/// The `impl LimitPolicy` that builds the checked policy.
fn implementation(
    input: &DeriveInput,
    name: &str,
    args: &RateLimitArgs,
    mode: Mode,
    algorithm: Algorithm,
) -> TokenStream {
    let krate = quote!(::tower_redis_ratelimit);
    let ident = &input.ident;
    let (impl_generics, type_generics, where_clause) = input.generics.split_for_impl();
    let mut calls = Vec::new();
    if let Some(key) = &args.key {
        let key = key_tokens(&key.value);
        calls.push(quote!(.key(#key)));
    }
    if args.algorithm.is_some() {
        let algorithm = algorithm_tokens(algorithm);
        calls.push(quote!(.algorithm(#krate::Algorithm::#algorithm)));
    }
    if let Some(message) = &args.message {
        let message = &message.value;
        calls.push(quote!(.message(#message)));
    }
    for rule in &args.rules {
        let limit = rule.limit.value;
        let period = duration_tokens(rule.period.value);
        let mut tokens = quote!(#krate::Rule::new(#limit, #period));
        if let Some(burst) = &rule.burst {
            let burst = burst.value;
            tokens = quote!(#tokens.burst(#burst));
        }
        if let Some(name) = &rule.name {
            let name = &name.value;
            tokens = quote!(#tokens.named(#name));
        }
        if rule.metered {
            tokens = quote!(#tokens.metered());
        }
        calls.push(quote!(.rule(#tokens)));
    }
    if let Some(window) = &args.prevent_duplicate {
        let window = duration_tokens(window.value);
        calls.push(quote!(.prevent_duplicate(#window)));
    }
    if let Some(block) = &args.block_for {
        let block = duration_tokens(block.value);
        calls.push(quote!(.block_for(#block)));
    }
    if args.mode.is_some() {
        let mode = match mode {
            Mode::Enforce => quote!(#krate::Mode::Enforce),
            Mode::Shadow => quote!(#krate::Mode::Shadow),
            Mode::Delay { max_delay } => {
                let max_delay = duration_tokens(max_delay);
                quote!(#krate::Mode::Delay { max_delay: #max_delay })
            }
        };
        calls.push(quote!(.mode(#mode)));
    }
    if let Some(header) = &args.cost_header {
        let header = &header.value;
        calls.push(quote!(.cost_from_header(
            #krate::__private::HeaderName::from_static(#header)
        )));
    }
    if let Some(statuses) = &args.count_only {
        // A match over the codes and ranges written, checked when the app compiled.
        let patterns = statuses.value.iter().map(|status| match *status {
            CountedStatus::Code(code) => quote!(#code),
            CountedStatus::Class(class) => {
                let (first, last) = (class * 100, class * 100 + 99);
                quote!(#first..=#last)
            }
        });
        calls.push(quote!(.count_only(|status: #krate::__private::StatusCode| {
            ::core::matches!(status.as_u16(), #(#patterns)|*)
        })));
    }
    if let Some(units) = &args.prefetch {
        let units = units.value;
        calls.push(quote!(.prefetch(#units)));
    }
    if let (Some(n), Some(lease)) = (&args.max_in_flight, &args.lease) {
        let n = n.value;
        let lease = duration_tokens(lease.value);
        calls.push(quote!(.max_in_flight(#n).lease(#lease)));
    }
    if let Some(scope) = &args.scope {
        let scope = match scope.value {
            Scope::Policy => quote!(Policy),
            Scope::Route => quote!(Route),
        };
        calls.push(quote!(.scope(#krate::policy::Scope::#scope)));
    }
    if let Some(meter) = &args.meter {
        calls.push(meter_tokens(meter));
    }
    if let Some(on_error) = &args.on_store_error {
        let on_error = match on_error.value {
            OnStoreError::Allow => quote!(Allow),
            OnStoreError::Deny => quote!(Deny),
        };
        calls.push(quote!(.on_store_error(#krate::OnStoreError::#on_error)));
    }
    quote! {
        impl #impl_generics #krate::LimitPolicy for #ident #type_generics #where_clause {
            fn policy() -> ::core::result::Result<#krate::Policy, #krate::PolicyError> {
                #krate::Policy::builder(#name)
                    #(#calls)*
                    .build()
            }
        }
    }
}

/// `.meter(..)` of a `meter(...)` argument: its unit, its estimate (a header's whole number,
/// else the fixed one, else 1), its usage header and bound.
fn meter_tokens(meter: &MeterArg) -> TokenStream {
    let krate = quote!(::tower_redis_ratelimit);
    let unit = &meter.unit.value;
    let fixed = meter.estimate.as_ref().map_or(1, |estimate| estimate.value);
    let mut tokens = match &meter.estimate_header {
        Some(header) => {
            let header = &header.value;
            quote!(#krate::meter::Meter::new(#unit).estimate(move |parts| {
                parts
                    .headers
                    .get(#krate::__private::HeaderName::from_static(#header))
                    .and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok())
                    .unwrap_or(#fixed)
            }))
        }
        None => quote!(#krate::meter::Meter::new(#unit).estimate(|_| #fixed)),
    };
    if let Some(header) = &meter.usage_header {
        let header = &header.value;
        tokens = quote!(#tokens.usage_header(#krate::__private::HeaderName::from_static(#header)));
    }
    if let Some(units) = &meter.max_usage {
        let units = units.value;
        tokens = quote!(#tokens.max_usage(#units));
    }
    quote!(.meter(#tokens))
}

fn key_tokens(key: &KeySpec) -> TokenStream {
    let krate = quote!(::tower_redis_ratelimit);
    match key {
        KeySpec::Ip => quote!(#krate::Key::ip()),
        KeySpec::User => quote!(#krate::Key::user()),
        KeySpec::Global => quote!(#krate::Key::global()),
        KeySpec::Header(name) => {
            let name = name.as_str();
            quote!(#krate::Key::header(#krate::__private::HeaderName::from_static(#name)))
        }
        KeySpec::Query(name) => quote!(#krate::Key::query(#name)),
    }
}

fn algorithm_tokens(algorithm: Algorithm) -> TokenStream {
    match algorithm {
        Algorithm::FixedWindow => quote!(FixedWindow),
        Algorithm::SlidingLog => quote!(SlidingLog),
        Algorithm::SlidingCounter => quote!(SlidingCounter),
        Algorithm::TokenBucket => quote!(TokenBucket),
    }
}

/// A duration as a constant expression, exactly.
fn duration_tokens(duration: Duration) -> TokenStream {
    let (secs, nanos) = (duration.as_secs(), duration.subsec_nanos());
    quote!(::core::time::Duration::new(#secs, #nanos))
}
