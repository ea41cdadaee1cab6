//! What the store learns of the Redis it talks to: its version (checked against the oldest the
//! store's Lua runs on), its mode, and what [`RedisStore::probe`](super::RedisStore::probe)
//! answers an app at start.

use std::fmt;
use std::time::Duration;

use ::redis::{FromRedisValue, Value};

use super::super::StoreError;

/// The oldest Redis the store runs on. Its Lua needs `SET … PXAT` (6.2); the `NX`/`GT` options of
/// `PEXPIREAT` and functions (7.0) are used where the server has them.
pub const MINIMUM_VERSION: RedisVersion = RedisVersion {
    major: 6,
    minor: 2,
    patch: 0,
};

/// A Redis version, as `INFO server` reports it (`redis_version`; Valkey reports the Redis
/// version it is compatible with there too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RedisVersion {
    /// The major version: 7 of 7.0.15.
    pub major: u32,
    /// The minor version: 0 of 7.0.15.
    pub minor: u32,
    /// The patch version: 15 of 7.0.15.
    pub patch: u32,
}

impl RedisVersion {
    /// Whether the server has functions (`FUNCTION LOAD`, `FCALL`): Redis 7.0 on.
    pub fn has_functions(self) -> bool {
        self.major >= 7
    }

    /// `7.0.15` as a version; `None` for anything else.
    pub fn parse(text: &str) -> Option<RedisVersion> {
        let mut parts = text.trim().splitn(3, '.');
        let mut part = || parts.next()?.parse().ok();
        Some(RedisVersion {
            major: part()?,
            minor: part()?,
            patch: part()?,
        })
    }
}

impl fmt::Display for RedisVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// How the server runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ServerMode {
    /// One node on its own.
    Standalone,
    /// A node of a Redis Cluster (the store's checks go to the primary of each identity's slot).
    Cluster,
    /// The primary that Redis Sentinel names (the store asks the sentinels after a failover).
    SentinelManaged,
}

impl fmt::Display for ServerMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ServerMode::Standalone => "standalone",
            ServerMode::Cluster => "cluster",
            ServerMode::SentinelManaged => "sentinel-managed",
        })
    }
}

/// What [`RedisStore::probe`](super::RedisStore::probe) found: print it at start.
///
/// ```text
/// Redis 7.0.15, standalone, functions, round trip 0.21 ms
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerInfo {
    /// The server's version (on a cluster, that of the node that answered).
    pub version: RedisVersion,
    /// How it runs.
    pub mode: ServerMode,
    /// Whether the store calls its Lua as a function library (`FCALL`, Redis 7 on one node or a
    /// Sentinel's primary, unless an ACL forbids functions) rather than as a script (`EVALSHA`).
    pub functions: bool,
    /// How long one `INFO server` took, there and back, on the store's connection.
    pub round_trip: Duration,
}

impl fmt::Display for ServerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Redis {}, {}, {}, round trip {:.2} ms",
            self.version,
            self.mode,
            if self.functions {
                "functions"
            } else {
                "scripts"
            },
            self.round_trip.as_secs_f64() * 1_000.0
        )
    }
}

/// The version and mode an `INFO server` reply names: one node's text, or a map of them (redis-rs
/// sends `INFO` to every primary of a cluster), of which the oldest version counts.
pub(super) fn parse_info_reply(reply: Value) -> Result<(RedisVersion, ServerMode), StoreError> {
    let text = |value: Value| -> Result<String, StoreError> {
        FromRedisValue::from_redis_value(value)
            .map_err(|error| StoreError::Protocol(format!("INFO server: {error}")))
    };
    match reply {
        Value::Map(nodes) => {
            let mut oldest: Option<(RedisVersion, ServerMode)> = None;
            for (_node, info) in nodes {
                let found = parse_info(&text(info)?)?;
                oldest = Some(oldest.map_or(found, |old| old.min(found)));
            }
            oldest.ok_or_else(|| StoreError::Protocol("INFO server: no node answered".into()))
        }
        reply => parse_info(&text(reply)?),
    }
}

/// The version and mode an `INFO server` text names.
fn parse_info(info: &str) -> Result<(RedisVersion, ServerMode), StoreError> {
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let version = field("redis_version")
        .and_then(RedisVersion::parse)
        .ok_or_else(|| {
            StoreError::Protocol("INFO server names no redis_version the store can read".into())
        })?;
    let mode = match field("redis_mode") {
        Some("cluster") => ServerMode::Cluster,
        _ => ServerMode::Standalone,
    };
    Ok((version, mode))
}

/// `Ok` for a version the store runs on, else the error that says which it needs.
pub(super) fn supported(version: RedisVersion) -> Result<(), StoreError> {
    if version >= MINIMUM_VERSION {
        Ok(())
    } else {
        Err(too_old(version))
    }
}

/// The error of a server too old for the store.
pub(super) fn too_old(version: RedisVersion) -> StoreError {
    StoreError::UnsupportedVersion {
        found: version.to_string(),
        minimum: "6.2",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_and_compare() {
        let version = |text| RedisVersion::parse(text).unwrap();
        assert_eq!(version("7.0.15").to_string(), "7.0.15");
        assert!(version("6.2.14") >= MINIMUM_VERSION);
        assert!(version("6.0.9") < MINIMUM_VERSION);
        assert!(version("10.0.0") > version("7.4.2"));
        assert!(!version("6.2.14").has_functions());
        assert!(version("7.0.0").has_functions());
        assert_eq!(RedisVersion::parse("7.0"), None);
        assert_eq!(RedisVersion::parse("seven"), None);
    }

    #[test]
    fn info_names_version_and_mode() {
        let info = "# Server\r\nredis_version:6.2.14\r\nredis_git_sha1:0\r\nredis_mode:cluster\r\n";
        assert_eq!(
            parse_info(info).unwrap(),
            (RedisVersion::parse("6.2.14").unwrap(), ServerMode::Cluster)
        );
        let standalone = "redis_version:7.0.15\nredis_mode:standalone\n";
        assert_eq!(parse_info(standalone).unwrap().1, ServerMode::Standalone);
        assert!(matches!(
            parse_info("redis_mode:standalone"),
            Err(StoreError::Protocol(_))
        ));
    }

    #[test]
    fn of_many_nodes_the_oldest_counts() {
        let node = |version: &str| {
            Value::BulkString(format!("redis_version:{version}\r\nredis_mode:cluster\r\n").into())
        };
        let reply = Value::Map(vec![
            (Value::SimpleString("127.0.0.1:7000".into()), node("7.0.15")),
            (Value::SimpleString("127.0.0.1:7001".into()), node("6.2.14")),
        ]);
        assert_eq!(
            parse_info_reply(reply).unwrap(),
            (RedisVersion::parse("6.2.14").unwrap(), ServerMode::Cluster)
        );
        assert_eq!(
            parse_info_reply(node("7.0.15")).unwrap().0,
            RedisVersion::parse("7.0.15").unwrap()
        );
    }

    #[test]
    fn an_old_server_is_refused_naming_both_versions() {
        let error = supported(RedisVersion::parse("6.0.9").unwrap()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "Redis 6.0.9 is too old for the rate limiter: it needs Redis 6.2 or later"
        );
        assert!(supported(RedisVersion::parse("6.2.0").unwrap()).is_ok());
    }
}
