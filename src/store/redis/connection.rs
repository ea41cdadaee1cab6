//! Where the store's connection comes from and how a script call travels on it: one node, a Redis
//! Cluster or a Sentinel-managed primary, over the user's pool or a client of the store's own.
//!
//! Whatever the topology, the store holds one connection that multiplexes every request: a
//! `MultiplexedConnection` to one node (a Sentinel's primary included); on a cluster, the store's
//! own [`ClusterRouter`] (one per node, each call sent to the node of its first key's slot) or,
//! over the user's cluster pool, redis-rs's `ClusterConnection`, which does the same through a
//! routing task. Both follow `MOVED` and `ASK` and refresh their slot map after a failover.

use std::time::Duration;

use ::redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisResult, ServerErrorKind, Value};
#[cfg(feature = "cluster")]
use deadpool_redis::redis::aio::ConnectionLike;
use deadpool_redis::redis::aio::MultiplexedConnection;

use super::super::StoreError;
#[cfg(feature = "cluster")]
use super::cluster::ClusterRouter;

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

/// Sends `script` on a node's connection within `timeout`: alone, or in one pipeline after
/// `ASKING` (`asking`: a cluster slot being imported by this node) and before `WAIT replicas`
/// (so its writes' acknowledgements are counted on the same node). Returns the script's reply and,
/// with `replicas`, the count of replicas that acknowledged.
pub(super) async fn call(
    connection: &mut MultiplexedConnection,
    script: &Cmd,
    replicas: Option<u32>,
    asking: bool,
    timeout: Duration,
) -> RedisResult<(Value, Option<i64>)> {
    // The connection's own response timeout: one timer per call.
    connection.set_response_timeout(timeout);
    if replicas.is_none() && !asking {
        let reply = connection.send_packed_command(script).await?;
        return Ok((server_error_as_err(reply)?, None));
    }
    let (pipeline, count) = pipeline(script, replicas, asking, timeout);
    // ASKING's own OK is skipped.
    let skip = usize::from(asking);
    replies_of(
        connection
            .send_packed_commands(&pipeline, skip, count)
            .await?,
    )
}

