//! How a script call travels on one connection: alone, or in a pipeline with `ASKING` (a slot in
//! migration) or `WAIT` (replicas to acknowledge), within the store's timeout; and `EVAL` in place
//! of an `EVALSHA` the node's script cache lost.

use std::time::Duration;

use ::redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisResult, Value};
use deadpool_redis::redis::aio::MultiplexedConnection;

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
pub(super) fn pipeline(
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
pub(super) fn replies_of(replies: Vec<Value>) -> RedisResult<(Value, Option<i64>)> {
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
pub(super) fn server_error_as_err(value: Value) -> RedisResult<Value> {
    match value {
        Value::ServerError(error) => Err(error.into()),
        value => Ok(value),
    }
}

/// Sends `script` on a node's connection within `timeout`: alone, or in one pipeline after
/// `ASKING` (`asking`: a cluster slot being imported by this node) and before `WAIT replicas`
/// (so its writes' acknowledgements are counted on the same node). Returns the script's reply and,
#[cfg(feature = "cluster")]
pub(super) async fn within<T>(
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
