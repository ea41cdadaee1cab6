//! Where the store's connection comes from and how a script call travels on it: one node, a Redis
//! Cluster or a Sentinel-managed primary, over the user's pool or a client of the store's own.
//!
//! Whatever the topology, the store holds one connection that multiplexes every request: a
//! `MultiplexedConnection` to one node (a Sentinel's primary included), or a `ClusterConnection`
//! that keeps one per node and sends each call to the node of its first key's slot, following
//! `MOVED` and `ASK` and refreshing its slot map after a failover.

use std::time::Duration;

use ::redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisResult, ServerErrorKind, Value};
#[cfg(feature = "cluster")]
use deadpool_redis::redis::aio::ConnectionLike;
use deadpool_redis::redis::aio::MultiplexedConnection;

use super::super::StoreError;

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
    Cluster(::redis::cluster::ClusterClient),
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
                Connection::Cluster(deadpool_redis::cluster::Connection::take(connection))
            }
            #[cfg(feature = "cluster")]
            Connector::Cluster(client) => {
                Connection::Cluster(client.get_async_connection().await.map_err(unavailable)?)
            }
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
    /// A cluster: routed per call by the slot of its first key.
    #[cfg(feature = "cluster")]
    Cluster(::redis::cluster_async::ClusterConnection),
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
        match replicas {
            None => {
                let reply = match self {
                    Connection::Node(connection) => {
                        // The connection's own response timeout: one timer per call.
                        connection.set_response_timeout(timeout);
                        connection.send_packed_command(script).await?
                    }
                    #[cfg(feature = "cluster")]
                    Connection::Cluster(connection) => {
                        within(timeout, connection.req_packed_command(script)).await?
                    }
                };
                Ok((server_error_as_err(reply)?, None))
            }
            Some(replicas) => {
                let mut pipeline = Pipeline::with_capacity(2);
                // The replicas get half the timeout (WAIT 0 would wait for ever): a replica that
                // doesn't acknowledge in time is told apart from a node that doesn't answer.
                let wait_ms = u64::try_from((timeout / 2).as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1);
                pipeline
                    .add_command(script.clone())
                    .add_command(::redis::cmd("WAIT").arg(replicas).arg(wait_ms).to_owned());
                let replies = match self {
                    Connection::Node(connection) => {
                        connection.set_response_timeout(timeout);
                        connection.send_packed_commands(&pipeline, 0, 2).await?
                    }
                    #[cfg(feature = "cluster")]
                    Connection::Cluster(connection) => {
                        within(timeout, connection.req_packed_commands(&pipeline, 0, 2)).await?
                    }
                };
                let mut replies = replies.into_iter();
                let (Some(reply), Some(acknowledged)) = (replies.next(), replies.next()) else {
                    return Err(RedisError::from((
                        ErrorKind::Client,
                        "a pipeline of two commands answered fewer",
                    )));
                };
                let reply = server_error_as_err(reply)?;
                match server_error_as_err(acknowledged)? {
                    Value::Int(count) => Ok((reply, Some(count))),
                    other => Err(RedisError::from((
                        ErrorKind::Client,
                        "WAIT answered something else than a count",
                        format!("{other:?}"),
                    ))),
                }
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
            Connection::Cluster(_) => false,
        }
    }

    /// Whether a call that timed out may have been lost on a connection that no longer answers
    /// (a silently dropped TCP connection): then the next request takes a new one. A cluster
    /// connection replaces its node connections itself.
    pub(super) fn replace_after_timeout(&self) -> bool {
        matches!(self, Connection::Node(_))
    }
}

/// A server's error answer as an `Err`.
fn server_error_as_err(value: Value) -> RedisResult<Value> {
    match value {
        Value::ServerError(error) => Err(error.into()),
        value => Ok(value),
    }
}

#[cfg(feature = "cluster")]
async fn within<T>(
    timeout: Duration,
    call: impl Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no reply within the store timeout",
            )))
        })
}

/// `EVAL <script> …` with the arguments of `EVALSHA <sha> …`: runs the script and leaves it in
/// the node's script cache, in one round trip, on whichever node the call is routed to.
pub(super) fn eval_of(body: &str, evalsha: &Cmd) -> Cmd {
    let mut eval = ::redis::cmd("EVAL");
    eval.arg(body);
    for arg in evalsha.args_iter().skip(2) {
        // The check's command holds plain arguments only.
        if let ::redis::Arg::Simple(bytes) = arg {
            eval.arg(bytes);
        }
    }
    eval
}

/// A failed command as a store error: a timeout is a [`StoreError::Timeout`] like the store's,
/// and an error answer from the script a [`StoreError::Protocol`].
pub(super) fn store_error(error: RedisError, timeout: Duration) -> StoreError {
    if error.is_timeout() {
        StoreError::Timeout(timeout)
    } else if error.kind() == ErrorKind::Server(ServerErrorKind::ResponseError) {
        // A plain `ERR` answer: the script or a command in it failed, which no retry will mend.
        StoreError::Protocol(error.to_string())
    } else {
        StoreError::Unavailable(Box::new(error))
    }
}

pub(super) fn is_no_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}
