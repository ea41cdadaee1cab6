//! What a store connects to (one node, a Redis Cluster, a Sentinel-managed primary, over the
//! user's pool or a client of its own), and the constructors that say so.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::{RedisError, Script};

use super::batch::Batcher;
use super::connection::Connector;
use crate::store::StoreError;

use super::client::{CallStats, ServerCheck};
#[cfg(feature = "cluster")]
use super::cluster;
use super::script::SCRIPT;
#[cfg(feature = "tls")]
use super::tls::TlsOptions;
use super::{DEFAULT_TIMEOUT, resets};
use super::{RedisStore, Shared, TestHooks};

/// What a store of its own connects to, kept so [`RedisStore::with_tls`] can rebuild its client.
#[derive(Debug, Clone)]
pub(super) enum Target {
    Node(String),
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
    #[cfg(feature = "sentinel")]
    Sentinel {
        master: String,
        urls: Vec<String>,
    },
}

impl RedisStore {
    pub(super) fn with_connector(connector: Connector, target: Option<Target>) -> Self {
        let functions = AtomicBool::new(!connector.is_cluster());
        RedisStore {
            shared: Arc::new(Shared {
                connector,
                target,
                connection: Mutex::new(None),
                reconnecting: tokio::sync::Mutex::new(()),
                functions,
                script: Script::new(SCRIPT),
                batcher: Batcher::default(),
                call_stats: CallStats::default(),
                hooks: TestHooks::default(),
                server: Mutex::new(ServerCheck::default()),
                resets: resets::ResetFeed::default(),
                notices_client: None,
                mirrors: Default::default(),
            }),
            timeout: DEFAULT_TIMEOUT,
            wait_for_replicas: None,
        }
    }

    /// A store over `pool` (one Redis node), with the default timeout of 250 ms.
    ///
    /// A pool lends no connection to subscribe with: give the store a URL for its reset
    /// notices with [`RedisStore::reset_notices_from`], or a `reset` reaches the units other
    /// instances took ahead ([`PolicyBuilder::prefetch`](crate::PolicyBuilder::prefetch)) only
    /// when their window ends.
    pub fn new(pool: deadpool_redis::Pool) -> Self {
        RedisStore::with_connector(Connector::Pool(pool), None)
    }

    /// Hears the store's reset notices ([`Store::watch_resets`](crate::store::Store::watch_resets)) through a subscription to
    /// `url`: for a store over a pool you built ([`RedisStore::new`], `from_cluster_pool`,
    /// `from_sentinel_pool`), which lends no connection to subscribe with. Any node that hears
    /// what the store's scripts publish will do: the node itself, any node of a cluster (its
    /// pub/sub reaches every node), a replica of the primary. Call it before the store is
    /// cloned or used.
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a malformed URL, or a store already cloned or used.
    pub fn reset_notices_from(mut self, url: &str) -> Result<Self, StoreError> {
        let client =
            ::redis::Client::open(url).map_err(|error| StoreError::Config(error.to_string()))?;
        let shared = Arc::get_mut(&mut self.shared).ok_or_else(|| {
            StoreError::Config("reset_notices_from: the store was already cloned or used".into())
        })?;
        shared.notices_client = Some(client);
        Ok(self)
    }

