//! The Redis store: many app instances share one limit.
//!
//! Every rule of a request goes to one `EVALSHA` of one script from `lua/`, which reads the time
//! with Redis `TIME`, checks every rule, and records the request in all of them only if all admit
//! it, setting each key's expiry in the same call. So a request costs one round trip whatever the
//! number of rules, app servers' clocks don't matter, and no key outlives its window.
//!
//! Topologies: one node, a Redis Cluster (feature `cluster`: the call goes to the node of the
//! identity's slot, every key of a check sharing one hash tag) or a Sentinel-managed primary
//! (feature `sentinel`), each over `rediss://` with feature `tls`.
//!
//! Connections: the store takes one connection (from the user's pool, or its own client) and shares
//! it, multiplexed, between requests. It takes a new one only when that connection fails or a
//! request times out, so no request pays for a pool's per-checkout health check (a `PING`, a
//! second round trip).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ::redis::{Cmd, RedisError, Script, Value};
use tokio::time::Instant;

use self::command::{decision_from, evalsha_command, rule_limits};
use self::connection::{Connection, Connector, eval_of, is_no_script, store_error};
use super::{CheckFuture, CheckRequest, Store, StoreError};
use crate::policy::Algorithm;

#[cfg(feature = "cluster")]
mod cluster;
mod command;
mod connection;
#[cfg(feature = "tls")]
mod tls;

#[cfg(feature = "tls")]
pub use self::tls::TlsOptions;

/// How long a check may take by default before it counts as a store failure.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// One algorithm's script: the shared head (arguments, penalty block, duplicate guard), the
/// algorithm's part, the shared tail (check all, record in all or none, reply).
macro_rules! script {
    ($algorithm:literal) => {
        concat!(
            include_str!("../../../lua/head.lua"),
            include_str!(concat!("../../../lua/", $algorithm, ".lua")),
            include_str!("../../../lua/tail.lua")
        )
    };
}

/// A [`Store`] in Redis. Cheap to clone; clones share the connection.
///
/// ```no_run
/// use tower_redis_ratelimit::{Policy, RateLimitLayer, Rule};
/// use tower_redis_ratelimit::store::RedisStore;
///
/// let store = RedisStore::from_url("redis://127.0.0.1:6379/0")?;
/// let policy = Policy::builder("api").rule(Rule::per_minute(20)).build()?;
/// let layer = RateLimitLayer::new(policy, store);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct RedisStore {
    shared: Arc<Shared>,
    timeout: Duration,
    /// Replicas that must acknowledge a check's writes before it counts (`WAIT`), if any.
    wait_for_replicas: Option<u32>,
}

struct Shared {
    connector: Connector,
    /// What the store's own client was built for, so TLS settings can rebuild it.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    target: Option<Target>,
    /// The shared connection; `None` until the first request and after a failure.
    connection: Mutex<Option<Connection>>,
    /// Held while a new connection is fetched, so a reconnect storm asks the pool once.
    reconnecting: tokio::sync::Mutex<()>,
    fixed_window: Script,
    sliding_log: Script,
    sliding_counter: Script,
    token_bucket: Script,
}

/// What a store of its own connects to, kept so [`RedisStore::with_tls`] can rebuild its client.
#[derive(Debug, Clone)]
enum Target {
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
    fn with_connector(connector: Connector, target: Option<Target>) -> Self {
        RedisStore {
            shared: Arc::new(Shared {
                connector,
                target,
                connection: Mutex::new(None),
                reconnecting: tokio::sync::Mutex::new(()),
                fixed_window: Script::new(script!("fixed_window")),
                sliding_log: Script::new(script!("sliding_log")),
                sliding_counter: Script::new(script!("sliding_counter")),
                token_bucket: Script::new(script!("token_bucket")),
            }),
            timeout: DEFAULT_TIMEOUT,
            wait_for_replicas: None,
        }
    }

    /// A store over `pool` (one Redis node), with the default timeout of 250 ms.
    pub fn new(pool: deadpool_redis::Pool) -> Self {
        RedisStore::with_connector(Connector::Pool(pool), None)
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
    /// (their keys would be in different slots): see [`Store::keys_share_one_slot`].
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
    fn connector(&self, tls: Option<&TlsSettings>) -> Result<Connector, StoreError> {
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
type TlsSettings = TlsOptions;
#[cfg(not(feature = "tls"))]
type TlsSettings = ();

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("timeout", &self.timeout)
            .field("wait_for_replicas", &self.wait_for_replicas)
            .field("cluster", &self.shared.connector.is_cluster())
            .finish_non_exhaustive()
    }
}

impl Store for RedisStore {
    fn check(&self, request: &CheckRequest<'_>) -> CheckFuture {
        if self.shared.connector.is_cluster()
            && let Some(quota) = request.quota
            && quota.identity != request.identity
        {
            // Layers refuse such policies when they are built; a hand-made request gets this
            // rather than Redis's CROSSSLOT.
            return CheckFuture::ready(Err(StoreError::Config(format!(
                "on Redis Cluster a quota must be keyed like its rules (one hash slot): \
                 {:?} and {:?} differ",
                request.identity, quota.identity
            ))));
        }
        // Everything that needs the request is done here, before the future: the future then owns
        // one packed command and a few words, not the request's borrows.
        let algorithm = request.algorithm;
        let command = evalsha_command(self.shared.script(algorithm).get_hash(), request);
        let limits = rule_limits(request);
        let shared = self.shared.clone();
        let (timeout, replicas) = (self.timeout, self.wait_for_replicas);
        CheckFuture::from_future(async move {
            shared
                .evaluate(algorithm, &command, replicas, timeout)
                .await
                .and_then(|reply| decision_from(&reply, &limits))
        })
    }

