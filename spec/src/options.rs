//! A policy's plain options: [`Scope`], [`OnStoreError`], [`Mode`], each with the name config
//! files and the derive's attribute give it.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Which requests share a bucket, besides having the same identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// One bucket per identity for every route the layer covers.
    #[default]
    Policy,
    /// One bucket per identity, method and route (a limit per endpoint). The route is
    /// axum's `MatchedPath` (so `/users/{id}` is one route), which is set when the layer is added
    /// with `Router::layer` or `route_layer`. Requests without it (a 404, a layer outside the router)
    /// share one `unmatched` route, so made-up paths can't mint fresh buckets; so do methods other
    /// than the standard nine.
    Route,
}

/// What happens when the store fails: an outage (Redis down, a timeout) or a fault (a script
/// error, a key of the wrong type, Redis out of memory; see `StoreError::is_fault`). Never a
/// 429: a store error is not a rate limit. Either way the failure is logged (an outage at `warn`,
/// a fault at `error`, a few lines a second per policy and kind at most) and counted.
///
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnStoreError {
    /// Let the request through, without rate-limit headers (fail open, default).
    #[default]
    Allow,
    /// Refuse the request with 503 and a problem+json body (fail closed).
    Deny,
}

/// What a policy does with a request that its rules refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Refuse it with 429 (default).
    #[default]
    Enforce,
    /// Let it through anyway, log it (`would be rate limited`) and count it
    /// (`RateLimitLayer::shadow_refusals`). The
    /// rate-limit headers still tell the truth, so a limit can be rolled out and watched before it
    /// bites. A request the rules refuse is recorded in none of them, as in enforce mode.
    Shadow,
    /// Hold it until the rules admit it, if that is at most `max_delay` away; a longer wait gets the
    /// 429 at once. The store reserves the request's place at the time it will fit, so waiting
    /// requests are admitted in order, exactly the limit per period, never polling. Needs an
    /// algorithm that can reserve ([`Algorithm::can_reserve`](crate::Algorithm::can_reserve)). A request refused for want of a
    /// concurrency slot (`PolicyBuilder::max_in_flight`) waits for one up to `max_delay`, first
    /// come first served (see the `concurrency` module). A held response carries the rate-limit
    /// headers of its check (its reservation counted), not counted down to when it is sent: its
    /// `t` may be up to the delay longer than what is left then, on the safe side.
    Delay {
        /// The longest a request is held.
        max_delay: Duration,
    },
}

impl Mode {
    /// The longest a refused request may wait to be admitted: zero unless [`Mode::Delay`].
    pub fn max_delay(self) -> Duration {
        match self {
            Mode::Delay { max_delay } => max_delay,
            Mode::Enforce | Mode::Shadow => Duration::ZERO,
        }
    }
}

/// The window of the duplicate guard when none is given: one request per 5 seconds.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(5);

/// A name that is none of an option's: the option, the name and the names it takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown value {name:?}: expected {expected}")]
pub struct UnknownName {
    /// The option (`scope`, `on_store_error`, `mode`).
    pub option: &'static str,
    /// The name given.
    pub name: String,
    /// The names it takes, as a message lists them.
    pub expected: &'static str,
}

