//! [`Algorithm`]: how a policy counts requests.

use std::fmt;
use std::str::FromStr;

/// How a policy counts requests. Every algorithm checks all rules first and records the request in
/// all of them only if all pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// One counter per rule and window; windows are aligned to the epoch. Cheapest, but a client can
    /// get up to twice the limit across a window edge.
    FixedWindow,
    /// The timestamps of admitted requests; a request is admitted when fewer than `limit` fall in the
    /// last `period`. Exact at any instant; memory grows with the limit.
    #[default]
    SlidingLog,
    /// Two counters per rule, this window's and the last one's; the last one counts in proportion
    /// to how much of it the sliding window still overlaps. Constant memory per key, no 2x burst at
    /// window edges; an estimate that assumes the last window's requests were spread evenly.
    SlidingCounter,
    /// A token bucket, as GCRA: one timestamp per rule. The bucket holds [`Rule::burst_size`](crate::Rule::burst_size) units
    /// (the limit unless set) and refills at `limit` per `period`, one unit at a time, so a client
    /// that was quiet may burst, then gets the steady rate. Constant memory per key, no window
    /// edges at all.
    TokenBucket,
}

impl Algorithm {
    /// The name used in config files: `fixed_window`, `sliding_log`, `sliding_counter` or
    /// `token_bucket`.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::SlidingCounter => "sliding_counter",
            Algorithm::TokenBucket => "token_bucket",
        }
    }

    /// Whether a request that doesn't fit now can reserve its place in the future (the algorithms
    /// [`Mode::Delay`](crate::Mode::Delay) works with): the token bucket and the sliding log know the exact time a
    /// request fits and can record it for then.
    pub fn can_reserve(self) -> bool {
        matches!(self, Algorithm::SlidingLog | Algorithm::TokenBucket)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error of parsing an unknown algorithm name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown algorithm {0:?}: expected \"fixed_window\", \"sliding_log\", \"sliding_counter\" or \"token_bucket\""
)]
pub struct UnknownAlgorithm(pub String);

impl FromStr for Algorithm {
    type Err = UnknownAlgorithm;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "fixed_window" => Ok(Algorithm::FixedWindow),
            "sliding_log" => Ok(Algorithm::SlidingLog),
            "sliding_counter" => Ok(Algorithm::SlidingCounter),
            "token_bucket" => Ok(Algorithm::TokenBucket),
            other => Err(UnknownAlgorithm(other.to_owned())),
        }
    }
}
