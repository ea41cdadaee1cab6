//! [`StoreSpec`]: the checked `store` of a configuration, and the store it opens.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::ConfigError;
use super::file::{StoreConfig, StoreTable};
#[cfg(feature = "redis")]
use crate::store::RedisStore;
use crate::store::{MemoryStore, Store, StoreError};

/// Where a configuration's counts live, checked (every URL parsed) but not connected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// The in-process [`MemoryStore`].
    Memory,
    /// One Redis node.
    Redis {
        /// Its `redis://` or `rediss://` URL.
        url: String,
    },
    /// A Redis Cluster, found from any of these node URLs.
    Cluster {
        /// Node URLs.
        urls: Vec<String>,
    },
    /// The primary that the sentinels at `urls` name `master`.
    Sentinel {
        /// The primary's name.
        master: String,
        /// Sentinel URLs.
        urls: Vec<String>,
    },
}

/// The Redis settings of a store: timeout, replicas, TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RedisSettings {
    pub(super) timeout: Duration,
    pub(super) wait_for_replicas: u32,
    pub(super) tls: Option<StoreTls>,
}

/// `tls_ca` and `tls_insecure`, checked: the TLS settings of a store over `rediss://`
/// ([`RateLimitConfig::store_tls`](super::RateLimitConfig::store_tls)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreTls {
    /// The CA file's path as written, and the PEM text read from it while checking (so a file
    /// that can't be read is a config error, not a failure at start).
    ca: Option<(String, Vec<u8>)>,
    /// Check no certificate at all.
    insecure: bool,
}

impl StoreTls {
    /// The path of `tls_ca`, as written: a PEM file of CA certificates trusted instead of the
    /// system's roots.
    pub fn ca_path(&self) -> Option<&str> {
        self.ca.as_ref().map(|(path, _)| path.as_str())
    }

    /// `tls_insecure`: whether no certificate is checked at all.
    pub fn insecure(&self) -> bool {
        self.insecure
    }
}

/// As a startup line shows it: `TLS CA "certs/ca.crt"`, `TLS CA: the system's roots` or
/// `TLS certificates NOT checked`.
impl fmt::Display for StoreTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.ca_path(), self.insecure) {
            (_, true) => f.write_str("TLS certificates NOT checked"),
            (Some(path), false) => write!(f, "TLS CA {path:?}"),
            (None, false) => f.write_str("TLS CA: the system's roots"),
        }
    }
}

impl StoreSpec {
    /// Whether the store's URLs are `rediss://`; `None` for the memory store.
    pub fn is_tls(&self) -> Option<bool> {
        let url = match self {
            StoreSpec::Memory => return None,
            StoreSpec::Redis { url } => url,
            StoreSpec::Cluster { urls } | StoreSpec::Sentinel { urls, .. } => urls.first()?,
        };
        Some(url.starts_with("rediss://"))
    }

    /// The store, not connected yet (a Redis that is down is a store failure per request).
    pub(super) fn open(&self, settings: &RedisSettings) -> Result<Arc<dyn Store>, StoreError> {
        #[cfg(feature = "redis")]
        if let Some(store) = self.open_redis(settings)? {
            return Ok(Arc::new(store));
        }
        // (Without the `redis` feature, a Redis store is refused when the file is checked.)
        let _ = settings;
        Ok(Arc::new(MemoryStore::new()))
    }

    /// The Redis store, not connected yet; `None` for the memory store.
    #[cfg(feature = "redis")]
    pub(super) fn open_redis(
        &self,
        settings: &RedisSettings,
    ) -> Result<Option<RedisStore>, StoreError> {
        let store = match self {
            StoreSpec::Memory => return Ok(None),
            StoreSpec::Redis { url } => RedisStore::from_url(url)?,
            #[cfg(feature = "cluster")]
            StoreSpec::Cluster { urls } => RedisStore::cluster(urls)?,
            #[cfg(feature = "sentinel")]
            StoreSpec::Sentinel { master, urls } => RedisStore::sentinel(master, urls)?,
            #[allow(unreachable_patterns)]
            _ => unreachable!("a store of a feature that is off is refused when checked"),
        };
        #[cfg(feature = "tls")]
        let store = match &settings.tls {
            Some(StoreTls { ca, insecure }) => {
                let options = crate::store::TlsOptions::new().insecure(*insecure);
                let options = match ca {
                    Some((_, pem)) => options.ca_pem(pem.clone()),
                    None => options,
                };
                store.with_tls(options)?
            }
            None => store,
        };
        Ok(Some(
            store
                .timeout(settings.timeout)
                .wait_for_replicas(settings.wait_for_replicas),
        ))
    }
}