/// One table per option, so a config file, the derive and `Display` can't disagree on a name.
macro_rules! named_values {
    ($type:ty, $option:literal, $expected:literal, { $($name:literal => $value:expr),+ $(,)? }) => {
        impl $type {
            /// The name config files (and the derive's attribute) give it.
            pub fn as_str(self) -> &'static str {
                $(if self == $value { return $name; })+
                unreachable!("every value has a name")
            }
        }

        impl FromStr for $type {
            type Err = UnknownName;

            fn from_str(name: &str) -> Result<Self, UnknownName> {
                match name {
                    $($name => Ok($value),)+
                    _ => Err(UnknownName {
                        option: $option,
                        name: name.to_owned(),
                        expected: $expected,
                    }),
                }
            }
        }

        impl fmt::Display for $type {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

named_values!(Scope, "scope", "\"policy\" or \"route\"", {
    "policy" => Scope::Policy,
    "route" => Scope::Route,
});

named_values!(OnStoreError, "on_store_error", "\"allow\" or \"deny\"", {
    "allow" => OnStoreError::Allow,
    "deny" => OnStoreError::Deny,
});

/// What [`Mode`] is named, without `Delay`'s wait: `enforce`, `shadow` or `delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeName {
    /// `enforce`.
    Enforce,
    /// `shadow`.
    Shadow,
    /// `delay`, which needs a `max_delay`.
    Delay,
}

named_values!(ModeName, "mode", "\"enforce\", \"shadow\" or \"delay\"", {
    "enforce" => ModeName::Enforce,
    "shadow" => ModeName::Shadow,
    "delay" => ModeName::Delay,
});

/// Why a written mode and `max_delay` don't make a [`Mode`]; the field that is wrong, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct ModeError {
    /// `mode` or `max_delay`.
    pub field: &'static str,
    /// What is wrong.
    pub reason: String,
}

impl Mode {
    /// The mode a config route (or the derive's attribute) writes: `mode` (default `enforce`) and
    /// the `max_delay` that `delay` needs and only `delay` takes.
    ///
    /// # Errors
    ///
    /// [`ModeError`] naming `mode` (an unknown name) or `max_delay` (missing with `delay`, given
    /// without it).
    pub fn from_written(
        mode: Option<&str>,
        max_delay: Option<Duration>,
    ) -> Result<Mode, ModeError> {
        let name = match mode {
            None => ModeName::Enforce,
            Some(text) => text.parse().map_err(|error: UnknownName| ModeError {
                field: "mode",
                reason: error.to_string(),
            })?,
        };
        match (name, max_delay) {
            (ModeName::Enforce, None) => Ok(Mode::Enforce),
            (ModeName::Shadow, None) => Ok(Mode::Shadow),
            (ModeName::Delay, Some(max_delay)) => Ok(Mode::Delay { max_delay }),
            (ModeName::Delay, None) => Err(ModeError {
                field: "max_delay",
                reason: "is required with mode = \"delay\": the longest a request may wait, \
                         such as \"2s\""
                    .to_owned(),
            }),
            (ModeName::Enforce | ModeName::Shadow, Some(_)) => Err(ModeError {
                field: "max_delay",
                reason: "applies only with mode = \"delay\"".to_owned(),
            }),
        }
    }

    /// The mode's name, without `Delay`'s wait.
    pub fn name(self) -> ModeName {
        match self {
            Mode::Enforce => ModeName::Enforce,
            Mode::Shadow => ModeName::Shadow,
            Mode::Delay { .. } => ModeName::Delay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reads_back_as_its_value() {
        for scope in [Scope::Policy, Scope::Route] {
            assert_eq!(scope.as_str().parse::<Scope>(), Ok(scope));
        }
        for on_error in [OnStoreError::Allow, OnStoreError::Deny] {
            assert_eq!(on_error.to_string().parse::<OnStoreError>(), Ok(on_error));
        }
        assert_eq!(
            "maybe".parse::<OnStoreError>().unwrap_err().to_string(),
            "unknown value \"maybe\": expected \"allow\" or \"deny\""
        );
    }

    #[test]
    fn a_written_mode_needs_max_delay_exactly_with_delay() {
        let second = Some(Duration::from_secs(1));
        assert_eq!(Mode::from_written(None, None), Ok(Mode::Enforce));
        assert_eq!(Mode::from_written(Some("shadow"), None), Ok(Mode::Shadow));
        assert_eq!(
            Mode::from_written(Some("delay"), second),
            Ok(Mode::Delay {
                max_delay: Duration::from_secs(1)
            })
        );
        let field = |mode, max_delay| Mode::from_written(mode, max_delay).unwrap_err().field;
        assert_eq!(field(Some("delay"), None), "max_delay");
        assert_eq!(field(Some("enforce"), second), "max_delay");
        assert_eq!(field(Some("later"), None), "mode");
    }
}
