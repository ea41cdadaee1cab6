//! `#[derive(LimitPolicy)]` for [tower-redis-ratelimit]: a policy declared next to its handler,
//! as a type the handler's extractor requires, checked when the app compiles. Use it through `tower-redis-ratelimit` with its `macros` feature, which re-exports
//! the derive beside the trait.
//!
//! [tower-redis-ratelimit]: https://docs.rs/tower-redis-ratelimit

mod attribute;
mod expand;

use proc_macro::TokenStream;

/// Implements `LimitPolicy` for a type from its `#[rate_limit(...)]` attribute.
///
/// The attribute takes what a route entry of a config file takes, with the same names and value
/// forms:
///
/// | option | value |
/// |---|---|
/// | `name` | the policy's name (default: the type's name) |
/// | `key` | `"ip"` (default), `"user"`, `"global"`, `"header:<name>"`, `"query:<name>"` |
/// | `algorithm` | `"sliding_log"` (default), `"fixed_window"`, `"sliding_counter"`, `"token_bucket"` |
/// | `message` | the `detail` of the 429 body |
/// | `rule(limit = 10, period = "60s")` | one per rule, with `burst = n` and `name = ".."` optional |
/// | `prevent_duplicate` | the duplicate guard (5 s), or `prevent_duplicate(period = "2s")` |
/// | `block_for` | a penalty block after a refusal, such as `"15m"` |
/// | `mode` | `"enforce"` (default), `"shadow"`, or `"delay"` with `max_delay = "2s"` |
/// | `cost_header` | the header whose number is the request's cost |
/// | `prefetch` | units an instance takes ahead per identity, such as `100` |
/// | `count_only` | the statuses that count, codes and classes: `[401, 403]`, `["5xx"]` |
/// | `max_in_flight` | a concurrency limit, with `lease = "30s"` |
/// | `scope` | `"policy"` (default) or `"route"` |
/// | `on_store_error` | `"allow"` (default) or `"deny"` |
///
/// Every check `PolicyBuilder::build` makes runs here, from the same code: a policy it would
/// refuse is a compile error with its message, pointing at the argument at fault.
///
/// The type takes no generic parameters (each policy is one type with one name), and the code it
/// writes names the crate `::tower_redis_ratelimit`, so the dependency can't be renamed.
///
/// Clippy's `duplicated_attributes` lint misreads two `rule(limit = ..)` of one attribute as one
/// attribute given twice (rust-clippy#13238); allow it on the type.
#[proc_macro_derive(LimitPolicy, attributes(rate_limit))]
pub fn derive_limit_policy(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::derive(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}