/// As a startup line shows it: `memory`, the URL, `cluster(3 nodes)`, `sentinel(mymaster)`.
impl fmt::Display for StoreSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tls = if self.is_tls() == Some(true) {
            ", TLS"
        } else {
            ""
        };
        match self {
            StoreSpec::Memory => f.write_str("memory"),
            StoreSpec::Redis { url } => f.write_str(url),
            StoreSpec::Cluster { urls } => {
                let plural = if urls.len() == 1 { "" } else { "s" };
                write!(f, "cluster({} node{plural}{tls})", urls.len())
            }
            StoreSpec::Sentinel { master, .. } => write!(f, "sentinel({master}{tls})"),
        }
    }
}

/// What `store` may be.
const STORE_EXPECTED: &str = "expected \"memory\", a URL, or a table with cluster = [...] or \
                              sentinel = [...] and master = \"...\"";

/// Checks the `store` value.
pub(super) fn check_store(store: &StoreConfig) -> Result<StoreSpec, ConfigError> {
    match store {
        StoreConfig::Named(text) if text == "memory" => Ok(StoreSpec::Memory),
        #[cfg(feature = "redis")]
        StoreConfig::Named(url) if is_redis_url(url) => {
            // Checks the URL without connecting.
            RedisStore::from_url(url)
                .map_err(|error| ConfigError::new("store", format!("{url:?}: {error}")))?;
            Ok(StoreSpec::Redis { url: url.clone() })
        }
        #[cfg(not(feature = "redis"))]
        StoreConfig::Named(url) if is_redis_url(url) => Err(ConfigError::new(
            "store",
            format!("{url:?} needs the crate feature \"redis\" (a default feature)"),
        )),
        StoreConfig::Named(other) => Err(ConfigError::new(
            "store",
            format!(
                "unknown store {other:?}: expected \"memory\" or a URL such as \
                 \"redis://127.0.0.1:6379/0\""
            ),
        )),
        StoreConfig::Table(table) => check_store_table(table),
    }
}

fn is_redis_url(text: &str) -> bool {
    text.starts_with("redis://") || text.starts_with("rediss://")
}

/// `{ cluster = [...] }` or `{ sentinel = [...], master = "..." }`.
fn check_store_table(table: &StoreTable) -> Result<StoreSpec, ConfigError> {
    match (&table.cluster, &table.sentinel, &table.master) {
        (Some(_), Some(_), _) => Err(ConfigError::new(
            "store",
            "expected either cluster = [...] or sentinel = [...], not both",
        )),
        (Some(_), None, Some(_)) => Err(ConfigError::new(
            "store.master",
            "applies only with sentinel = [...] (a cluster finds its primaries itself)",
        )),
        (Some(list), None, None) => {
            let urls = check_urls("store.cluster", list, "node")?;
            #[cfg(feature = "cluster")]
            {
                RedisStore::cluster(&urls)
                    .map_err(|error| ConfigError::new("store.cluster", error.to_string()))?;
                Ok(StoreSpec::Cluster { urls })
            }
            #[cfg(not(feature = "cluster"))]
            {
                let _ = urls;
                Err(ConfigError::new(
                    "store.cluster",
                    "needs the crate feature \"cluster\"",
                ))
            }
        }
        (None, Some(list), master) => {
            let urls = check_urls("store.sentinel", list, "sentinel")?;
            let master = match master {
                Some(name) if !name.is_empty() => name.clone(),
                Some(_) => {
                    return Err(ConfigError::new(
                        "store.master",
                        "expected the name the sentinels know the primary by, such as \"mymaster\"",
                    ));
                }
                None => {
                    return Err(ConfigError::new(
                        "store.master",
                        "is required with sentinel = [...]: the name the sentinels know the \
                         primary by, such as \"mymaster\"",
                    ));
                }
            };
            #[cfg(feature = "sentinel")]
            {
                RedisStore::sentinel(&master, &urls)
                    .map_err(|error| ConfigError::new("store.sentinel", error.to_string()))?;
                Ok(StoreSpec::Sentinel { master, urls })
            }
            #[cfg(not(feature = "sentinel"))]
            {
                let _ = (master, urls);
                Err(ConfigError::new(
                    "store.sentinel",
                    "needs the crate feature \"sentinel\"",
                ))
            }
        }
        (None, None, _) => Err(ConfigError::new("store", STORE_EXPECTED)),
    }
}