    fn keys_share_one_slot(&self) -> bool {
        self.shared.connector.is_cluster()
    }

    fn is_remote(&self) -> bool {
        true
    }
}

impl Shared {
    fn script(&self, algorithm: Algorithm) -> &Script {
        match algorithm {
            Algorithm::FixedWindow => &self.fixed_window,
            Algorithm::SlidingLog => &self.sliding_log,
            Algorithm::SlidingCounter => &self.sliding_counter,
            Algorithm::TokenBucket => &self.token_bucket,
        }
    }

    fn script_body(&self, algorithm: Algorithm) -> &'static str {
        match algorithm {
            Algorithm::FixedWindow => script!("fixed_window"),
            Algorithm::SlidingLog => script!("sliding_log"),
            Algorithm::SlidingCounter => script!("sliding_counter"),
            Algorithm::TokenBucket => script!("token_bucket"),
        }
    }

    /// Runs the check's `EVALSHA` (and its `WAIT`) and returns the script's reply, all within
    /// `timeout`.
    ///
    /// The common case, a connection at hand and the script cached in Redis, is one send bounded
    /// by the connection's own response timeout, so a check arms one timer. Connecting and sending
    /// the script itself after NOSCRIPT are rare: they run boxed, under a deadline for the whole
    /// check.
    async fn evaluate(
        &self,
        algorithm: Algorithm,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<Vec<Value>, StoreError> {
        let started = Instant::now();
        let reply = match self.cached() {
            Some(mut connection) => {
                match self.send(&mut connection, command, replicas, timeout).await {
                    Err(error) if is_no_script(&error) => Err(Missing::Script),
                    reply => Ok(reply),
                }
            }
            None => Err(Missing::Connection),
        };
        let reply = match reply {
            Ok(reply) => reply.map_err(|error| store_error(error, timeout)),
            Err(missing) => {
                let slow = self.connect_and_send(missing, algorithm, command, replicas, timeout);
                match tokio::time::timeout_at(started + timeout, Box::pin(slow)).await {
                    Ok(reply) => reply,
                    Err(_elapsed) => {
                        // A connection that stopped answering without an error (a silently dropped
                        // TCP connection) would time out forever: the next request takes a new one.
                        self.forget_connection_after_timeout();
                        return Err(StoreError::Timeout(timeout));
                    }
                }
            }
        };
        let (reply, acknowledged) = reply?;
        // Only an admission must survive a failover: a refusal recorded nothing to lose (but a
        // penalty block, which a lost write only shortens).
        let admitted =
            matches!(&reply, Value::Array(items) if items.first() == Some(&Value::Int(1)));
        if let (Some(wanted), Some(acknowledged)) = (replicas, acknowledged)
            && acknowledged < i64::from(wanted)
            && admitted
        {
            return Err(StoreError::NotReplicated {
                wanted,
                acknowledged: u32::try_from(acknowledged).unwrap_or(0),
            });
        }
        match reply {
            Value::Array(items) => Ok(items),
            other => Err(StoreError::Protocol(format!(
                "unexpected script reply {other:?}"
            ))),
        }
    }

    /// The rare path: takes a connection (a new one if needed) and sends `command`; when Redis
    /// lacks the script (a restart, `SCRIPT FLUSH`, a promoted replica, a new cluster node:
    /// NOSCRIPT) it sends the script itself with `EVAL`, which also caches it on that node.
    async fn connect_and_send(
        &self,
        missing: Missing,
        algorithm: Algorithm,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), StoreError> {
        let mut connection = self.connection().await?;
        if let Missing::Connection = missing {
            match self.send(&mut connection, command, replicas, timeout).await {
                Err(error) if is_no_script(&error) => {}
                reply => return reply.map_err(|error| store_error(error, timeout)),
            }
        }
        let eval = eval_of(self.script_body(algorithm), command);
        self.send(&mut connection, &eval, replicas, timeout)
            .await
            .map_err(|error| store_error(error, timeout))
    }

    /// Sends `command`; a connection that the failure shows to be broken is dropped so the next
    /// request takes a new one.
    async fn send(
        &self,
        connection: &mut Connection,
        command: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> Result<(Value, Option<i64>), RedisError> {
        let reply = connection.send(command, replicas, timeout).await;
        if let Err(error) = &reply
            && connection.is_broken_by(error)
        {
            self.forget_connection();
        }
        reply
    }

    async fn connection(&self) -> Result<Connection, StoreError> {
        let _only_one = self.reconnecting.lock().await;
        // Another request may have connected while this one waited for the lock.
        if let Some(connection) = self.cached() {
            return Ok(connection);
        }
        let connection = self.connector.connect().await?;
        *self.lock_connection() = Some(connection.clone());
        Ok(connection)
    }

    fn cached(&self) -> Option<Connection> {
        self.lock_connection().clone()
    }

    fn forget_connection(&self) {
        *self.lock_connection() = None;
    }

    fn forget_connection_after_timeout(&self) {
        let mut connection = self.lock_connection();
        if connection
            .as_ref()
            .is_none_or(Connection::replace_after_timeout)
        {
            *connection = None;
        }
    }

    fn lock_connection(&self) -> std::sync::MutexGuard<'_, Option<Connection>> {
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the fast path lacked.
enum Missing {
    /// No connection yet, or the last one failed.
    Connection,
    /// Redis answered NOSCRIPT.
    Script,
}
