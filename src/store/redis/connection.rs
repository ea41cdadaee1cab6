//! Where the store's connection comes from and how a script call travels on it: one node, a Redis
//! Cluster or a Sentinel-managed primary, over the user's pool or a client of the store's own.
//!
//! Whatever the topology, the store holds one connection that multiplexes every request: a
//! `MultiplexedConnection` to one node (a Sentinel's primary included); on a cluster, the store's
//! own [`ClusterRouter`] (one per node, each call sent to the node of its first key's slot) or,
//! over the user's cluster pool, redis-rs's `ClusterConnection`, which does the same through a
//! routing task. Both follow `MOVED` and `ASK` and refresh their slot map after a failover.

use std::time::Duration;

use ::redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};
#[cfg(feature = "cluster")]
use deadpool_redis::redis::aio::ConnectionLike;
use deadpool_redis::redis::aio::MultiplexedConnection;

#[cfg(feature = "cluster")]
use super::cluster::ClusterRouter;
use super::wire::call;
#[cfg(feature = "cluster")]
use super::wire::{pipeline, replies_of, server_error_as_err, within};
use crate::store::StoreError;

/// What the store takes a new connection from.
pub(super) enum Connector {
    /// The user's pool of single-node connections.
    Pool(deadpool_redis::Pool),
    /// A client of the store's own, for one node.
    Node(::redis::Client),
    /// The user's pool of cluster connections.
    #[cfg(feature = "cluster")]
    ClusterPool(deadpool_redis::cluster::Pool),
    /// A cluster client of the store's own.
    #[cfg(feature = "cluster")]
    Cluster(std::sync::Arc<ClusterRouter>),
    /// The user's pool of connections to a Sentinel-managed primary.
    #[cfg(feature = "sentinel")]
    SentinelPool(deadpool_redis::sentinel::Pool),
    /// A Sentinel client of the store's own: asks the sentinels for the primary at each connect.
    #[cfg(feature = "sentinel")]
    Sentinel(tokio::sync::Mutex<::redis::sentinel::SentinelClient>),
}

impl Connector {
    /// Whether every key of one call must be in one hash slot.
    pub(super) fn is_cluster(&self) -> bool {
        match self {
            #[cfg(feature = "cluster")]
            Connector::ClusterPool(_) | Connector::Cluster(_) => true,
            _ => false,
        }
    }

    /// Whether the connection goes to the primary that Redis Sentinel names.
    pub(super) fn is_sentinel(&self) -> bool {
        match self {
            #[cfg(feature = "sentinel")]
            Connector::SentinelPool(_) | Connector::Sentinel(_) => true,
            _ => false,
        }
    }

    /// A new connection. Connecting runs under the caller's deadline.
    pub(super) async fn connect(&self) -> Result<Connection, StoreError> {
        let unavailable = |error: RedisError| StoreError::Unavailable(Box::new(error));
        let pool_error =
            |error: deadpool_redis::PoolError| StoreError::Unavailable(Box::new(error));
        Ok(match self {
            Connector::Pool(pool) => Connection::Node(deadpool_redis::Connection::take(
                pool.get().await.map_err(pool_error)?,
            )),
            Connector::Node(client) => Connection::Node(
                client
                    .get_multiplexed_async_connection()
                    .await
                    .map_err(unavailable)?,
            ),
            #[cfg(feature = "cluster")]
            Connector::ClusterPool(pool) => {
                let connection = pool.get().await.map_err(pool_error)?;
                Connection::ClusterPool(deadpool_redis::cluster::Connection::take(connection))
            }
            // The router connects to each node when a request first needs it.
            #[cfg(feature = "cluster")]
            Connector::Cluster(router) => Connection::Cluster(router.clone()),
            #[cfg(feature = "sentinel")]
            Connector::SentinelPool(pool) => {
                let connection = pool.get().await.map_err(pool_error)?;
                Connection::Node(deadpool_redis::sentinel::Connection::take(connection))
            }
            #[cfg(feature = "sentinel")]
            Connector::Sentinel(client) => Connection::Node(
                client
                    .lock()
                    .await
                    .get_async_connection()
                    .await
                    .map_err(unavailable)?,
            ),
        })
    }
}

/// The connection every request of a store shares (a clone of it, which shares its pipeline).
#[derive(Clone)]
pub(super) enum Connection {
    /// One node: a plain Redis, or the primary a Sentinel named.
    Node(MultiplexedConnection),
    /// A cluster, through the store's own router: per call by the slot of its first key.
    #[cfg(feature = "cluster")]
    Cluster(std::sync::Arc<ClusterRouter>),
    /// A cluster, through the user's pool: redis-rs routes it the same way.
    #[cfg(feature = "cluster")]
    ClusterPool(::redis::cluster_async::ClusterConnection),
}

impl Connection {
    /// Sends `script` and returns its reply within `timeout`; with `replicas`, sends `WAIT` right
    /// after it on the same connection (so to the same node) and returns how many replicas
    /// acknowledged the script's writes too.
    pub(super) async fn send(
        &mut self,
        script: &Cmd,
        replicas: Option<u32>,
        timeout: Duration,
    ) -> RedisResult<(Value, Option<i64>)> {
        match self {
            Connection::Node(connection) => {
                call(connection, script, replicas, false, timeout).await
            }
            #[cfg(feature = "cluster")]
            Connection::Cluster(router) => router.send(script, replicas, timeout).await,
            #[cfg(feature = "cluster")]
            Connection::ClusterPool(connection) => {
                if replicas.is_none() {
                    let reply = within(timeout, connection.req_packed_command(script)).await?;
                    return Ok((server_error_as_err(reply)?, None));
                }
                let (pipeline, count) = pipeline(script, replicas, false, timeout);
                let call = connection.req_packed_commands(&pipeline, 0, count);
                replies_of(within(timeout, call).await?)
            }
        }
    }

    /// Sends `command`, which names no key (`INFO`, `FUNCTION LOAD`), to the node (on a
    /// cluster, to any node that answers) within `timeout`.
    pub(super) async fn query(&mut self, command: &Cmd, timeout: Duration) -> RedisResult<Value> {
        match self {
            Connection::Node(connection) => {
                Ok(call(connection, command, None, false, timeout).await?.0)
            }
            #[cfg(feature = "cluster")]
            Connection::Cluster(router) => router.query_any(command, timeout).await,
            #[cfg(feature = "cluster")]
            Connection::ClusterPool(connection) => {
                let reply = within(timeout, connection.req_packed_command(command)).await?;
                server_error_as_err(reply)
            }
        }
    }

    /// Whether a failed call means this connection should be replaced: a broken connection to a
    /// node, or a node that is no longer the primary (`READONLY` after a Sentinel failover). A
    /// cluster connection mends itself (reconnects, refreshes its slots), and dropping it would
    /// disturb the calls to healthy nodes.
    pub(super) fn is_broken_by(&self, error: &RedisError) -> bool {
        match self {
            Connection::Node(_) => {
                error.is_io_error()
                    || error.is_connection_dropped()
                    || error.is_connection_refusal()
                    || error.is_unrecoverable_error()
                    || error.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
            }
            #[cfg(feature = "cluster")]
            Connection::Cluster(_) | Connection::ClusterPool(_) => false,
        }
    }

    /// Whether a call that timed out may have been lost on a connection that no longer answers
    /// (a silently dropped TCP connection): then the next request takes a new one. A cluster
    /// connection replaces its node connections itself.
    pub(super) fn replace_after_timeout(&self) -> bool {
        matches!(self, Connection::Node(_))
    }
}