/// The URL list at `field`: at least one, each `redis://` or `rediss://`, all of one scheme.
fn check_urls(field: &str, items: &[String], what: &str) -> Result<Vec<String>, ConfigError> {
    if items.is_empty() {
        return Err(ConfigError::new(
            field,
            format!("must list at least one {what} URL"),
        ));
    }
    for (index, url) in items.iter().enumerate() {
        let entry = format!("{field}[{index}]");
        if !is_redis_url(url) {
            return Err(ConfigError::new(
                entry,
                format!("{url:?} is not a redis:// or rediss:// URL"),
            ));
        }
        if items[0].starts_with("rediss://") != url.starts_with("rediss://") {
            return Err(ConfigError::new(
                entry,
                format!(
                    "{url:?} and {field}[0] differ in TLS: use rediss:// for every URL or for none"
                ),
            ));
        }
        // (Without the `redis` feature, cluster and sentinel, which need it, are refused next.)
        #[cfg(feature = "redis")]
        RedisStore::from_url(url)
            .map_err(|error| ConfigError::new(entry, format!("{url:?}: {error}")))?;
    }
    Ok(items.to_vec())
}

/// How a PEM certificate starts.
const CERTIFICATE_PEM: &str = "-----BEGIN CERTIFICATE-----";

/// `tls_ca` and `tls_insecure`: only with a Redis store over rediss://, and not both.
pub(super) fn check_tls(
    ca: Option<&str>,
    insecure: Option<bool>,
    store: &StoreSpec,
) -> Result<Option<StoreTls>, ConfigError> {
    let given = match (ca, insecure) {
        (None, None) => return Ok(None),
        (Some(_), _) => "tls_ca",
        (None, Some(_)) => "tls_insecure",
    };
    match store.is_tls() {
        None => {
            return Err(ConfigError::new(
                given,
                "applies only to a Redis store, not \"memory\"",
            ));
        }
        Some(false) => {
            return Err(ConfigError::new(
                given,
                "applies only to rediss:// URLs (TLS), and the store's are redis://",
            ));
        }
        Some(true) => {}
    }
    if !cfg!(feature = "tls") {
        return Err(ConfigError::new(given, "needs the crate feature \"tls\""));
    }
    let insecure = insecure.unwrap_or(false);
    if insecure && ca.is_some() {
        return Err(ConfigError::new(
            "tls_insecure",
            "true checks no certificate, so tls_ca would go unused: give one or the other",
        ));
    }
    let ca = match ca {
        None => None,
        Some(path) => {
            let pem = std::fs::read(path).map_err(|error| {
                ConfigError::new("tls_ca", format!("cannot read {path:?}: {error}"))
            })?;
            // Text without a certificate is no error to the TLS library, just no CA at all.
            if !pem
                .windows(CERTIFICATE_PEM.len())
                .any(|window| window == CERTIFICATE_PEM.as_bytes())
            {
                return Err(ConfigError::new(
                    "tls_ca",
                    format!("{path:?} holds no PEM certificate ({CERTIFICATE_PEM})"),
                ));
            }
            Some((path.to_owned(), pem))
        }
    };
    let tls = StoreTls { ca, insecure };
    // Builds the store's clients with these settings (still without connecting), which parses
    // the certificates.
    let settings = RedisSettings {
        timeout: crate::store::DEFAULT_TIMEOUT,
        wait_for_replicas: 0,
        tls: Some(tls.clone()),
    };
    store.open(&settings).map_err(|error| match &tls.ca {
        Some((path, _)) => ConfigError::new("tls_ca", format!("{path:?}: {error}")),
        None => ConfigError::new(given, error.to_string()),
    })?;
    Ok(Some(tls))
}