    /// A store with a client of its own for `url` (`redis://host:port/db`, or `rediss://` with
    /// feature `tls`). Nothing connects yet: a Redis that is down makes requests fail open or
    /// closed, not this call; a malformed URL is an error here.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        let target = Target::Node(url.to_owned());
        Ok(RedisStore::with_connector(
            target.connector(None)?,
            Some(target),
        ))
    }

    /// A store over a Redis Cluster, found from any of its nodes' URLs (`redis://10.0.0.1:6379`).
    /// Each check goes to the primary of its identity's slot; `MOVED` and `ASK` are followed and
    /// the slot map is refreshed after a failover. Nothing connects yet.
    ///
    /// A layer over a cluster store refuses a policy whose quota is keyed apart from its rules
    /// (their keys would be in different slots): see [`Store::keys_share_one_slot`](crate::store::Store::keys_share_one_slot).
    #[cfg(feature = "cluster")]
    pub fn cluster<I>(urls: I) -> Result<Self, StoreError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let target = Target::Cluster(
            urls.into_iter()
                .map(|url| url.as_ref().to_owned())
                .collect(),
        );
        Ok(RedisStore::with_connector(
            target.connector(None)?,
            Some(target),
        ))
    }

    /// A store over a cluster pool you already have; the store takes one connection from it.
    #[cfg(feature = "cluster")]
    pub fn from_cluster_pool(pool: deadpool_redis::cluster::Pool) -> Self {
        RedisStore::with_connector(Connector::ClusterPool(pool), None)
    }

    /// A store over the primary that Redis Sentinel names `master`, asking the sentinels at
    /// `urls` (`redis://10.0.0.1:26379`). After a failover the store's connection breaks (or the
    /// old primary answers `READONLY`) and the next request asks the sentinels again. The primary
    /// is reached with the TLS mode of the sentinel URLs; for a password or database on the
    /// primary, build a `deadpool_redis::sentinel::Pool` and use [`RedisStore::from_sentinel_pool`].
    #[cfg(feature = "sentinel")]
    pub fn sentinel<I>(master: &str, urls: I) -> Result<Self, StoreError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let target = Target::Sentinel {
            master: master.to_owned(),
            urls: urls
                .into_iter()
                .map(|url| url.as_ref().to_owned())
                .collect(),
        };
        Ok(RedisStore::with_connector(
            target.connector(None)?,
            Some(target),
        ))
    }

    /// A store over a Sentinel pool you already have; the store takes one connection from it.
    #[cfg(feature = "sentinel")]
    pub fn from_sentinel_pool(pool: deadpool_redis::sentinel::Pool) -> Self {
        RedisStore::with_connector(Connector::SentinelPool(pool), None)
    }

    /// Rebuilds the store's own client with these TLS settings (a CA of your own, or no
    /// certificate checks at all) for its `rediss://` URLs. A store over your pool takes its TLS
    /// settings from the pool: this is an error there.
    ///
    /// ```no_run
    /// use tower_redis_ratelimit::store::{RedisStore, TlsOptions};
    ///
    /// let store = RedisStore::from_url("rediss://redis.internal:6380/0")?
    ///     .with_tls(TlsOptions::new().ca_file("certs/ca.crt")?)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "tls")]
    pub fn with_tls(self, tls: TlsOptions) -> Result<Self, StoreError> {
        let Some(target) = self.shared.target.clone() else {
            return Err(StoreError::Config(
                "TLS settings of a store over your own pool belong to the pool".to_owned(),
            ));
        };
        let connector = target.connector(Some(&tls))?;
        Ok(RedisStore {
            timeout: self.timeout,
            wait_for_replicas: self.wait_for_replicas,
            ..RedisStore::with_connector(connector, Some(target))
        })
    }

    /// How long a check may take, connecting included, before it is a [`StoreError::Timeout`]
    /// (default 250 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The configured timeout.
    pub fn timeout_duration(&self) -> Duration {
        self.timeout
    }

    /// Counts a check only once `replicas` replicas of its node have its writes: the script call
    /// is followed by `WAIT <replicas> <half the timeout>` on the same connection, in the same
    /// round trip. An admission that too few replicas acknowledge is a
    /// [`StoreError::NotReplicated`], answered by the policy's
    /// [`OnStoreError`](crate::OnStoreError) (fail closed: 503); a refusal stands as it is.
    ///
    /// Replication is asynchronous, so without this the admissions of the last moments before a
    /// primary dies can be lost and admitted again on the promoted replica. With it and a
    /// fail-closed policy, no admission a client saw is lost in a failover. Each check then waits
    /// for a replica's acknowledgement, and `WAIT` holds the shared connection while it waits:
    /// see the README for what it costs. `0` turns it off (the default).
    pub fn wait_for_replicas(mut self, replicas: u32) -> Self {
        self.wait_for_replicas = (replicas > 0).then_some(replicas);
        self
    }
}

impl Target {
    /// The store's own client for this target.
    #[cfg_attr(not(feature = "tls"), allow(unused_variables))]
    pub(super) fn connector(&self, tls: Option<&TlsSettings>) -> Result<Connector, StoreError> {
        let invalid = |error: RedisError| StoreError::Config(error.to_string());
        Ok(match self {
            Target::Node(url) => {
                #[cfg(feature = "tls")]
                if let Some(tls) = tls {
                    return Ok(Connector::Node(tls.node_client(url).map_err(invalid)?));
                }
                Connector::Node(::redis::Client::open(url.as_str()).map_err(invalid)?)
            }
            #[cfg(feature = "cluster")]
            Target::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(StoreError::Config(
                        "a cluster needs at least one node URL".into(),
                    ));
                }
                let router = cluster::ClusterRouter::new(
                    urls,
                    #[cfg(feature = "tls")]
                    tls.cloned(),
                )
                .map_err(invalid)?;
                Connector::Cluster(Arc::new(router))
            }
            #[cfg(feature = "sentinel")]
            Target::Sentinel { master, urls } => {
                if urls.is_empty() {
                    return Err(StoreError::Config(
                        "Sentinel needs at least one sentinel URL".into(),
                    ));
                }
                let infos = urls
                    .iter()
                    .map(|url| ::redis::IntoConnectionInfo::into_connection_info(url.as_str()))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(invalid)?;
                let tls_mode = match infos[0].addr() {
                    ::redis::ConnectionAddr::TcpTls { insecure: true, .. } => {
                        Some(::redis::TlsMode::Insecure)
                    }
                    ::redis::ConnectionAddr::TcpTls { .. } => Some(::redis::TlsMode::Secure),
                    _ => None,
                };
                let mut builder = ::redis::sentinel::SentinelClientBuilder::new(
                    infos.iter().map(|info| info.addr().clone()),
                    master,
                    ::redis::sentinel::SentinelServerType::Master,
                )
                .map_err(invalid)?;
                if let Some(mode) = tls_mode {
                    builder = builder.set_client_to_redis_tls_mode(mode);
                }
                #[cfg(feature = "tls")]
                if let Some(tls) = tls {
                    builder = tls.sentinel_builder(builder);
                }
                Connector::Sentinel(tokio::sync::Mutex::new(builder.build().map_err(invalid)?))
            }
        })
    }
}

#[cfg(feature = "tls")]
pub(super) type TlsSettings = TlsOptions;
#[cfg(not(feature = "tls"))]
pub(super) type TlsSettings = ();
