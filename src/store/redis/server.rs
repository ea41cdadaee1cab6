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

/// Which server answered, as its `INFO server` names itself (`server_name`, and the version
/// field of that name).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum ServerSoftware {
    /// Redis: no `server_name`, or `server_name:redis`; its version is `redis_version`.
    Redis,
    /// Valkey (`server_name:valkey`), at its own version (`valkey_version`). Its `redis_version`
    /// is the Redis version it is compatible with (7.2.4 for every Valkey so far).
    Valkey(RedisVersion),
    /// Another server speaking Redis's protocol, as its `server_name` calls itself, with the
    /// version its `<name>_version` field gives, if any.
    Other {
        /// Its `server_name`.
        name: String,
        /// Its `<name>_version`, as written.
        version: Option<String>,
    },
}

/// What [`RedisStore::probe`](super::RedisStore::probe) found: print it at start.
///
/// ```text
/// Redis 7.0.15, standalone, functions, round trip 0.21 ms
/// Valkey 9.1.2 (as Redis 7.2.4), standalone, functions, round trip 0.19 ms
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerInfo {
    /// The Redis version the server runs as (`redis_version`; on a cluster, that of the oldest
    /// node): what decides which commands it has, and what the store checks against
    /// [`MINIMUM_VERSION`] (a Valkey's is the Redis version it is compatible with).
    pub version: RedisVersion,
    /// Which server it is, and its own version.
    pub software: ServerSoftware,
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
        let version = self.version;
        match &self.software {
            ServerSoftware::Redis => write!(f, "Redis {version}")?,
            ServerSoftware::Valkey(own) => write!(f, "Valkey {own} (as Redis {version})")?,
            ServerSoftware::Other { name, version: own } => {
                write!(
                    f,
                    "{name} {} (as Redis {version})",
                    own.as_deref().unwrap_or("?")
                )?;
            }
        }
        write!(
            f,
            ", {}, {}, round trip {:.2} ms",
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

/// What an `INFO server` text names: the Redis version the server runs as, its mode, and which
/// server it is. Ordered by version first, so the oldest of a cluster's nodes is the least.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Found {
    pub(super) version: RedisVersion,
    pub(super) mode: ServerMode,
    pub(super) software: ServerSoftware,
}

/// What an `INFO server` reply names: one node's text, or a map of them (redis-rs sends `INFO`
/// to every primary of a cluster), of which the oldest version counts.
pub(super) fn parse_info_reply(reply: Value) -> Result<Found, StoreError> {
    let text = |value: Value| -> Result<String, StoreError> {
        FromRedisValue::from_redis_value(value)
            .map_err(|error| StoreError::Protocol(format!("INFO server: {error}")))
    };
    match reply {
        Value::Map(nodes) => {
            let mut oldest: Option<Found> = None;
            for (_node, info) in nodes {
                let found = parse_info(&text(info)?)?;
                oldest = Some(match oldest {
                    Some(old) => old.min(found),
                    None => found,
                });
            }
            oldest.ok_or_else(|| StoreError::Protocol("INFO server: no node answered".into()))
        }
        reply => parse_info(&text(reply)?),
    }
}

/// What an `INFO server` text names.
fn parse_info(info: &str) -> Result<Found, StoreError> {
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
    // Valkey 8 on says `server_mode` where Redis says `redis_mode`.
    let mode = match field("redis_mode").or_else(|| field("server_mode")) {
        Some("cluster") => ServerMode::Cluster,
        _ => ServerMode::Standalone,
    };
    let software = match field("server_name") {
        None | Some("") | Some("redis") => ServerSoftware::Redis,
        Some("valkey") => match field("valkey_version").and_then(RedisVersion::parse) {
            Some(own) => ServerSoftware::Valkey(own),
            None => ServerSoftware::Other {
                name: "valkey".into(),
                version: field("valkey_version").map(str::to_owned),
            },
        },
        Some(name) => ServerSoftware::Other {
            name: name.to_owned(),
            version: field(&format!("{name}_version")).map(str::to_owned),
        },
    };
    Ok(Found {
        version,
        mode,
        software,
    })
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
            Found {
                version: RedisVersion::parse("6.2.14").unwrap(),
                mode: ServerMode::Cluster,
                software: ServerSoftware::Redis,
            }
        );
        let standalone = "redis_version:7.0.15\nredis_mode:standalone\n";
        assert_eq!(parse_info(standalone).unwrap().mode, ServerMode::Standalone);
        assert!(matches!(
            parse_info("redis_mode:standalone"),
            Err(StoreError::Protocol(_))
        ));
    }

    #[test]
    fn valkey_and_other_servers_are_named_as_they_name_themselves() {
        // Valkey 9.1.2's own words (a cluster node's), abridged.
        let valkey = "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\n\
                      valkey_version:9.1.2\r\nvalkey_release_stage:ga\r\nserver_mode:cluster\r\n";
        let found = parse_info(valkey).unwrap();
        assert_eq!(
            found.software,
            ServerSoftware::Valkey(RedisVersion::parse("9.1.2").unwrap())
        );
        assert_eq!(found.version, RedisVersion::parse("7.2.4").unwrap());
        assert_eq!(found.mode, ServerMode::Cluster);
        let info = ServerInfo {
            version: found.version,
            software: found.software,
            mode: ServerMode::Standalone,
            functions: true,
            round_trip: Duration::from_micros(190),
        };
        assert_eq!(
            info.to_string(),
            "Valkey 9.1.2 (as Redis 7.2.4), standalone, functions, round trip 0.19 ms"
        );
        // Another server: named as it says, checked by the Redis version it runs as.
        let other = "redis_version:7.4.0\nserver_name:kvd\nkvd_version:2.0-beta\n";
        let found = parse_info(other).unwrap();
        assert_eq!(
            found.software,
            ServerSoftware::Other {
                name: "kvd".into(),
                version: Some("2.0-beta".into())
            }
        );
        let info = ServerInfo {
            software: found.software,
            ..info
        };
        assert!(
            info.to_string()
                .starts_with("kvd 2.0-beta (as Redis 7.2.4), ")
        );
        // Redis names itself by its version alone.
        let redis = parse_info("redis_version:7.0.15\nredis_mode:standalone\n").unwrap();
        assert_eq!(redis.software, ServerSoftware::Redis);
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
        let oldest = parse_info_reply(reply).unwrap();
        assert_eq!(oldest.version, RedisVersion::parse("6.2.14").unwrap());
        assert_eq!(oldest.mode, ServerMode::Cluster);
        assert_eq!(
            parse_info_reply(node("7.0.15")).unwrap().version,
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
