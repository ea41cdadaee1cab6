//! Ways in for `fuzz/`'s targets to the parsers that aren't public: compiled only under
//! `--cfg fuzzing` (which `cargo fuzz` sets), never part of the API.

use http::HeaderMap;

use crate::headers::{PolicyItem, RuleEntry, SfName};

/// The store's reader of a batch reply (`store/redis/reply.rs`), on `packed` for checks whose
/// short forms have these lengths: `true` if it read one entry per check.
#[cfg(feature = "redis")]
pub fn read_batch_reply(packed: &[u8], short_lengths: &[usize]) -> bool {
    crate::store::redis::read_batch_reply_for_fuzzing(packed, short_lengths)
}

/// The `RateLimit-Policy` and `RateLimit` headers the layer writes for rules of these names,
/// with (quota, window seconds) and (remaining, reset seconds); `None` if a name is not one a
/// policy accepts (printable ASCII).
pub fn written_headers(rules: &[(String, (u64, u64), (u64, u64))]) -> Option<HeaderMap> {
    let names = rules
        .iter()
        .map(|(name, _, _)| SfName::new(name).ok())
        .collect::<Option<Vec<_>>>()?;
    let policies: Vec<PolicyItem<'_>> = names
        .iter()
        .zip(rules)
        .map(|(name, (_, (quota, window_secs), _))| PolicyItem {
            name,
            quota: *quota,
            window_secs: *window_secs,
        })
        .collect();
    let statuses = names
        .iter()
        .zip(rules)
        .map(|(name, (_, _, (remaining, reset_secs)))| RuleEntry {
            name,
            remaining: *remaining,
            reset_secs: *reset_secs,
        });
    let mut headers = HeaderMap::new();
    if !rules.is_empty() {
        headers.insert(
            "ratelimit-policy",
            crate::headers::policy_header_value(&policies),
        );
        headers.insert(
            "ratelimit",
            crate::headers::ratelimit_header_value(statuses.collect::<Vec<_>>()),
        );
    }
    Some(headers)
}

/// The largest number a structured-field integer holds: written numbers are clamped to it.
pub const SF_INTEGER_MAX: u64 = crate::headers::SF_INTEGER_MAX;
