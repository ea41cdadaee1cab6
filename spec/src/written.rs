//! Values as config files and the derive's attribute write them: durations (`"500ms"`, `"1h30m"`)
//! and keys (`"ip"`, `"header:x-api-key"`). One parser each, so a limit moves between a file and
//! the code without relearning it.

use std::time::Duration;

use http::HeaderName;

/// A duration as people write it (`"500ms"`, `"10s"`, `"1m"`, `"1h30m"`, `"1d"`), through
/// `humantime`; more than zero.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit_spec::parse_duration;
///
/// assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
/// assert!(parse_duration("0s").unwrap_err().contains("longer than zero"));
/// ```
///
/// # Errors
///
/// What is wrong, as a message: not a duration, or zero.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    match parse_any_duration(text)? {
        duration if duration.is_zero() => Err(format!("{text:?} must be longer than zero")),
        duration => Ok(duration),
    }
}

/// [`parse_duration`] that lets zero through, for a caller whose checks refuse it with their own
/// message (the derive leaves a zero period to [`PolicyParts::check`](crate::PolicyParts::check)).
///
/// # Errors
///
/// What is wrong, as a message: not a duration.
pub fn parse_any_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|error| {
        format!(
            "invalid duration {text:?} ({error}): expected a number and a unit, such as \
             \"500ms\", \"10s\", \"1m\", \"1h30m\" or \"1d\""
        )
    })
}

/// A header name as written (`cost_header`, `tier_header`, a `header:` key's name).
///
/// # Errors
///
/// What is wrong, as a message.
pub fn parse_header_name(text: &str) -> Result<HeaderName, String> {
    HeaderName::try_from(text).map_err(|_| format!("{text:?} is not a header name"))
}

/// A key as written: `ip`, `user`, `global`, `header:<name>` or `query:<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySpec {
    /// `ip`: the client IP.
    Ip,
    /// `user`: the authenticated user id.
    User,
    /// `global`: one bucket for everyone.
    Global,
    /// `header:<name>`: a request header, such as an API key.
    Header(HeaderName),
    /// `query:<name>`: a query parameter.
    Query(String),
}

impl KeySpec {
    /// Parses a written key.
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_redis_ratelimit_spec::KeySpec;
    ///
    /// let api_key = HeaderName::from_static("x-api-key");
    /// assert_eq!(KeySpec::parse("header:X-Api-Key"), Ok(KeySpec::Header(api_key)));
    /// assert!(KeySpec::parse("cookie:id").is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// What is wrong, as a message: an unknown kind, a bad header name, no query parameter.
    pub fn parse(text: &str) -> Result<KeySpec, String> {
        match text {
            "ip" => Ok(KeySpec::Ip),
            "user" => Ok(KeySpec::User),
            "global" => Ok(KeySpec::Global),
            _ => match (text.strip_prefix("header:"), text.strip_prefix("query:")) {
                (Some(name), _) => HeaderName::try_from(name)
                    .map(KeySpec::Header)
                    .map_err(|_| format!("{name:?} is not a valid header name (in {text:?})")),
                (_, Some("")) => Err(format!("{text:?} names no query parameter")),
                (_, Some(name)) => Ok(KeySpec::Query(name.to_owned())),
                (None, None) => Err(format!(
                    "unknown key {text:?}: expected \"ip\", \"user\", \"global\", \
                     \"header:<name>\" or \"query:<name>\""
                )),
            },
        }
    }
}

/// Whether `name` may be a policy name or key prefix: 1 to 64 characters of letters, digits and
/// `-._~@+=!*(),/`, the rule a policy's build applies (names are part of every store key, and
/// nothing else in a key is written as it is).
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_VERBATIM_LEN && name.bytes().all(is_safe_byte)
}

/// The longest value written into a store key as it is (longer ones are hashed).
#[doc(hidden)]
pub const MAX_VERBATIM_LEN: usize = 64;

/// Characters that may appear verbatim in a key component: nothing that separates (`:`), tags
/// (`{`, `}`), marks a hash (`#`), escapes (`%`) or spaces.
fn is_safe_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-._~@+=!*(),/".contains(&byte)
}
