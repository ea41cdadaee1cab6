//! The parts of a [tower-redis-ratelimit] policy that are plain values (its [`Rule`]s,
//! [`Algorithm`], [`Mode`], [`Scope`], [`OnStoreError`]), the values config files write
//! ([`parse_duration`], [`KeySpec`]) and the one copy of the checks that refuse a policy that
//! can't work ([`PolicyParts::check`], [`PolicyError`]).
//!
//! Three places run these checks: `PolicyBuilder::build` when an app starts, config files
//! through it, and `#[derive(LimitPolicy)]` when the app compiles. Keeping them here, in a crate
//! with no runtime, is what lets the derive refuse at compile time exactly what the builder
//! refuses at run time, with the same message. Use them through `tower-redis-ratelimit`, which
//! re-exports what an app names (in its `policy` module, and the common ones at its root).
//!
//! [tower-redis-ratelimit]: https://docs.rs/tower-redis-ratelimit

mod algorithm;
mod check;
mod error;
mod options;
mod rule;
mod status_set;
mod written;

pub use algorithm::{Algorithm, UnknownAlgorithm};
pub use check::{CheckedParts, PolicyParts};
pub use error::{ErrorSite, PolicyError, RulePart};
pub use options::{
    DEFAULT_DUPLICATE_WINDOW, Mode, ModeError, ModeName, OnStoreError, Scope, UnknownName,
};
pub use rule::{InvalidRuleName, MAX_LIMIT, MAX_PERIOD, Rule, check_rule_name};
pub use status_set::{InvalidStatus, StatusSet};
pub use written::{
    KeySpec, MAX_VERBATIM_LEN, is_valid_name, parse_any_duration, parse_duration, parse_header_name,
};