/// The pipeline that carries `script` with `ASKING` or `WAIT`, and how many replies matter: the
/// script's, and `WAIT`'s with `replicas`.
fn pipeline(
    script: &Cmd,
    replicas: Option<u32>,
    asking: bool,
    timeout: Duration,
) -> (Pipeline, usize) {
    let mut pipeline = Pipeline::with_capacity(3);
    if asking {
        pipeline.add_command(::redis::cmd("ASKING"));
    }
    pipeline.add_command(script.clone());
    let Some(replicas) = replicas else {
        return (pipeline, 1);
    };
    // The replicas get half the timeout (WAIT 0 would wait for ever): a replica that doesn't
    // acknowledge in time is told apart from a node that doesn't answer.
    let wait_ms = u64::try_from((timeout / 2).as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    pipeline.add_command(::redis::cmd("WAIT").arg(replicas).arg(wait_ms).to_owned());
    (pipeline, 2)
}

/// The script's reply and `WAIT`'s count, if sent, from a call's replies.
fn replies_of(replies: Vec<Value>) -> RedisResult<(Value, Option<i64>)> {
    let mut replies = replies.into_iter();
    let reply = replies
        .next()
        .ok_or_else(|| RedisError::from((ErrorKind::Parse, "a script call answered nothing")))?;
    let reply = server_error_as_err(reply)?;
    match replies.next().map(server_error_as_err).transpose()? {
        None => Ok((reply, None)),
        Some(Value::Int(count)) => Ok((reply, Some(count))),
        Some(other) => Err(RedisError::from((
            ErrorKind::Parse,
            "WAIT answered something else than a count",
            format!("{other:?}"),
        ))),
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

/// `EVAL <script> …` with the arguments of `EVALSHA <sha> …` (or `FCALL <function> …`): runs the
/// script and leaves it in the node's script cache, in one round trip, on whichever node the call
/// is routed to.
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

/// A failed command as a store error. A timeout is a [`StoreError::Timeout`] like the store's.
/// Redis's answers that no retry mends are faults, in Redis's words ([`fault_of`]): `ERR` (the
/// script or a command in it failed), `WRONGTYPE` and `OOM`; a reply that can't be parsed is a
/// [`StoreError::Protocol`]. The rest (a connection lost or refused, a node loading, read-only or
/// busy) is the store being unavailable, which passes.
pub(super) fn store_error(error: RedisError, timeout: Duration) -> StoreError {
    if error.is_timeout() {
        return StoreError::Timeout(timeout);
    }
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::ResponseError) => fault_of(redis_words(&error)),
        ErrorKind::Extension if matches!(error.code(), Some("WRONGTYPE" | "OOM")) => {
            fault_of(redis_words(&error))
        }
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => {
            StoreError::Protocol(error.to_string())
        }
        _ => StoreError::Unavailable(Box::new(error)),
    }
}

/// An error Redis answered a script with, or that the script raised (`words`, as Redis wrote
/// them), as the fault it is: `WRONGTYPE …` a key of the wrong type, `OOM …` a Redis out of
/// memory, anything else the script failing.
pub(super) fn fault_of(words: String) -> StoreError {
    // On one line: Redis 6.2 ends some of its errors with the protocol's CRLF (`-OOM …\r\n`), and
    // a log line must not break.
    let words = if words.contains(['\r', '\n']) {
        words.trim_end().replace(['\r', '\n'], " ")
    } else {
        words
    };
    match code_of(&words) {
        "WRONGTYPE" => StoreError::WrongType(words),
        "OOM" => StoreError::OutOfMemory(words),
        _ => StoreError::Script(words),
    }
}

/// Redis's error code in `words`: its first word, past the places Redis before 7.0 puts before an
/// error raised in a script (`@user_script:65: `, `@user_script: 65: `, `=[C]: -1: `, once or
/// twice) and the `-` of the protocol it may keep (`-OOM command not allowed …`).
fn code_of(words: &str) -> &str {
    let mut rest = words.trim_start();
    while rest.starts_with('@') || rest.starts_with('=') {
        // `<chunk>:<line>: `: the line may be spaced from its colon, and negative.
        let Some((_chunk, after)) = rest.split_once(':') else {
            break;
        };
        let Some((_line, after)) = after.split_once(':') else {
            break;
        };
        rest = after.trim_start();
    }
    rest.trim_start_matches('-')
        .split_whitespace()
        .next()
        .unwrap_or_default()
}

/// A server's error as Redis wrote it, `<CODE> <detail>` (redis-rs displays it its own way).
fn redis_words(error: &RedisError) -> String {
    match (error.code(), error.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        (Some(code), None) => code.to_owned(),
        _ => error.to_string(),
    }
}

pub(super) fn is_no_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error of Redis's error answer `line` (`-<line>\r\n` on the wire).
    fn answered(line: &str) -> RedisError {
        match ::redis::parse_redis_value(format!("-{line}\r\n").as_bytes()) {
            Ok(Value::ServerError(error)) => error.into(),
            other => panic!("not an error answer: {other:?}"),
        }
    }

    #[test]
    fn redis_answers_that_no_retry_mends_are_faults_in_redis_words() {
        let timeout = Duration::from_millis(250);
        let wrong = "WRONGTYPE Operation against a key holding the wrong kind of value";
        let oom = "OOM command not allowed when used memory > 'maxmemory'.";
        let script = "ERR user_function:2: boom script: f, on @user_function:2.";
        assert!(matches!(store_error(answered(wrong), timeout),
            StoreError::WrongType(words) if words == wrong));
        assert!(matches!(store_error(answered(oom), timeout),
            StoreError::OutOfMemory(words) if words == oom));
        assert!(matches!(store_error(answered(script), timeout),
            StoreError::Script(words) if words == script));
        // What passes: a node loading or read-only, a dropped connection.
        for line in [
            "LOADING Redis is loading the dataset in memory",
            "READONLY You can't write",
        ] {
            let error = store_error(answered(line), timeout);
            assert!(
                matches!(error, StoreError::Unavailable(_)),
                "{line}: {error:?}"
            );
        }
        let dropped = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(
            store_error(dropped, timeout),
            StoreError::Unavailable(_)
        ));
        let late = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(matches!(store_error(late, timeout), StoreError::Timeout(t) if t == timeout));
        // A reply that can't be read.
        let unreadable = replies_of(Vec::new()).unwrap_err();
        assert!(matches!(
            store_error(unreadable, timeout),
            StoreError::Protocol(_)
        ));
        let wait = replies_of(vec![Value::Int(1), Value::Nil]).unwrap_err();
        assert!(matches!(
            store_error(wait, timeout),
            StoreError::Protocol(_)
        ));
    }

    #[test]
    fn a_checks_own_error_is_told_by_its_code() {
        assert_eq!(fault_of("WRONGTYPE Operation".into()).kind(), "wrong_type");
        // Redis 6.2 names where in the script the error was raised, before Redis's words.
        let oom = "@user_script:65: @user_script: 65: OOM command not allowed when used memory";
        assert_eq!(fault_of(oom.into()).kind(), "out_of_memory");
        let wrong = "@user_script: 12: WRONGTYPE Operation against a key";
        assert_eq!(fault_of(wrong.into()).kind(), "wrong_type");
        assert_eq!(fault_of("@user_script".into()).kind(), "script");
        let raised = "@user_script: 40: -OOM command not allowed when used memory > 'maxmemory'.";
        assert_eq!(fault_of(raised.into()).kind(), "out_of_memory");
        let direct = "=[C]: -1: -OOM command not allowed when used memory > 'maxmemory'.\r\n";
        let fault = fault_of(direct.into());
        assert_eq!(fault.kind(), "out_of_memory");
        assert!(!fault.to_string().contains(['\r', '\n']), "{fault}");
        assert_eq!(
            fault_of("OOM command not allowed".into()).kind(),
            "out_of_memory"
        );
        assert_eq!(
            fault_of("user_script:12: attempt to compare nil".into()).kind(),
            "script"
        );
        assert_eq!(
            fault_of("ERR value is not an integer".into()).kind(),
            "script"
        );
    }
}
